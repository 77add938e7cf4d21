// tests/test_util.hpp: helpers for tests that run MultiHeadAttention against reference_forward: seeded random
// fill, owned tensors laid out through arbitrary strides, owned AttentionInputs, and the fast-vs-reference check.
// Test-only. It sets no tolerance of its own: every comparison goes through tests/tolerance.hpp.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpt2attn/attention.hpp"
#include "gpt2attn/reference.hpp"
#include "kernels/bf16.hpp"
#include "tests/tolerance.hpp"

namespace gpt2attn {
// gtest prints a parameter through this instead of as raw bytes ("where GetParam() = avx2").
inline void PrintTo(Isa isa, std::ostream* os) { *os << to_string(isa); }
}  // namespace gpt2attn

namespace gpt2attn::test {

// A small causal self-attention config (E = 16, H = 2) for tests of the pool, limits and bookkeeping.
inline Config small_causal_config(int64_t context = 64) {
  Config c;
  c.d_model = 16;
  c.num_heads = 2;
  c.context_length = context;
  c.causal = true;
  return c;
}

// n floats uniform in [lo, hi), drawn from `rng` (seed it with a fixed value so failures reproduce).
inline std::vector<float> random_uniform(size_t n, std::mt19937_64& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// How a logical row-major tensor sits in memory. Strides are built innermost first, in memory order:
// the innermost dimension steps by elem_stride, every other by (span of the inner ones + pad[d]).
struct Layout {
  int64_t elem_stride = 1;          // 2 = every other element
  std::array<int64_t, 4> pad{};     // pad[d]: extra elements added to logical dimension d's stride (row/batch gaps)
  std::array<bool, 4> broadcast{};  // broadcast[d]: stride 0, every index reads index 0's data
  bool transpose_last2 = false;     // the last two dimensions swapped in memory (column-major matrices)

  bool contiguous() const {
    return elem_stride == 1 && !transpose_last2 && pad == std::array<int64_t, 4>{} &&
           broadcast == std::array<bool, 4>{};
  }
  std::string str() const {
    if (contiguous()) return "contiguous";
    std::ostringstream s;
    s << "strided(elem " << elem_stride << ", pad " << pad[0] << "/" << pad[1] << "/" << pad[2] << "/" << pad[3];
    for (int d = 0; d < 4; ++d) {
      if (broadcast[d]) s << ", bcast dim " << d;
    }
    if (transpose_last2) s << ", transposed";
    return s.str() + ")";
  }
};

// A tensor that owns its storage; `view` reads it through the layout's strides. Elements no view index reaches
// hold a poison value (NaN for f32), so a kernel that reads a gap produces NaN instead of passing by luck.
// Copies re-point the view at their own storage (moves keep it: a moved vector keeps its buffer).
struct OwnedTensor {
  std::vector<float> f32;
  std::vector<uint8_t> u8;
  TensorView view;  // empty (data == nullptr) when the tensor is absent

  OwnedTensor() = default;
  OwnedTensor(const OwnedTensor& o) : f32(o.f32), u8(o.u8), view(o.view) { rebind(); }
  OwnedTensor& operator=(const OwnedTensor& o) {
    f32 = o.f32, u8 = o.u8, view = o.view;
    rebind();
    return *this;
  }
  OwnedTensor(OwnedTensor&&) noexcept = default;
  OwnedTensor& operator=(OwnedTensor&&) noexcept = default;

 private:
  void rebind() {
    if (view.data) view.data = view.dtype == DType::f32 ? static_cast<const void*>(f32.data()) : u8.data();
  }
};

inline constexpr uint8_t kPoisonU8 = 0xA5;

// Lays out `logical` (row-major with `shape`) per `layout`. For DType::u8 each value is cast to uint8_t.
inline OwnedTensor make_tensor(const std::vector<float>& logical, const std::vector<int64_t>& shape, DType dtype,
                               const Layout& layout = {}) {
  const int r = static_cast<int>(shape.size());
  std::array<int, 4> order{0, 1, 2, 3};  // memory order, outermost first
  if (layout.transpose_last2 && r >= 2) std::swap(order[r - 2], order[r - 1]);
  std::array<int64_t, 4> strides{};
  int64_t span = 1;  // elements from the first to the last one the inner dimensions reach, inclusive
  bool innermost = true;
  for (int k = r - 1; k >= 0; --k) {
    const int d = order[k];
    if (layout.broadcast[d]) continue;
    strides[d] = innermost ? layout.elem_stride : span + layout.pad[d];
    innermost = false;
    span += (shape[d] - 1) * strides[d];
  }

  OwnedTensor t;
  t.view.dtype = dtype;
  t.view.rank = r;
  int64_t n = 1;
  for (int d = 0; d < r; ++d) {
    t.view.shape[d] = shape[d];
    t.view.strides[d] = strides[d];
    n *= shape[d];
  }
  if (static_cast<int64_t>(logical.size()) != n) throw std::logic_error("make_tensor: logical size != shape");
  if (dtype == DType::f32) {
    t.f32.assign(static_cast<size_t>(span), std::numeric_limits<float>::quiet_NaN());
  } else {
    t.u8.assign(static_cast<size_t>(span), kPoisonU8);
  }
  std::array<int64_t, 4> idx{};
  for (int64_t lin = 0; lin < n; ++lin) {
    int64_t rest = lin, off = 0;
    for (int d = r - 1; d >= 0; --d) {
      idx[d] = rest % shape[d];
      rest /= shape[d];
    }
    bool first_of_broadcast = true;  // a broadcast dimension keeps index 0's value
    for (int d = 0; d < r; ++d) {
      if (layout.broadcast[d] && idx[d] != 0) first_of_broadcast = false;
      off += idx[d] * strides[d];
    }
    if (!first_of_broadcast) continue;
    if (dtype == DType::f32) {
      t.f32[off] = logical[lin];
    } else {
      t.u8[off] = static_cast<uint8_t>(logical[lin]);
    }
  }
  t.view.data = dtype == DType::f32 ? static_cast<const void*>(t.f32.data()) : static_cast<const void*>(t.u8.data());
  return t;
}

// Everything one forward call reads, owned. Movable; inputs() is valid while this object lives.
struct OwnedInputs {
  OwnedTensor query, key, value, attn_mask, key_padding;
  MaskKind mask_kind = MaskKind::keep;

  AttentionInputs inputs() const {
    AttentionInputs in;
    in.query = query.view;
    in.key = key.view;
    in.value = value.view;
    in.attn_mask = attn_mask.view;
    in.mask_kind = mask_kind;
    in.key_padding = key_padding.view;
    return in;
  }
};

// The tolerance policy's reduction length: the longest dot product or sum behind an output element.
inline int64_t reduction_length(const Config& c, int64_t Tk) {
  return std::max({c.query_width(), c.key_width(), c.value_width(), c.d_model, Tk});
}

inline std::string describe(const Config& c) {
  std::ostringstream s;
  s << "E=" << c.d_model << " H=" << c.num_heads << " D=" << c.head_dim() << " d_in=" << c.query_width()
    << " kdim=" << c.key_width() << " vdim=" << c.value_width() << " qkv_bias=" << c.qkv_bias
    << " out_bias=" << c.out_bias << " causal=" << c.causal << " dropout=" << c.dropout
    << " context=" << c.context_length;
  return s.str();
}

// Runs the fast path into a NaN-filled (B, T, E) buffer, so an element the layer never writes cannot pass.
inline std::vector<float> run_fast(MultiHeadAttention& layer, const AttentionInputs& in, const RunOptions& run = {}) {
  const int64_t B = in.query.shape[0], T = in.query.shape[1];
  std::vector<float> out(static_cast<size_t>(B * T * layer.config().d_model), std::numeric_limits<float>::quiet_NaN());
  layer.forward(in, out.data(), run);
  return out;
}

// The label every fast-path failure carries: the ISA the layer really runs, threads, and the caller's context.
inline std::string fast_context(const MultiHeadAttention& layer, const RunOptions& run, const std::string& what) {
  std::ostringstream s;
  s << "[isa=" << to_string(layer.isa()) << " threads=" << (run.threads > 0 ? run.threads : layer.default_threads())
    << "] " << what;
  return s.str();
}

// x rounded to the nearest bf16 (ties to even), as f32: the value a bf16 layer computes with.
inline float round_bf16(float x) { return kernels::widen(kernels::to_bf16(x)); }
inline void round_bf16(std::vector<float>& v) {
  for (float& x : v) x = round_bf16(x);
}
// The weights a bf16 layer holds: each rounded once.
inline Weights rounded_bf16(Weights w) {
  for (auto* v : {&w.w_q, &w.w_k, &w.w_v, &w.b_q, &w.b_k, &w.b_v, &w.w_o, &w.b_o}) round_bf16(*v);
  return w;
}
// The query, key and value a bf16 layer reads: each rounded once (masks are not: they meet f32 scores).
inline OwnedInputs rounded_bf16(OwnedInputs in) {
  for (OwnedTensor* t : {&in.query, &in.key, &in.value}) round_bf16(t->f32);
  return in;
}

// Runs `layer` and reference_forward on the same inputs and compares with the one tolerance policy.
// `weights` must be the ones `layer` was built from. Flat indices in the message are into (B, T, E), row-major.
inline ::testing::AssertionResult fast_matches_reference(MultiHeadAttention& layer, const Weights& weights,
                                                         const AttentionInputs& in, const RunOptions& run,
                                                         const std::string& what) {
  const Config& c = layer.config();
  const int64_t Tk = in.key.empty() ? in.query.shape[1] : in.key.shape[1];
  const std::string ctx = fast_context(layer, run, what) + " | out " + in.query.shape_str() +
                          "->E=" + std::to_string(c.d_model) + " | " + describe(c);
  const std::vector<double> expected = reference_forward(c, weights, in, run);
  const std::vector<float> got = run_fast(layer, in, run);
  return all_close(got, expected, Dtype::f32, reduction_length(c, Tk), ctx);
}

// A bf16 layer against the reference on what it computes with (the weights and the query/key/value rounded to bf16
// once), at the bf16 policy: what is left is the layer's own roundings (Q, K, V, P and the attention output) and
// f32 arithmetic; then against the reference on the plain f32 inputs, at the looser bound that adds the rounding
// of the inputs and weights. `weights` and `in` are the unrounded ones the layer was given.
inline ::testing::AssertionResult bf16_matches_reference(MultiHeadAttention& layer, const Weights& weights,
                                                         const OwnedInputs& in, const RunOptions& run,
                                                         const std::string& what) {
  const Config& c = layer.config();
  const AttentionInputs view = in.inputs();
  const int64_t Tk = view.key.empty() ? view.query.shape[1] : view.key.shape[1];
  const std::string ctx = fast_context(layer, run, what) + " | bf16 | out " + view.query.shape_str() +
                          "->E=" + std::to_string(c.d_model) + " | " + describe(c);
  const OwnedInputs rounded = rounded_bf16(in);
  const std::vector<double> expected = reference_forward(c, rounded_bf16(weights), rounded.inputs(), run);
  const std::vector<float> got = run_fast(layer, view, run);
  const int64_t K = reduction_length(c, Tk);
  const ::testing::AssertionResult own = all_close(got, expected, Dtype::bf16, K, ctx + " | vs rounded inputs");
  if (!own) return own;
  const std::vector<double> plain = reference_forward(c, weights, view, run);
  return all_close_within(got, plain, [&](double m) { return bf16_unrounded_tolerance(K, m); },
                          ctx + " | vs f32 inputs");
}

// The random choices of the configuration sweeps: fixed seeds, so a failure reproduces.
class Rng {
 public:
  explicit Rng(uint64_t seed) : g(seed) {}
  int64_t between(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
  bool chance(double p) { return std::bernoulli_distribution(p)(g); }
  template <class T, size_t N>
  T pick(const T (&a)[N]) {
    return a[between(0, N - 1)];
  }
  template <class T>
  T pick(const std::vector<T>& a) {
    return a[static_cast<size_t>(between(0, static_cast<int64_t>(a.size()) - 1))];
  }
  std::mt19937_64 g;
};

// An unsigned integer from the environment (decimal, or hex with 0x), or `fallback` when unset or empty: the sizes and
// seeds of the long suites (GPT2ATTN_SWEEP_*, GPT2ATTN_SOAK_*). A value that is not a whole integer (or is 0 where
// `positive`, or above `max`) is reported in `error` rather than silently defaulted.
inline uint64_t env_uint(const char* name, uint64_t fallback, bool positive, uint64_t max, std::string& error) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(v, &end, 0);
  if (errno || *end || v[0] == '-' || (positive && x == 0) || x > max) {
    error = std::string(name) + "='" + v + "' is not a " + (positive ? "positive " : "") + "integer up to " +
            std::to_string(max);
    return fallback;
  }
  return x;
}

}  // namespace gpt2attn::test
