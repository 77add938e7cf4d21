// kernels/linear.hpp: y = x W^T + b for a few rows (decode: one row per sequence), reading W once from a
// panel-packed copy held as f32 or bf16 (a bf16 layer's decode streams half the weight bytes; the weights are
// widened to f32 as they are loaded, and x, the bias, the sums and y stay f32). Pure compute on pointers: no
// allocation, threads or oneDNN; the engine packs the weights once at construction and splits the panels across
// threads.
//
// Why not oneDNN here: a decode step's GEMMs have M = B (1..64), so they are bound by streaming W, which any
// register-blocked loop does at memory speed; and oneDNN 2.6's primitive execute allocates its argument map
// on every call, which a decode step must not do.
//
// Packed layout: W (N, K) row-major becomes ceil(N / kLinearPanel) panels, each (K, kLinearPanel): panel p
// holds outputs [p*16, p*16 + 16) with, for every k, their 16 weights contiguous (zero past N). The micro-
// kernel keeps a block of rows x a group of adjacent panels in registers (tiles.hpp) and streams the group's
// panels side by side, 16 weights of each per k (a 64-byte line in f32, half of one in bf16).
#pragma once

#include <cstdint>

#include "gpt2attn/dtype.hpp"
#include "gpt2attn/isa.hpp"
#include "kernels/bf16.hpp"

namespace gpt2attn::kernels {

inline constexpr int64_t kLinearPanel = 16;  // outputs per panel: one AVX-512 vector, two AVX2 vectors

inline int64_t linear_panels(int64_t N) { return (N + kLinearPanel - 1) / kLinearPanel; }
inline int64_t linear_packed_elements(int64_t N, int64_t K) { return linear_panels(N) * K * kLinearPanel; }

// w (N, K) row-major of S (f32 or bf16) -> packed (linear_packed_elements(N, K) elements of T, f32 or bf16), the
// layout above; f32 -> bf16 rounds each weight to nearest even, once (the engine packs one panel at a time, N <= 16,
// from rows already in T).
template <class T, class S>
void pack_linear_weights(const S* w, int64_t N, int64_t K, T* packed) {
  for (int64_t p = 0; p < linear_panels(N); ++p) {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t c = 0; c < kLinearPanel; ++c) {
        const int64_t n = p * kLinearPanel + c;
        packed[(p * K + k) * kLinearPanel + c] = narrow<T>(n < N ? widen(w[n * K + k]) : 0.0f);
      }
    }
  }
}

struct LinearArgs {
  const float* x = nullptr;         // (M, K), row stride ldx
  int64_t ldx = 0;
  const void* w_packed = nullptr;   // pack_linear_weights(W (N, K)) in the kernel's weight type
  const float* bias = nullptr;      // (N) or null
  float* y = nullptr;               // (M, N), row stride ldy
  int64_t ldy = 0;
  int64_t M = 0, N = 0, K = 0;
};

struct LinearKernel {
  Isa isa;        // the level whose flags compiled it
  DType weights;  // the packed weights' type, f32 or bf16: the layer's compute type
  int64_t panel_group;  // panels computed together: a range split at multiples of it keeps whole groups
  // Computes y's columns of panels [panel_begin, panel_end) for all M rows.
  void (*run)(const LinearArgs& args, int64_t panel_begin, int64_t panel_end);
};

}  // namespace gpt2attn::kernels
