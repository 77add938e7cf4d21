// tests/alloc/no_alloc_test.cpp: the serving steady state allocates nothing, and an allocation that fails anywhere
// in a serving life cycle, alone or with every allocation after it, reaches the caller as Error(out_of_memory), as
// does a bad argument met with an exhausted heap.
// This program replaces malloc and its relatives (forwarding to glibc's __libc_* entry points) and operator
// new/delete for the whole process, counts every allocation made while a flag is armed, and requires zero during
// decode steps after reserve_serving() and during ragged steps of up to 64 tokens after reserve_step(), on every
// instruction set this CPU runs. forward() and extend() run oneDNN
// GEMMs, and oneDNN 2.6 builds an argument map on every primitive execution; for them the test requires no
// allocation outside oneDNN and the same oneDNN count on a repeat of the same work (a primitive created on the first
// run would make the counts differ).
// A separate executable, not a GoogleTest suite: replacing malloc must not leak into gpt2attn_tests, and it cannot
// run under a sanitizer (which replaces malloc itself). It does not check results (tests/test_kv_cache_*.cpp do).
#include <execinfo.h>
#include <link.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpt2attn/gpt2attn.h"
#include "gpt2attn/gpt2.hpp"
#include "gpt2attn/gpt2attn.hpp"

// ---------------------------------------------------------------------------------------------------------------
// The allocation hook. While `g_armed`, every allocation increments `g_allocations` and one counter per origin (the
// library its immediate caller lies in: oneDNN, libgomp, anything else = gpt2attn, libstdc++, glibc); the first
// few of each origin record their size and a backtrace (backtrace() itself does not allocate once libgcc_s is
// loaded, which main() does first).

extern "C" {
void* __libc_malloc(size_t);
void __libc_free(void*);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
}

namespace {

std::atomic<bool> g_armed{false};
std::atomic<long> g_allocations{0};
std::atomic<long> g_frees{0};

// Origins, found from the immediate caller's address (library text ranges read once at start-up).
enum Origin { kOneDnn, kGomp, kOther, kOrigins };
const char* const kOriginNames[kOrigins] = {"oneDNN (libdnnl)", "libgomp", "other (gpt2attn, libstdc++, libc)"};
struct Range {
  uintptr_t lo = 0, hi = 0;
};
Range g_ranges[2];  // kOneDnn, kGomp
std::atomic<long> g_by_origin[kOrigins];

constexpr int kRecorded = 3, kFrames = 24;
struct Sample {
  size_t size;
  void* stack[kFrames];
  int depth;
};
Sample g_samples[kOrigins][kRecorded];
thread_local bool t_in_hook = false;  // backtrace() may call malloc on first use: no recursion

Origin origin_of(const void* caller) {
  const auto a = reinterpret_cast<uintptr_t>(caller);
  for (int o = 0; o < 2; ++o) {
    if (a >= g_ranges[o].lo && a < g_ranges[o].hi) return static_cast<Origin>(o);
  }
  return kOther;
}

int find_library_ranges(dl_phdr_info* info, size_t, void*) {
  const std::string name = info->dlpi_name ? info->dlpi_name : "";
  const int o = name.find("libdnnl.so") != std::string::npos   ? kOneDnn
                : name.find("libgomp.so") != std::string::npos ? kGomp
                                                               : -1;
  if (o < 0) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    const uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
    if (g_ranges[o].lo == 0 || lo < g_ranges[o].lo) g_ranges[o].lo = lo;
    if (hi > g_ranges[o].hi) g_ranges[o].hi = hi;
  }
  return 0;
}

__attribute__((always_inline)) inline void note_allocation_from(size_t n, const void* caller) {
  if (!g_armed.load(std::memory_order_relaxed) || t_in_hook) return;
  g_allocations.fetch_add(1);
  const Origin o = origin_of(caller);
  const long i = g_by_origin[o].fetch_add(1);
  if (i < kRecorded) {
    t_in_hook = true;
    g_samples[o][i].size = n;
    g_samples[o][i].depth = backtrace(g_samples[o][i].stack, kFrames);
    t_in_hook = false;
  }
}
#define note_allocation(n) note_allocation_from((n), __builtin_return_address(0))

void note_free(void* p) {
  if (p && g_armed.load(std::memory_order_relaxed) && !t_in_hook) g_frees.fetch_add(1);
}

// Fault injection: while g_fail_at > 0, the g_fail_at-th call of a throwing operator new made outside oneDNN and
// libgomp throws std::bad_alloc (as a real out-of-memory would): that call alone, or with g_fail_later every such call
// after it too (a heap that stays exhausted, where even an error message cannot be built); g_injected says whether
// it happened, and the first failure's backtrace is kept.
std::atomic<long> g_fail_at{0}, g_new_calls{0};
std::atomic<bool> g_fail_later{false}, g_injected{false};
__attribute__((always_inline)) inline void maybe_fail_new(const void* caller) {
  const long at = g_fail_at.load();
  if (at == 0 || t_in_hook || origin_of(caller) != kOther) return;
  const long call = g_new_calls.fetch_add(1) + 1;
  if (call == at) {
    g_injected.store(true);
    t_in_hook = true;
    g_samples[kOther][0].depth = backtrace(g_samples[kOther][0].stack, kFrames);
    t_in_hook = false;
    throw std::bad_alloc();
  }
  if (call > at && g_fail_later.load()) throw std::bad_alloc();
}

// Not a function: the caller's address must be the allocating function's caller.
#define aligned(alignment, n) (note_allocation(n), __libc_memalign((alignment), (n)))

}  // namespace

extern "C" {
void* malloc(size_t n) {
  note_allocation(n);
  return __libc_malloc(n);
}
void free(void* p) {
  note_free(p);
  __libc_free(p);
}
void* calloc(size_t count, size_t n) {
  note_allocation(count * n);
  return __libc_calloc(count, n);
}
void* realloc(void* p, size_t n) {
  note_allocation(n);
  return __libc_realloc(p, n);
}
void* memalign(size_t alignment, size_t n) { return aligned(alignment, n); }
void* aligned_alloc(size_t alignment, size_t n) { return aligned(alignment, n); }
void* valloc(size_t n) { return aligned(static_cast<size_t>(sysconf(_SC_PAGESIZE)), n); }
void* pvalloc(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return aligned(page, (n + page - 1) / page * page);
}
int posix_memalign(void** out, size_t alignment, size_t n) {
  if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) return EINVAL;
  void* p = aligned(alignment, n);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
}

void* operator new(size_t n) {
  note_allocation(n);
  maybe_fail_new(__builtin_return_address(0));
  if (void* p = __libc_malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) {
  note_allocation(n);
  maybe_fail_new(__builtin_return_address(0));
  if (void* p = __libc_malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  note_allocation(n);
  return __libc_malloc(n ? n : 1);
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  note_allocation(n);
  return __libc_malloc(n ? n : 1);
}
void* operator new(size_t n, std::align_val_t a) {
  if (void* p = aligned(static_cast<size_t>(a), n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n, std::align_val_t a) {
  if (void* p = aligned(static_cast<size_t>(a), n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new(size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return aligned(static_cast<size_t>(a), n ? n : 1);
}
void* operator new[](size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return aligned(static_cast<size_t>(a), n ? n : 1);
}
void operator delete(void* p) noexcept { free(p); }
void operator delete[](void* p) noexcept { free(p); }
void operator delete(void* p, size_t) noexcept { free(p); }
void operator delete[](void* p, size_t) noexcept { free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { free(p); }
void operator delete(void* p, std::align_val_t) noexcept { free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { free(p); }

// ---------------------------------------------------------------------------------------------------------------
// The checks.

namespace {

using namespace gpt2attn;

int g_passed = 0, g_failed = 0;

// Runs `work` with the counter armed; passes iff it allocated nothing. On failure prints the first allocations'
// sizes and stacks (symbolise the addresses with addr2line -e <binary> if the names are missing).
void expect_no_allocation(const std::string& what, const std::function<void()>& work) {
  g_allocations.store(0);
  g_frees.store(0);
  for (auto& c : g_by_origin) c.store(0);
  g_armed.store(true);
  bool threw = false;
  std::string error;
  try {
    work();
  } catch (const std::exception& e) {
    threw = true;
    error = e.what();
  }
  g_armed.store(false);
  const long n = g_allocations.load(), frees = g_frees.load();
  if (threw) {
    std::printf("FAIL  %s: threw: %s\n", what.c_str(), error.c_str());
    ++g_failed;
    return;
  }
  if (n == 0) {
    std::printf("ok    %s (0 allocations, %ld frees)\n", what.c_str(), frees);
    ++g_passed;
    return;
  }
  std::printf("FAIL  %s: %ld allocations (and %ld frees) in the steady state; by the caller's library:", what.c_str(),
              n, frees);
  for (int o = 0; o < kOrigins; ++o) std::printf(" %s %ld%s", kOriginNames[o], g_by_origin[o].load(), o + 1 < kOrigins ? "," : "\n");
  std::fflush(stdout);
  for (int o = 0; o < kOrigins; ++o) {
    for (long i = 0; i < g_by_origin[o].load() && i < kRecorded; ++i) {
      std::printf("  %s allocation %ld: %zu bytes, from:\n", kOriginNames[o], i + 1, g_samples[o][i].size);
      std::fflush(stdout);
      backtrace_symbols_fd(g_samples[o][i].stack, g_samples[o][i].depth, STDOUT_FILENO);
    }
  }
  ++g_failed;
}

// For work that runs oneDNN GEMMs: work(0) and then work(1) (the same shapes) armed; passes iff neither allocates
// outside oneDNN and both make the same number of oneDNN allocations (its per-execution argument maps), so that
// nothing was created on the first run.
void expect_only_onednn_execution(const std::string& what, const std::function<void(int)>& work) {
  long onednn[2] = {0, 0}, other[2] = {0, 0};
  for (int run = 0; run < 2; ++run) {
    for (auto& c : g_by_origin) c.store(0);
    g_armed.store(true);
    try {
      work(run);
    } catch (const std::exception& e) {
      g_armed.store(false);
      std::printf("FAIL  %s: threw: %s\n", what.c_str(), e.what());
      ++g_failed;
      return;
    }
    g_armed.store(false);
    onednn[run] = g_by_origin[kOneDnn].load();
    other[run] = g_by_origin[kGomp].load() + g_by_origin[kOther].load();
  }
  if (other[0] == 0 && other[1] == 0 && onednn[0] == onednn[1]) {
    std::printf("ok    %s (0 outside oneDNN; oneDNN's execution argument maps: %ld per run)\n", what.c_str(), onednn[0]);
    ++g_passed;
    return;
  }
  std::printf("FAIL  %s: outside oneDNN %ld then %ld allocations; oneDNN %ld then %ld\n", what.c_str(), other[0],
              other[1], onednn[0], onednn[1]);
  ++g_failed;
}

std::vector<float> random_tokens(int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = u(rng);
  return v;
}

// gpt2-small width, B = 4 sequences of different lengths (one crosses a 64-token block boundary while armed).
void check_isa(Isa isa, DType compute) {
  const std::string tag = std::string("[isa=") + to_string(isa) + " compute=" + to_string(compute) + " threads=2] ";
  const Config c = preset("gpt2-small");
  const Weights w = Weights::random(c, 1);
  CausalSelfAttention block(c, w, EngineOptions{.threads = 2, .isa = isa, .compute = compute});
  const int64_t E = c.d_model, W = c.query_width(), B = 4;
  const RunOptions run{.threads = 2};
  std::mt19937_64 rng(2);

  // 1. Decode, per the serving contract: prefill, reserve_serving, 2 warm-up steps, then 10 armed steps.
  {
    KvCache cache(block.config(), KvCacheOptions{.block_tokens = 64, .capacity_tokens = 1024});
    Workspace ws;
    const int64_t lens[B] = {5, 17, 60, 100};
    SequenceId ids[B];
    for (int64_t b = 0; b < B; ++b) ids[b] = cache.create();
    block.reserve_serving(128, B, 2, &ws);
    for (int64_t b = 0; b < B; ++b) {
      const std::vector<float> x = random_tokens(lens[b] * W, rng);
      std::vector<float> out(static_cast<size_t>(lens[b] * E));
      block.extend(cache, ids[b], x.data(), lens[b], out.data(), run, &ws);
    }
    const std::vector<float> x = random_tokens(12 * B * W, rng);
    std::vector<float> out(static_cast<size_t>(B * E));
    for (int s = 0; s < 2; ++s) block.decode(cache, ids, B, x.data() + s * B * W, out.data(), run, &ws);
    expect_no_allocation(tag + "10 decode steps, B=4, lengths 7..102 (a block boundary crossed), own Workspace", [&] {
      for (int s = 2; s < 12; ++s) block.decode(cache, ids, B, x.data() + s * B * W, out.data(), run, &ws);
    });

    // The same with the layer's own workspace (reserve_serving without ws), 2 warm-up steps first.
    block.reserve_serving(128, B, 2);
    const std::vector<float> y = random_tokens(12 * B * W, rng);
    for (int s = 0; s < 2; ++s) block.decode(cache, ids, B, y.data() + s * B * W, out.data(), run);
    expect_no_allocation(tag + "10 decode steps, B=4, the layer's own workspace", [&] {
      for (int s = 2; s < 12; ++s) block.decode(cache, ids, B, y.data() + s * B * W, out.data(), run);
    });

    // 2. No decode warm-up: a fresh Workspace, reserve_serving, prefills (oneDNN: see the file comment) of chunk
    // shapes seen once on a first pair of sequences and repeated on new ones, then decode steps.
    Workspace fresh;
    block.reserve_serving(128, 2, 2, &fresh);
    SequenceId more[4] = {cache.create(), cache.create(), cache.create(), cache.create()};
    const std::vector<float> p = random_tokens(128 * W, rng);
    const std::vector<float> d = random_tokens(3 * 2 * W, rng);
    std::vector<float> pout(static_cast<size_t>(128 * E));
    block.extend(cache, more[0], p.data(), 128, pout.data(), run, &fresh);
    block.extend(cache, more[1], p.data(), 50, pout.data(), run, &fresh);
    expect_only_onednn_execution(tag + "extend of 128 tokens (a shape seen before) on a new sequence, fresh Workspace",
                                 [&](int r) { block.extend(cache, more[2 + r], p.data(), 128, pout.data(), run, &fresh); });
    SequenceId pair[2] = {more[1], more[3]};
    expect_no_allocation(tag + "3 decode steps B=2 after those extends (no decode warm-up), fresh Workspace", [&] {
      for (int s = 0; s < 3; ++s) block.decode(cache, pair, 2, d.data() + s * 2 * W, out.data(), run, &fresh);
    });
  }

  // 3. Ragged steps (step() of several entries, not all single tokens: neither decode() nor extend()) of up to 64
  // tokens, whose projections run on the library's own kernel: after reserve_step() and no warm-up, nothing at all.
  // Three mixes: drafts of 4 on two sequences, single tokens on four and a chunk of 20 (32 tokens over 7 entries, the
  // decode kernel); drafts of 8, single tokens and a chunk of 40 (60 tokens, the tiled kernel for the chunk); four
  // drafts of 16 (64 tokens, the most on the few-row kernel). The prompts (62 and 63 tokens among them) put block
  // boundaries inside the steps. Each repeat truncates the sequences back to their prompts first (not counted), so
  // the armed steps append into the same blocks again and again. Steps of more than 64 tokens run oneDNN, whose
  // per-execution argument map allocates (see reserve_serving): not checked here.
  {
    constexpr int64_t kSeqs = 7, kMaxTokens = 64;
    KvCache cache(block.config(), KvCacheOptions{.block_tokens = 64, .capacity_tokens = 2048});
    const int64_t lens[kSeqs] = {3, 62, 63, 64, 90, 127, 10};
    SequenceId ids[kSeqs];
    for (int64_t s = 0; s < kSeqs; ++s) {
      ids[s] = cache.create();
      const std::vector<float> x = random_tokens(lens[s] * W, rng);
      std::vector<float> out(static_cast<size_t>(lens[s] * E));
      block.extend(cache, ids[s], x.data(), lens[s], out.data(), run);
    }
    struct Mix {
      std::vector<SequenceId> seqs;
      std::vector<int64_t> tokens;
    };
    const std::vector<Mix> mixes = {
        {{ids[1], ids[0], ids[2], ids[3], ids[4], ids[5], ids[6]}, {4, 1, 4, 1, 1, 1, 20}},
        {{ids[6], ids[1], ids[2], ids[0], ids[5]}, {40, 8, 8, 1, 3}},
        {{ids[2], ids[3], ids[4], ids[1]}, {16, 16, 16, 16}},
    };
    const std::vector<float> x = random_tokens(kMaxTokens * W, rng);
    std::vector<float> out(static_cast<size_t>(kMaxTokens * E));
    const auto truncate_all = [&] {
      for (int64_t s = 0; s < kSeqs; ++s) cache.truncate(ids[s], lens[s]);
    };
    const auto steps = [&](Workspace* ws) {
      for (const Mix& m : mixes) {
        block.step(cache, m.seqs.data(), m.tokens.data(), static_cast<int64_t>(m.seqs.size()), x.data(), out.data(),
                   run, ws);
      }
    };
    Workspace ws;
    block.reserve_step(kMaxTokens, kSeqs, 2, &ws);
    for (int repeat = 0; repeat < 4; ++repeat) {
      truncate_all();
      expect_no_allocation(tag + "ragged steps of 32, 60 and 64 tokens (7, 5 and 4 entries) after reserve_step, "
                                 "own Workspace, repeat " + std::to_string(repeat + 1),
                           [&] { steps(&ws); });
    }
    // The same with the layer's own workspace (reserve_step without ws).
    block.reserve_step(kMaxTokens, kSeqs, 2);
    for (int repeat = 0; repeat < 2; ++repeat) {
      truncate_all();
      expect_no_allocation(tag + "ragged steps of 32, 60 and 64 tokens after reserve_step, the layer's own "
                                 "workspace, repeat " + std::to_string(repeat + 1),
                           [&] { steps(nullptr); });
    }
  }

  // 4. forward(): repeated calls of one shape after reserve and one warm-up call, and the first call of a shape
  // right after reserve() (which creates its primitives), compared with the second.
  {
    const int64_t FB = 2, T = 64;
    const std::vector<float> x = random_tokens(FB * T * W, rng);
    std::vector<float> out(static_cast<size_t>(FB * T * E));
    block.layer().reserve(FB, T, T);
    block.forward(x.data(), FB, T, out.data(), run);
    expect_only_onednn_execution(tag + "5 forward calls B=2 T=64 after reserve + 1 warm-up, layer's own workspace",
                                 [&](int) {
                                   for (int i = 0; i < 5; ++i) block.forward(x.data(), FB, T, out.data(), run);
                                 });
    Workspace cold;
    const int64_t T2 = 50;
    block.layer().reserve(FB, T2, T2, &cold);
    expect_only_onednn_execution(tag + "first forward call B=2 T=50 right after reserve(2, 50, 50), own Workspace",
                                 [&](int) { block.forward(x.data(), FB, T2, out.data(), run, &cold); });
  }
}

// What f() threw with its n-th C++ allocation failing (with `later`, every one after it too), inspected once
// allocations work again: whether it was Error(out_of_memory), whether that was the preallocated one
// (engine/buffer.cpp), or else what escaped the API instead (empty when f() returned).
struct Outcome {
  bool out_of_memory = false, unnamed = false;
  std::string escaped;
};
template <class F>
Outcome run_failing(long n, bool later, F&& f) {
  g_new_calls.store(0);
  g_injected.store(false);
  g_fail_later.store(later);
  g_fail_at.store(n);
  // Kept, not inspected, until allocations work again (current_exception allocates nothing).
  std::exception_ptr thrown;
  try {
    f();
  } catch (...) {
    thrown = std::current_exception();
  }
  g_fail_at.store(0);
  Outcome o;
  if (!thrown) return o;
  try {
    std::rethrow_exception(thrown);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::out_of_memory) {
      o.out_of_memory = true;
      o.unnamed = std::string(e.what()).find("too little left to name the call") != std::string::npos;
    } else {
      o.escaped = std::string("Error with code ") + std::to_string(static_cast<int>(e.code())) + ": " + e.what();
    }
  } catch (const std::bad_alloc&) {
    o.escaped = "std::bad_alloc";
  } catch (const std::exception& e) {
    o.escaped = std::string("std::exception: ") + e.what();
  }
  return o;
}

// A server's whole life cycle on one layer (construction, a cache, prefill, fork, decode, forward), run again and
// again with its n-th C++ allocation failing, n = 1, 2, ... until a run makes fewer allocations than n. Each run
// must end in success or in Error(out_of_memory): never std::bad_alloc or another exception escaping the API. With
// `later`, every allocation after the n-th fails too, so the library's own handlers cannot allocate their messages.
void check_allocation_failures(bool later) {
  Config c;
  c.d_model = 32, c.num_heads = 2, c.context_length = 64, c.causal = true;
  const Weights w = Weights::random(c, 3);
  std::mt19937_64 rng(4);
  const std::vector<float> x = random_tokens(6 * c.d_model, rng);
  std::vector<float> out(static_cast<size_t>(6 * c.d_model));
  auto life = [&] {
    CausalSelfAttention layer(c, w, EngineOptions{.threads = 1});
    KvCache cache(layer.config(), KvCacheOptions{.block_tokens = 4, .capacity_tokens = 64});
    const SequenceId s = cache.create();
    layer.extend(cache, s, x.data(), 6, out.data());
    const SequenceId both[2] = {s, cache.fork(s)};
    layer.decode(cache, both, 2, x.data(), out.data());
    Workspace ws;
    layer.forward(x.data(), 1, 6, out.data(), {}, &ws);
  };
  const char* mode = later ? "and every one after it " : "";
  long n = 1, errors = 0, unnamed = 0;  // unnamed: the preallocated Error (engine/buffer.cpp)
  for (;; ++n) {
    const Outcome o = run_failing(n, later, life);
    errors += o.out_of_memory ? 1 : 0;
    unnamed += o.unnamed ? 1 : 0;
    if (!o.escaped.empty()) {
      std::printf("FAIL  allocation %ld %sfailing: %s escaped the API; the failed allocation was made from:\n", n,
                  mode, o.escaped.c_str());
      std::fflush(stdout);
      backtrace_symbols_fd(g_samples[kOther][0].stack, g_samples[kOther][0].depth, STDOUT_FILENO);
      ++g_failed;
      return;
    }
    if (!g_injected.load()) break;
  }
  if (later && unnamed == 0) {  // the exhausted heap must reach the error of last resort, or this checks nothing
    std::printf("FAIL  no run with every allocation after the n-th failing ended in the preallocated Error\n");
    ++g_failed;
    return;
  }
  std::printf("ok    each of %ld C++ allocations %sof a serving life cycle failed in turn: %ld ended in "
              "Error(out_of_memory) (%ld of them the preallocated one), the rest recovered\n", n - 1, mode, errors,
              unnamed);
  ++g_passed;
}

// Bad arguments met with an exhausted heap: every allocation fails from the call's start, so no error message can be
// built, and the caller must still get an Error (the preallocated out-of-memory one), not std::bad_alloc.
void check_bad_arguments_without_memory() {
  Config c;
  c.d_model = 32, c.num_heads = 2, c.context_length = 64, c.causal = true;
  const Weights w = Weights::random(c, 3);
  Config bad = c;
  bad.num_heads = 3;  // does not divide d_model
  CausalSelfAttention layer(c, w, EngineOptions{.threads = 1});
  KvCache cache(layer.config(), KvCacheOptions{.block_tokens = 4, .capacity_tokens = 64});
  const SequenceId unknown = 12345;
  float row[16];
  const std::vector<float> x(static_cast<size_t>((c.context_length + 1) * c.d_model), 0.5f);
  std::vector<float> out(x.size());
  struct Case {
    const char* name;
    std::function<void()> call;
  };
  const std::vector<Case> cases = {
      {"MultiHeadAttention(a config whose heads do not divide d_model)", [&] { MultiHeadAttention m(bad, w); }},
      {"KvCache::length(an unknown id)", [&] { cache.length(unknown); }},
      {"KvCache::fork(an unknown id)", [&] { cache.fork(unknown); }},
      {"KvCache::release(an unknown id)", [&] { cache.release(unknown); }},
      {"KvCache::blocks_needed(an unknown id)", [&] { cache.blocks_needed(unknown, 1); }},
      {"KvCache::read_key(an unknown id)", [&] { cache.read_key(unknown, 0, 0, row); }},
      {"CausalSelfAttention(a config whose heads do not divide d_model)",
       [&] { CausalSelfAttention l(bad, w, EngineOptions{.threads = 1}); }},
      {"CausalSelfAttention::decode(an unknown id)",
       [&] { layer.decode(cache, &unknown, 1, x.data(), out.data()); }},
      {"CausalSelfAttention::extend(an unknown id)",
       [&] { layer.extend(cache, unknown, x.data(), 1, out.data()); }},
      {"CausalSelfAttention::forward(T past the context length)",
       [&] { layer.forward(x.data(), 1, c.context_length + 1, out.data()); }},
      {"KvCache(a negative block size)",
       [&] { KvCache k(layer.config(), KvCacheOptions{.block_tokens = -1, .capacity_tokens = 64}); }},
  };
  for (const Case& k : cases) {
    const Outcome o = run_failing(1, true, k.call);
    const std::string got = o.out_of_memory ? "" : o.escaped.empty() ? "no exception" : o.escaped;
    if (got.empty()) {
      std::printf("ok    %s with every allocation failing: Error(out_of_memory)\n", k.name);
      ++g_passed;
    } else {
      std::printf("FAIL  %s with every allocation failing: %s\n", k.name, got.c_str());
      ++g_failed;
    }
  }
}

// The C API's message on a thread whose first failure meets an exhausted heap: the message buffer cannot be made
// (it is a thread's own, made on its first failure: not a thread_local, which glibc allocates on first use in a
// dlopen-ed library and ends the process when it cannot), so the status says out of memory and the message is the
// fixed one; once memory is back, the thread's next failure gets its own message.
void check_c_api_message_without_memory() {
  gpt2attn_status_t first = GPT2ATTN_OK, second = GPT2ATTN_OK;
  std::string first_message, second_message;
  Outcome o;
  std::thread fresh([&] {
    gpt2attn_seq_t s = 0;
    o = run_failing(1, true, [&] { first = gpt2attn_seq_create(nullptr, &s); });
    first_message = gpt2attn_last_error();
    second = gpt2attn_seq_create(nullptr, &s);
    second_message = gpt2attn_last_error();
  });
  fresh.join();
  const bool ok = o.escaped.empty() && !o.out_of_memory && first == GPT2ATTN_ERR_OUT_OF_MEMORY &&
                  first_message.find("no room left to keep this call's error message") != std::string::npos &&
                  second == GPT2ATTN_ERR_INVALID_ARGUMENT &&
                  second_message.rfind("gpt2attn_seq_create: cache is NULL", 0) == 0;
  std::printf("%s  a C call failing on a fresh thread with every allocation failing: status %d \"%s\", then with "
              "memory back: status %d \"%s\"%s\n", ok ? "ok  " : "FAIL", first, first_message.c_str(), second,
              second_message.c_str(), o.escaped.empty() ? "" : (" (escaped: " + o.escaped + ")").c_str());
  ++(ok ? g_passed : g_failed);
}

// A whole model's decode steps (gpt2attn/gpt2.hpp): after a few steps of this batch size every buffer, the layers'
// workspaces and the cache's tables have their size, and a step allocates nothing: the few-row kernels for every
// projection and the LM head, the split-KV decode, the row operations, the cache's look-ups.
void check_model_decode() {
  GPT2Config c;
  c.vocab_size = 300, c.n_positions = 96, c.n_embd = 64, c.n_head = 4, c.n_layer = 2;
  for (WeightFormat f : {WeightFormat::compute, WeightFormat::int8, WeightFormat::int4}) {
    EngineOptions o;
    o.threads = 2, o.weights = f;
    GPT2 model(random_gpt2(c, 7), o);
    KvCacheOptions k;
    k.capacity_tokens = 4 * 96;
    k.block_tokens = 8;
    ModelKvCache cache = model.make_cache(k);
    std::vector<SequenceId> seqs;
    for (int b = 0; b < 4; ++b) seqs.push_back(cache.create());
    const std::vector<int64_t> prompt = {5, 9, 1, 14};
    std::vector<int32_t> ids(29, 3), next(4, 7);
    std::vector<float> logits(static_cast<size_t>(4 * c.vocab_size));
    model.step(cache, seqs.data(), prompt.data(), 4, ids.data(), logits.data());
    const std::vector<int64_t> ones(4, 1);
    for (int t = 0; t < 3; ++t) model.step(cache, seqs.data(), ones.data(), 4, next.data(), logits.data());
    expect_no_allocation(std::string("[model ") + to_string(f) + "] 10 decode steps of a 2-layer GPT-2, B=4", [&] {
      for (int t = 0; t < 10; ++t) model.step(cache, seqs.data(), ones.data(), 4, next.data(), logits.data());
    });
  }
}

}  // namespace

int main() {
  // Load the unwinder now, so that backtrace() inside the hook does not allocate.
  void* frames[2];
  backtrace(frames, 2);
  dl_iterate_phdr(find_library_ranges, nullptr);
  for (Isa isa : compiled_isas()) {  // every level built in, best first
    if (!isa_supported(isa)) {
      std::printf("skip  [isa=%s] not supported by this CPU\n", to_string(isa));
      continue;
    }
    for (DType compute : {DType::f32, DType::bf16}) {
      try {
        check_isa(isa, compute);
      } catch (const std::exception& e) {
        std::printf("FAIL  [isa=%s compute=%s] set-up threw: %s\n", to_string(isa), to_string(compute), e.what());
        ++g_failed;
      }
    }
  }
  try {
    check_model_decode();
  } catch (const std::exception& e) {
    std::printf("FAIL  [model] set-up threw: %s\n", e.what());
    ++g_failed;
  }
  check_allocation_failures(false);
  check_allocation_failures(true);
  check_bad_arguments_without_memory();
  check_c_api_message_without_memory();
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
