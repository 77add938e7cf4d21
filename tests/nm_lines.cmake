# tests/nm_lines.cmake: the dynamic symbols a shared library defines, for the export checks (tests/c and tests/mpi
# check_exports.cmake): nm_lines(<var> <nm> <library> <nm flags>...) sets <var> to nm's output lines as a CMake list.
# Brackets ([abi:cxx11], operator[]) would stop CMake's list splitting and semicolons would split a line; the checks
# do not look at either, so they read as <> and ",".
function(nm_lines var nm lib)
  execute_process(COMMAND ${nm} ${ARGN} ${lib} OUTPUT_VARIABLE out RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${nm} ${ARGN} ${lib} failed: ${err}")
  endif()
  string(REPLACE "[" "<" out "${out}")
  string(REPLACE "]" ">" out "${out}")
  string(REPLACE ";" "," out "${out}")
  string(REGEX REPLACE "\n$" "" out "${out}")
  string(REPLACE "\n" ";" out "${out}")
  set(${var} "${out}" PARENT_SCOPE)
endfunction()
