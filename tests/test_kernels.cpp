// tests/test_kernels.cpp: every kernel instance against a plain double-precision loop on pre-projected Q/K/V, on
// every instruction set this CPU runs: the tiled attention kernel on contiguous (strided, NaN-padded) and on paged
// K/V, the split-KV decode kernel merged with merge_softmax_partials, and the few-row linear kernel. No GEMM sits
// between the data and the kernel, so a kernel error cannot hide behind oneDNN's rounding. It does not test the
// engine's planning, threads or validation (test_fastpath_*.cpp and test_kv_cache_*.cpp do).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/convert.hpp"
#include "engine/dispatch.hpp"
#include "engine/quantized.hpp"
#include "kernels/attention.hpp"
#include "kernels/bf16.hpp"
#include "kernels/kv_codec.hpp"
#include "kernels/decode_attention.hpp"
#include "kernels/dropout.hpp"
#include "kernels/linear.hpp"
#include "kernels/tiles.hpp"
#include "kernels/vec_probe.hpp"
#include "tests/isa_param.hpp"
#include "tests/test_util.hpp"

namespace gpt2attn {
namespace {

using test::all_close;
using test::all_close_over_cache;
using test::Dtype;
using test::random_uniform;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr float kSentinel = -12345.5f;  // fills memory a kernel must not write: row gaps, the scratch guard
constexpr int64_t kGuard = 64;          // sentinel floats after each scratch slice
constexpr int kMaxReported = 8;         // failing cases printed in full per test; the rest are only counted

// =============================================================================================================
// Naive references: plain loops with double accumulation, on dense row-major data.

struct NaiveDropout {
  float p = 0.0f;  // 0 = off
  uint64_t seed = 0;
  int64_t bh = 0;  // b*H + h of the slice, for the draw index
};

// One head's attention. q (T, D), k and v (Tk, D); bias (T, Tk), or empty for none, holds the additive mask and
// -inf wherever a key is masked (keep == 0, block != 0, key padding != 0, causal j > i + Tk - T):
//   s_ij  = scale * q_i . k_j + bias_ij
//   p_ij  = exp(s_ij - max_j s_ij) / sum_j exp(s_ij - max_j s_ij);   p_i = 0 when every s_ij is -inf
//   with dropout (include/gpt2attn/attention.hpp's contract):
//   p_ij *= [dropout_uniform(seed, ((b*H + h)*T + i)*Tk + j) >= p] / (1 - p)
//   out_i = sum_j p_ij v_j
std::vector<double> naive_attention(const std::vector<float>& q, const std::vector<float>& k,
                                    const std::vector<float>& v, int64_t T, int64_t Tk, int64_t D,
                                    const std::vector<double>& bias, double scale, const NaiveDropout& drop = {}) {
  std::vector<double> out(static_cast<size_t>(T * D), 0.0), s(static_cast<size_t>(Tk));
  for (int64_t i = 0; i < T; ++i) {
    double mx = kNegInf;
    for (int64_t j = 0; j < Tk; ++j) {
      double dot = 0.0;
      for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[i * D + d]) * k[j * D + d];
      s[j] = scale * dot + (bias.empty() ? 0.0 : bias[i * Tk + j]);
      mx = std::max(mx, s[j]);
    }
    if (mx == kNegInf) continue;  // every key masked: a zero row
    double sum = 0.0;
    for (int64_t j = 0; j < Tk; ++j) sum += (s[j] = std::exp(s[j] - mx));
    for (int64_t j = 0; j < Tk; ++j) {
      double p = s[j] / sum;
      if (drop.p > 0.0f) {
        const auto n = static_cast<uint64_t>((drop.bh * T + i) * Tk + j);
        p *= kernels::dropout_uniform(drop.seed, n) >= drop.p ? 1.0 / (1.0 - drop.p) : 0.0;
      }
      for (int64_t d = 0; d < D; ++d) out[i * D + d] += p * v[j * D + d];
    }
  }
  return out;
}

// y (M, N) = x (M, K) W^T + b:   y_mn = sum_k x_mk w_nk + b_n   (W (N, K) row-major; b = 0 when absent)
std::vector<double> naive_linear(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& b,
                                 int64_t M, int64_t N, int64_t K) {
  std::vector<double> y(static_cast<size_t>(M * N));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double acc = b.empty() ? 0.0 : b[n];
      for (int64_t k = 0; k < K; ++k) acc += static_cast<double>(x[m * K + k]) * w[n * K + k];
      y[m * N + n] = acc;
    }
  }
  return y;
}

// The tolerance's reduction length by test_util.hpp's rule (the longest dot product or sum behind an output
// element) for one head of width D over Tk keys: a one-head layer of width D, so max(D, Tk).
int64_t reduction_for_head(int64_t D, int64_t Tk) {
  Config c;
  c.d_model = D;
  c.num_heads = 1;
  return test::reduction_length(c, Tk);
}

// =============================================================================================================
// Memory as the kernels see it: strided rows with poisoned gaps, paged blocks, guarded scratch.

// Dense (rows, D) laid out with row stride ld >= D; the gaps hold NaN, so a stray read poisons the result.
std::vector<float> strided(const std::vector<float>& dense, int64_t rows, int64_t D, int64_t ld) {
  std::vector<float> mem(static_cast<size_t>(rows * ld), kNaN);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(dense.begin() + r * D, D, mem.begin() + r * ld);
  return mem;
}

// An output of (rows, D) with row stride ld: NaN where the kernel must write (an element it skips cannot pass),
// the sentinel in the gaps (which it must leave alone).
std::vector<float> output_buffer(int64_t rows, int64_t D, int64_t ld) {
  std::vector<float> mem(static_cast<size_t>(rows * ld), kSentinel);
  for (int64_t r = 0; r < rows; ++r) std::fill_n(mem.begin() + r * ld, D, kNaN);
  return mem;
}

std::vector<float> unstrided(const std::vector<float>& mem, int64_t rows, int64_t D, int64_t ld) {
  std::vector<float> dense(static_cast<size_t>(rows * D));
  for (int64_t r = 0; r < rows; ++r) std::copy_n(mem.begin() + r * ld, D, dense.begin() + r * D);
  return dense;
}

// Gap elements (columns [D, ld) of each row) that no longer hold the sentinel.
int64_t gap_writes(const std::vector<float>& mem, int64_t rows, int64_t D, int64_t ld) {
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = D; c < ld; ++c) n += mem[r * ld + c] != kSentinel;
  return n;
}

// A scratch slice of `floats` NaN (a read before write poisons the result), then kGuard sentinels (a write past
// the size the kernel asked for shows).
std::vector<float> scratch_slice(size_t floats) {
  std::vector<float> s(floats + kGuard, kNaN);
  std::fill(s.begin() + static_cast<int64_t>(floats), s.end(), kSentinel);
  return s;
}
bool guard_intact(const std::vector<float>& s, size_t floats) {
  return std::all_of(s.begin() + static_cast<int64_t>(floats), s.end(), [](float x) { return x == kSentinel; });
}

// The T query rows of `a` through `kern` one call per query tile, the last tile first, as the engine schedules tiles
// that each make their own work item (one scratch slice throughout).
void run_tile_by_tile(const kernels::AttentionKernel& kern, const kernels::AttentionArgs& a, int64_t T,
                      float* scratch) {
  const int64_t BQ = kern.tiles.query_tile;
  for (int64_t q0 = (T - 1) / BQ * BQ; q0 >= 0; q0 -= BQ) kern.run(a, q0, std::min(q0 + BQ, T), scratch);
}

// A float whose two halves are both bf16 NaNs (0x7fc0): pool gaps read as f32 or as bf16 are NaN either way, and
// an int8 row read from a gap meets a NaN scale.
float pool_nan() {
  const uint32_t u = 0x7fc07fc0u;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rounds the rows of x (n, D) to what a K/V block of `dtype` holds, through the cache's own codec (bf16: nearest
// even; int8: quantised with the row's scale), so the naive loops read exactly the values the kernel reads: the
// storage rounding is the cache's, not the kernel's, error.
void round_to_storage(std::vector<float>& x, int64_t D, DType dtype) {
  const kernels::KvLayout one{dtype, 1, 1, D};
  std::vector<std::byte> block(static_cast<size_t>(one.block_bytes()));
  for (size_t i = 0; i < x.size(); i += static_cast<size_t>(D)) {
    kernels::store_kv_row(one, block.data(), kernels::KvPart::key, 0, 0, x.data() + i);
    kernels::load_kv_row(one, block.data(), kernels::KvPart::key, 0, 0, x.data() + i);
  }
}

// K/V of H heads in the KV cache's block layout (kernels/kv_layout.hpp), elements f32, bf16 or int8: a block holds
// K [H][bt][D] then V [H][bt][D] (then int8's scales). The blocks sit in one pool in shuffled order with a gap
// between neighbours; every element no written (head, token) row covers stays NaN.
struct PagedStore {
  kernels::KvLayout layout;
  int64_t stride = 0;  // floats from one block's slot in the pool to the next
  std::vector<float> pool;
  std::vector<int64_t> slot;             // slot[b]: where block b of the sequence sits in the pool
  std::vector<const std::byte*> table;  // table[b]: block b, as the kernels receive it

  PagedStore() = default;
  PagedStore(int64_t heads, int64_t head_dim, int64_t block_tokens, int64_t tokens, std::mt19937_64& rng,
             DType dtype = DType::f32)
      : layout{dtype, heads, block_tokens, head_dim},
        stride((layout.block_bytes() + 3) / 4 + 7) {
    const int64_t blocks = (tokens + block_tokens - 1) / block_tokens;
    pool.assign(static_cast<size_t>(blocks * stride), pool_nan());
    for (int64_t b = 0; b < blocks; ++b) slot.push_back(b);
    std::shuffle(slot.begin(), slot.end(), rng);
    for (int64_t b = 0; b < blocks; ++b) table.push_back(block(b));
  }
  // table points into pool: movable (a moved vector keeps its buffer), never copied.
  PagedStore(PagedStore&&) = default;
  PagedStore& operator=(PagedStore&&) = default;
  PagedStore(const PagedStore&) = delete;
  PagedStore& operator=(const PagedStore&) = delete;

  std::byte* block(int64_t b) { return reinterpret_cast<std::byte*>(pool.data() + slot[b] * stride); }
  // Stores token j's K and V rows (D values each, from the dense (tokens, D) arrays, already round_to_storage'd)
  // for head h.
  void put(int64_t h, int64_t j, const std::vector<float>& k, const std::vector<float>& v) {
    const int64_t bt = layout.block_tokens, D = layout.D;
    for (auto [part, src] : {std::pair{kernels::KvPart::key, &k}, std::pair{kernels::KvPart::value, &v}}) {
      kernels::store_kv_row(layout, block(j / bt), part, h, j % bt, src->data() + j * D);
    }
  }
};

// =============================================================================================================
// Failure reporting: every case runs; the first kMaxReported failures print in full (ISA, case, element), the
// rest are counted.

template <class Case, class Check>
void expect_all_cases(const std::string& isa, const std::vector<Case>& cases, Check&& check) {
  ASSERT_FALSE(cases.empty());
  int64_t failed = 0;
  for (const Case& c : cases) {
    const ::testing::AssertionResult r = check(c);
    if (!r && failed++ < kMaxReported) ADD_FAILURE() << r.message();
  }
  EXPECT_EQ(failed, 0) << "[isa=" << isa << "] " << failed << " of " << cases.size() << " cases failed (at most "
                       << kMaxReported << " shown above)";
}

// Every test is parameterised over the instruction set (tests/isa_param.hpp); the prefix "Kernel" makes
// --gtest_filter='Kernel*' select every test of this file. These drive the f32-compute kernels of one K/V dtype (f32
// unless a suite says otherwise); a level with no row of its own for them (avx512_bf16 has int8 K/V rows only, its
// f32 and bf16 K/V rows are avx512's) is skipped, not re-run: the bf16-compute rows are checked through the engine in
// test_fastpath_sweep.cpp. A suite over several K/V dtypes passes none and asks own_row per dtype.
class KernelTest : public test::IsaTest {
 protected:
  explicit KernelTest(std::optional<DType> kv = DType::f32) : kv_(kv) {}
  // Whether this level has an f32-compute row of its own for K/V dtype kv.
  bool own_row(DType kv) const { return detail::kernels_for(isa(), DType::f32, kv).isa == isa(); }
  void SetUp() override {
    test::IsaTest::SetUp();
    if (IsSkipped() || !kv_ || own_row(*kv_)) return;
    GTEST_SKIP() << to_string(isa()) << " has no f32-compute kernels of its own for " << to_string(*kv_)
                 << " K/V (it uses " << to_string(detail::kernels_for(isa(), DType::f32, *kv_).isa) << "'s)";
  }

 private:
  std::optional<DType> kv_;
};

// =============================================================================================================
// 1-2. The tiled attention kernel, contiguous and paged K/V.

enum class MaskVariant { none, additive_f32, keep_u8, block_u8, padding_u8, padding_f32, dropout };
constexpr MaskVariant kMaskVariants[] = {MaskVariant::none,     MaskVariant::additive_f32, MaskVariant::keep_u8,
                                         MaskVariant::block_u8, MaskVariant::padding_u8,   MaskVariant::padding_f32,
                                         MaskVariant::dropout};

// How each variant is stored, for failure messages. Rows i % 5 == 4 of the (T, Tk) masks mask every key; key 0 is
// always padding (with causal T == Tk, row 0 then sees nothing; with Tk = 1, no row does).
const char* describe(MaskVariant m) {
  switch (m) {
    case MaskVariant::none: return "none";
    case MaskVariant::additive_f32: return "additive f32 (column-major, stride_j T+2; 15% -inf; rows i%5==4 all -inf)";
    case MaskVariant::keep_u8: return "keep u8 (row stride Tk+3; 30% zero; rows i%5==4 all zero)";
    case MaskVariant::block_u8: return "block u8 (row stride Tk+3; 30% nonzero; rows i%5==4 all nonzero)";
    case MaskVariant::padding_u8: return "key padding u8 (key 0 and 30% padded)";
    case MaskVariant::padding_f32: return "key padding f32 (stride_j 2; key 0 and 30% padded)";
    case MaskVariant::dropout: return "dropout p=0.25 (b=1 h=2 of H=3)";
  }
  return "?";
}

constexpr float kDropoutP = 0.25f;
constexpr int64_t kDropoutBh = 1 * 3 + 2;           // (b, h) = (1, 2) of H = 3: a nonzero dropout_base
constexpr int64_t kPagedHeads = 3, kPagedHead = 1;  // paged K/V: the blocks hold 3 heads, the case reads head 1

struct AttnCase {
  int64_t T = 0, Tk = 0, D = 0;
  bool causal = false;
  MaskVariant mask = MaskVariant::none;
  int64_t block_tokens = 0;  // 0: contiguous K/V with the row strides below; else paged, blocks of this many keys
  bool one_call = false;     // run over [0, T) in one call; else one call per query tile, last tile first
  uint64_t seed = 0;
  DType kv = DType::f32;     // K/V element type (paged cases only: the cache's storage format)

  // Row strides past D (NaN gaps), odd so rows are misaligned for vector loads.
  int64_t ldq() const { return D + 3; }
  int64_t ldk() const { return D + 5; }
  int64_t ldv() const { return D + 1; }
  int64_t ldo() const { return D + 2; }

  std::string name() const {
    std::ostringstream s;
    s << "T=" << T << " Tk=" << Tk << " D=" << D;
    if (causal) {
      s << " causal(offset " << Tk - T << ")";
    } else {
      s << " non-causal";
    }
    s << " | mask " << describe(mask) << " | layout ";
    if (block_tokens == 0) {
      s << "contiguous(ldq=D+3 ldk=D+5 ldv=D+1 ldo=D+2)";
    } else {
      s << "paged(" << to_string(kv) << ", block_tokens=" << block_tokens << ", head " << kPagedHead << " of "
        << kPagedHeads << ", blocks shuffled; ldq=D+3 ldo=D+2)";
    }
    s << " | " << (one_call ? "one run() over [0, T)" : "one run() per query tile, last first") << " | seed " << seed;
    return s.str();
  }
};

// T and Tk around the tile edges: one row, a few, a query tile -1/0/+1, two key tiles + 3, and 113.
std::vector<int64_t> tile_lengths(const kernels::TileShape& t) {
  std::vector<int64_t> n = {1, 7, t.query_tile - 1, t.query_tile, t.query_tile + 1, 2 * t.key_tile + 3, 113};
  n.erase(std::remove_if(n.begin(), n.end(), [](int64_t x) { return x < 1; }), n.end());
  std::sort(n.begin(), n.end());
  n.erase(std::unique(n.begin(), n.end()), n.end());
  return n;
}

constexpr int64_t kHeadDims[] = {1, 3, 16, 64, 65, 128};

// Contiguous: every (T, Tk, D, causal) with every mask variant. Paged: every (T, Tk, D, causal, block_tokens),
// the mask variant cycling with the case index (index mod 7, which meets every variant with every block size, head
// size and causal setting). Whether the query tiles run in one call or one call each is drawn from
// the seed, so both meet every shape family.
std::vector<AttnCase> attention_cases(const kernels::TileShape& t, bool paged, DType kv = DType::f32) {
  std::vector<AttnCase> cases;
  const std::vector<int64_t> lengths = tile_lengths(t);
  const std::vector<int64_t> block_sizes = paged ? std::vector<int64_t>{1, 3, 16, 64} : std::vector<int64_t>{0};
  for (int64_t T : lengths) {
    for (int64_t Tk : lengths) {
      for (int64_t D : kHeadDims) {
        for (bool causal : {false, true}) {
          for (int64_t bt : block_sizes) {
            auto add = [&](MaskVariant m) {
              const uint64_t seed = 1000 + cases.size();
              cases.push_back({T, Tk, D, causal, m, bt, (kernels::splitmix64(seed) & 1) != 0, seed, kv});
            };
            if (paged) {
              add(kMaskVariants[cases.size() % std::size(kMaskVariants)]);
            } else {
              for (MaskVariant m : kMaskVariants) add(m);
            }
          }
        }
      }
    }
  }
  return cases;
}

// A case's mask as the kernel reads it (MaskRefs into owned storage: move it, never copy) and as the reference
// does (bias).
struct MaskData {
  std::vector<float> f32;
  std::vector<uint8_t> u8;
  kernels::MaskRef mask, padding;
  std::vector<double> bias;  // (T, Tk): the additive value, -inf where masked; empty when nothing is masked
};

MaskData make_mask(const AttnCase& c, std::mt19937_64& rng) {
  const int64_t T = c.T, Tk = c.Tk;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::uniform_int_distribution<int> nonzero(1, 255);
  MaskData m;
  if (c.mask == MaskVariant::none || c.mask == MaskVariant::dropout) return m;
  m.bias.assign(static_cast<size_t>(T * Tk), 0.0);
  const bool dead_row_kind =
      c.mask == MaskVariant::additive_f32 || c.mask == MaskVariant::keep_u8 || c.mask == MaskVariant::block_u8;
  auto dead_row = [&](int64_t i) { return dead_row_kind && i % 5 == 4; };

  switch (c.mask) {
    case MaskVariant::additive_f32: {  // column-major: stride_i 1, stride_j T + 2
      m.mask = {nullptr, kernels::MaskDType::f32, kernels::MaskMode::additive, 1, T + 2};
      m.f32.assign(static_cast<size_t>(Tk * (T + 2)), kNaN);
      for (int64_t i = 0; i < T; ++i) {
        for (int64_t j = 0; j < Tk; ++j) {
          const float r = u(rng), x = -2.0f + 4.0f * u(rng);
          const float val = dead_row(i) || r < 0.15f ? -INFINITY : x;
          m.f32[i + j * (T + 2)] = val;
          m.bias[i * Tk + j] = val;
        }
      }
      m.mask.data = m.f32.data();
      break;
    }
    case MaskVariant::keep_u8:
    case MaskVariant::block_u8: {  // row-major, row stride Tk + 3; the gaps hold 0 for keep, 0xA5 for block
      const bool keep = c.mask == MaskVariant::keep_u8;
      m.mask = {nullptr, kernels::MaskDType::u8, keep ? kernels::MaskMode::keep : kernels::MaskMode::block, Tk + 3, 1};
      m.u8.assign(static_cast<size_t>(T * (Tk + 3)), keep ? 0 : 0xA5);
      for (int64_t i = 0; i < T; ++i) {
        for (int64_t j = 0; j < Tk; ++j) {
          const bool masked = dead_row(i) || u(rng) < 0.3f;
          const int x = nonzero(rng);
          m.u8[i * (Tk + 3) + j] = static_cast<uint8_t>(masked == keep ? 0 : x);  // keep: 0 masks; block: !0 masks
          if (masked) m.bias[i * Tk + j] = kNegInf;
        }
      }
      m.mask.data = m.u8.data();
      break;
    }
    case MaskVariant::padding_u8:
    case MaskVariant::padding_f32: {  // (1, Tk), nonzero = padding (mode block), as the engine passes it
      const bool f32 = c.mask == MaskVariant::padding_f32;
      const int64_t sj = f32 ? 2 : 1;
      m.padding = {nullptr, f32 ? kernels::MaskDType::f32 : kernels::MaskDType::u8, kernels::MaskMode::block, 0, sj};
      if (f32) {
        m.f32.assign(static_cast<size_t>(Tk * sj), kNaN);
      } else {
        m.u8.assign(static_cast<size_t>(Tk), 0);
      }
      for (int64_t j = 0; j < Tk; ++j) {
        const bool pad = j == 0 || u(rng) < 0.3f;
        if (f32) {
          m.f32[j * sj] = pad ? (u(rng) < 0.5f ? 1.0f : -0.5f) : 0.0f;
        } else {
          m.u8[j] = static_cast<uint8_t>(pad ? nonzero(rng) : 0);
        }
        if (pad)
          for (int64_t i = 0; i < T; ++i) m.bias[i * Tk + j] = kNegInf;
      }
      m.padding.data = f32 ? static_cast<const void*>(m.f32.data()) : static_cast<const void*>(m.u8.data());
      break;
    }
    case MaskVariant::none:
    case MaskVariant::dropout: break;
  }
  return m;
}

// Runs one case through `kern` (one call over all query tiles, or one call per tile, last first, as the engine
// schedules them; one scratch slice throughout) and checks: the output against naive_attention, rows with every key
// masked exactly zero, the output's row gaps and the scratch guard untouched. It runs the case the other way too
// (one call per tile after one call, or one call after per-tile calls, on the same scratch) and requires the same
// bits: a call takes its tiles in groups (tiles::kQueryTileGroup), and the grouping must not change any result.
::testing::AssertionResult check_attention(const kernels::AttentionKernel& kern, const AttnCase& c) {
  const int64_t T = c.T, Tk = c.Tk, D = c.D, BQ = kern.tiles.query_tile, BK = kern.tiles.key_tile;
  std::mt19937_64 rng(c.seed);
  const std::vector<float> q = random_uniform(T * D, rng, -2.0f, 2.0f);
  std::vector<float> k = random_uniform(Tk * D, rng, -2.0f, 2.0f);
  std::vector<float> v = random_uniform(Tk * D, rng, -1.0f, 1.0f);
  round_to_storage(k, D, c.kv);
  round_to_storage(v, D, c.kv);
  const MaskData mk = make_mask(c, rng);
  std::vector<double> bias = mk.bias;
  if (c.causal) {
    if (bias.empty()) bias.assign(static_cast<size_t>(T * Tk), 0.0);
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = std::max<int64_t>(0, i + (Tk - T) + 1); j < Tk; ++j) bias[i * Tk + j] = kNegInf;
  }

  kernels::AttentionArgs a;
  a.T = T, a.Tk = Tk, a.D = D;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const std::vector<float> q_mem = strided(q, T, D, c.ldq());
  a.q = q_mem.data(), a.ldq = c.ldq();
  std::vector<float> k_mem, v_mem;
  PagedStore store;
  if (c.block_tokens == 0) {
    k_mem = strided(k, Tk, D, c.ldk());
    v_mem = strided(v, Tk, D, c.ldv());
    a.kv.k = k_mem.data(), a.kv.ldk = c.ldk();
    a.kv.v = v_mem.data(), a.kv.ldv = c.ldv();
  } else {  // as the engine's extend(): k, v, ldk, ldv unset; the contract reads rows at stride D from the blocks
    store = PagedStore(kPagedHeads, D, c.block_tokens, Tk, rng, c.kv);
    for (int64_t j = 0; j < Tk; ++j) store.put(kPagedHead, j, k, v);
    a.kv.blocks = store.table.data();
    a.kv.layout = store.layout;
    a.kv.head = kPagedHead;
  }
  std::vector<float> out_mem = output_buffer(T, D, c.ldo());
  a.out = out_mem.data(), a.ldo = c.ldo();

  a.causal = c.causal;
  a.causal_offset = Tk - T;
  a.mask = mk.mask;
  a.key_padding = mk.padding;
  NaiveDropout drop;
  if (c.mask == MaskVariant::dropout) {
    drop = {kDropoutP, c.seed * 0x9e3779b97f4a7c15ull + 1, kDropoutBh};
    a.dropout_p = drop.p;
    a.dropout_seed = drop.seed;
    a.dropout_base = static_cast<uint64_t>(kDropoutBh * T * Tk);
  }

  const size_t scratch_floats = kern.scratch_floats(D);
  std::vector<float> scratch = scratch_slice(scratch_floats);
  const auto run_all = [&](bool one_call) {
    if (one_call) {
      kern.run(a, 0, T, scratch.data());
    } else {
      run_tile_by_tile(kern, a, T, scratch.data());
    }
  };
  run_all(c.one_call);

  std::ostringstream ctx;
  ctx << "[isa=" << to_string(kern.isa) << " BQ=" << BQ << " BK=" << BK << "] " << c.name();
  const std::vector<float> got = unstrided(out_mem, T, D, c.ldo());
  const std::vector<double> want = naive_attention(q, k, v, T, Tk, D, bias, a.scale, drop);
  ::testing::AssertionResult r =
      all_close(got, want, Dtype::f32, reduction_for_head(D, Tk), ctx.str() + " | index i*D+d");
  if (!r) return r;
  for (int64_t i = 0; i < T && !bias.empty(); ++i) {
    if (!std::all_of(bias.begin() + i * Tk, bias.begin() + (i + 1) * Tk, [](double b) { return b == kNegInf; }))
      continue;
    for (int64_t d = 0; d < D; ++d) {
      if (got[i * D + d] != 0.0f) {
        return ::testing::AssertionFailure() << ctx.str() << ": row " << i << " has every key masked, expected exact "
                                             << "zeros, got " << got[i * D + d] << " at d=" << d;
      }
    }
  }
  if (const int64_t n = gap_writes(out_mem, T, D, c.ldo())) {
    return ::testing::AssertionFailure() << ctx.str() << ": wrote " << n << " floats in the output's row gaps";
  }
  if (!guard_intact(scratch, scratch_floats)) {
    return ::testing::AssertionFailure() << ctx.str() << ": wrote past scratch_floats(D)=" << scratch_floats;
  }
  std::vector<float> other = output_buffer(T, D, c.ldo());
  a.out = other.data();
  run_all(!c.one_call);
  for (size_t i = 0; i < other.size(); ++i) {
    if (std::memcmp(&other[i], &out_mem[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << ctx.str() << ": run the other way ("
                                           << (c.one_call ? "one call per tile" : "one call") << "), element " << i
                                           << " of the output buffer is " << other[i] << ", not " << out_mem[i];
    }
  }
  return ::testing::AssertionSuccess();
}

class KernelAttention : public KernelTest {};

TEST_P(KernelAttention, ContiguousMatchesNaive) {
  const kernels::AttentionKernel& kern = detail::attention_kernel(isa());
  ASSERT_EQ(kern.isa, isa());
  expect_all_cases(to_string(kern.isa), attention_cases(kern.tiles, false),
                   [&](const AttnCase& c) { return check_attention(kern, c); });
}

TEST_P(KernelAttention, PagedMatchesNaive) {
  const kernels::AttentionKernel& kern = detail::attention_kernel(isa());
  ASSERT_EQ(kern.isa, isa());
  expect_all_cases(to_string(kern.isa), attention_cases(kern.tiles, true),
                   [&](const AttnCase& c) { return check_attention(kern, c); });
}

// Output rows aligned to whole vectors, spanning more than tiles::kStreamOutputMinBytes, take the streaming stores
// (Vec::stream, where a vector is a cache line) and the others ordinary ones: both give the same bits, write nothing
// outside the rows' D values, and read back right after the call (the kernel fences its streamed lines). Ragged
// query tiles and head sizes leave part of each tile to the element-by-element tail.
TEST_P(KernelAttention, AlignedOutputRowsMatchUnalignedBitForBit) {
  const kernels::AttentionKernel& kern = detail::attention_kernel(isa());
  const int64_t BQ = kern.tiles.query_tile;
  std::mt19937_64 rng(515);
  struct Shape { int64_t T, D; bool causal; };
  for (const Shape sh : {Shape{2 * BQ + 5, 64, true}, Shape{BQ, 16, false}, Shape{33, 128, true}, Shape{7, 65, true},
                         Shape{BQ + 1, 48, false}}) {
    const std::vector<float> q = random_uniform(sh.T * sh.D, rng, -2, 2), k = random_uniform(sh.T * sh.D, rng, -2, 2),
                             v = random_uniform(sh.T * sh.D, rng, -1, 1);
    kernels::AttentionArgs a;
    a.q = q.data(), a.ldq = sh.D;
    a.kv.k = k.data(), a.kv.v = v.data(), a.kv.ldk = a.kv.ldv = sh.D;
    a.T = a.Tk = sh.T, a.D = sh.D;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(sh.D)));
    a.causal = sh.causal;
    std::vector<float> scratch = scratch_slice(kern.scratch_floats(sh.D));
    // Rows of ldo floats from a 64-byte boundary (ldo a multiple of 16, wide enough that the T rows pass the
    // streaming threshold) and from one float past it (ldo odd, rows far below it).
    const int64_t past = kernels::tiles::kStreamOutputMinBytes / (sh.T * static_cast<int64_t>(sizeof(float))) + 1;
    const int64_t ld_aligned = (std::max(sh.D, past) + 15) / 16 * 16 + 16, ld_odd = sh.D + 3;
    std::vector<float> mem(static_cast<size_t>(sh.T * (ld_aligned + ld_odd) + 64), kSentinel);
    float* aligned = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64 / sizeof(float);
    float* odd = aligned + sh.T * ld_aligned + 1;
    a.out = aligned, a.ldo = ld_aligned;
    kern.run(a, 0, sh.T, scratch.data());
    a.out = odd, a.ldo = ld_odd;
    run_tile_by_tile(kern, a, sh.T, scratch.data());
    int64_t differ = 0, outside = 0;
    for (int64_t i = 0; i < sh.T; ++i) {
      for (int64_t d = 0; d < ld_aligned; ++d) {
        const float x = aligned[i * ld_aligned + d];
        if (d >= sh.D) {
          outside += x != kSentinel;
        } else {
          differ += std::memcmp(&x, &odd[i * ld_odd + d], sizeof x) != 0 || std::isnan(x);
        }
      }
      for (int64_t d = sh.D; d < ld_odd; ++d) outside += odd[i * ld_odd + d] != kSentinel;
    }
    EXPECT_EQ(differ, 0) << to_string(kern.isa) << " T=" << sh.T << " D=" << sh.D << ": elements that differ between the rows";
    EXPECT_EQ(outside, 0) << to_string(kern.isa) << " T=" << sh.T << " D=" << sh.D << ": writes past a row's D values";
    EXPECT_TRUE(guard_intact(scratch, kern.scratch_floats(sh.D))) << to_string(kern.isa) << " wrote past its scratch";
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Kernel, KernelAttention);

// Suites over every K/V dtype, or over the bf16-compute row: they pick their kernels themselves.
class KernelAttentionAnyKv : public KernelTest {
 protected:
  KernelAttentionAnyKv() : KernelTest(std::nullopt) {}
};

// The kernel for each stored K/V format (bf16, int8 with its scales per key, fp8, ...) over the same paged cases, on
// K/V rounded by the cache's codec (the naive loops read the same rounded values, so the f32 tolerance applies: only
// the kernel's own arithmetic is under test). A level runs the formats it has rows of its own for.
TEST_P(KernelAttentionAnyKv, PagedStoredKvMatchesNaive) {
  for (DType kv : test::stored_kv_formats()) {
    if (!own_row(kv)) continue;
    SCOPED_TRACE(std::string("K/V ") + to_string(kv));
    const kernels::AttentionKernel& kern = detail::attention_kernel(isa(), kv);
    ASSERT_EQ(kern.isa, isa());
    ASSERT_EQ(kern.kv, kv);
    expect_all_cases(to_string(kern.isa), attention_cases(kern.tiles, true, kv),
                     [&](const AttnCase& c) { return check_attention(kern, c); });
  }
}

// The engine gives a call one query tile where one head's K and V fit tiles::kCorePrefetchMinBytes, and a group of
// tiles::kQueryTileGroup past it (run_query_tiles); every kernel says so for its own K/V element size.
TEST_P(KernelAttentionAnyKv, TilesPerCallGroupPastTheL2Threshold) {
  for (DType kv : test::kv_formats()) {
    const kernels::AttentionKernel& kern = detail::attention_kernel(isa(), kv);
    const int64_t D = 64, row = D * static_cast<int64_t>(size_of(kv));
    const int64_t fits = kernels::tiles::kCorePrefetchMinBytes / (2 * row);  // K and V of `fits` rows: the threshold
    EXPECT_EQ(kern.tiles_per_call(1, D), 1) << to_string(kv);
    EXPECT_EQ(kern.tiles_per_call(fits, D), 1) << to_string(kv);
    EXPECT_EQ(kern.tiles_per_call(fits + 1, D), kernels::tiles::kQueryTileGroup) << to_string(kv);
  }
}

// The bf16-compute core (bf16 Q, K, V and output) run over all its query tiles in one call, so in groups of
// tiles::kQueryTileGroup, gives the same bits as one call per tile, which is what the engine's tests check against
// the reference at their lengths (the engine groups only past 1 MiB of K and V per head). Self-attention, causal and
// not, and cross-attention with more keys than queries (causal offset), at head sizes with odd pairs.
TEST_P(KernelAttentionAnyKv, Bf16CoreGroupedCallsMatchCallsPerTile) {
  const detail::KernelSet& row = detail::kernels_for(isa(), DType::bf16, DType::bf16);
  if (row.isa != isa()) GTEST_SKIP() << to_string(isa()) << " uses " << to_string(row.isa) << "'s bf16 core";
  const kernels::AttentionKernel& kern = *row.prefill;
  const int64_t BQ = kern.tiles.query_tile;
  std::mt19937_64 rng(4242);
  struct Shape { int64_t T, Tk, D; bool causal; };
  for (const Shape sh : {Shape{9 * BQ + 7, 9 * BQ + 7, 64, true}, Shape{5 * BQ + 1, 5 * BQ + 1, 7, true},
                         Shape{6 * BQ, 6 * BQ + 33, 33, true}, Shape{4 * BQ + 3, 130, 48, false}}) {
    const auto bf16s = [&](int64_t n, float lo, float hi) {
      const std::vector<float> f = random_uniform(n, rng, lo, hi);
      std::vector<kernels::bf16> b(f.size());
      std::transform(f.begin(), f.end(), b.begin(), [](float x) { return kernels::to_bf16(x); });
      return b;
    };
    const std::vector<kernels::bf16> q = bf16s(sh.T * sh.D, -2, 2), k = bf16s(sh.Tk * sh.D, -2, 2),
                                     v = bf16s(sh.Tk * sh.D, -1, 1);
    kernels::AttentionArgs a;
    a.q = q.data(), a.ldq = sh.D;
    a.kv.k = k.data(), a.kv.v = v.data(), a.kv.ldk = a.kv.ldv = sh.D;
    a.T = sh.T, a.Tk = sh.Tk, a.D = sh.D, a.ldo = sh.D;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(sh.D)));
    a.causal = sh.causal, a.causal_offset = sh.Tk - sh.T;
    std::vector<float> scratch = scratch_slice(kern.scratch_floats(sh.D));
    std::vector<kernels::bf16> one(static_cast<size_t>(sh.T * sh.D)), per_tile(one.size());
    a.out = one.data();
    kern.run(a, 0, sh.T, scratch.data());
    a.out = per_tile.data();
    run_tile_by_tile(kern, a, sh.T, scratch.data());
    EXPECT_EQ(std::memcmp(one.data(), per_tile.data(), one.size() * sizeof(kernels::bf16)), 0)
        << to_string(kern.isa) << " T=" << sh.T << " Tk=" << sh.Tk << " D=" << sh.D << " causal=" << sh.causal;
    EXPECT_TRUE(guard_intact(scratch, kern.scratch_floats(sh.D))) << to_string(kern.isa) << " wrote past its scratch";
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Kernel, KernelAttentionAnyKv);

// =============================================================================================================
// 3. The decode kernel: a sequence's keys in [j_begin, j_end) splits, merged with merge_softmax_partials.

struct DecodeCase {
  int64_t H = 0, H_kv = 0, D = 0, block_tokens = 0, n = 0;  // n keys cached, in blocks of block_tokens
  std::vector<int64_t> cuts;                      // split s covers keys [cuts[s], cuts[s + 1]); 0 ... n
  uint64_t seed = 0;
  DType kv = DType::f32;                          // K/V element type in the blocks
  int64_t tokens = 1;  // new tokens sharing the pass (DecodeArgs::tokens): the last `tokens` keys, causal among them

  int64_t ldq() const { return D + 2; }  // q (tokens, H, D) rows, NaN gaps
  std::string name() const {
    std::ostringstream s;
    s << "H=" << H << " H_kv=" << H_kv << " D=" << D << " n=" << n << " block_tokens=" << block_tokens << " (score run "
      << std::min<int64_t>(block_tokens, kernels::tiles::kDecodeMaxScoreKeys) << ") splits";
    for (size_t i = 0; i + 1 < cuts.size(); ++i) s << " [" << cuts[i] << "," << cuts[i + 1] << ")";
    s << " | layout paged(" << to_string(kv) << ", blocks shuffled) ldq=D+2 | new tokens " << tokens << " | seed "
      << seed;
    return s.str();
  }
};

// Every (H, D, block_tokens, n, splits) with splits <= n; the cut points are random, so splits are ragged and
// start mid-block. block_tokens 300 > kDecodeMaxScoreKeys = 256 scores a block in two runs. The K/V heads cycle
// through H's divisors (one per head, groups of 2, 3 and 4, one for all) with the case index, so grouping meets
// every shape.
std::vector<DecodeCase> decode_cases(DType kv = DType::f32) {
  std::vector<DecodeCase> cases;
  test::Rng r(77);
  for (int64_t H : {1, 3, 12}) {
    for (int64_t D : {1, 7, 48, 64, 128}) {  // 48: AVX-512 vectors, not a multiple of four of them
      for (int64_t bt : {1, 5, 64, 300}) {
        for (int64_t n : {1, 7, 64, 257, 301, 613}) {
          for (int64_t splits : {1, 2, 5}) {
            if (splits > n) continue;
            const std::vector<int64_t> kv_heads = H == 12 ? std::vector<int64_t>{12, 6, 4, 3, 1}
                                                  : H == 3  ? std::vector<int64_t>{3, 1}
                                                            : std::vector<int64_t>{1};
            const int64_t H_kv = kv_heads[cases.size() % kv_heads.size()];
            DecodeCase c{H, H_kv, D, bt, n, {0, n}, 5000 + cases.size(), kv};
            while (static_cast<int64_t>(c.cuts.size()) < splits + 1) {
              const int64_t x = r.between(1, n - 1);
              if (std::find(c.cuts.begin(), c.cuts.end(), x) == c.cuts.end()) c.cuts.push_back(x);
            }
            std::sort(c.cuts.begin(), c.cuts.end());
            cases.push_back(c);
          }
        }
      }
    }
  }
  return cases;
}

// A decode case's data: q (H, D), and per K/V head dense K and V (n, D) as round_to_storage leaves them.
struct DecodeData {
  std::vector<float> q;
  std::vector<std::vector<float>> k, v;
};
DecodeData random_decode_data(const DecodeCase& c, std::mt19937_64& rng) {
  DecodeData x{random_uniform(c.tokens * c.H * c.D, rng, -2.0f, 2.0f), {}, {}};
  for (int64_t h = 0; h < c.H_kv; ++h) {
    x.k.push_back(random_uniform(c.n * c.D, rng, -2.0f, 2.0f));
    x.v.push_back(random_uniform(c.n * c.D, rng, -1.0f, 1.0f));
  }
  return x;
}

// Runs every split through `kern` (in reverse order, through one scratch slice), merges per head as the engine
// does (partials (splits, H) and (splits, H, D); with several new tokens (splits, H * tokens) rows in the kernel's
// order), and checks against naive_attention of one query per head and token, token i over keys [0, n - tokens + i].
// The data is random_decode_data's unless `make` gives it.
::testing::AssertionResult check_decode(
    const kernels::DecodeKernel& kern, const DecodeCase& c,
    const std::function<DecodeData(const DecodeCase&, std::mt19937_64&)>& make = random_decode_data) {
  const int64_t H = c.H, H_kv = c.H_kv, D = c.D, n = c.n, S = static_cast<int64_t>(c.cuts.size()) - 1;
  const int64_t T = c.tokens, R = H * T, group = H / H_kv;  // R partial-state rows an item
  std::mt19937_64 rng(c.seed);
  DecodeData data = make(c, rng);
  const std::vector<float>& q = data.q;
  std::vector<std::vector<float>>& k = data.k;  // per K/V head, dense (n, D)
  std::vector<std::vector<float>>& v = data.v;
  PagedStore store(H_kv, D, c.block_tokens, n, rng, c.kv);
  for (int64_t h = 0; h < H_kv; ++h) {
    round_to_storage(k[h], D, c.kv);
    round_to_storage(v[h], D, c.kv);
    for (int64_t j = 0; j < n; ++j) store.put(h, j, k[h], v[h]);
  }

  kernels::DecodeArgs a;
  const std::vector<float> q_mem = strided(q, T * H, D, c.ldq());
  a.q = q_mem.data(), a.ldq = c.ldq();
  if (T > 1) a.tokens = T, a.ld_token = H * c.ldq(), a.last_key = n - T;
  a.blocks = store.table.data(), a.layout = store.layout;
  a.H = H, a.D = D;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  std::vector<float> m(static_cast<size_t>(S * R), kNaN), l(m), acc(static_cast<size_t>(S * R * D), kNaN);
  const size_t scratch_floats = kern.scratch_floats(R, D, c.block_tokens);
  std::vector<float> scratch = scratch_slice(scratch_floats);
  for (int64_t s = S - 1; s >= 0; --s) {
    kern.run(a, c.cuts[s], c.cuts[s + 1], scratch.data(), m.data() + s * R, l.data() + s * R, acc.data() + s * R * D);
  }
  std::vector<float> got(static_cast<size_t>(T * H * D), kNaN);
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = ((h / group) * T + i) * group + h % group;  // token i's head h among the kernel's rows
      kernels::merge_softmax_partials(m.data() + r, l.data() + r, R, acc.data() + r * D, R * D, S, D,
                                      got.data() + (i * H + h) * D);
    }
  }

  std::vector<double> want;
  for (int64_t i = 0; i < T; ++i) {
    const int64_t seen = n - T + i + 1;  // token i's keys
    for (int64_t h = 0; h < H; ++h) {
      const std::vector<float> qh(q.begin() + (i * H + h) * D, q.begin() + (i * H + h + 1) * D);
      const int64_t g = h / group;  // query head h reads K/V head g
      const std::vector<float> kg(k[g].begin(), k[g].begin() + seen * D), vg(v[g].begin(), v[g].begin() + seen * D);
      const std::vector<double> o = naive_attention(qh, kg, vg, 1, seen, D, {}, a.scale);
      want.insert(want.end(), o.begin(), o.end());
    }
  }
  std::ostringstream ctx;
  ctx << "[isa=" << to_string(kern.isa) << "] decode " << c.name();
  ::testing::AssertionResult r =
      all_close_over_cache(got, want, c.kv, D, reduction_for_head(D, n), ctx.str() + " | index (i*H+h)*D+d");
  if (!r) return r;
  if (!guard_intact(scratch, scratch_floats)) {
    return ::testing::AssertionFailure() << ctx.str()
                                         << ": wrote past scratch_floats(H, D, block_tokens)=" << scratch_floats;
  }
  return ::testing::AssertionSuccess();
}

// The decode kernels run at every level that has a row of its own for their K/V dtype: avx512_bf16 has the int8 K/V
// one (its scores on vpdpwssd) and falls through to avx512 for f32 and bf16 K/V. Each test asks own_row.
class KernelDecode : public KernelTest {
 protected:
  KernelDecode() : KernelTest(std::nullopt) {}
};

TEST_P(KernelDecode, MergedSplitsMatchNaive) {
  if (!own_row(DType::f32)) GTEST_SKIP() << to_string(isa()) << " uses a lower level's f32 decode kernel";
  const kernels::DecodeKernel& kern = detail::decode_kernel(isa());
  ASSERT_EQ(kern.isa, isa());
  expect_all_cases(to_string(kern.isa), decode_cases(), [&](const DecodeCase& c) { return check_decode(kern, c); });
}

// The decode kernel of each stored K/V format (Vec::load of its element in the vector loops, widen in the tails;
// int8: integer scores over an int16 query, kernels/int_dot.hpp, and scales per key), on K/V rounded by the cache's
// codec, every shape and grouping of the f32 cases.
TEST_P(KernelDecode, StoredKvMatchesNaive) {
  for (DType kv : test::stored_kv_formats()) {
    if (!own_row(kv)) continue;
    SCOPED_TRACE(std::string("K/V ") + to_string(kv));
    const kernels::DecodeKernel& kern = detail::decode_kernel(isa(), kv);
    ASSERT_EQ(kern.isa, isa());
    ASSERT_EQ(kern.kv, kv);
    expect_all_cases(to_string(kern.isa), decode_cases(kv), [&](const DecodeCase& c) { return check_decode(kern, c); });
  }
}

// Several new tokens of one sequence in one pass (DecodeArgs::tokens: a draft to verify, a short chunk), each token
// seeing the cached keys and the new ones up to its own: every K/V format, a third of the f32 shapes (every grouping,
// ragged splits, blocks of 1 to 300 keys) with 2 to 32 tokens (a ragged step's short entries, kStepDecodeTokens), so
// that the causal cut falls inside runs, at their edges and across splits, and a split may hold keys no token of a
// row sees.
TEST_P(KernelDecode, SeveralTokensMatchNaive) {
  for (DType kv : test::kv_formats()) {
    if (!own_row(kv)) continue;
    SCOPED_TRACE(std::string("K/V ") + to_string(kv));
    const kernels::DecodeKernel& kern = detail::decode_kernel(isa(), kv);
    std::vector<DecodeCase> cases;
    const std::vector<DecodeCase> all = decode_cases(kv);
    for (size_t i = 0; i < all.size(); i += 3) {
      DecodeCase c = all[i];
      c.tokens = std::min<int64_t>(c.n, std::array<int64_t, 4>{2, 3, 5, 32}[(i / 3) % 4]);
      cases.push_back(c);
    }
    expect_all_cases(to_string(kern.isa), cases, [&](const DecodeCase& c) { return check_decode(kern, c); });
  }
}

// Scores that rise or fall along the sequence, so that the decode kernel's running max (which moves only when a
// score passes it by more than kLazyMax = 8, log2 units) moves by less than that from run to run (p above 1
// between moves: slopes 0.02 and 0.1 per key, 1.3 and 6.4 per 64-key run), by more (0.2: every run), or never
// after the first run (-0.2). Each key is a random row plus slope * j times the query's direction, which puts
// score j at about slope * j. And one key (j = 400) raised by 12 or by 150 over flat scores: the max moves once,
// mid-sequence, by more than the threshold, and by more than a float's exponent range (2^150 would overflow if
// the kernel did not move it). Every format, 1 and 3 splits, blocks of 64 and of 16 keys, one head and a group of
// 3. (Steeper slopes reach scores of several hundred, where the f32 score's own rounding exceeds the tolerance
// policy's bound with or without the lazy max.)
TEST_P(KernelDecode, RisingAndFallingScoresMatchNaive) {
  for (DType kv : test::kv_formats()) {
    if (!own_row(kv)) continue;
    const kernels::DecodeKernel& kern = detail::decode_kernel(isa(), kv);
    for (const auto& [slope, jump] : {std::pair{0.02, 0.0}, std::pair{0.1, 0.0}, std::pair{0.2, 0.0}, std::pair{-0.2, 0.0},
                                      std::pair{0.0, 12.0}, std::pair{0.0, 150.0}}) {
      for (int64_t bt : {16, 64}) {
        for (int64_t H : {1, 3}) {
          const int64_t n = 613;
          for (const std::vector<int64_t>& cuts : {std::vector<int64_t>{0, n}, std::vector<int64_t>{0, 100, 400, n}}) {
            const DecodeCase c{H, 1, 64, bt, n, cuts, 900 + static_cast<uint64_t>(bt + H), kv};
            const auto rising = [slope, jump](const DecodeCase& dc, std::mt19937_64& rng) {
              DecodeData x = random_decode_data(dc, rng);
              // The query's direction u = q_0 / |q_0|; q_0 . (u * t) = |q_0| t, in log2 units |q_0| t log2(e) / sqrt(D).
              double norm = 0.0;
              for (int64_t d = 0; d < dc.D; ++d) norm += double{x.q[d]} * x.q[d];
              norm = std::sqrt(norm);
              const double log2e = 1.0 / std::log(2.0);
              const double per_unit = norm * log2e / std::sqrt(static_cast<double>(dc.D));
              for (int64_t j = 0; j < dc.n; ++j) {
                const double t = (slope * static_cast<double>(j) + (j == 400 ? jump : 0.0)) / per_unit;
                for (int64_t d = 0; d < dc.D; ++d) {
                  x.k[0][j * dc.D + d] += static_cast<float>(t * x.q[d] / norm);
                }
              }
              return x;
            };
            EXPECT_TRUE(check_decode(kern, c, rising)) << "slope " << slope << " per key, key 400 raised by " << jump;
          }
        }
      }
    }
  }
}

// A query head holding a NaN or an infinity gives that head NaN outputs in every K/V format, never plausible
// numbers, and leaves the other heads exact.
TEST_P(KernelDecode, NonFiniteQueryHeadGivesNaNOnlyThere) {
  const int64_t H = 2, D = 64, bt = 16, n = 40;
  for (DType kv : test::kv_formats()) {
    if (!own_row(kv)) continue;
    for (float bad : {kNaN, INFINITY}) {
      const kernels::DecodeKernel& kern = detail::decode_kernel(isa(), kv);
      std::mt19937_64 rng(11);
      std::vector<float> q = random_uniform(H * D, rng, -2.0f, 2.0f);
      std::vector<float> k = random_uniform(n * D, rng, -2.0f, 2.0f), v = random_uniform(n * D, rng, -1.0f, 1.0f);
      round_to_storage(k, D, kv);
      round_to_storage(v, D, kv);
      PagedStore store(1, D, bt, n, rng, kv);
      for (int64_t j = 0; j < n; ++j) store.put(0, j, k, v);
      const std::vector<double> want1 =
          naive_attention(std::vector<float>(q.begin() + D, q.end()), k, v, 1, n, D, {}, 0.125f);
      q[5] = bad;  // head 0
      kernels::DecodeArgs a;
      a.q = q.data(), a.ldq = D, a.blocks = store.table.data(), a.layout = store.layout, a.H = H, a.D = D;
      a.scale = 0.125f;
      std::vector<float> m(H), l(H), acc(H * D), out(H * D);
      std::vector<float> scratch(kern.scratch_floats(H, D, bt));
      kern.run(a, 0, n, scratch.data(), m.data(), l.data(), acc.data());
      for (int64_t h = 0; h < H; ++h) {
        kernels::merge_softmax_partials(m.data() + h, l.data() + h, H, acc.data() + h * D, H * D, 1, D,
                                        out.data() + h * D);
      }
      const std::string what = "[isa=" + std::string(to_string(kern.isa)) + "] " + to_string(kv) + " query " +
                               std::to_string(bad);
      for (int64_t d = 0; d < D; ++d) EXPECT_TRUE(std::isnan(out[d])) << what << " head 0, d=" << d;
      EXPECT_TRUE(all_close_over_cache(std::vector<float>(out.begin() + D, out.end()), want1, kv, D,
                                       reduction_for_head(D, n), what + " | head 1"));
    }
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Kernel, KernelDecode);

// The integer score dot products of an int8 cache (kernels/int_dot.hpp) equal their scalar twin exactly: full calls
// (kKeys keys, the transpose-add) and ragged ones, lengths that are not a multiple of the vector step, up to
// kIntDotMaxLen, with extreme values (|q| = 32767, k = -128 and 127) where an overflow would show; D = 600 through
// the decode kernel's chunks; a zero query row scores 0.
const kernels::IntDotKernel& int_dot_kernel(Isa isa) { return *detail::isa_kernels(isa).int_dot; }

// Vec::exp2, the softmax's exponential (kernels/vec.hpp), on every instruction set: within 2e-7 relative of 2^x
// wherever that is a normal float (x in [-126, 126], every 1/1024, so every integer and half-integer where the
// range reduction turns), exactly 2^n at integers (the polynomial is 1 at 0), 0 below -126 and for -inf (a masked
// score), NaN for NaN (bad input must not pass for a masked row).
const kernels::VecProbe& vec_probe(Isa isa) { return *detail::isa_kernels(isa).vec; }

// The fp8 (e4m3) widening load (Vec::load(const fp8_e4m3*), through binary16) on every instruction set gives every
// one of the 256 codes exactly as its scalar twin's table does: its value as the format defines it ((1 + m/8) 2^(e-7),
// subnormals m 2^-9) times 2^-8, which the row's scale restores, and -0 for 0x80. The NaN codes, which the cache never
// stores, read as +-1.875 on both.
class KernelVecFp8 : public KernelTest {};

TEST_P(KernelVecFp8, EveryCodeWidensExactly) {
  const kernels::VecProbe& probe = vec_probe(isa());
  ASSERT_EQ(probe.isa, isa());
  std::vector<uint8_t> codes(256 * 3);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>((i * 7 + i / 256) % 256);  // each 3 times, shuffled
  std::vector<float> y(codes.size(), -1.0f);
  probe.widen_fp8(codes.data(), static_cast<int64_t>(codes.size()), y.data());
  int64_t bad = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    const int c = codes[i] & 0x7f, e = c >> 3, m = c & 7;
    const double mag = e == 0 ? m * std::ldexp(1.0, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
    const double want = ((codes[i] & 0x80) ? -1.0 : 1.0) * (c == 0x7f ? 1.875 : std::ldexp(mag, -8));
    const float twin = kernels::widen(kernels::fp8_e4m3{codes[i]});
    const bool ok = y[i] == static_cast<float>(want) && twin == y[i] &&
                    std::signbit(y[i]) == static_cast<bool>(codes[i] & 0x80);
    if (!ok && bad++ < 8) {
      ADD_FAILURE() << "[isa=" << to_string(isa()) << "] code 0x" << std::hex << int{codes[i]} << std::dec << ": load "
                    << y[i] << ", twin " << twin << ", format " << want;
    }
  }
  EXPECT_EQ(bad, 0);
}
GPT2ATTN_INSTANTIATE_ISAS(Kernel, KernelVecFp8);

// The fp8 codec's narrowing (kernels/fp8.hpp to_fp8_e4m3, what the cache stores): every code's value maps back to its
// code; a value between two neighbours goes to the nearer, a tie to the even code; past 448 and +-inf saturate to
// +-448; below 2^-10 is zero of its sign; NaN stays NaN. Checked against the format's sorted values, 200k draws over
// 2^-14..2^10 and the midpoints themselves.
TEST(KernelFp8, NarrowingRoundsToNearestEvenAndSaturates) {
  using kernels::fp8_e4m3;
  std::vector<std::pair<float, int>> pos;  // (value, code) of the finite non-negative codes, ascending
  for (int c = 0; c < 0x7f; ++c) pos.push_back({kernels::fp8_e4m3_value(static_cast<uint8_t>(c)), c});
  for (size_t i = 1; i < pos.size(); ++i) ASSERT_LT(pos[i - 1].first, pos[i].first) << "codes " << i - 1 << ", " << i;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(kernels::to_fp8_e4m3(kernels::fp8_e4m3_value(static_cast<uint8_t>(c))).bits, c) << "code " << c;
  }
  auto nearest = [&](float x) {  // the code torch's round-to-nearest-even would give, saturated
    const float a = std::fabs(x);
    int code = 0x7e;
    if (a <= 448.0f) {
      const auto hi = std::lower_bound(pos.begin(), pos.end(), std::pair{a, -1});
      const auto lo = hi == pos.begin() ? hi : hi - 1;
      const double dl = a - double{lo->first}, dh = double{hi->first} - a;
      code = dl < dh ? lo->second : dh < dl ? hi->second : (lo->second % 2 == 0 ? lo->second : hi->second);
    }
    return std::signbit(x) ? code | 0x80 : code;
  };
  std::mt19937_64 rng(88);
  std::uniform_real_distribution<float> frac(0.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-14, 10);
  for (int i = 0; i < 200000; ++i) {
    float x = std::ldexp(frac(rng), expo(rng));
    if (i % 2) x = -x;
    ASSERT_EQ(kernels::to_fp8_e4m3(x).bits, nearest(x)) << "x = " << x;
  }
  for (size_t i = 1; i < pos.size(); ++i) {
    const float mid = 0.5f * (pos[i - 1].first + pos[i].first);
    ASSERT_EQ(kernels::to_fp8_e4m3(mid).bits, nearest(mid)) << "midpoint " << mid;
  }
  for (float big : {448.0f, 449.0f, 464.0f, 480.0f, 1e9f, INFINITY}) {
    EXPECT_EQ(kernels::to_fp8_e4m3(big).bits, 0x7e) << big;
    EXPECT_EQ(kernels::to_fp8_e4m3(-big).bits, 0xfe) << -big;
  }
  EXPECT_EQ(kernels::to_fp8_e4m3(0x1p-11f).bits, 0x00);
  EXPECT_EQ(kernels::to_fp8_e4m3(-0x1p-11f).bits, 0x80);
  EXPECT_TRUE(std::isnan(kernels::fp8_e4m3_value(kernels::to_fp8_e4m3(kNaN).bits)));
}

class KernelVecExp2 : public KernelTest {};

TEST_P(KernelVecExp2, WithinItsBoundAndExactWhereItMustBe) {
  const kernels::VecProbe& probe = vec_probe(isa());
  ASSERT_EQ(probe.isa, isa());
  std::vector<float> x;
  for (int64_t i = -130 * 1024; i <= 126 * 1024; ++i) x.push_back(static_cast<float>(i) / 1024.0f);
  const size_t specials = x.size();
  for (float v : {-INFINITY, NAN, -0.0f, std::nextafter(-126.0f, -127.0f), std::nextafter(-126.0f, 0.0f)}) x.push_back(v);
  while (x.size() % static_cast<size_t>(probe.lanes) != 0) x.push_back(0.0f);
  std::vector<float> y(x.size(), -1.0f);
  probe.exp2(x.data(), static_cast<int64_t>(x.size()), y.data());
  double worst = 0.0;
  for (size_t i = 0; i < specials; ++i) {
    if (x[i] < -126.0f) {
      ASSERT_EQ(y[i], 0.0f) << "[isa=" << to_string(probe.isa) << "] exp2(" << x[i] << ")";
      continue;
    }
    const double want = std::exp2(static_cast<double>(x[i]));
    worst = std::max(worst, std::fabs(y[i] / want - 1.0));
    if (x[i] == std::round(x[i])) {
      ASSERT_EQ(y[i], static_cast<float>(want)) << "[isa=" << to_string(probe.isa) << "] exp2 of the integer " << x[i];
    }
  }
  EXPECT_LE(worst, 2e-7) << "[isa=" << to_string(probe.isa) << "]";
  EXPECT_EQ(y[specials], 0.0f) << "exp2(-inf)";
  EXPECT_TRUE(std::isnan(y[specials + 1])) << "exp2(NaN) = " << y[specials + 1];
  EXPECT_EQ(y[specials + 2], 1.0f) << "exp2(-0)";
  EXPECT_EQ(y[specials + 3], 0.0f) << "exp2 just below -126";
  EXPECT_GT(y[specials + 4], 0.0f) << "exp2 just above -126";
}

// Where Vec::exp2 builds 2^n another way than in the exponent bits (AVX-512: vscalefps), the two agree bit for bit:
// every 1/4096 over [-130, 8] (each rounding tie of n among them), a million random floats over [-140, 0] (the
// softmax's domain: a score minus the running max), the subnormal edge and the specials.
TEST_P(KernelVecExp2, ScalefMatchesExponentBitsBitForBit) {
  const kernels::VecProbe& probe = vec_probe(isa());
  if (probe.exp2_bits == nullptr) GTEST_SKIP() << "[isa=" << to_string(probe.isa) << "] exp2 is the exponent-bits construction";
  std::vector<float> x;
  for (int64_t i = -130 * 4096; i <= 8 * 4096; ++i) x.push_back(static_cast<float>(i) / 4096.0f);
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-140.0f, 0.0f);
  for (int i = 0; i < 1000000; ++i) x.push_back(u(rng));
  for (float v : {-INFINITY, NAN, -0.0f, 0.0f, std::nextafter(-126.0f, -127.0f), -126.0f, std::nextafter(-126.0f, 0.0f),
                  -125.5f, std::nextafter(-125.5f, 0.0f), -0.5f, 0.5f}) {
    x.push_back(v);
  }
  while (x.size() % static_cast<size_t>(probe.lanes) != 0) x.push_back(0.0f);
  std::vector<float> a(x.size()), b(x.size());
  probe.exp2(x.data(), static_cast<int64_t>(x.size()), a.data());
  probe.exp2_bits(x.data(), static_cast<int64_t>(x.size()), b.data());
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      ASSERT_TRUE(std::isnan(a[i]) && std::isnan(b[i])) << "[isa=" << to_string(probe.isa) << "] exp2(NaN)";
      continue;
    }
    uint32_t ua, ub;
    std::memcpy(&ua, &a[i], 4);
    std::memcpy(&ub, &b[i], 4);
    ASSERT_EQ(ua, ub) << "[isa=" << to_string(probe.isa) << "] exp2(" << x[i] << "): " << a[i] << " against " << b[i];
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Kernel, KernelVecExp2);

// Every level with an int8 K/V row of its own (avx512_bf16's sums on vpdpwssd).
class KernelIntDot : public KernelTest {
 protected:
  KernelIntDot() : KernelTest(DType::i8) {}
};

TEST_P(KernelIntDot, MatchesScalarTwinExactly) {
  const kernels::IntDotKernel& kern = int_dot_kernel(isa());
  const kernels::IntDotKernel& twin = int_dot_kernel(Isa::scalar);
  ASSERT_EQ(kern.isa, isa());
  std::mt19937_64 rng(21);
  std::uniform_int_distribution<int> qd(-32767, 32767), kd(-128, 127);
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{31}, int64_t{33},
                    int64_t{64}, int64_t{80}, int64_t{128}, int64_t{200}, int64_t{511}, kernels::kIntDotMaxLen}) {
    for (int fill = 0; fill < 3; ++fill) {  // random, extreme (largest products), zero query row
      const int64_t ldk = n + 5;  // rows not a multiple of anything
      std::vector<int16_t> q(static_cast<size_t>(n));
      std::vector<int8_t> k(static_cast<size_t>(kern.keys * ldk));
      for (auto& x : q) x = static_cast<int16_t>(fill == 0 ? qd(rng) : fill == 1 ? 32767 : 0);
      for (auto& x : k) x = static_cast<int8_t>(fill == 1 ? (rng() & 1 ? 127 : -128) : kd(rng));
      if (fill == 1) std::fill(k.begin(), k.begin() + ldk, int8_t{-128});  // key 0: the most negative dot
      for (int keys : {kern.keys, 1, kern.keys - 1}) {
        if (keys < 1) continue;
        std::vector<int32_t> got(static_cast<size_t>(kern.keys), -7), want(got);
        kern.dots(q.data(), k.data(), ldk, n, keys, got.data());
        twin.dots(q.data(), k.data(), ldk, n, keys, want.data());
        for (int r = 0; r < kern.keys; ++r) {
          EXPECT_EQ(got[r], want[r]) << "[isa=" << to_string(kern.isa) << "] n=" << n << " keys=" << keys << " fill=" << fill
                                     << " key " << r;
          if (fill == 2 && r < keys) {
            EXPECT_EQ(got[r], 0);
          }
        }
        if (fill == 1 && n == kernels::kIntDotMaxLen) {
          EXPECT_EQ(want[0], -32767 * 128 * 512);  // the largest |dot| a chunk can hold, below 2^31
        }
      }
    }
  }
}

// The int16 query quantiser on every instruction set, at the edge where 32767 / max|x * c| overflows float (a row of
// denormal-sized values): it gave 0 * inf = NaN for zeros (cast to int16: undefined) and +-32767 for the rest.
TEST_P(KernelIntDot, QueryQuantiserKeepsTinyRowsWithinHalfAStep) {
  const kernels::IntDotKernel& kern = int_dot_kernel(isa());
  for (const float c : {1.0f, 0.125f}) {
    for (const float top : {4e-35f, 3.0f}) {  // a tiny row, and an ordinary one
      std::vector<float> x(37);
      for (size_t d = 0; d < x.size(); ++d) x[d] = top * static_cast<float>((d * 7) % 11) / 10.0f * (d % 2 ? -1 : 1);
      x[20] = -top;  // the largest magnitude, at (20 * 7) % 11 = 8 otherwise
      x[5] = 0.0f;
      std::vector<int16_t> q(x.size());
      const float scale = kern.quantize(x.data(), c, static_cast<int64_t>(x.size()), q.data());
      ASSERT_GT(scale, 0.0f) << "[isa=" << to_string(kern.isa) << "] top=" << top;
      EXPECT_EQ(q[20], -32767) << "[isa=" << to_string(kern.isa) << "] the largest magnitude maps to the end of the range";
      EXPECT_EQ(q[5], 0) << "[isa=" << to_string(kern.isa) << "] top=" << top;
      // Half a step, plus the rounding of a denormal scale to a multiple of 2^-149 (|q| times half of that).
      const double bound = top * c / 65534.0 * 1.01 + 32767.0 * std::ldexp(1.0, -150);
      for (size_t d = 0; d < x.size(); ++d) {
        EXPECT_LE(std::fabs(q[d] * static_cast<double>(scale) - x[d] * static_cast<double>(c)), bound)
            << "[isa=" << to_string(kern.isa) << "] c=" << c << " top=" << top << " d=" << d << " q=" << q[d];
      }
    }
  }
}

// Through the decode kernel: D = 1, 128 and 600 (two chunks of the dot, kIntDotMaxLen + 88), a zero query head; the
// same int8 cache at every level, against naive attention over what it holds.
TEST_P(KernelIntDot, DecodeInt8HeadSizesAndZeroQuery) {
  const kernels::DecodeKernel& kern = detail::decode_kernel(isa(), DType::i8);
  for (int64_t D : {int64_t{1}, int64_t{128}, int64_t{600}}) {
    const int64_t H = 2, bt = 16, n = 37;
    std::mt19937_64 rng(static_cast<uint64_t>(D));
    std::vector<float> q = random_uniform(H * D, rng, -2.0f, 2.0f);
    std::fill(q.begin(), q.begin() + D, 0.0f);  // head 0: a zero row (scale 0): uniform weights, the mean of V
    std::vector<float> k = random_uniform(n * D, rng, -2.0f, 2.0f), v = random_uniform(n * D, rng, -1.0f, 1.0f);
    round_to_storage(k, D, DType::i8);
    round_to_storage(v, D, DType::i8);
    PagedStore store(1, D, bt, n, rng, DType::i8);
    for (int64_t j = 0; j < n; ++j) store.put(0, j, k, v);
    kernels::DecodeArgs a;
    a.q = q.data(), a.ldq = D, a.blocks = store.table.data(), a.layout = store.layout, a.H = H, a.D = D;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
    std::vector<float> m(H), l(H), acc(H * D), out(H * D);
    std::vector<float> scratch(kern.scratch_floats(H, D, bt));
    kern.run(a, 0, n, scratch.data(), m.data(), l.data(), acc.data());
    std::vector<double> want;
    for (int64_t h = 0; h < H; ++h) {
      kernels::merge_softmax_partials(m.data() + h, l.data() + h, H, acc.data() + h * D, H * D, 1, D,
                                      out.data() + h * D);
      const std::vector<double> o =
          naive_attention(std::vector<float>(q.begin() + h * D, q.begin() + (h + 1) * D), k, v, 1, n, D, {}, a.scale);
      want.insert(want.end(), o.begin(), o.end());
    }
    EXPECT_EQ(m[0], 0.0f) << "a zero query row scores exactly 0";
    EXPECT_TRUE(all_close_over_cache(out, want, DType::i8, D, reduction_for_head(D, n),
                                     "[isa=" + std::string(to_string(kern.isa)) + "] int8 D=" + std::to_string(D)));
  }
}
GPT2ATTN_INSTANTIATE_ISAS(Kernel, KernelIntDot);

// =============================================================================================================
// 4. The few-row linear kernel over every panel of the packed weights.

struct LinearCase {
  int64_t M = 0, N = 0, K = 0;
  bool bias = false;
  uint64_t seed = 0;

  int64_t ldx() const { return K + 3; }  // NaN gaps
  int64_t ldy() const { return N + 5; }  // sentinel gaps
  std::string name() const {
    std::ostringstream s;
    s << "M=" << M << " N=" << N << " K=" << K << (bias ? " bias" : " no bias") << " | panels "
      << kernels::linear_panels(N) << " (the second half in one call, then the first one call each), K chunks of "
      << "at most " << kernels::tiles::kLinearKChunk << " | ldx=K+3 ldy=N+5 | seed " << seed;
    return s.str();
  }
};

// M around the row blocks (AVX-512 8, AVX2 6, scalar 4); N around the 16-output panel and the panel groups
// (AVX-512 3): 1, 2, 3, 5 and 7 panels, so calls hold whole and ragged groups; K up to past one and two
// kLinearKChunk, so later chunks accumulate on the partial sums in y.
std::vector<LinearCase> linear_cases() {
  constexpr int64_t kc = kernels::tiles::kLinearKChunk;
  std::vector<LinearCase> cases;
  for (int64_t M : {1, 3, 8, 9, 19})
    for (int64_t N : {1, 16, 17, 48, 69, 112})
      for (int64_t K : {int64_t{1}, int64_t{5}, int64_t{300}, kc + 37, 2 * kc + 1})
        for (bool bias : {false, true}) cases.push_back({M, N, K, bias, 9000 + cases.size()});
  return cases;
}

// The kernel's weight format: f32 or bf16 (a bf16 layer's decode) packed as the compute type, or int8 / int4 codes
// with their scales, packed panel by panel as the engine packs them. The naive loops run on the weights as packed
// (bf16-rounded, or dequantized: code x scale), so the f32 tolerance applies: only the kernel's arithmetic is under
// test.
::testing::AssertionResult check_linear(const kernels::LinearKernel& kern, const LinearCase& c) {
  const int64_t M = c.M, N = c.N, K = c.K;
  std::mt19937_64 rng(c.seed);
  const std::vector<float> x = random_uniform(M * K, rng);
  std::vector<float> w = random_uniform(N * K, rng);
  if (N > 2 && K > 2) {  // a row of zeros (scale 0) and a weight at the row's largest magnitude, negated
    std::fill_n(w.begin() + K, K, 0.0f);
    w[2 * K + 1] = -1.0f;
  }
  const std::vector<float> b = c.bias ? random_uniform(N, rng) : std::vector<float>{};
  const WeightFormat f = kern.format;
  // NaN-filled first (codes: a pattern, scales: NaN), so an element the packing skips poisons the result.
  std::vector<std::byte> packed(static_cast<size_t>(kernels::linear_packed_bytes(N, K, f, kern.compute)), std::byte{0x55});
  std::vector<float> scales(static_cast<size_t>(kernels::linear_scales(N, K, f)), kNaN);
  const int64_t per_k = kernels::linear_bytes_per_k(f, kern.compute), per_panel = kernels::linear_panels(N) > 0
      ? static_cast<int64_t>(scales.size()) / kernels::linear_panels(N) : 0;
  // The quantized formats: each row's codes and scales (quantize_row), which the panels rearrange.
  const int64_t G = f == WeightFormat::compute ? 0 : detail::quant_groups(f, K);
  std::vector<int8_t> codes(static_cast<size_t>(f == WeightFormat::compute ? 0 : N * K));
  std::vector<float> row_scales(static_cast<size_t>(N * G));
  for (int64_t n = 0; f != WeightFormat::compute && n < N; ++n) {
    kernels::quantize_row(f, w.data() + n * K, K, codes.data() + n * K, row_scales.data() + n * G);
  }
  for (int64_t p = 0; p < kernels::linear_panels(N); ++p) {
    const int64_t n0 = p * kernels::kLinearPanel, n = std::min(kernels::kLinearPanel, N - n0);
    std::byte* dst = packed.data() + p * kernels::linear_padded_k(f, K) * per_k;
    if (f == WeightFormat::int8) {
      kernels::pack_linear_panel_int8(codes.data() + n0 * K, row_scales.data() + n0 * G, n, K,
                                      reinterpret_cast<int8_t*>(dst), scales.data() + p * per_panel);
    } else if (f == WeightFormat::int4) {
      kernels::pack_linear_panel_int4(codes.data() + n0 * K, row_scales.data() + n0 * G, n, K,
                                      reinterpret_cast<kernels::int4x2*>(dst), scales.data() + p * per_panel);
    } else if (kern.compute == DType::bf16) {
      std::vector<kernels::bf16> rows(static_cast<size_t>(n * K));
      for (size_t i = 0; i < rows.size(); ++i) rows[i] = kernels::to_bf16(w[static_cast<size_t>(n0 * K) + i]);
      kernels::pack_linear_weights(rows.data(), n, K, reinterpret_cast<kernels::bf16*>(dst));
    } else {
      kernels::pack_linear_weights(w.data() + n0 * K, n, K, reinterpret_cast<float*>(dst));
    }
  }
  if (f != WeightFormat::compute) {
    const int64_t group = kernels::quant_group(f, K);
    for (int64_t i = 0; i < N * K; ++i) w[i] = static_cast<float>(codes[i]) * row_scales[i / K * G + i % K / group];
  } else if (kern.compute == DType::bf16) {
    test::round_bf16(w);
  }

  // The quantized formats' kernels quantize x's rows to int16 (kernels/int_dot.hpp's quantize_query_i16, compiled at
  // the kernel's level: where the compiler contracts its rounding into an FMA a code can differ by one): the naive
  // loops take those values, so only the kernel's arithmetic is under test.
  std::vector<float> x_ref = x;
  if (f != WeightFormat::compute) {
    const auto quantize = detail::isa_kernels(kern.isa).int_dot->quantize;
    std::vector<int16_t> q(static_cast<size_t>(K));
    for (int64_t m = 0; m < M; ++m) {
      const float sx = quantize(x.data() + m * K, 1.0f, K, q.data());
      for (int64_t k = 0; k < K; ++k) x_ref[m * K + k] = static_cast<float>(q[k]) * sx;
    }
  }
  std::vector<std::byte> scratch(static_cast<size_t>(kernels::linear_scratch_bytes(f, M, K)), std::byte{0x55});

  kernels::LinearArgs a;
  a.scratch = scratch.data();
  const std::vector<float> x_mem = strided(x, M, K, c.ldx());
  std::vector<float> y_mem = output_buffer(M, N, c.ldy());
  a.x = x_mem.data(), a.ldx = c.ldx();
  a.w_packed = packed.data();
  a.scales = scales.empty() ? nullptr : scales.data();
  a.bias = c.bias ? b.data() : nullptr;
  a.y = y_mem.data(), a.ldy = c.ldy();
  a.M = M, a.N = N, a.K = K;
  std::ostringstream ctx;
  ctx << "[isa=" << to_string(kern.isa) << "] linear " << c.name();
  // Threads run neighbouring panel ranges at once, so a call must write only its own panels' columns: before
  // each call, those of the panels not run yet still hold their NaN.
  const int64_t panels = kernels::linear_panels(N), half = panels / 2;
  kern.run(a, half, panels);
  for (int64_t p = 0; p <= half; ++p) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = p * kernels::kLinearPanel; n < std::min(N, half * kernels::kLinearPanel); ++n) {
        if (!std::isnan(y_mem[m * c.ldy() + n])) {
          return ::testing::AssertionFailure() << ctx.str() << ": wrote y[" << m << ", " << n << "] before panel "
                                               << n / kernels::kLinearPanel << "'s call";
        }
      }
    }
    if (p < half) kern.run(a, p, p + 1);
  }
  // The reduction is the K-long dot product (test_util.hpp's rule: the projection widths).
  ::testing::AssertionResult r = all_close(unstrided(y_mem, M, N, c.ldy()), naive_linear(x_ref, w, b, M, N, K), Dtype::f32,
                                           K, ctx.str() + " | index m*N+n");
  if (!r) return r;
  if (const int64_t n = gap_writes(y_mem, M, N, c.ldy())) {
    return ::testing::AssertionFailure() << ctx.str() << ": wrote " << n << " floats in y's row gaps (columns >= N)";
  }
  return ::testing::AssertionSuccess();
}

class KernelLinear : public KernelTest {};

TEST_P(KernelLinear, AllPanelsMatchNaive) {
  const kernels::LinearKernel& kern = detail::linear_kernel(isa());
  ASSERT_EQ(kern.isa, isa());
  expect_all_cases(to_string(kern.isa), linear_cases(), [&](const LinearCase& c) { return check_linear(kern, c); });
}

// Quantized weights (the second list of kernel_list.def): int8 codes with a scale per output, int4 nibbles with a
// scale per output and 32 inputs (K = 5, 300, 293, 513: partial last groups). Every level compiles its own, avx512_bf16
// included (its layers use them), so no level is skipped.
class KernelQuantizedLinear : public KernelTest {
 protected:
  KernelQuantizedLinear() : KernelTest(std::nullopt) {}
};

TEST_P(KernelQuantizedLinear, AllPanelsMatchNaiveOnDequantizedWeights) {
  for (WeightFormat f : {WeightFormat::int8, WeightFormat::int4}) {
    const kernels::LinearKernel& kern = detail::linear_kernel(isa(), f, DType::f32);
    ASSERT_EQ(kern.isa, isa());
    ASSERT_EQ(kern.format, f);
    expect_all_cases(std::string(to_string(kern.isa)) + " " + to_string(f), linear_cases(),
                     [&](const LinearCase& c) { return check_linear(kern, c); });
  }
}

// int4's conversion for the prefill GEMMs (LinearKernel::dequantize): code x scale exactly in f32, rounded to nearest
// even for bf16 (out bf16, or bf16 values in f32), at every level bit for bit, over full and short last groups.
TEST_P(KernelQuantizedLinear, Int4DequantizeIsCodeTimesScaleRoundedOnce) {
  const kernels::LinearKernel& kern = detail::linear_kernel(isa(), WeightFormat::int4, DType::f32);
  ASSERT_NE(kern.dequantize, nullptr);
  std::mt19937_64 rng(4242);
  for (int64_t K : {1, 16, 17, 31, 32, 33, 70, 100}) {
    const int64_t N = 3, G = kernels::weight_groups(K);
    std::vector<int8_t> codes(static_cast<size_t>(N * K));
    std::uniform_int_distribution<int> code(-8, 7);
    for (int8_t& c : codes) c = static_cast<int8_t>(code(rng));
    const std::vector<float> scales = random_uniform(N * G, rng);
    // The layout: per group of 32 inputs 16 bytes, input i in byte i's low nibble, i + 16 in its high one.
    std::vector<uint8_t> packed(static_cast<size_t>(N * G * 16), 0);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t g = k / 32, i = k % 32;
        packed[(n * G + g) * 16 + i % 16] |= static_cast<uint8_t>((codes[n * K + k] & 0x0f) << (4 * (i / 16)));
      }
    }
    std::vector<float> f32(static_cast<size_t>(N * K), kNaN), rounded(f32);
    std::vector<kernels::bf16> b16(static_cast<size_t>(N * K), kernels::bf16{0x7fc1});
    kern.dequantize(packed.data(), scales.data(), N, K, DType::f32, false, f32.data());
    kern.dequantize(packed.data(), scales.data(), N, K, DType::f32, true, rounded.data());
    kern.dequantize(packed.data(), scales.data(), N, K, DType::bf16, true, b16.data());
    for (int64_t i = 0; i < N * K; ++i) {
      const float want = static_cast<float>(codes[i]) * scales[i / K * G + i % K / 32];
      ASSERT_EQ(f32[i], want) << to_string(isa()) << " K=" << K << " element " << i;
      ASSERT_EQ(rounded[i], kernels::widen(kernels::to_bf16(want))) << to_string(isa()) << " K=" << K << " " << i;
      ASSERT_EQ(b16[i].bits, kernels::to_bf16(want).bits) << to_string(isa()) << " K=" << K << " element " << i;
    }
  }
}

// The bf16-compute rows' kernel: half the weight bytes, widened as they are loaded.
TEST_P(KernelLinear, Bf16WeightsMatchNaive) {
  const kernels::LinearKernel& kern = *detail::kernels_for(isa(), DType::bf16, DType::bf16).few_row_linear;
  ASSERT_EQ(kern.isa, isa());
  expect_all_cases(to_string(kern.isa), linear_cases(),
                   [&](const LinearCase& c) { return check_linear(kern, c); });
}
GPT2ATTN_INSTANTIATE_ISAS(Kernel, KernelLinear);
GPT2ATTN_INSTANTIATE_ISAS(Kernel, KernelQuantizedLinear);

}  // namespace
}  // namespace gpt2attn
