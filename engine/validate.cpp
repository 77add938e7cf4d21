// engine/validate.cpp: the one check of a call's inputs (shapes, dtypes, strides, finiteness): forward's, shared by
// MultiHeadAttention::forward and the naive reference, and extend's and decode's. It never checks the Config or
// Weights (done at construction).
#include "engine/validate.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "engine/team.hpp"
#include "engine/util.hpp"
#include "gpt2attn/error.hpp"
#include "kernels/bf16.hpp"

namespace gpt2attn::detail {
namespace {

// Checks that hold for every view before its shape is read: a sane rank, no negative size or stride, no zero size
// (`dims` names the sizes that must be >= 1), and data behind the shape. A bad rank is reported before shape_str()
// is called, which indexes shape[0..rank). A zero size is reported before a null pointer: a zero-element array (an
// empty .npy file, whose std::vector::data() is null) is no null pointer to its user, and a null view let through
// would pass for an absent one below (empty() is data == nullptr), so a zero-length key and value would mean
// self-attention.
void check_view(const TensorView& v, const char* name, const char* dims) {
  if (v.rank < 0 || v.rank > 4) invalid(std::string(name) + ": rank must be in [0, 4], got " + str(v.rank));
  bool no_elements = false;
  for (int d = 0; d < v.rank; ++d) {
    if (v.shape[d] < 0) invalid(std::string(name) + ": negative size in shape " + v.shape_str());
    if (v.strides[d] < 0) {
      invalid(std::string(name) + ": negative stride " + str(v.strides[d]) + " in dimension " + str(d) +
              " (shape " + v.shape_str() + "); negative strides are not supported");
    }
    no_elements = no_elements || v.shape[d] == 0;
  }
  if (no_elements) {
    invalid(std::string(name) + ": shape " + v.shape_str() + " has no elements; " + dims + " must be >= 1");
  }
  if (v.data == nullptr && v.rank > 0) {
    invalid(std::string(name) + ": null data pointer with non-empty shape " + v.shape_str());
  }
}

// Activations (query, key, value) come as f32 or bf16, whatever the layer computes in: as_rows converts once.
void require_activation_dtype(const TensorView& v, const char* name) {
  if (v.dtype != DType::f32 && v.dtype != DType::bf16) {
    invalid(std::string(name) + ": expected dtype f32 or bf16, got " + to_string(v.dtype));
  }
}

void require_mask_dtype(const TensorView& v, const char* name) {
  if (v.dtype != DType::f32 && v.dtype != DType::u8) {
    invalid(std::string(name) + ": expected dtype u8 or f32, got " + to_string(v.dtype));
  }
}

// "(B, Tk, kdim) = (2, *, 16)": the symbolic shape and the values known at this point (`*` = free).
std::string expected_str(const char* symbols, std::initializer_list<int64_t> dims) {
  std::string s = std::string(symbols) + " = (";
  int i = 0;
  for (int64_t d : dims) s += (i++ ? ", " : "") + (d < 0 ? std::string("*") : str(d));
  return s + ")";
}

[[noreturn]] void bad_shape(const TensorView& v, const char* name, const std::string& expected) {
  invalid(std::string(name) + ": expected shape " + expected + ", got " + v.shape_str());
}

// The values of an f32 mask. An additive mask may hold -inf (that is how it blocks) but not NaN, and not +inf: +inf
// would make the row's softmax inf - inf = NaN, which no caller can mean. A float keep/block mask or key_padding
// reads nonzero as keep/block, which a NaN is too, but no caller means a NaN as a decision: refused too, rather than
// silently taken as one. `what` and `kind` name the mask (kind null for key_padding; the name is built only for the
// message, so a valid call allocates nothing here), `index_names` its indices for v.rank.
void check_mask_values(const TensorView& v, const char* what, const char* kind, bool additive,
                       const char* index_names) {
  if (v.dtype != DType::f32) return;  // u8: every value is a decision
  const auto* p = static_cast<const float*>(v.data);
  std::array<int64_t, 4> shape{1, 1, 1, 1}, strides{0, 0, 0, 0};
  const int lead = 4 - v.rank;  // right-align into 4 dimensions so one loop nest covers every rank
  for (int d = 0; d < v.rank; ++d) {
    shape[lead + d] = v.shape[d];
    strides[lead + d] = v.strides[d];
  }
  for (int64_t a = 0; a < shape[0]; ++a) {
    for (int64_t b = 0; b < shape[1]; ++b) {
      for (int64_t c = 0; c < shape[2]; ++c) {
        for (int64_t d = 0; d < shape[3]; ++d) {
          const float x = p[a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]];
          if (std::isnan(x) || (additive && x == INFINITY)) {
            const std::array<int64_t, 4> idx{a, b, c, d};
            std::string at;
            for (int k = lead; k < 4; ++k) at += (k > lead ? ", " : "") + str(idx[k]);
            const std::string name = kind ? std::string(what) + " (" + kind + ")" : std::string(what);
            invalid(name + " contains " + (std::isnan(x) ? "NaN" : "+Inf") + " at " + index_names + " = (" + at +
                    (additive ? "); only finite values and -inf are allowed" : "); a NaN neither keeps nor blocks"));
          }
        }
      }
    }
  }
}

}  // namespace

namespace {
// Elements below which a finiteness scan stays on the calling thread: starting a team costs a few microseconds,
// about what one thread takes to scan this many floats from cache.
constexpr int64_t kParallelScanElements = int64_t{1} << 16;

}  // namespace

namespace {

// The first non-finite element of a rank-3 f32 or bf16 view, scanned through its strides a row at a time: its row
// (b * T + t), column and value; row = B * T when there is none.
struct NonFinite {
  int64_t row = 0, column = 0;
  float value = 0.0f;
};
NonFinite first_nonfinite(const TensorView& v, int threads) {
  const int64_t T = v.shape[1], n = v.shape[2];
  const int64_t rows = checked_mul(v.shape[0], T, "the input's rows (B x T)");  // refused, not wrapped
  const int64_t elements = checked_mul(rows, n, "the input's elements (B x T x width)");
  const int64_t sB = v.strides[0], sT = v.strides[1], sE = v.strides[2];
  const bool f32 = v.dtype != DType::bf16;
  const auto offset = [&](int64_t r) { return r / T * sB + r % T * sT; };  // row r = (b, t) = (r / T, r % T)
  const auto row_bad = [&](int64_t r) {
    return f32 ? any_nonfinite<DType::f32>(v.data, offset(r), n, sE)
               : any_nonfinite<DType::bf16>(v.data, offset(r), n, sE);
  };
  // The first bad row: with a team, the least of every thread's finds (the same row a serial scan stops at).
  int64_t first = rows;
  if (threads > 1 && elements >= kParallelScanElements) {
    // A few chunks of rows per thread, taken dynamically; each chunk stops at its first bad row.
    std::atomic<int64_t> least{rows};
    const int64_t chunk = ceil_div(rows, int64_t{threads} * 8);
    team_for(threads, ceil_div(rows, chunk), [&](int64_t c, int) {
      for (int64_t r = c * chunk; r < std::min(rows, (c + 1) * chunk); ++r) {
        if (!row_bad(r)) continue;
        for (int64_t seen = least.load(); r < seen && !least.compare_exchange_weak(seen, r);) {
        }
        return;
      }
    });
    first = least.load();
  } else {
    for (int64_t r = 0; r < rows && first == rows; ++r) {
      if (row_bad(r)) first = r;
    }
  }
  if (first == rows) return {rows, 0, 0.0f};
  for (int64_t e = 0;; ++e) {  // the row's first offender
    const int64_t at = offset(first) + e * sE;
    const float x = f32 ? static_cast<const float*>(v.data)[at]
                        : kernels::widen(static_cast<const kernels::bf16*>(v.data)[at]);
    if (!std::isfinite(x)) return {first, e, x};
  }
}

const char* nonfinite_name(float x) { return std::isnan(x) ? "NaN" : (x > 0 ? "+Inf" : "-Inf"); }

}  // namespace

void check_finite(const TensorView& v, const char* name, const char* len_symbol, int threads) {
  const NonFinite bad = first_nonfinite(v, threads);
  if (bad.row == v.shape[0] * v.shape[1]) return;
  const int64_t T = v.shape[1];
  invalid(std::string(name) + " contains " + nonfinite_name(bad.value) + " at (b, " + len_symbol + ", e) = (" +
          str(bad.row / T) + ", " + str(bad.row % T) + ", " + str(bad.column) + ")");
}

void check_projection(const void* y, DType dtype, int64_t rows, int64_t n, int64_t ld, const char* projection,
                      int64_t col0, int threads) {
  const TensorView v = TensorView::contiguous(y, dtype, {1, rows, n}).with_strides({0, ld, 1});
  const NonFinite bad = first_nonfinite(v, threads);
  if (bad.row == rows) return;
  invalid(std::string(projection) + " projection overflowed: its output (row " + str(bad.row) + ", column " +
          str(col0 + bad.column) + ") is " + nonfinite_name(bad.value) +
          " from finite inputs and weights (values past float32's range, 3.4e38); scale the inputs down");
}

void check_threads(int64_t threads, const char* call, const char* field) {
  if (threads < 0 || threads > max_threads()) {
    invalid(std::string(call) + ": " + field + ": expected 0 (the default) to " + str(max_threads()) +
            " (gpt2attn::max_threads()), got " + str(threads));
  }
}

int threads_or_default(int threads) {
  return threads > 0 ? threads : std::min(omp_get_max_threads(), max_threads());
}

AttnShape shape_of(const Config& config) {
  AttnShape s;
  s.E = config.d_model;
  s.H = config.num_heads;
  s.H_kv = config.kv_heads();
  s.D = config.head_dim();
  s.d_in = config.query_width();
  s.kdim = config.key_width();
  s.vdim = config.value_width();
  return s;
}

AttnShape validate_inputs(const Config& config, const AttentionInputs& in, const RunOptions& run, int threads) {
  check_threads(run.threads, "forward", "run.threads");

  AttnShape s = shape_of(config);

  // query (B, T, d_in)
  const TensorView& q = in.query;
  check_view(q, "query", "B, T and the width d_in");
  if (q.empty()) invalid("query: missing; expected a (B, T, d_in) f32 or bf16 tensor");
  require_activation_dtype(q, "query");
  if (q.rank != 3) {
    invalid("query: expected rank 3 (B, T, d_in), got rank " + str(q.rank) + " with shape " + q.shape_str());
  }
  if (q.shape[2] != s.d_in) bad_shape(q, "query", expected_str("(B, T, d_in)", {-1, -1, s.d_in}));
  if (q.shape[0] < 1 || q.shape[1] < 1) {
    invalid("query: batch B and length T must be >= 1, got shape " + q.shape_str());
  }
  s.B = q.shape[0];
  s.T = q.shape[1];
  if (s.T > config.context_length) {
    invalid("query: sequence length T=" + str(s.T) + " exceeds context_length=" + str(config.context_length));
  }

  // key (B, Tk, kdim) and value (B, Tk, vdim), both or neither
  const TensorView &k = in.key, &v = in.value;
  check_view(k, "key", "B, Tk and the width kdim");
  check_view(v, "value", "B, Tk and the width vdim");
  if (k.empty() != v.empty()) {
    invalid(k.empty() ? "value given without key: pass both for cross-attention, or neither for self-attention"
                      : "key given without value: pass both for cross-attention, or neither for self-attention");
  }
  s.self_attention = k.empty();
  if (s.self_attention) {
    // key = value = query, so the key/value projections must accept the query's width.
    if (config.key_width() != s.d_in || config.value_width() != s.d_in) {
      invalid("key/value: missing, but self-attention needs kdim = vdim = d_in; config has d_in=" + str(s.d_in) +
              ", kdim=" + str(config.key_width()) + ", vdim=" + str(config.value_width()));
    }
    s.Tk = s.T;
    s.kdim = s.vdim = s.d_in;
  } else {
    require_activation_dtype(k, "key");
    require_activation_dtype(v, "value");
    if (k.rank != 3) {
      invalid("key: expected rank 3 (B, Tk, kdim), got rank " + str(k.rank) + " with shape " + k.shape_str());
    }
    if (k.shape[0] != s.B || k.shape[2] != s.kdim) {
      bad_shape(k, "key", expected_str("(B, Tk, kdim)", {s.B, -1, s.kdim}));
    }
    if (k.shape[1] < 1) invalid("key: length Tk must be >= 1, got shape " + k.shape_str());
    s.Tk = k.shape[1];
    if (v.rank != 3) {
      invalid("value: expected rank 3 (B, Tk, vdim), got rank " + str(v.rank) + " with shape " + v.shape_str());
    }
    if (v.shape[0] != s.B || v.shape[1] != s.Tk || v.shape[2] != s.vdim) {
      bad_shape(v, "value", expected_str("(B, Tk, vdim)", {s.B, s.Tk, s.vdim}) + " (B from query, Tk from key)");
    }
    if (s.Tk > config.context_length) {
      invalid("key: sequence length Tk=" + str(s.Tk) + " exceeds context_length=" + str(config.context_length));
    }
  }

  // attn_mask: exactly (T, Tk), (B, T, Tk) or (B, H, T, Tk); broadcasting beyond that is the caller's strides.
  const TensorView& m = in.attn_mask;
  check_view(m, "attn_mask", "T, Tk and, where present, B and H");
  if (!m.empty()) {
    require_mask_dtype(m, "attn_mask");
    if (in.mask_kind == MaskKind::additive && m.dtype != DType::f32) {
      invalid(std::string("attn_mask: mask_kind additive requires dtype f32, got ") + to_string(m.dtype) +
              " (use keep or block for a boolean mask)");
    }
    // The message is built only on error: a valid call allocates nothing here.
    const auto refuse = [&] {
      bad_shape(m, "attn_mask",
                expected_str("(T, Tk)", {s.T, s.Tk}) + ", " + expected_str("(B, T, Tk)", {s.B, s.T, s.Tk}) + " or " +
                    expected_str("(B, H, T, Tk)", {s.B, s.H, s.T, s.Tk}));
    };
    switch (m.rank) {
      case 2:
        if (m.shape[0] != s.T || m.shape[1] != s.Tk) refuse();
        break;
      case 3:
        if (m.shape[0] != s.B || m.shape[1] != s.T || m.shape[2] != s.Tk) refuse();
        break;
      case 4:
        if (m.shape[0] != s.B || m.shape[1] != s.H || m.shape[2] != s.T || m.shape[3] != s.Tk) refuse();
        break;
      default: refuse();
    }
    s.mask_rank = m.rank;
  }

  // key_padding (B, Tk), nonzero = padding
  const TensorView& kp = in.key_padding;
  check_view(kp, "key_padding", "B and Tk");
  if (!kp.empty()) {
    require_mask_dtype(kp, "key_padding");
    if (kp.rank != 2 || kp.shape[0] != s.B || kp.shape[1] != s.Tk) {
      bad_shape(kp, "key_padding", expected_str("(B, Tk)", {s.B, s.Tk}));
    }
    s.key_padding = true;
  }

  // An output that could never exist (B x T x E floats past the machine's memory) is refused before the scans below
  // read the input it implies: nothing else bounds B. The memory is asked only past 1 GiB (sysconf makes a system
  // call), so an ordinary call pays a multiplication.
  const int64_t out_bytes = checked_product({s.B, s.T, config.d_model, int64_t{4}}, "the output (B, T, E)");
  if (out_bytes > int64_t{1} << 30) check_fits_in_memory(out_bytes, "the output (B, T, E)");

  // Last, because it reads every element: the shapes above guarantee the scans stay in bounds.
  if (run.check_finite) {
    check_finite(q, "query", "t", threads);
    if (!s.self_attention) {
      check_finite(k, "key", "j", threads);
      check_finite(v, "value", "j", threads);
    }
    static const char* const kMaskIndices[5] = {"", "", "(t, j)", "(b, t, j)", "(b, h, t, j)"};
    if (!m.empty()) {
      check_mask_values(m, "attn_mask", to_string(in.mask_kind), in.mask_kind == MaskKind::additive,
                        kMaskIndices[m.rank]);
    }
    if (!kp.empty()) check_mask_values(kp, "key_padding", nullptr, false, "(b, j)");
  }
  return s;
}

namespace {

// What extend and decode share: the cache fits the layer, inference mode, threads, pointers and x's values.
AttnShape serving_shape(const Config& config, const KvCache& cache, const float* x, int64_t B, int64_t T,
                        const float* out, const RunOptions& run, int threads, const char* call) {
  const Config& c = cache.config();
  if (c.d_model != config.d_model || c.num_heads != config.num_heads || c.kv_heads() != config.kv_heads()) {
    invalid(std::string(call) + ": the KV cache was built for E=" + str(c.d_model) + ", H=" + str(c.num_heads) +
            ", H_kv=" + str(c.kv_heads()) + " but the layer has E=" + str(config.d_model) + ", H=" +
            str(config.num_heads) + ", H_kv=" + str(config.kv_heads()));
  }
  if (run.training) invalid(std::string(call) + ": the KV cache is for inference; RunOptions.training must be false");
  check_threads(run.threads, call, "run.threads");
  if (!x) invalid(std::string(call) + ": x is a null pointer");
  if (!out) invalid(std::string(call) + ": out is a null pointer");
  AttnShape s = shape_of(config);
  s.B = B;
  s.T = T;
  if (run.check_finite) check_finite(TensorView::f32(x, {B, T, s.d_in}), "x", "t", threads);
  return s;
}

}  // namespace

AttnShape validate_extend(const Config& config, const KvCache& cache, const float* x, int64_t T, const float* out,
                          const RunOptions& run, int threads) {
  if (T < 1) invalid("extend: T must be >= 1, got " + str(T));
  if (T > config.context_length) {
    invalid("extend: T=" + str(T) + " new tokens exceed context_length=" + str(config.context_length));
  }
  return serving_shape(config, cache, x, 1, T, out, run, threads, "extend");
}

AttnShape validate_decode(const Config& config, const KvCache& cache, const SequenceId* seqs, int64_t B,
                          const float* x, const float* out, const RunOptions& run, int threads) {
  if (B < 1) invalid("decode: B must be >= 1, got " + str(B));
  if (!seqs) invalid("decode: seqs is a null pointer");
  return serving_shape(config, cache, x, B, 1, out, run, threads, "decode");
}

AttnShape validate_step(const Config& config, const KvCache& cache, const SequenceId* seqs, const int64_t* tokens,
                        int64_t n, const float* x, const float* out, const RunOptions& run, int threads) {
  if (n < 1) invalid("step: n (entries) must be >= 1, got " + str(n));
  if (!seqs) invalid("step: seqs is a null pointer");
  if (!tokens) invalid("step: tokens is a null pointer");
  int64_t total = 0;  // at most n * context_length: each term is bounded first
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 1 || tokens[i] > config.context_length) {
      invalid("step: entry " + str(i) + " (sequence " + str(seqs[i]) + ") has tokens=" + str(tokens[i]) +
              "; expected 1 <= tokens <= context_length=" + str(config.context_length));
    }
    total = checked_add(total, tokens[i], "step: the step's tokens");
  }
  return serving_shape(config, cache, x, 1, total, out, run, threads, "step");
}

}  // namespace gpt2attn::detail
