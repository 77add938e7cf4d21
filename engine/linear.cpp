// engine/linear.cpp: oneDNN matmul primitives for the projections (describe once, execute many).
#include "engine/linear.hpp"

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/convert.hpp"
#include "gpt2attn/error.hpp"
#include "kernels/bf16.hpp"

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
  if (compute != DType::bf16 || K % 32 == 0) return;
  while (std::string_view(pd.impl_info_str()).find("amx") != std::string_view::npos) {
    if (!pd.next_impl()) {
      fail(ErrorCode::internal, "oneDNN: no bf16 matmul without AMX for K=" + std::to_string(K) +
                                    " (oneDNN 2.6's AMX kernel is not safe where K is not a multiple of 32)");
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
  bool narrow_dst = false;              // a bf16 Linear on f32 GEMMs writing bf16: the result goes through Wide::dst
  std::vector<memory> keep_alive;       // the memory objects c_args points into
  std::vector<dnnl_exec_arg_t> c_args;  // built once: the C++ execute() would build a vector per call
  uint64_t last_use = 0;                // ExecContext::uses_ at its latest lookup
  bool reserved = false;                // made or found by prepare(): trim() keeps it
};

Linear::Linear(const TensorView& w, const float* bias, DType compute)
    : N_(w.shape[0]), K_(w.shape[1]), compute_(compute), gemm_(compute), has_bias_(bias != nullptr) {
  const int64_t N = N_, K = K_;
  dnnl_type(compute);  // refuses a type that is not a compute type
  try {
    auto& eng = cpu_engine();
    // Let oneDNN choose the weights' blocked layout for a representative M; every later primitive is
    // created with this same layout, so the weights exist once, reordered (and rounded to bf16) once.
    const memory::desc b_desc({1, N}, dt::f32, tag::ab);
    // The operation descriptor outlives the primitive descriptor made from it: oneDNN's iterator reads it in place
    // when next_impl() (skip_amx) steps to another implementation. describe() (re)makes it, then the pd over it.
    std::optional<dnnl::matmul::desc> op;
    const auto describe = [&](DType gemm) {
      const dt g = dnnl_type(gemm);
      const memory::desc src_any({128, K}, g, tag::ab), w_any({K, N}, g, tag::any), dst_any({128, N}, dt::f32, tag::ab);
      op.emplace(has_bias_ ? dnnl::matmul::desc(src_any, w_any, b_desc, dst_any)
                           : dnnl::matmul::desc(src_any, w_any, dst_any));
      return dnnl::matmul::primitive_desc(*op, eng);
    };
    auto pd = [&]() -> dnnl::matmul::primitive_desc {
      try {
        return describe(compute);
      } catch (const dnnl::error& e) {
        // oneDNN 2.6 has bf16 matmuls from avx512_core on: below, a bf16 layer multiplies in f32 (gemm_).
        if (compute != DType::bf16 || e.status != dnnl_unimplemented) throw;
        gemm_ = DType::f32;
        return describe(gemm_);
      }
    }();
    skip_amx(pd, gemm_, K);
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
  for (int64_t v : {k.N, k.K, static_cast<int64_t>(k.bias), static_cast<int64_t>(k.compute),
                    static_cast<int64_t>(k.dst), k.M, k.lda, k.ldc, static_cast<int64_t>(k.threads),
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
  const ExecContext::Key key{N_, K_, has_bias_, compute_, dst_type, M, lda, ldc, threads, slot};
  std::lock_guard<std::mutex> lock(ctx.mu_);
  if (gemm_ != compute_ && dst_type != DType::f32) {  // the slot's f32 result, grown (only) for a larger shape
    ExecContext::Wide& wd = ctx.wide_[slot];
    if (const auto floats = static_cast<size_t>(M * N_); wd.dst.size() < floats) wd.dst.resize(floats);
    if (wide_out) *wide_out = &wd;
  }
  if (auto it = ctx.entries_.find(key); it != ctx.entries_.end()) {
    // oneDNN picks the blocked weights layout from the shape alone, so every Linear of this shape has it.
    if (it->second->weights_desc != weights_desc_) fail(ErrorCode::internal, "oneDNN: weights layouts differ for one shape");
    it->second->last_use = ++ctx.uses_;
    it->second->reserved = it->second->reserved || pin;
    return *it->second;
  }
  try {
    auto& eng = cpu_engine();
    // A bf16 Linear on f32 GEMMs reads x as f32 (operand()), and writes a bf16 y through a dense f32 one.
    const bool wide = gemm_ != compute_, wide_dst = wide && dst_type != DType::f32;
    const memory::desc src({M, K_}, dnnl_type(gemm_), memory::dims{lda, 1}),
        dst({M, N_}, dt::f32, memory::dims{wide_dst ? N_ : ldc, 1});
    const memory::desc dst_desc = wide ? dst : memory::desc({M, N_}, dnnl_type(dst_type), memory::dims{ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    // Created under the caller's thread count: oneDNN plans its work split for it.
    ScopedOmpThreads scope(threads);
    // Named, so that it outlives pd: skip_amx's next_impl() reads it in place.
    const dnnl::matmul::desc op = has_bias_ ? dnnl::matmul::desc(src, weights_desc_, bias_.get_desc(), dst_desc)
                                            : dnnl::matmul::desc(src, weights_desc_, dst_desc);
    dnnl::matmul::primitive_desc pd(op, attr, eng);
    skip_amx(pd, gemm_, K_);
    auto e = std::make_unique<ExecContext::Entry>();
    e->prim = dnnl::matmul(pd);
    e->stream = dnnl::stream(eng);
    e->src = memory(src, eng, DNNL_MEMORY_NONE);
    e->weights = memory(weights_desc_, eng, DNNL_MEMORY_NONE);
    e->weights_desc = weights_desc_;
    e->dst = memory(dst_desc, eng, DNNL_MEMORY_NONE);
    e->narrow_dst = wide_dst;
    e->scratch = memory(pd.scratchpad_desc(), eng);
    std::vector<std::pair<int, memory>> args = {{DNNL_ARG_SRC, e->src}, {DNNL_ARG_WEIGHTS, e->weights},
                                                {DNNL_ARG_DST, e->dst}, {DNNL_ARG_SCRATCHPAD, e->scratch}};
    if (has_bias_) {
      e->bias = memory(bias_.get_desc(), eng, DNNL_MEMORY_NONE);
      args.emplace_back(DNNL_ARG_BIAS, e->bias);
    }
    for (auto& [arg, mem] : args) {
      e->keep_alive.push_back(mem);
      e->c_args.push_back({arg, mem.get()});
    }
    e->last_use = ++ctx.uses_;
    e->reserved = pin;
    return *ctx.entries_.emplace(key, std::move(e)).first->second;
  } catch (const dnnl::error& e) {
    fail(code_of(e.status), "oneDNN: creating a matmul for M=" + std::to_string(M) + " failed: " + e.what());
  }
}

void Linear::prepare(ExecContext& ctx, int64_t M, int64_t lda, int64_t ldc, int threads, int slot, DType dst) const {
  entry(ctx, M, lda, ldc, threads, slot, dst, /*pin=*/true);
}

void Linear::run(ExecContext& ctx, const void* x, int64_t M, int64_t lda, void* y, int64_t ldc, int threads, int slot,
                 DType dst) const {
  ExecContext::Wide* wide = nullptr;
  ExecContext::Entry& e = entry(ctx, M, lda, ldc, threads, slot, dst, /*pin=*/false, &wide);
  e.src.set_data_handle(const_cast<void*>(x));
  e.weights.set_data_handle(weights_.get_data_handle());
  if (has_bias_) e.bias.set_data_handle(bias_.get_data_handle());
  e.dst.set_data_handle(e.narrow_dst ? wide->dst.data() : y);
  ScopedOmpThreads scope(threads);
  const dnnl_status_t st =
      dnnl_primitive_execute(e.prim.get(), e.stream.get(), static_cast<int>(e.c_args.size()), e.c_args.data());
  if (st != dnnl_success) fail(code_of(st), "oneDNN: matmul execution failed (status " + std::to_string(st) + ")");
  e.stream.wait();
  if (e.narrow_dst) {  // the f32 result rounded into the bf16 y
    auto* yb = static_cast<kernels::bf16*>(y);
    const float* y32 = wide->dst.data();
    for (int64_t i = 0; i < M; ++i)
      for (int64_t n = 0; n < N_; ++n) yb[i * ldc + n] = kernels::to_bf16(y32[i * N_ + n]);
  }
}

}  // namespace gpt2attn::detail

namespace gpt2attn {

void limit_gemm_isa(Isa isa) { detail::cap_onednn(isa); }

}  // namespace gpt2attn
