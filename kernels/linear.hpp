// kernels/linear.hpp: y = x W^T + b for a few rows (decode: one row per sequence), reading W once from a
// panel-packed copy held as f32, bf16, int8 or int4 (a bf16 layer's decode streams half the f32 weight bytes, int8 a
// quarter, int4 about a sixth with its scales). f32 and bf16 are widened to f32 in registers as they are loaded; int8
// and int4 codes meet each row of x quantized to int16 (quantize_query_i16, kernels/int_dot.hpp: half a step of
// max|x| / 32767) in exact integer sums, scaled to f32 per chunk (int8) or group (int4). The bias, the scales and y
// are f32. Pure compute on pointers: no allocation, threads or oneDNN; the engine packs the weights once at
// construction and splits the panels across threads.
//
// Why not oneDNN here: a decode step's GEMMs have M = B (1..64), so they are bound by streaming W, which any
// register-blocked loop does at memory speed; and oneDNN 2.6's primitive execute allocates its argument map
// on every call, which a decode step must not do.
//
// Packed layout: W (N, K) row-major becomes ceil(N / kLinearPanel) panels, panel p holding outputs [p*16, p*16 + 16)
// (zero past N). The compute types:
//   f32:  for every k, the 16 outputs' weights contiguous, 64 bytes;
//   bf16: for every input pair (2i, 2i + 1), 64 bytes: element 2c + j is output c's weight at input 2i + j, so one
//         32-bit lane holds an output's pair, which a shift and a mask widen (Vec::load_pair; one ALU operation per
//         16 weights where zero-extending takes two, beside the FMAs on the same ports: M = 16 rows, N = 1024, K = 768
//         from L2 on one thread of the Xeon VM took 0.176 ms against 0.200, 84% of the FMA peak against 74%); an odd
//         K's last input alone, its 16 weights contiguous. Input k (even) starts k * 32 bytes into the panel, as if
//         each input had its own 32 bytes.
// The quantized formats (gpt2attn/dtype.hpp, WeightFormat) are read by integer dot products, so their inputs come in
// pairs (vpdpwssd / vpmaddwd multiply adjacent int16 pairs into one int32 lane): K padded to linear_padded_k (zero
// codes), and per panel
//   int8: for every input pair (2i, 2i + 1), 32 bytes: byte 2c + j is output c's code at input 2i + j;
//   int4: for every input quad (4i .. 4i + 3), 32 bytes: byte 2c + j holds output c's code q at input 4i + j in its
//         low nibble and at 4i + 2 + j in its high one, each as q + 8 in [0, 15],
// so a vector of W int32 lanes (outputs [vW, vW + W)) widens bytes [2vW, 2vW + 2W) into one pair (int8) or two
// (int4) of int16 per lane. Their f32 scales sit beside the codes: int8 one per output, linear_scales(N, K, f) floats
// in panel order ([panel][16]); int4 one per output and group of kWeightGroup inputs, [panel][group][16].
// The micro-kernel keeps a block of rows x a group of adjacent panels in registers (tiles.hpp) and streams the
// group's panels side by side.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/isa.hpp"
#include "kernels/bf16.hpp"

namespace gpt2attn::kernels {

inline constexpr int64_t kLinearPanel = 16;  // outputs per panel: one AVX-512 vector, two AVX2 vectors

// Two int4 codes in a byte (each nibble q + 8 in [0, 15], for the code q in [-8, 7]): the packed element of an int4
// panel.
struct int4x2 {
  uint8_t bits;
};

inline int64_t linear_panels(int64_t N) { return (N + kLinearPanel - 1) / kLinearPanel; }
inline int64_t linear_packed_elements(int64_t N, int64_t K) { return linear_panels(N) * K * kLinearPanel; }
inline int64_t weight_groups(int64_t K) { return (K + kWeightGroup - 1) / kWeightGroup; }
// Inputs a panel holds in format f: K, padded for the quantized formats to whole input quads (their pairs, their
// nibbles' quads).
inline int64_t linear_padded_k(WeightFormat f, int64_t K) { return f == WeightFormat::compute ? K : (K + 3) / 4 * 4; }
// Bytes of one panel per k, and of the whole packed matrix, in format f (f32 or bf16 for WeightFormat::compute).
inline int64_t linear_bytes_per_k(WeightFormat f, DType compute) {
  switch (f) {
    case WeightFormat::int8: return kLinearPanel;
    case WeightFormat::int4: return kLinearPanel / 2;
    case WeightFormat::compute: break;
  }
  return kLinearPanel * static_cast<int64_t>(size_of(compute));
}
inline int64_t linear_packed_bytes(int64_t N, int64_t K, WeightFormat f, DType compute) {
  return linear_panels(N) * linear_padded_k(f, K) * linear_bytes_per_k(f, compute);
}
// Bytes of LinearArgs::scratch a call of the kernel for format f needs for M rows of K inputs: the quantized formats'
// int16 rows of x (padded), their scales, and for int4 each group's sum of x's codes; none for the compute types.
inline int64_t linear_scratch_bytes(WeightFormat f, int64_t M, int64_t K) {
  if (f == WeightFormat::compute) return 0;
  const int64_t sums = f == WeightFormat::int4 ? (K + kWeightGroup - 1) / kWeightGroup : 0;
  return M * (linear_padded_k(f, K) * static_cast<int64_t>(sizeof(int16_t)) + static_cast<int64_t>(sizeof(float)) +
              sums * static_cast<int64_t>(sizeof(int32_t)));
}
// Floats of scales beside the codes: none for the compute types.
inline int64_t linear_scales(int64_t N, int64_t K, WeightFormat f) {
  switch (f) {
    case WeightFormat::int8: return linear_panels(N) * kLinearPanel;
    case WeightFormat::int4: return linear_panels(N) * weight_groups(K) * kLinearPanel;
    case WeightFormat::compute: break;
  }
  return 0;
}

// The quantization of gpt2attn/dtype.hpp's WeightFormat, one row (int8) or group (int4) of n values at a time: the
// scale, and a value's code under it (division, not a reciprocal's product, so the value the scale was taken from gets
// its extreme code exactly). dequantized() and the packing below both use these, so the codes the kernels read are the
// ones the references are given.
//   int8: s = max|w| / 127, taken one float down where 127 s would overflow; codes round(w / s) in [-127, 127].
//   int4: s = m / -8, m the value of largest magnitude (the first of equal ones), so m's code is -8 and all 16 codes
//         serve (llama.cpp's q4_0 takes its scale so); codes round(w / s) in [-8, 7].
inline float quant_scale(WeightFormat f, const float* w, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (std::fabs(w[i]) > std::fabs(m)) m = w[i];
  }
  if (f == WeightFormat::int4) return m / -8.0f;
  float s = std::fabs(m) / 127.0f;
  if (std::isinf(s * 127.0f)) s = std::nextafter(s, 0.0f);
  return s;
}
inline int quant_code(WeightFormat f, float w, float scale) {
  if (scale == 0.0f) return 0;  // a row (group) of zeros, or of values too small for the scale to be represented
  const float lo = f == WeightFormat::int4 ? -8.0f : -127.0f, hi = f == WeightFormat::int4 ? 7.0f : 127.0f;
  return static_cast<int>(std::clamp(std::nearbyint(w / scale), lo, hi));
}

// w (N, K) row-major of S (f32 or bf16) -> packed (linear_packed_elements(N, K) elements of T, f32 or bf16), the
// layout above; f32 -> bf16 rounds each weight to nearest even, once (the engine packs one panel at a time, N <= 16,
// from rows already in T).
template <class T, class S>
void pack_linear_weights(const S* w, int64_t N, int64_t K, T* packed) {
  constexpr bool kPairs = std::is_same_v<T, bf16>;
  for (int64_t p = 0; p < linear_panels(N); ++p) {
    for (int64_t k = 0; k < K; ++k) {
      // Input k's slot in its 32 (pair) or 16 (f32, an odd K's last bf16 input) elements.
      const bool paired = kPairs && k / 2 * 2 + 1 < K;
      for (int64_t c = 0; c < kLinearPanel; ++c) {
        const int64_t n = p * kLinearPanel + c;
        const int64_t at = paired ? k / 2 * 2 * kLinearPanel + 2 * c + k % 2 : k * kLinearPanel + c;
        packed[p * K * kLinearPanel + at] = narrow<T>(n < N ? widen(w[n * K + k]) : 0.0f);
      }
    }
  }
}

// One row of K values in format f (int8 or int4): codes (K of them, row-major) and one scale per group of inputs
// (int8: the whole row, one scale; int4: weight_groups(K) scales). The rule above, group by group: every layer's
// codes come from here (QuantizedWeights::quantize), and the panels below rearrange them.
inline int64_t quant_group(WeightFormat f, int64_t K) { return f == WeightFormat::int4 ? kWeightGroup : K; }
inline void quantize_row(WeightFormat f, const float* w, int64_t K, int8_t* codes, float* scales) {
  const int64_t group = quant_group(f, K);
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g) {
    const int64_t len = std::min(group, K - k0);
    scales[g] = quant_scale(f, w + k0, len);
    for (int64_t k = k0; k < k0 + len; ++k) codes[k] = static_cast<int8_t>(quant_code(f, w[k], scales[g]));
  }
}

// Panel p of a quantized matrix from the codes (quantize_row's, row stride K) and scales (ceil(K / group) a row) of
// its rows [p*16, p*16 + n), n <= 16: the panel's share of the packed layout above (linear_padded_k(f, K) * 16 int8_t,
// or half as many int4x2) and its scales (16, or groups * 16 floats), the outputs past n and the inputs past K zero.
inline void pack_linear_panel_int8(const int8_t* codes, const float* scales, int64_t n, int64_t K, int8_t* packed,
                                   float* packed_scales) {
  for (int64_t c = 0; c < kLinearPanel; ++c) packed_scales[c] = c < n ? scales[c] : 0.0f;
  for (int64_t k = 0; k < linear_padded_k(WeightFormat::int8, K); ++k) {
    for (int64_t c = 0; c < kLinearPanel; ++c) {
      packed[k / 2 * 2 * kLinearPanel + 2 * c + k % 2] = c < n && k < K ? codes[c * K + k] : 0;
    }
  }
}
inline void pack_linear_panel_int4(const int8_t* codes, const float* scales, int64_t n, int64_t K, int4x2* packed,
                                   float* packed_scales) {
  const int64_t G = weight_groups(K);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t c = 0; c < kLinearPanel; ++c) packed_scales[g * kLinearPanel + c] = c < n ? scales[c * G + g] : 0.0f;
  }
  const auto code = [&](int64_t o, int64_t k) { return o < n && k < K ? codes[o * K + k] + 8 : 8; };
  for (int64_t q = 0; q < linear_padded_k(WeightFormat::int4, K) / 4; ++q) {
    for (int64_t c = 0; c < kLinearPanel; ++c) {
      for (int64_t j = 0; j < 2; ++j) {
        packed[q * 2 * kLinearPanel + 2 * c + j].bits =
            static_cast<uint8_t>(code(c, 4 * q + j) | code(c, 4 * q + 2 + j) << 4);
      }
    }
  }
}

struct LinearArgs {
  const float* x = nullptr;         // (M, K), row stride ldx
  int64_t ldx = 0;
  const void* w_packed = nullptr;   // the packed W (N, K) in the kernel's weight format
  const float* scales = nullptr;    // the quantized formats' scales (linear_scales floats), else null
  const float* bias = nullptr;      // (N) or null
  float* y = nullptr;               // (M, N), row stride ldy
  int64_t ldy = 0;
  int64_t M = 0, N = 0, K = 0;
  void* scratch = nullptr;          // linear_scratch_bytes(format, M, K) of the calling thread's own
};

// int4 weights for a GEMM (the engine's prefill Linear): codes two a byte, 16 bytes per group of kWeightGroup inputs
// (byte i of group g holds input 32g + i in its low nibble and 32g + 16 + i in its high one, 4-bit two's complement;
// weight_groups(K) * 16 bytes a row), times their group scales (N, weight_groups(K)), into dst (N, K) row-major of
// `out` (f32 or bf16), each value rounded to bf16 when out is bf16 or bf16_values (a bf16 layer's values in f32).
using DequantizeFn = void (*)(const uint8_t* codes, const float* scales, int64_t N, int64_t K, DType out,
                              bool bf16_values, void* dst);
// codes (N, K) row-major (quantize_row's, in [-8, 7]) into that layout: int4_group_bytes(N, K) bytes at out.
inline int64_t int4_group_bytes(int64_t N, int64_t K) { return N * weight_groups(K) * (kWeightGroup / 2); }
inline void pack_int4_groups(const int8_t* codes, int64_t N, int64_t K, uint8_t* out) {
  constexpr int64_t half = kWeightGroup / 2;
  const int64_t G = weight_groups(K);
  std::fill_n(out, int4_group_bytes(N, K), uint8_t{0});
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = k / kWeightGroup, i = k % kWeightGroup;
      out[(n * G + g) * half + i % half] |= static_cast<uint8_t>((codes[n * K + k] & 0x0f) << (4 * (i / half)));
    }
  }
}

struct LinearKernel {
  Isa isa;        // the level whose flags compiled it
  WeightFormat format;  // the packed weights' format: compute (f32 or bf16, `compute`), int8 or int4
  DType compute;        // for WeightFormat::compute, the packed weights' type; else f32
  int64_t panel_group;  // panels computed together: a range split at multiples of it keeps whole groups
  // Computes y's columns of panels [panel_begin, panel_end) for all M rows.
  void (*run)(const LinearArgs& args, int64_t panel_begin, int64_t panel_end);
  DequantizeFn dequantize = nullptr;  // int4's, compiled at the level; null for the other formats
};

}  // namespace gpt2attn::kernels
