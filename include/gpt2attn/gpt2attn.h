/* gpt2attn/gpt2attn.h: the C API (C99 and later, and C++): opaque handles over CausalSelfAttention, KvCache and
 * Workspace for serving GPT-2-style causal self-attention from C or through an FFI. Inference only.
 *
 * Status contract: every function that can fail returns gpt2attn_status_t, and gpt2attn_last_error() then holds
 * a one-line message naming the function and the argument, sequence, field or file. A failed call wrote nothing
 * (outputs, the cache, *out are as they were; GPT2ATTN_ERR_INTERNAL alone promises nothing about outputs). No C++
 * exception crosses this boundary and gpt2attn's code never exits or aborts. Two libraries under it can: the
 * OpenMP runtime (libgomp), which oneDNN uses to reorder a new layer's weights, exits the process when it cannot
 * create a team's threads (a thread or pid limit, no address space left), and oneDNN's code generator may crash
 * when no memory is left for a new kernel; a server whose first call at each thread count and shape happens at
 * start-up (reserve, reserve_serving) meets the second there. A call's own threads that cannot be started are
 * GPT2ATTN_ERR_OUT_OF_MEMORY.
 * A null handle or pointer is GPT2ATTN_ERR_INVALID_ARGUMENT, never a crash.
 *
 * Shapes use one vocabulary: B batch (sequences in a decode step), T tokens, E model width (d_model),
 * H heads, D = E / H head size, d_in input width (E unless the weights say otherwise). Every array is
 * row-major, contiguous, float32, owned by the caller.
 *
 * Threads: each compute call takes `threads` (0 = the layer's default, omp_get_max_threads() when the
 * layer was created). The kernel instruction set is chosen once per layer; GPT2ATTN_ISA=scalar|avx2|avx512|
 * avx512_bf16 in the environment forces a weaker one.
 *
 * Concurrency: handles may be shared between threads. Calls that pass their own workspace run in parallel
 * on one layer and one cache, provided each workspace and each sequence is used by one call at a time;
 * calls with a NULL workspace on one layer are serialised.
 *
 * ABI policy: what a program compiled against this header can rely on.
 * - The C API is the stable interface. It lives in libgpt2attn.so.N, N = GPT2ATTN_ABI_VERSION, and every release
 *   that ships that file name keeps it: a program built against this header runs unchanged against any later
 *   such release. Anything that would break that raises N, so an old program never loads an incompatible library.
 * - Within one N, functions are never removed and their signatures and documented meaning never change. Releases
 *   add functions (a program using one needs that release or later: gpt2attn_version() says which is loaded) and
 *   may add status codes: treat any nonzero status as a failure and report gpt2attn_last_error().
 * - Handles are opaque: their size and contents are not part of the ABI.
 * - Structs grow only at their end, and each leads with struct_size, which the caller sets to sizeof the struct
 *   as its own header declares it (gpt2attn_config_init() and gpt2attn_kv_cache_options_init() do). A struct
 *   passed in is read by its struct_size: fields an older caller's header did not have read as 0, and 0 always
 *   means what the release before the field did; fields of a newer header that this library does not know must
 *   be 0, or the call fails with GPT2ATTN_ERR_INVALID_ARGUMENT naming struct_size (the caller asked for something
 *   this library cannot do). A struct the library fills (gpt2attn_config_preset, gpt2attn_layer_config) is
 *   written up to the caller's struct_size: fields the library does not know are set to 0. A struct_size below
 *   the struct's first version, or above 4096, is refused. Fields are appended in groups of 8 bytes, so no
 *   version ends in padding that an older library would have to read as a field.
 * - gpt2attn_step_entry_t, an element of an array, is the exception: it has no struct_size and never changes (a new
 *   field would change the array's stride); what a step needs later comes as a new function.
 * - The C++ API (the gpt2attn/<name>.hpp headers) is exported by the same library but is source-compatible only:
 *   its classes and option structs grow between releases, so C++ code is rebuilt for each release. Its symbols
 *   carry the release's version (GPT2ATTN_CXX_MAJOR.MINOR.PATCH), so a C++ program run against another release
 *   stops at load time with an error naming that version instead of misbehaving.
 * The library exports nothing but these two APIs (checked by tests/c/check_exports.cmake). */
#ifndef GPT2ATTN_GPT2ATTN_H
#define GPT2ATTN_GPT2ATTN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "gpt2attn/export.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The release this header comes with; kept equal to project(VERSION) in CMakeLists.txt (checked at configure
 * time). gpt2attn_version() gives the loaded library's. */
#define GPT2ATTN_VERSION_MAJOR 0
#define GPT2ATTN_VERSION_MINOR 1
#define GPT2ATTN_VERSION_PATCH 0
/* N in libgpt2attn.so.N (the SONAME): raised only when the C ABI breaks (see the policy above). */
#define GPT2ATTN_ABI_VERSION 1

/* The same numbers as gpt2attn::ErrorCode; 0 is success. Later releases may add codes. */
typedef enum gpt2attn_status {
  GPT2ATTN_OK = 0,
  GPT2ATTN_ERR_INVALID_ARGUMENT = 1, /* a handle, pointer, id, shape or size the caller passed is wrong */
  GPT2ATTN_ERR_BAD_FILE = 2,         /* a weights file is missing, truncated, corrupt or inconsistent */
  GPT2ATTN_ERR_OUT_OF_MEMORY = 3,    /* an allocation failed or the KV pool has no free block now; nothing written
                                        (a sequence larger than the whole pool, or a size whose byte count
                                        overflows int64, is INVALID_ARGUMENT: it can never fit) */
  GPT2ATTN_ERR_INTERNAL = 4          /* a bug or an unexpected failure inside a dependency */
} gpt2attn_status_t;

typedef struct gpt2attn_layer gpt2attn_layer_t;         /* one causal self-attention layer (weights + kernels) */
typedef struct gpt2attn_kv_cache gpt2attn_kv_cache_t;   /* a paged K/V pool and the sequences living in it */
typedef struct gpt2attn_workspace gpt2attn_workspace_t; /* per-thread scratch memory for compute calls */
typedef int64_t gpt2attn_seq_t;                         /* a sequence id; never reused within one cache */

/* One entry of a continuous-batching step (gpt2attn_layer_step): `tokens` (>= 1) new tokens for sequence `seq`. An
 * array element, so fixed for the ABI's life: no struct_size (see the ABI policy). */
typedef struct gpt2attn_step_entry {
  gpt2attn_seq_t seq;
  int64_t tokens;
} gpt2attn_step_entry_t;

/* The layer's sizes. Always causal self-attention, inference only (no dropout). Set struct_size (see the ABI
 * policy): start from gpt2attn_config_init() or a zeroed struct with struct_size = sizeof(gpt2attn_config_t). */
typedef struct gpt2attn_config {
  uint32_t struct_size;
  int64_t d_model;        /* E */
  int64_t num_heads;      /* H; must divide E */
  int64_t d_in;           /* input width; 0 means E */
  int64_t context_length; /* longest sequence (cached + new tokens) accepted */
  int32_t qkv_bias;       /* nonzero: biases on the Q/K/V projections */
  int32_t out_bias;       /* nonzero: bias on the output projection */
  int64_t num_kv_heads;   /* H_kv: K/V heads shared by groups of query heads; must divide H; 0 means H */
} gpt2attn_config_t;

/* Pool options. Exactly one of capacity_tokens (rounded up to whole blocks) and capacity_bytes (rounded down) is
 * nonzero. kv_dtype: "f32" (NULL means f32), "bf16" (half the bytes, each K/V value rounded to nearest even once),
 * "i8" (also "int8": symmetric int8 with one f32 scale per token, K/V head and K or V: a quarter of the bytes plus
 * the scales) or "fp8" (e4m3 rounded to nearest even after a power-of-two scale per row: the same bytes); each
 * value is converted once, when appended; attention still computes in f32. Set struct_size as for
 * gpt2attn_config_t (gpt2attn_kv_cache_options_init()). */
typedef struct gpt2attn_kv_cache_options {
  uint32_t struct_size;
  int64_t block_tokens; /* 0: 64 or context_length */
  int64_t capacity_tokens;
  uint64_t capacity_bytes;
  const char* kv_dtype;
} gpt2attn_kv_cache_options_t;

/* How a layer computes (gpt2attn::EngineOptions); every field 0 or NULL is its default. Set struct_size as for
 * gpt2attn_config_t (gpt2attn_engine_options_init()). */
typedef struct gpt2attn_engine_options {
  uint32_t struct_size;
  int32_t threads;     /* threads of a call that passes 0; 0: every core OpenMP offers */
  const char* isa;     /* instruction-set cap: NULL or "best", "avx512_bf16", "avx512", "avx2", "scalar" */
  const char* compute; /* NULL or "f32"; "bf16": weights, projections and attention in bf16, sums in f32 */
  /* Appended after the first release (struct_size): the projection weights' format. NULL or "compute": the
   * compute type; "int8" (one scale per output row) or "int4" (one per row and 32 inputs), quantized when the layer
   * is built (gpt2attn/dtype.hpp, WeightFormat). */
  const char* weights;
} gpt2attn_engine_options_t;

/* The struct_size of a struct as this header declares it. */
#ifdef __cplusplus
#define GPT2ATTN_STRUCT_SIZE(type) static_cast<uint32_t>(sizeof(type))
#else
#define GPT2ATTN_STRUCT_SIZE(type) ((uint32_t)sizeof(type))
#endif

/* Every field 0 (its default) and struct_size set: fill in what you need. Inline, so struct_size is the size the
 * caller was compiled with, which is what the library must be told. */
static inline gpt2attn_config_t gpt2attn_config_init(void) {
  gpt2attn_config_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = GPT2ATTN_STRUCT_SIZE(gpt2attn_config_t);
  return c;
}
static inline gpt2attn_kv_cache_options_t gpt2attn_kv_cache_options_init(void) {
  gpt2attn_kv_cache_options_t o;
  memset(&o, 0, sizeof o);
  o.struct_size = GPT2ATTN_STRUCT_SIZE(gpt2attn_kv_cache_options_t);
  return o;
}
static inline gpt2attn_engine_options_t gpt2attn_engine_options_init(void) {
  gpt2attn_engine_options_t o;
  memset(&o, 0, sizeof o);
  o.struct_size = GPT2ATTN_STRUCT_SIZE(gpt2attn_engine_options_t);
  return o;
}

/* ---- library ---------------------------------------------------------------------------------------------- */

/* The message of this thread's last failed call ("" if none); valid until this thread's next failing call or its
 * exit. Where even that message finds no memory, a fixed one saying so. */
GPT2ATTN_API const char* gpt2attn_last_error(void);
/* "MAJOR.MINOR.PATCH" of the loaded library (GPT2ATTN_VERSION_* are the header's). */
GPT2ATTN_API const char* gpt2attn_version(void);
/* A static name for a status: "ok", "invalid argument", "bad file", "out of memory", "internal", "unknown". */
GPT2ATTN_API const char* gpt2attn_status_string(gpt2attn_status_t status);
/* The strongest kernel instruction set this CPU runs: "avx512_bf16", "avx512", "avx2" or "scalar" (static string). */
GPT2ATTN_API const char* gpt2attn_best_isa(void);
/* *out = a preset's sizes: "gpt2-small" (E=768, H=12), "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-*".
 * out->struct_size must be set. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_config_preset(const char* name, gpt2attn_config_t* out);

/* ---- layer ------------------------------------------------------------------------------------------------ */

/* A layer with random weights (uniform +-1/sqrt(fan_in), reproducible from seed) for `config`. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_create_random(const gpt2attn_config_t* config, uint64_t seed,
                                                            gpt2attn_layer_t** out);
/* From torch MHA arrays (copied): in_proj_weight (E + 2 KW, d_in), in_proj_bias (E + 2 KW) or NULL iff !qkv_bias,
   out_proj_*; KW = H_kv * D, which is E (3E rows in all) unless num_kv_heads groups the K/V heads. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_create(const gpt2attn_config_t* config, const float* in_proj_weight,
                                                     const float* in_proj_bias, const float* out_proj_weight,
                                                     const float* out_proj_bias, gpt2attn_layer_t** out);
/* From safetensors (torch or HF GPT-2 names after prefix, e.g. "h.3.attn."; NULL = ""); E, d_in and the K/V heads
   (grouped-query checkpoints) from the shapes. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_load_safetensors(const char* path, const char* prefix,
                                                               int64_t num_heads, int64_t context_length,
                                                               gpt2attn_layer_t** out);
/* The three above, computing as `options` says (NULL: the defaults, as the three do): bf16 compute, an
   instruction-set cap, a default thread count. gpt2attn_layer_describe names the instruction set it runs at. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_create_random_with(const gpt2attn_config_t* config, uint64_t seed,
                                                                 const gpt2attn_engine_options_t* options,
                                                                 gpt2attn_layer_t** out);
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_create_with(const gpt2attn_config_t* config,
                                                          const float* in_proj_weight, const float* in_proj_bias,
                                                          const float* out_proj_weight, const float* out_proj_bias,
                                                          const gpt2attn_engine_options_t* options,
                                                          gpt2attn_layer_t** out);
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_load_safetensors_with(const char* path, const char* prefix,
                                                                    int64_t num_heads, int64_t context_length,
                                                                    const gpt2attn_engine_options_t* options,
                                                                    gpt2attn_layer_t** out);
/* Frees the layer; NULL is a no-op. Caches and workspaces used with it stay valid. */
GPT2ATTN_API void gpt2attn_layer_destroy(gpt2attn_layer_t* layer);

/* *out = the layer's sizes (E, H, d_in, context_length, biases, H_kv); out->struct_size must be set. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_config(const gpt2attn_layer_t* layer, gpt2attn_config_t* out);
/* *isa ("avx512"...) and *implementation (kernels + GEMMs), each optional; strings live as long as the layer. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_describe(const gpt2attn_layer_t* layer, const char** isa,
                                                       const char** implementation);

/* ---- KV cache and sequences ------------------------------------------------------------------------------- */

/* A pool for this E and H, allocated now: capacity_tokens in blocks of block_tokens (0: 64 or context_length). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_kv_cache_create(const gpt2attn_layer_t* layer, int64_t block_tokens,
                                                        int64_t capacity_tokens, gpt2attn_kv_cache_t** out);
/* The same with options (a bf16 or i8 K/V store, a byte capacity): gpt2attn_kv_cache_options_t above. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_kv_cache_create_with(const gpt2attn_layer_t* layer,
                                                             const gpt2attn_kv_cache_options_t* options,
                                                             gpt2attn_kv_cache_t** out);
/* Frees the pool and every sequence in it; NULL is a no-op. */
GPT2ATTN_API void gpt2attn_kv_cache_destroy(gpt2attn_kv_cache_t* cache);
/* The pool's sizes in bytes and its K/V storage type ("f32", "bf16" or "i8", a static string); any out may be
 * NULL. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_kv_cache_bytes(const gpt2attn_kv_cache_t* cache, uint64_t* block_bytes,
                                                       uint64_t* capacity_bytes, const char** kv_dtype);
/* Pool state; any out pointer may be NULL. Room left: free_blocks * block_tokens tokens. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_kv_cache_stats(const gpt2attn_kv_cache_t* cache, int64_t* block_tokens,
                                                       int64_t* total_blocks, int64_t* free_blocks,
                                                       int64_t* num_sequences);

/* A new empty sequence (takes no block until tokens are appended). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_seq_create(gpt2attn_kv_cache_t* cache, gpt2attn_seq_t* out);
/* A new sequence sharing parent's cached tokens (blocks shared, copied on first write). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_seq_fork(gpt2attn_kv_cache_t* cache, gpt2attn_seq_t parent,
                                                 gpt2attn_seq_t* out);
/* A new sequence sharing parent's first prefix_tokens tokens (0..length: a shared system prompt); a partly used last
   block is copied on the child's first append into it. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_seq_fork_prefix(gpt2attn_kv_cache_t* cache, gpt2attn_seq_t parent,
                                                        int64_t prefix_tokens, gpt2attn_seq_t* out);
/* Drops seq's tokens past new_length (0..length: rejected draft tokens, a cancelled chunk); blocks no other sequence
   holds go back to the pool, and no other sequence's tokens change. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_seq_truncate(gpt2attn_kv_cache_t* cache, gpt2attn_seq_t seq,
                                                     int64_t new_length);
/* Returns the sequence's unshared blocks to the pool; the id becomes invalid. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_seq_release(gpt2attn_kv_cache_t* cache, gpt2attn_seq_t seq);
/* *out = cached tokens of seq. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_seq_length(const gpt2attn_kv_cache_t* cache, gpt2attn_seq_t seq,
                                                   int64_t* out);
/* *out = blocks appending `tokens` to seq would take from the pool now (for admission control);
   GPT2ATTN_ERR_INVALID_ARGUMENT when tokens < 0 or seq's length + tokens passes the cache's context_length. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_seq_blocks_needed(const gpt2attn_kv_cache_t* cache, gpt2attn_seq_t seq,
                                                          int64_t tokens, int64_t* out);

/* ---- workspace -------------------------------------------------------------------------------------------- */

/* Scratch memory for compute calls: one per concurrently calling thread; grows on demand. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_workspace_create(gpt2attn_workspace_t** out);
/* Frees it; NULL is a no-op. */
GPT2ATTN_API void gpt2attn_workspace_destroy(gpt2attn_workspace_t* ws);
/* *out = scratch bytes held now. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_workspace_bytes(const gpt2attn_workspace_t* ws, size_t* out);

/* ---- compute (ws may be NULL: the layer's own workspace, calls serialised) ---------------------------------- */

/* Prefill / chunked prefill: appends T tokens to seq, x (T, d_in) -> out (T, E); length + T <= context_length. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_extend(gpt2attn_layer_t* layer, gpt2attn_kv_cache_t* cache,
                                                     gpt2attn_seq_t seq, const float* x, int64_t T, float* out,
                                                     int threads, gpt2attn_workspace_t* ws);
/* One decode step for B distinct sequences: seqs (B), x (B, d_in) one new token each -> out (B, E). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_decode(gpt2attn_layer_t* layer, gpt2attn_kv_cache_t* cache,
                                                     const gpt2attn_seq_t* seqs, int64_t B, const float* x,
                                                     float* out, int threads, gpt2attn_workspace_t* ws);
/* One step of continuous batching over n entries (distinct sequences, any cached lengths): entry i appends
 * entries[i].tokens >= 1 new tokens to entries[i].seq (a chunk of a prompt, one next token or k draft tokens to
 * verify, in any mix). x (sum of tokens, d_in), the entries' tokens packed in entry order -> out (sum of tokens, E).
 * Each new token attends to its sequence's cached tokens and causally to its own entry's earlier new tokens, as
 * gpt2attn_layer_extend of that entry alone computes it; the projections run once over all the step's tokens, so the
 * weights stream once a step. Checks and errors as extend and decode: a refused step changes no sequence. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_step(gpt2attn_layer_t* layer, gpt2attn_kv_cache_t* cache,
                                                   const gpt2attn_step_entry_t* entries, int64_t n, const float* x,
                                                   float* out, int threads, gpt2attn_workspace_t* ws);
/* Causal self-attention without a cache: x (B, T, d_in) -> out (B, T, E). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_forward(gpt2attn_layer_t* layer, const float* x, int64_t B,
                                                      int64_t T, float* out, int threads, gpt2attn_workspace_t* ws);
/* The same with x and out of the named element types: "f32" (NULL means f32) or "bf16" (bfloat16 as uint16_t bit
 * patterns, the high half of a float32). A bf16 x is read in place by either compute type; a bf16 out is written by
 * the output GEMM itself and needs a layer that computes in bf16 (engine options compute = "bf16"), so a server
 * holding bf16 activations converts nothing. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_forward_typed(gpt2attn_layer_t* layer, const void* x,
                                                            const char* x_dtype, int64_t B, int64_t T, void* out,
                                                            const char* out_dtype, int threads,
                                                            gpt2attn_workspace_t* ws);
/* Grows ws (NULL: the layer's own) for extend <= max_extend_tokens, decode <= max_decode_batch: decode then never
 * allocates; extend allocates nothing of gpt2attn's own for a chunk shape reserved or recently seen (a workspace
 * keeps the 256 most recently used GEMM primitives besides the reserved ones; oneDNN's GEMMs still allocate). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_reserve(gpt2attn_layer_t* layer, int64_t max_extend_tokens,
                                                      int64_t max_decode_batch, int threads,
                                                      gpt2attn_workspace_t* ws);
/* *out = the scratch bytes gpt2attn_layer_reserve would hold for these sizes (gpt2attn_workspace_bytes of a workspace
 * that held less before). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_reserve_bytes(const gpt2attn_layer_t* layer,
                                                            int64_t max_extend_tokens, int64_t max_decode_batch,
                                                            int threads, size_t* out);
/* Grows ws (NULL: the layer's own) for gpt2attn_layer_step of up to max_tokens tokens over up to max_entries entries
 * (1 <= max_entries <= max_tokens), and makes its GEMM primitives: such a step then allocates nothing of gpt2attn's
 * own (a step of up to 64 tokens runs no oneDNN at all; a longer one's oneDNN GEMMs still allocate). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_reserve_step(gpt2attn_layer_t* layer, int64_t max_tokens,
                                                           int64_t max_entries, int threads,
                                                           gpt2attn_workspace_t* ws);
/* *out = the scratch bytes gpt2attn_layer_reserve_step would hold for these sizes (gpt2attn_workspace_bytes of a
 * workspace that held less before). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_layer_reserve_step_bytes(const gpt2attn_layer_t* layer, int64_t max_tokens,
                                                                 int64_t max_entries, int threads, size_t* out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GPT2ATTN_GPT2ATTN_H */
