# tests/c/check_exports.cmake (ctest abi.exports): libgpt2attn.so exports the public API and nothing else.
#   cmake -DNM=nm -DOBJDUMP=objdump -DLIB=libgpt2attn.so.X -DHEADER=gpt2attn.h -DABI_VERSION=N -DVERSION=M.m.p -P ...
# Each dynamic symbol the library defines (nm -D --defined-only) must be one of
#   - a C function declared GPT2ATTN_API in gpt2attn.h, at version GPT2ATTN_<ABI_VERSION>; each of them must be there;
#   - a symbol of the C++ API, at version GPT2ATTN_CXX_<VERSION>: a function, member or static of namespace gpt2attn
#     whose next name is a class or a function, not a namespace (gpt2attn::detail::, kernels::, safetensors::, ... are
#     the engine's own) and not an engine-internal Impl; or the typeinfo or vtable of such a class;
#   - one of those two version nodes.
# Anything else (oneDNN, xsimd, nlohmann::json, standard-library templates, an internal namespace) fails the test,
# listed. The SONAME must be libgpt2attn.so.<ABI_VERSION>.
cmake_minimum_required(VERSION 3.25)  # policies of the script mode, as the project sets them
foreach(v NM OBJDUMP LIB HEADER ABI_VERSION VERSION)
  if(NOT DEFINED ${v} OR "${${v}}" STREQUAL "")
    message(FATAL_ERROR "check_exports.cmake: -D${v}=... is missing")
  endif()
endforeach()
set(c_node "GPT2ATTN_${ABI_VERSION}")
set(cxx_node "GPT2ATTN_CXX_${VERSION}")

# The C functions the header declares for export; `static inline` helpers are the caller's and are not among them.
file(READ ${HEADER} header)
string(REGEX MATCHALL "GPT2ATTN_API[^;(]*[ *]gpt2attn_[a-z0-9_]+\\(" decls "${header}")
set(declared "")
foreach(d IN LISTS decls)
  string(REGEX MATCH "gpt2attn_[a-z0-9_]+\\($" name "${d}")
  string(REGEX REPLACE "\\($" "" name "${name}")
  list(APPEND declared ${name})
endforeach()
list(LENGTH declared n_declared)
if(n_declared LESS 20)
  message(FATAL_ERROR "only ${n_declared} GPT2ATTN_API functions found in ${HEADER}: did the declarations change?")
endif()

# The same table twice, in symbol-table order (--no-sort): mangled (the C / C++ split) and demangled (the names).
include(${CMAKE_CURRENT_LIST_DIR}/../nm_lines.cmake)
nm_lines(raw ${NM} ${LIB} -D --defined-only --no-sort)
nm_lines(demangled ${NM} ${LIB} -D --defined-only --no-sort --demangle)
list(LENGTH raw n)
list(LENGTH demangled n2)
if(NOT n EQUAL n2 OR n EQUAL 0)
  message(FATAL_ERROR "nm listed ${n} and ${n2} symbols for the same library")
endif()

set(bad "")
set(exported_c "")
set(n_cxx 0)
math(EXPR last "${n} - 1")
foreach(i RANGE ${last})
  list(GET raw ${i} r)
  list(GET demangled ${i} d)
  if(NOT r MATCHES "^[0-9a-f]* ([A-Za-z]) (.*)$")
    list(APPEND bad "unparsed nm line: ${r}")
    continue()
  endif()
  set(type ${CMAKE_MATCH_1})
  set(mangled "${CMAKE_MATCH_2}")
  string(REGEX REPLACE "^[0-9a-f]* [A-Za-z] " "" name "${d}")
  set(version "")
  if(name MATCHES "^(.*[^@])@@?([A-Za-z0-9_.]+)$")
    set(name "${CMAKE_MATCH_1}")
    set(version "${CMAKE_MATCH_2}")
  endif()
  if(type STREQUAL "A")  # a version node
    if(NOT (name STREQUAL c_node OR name STREQUAL cxx_node))
      list(APPEND bad "version node ${name} (expected ${c_node} and ${cxx_node})")
    endif()
  elseif(NOT mangled MATCHES "^_Z")  # C
    list(FIND declared "${name}" at)
    if(at LESS 0)
      list(APPEND bad "C symbol ${name}@${version} (not a GPT2ATTN_API function of gpt2attn.h)")
    elseif(NOT version STREQUAL c_node)
      list(APPEND bad "C function ${name} at version '${version}', expected ${c_node}")
    else()
      list(APPEND exported_c ${name})
    endif()
  else()  # C++
    string(REGEX REPLACE "^(typeinfo name for|typeinfo for|vtable for) " "" entity "${name}")
    if(NOT entity MATCHES "^gpt2attn::")
      list(APPEND bad "C++ symbol outside namespace gpt2attn: ${name}")
    elseif(entity MATCHES "^gpt2attn::[a-z_][A-Za-z0-9_]*::" OR entity MATCHES "^gpt2attn::\\(anonymous")
      list(APPEND bad "C++ symbol of an internal namespace: ${name}")
    elseif(entity MATCHES "::Impl(::|$|\\()")
      list(APPEND bad "C++ symbol of an engine-internal Impl: ${name}")
    elseif(NOT version STREQUAL cxx_node)
      list(APPEND bad "C++ symbol ${name} at version '${version}', expected ${cxx_node}")
    else()
      math(EXPR n_cxx "${n_cxx} + 1")
    endif()
  endif()
endforeach()

foreach(name IN LISTS declared)
  list(FIND exported_c "${name}" at)
  if(at LESS 0)
    list(APPEND bad "${name} is declared GPT2ATTN_API in gpt2attn.h but not exported")
  endif()
endforeach()

execute_process(COMMAND ${OBJDUMP} -p ${LIB} OUTPUT_VARIABLE dynamic RESULT_VARIABLE rc)
string(REGEX MATCH "SONAME +([^\n]+)" _ "${dynamic}")
if(NOT CMAKE_MATCH_1 STREQUAL "libgpt2attn.so.${ABI_VERSION}")
  list(APPEND bad "SONAME '${CMAKE_MATCH_1}', expected libgpt2attn.so.${ABI_VERSION}")
endif()

list(LENGTH exported_c n_c)
list(LENGTH bad n_bad)
message(STATUS "${LIB}: ${n} defined dynamic symbols: ${n_c} C functions (${n_declared} declared), ${n_cxx} C++ "
               "symbols of the C++ API, ${n_bad} others or problems")
if(n_bad GREATER 0)
  list(JOIN bad "\n  " listing)
  message(FATAL_ERROR "libgpt2attn.so exports more or less than its API:\n  ${listing}")
endif()
