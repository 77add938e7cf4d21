// model/c_api.cpp: the model library's C API (include/gpt2attn/gpt2attn_model.h) over GPT2: null checks, the
// struct_size rule, status codes and this library's per-thread last-error message. It computes nothing itself, lets
// no exception out, and uses only the public API (engine/c_api.cpp's helpers are the attention library's internals,
// so the few it needs are written again here).
#include "gpt2attn/gpt2attn_model.h"

#include <pthread.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "gpt2attn/error.hpp"
#include "gpt2attn/gpt2.hpp"
#include "gpt2attn/isa.hpp"

namespace ga = gpt2attn;

struct gpt2attn_model {
  ga::GPT2 model;
};

static_assert(GPT2ATTN_ERR_INVALID_ARGUMENT == static_cast<int>(ga::ErrorCode::invalid_argument) &&
              GPT2ATTN_ERR_BAD_FILE == static_cast<int>(ga::ErrorCode::bad_file) &&
              GPT2ATTN_ERR_OUT_OF_MEMORY == static_cast<int>(ga::ErrorCode::out_of_memory) &&
              GPT2ATTN_ERR_INTERNAL == static_cast<int>(ga::ErrorCode::internal));

namespace {

// The last-error message, as engine/c_api.cpp keeps gpt2attn_last_error()'s and for its reasons: a fixed buffer per
// thread behind a pthread key (not a thread_local, which glibc allocates on first use in a dlopen'ed library and
// answers with an abort when it cannot), made on the thread's first failure, so that recording an out-of-memory
// error needs no memory once it exists; a message too long keeps its start and its end (where the reason is).
constexpr size_t kMessageBytes = 8192;
constexpr char kNoRoom[] = "gpt2attn_model: out of memory (no room left to keep this call's error message)";

void free_message(void* p) {
  if (p != kNoRoom) delete[] static_cast<char*>(p);
}

struct MessageKey {
  pthread_key_t key{};
  bool made = false;
  MessageKey() { made = pthread_key_create(&key, free_message) == 0; }
  ~MessageKey() {
    if (made) pthread_key_delete(key);
  }
};
const MessageKey g_messages;

char* message_buffer() noexcept {
  if (!g_messages.made) return nullptr;
  void* p = pthread_getspecific(g_messages.key);
  if (p != nullptr && p != kNoRoom) return static_cast<char*>(p);
  char* buf = new (std::nothrow) char[kMessageBytes];
  if (buf == nullptr) {
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
    const size_t tail = std::min(kTail, what_len);
    std::memcpy(msg + head + kGap, what + what_len - tail, tail);
    msg[head + kGap + tail] = '\0';
  }
  return status;
}

// Runs body and turns whatever it throws into a status and a message prefixed with the C function's name.
template <class Body>
gpt2attn_status_t guarded(const char* fn, Body&& body) noexcept {
  try {
    body();
    return GPT2ATTN_OK;
  } catch (const ga::Error& e) {
    const int code = static_cast<int>(e.code());
    const auto status = code >= 1 && code <= 4 ? static_cast<gpt2attn_status_t>(code) : GPT2ATTN_ERR_INTERNAL;
    return record(status, fn, e.what());
  } catch (const std::bad_alloc&) {
    return record(GPT2ATTN_ERR_OUT_OF_MEMORY, fn, "out of memory");
  } catch (const std::exception& e) {
    return record(GPT2ATTN_ERR_INTERNAL, fn, e.what());
  } catch (...) {
    return record(GPT2ATTN_ERR_INTERNAL, fn, "unknown exception");
  }
}

template <class T>
T& deref(T* p, const char* name) {
  if (p == nullptr) ga::invalid(std::string(name) + " is NULL");
  return *p;
}
void require(const void* p, const char* name) {
  if (p == nullptr) ga::invalid(std::string(name) + " is NULL");
}

// ---- struct_size: gpt2attn.h's rule for structs that grow -------------------------------------------------------
// The size of each struct's first version: the smallest struct_size accepted.
constexpr size_t kModelOptionsFirstSize = offsetof(gpt2attn_model_options_t, weights) + sizeof(const char*);
constexpr size_t kModelConfigFirstSize = offsetof(gpt2attn_gpt2_config_t, layer_norm_epsilon) + sizeof(double);
constexpr size_t kGenerateOptionsFirstSize = offsetof(gpt2attn_generate_options_t, kv_dtype) + sizeof(const char*);
constexpr size_t kMaxStructSize = 4096;

size_t checked_struct_size(uint32_t struct_size, size_t first_size, const char* name, const char* type) {
  if (struct_size < first_size || struct_size > kMaxStructSize) {
    ga::invalid(std::string(name) + ".struct_size is " + std::to_string(struct_size) + ": set it to sizeof(" + type +
                "_t), as " + type + "_init() does");
  }
  return struct_size;
}

// A struct passed in, read by its struct_size: fields past the caller's size are 0; bytes a newer header added past
// ours must be 0, since this library cannot do what they ask.
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
                  " is set: a field of a newer gpt2attn_model.h than this library (sizeof(" + type + "_t) = " +
                  std::to_string(sizeof(T)) + ") knows");
    }
  }
  return v;
}

// A struct the library fills: written up to the caller's struct_size, which it keeps; bytes past ours are zeroed.
template <class T>
void write_sized(T* p, T v, size_t first_size, const char* name, const char* type) {
  const size_t n = checked_struct_size(deref(p, name).struct_size, first_size, name, type);
  v.struct_size = p->struct_size;
  std::memcpy(p, &v, std::min(n, sizeof(T)));
  if (n > sizeof(T)) std::memset(reinterpret_cast<unsigned char*>(p) + sizeof(T), 0, n - sizeof(T));
}

// NULL: the defaults. The model's layers check the thread count, naming it.
ga::EngineOptions to_cpp(const gpt2attn_model_options_t* options) {
  ga::EngineOptions o;
  if (!options) return o;
  const gpt2attn_model_options_t c = read_sized(options, kModelOptionsFirstSize, "options", "gpt2attn_model_options");
  o.threads = c.threads;
  if (c.isa) o.isa = ga::isa_from_string(c.isa);
  if (c.dtype) {
    const std::string d = c.dtype;
    if (d != "f32" && d != "bf16") ga::invalid("options.dtype '" + d + "' (supported: f32, bf16)");
    o.compute = ga::dtype_from_string(d);
  }
  if (c.weights) {
    const std::string w = c.weights;
    if (w != "compute" && w != "int8" && w != "int4") {
      ga::invalid("options.weights '" + w + "' (supported: compute, int8, int4)");
    }
    o.weights = ga::weight_format_from_string(w);
  }
  return o;
}

// NULL: greedy, 16 new ids. Zero fields are the defaults gpt2attn_model.h names.
ga::GenerateOptions to_cpp(const gpt2attn_generate_options_t* options) {
  ga::GenerateOptions o;
  if (!options) return o;
  const gpt2attn_generate_options_t g =
      read_sized(options, kGenerateOptionsFirstSize, "options", "gpt2attn_generate_options");
  if (g.max_new_tokens != 0) o.max_new_tokens = g.max_new_tokens;
  o.sampling.temperature = g.temperature;
  o.sampling.top_k = g.top_k;
  o.sampling.top_p = g.top_p == 0.0f ? 1.0f : g.top_p;
  o.sampling.seed = g.seed;
  if (g.n_stop < 0) ga::invalid("options.n_stop is " + std::to_string(g.n_stop) + " (at least 0)");
  if (g.n_stop > 0) {
    require(g.stop_ids, "options.stop_ids");
    o.stop_tokens.assign(g.stop_ids, g.stop_ids + g.n_stop);
  }
  if (g.max_step_tokens != 0) o.max_step_tokens = g.max_step_tokens;
  if (g.kv_dtype) o.kv_dtype = ga::dtype_from_string(g.kv_dtype);
  o.run.threads = g.threads;
  return o;
}

}  // namespace

extern "C" {

const char* gpt2attn_model_last_error(void) {
  if (!g_messages.made) return kNoRoom;
  const void* p = pthread_getspecific(g_messages.key);
  return p != nullptr ? static_cast<const char*>(p) : "";
}

gpt2attn_status_t gpt2attn_model_open(const char* dir, const gpt2attn_model_options_t* options,
                                      gpt2attn_model_t** out) {
  return guarded(__func__, [&] {
    require(dir, "dir");
    const ga::EngineOptions o = to_cpp(options);
    require(out, "out");
    *out = new gpt2attn_model{ga::GPT2::from_pretrained(dir, o)};
  });
}

void gpt2attn_model_free(gpt2attn_model_t* model) { delete model; }

gpt2attn_status_t gpt2attn_model_config(const gpt2attn_model_t* model, gpt2attn_gpt2_config_t* out) {
  return guarded(__func__, [&] {
    const ga::GPT2Config& c = deref(model, "model").model.config();
    gpt2attn_gpt2_config_t v{};  // struct_size: write_sized keeps the caller's
    v.vocab_size = c.vocab_size;
    v.n_positions = c.n_positions;
    v.n_embd = c.n_embd;
    v.n_layer = c.n_layer;
    v.n_head = c.n_head;
    v.n_inner = c.inner();
    v.layer_norm_epsilon = c.layer_norm_epsilon;
    write_sized(out, v, kModelConfigFirstSize, "out", "gpt2attn_gpt2_config");
  });
}

gpt2attn_status_t gpt2attn_model_logits(gpt2attn_model_t* model, const int32_t* ids, int64_t T, float* out) {
  return guarded(__func__, [&] {
    auto& m = deref(model, "model");
    require(ids, "ids");
    require(out, "out");
    m.model.logits(ids, T, out);  // checks T and every id before it writes out
  });
}

gpt2attn_status_t gpt2attn_model_generate(gpt2attn_model_t* model, const int32_t* prompt, int64_t n,
                                          const gpt2attn_generate_options_t* options, int32_t* out_ids,
                                          int64_t capacity, int64_t* n_out, int* finish_reason) {
  return guarded(__func__, [&] {
    auto& m = deref(model, "model");
    require(prompt, "prompt");
    require(out_ids, "out_ids");
    require(n_out, "n_out");
    const ga::GenerateOptions o = to_cpp(options);
    const int64_t P = m.model.config().n_positions;
    // n sizes the prompt's copy, so it is checked here (as the library would), before the copy is made.
    if (n < 1 || n >= P) {
      ga::invalid("n is " + std::to_string(n) + " prompt ids; expected 1 to n_positions - 1 = " +
                  std::to_string(P - 1));
    }
    // Generation ends at max_new_tokens or at n_positions ids in all, so this many ids at most come back.
    const int64_t most = std::min(o.max_new_tokens, P - n);
    if (o.max_new_tokens >= 1 && capacity < most) {
      ga::invalid("capacity is " + std::to_string(capacity) + " ids; this call can return " + std::to_string(most) +
                  " (min(max_new_tokens, n_positions - n))");
    }
    const std::vector<ga::Generation> g = m.model.generate({std::vector<int32_t>(prompt, prompt + n)}, o);
    const std::vector<int32_t>& ids = g.front().new_ids;
    std::copy(ids.begin(), ids.end(), out_ids);
    *n_out = static_cast<int64_t>(ids.size());
    if (finish_reason) {
      *finish_reason = g.front().finish_reason == "stop" ? GPT2ATTN_FINISH_STOP : GPT2ATTN_FINISH_LENGTH;
    }
  });
}

}  // extern "C"
