# The Python wheel (pyproject.toml; scikit-build-core builds this project with SKBUILD set and
# installs component "python" into the wheel's site-packages root). scikit-build-core copies the
# package's Python files from python/moejit itself; this adds what CMake builds:
#   moejit/libmoejit.so.0                  the library, one file (a wheel stores no symlinks),
#                                          found there by moejit._capi
#   moejit/moejit-precompile               the tool, run by the console command of that name
#   moejit/precompile-configs/*.json       its example model configs
# Self-contained: spdlog and fmt are header-only, libmoejit_core is linked in, and NVRTC and
# libcuda are loaded with dlopen, so the library needs only the C and C++ runtimes.
if(NOT TARGET moejit-precompile)
  message(FATAL_ERROR "the wheel holds moejit-precompile, which needs CLI11 and nlohmann-json "
                      "(Debian: libcli11-dev nlohmann-json3-dev; tools/setup-deps.sh installs them)")
endif()
install(FILES $<TARGET_FILE:moejit> DESTINATION moejit RENAME libmoejit.so.0
        COMPONENT python)
# Stripped like the installed targets (install(FILES) is not): 16% smaller; only the C API's symbols
# are dynamic ones, so nothing a caller needs is lost.
if(CMAKE_STRIP)
  install(CODE "execute_process(COMMAND \"${CMAKE_STRIP}\" --strip-unneeded
                \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/moejit/libmoejit.so.0\" COMMAND_ERROR_IS_FATAL ANY)"
          COMPONENT python)
endif()
install(TARGETS moejit-precompile RUNTIME DESTINATION moejit COMPONENT python)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/tools/precompile/configs/
        DESTINATION moejit/precompile-configs COMPONENT python FILES_MATCHING PATTERN "*.json")
