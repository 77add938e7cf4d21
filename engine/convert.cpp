// engine/convert.cpp: the one strided-view converter (convert.hpp) and what is built on it.
#include "engine/convert.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "engine/team.hpp"
#include "engine/util.hpp"
#include "gpt2attn/error.hpp"
#include "kernels/bf16.hpp"
#include "kernels/linear.hpp"
#include "support/file_io.hpp"

namespace gpt2attn::detail {
namespace {

// Element of type S at p as f32 (exact for all three), read with memcpy: a file's tensor may be unaligned.
template <DType S>
float load(const std::byte* p) {
  if constexpr (S == DType::f32) {
    float f;
    std::memcpy(&f, p, sizeof f);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    return S == DType::bf16 ? kernels::widen(kernels::bf16{h}) : io::f16_to_f32(h);
  }
}

// An f32 element holding a bf16 value (convert_bf16_values): same layout as float.
struct Bf16InF32 {
  float f;
};
static_assert(sizeof(Bf16InF32) == sizeof(float));

// Whether an element of type S is copied bit for bit into Dst: the same type (a bf16 widened into Bf16InF32 is not).
template <DType S, class Dst>
constexpr bool same_type = (S == DType::f32 && std::is_same_v<Dst, float>) ||
                           (S == DType::bf16 && std::is_same_v<Dst, kernels::bf16>);

// An f32 value stored as Dst: itself, rounded to the nearest bf16, or rounded to it and widened back.
template <class Dst>
Dst store(float x) {
  if constexpr (std::is_same_v<Dst, Bf16InF32>) {
    return {kernels::widen(kernels::to_bf16(x))};
  } else {
    return kernels::narrow<Dst>(x);
  }
}

// Element of type S at p as Dst: its bits where the types agree (a NaN's payload too), else rounded once.
template <DType S, class Dst>
Dst element(const std::byte* p) {
  if constexpr (same_type<S, Dst>) {
    Dst x{};
    std::memcpy(&x, p, sizeof x);
    return x;
  } else {
    return store<Dst>(load<S>(p));
  }
}

// A view of rank 1 to 3 as (B, N, W) with its strides in elements: the rank-1 (W) and rank-2 (N, W) views as one B.
struct Shape3 {
  int64_t B, N, W, sb, sn, sw;
};
Shape3 shape3(const TensorView& v) {
  switch (v.rank) {
    case 1: return {1, 1, v.shape[0], 0, 0, v.strides[0]};
    case 2: return {1, v.shape[0], v.shape[1], 0, v.strides[0], v.strides[1]};
    case 3: return {v.shape[0], v.shape[1], v.shape[2], v.strides[0], v.strides[1], v.strides[2]};
    default: fail(ErrorCode::internal, "convert: a view of rank " + std::to_string(v.rank) + " (expected 1 to 3)");
  }
}

// Rows of adjacent elements are converted whole, each row an item; others kTile rows at a time, kTile columns by
// kTile columns, so that a transposed view (adjacent elements down a column) reads each cache line once.
constexpr int64_t kTile = 64;
// Below this many elements a team costs more than it saves.
constexpr int64_t kParallelElements = 65536;

template <DType S, class Dst>
void convert_as(const TensorView& v, Dst* dst, int threads) {
  const Shape3 s = shape3(v);
  const auto* base = static_cast<const std::byte*>(v.data);
  constexpr int64_t bytes = static_cast<int64_t>(size_of(S));
  constexpr bool same = same_type<S, Dst>;
  const bool adjacent = s.sw == 1;
  const int64_t rows = adjacent ? 1 : kTile, cols = kTile;
  const int64_t per_b = ceil_div(s.N, rows), items = s.B * per_b;
  const auto convert_item = [&](int64_t item) {
    const int64_t b = item / per_b, n0 = item % per_b * rows, n1 = std::min(s.N, n0 + rows);
    const std::byte* in = base + b * s.sb * bytes;
    Dst* out = dst + b * s.N * s.W;
    if (adjacent) {  // row n0, its elements read at a stride the compiler knows
      const std::byte* row = in + n0 * s.sn * bytes;
      Dst* o = out + n0 * s.W;
      if constexpr (same) {
        std::memcpy(o, row, static_cast<size_t>(s.W * bytes));
      } else {
        for (int64_t c = 0; c < s.W; ++c) o[c] = store<Dst>(load<S>(row + c * bytes));
      }
      return;
    }
    for (int64_t c0 = 0; c0 < s.W; c0 += cols) {
      const int64_t c1 = std::min(s.W, c0 + cols);
      for (int64_t n = n0; n < n1; ++n) {
        const std::byte* row = in + n * s.sn * bytes;
        for (int64_t c = c0; c < c1; ++c) out[n * s.W + c] = element<S, Dst>(row + c * s.sw * bytes);
      }
    }
  };
  if (threads > 1 && s.B * s.N * s.W > kParallelElements) {
    // A few chunks of items per thread, taken dynamically: a thread that lost its core leaves its share to the others.
    const int64_t chunk = ceil_div(items, int64_t{threads} * 8);
    team_for(threads, ceil_div(items, chunk), [&](int64_t c, int) {
      for (int64_t item = c * chunk; item < std::min(items, (c + 1) * chunk); ++item) convert_item(item);
    });
  } else {
    for (int64_t item = 0; item < items; ++item) convert_item(item);
  }
}

template <class Dst>
void convert_to(const TensorView& v, Dst* dst, int threads) {
  switch (v.dtype) {
    case DType::f32: return convert_as<DType::f32>(v, dst, threads);
    case DType::bf16: return convert_as<DType::bf16>(v, dst, threads);
    case DType::f16: return convert_as<DType::f16>(v, dst, threads);
    default: fail(ErrorCode::internal, std::string("convert: cannot read ") + to_string(v.dtype) + " elements");
  }
}

}  // namespace

void convert_bf16_values(const TensorView& v, float* dst, int threads) {
  convert_to(v, reinterpret_cast<Bf16InF32*>(dst), threads);
}

void convert(const TensorView& v, DType to, void* dst, int threads) {
  if (to == DType::bf16) {
    convert_to(v, static_cast<kernels::bf16*>(dst), threads);
  } else if (to == DType::f32) {
    convert_to(v, static_cast<float*>(dst), threads);
  } else {
    fail(ErrorCode::internal, std::string("convert: no layer computes in ") + to_string(to));
  }
}

TensorView slice(const TensorView& v, int dim, int64_t i0, int64_t n) {
  if (v.empty()) return v;
  TensorView s = v;
  s.data = static_cast<const std::byte*>(v.data) + i0 * v.strides[dim] * static_cast<int64_t>(size_of(v.dtype));
  s.shape[dim] = n;
  return s;
}

std::vector<float> f32_values(const TensorView& v) {
  std::vector<float> out;
  if (v.empty()) return out;
  out.resize(static_cast<size_t>(v.numel()));
  convert(v, DType::f32, out.data());
  return out;
}

bool needs_packing(const TensorView& x, DType compute, DType operand) {
  const int64_t N = x.shape[1], W = x.shape[2];
  // Dense rows only: oneDNN 2.6's brgemm matmul refuses a row stride past the width, and what takes it instead with
  // blocked weights is its reference loop (hundreds of times slower on an Intel Xeon, model 207).
  return x.dtype != operand || operand != compute ||
         !(x.strides[2] == 1 && x.strides[1] == W && (x.shape[0] == 1 || x.strides[0] == N * x.strides[1]));
}

int64_t operand_bytes(DType operand, int64_t rows, int64_t width) {
  const int64_t elements = rows * width * static_cast<int64_t>(size_of(operand));
  return operand == DType::u8 ? round_up(elements, 64) + rows * static_cast<int64_t>(sizeof(float)) : elements;
}

namespace {
// v rounded to the nearest integer, ties to even, for |v| <= 2^22: adding and subtracting 1.5 x 2^23 leaves the
// integer part in the mantissa. Unlike nearbyint, it vectorizes at the engine's baseline flags (SSE2 has no roundps).
inline float round_small(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

template <DType S>
void quantize_row(const std::byte* x, int64_t stride, int64_t W, uint8_t* q, float* scale) {
  const int64_t step = stride * static_cast<int64_t>(size_of(S));
  float amax = 0.0f, probe = 0.0f;  // probe: NaN when the row holds a NaN or an infinity
  for (int64_t k = 0; k < W; ++k) {
    const float v = load<S>(x + k * step);
    amax = std::max(amax, std::fabs(v));
    probe += v * 0.0f;
  }
  if (probe != probe) {  // a row that is not finite (check_finite off): NaN scale and zero codes, so NaN out
    *scale = std::numeric_limits<float>::quiet_NaN();
    std::fill_n(q, W, uint8_t{128});
    return;
  }
  const float s = amax / 127.0f, r = 1.0f / s, inv = std::isfinite(r) ? r : 0.0f;  // zeros, or too small to scale
  *scale = s;
  for (int64_t k = 0; k < W; ++k) {
    const float v = std::clamp(round_small(load<S>(x + k * step) * inv), -127.0f, 127.0f);
    q[k] = static_cast<uint8_t>(static_cast<int>(v) + 128);
  }
}
}  // namespace

Rows quantize_rows(const TensorView& x, std::byte* scratch, int threads) {
  const int64_t N = x.shape[1], W = x.shape[2], rows = x.shape[0] * N;
  auto* q = reinterpret_cast<uint8_t*>(scratch);
  auto* scales = reinterpret_cast<float*>(scratch + round_up(rows * W, 64));
  const auto* base = static_cast<const std::byte*>(x.data);
  const int64_t es = static_cast<int64_t>(size_of(x.dtype));
  team_for(threads, rows, [&](int64_t i, int) {
    const std::byte* r = base + ((i / N) * x.strides[0] + (i % N) * x.strides[1]) * es;
    switch (x.dtype) {
      case DType::f32: quantize_row<DType::f32>(r, x.strides[2], W, q + i * W, scales + i); break;
      case DType::bf16: quantize_row<DType::bf16>(r, x.strides[2], W, q + i * W, scales + i); break;
      case DType::f16: quantize_row<DType::f16>(r, x.strides[2], W, q + i * W, scales + i); break;
      default: fail(ErrorCode::internal, std::string("quantize_rows: a ") + to_string(x.dtype) + " view");
    }
  });
  return {scratch, W, DType::u8, scales};
}

// A (B, N, W) view of the compute type whose rows are dense and evenly spaced is read in place as a 2-D (B*N, W)
// matrix; anything else (other strides, an f32 view into a bf16 layer and the reverse, or any view into a
// bf16 layer on f32 GEMMs) is converted contiguously into `scratch` first (O(B*N*W), once per call, across the team).
Rows as_rows(const TensorView& x, DType compute, DType operand, std::byte* scratch, int threads) {
  if (operand == DType::u8) return quantize_rows(x, scratch, threads);
  if (!needs_packing(x, compute, operand)) return {x.data, x.strides[1], operand};
  if (operand == compute) {
    convert(x, compute, scratch, threads);
  } else {
    convert_bf16_values(x, reinterpret_cast<float*>(scratch), threads);
  }
  return {scratch, x.shape[2], operand};
}

}  // namespace gpt2attn::detail
