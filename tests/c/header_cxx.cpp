// tests/c/header_cxx.cpp: header_c.c compiled as C++ (the C header's extern "C", casts and inline helpers under
// C++'s rules and warnings).
#include "header_c.c"
