# One step of the install test (see CMakeLists.txt), run as `cmake -DSTEP=<step> ... -P`.
cmake_minimum_required(VERSION 3.24)
string(REPLACE "," ";" TOOLS "${TOOLS}")  # comma-separated on the command line (CMakeLists.txt)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "command failed (${rc}): ${cmd}\n${out}\n${err}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

function(expect_file path)
  if(NOT EXISTS ${path} OR IS_DIRECTORY ${path})
    message(FATAL_ERROR "not installed: ${path}")
  endif()
endfunction()

# A symlink named `link` pointing at the file name `target` (relative, so the tree can move).
function(expect_symlink link target)
  if(NOT IS_SYMLINK ${link})
    message(FATAL_ERROR "expected a symlink: ${link}")
  endif()
  file(READ_SYMLINK ${link} actual)
  if(NOT actual STREQUAL target)
    message(FATAL_ERROR "${link} -> ${actual}, expected -> ${target}")
  endif()
endfunction()

# `readelf -d` output of a binary that must not depend on libcuda.so.1: the driver is dlopen'd, so
# the library and the tools load on machines without a GPU driver (an image build warming the
# cache with moejit-precompile).
function(expect_no_libcuda file dynamic)
  if(dynamic MATCHES "NEEDED[^\n]*\\[libcuda\\.so")
    message(FATAL_ERROR "${file} depends on libcuda:\n${dynamic}")
  endif()
endfunction()

function(require_pkg_config)
  find_program(pc NAMES ${PKG_CONFIG} pkg-config pkgconf)
  if(NOT pc)
    message(FATAL_ERROR "pkg-config not found (Debian: apt-get install pkg-config)")
  endif()
  set(pc ${pc} PARENT_SCOPE)
endfunction()

# `pkg-config <args> moejit` with moejit.pc taken only from <prefix>/<pkgconfigdir>.
function(pkg_config out_var prefix)
  require_pkg_config()
  set(ENV{PKG_CONFIG_PATH} ${prefix}/${PKGCONFIGDIR})
  set(ENV{PKG_CONFIG_LIBDIR} ${prefix}/${PKGCONFIGDIR})
  run(${pc} ${ARGN} moejit)
  string(STRIP "${run_output}" value)
  set(${out_var} "${value}" PARENT_SCOPE)
endfunction()

function(same_dir a b what)
  file(REAL_PATH "${a}" ra)
  file(REAL_PATH "${b}" rb)
  if(NOT ra STREQUAL rb)
    message(FATAL_ERROR "${what}: ${a} is not ${b}")
  endif()
endfunction()

function(configure_and_build lang)
  set(bin ${SCRATCH}/example-${lang})
  file(REMOVE_RECURSE ${bin})
  # Only the scratch prefix may provide moejit: no package registry, no build tree.
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/${lang} -B ${bin} -G ${GENERATOR}
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=${C_COMPILER}
      -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${PREFIX}
      -DCUDAToolkit_ROOT=${CUDA_ROOT} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF ${ARGN})
  message("${run_output}")
  run(${CMAKE_COMMAND} --build ${bin})
  message("${run_output}")
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE ${SCRATCH})
  run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX})
  message("${run_output}")

elseif(STEP STREQUAL "layout")
  set(lib ${PREFIX}/${LIBDIR})
  expect_file(${lib}/libmoejit.so.${VERSION})
  expect_symlink(${lib}/libmoejit.so.${SOVERSION} libmoejit.so.${VERSION})
  expect_symlink(${lib}/libmoejit.so libmoejit.so.${SOVERSION})
  expect_file(${PREFIX}/${INCLUDEDIR}/moejit/moejit.h)
  foreach(f moejitConfig.cmake moejitConfigVersion.cmake moejitTargets.cmake)
    expect_file(${PREFIX}/${CMAKEDIR}/${f})
  endforeach()
  expect_file(${PREFIX}/${PKGCONFIGDIR}/moejit.pc)
  # Each tool finds the library in ../lib wherever the prefix lies (cmake/install.cmake).
  find_program(READELF readelf)
  if(READELF)
    run(${READELF} -d ${lib}/libmoejit.so.${VERSION})
    expect_no_libcuda(${lib}/libmoejit.so.${VERSION} "${run_output}")
  endif()
  foreach(tool IN LISTS TOOLS)
    expect_file(${PREFIX}/${BINDIR}/${tool})
    if(READELF)
      run(${READELF} -d ${PREFIX}/${BINDIR}/${tool})
      if(NOT run_output MATCHES "R(UN)?PATH[^\n]*\\$ORIGIN/")
        message(FATAL_ERROR "${tool} has no RUNPATH relative to $ORIGIN:\n${run_output}")
      endif()
      expect_no_libcuda(${tool} "${run_output}")
    endif()
  endforeach()
  # moejit-precompile's example model configs, read by the installed tool from where they lie.
  if("moejit-precompile" IN_LIST TOOLS)
    set(configs ${PREFIX}/${DATADIR}/moejit/precompile-configs)
    foreach(model deepseek-v3 mixtral-8x7b qwen3-30b-a3b gpt-oss-120b)
      expect_file(${configs}/${model}.json)
    endforeach()
    run(${PREFIX}/${BINDIR}/moejit-precompile --dry-run --arch sm_90 --model-config
        ${configs}/deepseek-v3.json --cache-dir ${SCRATCH}/layout-cache)
    if(NOT run_output MATCHES "specializations")
      message(FATAL_ERROR "moejit-precompile --dry-run on the installed config:\n${run_output}")
    endif()
  endif()
  # The internals stay internal: no static core library, no private headers.
  file(GLOB_RECURSE leaked ${PREFIX}/*moejit_core* ${PREFIX}/*.a)
  file(GLOB headers RELATIVE ${PREFIX}/${INCLUDEDIR} ${PREFIX}/${INCLUDEDIR}/*
       ${PREFIX}/${INCLUDEDIR}/moejit/*)
  list(REMOVE_ITEM headers moejit moejit/moejit.h)
  if(leaked OR headers)
    message(FATAL_ERROR "installed files that are not part of the package: ${leaked} ${headers}")
  endif()
  # The exported target must not drag the library's private dependencies into consumers.
  file(READ ${PREFIX}/${CMAKEDIR}/moejitTargets.cmake targets)
  if(targets MATCHES "INTERFACE_LINK_LIBRARIES|nvrtc|spdlog|moejit_core")
    message(FATAL_ERROR "moejitTargets.cmake leaks link dependencies:\n${targets}")
  endif()
  message("layout OK: ${lib}/libmoejit.so -> .so.${SOVERSION} -> .so.${VERSION}; tools: ${TOOLS}")

elseif(STEP STREQUAL "components")
  # A packager installs each component on its own (cmake/install.cmake): runtime (the library),
  # development (header, link symlink, CMake and pkg-config files) and tools. Nothing may be left
  # in CMake's default component, which a split package would lose.
  set(expect_runtime ${LIBDIR}/libmoejit.so.${VERSION} ${LIBDIR}/libmoejit.so.${SOVERSION})
  set(expect_development ${INCLUDEDIR}/moejit/moejit.h ${LIBDIR}/libmoejit.so
      ${CMAKEDIR}/moejitConfig.cmake ${PKGCONFIGDIR}/moejit.pc)
  set(expect_tools)
  foreach(tool IN LISTS TOOLS)
    list(APPEND expect_tools ${BINDIR}/${tool})
  endforeach()
  if("moejit-precompile" IN_LIST TOOLS)
    list(APPEND expect_tools ${DATADIR}/moejit/precompile-configs/deepseek-v3.json)
  endif()
  foreach(component runtime development tools Unspecified)
    set(root ${SCRATCH}/component-${component})
    file(REMOVE_RECURSE ${root})
    run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${root} --component ${component})
    file(GLOB_RECURSE installed LIST_DIRECTORIES false RELATIVE ${root} ${root}/*)
    if(component STREQUAL "Unspecified")
      if(installed)
        message(FATAL_ERROR "installed in no component: ${installed}")
      endif()
      continue()
    endif()
    foreach(f IN LISTS expect_${component})
      if(NOT f IN_LIST installed)
        message(FATAL_ERROR "component ${component} lacks ${f}; it has: ${installed}")
      endif()
    endforeach()
    message("${component}: ${installed}")
  endforeach()

elseif(STEP STREQUAL "pkgconfig")
  pkg_config(version ${PREFIX} --modversion)
  if(NOT version STREQUAL VERSION)
    message(FATAL_ERROR "pkg-config --modversion moejit = '${version}', expected ${VERSION}")
  endif()
  pkg_config(flags ${PREFIX} --cflags --libs)
  message("pkg-config --cflags --libs moejit: ${flags}")
  # The file must be relocatable: a copy of the tree elsewhere points at the copy.
  set(moved ${SCRATCH}/moved-prefix)
  file(REMOVE_RECURSE ${moved})
  file(COPY ${PREFIX}/ DESTINATION ${moved})
  foreach(root ${PREFIX} ${moved})
    pkg_config(includedir ${root} --variable=includedir)
    pkg_config(libdir ${root} --variable=libdir)
    same_dir(${includedir} ${root}/${INCLUDEDIR} "includedir of ${root}")
    same_dir(${libdir} ${root}/${LIBDIR} "libdir of ${root}")
  endforeach()
  # A C program built with exactly what pkg-config says (plus an rpath to run in place).
  pkg_config(cflags ${PREFIX} --cflags)
  pkg_config(libs ${PREFIX} --libs)
  pkg_config(libdir ${PREFIX} --variable=libdir)
  separate_arguments(cflags UNIX_COMMAND "${cflags}")
  separate_arguments(libs UNIX_COMMAND "${libs}")
  set(exe ${SCRATCH}/version_check)
  run(${C_COMPILER} -std=c99 -Wall -Wextra -Werror ${cflags}
      ${CMAKE_CURRENT_LIST_DIR}/version_check.c -o ${exe} ${libs} -Wl,-rpath,${libdir})
  run(${exe})
  message("${run_output}")

elseif(STEP STREQUAL "build_example_cpp")
  configure_and_build(cpp)
  # The package must have come from the scratch prefix.
  file(STRINGS ${SCRATCH}/example-cpp/CMakeCache.txt dir REGEX "^moejit_DIR:")
  string(REGEX REPLACE "^[^=]*=" "" dir "${dir}")
  same_dir(${dir} ${PREFIX}/${CMAKEDIR} "moejit_DIR")

elseif(STEP STREQUAL "cmake_package")
  # The CMake package is relocatable and versioned: a copy of the tree elsewhere serves
  # find_package(moejit <same major>) with its own paths, and refuses another major version.
  set(moved ${SCRATCH}/moved-cmake-prefix)
  file(REMOVE_RECURSE ${moved})
  file(COPY ${PREFIX}/ DESTINATION ${moved})
  set(src ${SCRATCH}/find-package)
  file(WRITE ${src}/CMakeLists.txt [=[
cmake_minimum_required(VERSION 3.24)
project(find_moejit LANGUAGES NONE)
find_package(moejit ${REQUEST} CONFIG REQUIRED)
get_target_property(inc moejit::moejit INTERFACE_INCLUDE_DIRECTORIES)
file(WRITE ${CMAKE_BINARY_DIR}/found.txt "${moejit_DIR}\n${inc}")
]=])
  math(EXPR next_major "${SOVERSION} + 1")
  foreach(request 0 ${SOVERSION}.0 ${next_major}.0)
    set(bin ${SCRATCH}/find-package-${request})
    file(REMOVE_RECURSE ${bin})
    execute_process(COMMAND ${CMAKE_COMMAND} -S ${src} -B ${bin} -DREQUEST=${request}
                            -DCMAKE_PREFIX_PATH=${moved} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(request STREQUAL "${next_major}.0")
      if(rc EQUAL 0 OR NOT err MATCHES "moejitConfig.cmake, version: ${VERSION}")
        message(FATAL_ERROR "find_package(moejit ${request}) against ${VERSION}:\n${out}\n${err}")
      endif()
      continue()
    elseif(NOT rc EQUAL 0)
      message(FATAL_ERROR "find_package(moejit ${request}) failed:\n${out}\n${err}")
    endif()
    file(STRINGS ${bin}/found.txt found)
    list(GET found 0 dir)
    list(GET found 1 inc)
    same_dir(${dir} ${moved}/${CMAKEDIR} "moejit_DIR of the moved tree")
    same_dir(${inc} ${moved}/${INCLUDEDIR} "include directory of the moved tree")
  endforeach()
  message("moved package found: ${dir}, include ${inc}")

elseif(STEP STREQUAL "build_example_c")
  require_pkg_config()
  set(ENV{PKG_CONFIG_PATH} ${PREFIX}/${PKGCONFIGDIR})
  set(ENV{PKG_CONFIG_LIBDIR} ${PREFIX}/${PKGCONFIGDIR})
  configure_and_build(c -DPKG_CONFIG_EXECUTABLE=${pc})

elseif(STEP STREQUAL "example_c_makefile")
  # examples/c/Makefile, the way its header says to use it, in a copy (it builds in its own
  # directory). A CUDA_HOME without a toolkit is refused by name before the compiler runs: the
  # link would otherwise fail with undefined cuda* symbols that name no cause.
  find_program(make NAMES make gmake)
  if(NOT make)
    message(FATAL_ERROR "make not found (Debian: apt-get install make)")
  endif()
  set(dir ${SCRATCH}/example-c-makefile)
  file(REMOVE_RECURSE ${dir})
  file(COPY ${SOURCE_DIR}/examples/c/Makefile ${SOURCE_DIR}/examples/c/combine.c DESTINATION ${dir})
  set(pc_path PKG_CONFIG_PATH=${PREFIX}/${PKGCONFIGDIR})
  execute_process(COMMAND ${make} -C ${dir} ${pc_path} CUDA_HOME=${SCRATCH}/no-such-toolkit
                          CC=${C_COMPILER}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "no CUDA toolkit at CUDA_HOME=${SCRATCH}/no-such-toolkit")
    message(FATAL_ERROR "a CUDA_HOME without a toolkit was not refused by name (rc ${rc}):\n"
                        "${out}\n${err}")
  endif()
  if(EXISTS ${dir}/moejit-example-c)
    message(FATAL_ERROR "the refused build left ${dir}/moejit-example-c")
  endif()
  set(ENV{PKG_CONFIG_LIBDIR} ${SCRATCH}/no-such-pkgconfig-dir)  # no system-wide moejit.pc either
  execute_process(COMMAND ${make} -C ${dir} PKG_CONFIG_PATH=${SCRATCH}/no-such-pkgconfig-dir
                          CUDA_HOME=${CUDA_ROOT}
                          CC=${C_COMPILER}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "pkg-config cannot find moejit")
    message(FATAL_ERROR "a PKG_CONFIG_PATH without moejit was not refused by name (rc ${rc}):\n"
                        "${out}\n${err}")
  endif()
  # PKG_CONFIG_LIBDIR keeps any system-wide moejit.pc out of it: only the scratch prefix counts.
  set(ENV{PKG_CONFIG_LIBDIR} ${PREFIX}/${PKGCONFIGDIR})
  run(${make} -C ${dir} ${pc_path} CUDA_HOME=${CUDA_ROOT} CC=${C_COMPILER})
  message("${run_output}")
  expect_file(${dir}/moejit-example-c)

else()
  message(FATAL_ERROR "unknown STEP '${STEP}'")
endif()
