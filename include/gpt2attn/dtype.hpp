// gpt2attn/dtype.hpp: the one element-type vocabulary of the library: tensor views, masks, compute and K/V storage
// types, and the tolerance policy all name their element type with DType.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "gpt2attn/export.h"

namespace gpt2attn {

enum class DType : uint8_t {
  f32,   // IEEE binary32
  bf16,  // bfloat16: binary32's exponent, 8 significant bits
  f16,   // IEEE binary16
  i8,    // signed 8-bit integer (quantised storage)
  u8,    // unsigned 8-bit integer; carries bool masks (0 / nonzero)
  fp8,   // 8-bit float e4m3 (torch.float8_e4m3fn's encoding; K/V storage, with a power-of-two scale per row)
};

inline constexpr size_t kNumDTypes = static_cast<size_t>(DType::fp8) + 1;  // tables indexed by DType

constexpr size_t size_of(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16:
    case DType::f16: return 2;
    case DType::i8:
    case DType::u8:
    case DType::fp8: return 1;
  }
  return 0;
}

GPT2ATTN_API const char* to_string(DType t);  // "f32", "bf16", "f16", "i8", "u8", "fp8"
// The inverse; throws invalid_argument naming the known ones.
GPT2ATTN_API DType dtype_from_string(const std::string& s);

// How a layer holds its projection weights (EngineOptions::weights). Each output row (channel) of a matrix is
// quantized alone, from the values given, once at construction:
//   compute  the compute type (f32, or bf16 rounded to nearest even).
//   int8     symmetric, one f32 scale per output row: s = max|w| / 127, q = round(w / s) in [-127, 127], the weight
//            the layer computes with q * s. A row of zeros has s = 0.
//   int4     symmetric, one f32 scale per group of kWeightGroup consecutive inputs of a row (the last group of a row
//            whose width is not a multiple takes the rest): s = m / -8 with m the group's value of largest magnitude,
//            q = round(w / s) in [-8, 7] (m's code is -8: all 16 codes serve, as in llama.cpp's q4_0), two to a byte.
// dequantized() (gpt2attn/weights.hpp) gives the weights a layer of each format computes with.
enum class WeightFormat : uint8_t { compute, int8, int4 };
inline constexpr int64_t kWeightGroup = 32;  // int4 inputs per scale (llama.cpp's q4_0 blocks are 32 too)

GPT2ATTN_API const char* to_string(WeightFormat f);  // "compute", "int8", "int4"
// The inverse; throws invalid_argument naming the known ones.
GPT2ATTN_API WeightFormat weight_format_from_string(const std::string& s);

}  // namespace gpt2attn
