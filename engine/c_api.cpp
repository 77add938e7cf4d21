// engine/c_api.cpp: the C API (include/gpt2attn/gpt2attn.h) over the C++ classes: null checks, status codes,
// the per-thread last-error message. It computes nothing itself and lets no exception out.
#include "gpt2attn/gpt2attn.h"

#include <pthread.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/validate.hpp"
#include "gpt2attn/gpt2attn.hpp"

namespace ga = gpt2attn;

#define GPT2ATTN_STR2(x) #x
#define GPT2ATTN_STR(x) GPT2ATTN_STR2(x)

// gpt2attn_layer_step's entries (an array of {seq, tokens}) as the two arrays CausalSelfAttention::step takes. The
// C++ call has no strided form, so the entries are copied; the arrays belong to the workspace handle the step runs
// on (or, for a NULL workspace, to the layer handle, under its lock), since the API already promises that a workspace
// serves one call at a time and NULL-workspace calls on one layer are serialised. They only grow, so a step no larger
// than the largest before it (or than reserve_step's max_entries) allocates nothing. Not a thread_local: each
// thread would keep its own copy for its life, and in a library loaded with dlopen glibc allocates a thread_local on
// first use and ends the process when that fails (as the error messages' comment below says), where a vector's growth
// is a bad_alloc and so an OUT_OF_MEMORY status.
struct StepEntryArrays {
  std::vector<gpt2attn_seq_t> seqs;
  std::vector<int64_t> tokens;

  void reserve(int64_t n) {
    seqs.reserve(static_cast<size_t>(n));
    tokens.reserve(static_cast<size_t>(n));
  }
  void assign(const gpt2attn_step_entry_t* entries, int64_t n) {
    reserve(n);  // both first: a bad_alloc leaves no half-grown pair
    seqs.resize(static_cast<size_t>(n));
    tokens.resize(static_cast<size_t>(n));
    for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
      seqs[i] = entries[i].seq;
      tokens[i] = entries[i].tokens;
    }
  }
};

// The handles are the C++ objects plus what a C caller needs to borrow as a stable `const char*`.
struct gpt2attn_layer {
  ga::CausalSelfAttention attn;
  std::string isa;             // to_string(attn.layer().isa())
  std::string implementation;  // attn.layer().implementation(), computed once so describe() cannot fail
  std::mutex step_mutex;       // guards step_entries: the entries of gpt2attn_layer_step calls with a NULL workspace
  StepEntryArrays step_entries;
};
struct gpt2attn_kv_cache {
  ga::KvCache cache;
};
struct gpt2attn_workspace {
  ga::Workspace ws;
  StepEntryArrays step_entries;  // gpt2attn_layer_step's entries on this workspace
};

// Sequence ids pass straight through, arrays included (decode's seqs).
static_assert(std::is_same_v<gpt2attn_seq_t, ga::SequenceId>);
static_assert(GPT2ATTN_ERR_INVALID_ARGUMENT == static_cast<int>(ga::ErrorCode::invalid_argument) &&
              GPT2ATTN_ERR_BAD_FILE == static_cast<int>(ga::ErrorCode::bad_file) &&
              GPT2ATTN_ERR_OUT_OF_MEMORY == static_cast<int>(ga::ErrorCode::out_of_memory) &&
              GPT2ATTN_ERR_INTERNAL == static_cast<int>(ga::ErrorCode::internal));

namespace {

// Each thread's message lives in a buffer of its own, made on the thread's first failure and then reused: a fixed
// size, not a std::string, so that recording an out-of-memory error needs no memory once the buffer exists. 8 KiB
// holds any message but one naming a path of thousands of characters; that one keeps its start and its end, where the
// reason is ("...: cannot open: File name too long"), with " ... " between.
// Not a thread_local: in a library loaded with dlopen (an FFI, a plugin) glibc allocates a thread's thread_locals on
// their first use and ends the process when that fails, the very case an out-of-memory status must survive. Getting
// and setting a pthread key's value allocates nothing (for a process's first 32 keys; a later key's first set may
// need memory, and its failure is handled). Where no buffer can be had, the message is kNoRoom.
constexpr size_t kMessageBytes = 8192;
constexpr char kNoRoom[] = "gpt2attn: out of memory (no room left to keep this call's error message)";

void free_message(void* p) {
  if (p != kNoRoom) delete[] static_cast<char*>(p);
}

struct MessageKey {
  pthread_key_t key{};
  bool made = false;  // zero before this object is constructed: a call from another library's initialiser gets kNoRoom
  MessageKey() { made = pthread_key_create(&key, free_message) == 0; }
  ~MessageKey() {
    if (made) pthread_key_delete(key);  // before the library unloads: no thread-exit call into its unmapped code
  }
};
const MessageKey g_messages;

// The calling thread's buffer, made on its first use; null (with kNoRoom recorded where it can be) when none can be.
char* message_buffer() noexcept {
  if (!g_messages.made) return nullptr;
  void* p = pthread_getspecific(g_messages.key);
  if (p != nullptr && p != kNoRoom) return static_cast<char*>(p);
  char* buf = nullptr;
  try {
    buf = new char[kMessageBytes];
  } catch (const std::bad_alloc&) {
    pthread_setspecific(g_messages.key, kNoRoom);
    return nullptr;
  }
  if (pthread_setspecific(g_messages.key, buf) != 0) {
    delete[] buf;
    return nullptr;
  }
  return buf;
}

gpt2attn_status_t record(gpt2attn_status_t status, const char* fn, const char* what) noexcept {
  char* const msg = message_buffer();
  if (msg == nullptr) return status;
  const int n = std::snprintf(msg, kMessageBytes, "%s: %s", fn, what);
  if (n >= static_cast<int>(kMessageBytes)) {
    constexpr size_t kTail = kMessageBytes / 2, kGap = 5;  // " ... "
    const size_t head = kMessageBytes - 1 - kGap - kTail;
    std::memcpy(msg + head, " ... ", kGap);
    const size_t what_len = std::strlen(what);
    const size_t tail = std::min(kTail, what_len);  // `what` alone may be shorter (a long fn)
    std::memcpy(msg + head + kGap, what + what_len - tail, tail);
    msg[head + kGap + tail] = '\0';
  }
  return status;
}

gpt2attn_status_t status_of(ga::ErrorCode code) noexcept {
  switch (code) {
    case ga::ErrorCode::invalid_argument: return GPT2ATTN_ERR_INVALID_ARGUMENT;
    case ga::ErrorCode::bad_file: return GPT2ATTN_ERR_BAD_FILE;
    case ga::ErrorCode::out_of_memory: return GPT2ATTN_ERR_OUT_OF_MEMORY;
    case ga::ErrorCode::internal: return GPT2ATTN_ERR_INTERNAL;
  }
  return GPT2ATTN_ERR_INTERNAL;
}

// Runs body and turns whatever it throws into a status and a message prefixed with the C function's name.
template <class Body>
gpt2attn_status_t guarded(const char* fn, Body&& body) noexcept {
  try {
    body();
    return GPT2ATTN_OK;
  } catch (const ga::Error& e) {
    return record(status_of(e.code()), fn, e.what());
  } catch (const std::bad_alloc&) {
    return record(GPT2ATTN_ERR_OUT_OF_MEMORY, fn, "out of memory");
  } catch (const std::exception& e) {
    return record(GPT2ATTN_ERR_INTERNAL, fn, e.what());
  } catch (...) {
    return record(GPT2ATTN_ERR_INTERNAL, fn, "unknown exception");
  }
}

// Null handles and pointers are the caller's mistake: an error naming the argument, never a crash.
template <class T>
T& deref(T* p, const char* name) {
  if (p == nullptr) ga::invalid(std::string(name) + " is NULL");
  return *p;
}
void require(const void* p, const char* name) {
  if (p == nullptr) ga::invalid(std::string(name) + " is NULL");
}

ga::RunOptions run_options(int threads) {
  ga::detail::check_threads(threads, "run", "threads");
  ga::RunOptions run;
  run.threads = threads;
  return run;
}

// ---- struct_size: the ABI policy's rule for structs that grow (gpt2attn.h) ----------------------------------------
// The size of each struct's first version: the smallest struct_size accepted. Appending a field leaves these as they
// are; the fields after them read as 0 from a caller whose header predates them.
constexpr size_t kConfigFirstSize = offsetof(gpt2attn_config_t, num_kv_heads) + sizeof(int64_t);
constexpr size_t kKvCacheOptionsFirstSize = offsetof(gpt2attn_kv_cache_options_t, kv_dtype) + sizeof(const char*);
constexpr size_t kEngineOptionsFirstSize = offsetof(gpt2attn_engine_options_t, compute) + sizeof(const char*);
// Far above any struct this API will have, far below what a garbage struct_size (an uninitialised struct) makes us
// read or write.
constexpr size_t kMaxStructSize = 4096;

// The caller's struct_size, checked against [first_size, kMaxStructSize]; `type` is the C name without its _t.
size_t checked_struct_size(uint32_t struct_size, size_t first_size, const char* name, const char* type) {
  if (struct_size < first_size || struct_size > kMaxStructSize) {
    ga::invalid(std::string(name) + ".struct_size is " + std::to_string(struct_size) + ": set it to sizeof(" + type +
                "_t), as " + type + "_init() does");
  }
  return struct_size;
}

// A struct the caller passes in, read by its struct_size: fields past the caller's size are 0 (their default), and
// the bytes a newer header added past ours must be 0, since this library cannot do what a nonzero field asks.
template <class T>
T read_sized(const T* p, size_t first_size, const char* name, const char* type) {
  const size_t n = checked_struct_size(deref(p, name).struct_size, first_size, name, type);
  T v;
  std::memset(&v, 0, sizeof v);
  std::memcpy(&v, p, std::min(n, sizeof(T)));
  const auto* bytes = reinterpret_cast<const unsigned char*>(p);
  for (size_t i = sizeof(T); i < n; ++i) {
    if (bytes[i] != 0) {
      ga::invalid(std::string(name) + ".struct_size is " + std::to_string(n) + " and byte " + std::to_string(i) +
                  " is set: a field of a newer gpt2attn.h than this library (" + GPT2ATTN_STR(GPT2ATTN_VERSION_MAJOR) +
                  "." + GPT2ATTN_STR(GPT2ATTN_VERSION_MINOR) + "." + GPT2ATTN_STR(GPT2ATTN_VERSION_PATCH) +
                  ", sizeof(" + type + "_t) = " + std::to_string(sizeof(T)) + ") knows");
    }
  }
  return v;
}

// A struct the library fills: written up to the caller's struct_size, which it keeps; bytes past ours are zeroed
// (fields this library does not know read as their default). Checked before anything is written.
template <class T>
void write_sized(T* p, T v, size_t first_size, const char* name, const char* type) {
  const size_t n = checked_struct_size(deref(p, name).struct_size, first_size, name, type);
  v.struct_size = p->struct_size;
  std::memcpy(p, &v, std::min(n, sizeof(T)));
  if (n > sizeof(T)) std::memset(reinterpret_cast<unsigned char*>(p) + sizeof(T), 0, n - sizeof(T));
}

ga::Config to_cpp(const gpt2attn_config_t* config) {
  const gpt2attn_config_t c = read_sized(config, kConfigFirstSize, "config", "gpt2attn_config");
  ga::Config cfg;
  cfg.d_model = c.d_model;
  cfg.num_heads = c.num_heads;
  cfg.num_kv_heads = c.num_kv_heads;
  cfg.d_in = c.d_in;
  cfg.context_length = c.context_length;
  cfg.qkv_bias = c.qkv_bias != 0;
  cfg.out_bias = c.out_bias != 0;
  cfg.causal = true;
  return cfg;
}

gpt2attn_config_t to_c(const ga::Config& cfg) {
  gpt2attn_config_t c{};  // struct_size: write_sized keeps the caller's
  c.d_model = cfg.d_model;
  c.num_heads = cfg.num_heads;
  c.num_kv_heads = cfg.kv_heads();
  c.d_in = cfg.query_width();
  c.context_length = cfg.context_length;
  c.qkv_bias = cfg.qkv_bias ? 1 : 0;
  c.out_bias = cfg.out_bias ? 1 : 0;
  return c;
}

// NULL: the defaults. The layer checks the thread count against max_threads(), naming the field.
ga::EngineOptions to_cpp(const gpt2attn_engine_options_t* options) {
  ga::EngineOptions o;
  if (!options) return o;
  const gpt2attn_engine_options_t c = read_sized(options, kEngineOptionsFirstSize, "options", "gpt2attn_engine_options");
  o.threads = c.threads;
  if (c.isa) o.isa = ga::isa_from_string(c.isa);
  if (c.compute) o.compute = ga::dtype_from_string(c.compute);
  if (c.weights) o.weights = ga::weight_format_from_string(c.weights);
  return o;
}

// Builds the handle completely before publishing it, so *out is written only on success.
template <class W>  // Weights or WeightsView
void make_layer(const ga::Config& cfg, const W& w, const ga::EngineOptions& options, gpt2attn_layer_t** out) {
  auto* layer = new gpt2attn_layer{ga::CausalSelfAttention(cfg, w, options), {}, {}, {}, {}};
  try {
    layer->isa = ga::to_string(layer->attn.layer().isa());
    layer->implementation = layer->attn.layer().implementation();
  } catch (...) {
    delete layer;
    throw;
  }
  *out = layer;
}

// The constructors, each under the name of the public function that called it (the errors' prefix).
gpt2attn_status_t create_random(const char* fn, const gpt2attn_config_t* config, uint64_t seed,
                                const gpt2attn_engine_options_t* options, gpt2attn_layer_t** out) {
  return guarded(fn, [&] {
    const ga::Config cfg = to_cpp(config);
    const ga::EngineOptions o = to_cpp(options);
    require(out, "out");
    make_layer(cfg, ga::Weights::random(cfg, seed), o, out);
  });
}

gpt2attn_status_t create(const char* fn, const gpt2attn_config_t* config, const float* in_proj_weight,
                         const float* in_proj_bias, const float* out_proj_weight, const float* out_proj_bias,
                         const gpt2attn_engine_options_t* options, gpt2attn_layer_t** out) {
  return guarded(fn, [&] {
    const ga::Config cfg = to_cpp(config);
    const ga::EngineOptions o = to_cpp(options);
    require(in_proj_weight, "in_proj_weight");
    require(out_proj_weight, "out_proj_weight");
    require(out, "out");
    // The bias pointers must agree with the flags: a silently ignored bias would be a wrong model.
    if (cfg.qkv_bias != (in_proj_bias != nullptr)) {
      ga::invalid(cfg.qkv_bias ? "in_proj_bias is NULL but config.qkv_bias is set"
                               : "in_proj_bias given but config.qkv_bias is 0");
    }
    if (cfg.out_bias != (out_proj_bias != nullptr)) {
      ga::invalid(cfg.out_bias ? "out_proj_bias is NULL but config.out_bias is set"
                               : "out_proj_bias given but config.out_bias is 0");
    }
    cfg.validate();  // sizes below are computed from E, KW and d_in: check them first
    const size_t E = static_cast<size_t>(cfg.d_model), KW = static_cast<size_t>(cfg.kv_width()),
                 d_in = static_cast<size_t>(cfg.query_width());
    // in_proj_weight is torch's [W_q; W_k; W_v] stacked along rows (E, KW and KW of them), in_proj_bias likewise.
    ga::Weights w;
    w.w_q.assign(in_proj_weight, in_proj_weight + E * d_in);
    w.w_k.assign(in_proj_weight + E * d_in, in_proj_weight + (E + KW) * d_in);
    w.w_v.assign(in_proj_weight + (E + KW) * d_in, in_proj_weight + (E + 2 * KW) * d_in);
    if (in_proj_bias) {
      w.b_q.assign(in_proj_bias, in_proj_bias + E);
      w.b_k.assign(in_proj_bias + E, in_proj_bias + E + KW);
      w.b_v.assign(in_proj_bias + E + KW, in_proj_bias + E + 2 * KW);
    }
    w.w_o.assign(out_proj_weight, out_proj_weight + E * E);
    if (out_proj_bias) w.b_o.assign(out_proj_bias, out_proj_bias + E);
    make_layer(cfg, w, o, out);
  });
}

gpt2attn_status_t load_safetensors(const char* fn, const char* path, const char* prefix, int64_t num_heads,
                                   int64_t context_length, const gpt2attn_engine_options_t* options,
                                   gpt2attn_layer_t** out) {
  return guarded(fn, [&] {
    const ga::EngineOptions o = to_cpp(options);
    require(path, "path");
    require(out, "out");
    const ga::StoredLayer loaded = ga::open_safetensors_layer(path, prefix ? prefix : "");
    ga::Config cfg;
    cfg.num_heads = num_heads;
    cfg.context_length = context_length;
    cfg.causal = true;
    cfg = ga::apply_loaded_shapes(cfg, loaded);
    make_layer(cfg, loaded.weights, o, out);
  });
}

}  // namespace

extern "C" {

// ---- library ------------------------------------------------------------------------------------------------

const char* gpt2attn_last_error(void) {
  if (!g_messages.made) return kNoRoom;
  const void* p = pthread_getspecific(g_messages.key);
  return p != nullptr ? static_cast<const char*>(p) : "";
}

const char* gpt2attn_version(void) {
  return GPT2ATTN_STR(GPT2ATTN_VERSION_MAJOR) "." GPT2ATTN_STR(GPT2ATTN_VERSION_MINOR) "." GPT2ATTN_STR(
      GPT2ATTN_VERSION_PATCH);
}

const char* gpt2attn_status_string(gpt2attn_status_t status) {
  switch (status) {
    case GPT2ATTN_OK: return "ok";
    case GPT2ATTN_ERR_INVALID_ARGUMENT: return "invalid argument";
    case GPT2ATTN_ERR_BAD_FILE: return "bad file";
    case GPT2ATTN_ERR_OUT_OF_MEMORY: return "out of memory";
    case GPT2ATTN_ERR_INTERNAL: return "internal";
  }
  return "unknown";
}

const char* gpt2attn_best_isa(void) {
  try {
    return ga::to_string(ga::best_supported_isa());
  } catch (...) {
    return "scalar";  // the scalar kernels always exist
  }
}

gpt2attn_status_t gpt2attn_config_preset(const char* name, gpt2attn_config_t* out) {
  return guarded(__func__, [&] {
    require(name, "name");
    write_sized(out, to_c(ga::preset(name)), kConfigFirstSize, "out", "gpt2attn_config");
  });
}

// ---- layer --------------------------------------------------------------------------------------------------

gpt2attn_status_t gpt2attn_layer_create_random(const gpt2attn_config_t* config, uint64_t seed,
                                               gpt2attn_layer_t** out) {
  return create_random(__func__, config, seed, nullptr, out);
}

gpt2attn_status_t gpt2attn_layer_create_random_with(const gpt2attn_config_t* config, uint64_t seed,
                                                    const gpt2attn_engine_options_t* options, gpt2attn_layer_t** out) {
  return create_random(__func__, config, seed, options, out);
}

gpt2attn_status_t gpt2attn_layer_create(const gpt2attn_config_t* config, const float* in_proj_weight,
                                        const float* in_proj_bias, const float* out_proj_weight,
                                        const float* out_proj_bias, gpt2attn_layer_t** out) {
  return create(__func__, config, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, nullptr, out);
}

gpt2attn_status_t gpt2attn_layer_create_with(const gpt2attn_config_t* config, const float* in_proj_weight,
                                             const float* in_proj_bias, const float* out_proj_weight,
                                             const float* out_proj_bias, const gpt2attn_engine_options_t* options,
                                             gpt2attn_layer_t** out) {
  return create(__func__, config, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, options, out);
}

gpt2attn_status_t gpt2attn_layer_load_safetensors(const char* path, const char* prefix, int64_t num_heads,
                                                  int64_t context_length, gpt2attn_layer_t** out) {
  return load_safetensors(__func__, path, prefix, num_heads, context_length, nullptr, out);
}

gpt2attn_status_t gpt2attn_layer_load_safetensors_with(const char* path, const char* prefix, int64_t num_heads,
                                                       int64_t context_length,
                                                       const gpt2attn_engine_options_t* options,
                                                       gpt2attn_layer_t** out) {
  return load_safetensors(__func__, path, prefix, num_heads, context_length, options, out);
}

void gpt2attn_layer_destroy(gpt2attn_layer_t* layer) { delete layer; }

gpt2attn_status_t gpt2attn_layer_config(const gpt2attn_layer_t* layer, gpt2attn_config_t* out) {
  return guarded(__func__, [&] {
    const auto& l = deref(layer, "layer");
    write_sized(out, to_c(l.attn.config()), kConfigFirstSize, "out", "gpt2attn_config");
  });
}

gpt2attn_status_t gpt2attn_layer_describe(const gpt2attn_layer_t* layer, const char** isa,
                                          const char** implementation) {
  return guarded(__func__, [&] {
    const auto& l = deref(layer, "layer");
    if (isa) *isa = l.isa.c_str();
    if (implementation) *implementation = l.implementation.c_str();
  });
}

// ---- KV cache and sequences ---------------------------------------------------------------------------------

gpt2attn_status_t gpt2attn_kv_cache_create(const gpt2attn_layer_t* layer, int64_t block_tokens,
                                           int64_t capacity_tokens, gpt2attn_kv_cache_t** out) {
  return guarded(__func__, [&] {
    const auto& l = deref(layer, "layer");
    require(out, "out");
    if (capacity_tokens <= 0) ga::invalid("capacity_tokens must be > 0, got " + std::to_string(capacity_tokens));
    ga::KvCacheOptions o;
    o.block_tokens = block_tokens;  // 0 = the library's default, min(64, context_length)
    o.capacity_tokens = capacity_tokens;
    *out = new gpt2attn_kv_cache{ga::KvCache(l.attn.config(), o)};
  });
}

gpt2attn_status_t gpt2attn_kv_cache_create_with(const gpt2attn_layer_t* layer,
                                                const gpt2attn_kv_cache_options_t* options, gpt2attn_kv_cache_t** out) {
  return guarded(__func__, [&] {
    const auto& l = deref(layer, "layer");
    const gpt2attn_kv_cache_options_t opt =
        read_sized(options, kKvCacheOptionsFirstSize, "options", "gpt2attn_kv_cache_options");
    require(out, "out");
    if (opt.capacity_tokens < 0) {
      ga::invalid("options.capacity_tokens must be >= 0, got " + std::to_string(opt.capacity_tokens));
    }
    ga::KvCacheOptions o;
    o.block_tokens = opt.block_tokens;
    o.capacity_tokens = opt.capacity_tokens;
    o.capacity_bytes = static_cast<size_t>(opt.capacity_bytes);
    o.dtype = opt.kv_dtype ? ga::dtype_from_string(opt.kv_dtype) : ga::DType::f32;
    *out = new gpt2attn_kv_cache{ga::KvCache(l.attn.config(), o)};  // the cache checks the rest, naming the field
  });
}

void gpt2attn_kv_cache_destroy(gpt2attn_kv_cache_t* cache) { delete cache; }

gpt2attn_status_t gpt2attn_kv_cache_bytes(const gpt2attn_kv_cache_t* cache, uint64_t* block_bytes,
                                          uint64_t* capacity_bytes, const char** kv_dtype) {
  return guarded(__func__, [&] {
    const ga::KvCache& c = deref(cache, "cache").cache;
    if (block_bytes) *block_bytes = c.block_bytes();
    if (capacity_bytes) *capacity_bytes = c.capacity_bytes();
    if (kv_dtype) *kv_dtype = ga::to_string(c.dtype());
  });
}

gpt2attn_status_t gpt2attn_kv_cache_stats(const gpt2attn_kv_cache_t* cache, int64_t* block_tokens,
                                          int64_t* total_blocks, int64_t* free_blocks, int64_t* num_sequences) {
  return guarded(__func__, [&] {
    const ga::KvCache& c = deref(cache, "cache").cache;
    // Read everything first so a failure leaves every output untouched.
    const int64_t bt = c.block_tokens(), total = c.total_blocks(), free = c.free_blocks(), n = c.num_sequences();
    if (block_tokens) *block_tokens = bt;
    if (total_blocks) *total_blocks = total;
    if (free_blocks) *free_blocks = free;
    if (num_sequences) *num_sequences = n;
  });
}

gpt2attn_status_t gpt2attn_seq_create(gpt2attn_kv_cache_t* cache, gpt2attn_seq_t* out) {
  return guarded(__func__, [&] {
    auto& c = deref(cache, "cache");
    require(out, "out");
    *out = c.cache.create();
  });
}

gpt2attn_status_t gpt2attn_seq_fork(gpt2attn_kv_cache_t* cache, gpt2attn_seq_t parent, gpt2attn_seq_t* out) {
  return guarded(__func__, [&] {
    auto& c = deref(cache, "cache");
    require(out, "out");
    *out = c.cache.fork(parent);
  });
}

gpt2attn_status_t gpt2attn_seq_fork_prefix(gpt2attn_kv_cache_t* cache, gpt2attn_seq_t parent, int64_t prefix_tokens,
                                           gpt2attn_seq_t* out) {
  return guarded(__func__, [&] {
    auto& c = deref(cache, "cache");
    require(out, "out");
    *out = c.cache.fork(parent, prefix_tokens);
  });
}

gpt2attn_status_t gpt2attn_seq_truncate(gpt2attn_kv_cache_t* cache, gpt2attn_seq_t seq, int64_t new_length) {
  return guarded(__func__, [&] { deref(cache, "cache").cache.truncate(seq, new_length); });
}

gpt2attn_status_t gpt2attn_seq_release(gpt2attn_kv_cache_t* cache, gpt2attn_seq_t seq) {
  return guarded(__func__, [&] { deref(cache, "cache").cache.release(seq); });
}

gpt2attn_status_t gpt2attn_seq_length(const gpt2attn_kv_cache_t* cache, gpt2attn_seq_t seq, int64_t* out) {
  return guarded(__func__, [&] {
    const auto& c = deref(cache, "cache");
    require(out, "out");
    *out = c.cache.length(seq);
  });
}

gpt2attn_status_t gpt2attn_seq_blocks_needed(const gpt2attn_kv_cache_t* cache, gpt2attn_seq_t seq,
                                             int64_t tokens, int64_t* out) {
  return guarded(__func__, [&] {
    const auto& c = deref(cache, "cache");
    require(out, "out");
    *out = c.cache.blocks_needed(seq, tokens);
  });
}

// ---- workspace ----------------------------------------------------------------------------------------------

gpt2attn_status_t gpt2attn_workspace_create(gpt2attn_workspace_t** out) {
  return guarded(__func__, [&] {
    require(out, "out");
    *out = new gpt2attn_workspace{};
  });
}

void gpt2attn_workspace_destroy(gpt2attn_workspace_t* ws) { delete ws; }

gpt2attn_status_t gpt2attn_workspace_bytes(const gpt2attn_workspace_t* ws, size_t* out) {
  return guarded(__func__, [&] {
    const auto& w = deref(ws, "ws");
    require(out, "out");
    *out = w.ws.bytes();
  });
}

// ---- compute ------------------------------------------------------------------------------------------------

gpt2attn_status_t gpt2attn_layer_extend(gpt2attn_layer_t* layer, gpt2attn_kv_cache_t* cache, gpt2attn_seq_t seq,
                                        const float* x, int64_t T, float* out, int threads,
                                        gpt2attn_workspace_t* ws) {
  return guarded(__func__, [&] {
    auto& l = deref(layer, "layer");
    auto& c = deref(cache, "cache");
    require(x, "x");
    require(out, "out");
    l.attn.extend(c.cache, seq, x, T, out, run_options(threads), ws ? &ws->ws : nullptr);
  });
}

gpt2attn_status_t gpt2attn_layer_decode(gpt2attn_layer_t* layer, gpt2attn_kv_cache_t* cache,
                                        const gpt2attn_seq_t* seqs, int64_t B, const float* x, float* out,
                                        int threads, gpt2attn_workspace_t* ws) {
  return guarded(__func__, [&] {
    auto& l = deref(layer, "layer");
    auto& c = deref(cache, "cache");
    require(seqs, "seqs");
    require(x, "x");
    require(out, "out");
    l.attn.decode(c.cache, seqs, B, x, out, run_options(threads), ws ? &ws->ws : nullptr);
  });
}

gpt2attn_status_t gpt2attn_layer_step(gpt2attn_layer_t* layer, gpt2attn_kv_cache_t* cache,
                                      const gpt2attn_step_entry_t* entries, int64_t n, const float* x, float* out,
                                      int threads, gpt2attn_workspace_t* ws) {
  return guarded(__func__, [&] {
    auto& l = deref(layer, "layer");
    auto& c = deref(cache, "cache");
    require(entries, "entries");
    require(x, "x");
    require(out, "out");
    const ga::RunOptions run = run_options(threads);
    // n sizes the copy of the entries, so it is checked here, before the library sees it: at least one entry, and
    // no more than there are sequences (the entries are distinct), which bounds the copy by what the cache holds.
    if (n < 1) ga::invalid("n (entries) must be >= 1, got " + std::to_string(n));
    const int64_t sequences = c.cache.num_sequences();
    if (n > sequences) {
      ga::invalid("n is " + std::to_string(n) + " entries but the cache holds " + std::to_string(sequences) +
                  " sequences (a step's entries are distinct sequences)");
    }
    if (ws) {
      ws->step_entries.assign(entries, n);
      l.attn.step(c.cache, ws->step_entries.seqs.data(), ws->step_entries.tokens.data(), n, x, out, run, &ws->ws);
      return;
    }
    const std::lock_guard<std::mutex> lock(l.step_mutex);  // NULL-workspace calls are serialised on the layer anyway
    l.step_entries.assign(entries, n);
    l.attn.step(c.cache, l.step_entries.seqs.data(), l.step_entries.tokens.data(), n, x, out, run, nullptr);
  });
}

gpt2attn_status_t gpt2attn_layer_forward(gpt2attn_layer_t* layer, const float* x, int64_t B, int64_t T, float* out,
                                         int threads, gpt2attn_workspace_t* ws) {
  return guarded(__func__, [&] {
    auto& l = deref(layer, "layer");
    require(x, "x");
    require(out, "out");
    l.attn.forward(x, B, T, out, run_options(threads), ws ? &ws->ws : nullptr);
  });
}

gpt2attn_status_t gpt2attn_layer_forward_typed(gpt2attn_layer_t* layer, const void* x, const char* x_dtype, int64_t B,
                                               int64_t T, void* out, const char* out_dtype, int threads,
                                               gpt2attn_workspace_t* ws) {
  return guarded(__func__, [&] {
    auto& l = deref(layer, "layer");
    require(x, "x");
    require(out, "out");
    // The C header's two activation types, by name; anything else is named in the error.
    auto activation = [](const char* name, const char* what) {
      const std::string s = name ? name : "f32";
      if (s != "f32" && s != "bf16") ga::invalid(std::string(what) + " '" + s + "' (supported: f32, bf16)");
      return ga::dtype_from_string(s);
    };
    ga::AttentionInputs in;
    in.query = ga::TensorView::contiguous(x, activation(x_dtype, "x_dtype"), {B, T, l.attn.config().query_width()});
    l.attn.layer().forward(in, out, activation(out_dtype, "out_dtype"), run_options(threads), ws ? &ws->ws : nullptr);
  });
}

gpt2attn_status_t gpt2attn_layer_reserve(gpt2attn_layer_t* layer, int64_t max_extend_tokens,
                                         int64_t max_decode_batch, int threads, gpt2attn_workspace_t* ws) {
  return guarded(__func__, [&] {
    auto& l = deref(layer, "layer");
    run_options(threads);  // the same threads check as the compute calls
    l.attn.reserve_serving(max_extend_tokens, max_decode_batch, threads, ws ? &ws->ws : nullptr);
  });
}

gpt2attn_status_t gpt2attn_layer_reserve_bytes(const gpt2attn_layer_t* layer, int64_t max_extend_tokens,
                                               int64_t max_decode_batch, int threads, size_t* out) {
  return guarded(__func__, [&] {
    const auto& l = deref(layer, "layer");
    require(out, "out");
    run_options(threads);
    *out = l.attn.serving_workspace_bytes(max_extend_tokens, max_decode_batch, threads);
  });
}

gpt2attn_status_t gpt2attn_layer_reserve_step(gpt2attn_layer_t* layer, int64_t max_tokens, int64_t max_entries,
                                              int threads, gpt2attn_workspace_t* ws) {
  return guarded(__func__, [&] {
    auto& l = deref(layer, "layer");
    run_options(threads);  // the same threads check as the compute calls
    l.attn.reserve_step(max_tokens, max_entries, threads, ws ? &ws->ws : nullptr);  // checks the sizes
    // And the copy of the entries that gpt2attn_layer_step makes on this workspace (or the layer's).
    if (ws) {
      ws->step_entries.reserve(max_entries);
    } else {
      const std::lock_guard<std::mutex> lock(l.step_mutex);
      l.step_entries.reserve(max_entries);
    }
  });
}

gpt2attn_status_t gpt2attn_layer_reserve_step_bytes(const gpt2attn_layer_t* layer, int64_t max_tokens,
                                                    int64_t max_entries, int threads, size_t* out) {
  return guarded(__func__, [&] {
    const auto& l = deref(layer, "layer");
    require(out, "out");
    run_options(threads);
    *out = l.attn.step_workspace_bytes(max_tokens, max_entries, threads);
  });
}

}  // extern "C"
