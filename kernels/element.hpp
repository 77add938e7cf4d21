// kernels/element.hpp: the element types the kernels read and write, and the DType each one is. The compute types are
// float and bf16; the K/V cache also stores int8_t (with row scales, kernels/kv_layout.hpp) and fp8_e4m3. dtype_of is
// how a kernel set's row (kernels/kernel_list.def) gets its dtypes from the types its kernels were instantiated with.
#pragma once

#include <cstdint>
#include <type_traits>

#include "gpt2attn/dtype.hpp"
#include "kernels/bf16.hpp"
#include "kernels/fp8.hpp"

namespace gpt2attn::kernels {

template <class T>
inline constexpr bool kNotAnElement = false;

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) {
    return DType::f32;
  } else if constexpr (std::is_same_v<T, bf16>) {
    return DType::bf16;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return DType::i8;
  } else if constexpr (std::is_same_v<T, fp8_e4m3>) {
    return DType::fp8;
  } else {
    static_assert(kNotAnElement<T>, "not an element type of the kernels: add it here and to kernels/vec.hpp");
  }
}

}  // namespace gpt2attn::kernels
