# Installation and packaging: the shared library (versioned SONAME and its symlinks), the public
# header, a CMake package (find_package(moejit CONFIG) -> moejit::moejit) and a pkg-config file.
#
# Only `moejit` is installed. `moejit_core` is an implementation detail linked into it; consumers
# need nothing but the header and -lmoejit: the library needs only the C and C++ runtimes (spdlog
# and fmt are header-only), and NVRTC and libcuda are dlopen'd at run time.
#
# Tools install themselves from their own CMakeLists.txt, next to their add_executable():
#   install(TARGETS moejit-precompile RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT tools)
# This file only gives them an install RPATH that finds the installed libmoejit.so.0 (it is
# included after add_subdirectory(tools), so the targets exist here).
#
# Every installed file is relocatable: `cmake --install build --prefix /anywhere` yields a tree
# whose CMake package and pkg-config file compute their prefix from their own location.

include(CMakePackageConfigHelpers)

set(MOEJIT_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/moejit"
    CACHE STRING "Where moejitConfig.cmake is installed (relative to the prefix)")
set(MOEJIT_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_LIBDIR}/pkgconfig"
    CACHE STRING "Where moejit.pc is installed (relative to the prefix)")

install(TARGETS moejit EXPORT moejitTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT development
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development)
install(FILES ${PROJECT_SOURCE_DIR}/include/moejit/moejit.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/moejit COMPONENT development)

# ---- CMake package -------------------------------------------------------------------------------
install(EXPORT moejitTargets NAMESPACE moejit:: FILE moejitTargets.cmake
        DESTINATION ${MOEJIT_INSTALL_CMAKEDIR} COMPONENT development)
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/moejitConfig.cmake.in
  ${PROJECT_BINARY_DIR}/package/moejitConfig.cmake
  INSTALL_DESTINATION ${MOEJIT_INSTALL_CMAKEDIR}
  PATH_VARS CMAKE_INSTALL_INCLUDEDIR)
# The SONAME carries only the major version (libmoejit.so.0), and argument structs are versioned by
# their size, so any library of the same major version serves a consumer built against an older
# minor one.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/package/moejitConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/package/moejitConfig.cmake
              ${PROJECT_BINARY_DIR}/package/moejitConfigVersion.cmake
        DESTINATION ${MOEJIT_INSTALL_CMAKEDIR} COMPONENT development)

# ---- pkg-config ----------------------------------------------------------------------------------
# prefix is derived from ${pcfiledir} (the directory holding moejit.pc), so the file stays correct
# wherever the tree is installed or moved. Absolute install dirs cannot be relocated and are used
# as they are.
function(moejit_pc_path out dir)
  if(IS_ABSOLUTE "${dir}")
    set(${out} "${dir}" PARENT_SCOPE)
  else()
    set(${out} "\${prefix}/${dir}" PARENT_SCOPE)
  endif()
endfunction()
if(IS_ABSOLUTE "${MOEJIT_INSTALL_PKGCONFIGDIR}")
  set(MOEJIT_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  # Walk up from <prefix>/<pkgconfigdir> to <prefix>, computed on a dummy root.
  file(RELATIVE_PATH MOEJIT_PC_UP "/root/${MOEJIT_INSTALL_PKGCONFIGDIR}" "/root")
  string(REGEX REPLACE "/$" "" MOEJIT_PC_UP "${MOEJIT_PC_UP}")
  set(MOEJIT_PC_PREFIX "\${pcfiledir}/${MOEJIT_PC_UP}")
endif()
moejit_pc_path(MOEJIT_PC_LIBDIR "${CMAKE_INSTALL_LIBDIR}")
moejit_pc_path(MOEJIT_PC_INCLUDEDIR "${CMAKE_INSTALL_INCLUDEDIR}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/moejit.pc.in ${PROJECT_BINARY_DIR}/package/moejit.pc
               @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/package/moejit.pc
        DESTINATION ${MOEJIT_INSTALL_PKGCONFIGDIR} COMPONENT development)

# ---- tools ---------------------------------------------------------------------------------------
# Installed tools that link the shared library find it in ../lib (whatever the prefix), unless the
# tool chose its own RPATH.
file(RELATIVE_PATH MOEJIT_BIN_TO_LIB "/root/${CMAKE_INSTALL_BINDIR}" "/root/${CMAKE_INSTALL_LIBDIR}")
foreach(tool moejit-precompile moejit-bench moejit-demo)
  if(TARGET ${tool})
    get_target_property(tool_rpath ${tool} INSTALL_RPATH)
    if(NOT tool_rpath)
      set_target_properties(${tool} PROPERTIES
        INSTALL_RPATH "$ORIGIN/${MOEJIT_BIN_TO_LIB}" INSTALL_RPATH_USE_LINK_PATH ON)
    endif()
  endif()
endforeach()
