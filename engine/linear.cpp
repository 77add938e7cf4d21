// engine/linear.cpp: oneDNN matmul primitives for the projections (describe once, execute many).
#include "engine/linear.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/convert.hpp"
#include "gpt2attn/error.hpp"
#include "kernels/bf16.hpp"
#include "kernels/linear.hpp"

namespace gpt2attn::detail {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

namespace {
// oneDNN reports a failed allocation as a status; the caller sees it as ours, anything else is internal.
ErrorCode code_of(dnnl_status_t status) {
  return status == dnnl_out_of_memory ? ErrorCode::out_of_memory : ErrorCode::internal;
}
dt dnnl_type(DType t) {
  switch (t) {
    case DType::f32: return dt::f32;
    case DType::bf16: return dt::bf16;
    case DType::u8: return dt::u8;
    default: fail(ErrorCode::internal, std::string("linear: no oneDNN GEMM computes in ") + to_string(t));
  }
}

// oneDNN 2.6's AMX bf16 matmul (`brg:avx512_core_amx_bf16`) executes an illegal instruction for some GEMMs whose K is
// not a multiple of 32, the bf16 elements of a 64-byte tile row, killing the process with SIGILL: 200x63 times 63x2 on
// one thread, 33x63 times 63x17 on two (on an Intel Xeon with AMX; uxlfoundation/oneDNN#1661 reports the
// same in 2.7.3, and #5717 rows mixed by the K remainder in a 3.x AMX kernel). Such a GEMM takes oneDNN's next
// implementation without AMX (its AVX512-BF16 kernel there). Where K is a multiple of 32 AMX stays: no multiple of 32
// up to 4096 crashed in a scan over M, N and 1-2 threads (bench/README, "oneDNN 2.6 on AMX").
// For such a GEMM, steps pd past the implementations that use AMX, leaving it on the first one that does not.
void skip_amx(dnnl::matmul::primitive_desc& pd, DType compute, int64_t K) {
  // int8 AMX tiles hold 64 bytes of a row as bf16's hold 32 elements: the same rule at 64 (untested on AMX here).
  if (compute == DType::u8 ? K % 64 == 0 : compute != DType::bf16 || K % 32 == 0) return;
  while (std::string_view(pd.impl_info_str()).find("amx") != std::string_view::npos) {
    if (!pd.next_impl()) {
      fail(ErrorCode::internal, std::string("oneDNN: no ") + to_string(compute) + " matmul without AMX for K=" +
                                    std::to_string(K) + " (oneDNN 2.6's AMX kernels are not safe for this K)");
    }
  }
}
}  // namespace

ScopedOmpThreads::ScopedOmpThreads(int threads) : saved_(omp_get_max_threads()) {
  if (threads > 0) omp_set_num_threads(threads);
}
ScopedOmpThreads::~ScopedOmpThreads() { omp_set_num_threads(saved_); }

void cap_onednn(Isa isa) {
  if (isa == Isa::best || std::getenv("ONEDNN_MAX_CPU_ISA") || std::getenv("DNNL_MAX_CPU_ISA")) return;
  dnnl::cpu_isa level = dnnl::cpu_isa::sse41;
  switch (isa) {
    case Isa::avx512_bf16: level = dnnl::cpu_isa::avx512_core_bf16; break;
    case Isa::avx512: level = dnnl::cpu_isa::avx512_core; break;
    case Isa::avx2: level = dnnl::cpu_isa::avx2; break;
    case Isa::scalar:
    case Isa::best: break;
  }
  const dnnl::status st = dnnl::set_max_cpu_isa(level);
  if (st != dnnl::status::success) {
    fail(ErrorCode::internal, std::string("oneDNN: cannot cap its instruction set at ") + to_string(isa) +
                                  (st == dnnl::status::unimplemented ? " (this oneDNN was built without that control)"
                                                                     : " (it has dispatched already in this process)"));
  }
}

dnnl::engine& cpu_engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

// One primitive for one (Linear, M, lda, ldc, threads), with its memory objects and scratchpad kept so that
// a call only swaps data handles.
struct ExecContext::Entry {
  dnnl::matmul prim;
  dnnl::stream stream;
  memory src, weights, bias, dst, scratch;  // handles set per call: one entry serves every Linear of its shape
  memory::desc weights_desc;
  // Where the GEMM writes: y itself, or the slot's dense Wide::dst, from which run() finishes y: an int8 Linear's int32
  // sums (rescaled), a bf16 Linear on f32 GEMMs writing bf16 (rounded), or a y whose row stride oneDNN's fast
  // kernels refuse (copied; see entry()).
  enum class Via : uint8_t { direct, int8_sums, f32_to_bf16, dense_copy } via = Via::direct;
  std::vector<memory> keep_alive;       // the memory objects c_args points into
  std::vector<dnnl_exec_arg_t> c_args;  // built once: the C++ execute() would build a vector per call
  std::string impl;                     // oneDNN's implementation, e.g. "brg:avx512_core"
  uint64_t last_use = 0;                // ExecContext::uses_ at its latest lookup
  bool reserved = false;                // made or found by prepare(): trim() keeps it
};

namespace {
// oneDNN's u8 x s8 -> s32 matmul for (M, K) x (K, N), weights in the layout it prefers.
dnnl::matmul::primitive_desc int8_matmul(int64_t M, int64_t K, int64_t N, std::optional<dnnl::matmul::desc>& op,
                                         const dnnl::primitive_attr& attr = {}) {
  const memory::desc src({M, K}, dt::u8, tag::ab), w({K, N}, dt::s8, tag::any), dst({M, N}, dt::s32, tag::ab);
  op.emplace(src, w, dst);
  return dnnl::matmul::primitive_desc(*op, attr, cpu_engine());
}
bool on_vnni(const dnnl::matmul::primitive_desc& pd) {
  const std::string_view impl = pd.impl_info_str();
  return impl.find("vnni") != std::string_view::npos || impl.find("amx") != std::string_view::npos;
}
}  // namespace

bool Linear::int8_available() {
  static const bool available = [] {
    try {
      std::optional<dnnl::matmul::desc> op;
      return on_vnni(int8_matmul(64, 64, 64, op));
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return available;
}

dnnl::matmul::primitive_desc Linear::describe(memory::format_tag weights, std::optional<dnnl::matmul::desc>& op) {
  auto& eng = cpu_engine();
  const auto make = [&](DType gemm) {
    const dt g = dnnl_type(gemm);
    const memory::desc src({128, K_}, g, tag::ab), w({K_, N_}, g, weights), dst({128, N_}, dt::f32, tag::ab);
    op.emplace(has_bias_ ? dnnl::matmul::desc(src, w, memory::desc({1, N_}, dt::f32, tag::ab), dst)
                         : dnnl::matmul::desc(src, w, dst));
    return dnnl::matmul::primitive_desc(*op, eng);
  };
  auto pd = [&]() -> dnnl::matmul::primitive_desc {
    try {
      return make(compute_);
    } catch (const dnnl::error& e) {
      // oneDNN 2.6 has bf16 matmuls from avx512_core on: below, a bf16 layer multiplies in f32 (gemm_).
      if (compute_ != DType::bf16 || e.status != dnnl_unimplemented) throw;
      gemm_ = DType::f32;
      return make(gemm_);
    }
  }();
  skip_amx(pd, gemm_, K_);
  return pd;
}

Linear::Linear(WeightFormat f, const int8_t* codes, const float* scales, int64_t N, int64_t K, const float* bias,
               DType compute, kernels::DequantizeFn dequantize)
    : N_(N), K_(K), compute_(compute), gemm_(f == WeightFormat::int8 ? DType::u8 : compute),
      has_bias_(bias != nullptr), format_(f), dequantize_(dequantize) {
  dnnl_type(compute);  // refuses a type that is not a compute type
  if (f == WeightFormat::int4) {
    if (!dequantize) fail(ErrorCode::internal, "linear: int4 weights without their dequantization kernel");
    static std::atomic<uint64_t> ids{0};
    id_ = ++ids;
    nibbles_.resize(static_cast<size_t>(kernels::int4_group_bytes(N, K)));
    kernels::pack_int4_groups(codes, N, K, nibbles_.data());
    group_scales_.assign(scales, scales + N * kernels::weight_groups(K));
    try {
      auto& eng = cpu_engine();
      // Plain weights, (N, K) row-major as oneDNN's (K, N): run() writes them per call. oneDNN 2.6's brgemm matmul
      // takes them as fast as its blocked layout (M = 1024, K = 1600, N = 64, one thread, f32 and bf16).
      std::optional<dnnl::matmul::desc> op;
      const auto pd = describe(tag::ba, op);
      weights_desc_ = pd.weights_desc();
      impl_ = std::string(pd.impl_info_str()) + " (int4 dequantized per call)";
      if (has_bias_) {
        bias_ = memory(memory::desc({1, N}, dt::f32, tag::ab), eng);
        std::copy(bias, bias + N, static_cast<float*>(bias_.get_data_handle()));
      }
    } catch (const dnnl::error& e) {
      fail(code_of(e.status), std::string("oneDNN: creating a ") + std::to_string(N) + "x" + std::to_string(K) +
                                    " int4 linear layer failed: " + e.what());
    }
    return;
  }
  try {
    w_scales_.assign(scales, scales + N);
    w_sums_.assign(static_cast<size_t>(N), 0);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) w_sums_[n] += codes[n * K + k];
    }
    if (bias) bias_host_.assign(bias, bias + N);
    std::optional<dnnl::matmul::desc> op;
    auto pd = int8_matmul(128, K, N, op);
    skip_amx(pd, gemm_, K);
    if (!on_vnni(pd)) {
      fail(ErrorCode::internal, std::string("oneDNN: its u8 x s8 matmul here is ") + pd.impl_info_str() +
                                    ", not VNNI (Linear::int8_available() said otherwise)");
    }
    weights_desc_ = pd.weights_desc();
    impl_ = std::string(pd.impl_info_str()) + " (u8 x s8, activations per row)";
    weights_ = memory(weights_desc_, cpu_engine());
    // oneDNN reads our (N, K) codes as its (K, N) matrix.
    memory user_w(memory::desc({K, N}, dt::s8, memory::dims{1, K}), cpu_engine(), const_cast<int8_t*>(codes));
    dnnl::stream s(cpu_engine());
    dnnl::reorder(user_w, weights_).execute(s, user_w, weights_);
    s.wait();
  } catch (const dnnl::error& e) {
    fail(code_of(e.status), std::string("oneDNN: creating a ") + std::to_string(N) + "x" + std::to_string(K) +
                                  " int8 linear layer failed: " + e.what());
  }
}

Linear::Linear(const TensorView& w, const float* bias, DType compute)
    : N_(w.shape[0]), K_(w.shape[1]), compute_(compute), gemm_(compute), has_bias_(bias != nullptr) {
  const int64_t N = N_, K = K_;
  dnnl_type(compute);  // refuses a type that is not a compute type
  try {
    auto& eng = cpu_engine();
    // Let oneDNN choose the weights' blocked layout for a representative M; every later primitive is
    // created with this same layout, so the weights exist once, reordered (and rounded to bf16) once.
    const memory::desc b_desc({1, N}, dt::f32, tag::ab);
    std::optional<dnnl::matmul::desc> op;
    const auto pd = describe(tag::any, op);
    weights_desc_ = pd.weights_desc();
    impl_ = pd.impl_info_str();
    if (gemm_ != compute_) impl_ += " (f32 on bf16 values)";
    weights_ = memory(weights_desc_, eng);
    // oneDNN reorders f32 and bf16 through any positive strides: our (N, K) view is its (K, N) matrix with the
    // strides swapped. f16 (which oneDNN 2.6 does not reorder on every CPU), unaligned data and broadcast (zero)
    // strides are first read into a contiguous (N, K) copy in the compute type; so are the weights of a bf16 layer
    // on f32 GEMMs, rounded to bf16 and widened back.
    std::vector<std::byte> staged;
    const bool direct = gemm_ == compute_ && (w.dtype == DType::f32 || w.dtype == DType::bf16) &&
                        w.strides[0] > 0 && w.strides[1] > 0 &&
                        reinterpret_cast<uintptr_t>(w.data) % size_of(w.dtype) == 0;
    memory::desc user_desc;
    const void* user_data = w.data;
    if (direct) {
      user_desc = memory::desc({K, N}, dnnl_type(w.dtype), memory::dims{w.strides[1], w.strides[0]});
    } else {
      staged.resize(static_cast<size_t>(N * K) * size_of(compute));
      convert(w, compute, staged.data());
      if (gemm_ != compute_) {  // the bf16 values, widened (exactly) for the f32 GEMM
        std::vector<std::byte> wide(static_cast<size_t>(N * K) * sizeof(float));
        convert(TensorView::contiguous(staged.data(), DType::bf16, {N, K}), DType::f32, wide.data());
        staged = std::move(wide);
      }
      user_desc = memory::desc({K, N}, dnnl_type(gemm_), tag::ba);
      user_data = staged.data();
    }
    memory user_w(user_desc, eng, const_cast<void*>(user_data));
    dnnl::stream s(eng);
    dnnl::reorder(user_w, weights_).execute(s, user_w, weights_);
    if (has_bias_) {
      bias_ = memory(b_desc, eng);
      std::copy(bias, bias + N, static_cast<float*>(bias_.get_data_handle()));
    }
    s.wait();
  } catch (const dnnl::error& e) {
    fail(code_of(e.status), std::string("oneDNN: creating a ") + std::to_string(N) + "x" + std::to_string(K) +
                                  " linear layer failed: " + e.what());
  }
}

Linear::Linear(Linear&&) noexcept = default;
Linear& Linear::operator=(Linear&&) noexcept = default;
Linear::~Linear() = default;

ExecContext::ExecContext() = default;
ExecContext::~ExecContext() = default;

void ExecContext::trim() noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.size() <= kKeptEntries) return;
  try {
    std::vector<std::pair<uint64_t, Key>> by_use;  // the entries trim may drop
    by_use.reserve(entries_.size());
    for (const auto& [key, e] : entries_) {
      if (!e->reserved) by_use.emplace_back(e->last_use, key);
    }
    if (by_use.size() <= kKeptEntries) return;
    const auto drop = static_cast<std::ptrdiff_t>(by_use.size() - kKeptEntries);
    std::nth_element(by_use.begin(), by_use.begin() + drop, by_use.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto it = by_use.begin(); it != by_use.begin() + drop; ++it) entries_.erase(it->second);
  } catch (const std::bad_alloc&) {
    // Keep every entry: the next call tries again.
  }
}

size_t ExecContext::entries() {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

size_t ExecContext::reserved() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto pinned = [](const auto& e) { return e.second->reserved; };
  return static_cast<size_t>(std::count_if(entries_.begin(), entries_.end(), pinned));
}

size_t ExecContext::KeyHash::operator()(const Key& k) const {
  size_t h = 0;
  for (int64_t v : {k.N, k.K, static_cast<int64_t>(k.format), static_cast<int64_t>(k.bias), static_cast<int64_t>(k.compute),
                    static_cast<int64_t>(k.gemm), static_cast<int64_t>(k.dst), k.M, k.lda, k.ldc, static_cast<int64_t>(k.threads),
                    static_cast<int64_t>(k.slot)}) {
    h = h * 0x9e3779b97f4a7c15ull + std::hash<int64_t>()(v);
  }
  return h;
}

ExecContext::Entry& Linear::entry(ExecContext& ctx, int64_t M, int64_t lda, int64_t ldc, int threads, int slot,
                                  DType dst_type, bool pin, ExecContext::Wide** wide_out) const {
  if (dst_type != DType::f32 && dst_type != compute_) {
    fail(ErrorCode::internal,
         std::string("linear: a ") + to_string(compute_) + " GEMM cannot write " + to_string(dst_type));
  }
  const ExecContext::Key key{N_, K_, format_ == WeightFormat::int4 ? format_ : WeightFormat::compute, has_bias_,
                             compute_, gemm_, dst_type, M, lda, ldc, threads, slot};
  const bool int8 = gemm_ == DType::u8;
  std::lock_guard<std::mutex> lock(ctx.mu_);
  // The slot's dense result buffer, grown (only) for a larger shape, when the entry writes through it.
  // And an int4 Linear's weights buffer (whose contents a resize loses).
  const auto via_wide = [&](ExecContext::Entry& e) -> ExecContext::Entry& {
    const bool int4 = format_ == WeightFormat::int4;
    if (e.via != ExecContext::Entry::Via::direct || int4) {
      ExecContext::Wide& wd = ctx.wide_[slot];
      if (const auto floats = static_cast<size_t>(M * N_); e.via != ExecContext::Entry::Via::direct &&
                                                           wd.dst.size() < floats) {
        wd.dst.resize(floats);
      }
      if (const size_t bytes = static_cast<size_t>(N_ * K_) * size_of(gemm_); int4 && wd.weights.size() < bytes) {
        wd.weights.resize(bytes);
        wd.weights_of = 0;
      }
      if (wide_out) *wide_out = &wd;
    }
    return e;
  };
  if (auto it = ctx.entries_.find(key); it != ctx.entries_.end()) {
    // oneDNN picks the blocked weights layout from the shape alone, so every Linear of this shape has it.
    if (it->second->weights_desc != weights_desc_) fail(ErrorCode::internal, "oneDNN: weights layouts differ for one shape");
    it->second->last_use = ++ctx.uses_;
    it->second->reserved = it->second->reserved || pin;
    return via_wide(*it->second);
  }
  try {
    auto& eng = cpu_engine();
    using Via = ExecContext::Entry::Via;
    // A bf16 Linear on f32 GEMMs reads x as f32 (operand()), and writes a bf16 y through a dense f32 one; an int8 one
    // reads u8 codes and writes its int32 sums there, which run() rescales into y.
    const Via first = int8 ? Via::int8_sums : gemm_ != compute_ && dst_type != DType::f32 ? Via::f32_to_bf16 : Via::direct;
    const memory::desc src({M, K_}, dnnl_type(gemm_), memory::dims{lda, 1});
    const auto make = [&](Via via) {
      const bool dense = via != Via::direct;
      const dt out = int8 ? dt::s32 : via == Via::f32_to_bf16 || gemm_ != compute_ ? dt::f32 : dnnl_type(dst_type);
      const memory::desc dst_desc({M, N_}, out, memory::dims{dense ? N_ : ldc, 1});
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      // Created under the caller's thread count: oneDNN plans its work split for it.
      ScopedOmpThreads scope(threads);
      // Named, so that it outlives pd: skip_amx's next_impl() reads it in place. int8 adds its bias itself.
      const dnnl::matmul::desc op = has_bias_ && !int8
                                        ? dnnl::matmul::desc(src, weights_desc_, bias_.get_desc(), dst_desc)
                                        : dnnl::matmul::desc(src, weights_desc_, dst_desc);
      dnnl::matmul::primitive_desc pd(op, attr, eng);
      skip_amx(pd, gemm_, K_);
      return std::pair{pd, dst_desc};
    };
    auto [pd, dst_desc] = make(first);
    Via via = first;
    // oneDNN 2.6's brgemm matmul takes dense rows only, and with its blocked weights the one implementation left for a
    // strided y is the reference loop: on an Intel Xeon (family 6, model 207) gpt2-small's output projection panels,
    // written at row stride d_model, took 20.4 s of a 48.8 ms prefill (T = 1024, 2 threads). Such a y is written
    // densely into the slot's buffer and copied.
    // int4's plain weights likewise: oneDNN 2.6's gemm:jit, which takes the strided y, wrote through a null pointer on
    // them (M = 1, K = 120, N = 24, ldc = 120, AVX-512 Xeon); its brgemm, on dense rows, runs them.
    if (via == Via::direct && ldc != N_ &&
        (format_ == WeightFormat::int4 || std::string_view(pd.impl_info_str()).rfind("ref:", 0) == 0)) {
      via = Via::dense_copy;
      std::tie(pd, dst_desc) = make(via);
    }
    auto e = std::make_unique<ExecContext::Entry>();
    e->prim = dnnl::matmul(pd);
    e->stream = dnnl::stream(eng);
    e->src = memory(src, eng, DNNL_MEMORY_NONE);
    e->weights = memory(weights_desc_, eng, DNNL_MEMORY_NONE);
    e->weights_desc = weights_desc_;
    e->dst = memory(dst_desc, eng, DNNL_MEMORY_NONE);
    e->via = via;
    e->impl = pd.impl_info_str();
    e->scratch = memory(pd.scratchpad_desc(), eng);
    std::vector<std::pair<int, memory>> args = {{DNNL_ARG_SRC, e->src}, {DNNL_ARG_WEIGHTS, e->weights},
                                                {DNNL_ARG_DST, e->dst}, {DNNL_ARG_SCRATCHPAD, e->scratch}};
    if (has_bias_ && !int8) {
      e->bias = memory(bias_.get_desc(), eng, DNNL_MEMORY_NONE);
      args.emplace_back(DNNL_ARG_BIAS, e->bias);
    }
    for (auto& [arg, mem] : args) {
      e->keep_alive.push_back(mem);
      e->c_args.push_back({arg, mem.get()});
    }
    e->last_use = ++ctx.uses_;
    e->reserved = pin;
    return via_wide(*ctx.entries_.emplace(key, std::move(e)).first->second);
  } catch (const dnnl::error& e) {
    fail(code_of(e.status), "oneDNN: creating a matmul for M=" + std::to_string(M) + " failed: " + e.what());
  }
}

void Linear::prepare(ExecContext& ctx, int64_t M, int64_t lda, int64_t ldc, int threads, int slot, DType dst) const {
  entry(ctx, M, lda, ldc, threads, slot, dst, /*pin=*/true);
}

void Linear::run(ExecContext& ctx, const void* x, int64_t M, int64_t lda, void* y, int64_t ldc, int threads, int slot,
                 DType dst, const float* row_scales) const {
  const bool int8 = gemm_ == DType::u8;
  if (int8 != (row_scales != nullptr)) {
    fail(ErrorCode::internal, int8 ? "linear: an int8 GEMM without its activations' row scales"
                                   : "linear: row scales given to a GEMM that reads no int8 activations");
  }
  ExecContext::Wide* wide = nullptr;
  ExecContext::Entry& e = entry(ctx, M, lda, ldc, threads, slot, dst, /*pin=*/false, &wide);
  e.src.set_data_handle(const_cast<void*>(x));
  if (format_ == WeightFormat::int4) {
    if (wide->weights_of != id_) {
      // bf16 values in f32 GEMMs where oneDNN has no bf16 matmul: rounded to bf16, widened.
      dequantize_(nibbles_.data(), group_scales_.data(), N_, K_, gemm_, compute_ == DType::bf16, wide->weights.data());
      wide->weights_of = id_;
    }
    e.weights.set_data_handle(wide->weights.data());
  } else {
    e.weights.set_data_handle(weights_.get_data_handle());
  }
  if (has_bias_ && !int8) e.bias.set_data_handle(bias_.get_data_handle());
  using Via = ExecContext::Entry::Via;
  e.dst.set_data_handle(e.via != Via::direct ? wide->dst.data() : y);
  ScopedOmpThreads scope(threads);
  const dnnl_status_t st =
      dnnl_primitive_execute(e.prim.get(), e.stream.get(), static_cast<int>(e.c_args.size()), e.c_args.data());
  if (st != dnnl_success) fail(code_of(st), "oneDNN: matmul execution failed (status " + std::to_string(st) + ")");
  e.stream.wait();
  if (e.via == Via::int8_sums) {  // y = (sum - 128 colsum) x_scale w_scale + b, in f32, stored as dst
    // One loop per output type, without branches, so that the compiler vectorizes it (with the bf16 store in the
    // loop it did not: the epilogue took ~10% of gpt2-xl's int8 prefill).
    const auto* acc = reinterpret_cast<const int32_t*>(wide->dst.data());
    const float* ws = w_scales_.data();
    const int32_t* sums = w_sums_.data();
    const float* b = has_bias_ ? bias_host_.data() : nullptr;
    const auto value = [&](const int32_t* a, float sx, int64_t n) {
      return static_cast<float>(a[n] - 128 * sums[n]) * (sx * ws[n]) + (b ? b[n] : 0.0f);
    };
    for (int64_t i = 0; i < M; ++i) {
      const float sx = row_scales[i];
      const int32_t* a = acc + i * N_;
      if (dst == DType::f32) {
        float* yf = static_cast<float*>(y) + i * ldc;
        for (int64_t n = 0; n < N_; ++n) yf[n] = value(a, sx, n);
      } else {
        auto* yb = static_cast<kernels::bf16*>(y) + i * ldc;
        for (int64_t n = 0; n < N_; ++n) yb[n] = kernels::to_bf16(value(a, sx, n));
      }
    }
    return;
  }
  if (e.via == Via::f32_to_bf16) {  // the f32 result rounded into the bf16 y
    auto* yb = static_cast<kernels::bf16*>(y);
    const float* y32 = wide->dst.data();
    for (int64_t i = 0; i < M; ++i)
      for (int64_t n = 0; n < N_; ++n) yb[i * ldc + n] = kernels::to_bf16(y32[i * N_ + n]);
  } else if (e.via == Via::dense_copy) {  // dense rows of dst's type into the strided y
    const size_t row = static_cast<size_t>(N_) * size_of(dst);
    for (int64_t i = 0; i < M; ++i) {
      std::memcpy(static_cast<std::byte*>(y) + i * ldc * size_of(dst),
                  reinterpret_cast<const std::byte*>(wide->dst.data()) + i * row, row);
    }
  }
}

size_t ExecContext::reference_entries() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto ref = [](const auto& e) { return e.second->impl.rfind("ref:", 0) == 0; };
  return static_cast<size_t>(std::count_if(entries_.begin(), entries_.end(), ref));
}

}  // namespace gpt2attn::detail

namespace gpt2attn {

void limit_gemm_isa(Isa isa) { detail::cap_onednn(isa); }

}  // namespace gpt2attn
