# tests/consumers/run.cmake: builds and runs consumer.c and consumer.cpp against gpt2attn as users do (cmake -P; the
# ctests in tests/consumers/CMakeLists.txt pass the -D variables).
#   MODE=install           cmake --install the build tree into WORK_DIR/prefix, from empty
#   MODE=cmake_package     tests/consumers/project with find_package(gpt2attn) from that prefix: once as a C-only
#                          project (consumer.c), once with C++ (both programs). With HIDE (directories joined by
#                          '|'), only the C/C++ project, whose find_* calls ignore those directories (oneDNN's
#                          package and headers); the project checks that oneDNN is indeed out of its sight.
#   MODE=mpi_package       BUILD_DIR installed into WORK_DIR/prefix_mpi without the component mpi, then with it
#                          (`cmake --install --component mpi`); tests/consumers/project with CONSUMER_MPI (and
#                          oneDNN hidden, as above) builds consumer_mpi.cpp against gpt2attn::mpi, run by MPIEXEC on
#                          2 ranks (MPIEXEC_NP_FLAG; MPIEXEC_FLAGS joined by '|')
#   MODE=pkg_config        both programs compiled and linked by hand with `pkg-config --cflags --libs gpt2attn`
#   MODE=python_package    the installed Python package imported from the prefix, loading the prefix's library
#   MODE=add_subdirectory  tests/consumers/project adding SOURCE_TREE with add_subdirectory (kept between runs:
#                          the library's own compile is most of this test's time)
cmake_minimum_required(VERSION 3.25)  # policies of the script mode, as the project sets them
foreach(v MODE WORK_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "run.cmake: -D${v}=... is missing")
  endif()
endforeach()
set(here ${CMAKE_CURRENT_LIST_DIR})
set(prefix ${WORK_DIR}/prefix)

# Runs a command, echoing it; stops the test with its output when it fails.
function(run)
  cmake_parse_arguments(R "" "WORKING_DIRECTORY" "" ${ARGN})
  list(JOIN R_UNPARSED_ARGUMENTS " " line)
  message(STATUS "$ ${line}")
  if(NOT R_WORKING_DIRECTORY)
    set(R_WORKING_DIRECTORY ${WORK_DIR})
  endif()
  execute_process(COMMAND ${R_UNPARSED_ARGUMENTS} WORKING_DIRECTORY ${R_WORKING_DIRECTORY}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}):\n${out}")
  endif()
  string(STRIP "${out}" out)
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

# Configures tests/consumers/project into `dir`, builds it and runs what it built.
function(build_project dir)
  set(programs consumer_c)
  if(NOT "-DCONSUMER_C_ONLY=ON" IN_LIST ARGN)
    list(APPEND programs consumer_cpp)
  endif()
  run(${CMAKE_COMMAND} -S ${here}/project -B ${dir} -G ${GENERATOR} -DCMAKE_BUILD_TYPE=${BUILD_TYPE}
      -DCMAKE_C_COMPILER=${C_COMPILER} -DCMAKE_CXX_COMPILER=${CXX_COMPILER} ${ARGN})
  run(${CMAKE_COMMAND} --build ${dir} --parallel ${JOBS})
  foreach(p IN LISTS programs)
    run(${dir}/${p})
    message(STATUS "${last_output}")
  endforeach()
endfunction()

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE ${prefix})
  run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
elseif(MODE STREQUAL "cmake_package")
  # CMAKE_FIND_USE_PACKAGE_REGISTRY off: the package must come from the prefix, nowhere else.
  set(variants c_only c_cxx)
  if(DEFINED HIDE)
    set(variants c_cxx_hidden)
  endif()
  foreach(variant IN LISTS variants)
    set(dir ${WORK_DIR}/cmake_package_${variant})
    file(REMOVE_RECURSE ${dir})
    set(only "")
    if(variant STREQUAL "c_only")
      set(only -DCONSUMER_C_ONLY=ON)
    elseif(variant STREQUAL "c_cxx_hidden")
      # An initial cache (-C): the list keeps its semicolons, which a -D on this command line would split.
      string(REPLACE "|" ";" hidden "${HIDE}")
      file(WRITE ${WORK_DIR}/cmake_package_hide.cmake "set(CMAKE_IGNORE_PATH \"${hidden}\" CACHE STRING \"\")\n")
      set(only -C ${WORK_DIR}/cmake_package_hide.cmake -DCONSUMER_EXPECT_NO_DNNL=ON)
      message(STATUS "hidden from the consumer: ${hidden}")
    endif()
    build_project(${dir} -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF ${only})
    file(STRINGS ${dir}/CMakeCache.txt found REGEX "^gpt2attn_DIR:")
    string(FIND "${found}" "${prefix}/" at)
    if(NOT at GREATER 0)
      message(FATAL_ERROR "find_package(gpt2attn) did not take the package from ${prefix}: ${found}")
    endif()
  endforeach()
elseif(MODE STREQUAL "mpi_package")
  set(prefix ${WORK_DIR}/prefix_mpi)
  file(REMOVE_RECURSE ${prefix})
  # The rest of the install (CMake's default component, "Unspecified") leaves the module out, and the module's
  # component puts in all it needs.
  run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --component Unspecified)
  file(GLOB_RECURSE module RELATIVE ${prefix} ${prefix}/*mpi* ${prefix}/*parallel.hpp)
  if(module)
    message(FATAL_ERROR "installed without the component mpi, yet: ${module}")
  endif()
  run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} --component mpi)
  file(GLOB_RECURSE module RELATIVE ${prefix} ${prefix}/*mpi* ${prefix}/*parallel.hpp)
  message(STATUS "the component mpi installed: ${module}")
  string(REPLACE "|" ";" hidden "${HIDE}")
  file(WRITE ${WORK_DIR}/mpi_package_hide.cmake "set(CMAKE_IGNORE_PATH \"${hidden}\" CACHE STRING \"\")\n")
  set(dir ${WORK_DIR}/mpi_package)
  file(REMOVE_RECURSE ${dir})
  build_project(${dir} -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
                -C ${WORK_DIR}/mpi_package_hide.cmake -DCONSUMER_EXPECT_NO_DNNL=ON -DCONSUMER_MPI=ON)
  string(REPLACE "|" ";" flags "${MPIEXEC_FLAGS}")
  run(${MPIEXEC} ${MPIEXEC_NP_FLAG} 2 ${flags} ${dir}/consumer_mpi)
  message(STATUS "${last_output}")
elseif(MODE STREQUAL "pkg_config")
  find_program(PKG_CONFIG pkg-config)
  if(NOT PKG_CONFIG)
    message(FATAL_ERROR "pkg-config not found (Debian: pkgconf, which scripts/install-deps.sh installs)")
  endif()
  set(ENV{PKG_CONFIG_PATH} ${prefix}/${LIBDIR}/pkgconfig)
  run(${PKG_CONFIG} --print-errors --modversion gpt2attn)
  if(NOT last_output STREQUAL VERSION)
    message(FATAL_ERROR "pkg-config says gpt2attn ${last_output}, the build is ${VERSION}")
  endif()
  run(${PKG_CONFIG} --print-errors --cflags --libs gpt2attn)
  separate_arguments(flags UNIX_COMMAND "${last_output}")
  message(STATUS "pkg-config --cflags --libs gpt2attn: ${last_output}")
  # The prefix is not one the dynamic loader searches: the program records it, as it would be told to.
  set(dir ${WORK_DIR}/pkg_config)
  file(REMOVE_RECURSE ${dir})
  file(MAKE_DIRECTORY ${dir})
  set(strict -Wall -Wextra -Wpedantic -Werror)
  run(${C_COMPILER} -std=c99 ${strict} ${here}/consumer.c ${flags} -Wl,-rpath,${prefix}/${LIBDIR} -o ${dir}/consumer_c)
  run(${CXX_COMPILER} -std=c++17 ${strict} ${here}/consumer.cpp ${flags} -Wl,-rpath,${prefix}/${LIBDIR}
      -o ${dir}/consumer_cpp)
  foreach(p consumer_c consumer_cpp)
    run(${dir}/${p})
    message(STATUS "${last_output}")
  endforeach()
elseif(MODE STREQUAL "python_package")
  file(GLOB site ${prefix}/${LIBDIR}/python3*/*-packages)
  set(ENV{PYTHONPATH} "${site}")
  run(${PYTHON} ${here}/consumer.py ${prefix})
  message(STATUS "${last_output}")
elseif(MODE STREQUAL "add_subdirectory")
  # Build type None (no -O): what is tested is how the tree embeds, and the library's compile is most of this test's
  # time; the optimised build with warnings as errors is the main build's. The last -D wins over build_project's.
  build_project(${WORK_DIR}/add_subdirectory -DGPT2ATTN_SOURCE_DIR=${SOURCE_TREE} -DGPT2ATTN_WERROR=${WERROR}
                -DCMAKE_BUILD_TYPE=None)
else()
  message(FATAL_ERROR "run.cmake: unknown MODE '${MODE}'")
endif()
