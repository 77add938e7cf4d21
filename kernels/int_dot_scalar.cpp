// kernels/int_dot_scalar.cpp: the portable twin of the int8-key dot products (kernels/int_dot.hpp), for the tests.
#define GPT2ATTN_SCALAR_ONLY 1
#include "kernels/int_dot.hpp"

namespace gpt2attn::kernels {
const IntDotKernel& int_dot_scalar() { return make_int_dot_kernel<ScalarArch>("scalar"); }
}  // namespace gpt2attn::kernels
