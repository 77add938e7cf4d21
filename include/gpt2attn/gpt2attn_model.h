/* gpt2attn/gpt2attn_model.h: the C API (C99 and later, and C++) of the model library, libgpt2attn_model.so: a whole
 * GPT-2 from a Hugging Face checkpoint directory, its teacher-forced logits and greedy or sampled generation, over
 * token ids (tokenization is the caller's). It has no KV cache or step call of its own yet: a C server batching
 * sequences builds on the layer API of gpt2attn.h or on the C++ GPT2::step.
 *
 * Contract: gpt2attn.h's, for the same status codes. Every function that can fail returns gpt2attn_status_t; a failed
 * call wrote nothing (GPT2ATTN_ERR_INTERNAL alone promises nothing about outputs), throws nothing, and leaves a
 * one-line message naming the function and the argument, field or file in gpt2attn_model_last_error(). A NULL handle
 * or pointer is GPT2ATTN_ERR_INVALID_ARGUMENT.
 *
 * The message lives in this library, not in gpt2attn_last_error(): libgpt2attn.so exports no way for another library
 * to set its message, so each library keeps its own. A model call's failure is read with gpt2attn_model_last_error();
 * gpt2attn_last_error() keeps the last failure of the attention API's own calls.
 *
 * Structs follow gpt2attn.h's ABI policy: each leads with struct_size (set it with the _init() functions below), they
 * grow only at their end in groups of 8 bytes, fields an older caller did not have read as 0, and 0 is always the
 * default. Handles are opaque. Link with -lgpt2attn_model -lgpt2attn.
 *
 * Threads: a model may be shared between threads; its calls are serialised (one call computes at a time, on the
 * model's threads). */
#ifndef GPT2ATTN_GPT2ATTN_MODEL_H
#define GPT2ATTN_GPT2ATTN_MODEL_H

#include <stdint.h>
#include <string.h>

#include "gpt2attn/gpt2attn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gpt2attn_model gpt2attn_model_t; /* a GPT-2's weights, converted or quantized, and its scratch */

/* How the model computes; every field 0 or NULL is its default. */
typedef struct gpt2attn_model_options {
  uint32_t struct_size;
  int32_t threads;     /* threads of every call; 0: every core OpenMP offers (OMP_NUM_THREADS) */
  const char* isa;     /* instruction-set cap: NULL or "best", "avx512_bf16", "avx512", "avx2", "scalar" */
  const char* dtype;   /* compute type: NULL or "f32"; "bf16": weights and matrix products in bf16, sums in f32 */
  const char* weights; /* the matrices' format: NULL or "compute" (dtype's), "int8" (a scale per output row) or
                          "int4" (a scale per row and 32 inputs; the LM head stays int8), quantized once, at open */
} gpt2attn_model_options_t;

/* A model's sizes, in Hugging Face's GPT2Config names. Filled by gpt2attn_model_config. */
typedef struct gpt2attn_gpt2_config {
  uint32_t struct_size;
  int64_t vocab_size;
  int64_t n_positions; /* the longest sequence: prompt plus generated ids */
  int64_t n_embd;      /* E */
  int64_t n_layer;
  int64_t n_head;      /* H */
  int64_t n_inner;     /* the MLP's width (4 E unless config.json says otherwise) */
  double layer_norm_epsilon;
} gpt2attn_gpt2_config_t;

/* What gpt2attn_model_generate does; every field 0 or NULL is its default (greedy, 16 new ids, no stop ids). */
typedef struct gpt2attn_generate_options {
  uint32_t struct_size;
  float temperature;       /* 0: greedy (argmax; top_k and top_p ignored); else finite and above 0 */
  int64_t max_new_tokens;  /* 0: 16; generation also ends at n_positions ids in all */
  int64_t top_k;           /* 0: off; else keep the ids whose logit >= the k-th largest */
  float top_p;             /* 0 or 1: off; else in (0, 1): the nucleus */
  int32_t threads;         /* 0: the model's */
  uint64_t seed;           /* the sampling stream: a sequence's ids depend only on its logits, seed and position */
  const int32_t* stop_ids; /* n_stop ids (or NULL with n_stop 0): one sampled ends generation, returned as the last */
  int64_t n_stop;
  int64_t max_step_tokens; /* 0: 512; the prompt's prefill runs in chunks of this many ids */
  const char* kv_dtype;    /* the cache's K/V storage: NULL or "f32", "bf16", "i8" ("int8"), "fp8" */
} gpt2attn_generate_options_t;

/* Why generation ended. */
typedef enum gpt2attn_finish_reason {
  GPT2ATTN_FINISH_STOP = 1,  /* a stop id was sampled (it is the last id returned) */
  GPT2ATTN_FINISH_LENGTH = 2 /* max_new_tokens ids, or the sequence reached n_positions */
} gpt2attn_finish_reason_t;

static inline gpt2attn_model_options_t gpt2attn_model_options_init(void) {
  gpt2attn_model_options_t o;
  memset(&o, 0, sizeof o);
  o.struct_size = GPT2ATTN_STRUCT_SIZE(gpt2attn_model_options_t);
  return o;
}
static inline gpt2attn_gpt2_config_t gpt2attn_gpt2_config_init(void) {
  gpt2attn_gpt2_config_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = GPT2ATTN_STRUCT_SIZE(gpt2attn_gpt2_config_t);
  return c;
}
static inline gpt2attn_generate_options_t gpt2attn_generate_options_init(void) {
  gpt2attn_generate_options_t g;
  memset(&g, 0, sizeof g);
  g.struct_size = GPT2ATTN_STRUCT_SIZE(gpt2attn_generate_options_t);
  return g;
}

/* The message of this thread's last failed model call ("" if none); valid until this thread's next failing model
 * call or its exit. Where even that message finds no memory, a fixed one saying so. */
GPT2ATTN_API const char* gpt2attn_model_last_error(void);

/* Opens a Hugging Face GPT-2 checkpoint directory (config.json, and model.safetensors or the shards
 * model.safetensors.index.json lists; F32, F16 or BF16) and builds the model as `options` says (NULL: the defaults).
 * GPT2ATTN_ERR_BAD_FILE naming the file and the tensor for a missing directory or file, a bad config or tensor. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_model_open(const char* dir, const gpt2attn_model_options_t* options,
                                                   gpt2attn_model_t** out);
/* Frees the model; NULL is a no-op. */
GPT2ATTN_API void gpt2attn_model_free(gpt2attn_model_t* model);

/* *out = the model's sizes; out->struct_size must be set (gpt2attn_gpt2_config_init()). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_model_config(const gpt2attn_model_t* model, gpt2attn_gpt2_config_t* out);

/* Teacher-forced logits of ids (T) at positions 0..T-1, without a cache: out (T, vocab_size) float32, row-major.
 * 1 <= T <= n_positions; every id in [0, vocab_size) (else GPT2ATTN_ERR_INVALID_ARGUMENT naming the id and its
 * index, out untouched). */
GPT2ATTN_API gpt2attn_status_t gpt2attn_model_logits(gpt2attn_model_t* model, const int32_t* ids, int64_t T,
                                                     float* out);

/* Generates after prompt (n ids, 1 <= n < n_positions) as `options` says (NULL: greedy, 16 ids): out_ids[0..*n_out)
 * the new ids (a stop id included), *finish_reason a gpt2attn_finish_reason_t. capacity must hold the most the call
 * can return, min(max_new_tokens, n_positions - n), checked before anything runs; finish_reason may be NULL. */
GPT2ATTN_API gpt2attn_status_t gpt2attn_model_generate(gpt2attn_model_t* model, const int32_t* prompt, int64_t n,
                                                       const gpt2attn_generate_options_t* options, int32_t* out_ids,
                                                       int64_t capacity, int64_t* n_out, int* finish_reason);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GPT2ATTN_GPT2ATTN_MODEL_H */
