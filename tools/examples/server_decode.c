/* tools/examples/server_decode.c: the same server loop as server_decode.cpp through the C API: sequences arrive
 * and are prefilled, decode together one token per step, leave. Random weights, no model around the layer.
 *
 *   server_decode_c [--preset gpt2-small] [--steps 16] [--threads 0] */
#include <gpt2attn/gpt2attn.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LIVE 4    /* decode batch limit of this toy server */
#define MAX_PROMPT 32 /* longest prompt, for the workspace reservation */

/* The server's state: the layer, its pool and workspace, and the live requests in decode order. */
typedef struct server {
  gpt2attn_layer_t* layer;
  gpt2attn_kv_cache_t* cache;
  gpt2attn_workspace_t* ws;
  int threads;
  int64_t E;
  int64_t n_live;
  gpt2attn_seq_t seqs[MAX_LIVE]; /* (B) */
  float* next;                   /* (MAX_LIVE, E): each live sequence's next input token */
  float* scratch;                /* (2, MAX_PROMPT, E): a prompt, then its output */
  unsigned rng;
} server_t;

/* Reports a failed call with the library's message; returns the status so callers can `return fail(...)`. */
static gpt2attn_status_t fail(const char* what, gpt2attn_status_t st) {
  fprintf(stderr, "server_decode_c: %s: %s (%s)\n", what, gpt2attn_last_error(), gpt2attn_status_string(st));
  return st;
}

/* Stand-in for a tokenizer + embedding: n random floats in [-1, 1). */
static void random_tokens(server_t* s, float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    s->rng = s->rng * 1664525u + 1013904223u;
    x[i] = (float)(s->rng >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
  }
}

/* Admits a request with a prompt of T tokens: a new sequence, prefilled in one extend. A full pool is not an
 * error for a server: the request waits (nothing was written, the sequence is released). */
static gpt2attn_status_t admit(server_t* s, int64_t T) {
  /* Batch full or prompt too long for this toy: the request waits (a real server prefills long prompts in
   * chunks of MAX_PROMPT tokens, one extend each). */
  if (s->n_live == MAX_LIVE || T > MAX_PROMPT) return GPT2ATTN_OK;
  gpt2attn_seq_t seq;
  gpt2attn_status_t st = gpt2attn_seq_create(s->cache, &seq);
  if (st != GPT2ATTN_OK) return fail("seq_create", st);
  float* prompt = s->scratch;                  /* (T, E) */
  float* out = s->scratch + MAX_PROMPT * s->E; /* (T, E) */
  random_tokens(s, prompt, T * s->E);
  st = gpt2attn_layer_extend(s->layer, s->cache, seq, prompt, T, out, s->threads, s->ws);
  if (st != GPT2ATTN_OK) {
    gpt2attn_seq_release(s->cache, seq); /* never leak a sequence: its blocks would be lost */
    if (st == GPT2ATTN_ERR_OUT_OF_MEMORY) {
      printf("  . a prompt of %lld tokens waits for room in the pool\n", (long long)T);
      return GPT2ATTN_OK;
    }
    return fail("extend", st);
  }
  /* A real model would take the last row through the residual, the MLP, the other layers, the LM head and
   * sampling, and embed the sampled token. Here the attention output itself is fed back. */
  memcpy(s->next + s->n_live * s->E, out + (T - 1) * s->E, sizeof(float) * (size_t)s->E);
  s->seqs[s->n_live++] = seq;
  printf("  + sequence %lld arrives: prompt of %lld tokens\n", (long long)seq, (long long)T);
  return GPT2ATTN_OK;
}

/* The oldest request finishes: release its blocks and close the gap in the batch. */
static gpt2attn_status_t leave(server_t* s) {
  int64_t len = 0;
  gpt2attn_status_t st = gpt2attn_seq_length(s->cache, s->seqs[0], &len);
  if (st != GPT2ATTN_OK) return fail("seq_length", st);
  printf("  - sequence %lld leaves after %lld tokens\n", (long long)s->seqs[0], (long long)len);
  st = gpt2attn_seq_release(s->cache, s->seqs[0]);
  if (st != GPT2ATTN_OK) return fail("seq_release", st);
  --s->n_live;
  memmove(s->seqs, s->seqs + 1, sizeof(gpt2attn_seq_t) * (size_t)s->n_live);
  memmove(s->next, s->next + s->E, sizeof(float) * (size_t)(s->n_live * s->E));
  return GPT2ATTN_OK;
}

static gpt2attn_status_t serve(server_t* s, const char* preset, int steps) {
  gpt2attn_config_t cfg = gpt2attn_config_init(); /* struct_size set (the ABI policy in gpt2attn.h) */
  gpt2attn_status_t st = gpt2attn_config_preset(preset, &cfg);
  if (st != GPT2ATTN_OK) return fail("config_preset", st);
  st = gpt2attn_layer_create_random(&cfg, 42, &s->layer);
  if (st != GPT2ATTN_OK) return fail("layer_create_random", st);
  const char* impl = "";
  gpt2attn_layer_describe(s->layer, NULL, &impl);
  printf("%s: E=%lld H=%lld, kernels %s\n", preset, (long long)cfg.d_model, (long long)cfg.num_heads, impl);

  /* The pool is sized in tokens for the whole server and allocated once (blocks of 64 tokens). One workspace
   * per serving thread, reserved for the largest prompt and batch: the decode steps below allocate nothing. */
  st = gpt2attn_kv_cache_create(s->layer, 0, 1024, &s->cache);
  if (st != GPT2ATTN_OK) return fail("kv_cache_create", st);
  st = gpt2attn_workspace_create(&s->ws);
  if (st != GPT2ATTN_OK) return fail("workspace_create", st);
  st = gpt2attn_layer_reserve(s->layer, MAX_PROMPT, MAX_LIVE, s->threads, s->ws);
  if (st != GPT2ATTN_OK) return fail("reserve", st);

  s->E = cfg.d_model;
  s->next = malloc(sizeof(float) * (size_t)(MAX_LIVE * s->E));
  s->scratch = malloc(sizeof(float) * (size_t)(2 * MAX_PROMPT * s->E));
  float* y = malloc(sizeof(float) * (size_t)(MAX_LIVE * s->E));
  if (!s->next || !s->scratch || !y) {
    free(y);
    fprintf(stderr, "server_decode_c: out of memory\n");
    return GPT2ATTN_ERR_OUT_OF_MEMORY;
  }

  const int64_t prompts[3] = {12, 32, 20};
  for (int i = 0; i < 3 && st == GPT2ATTN_OK; ++i) st = admit(s, prompts[i]);

  for (int step = 0; step < steps && s->n_live > 0 && st == GPT2ATTN_OK; ++step) {
    /* Mid-way the oldest request finishes and leaves, and a new one arrives in its place. */
    if (step == steps / 2) {
      st = leave(s);
      if (st == GPT2ATTN_OK) st = admit(s, 16);
      if (st != GPT2ATTN_OK) break;
    }
    /* One decode step for every live sequence: next (B, E) -> y (B, E), one GEMM for all B. */
    st = gpt2attn_layer_decode(s->layer, s->cache, s->seqs, s->n_live, s->next, y, s->threads, s->ws);
    if (st != GPT2ATTN_OK) {
      fail("decode", st);
      break;
    }
    /* As in admit(): a real model would turn each row of y into the next token's embedding. */
    memcpy(s->next, y, sizeof(float) * (size_t)(s->n_live * s->E));
    int64_t free_blocks = 0, total_blocks = 0;
    gpt2attn_kv_cache_stats(s->cache, NULL, &total_blocks, &free_blocks, NULL);
    printf("step %d: decoded %lld sequences, %lld of %lld blocks free\n", step, (long long)s->n_live,
           (long long)free_blocks, (long long)total_blocks);
  }
  free(y);
  return st;
}

int main(int argc, char** argv) {
  const char* preset = "gpt2-small";
  int steps = 16;
  server_t s;
  memset(&s, 0, sizeof s);
  s.rng = 7;
  for (int i = 1; i < argc; ++i) {
    const int has_value = i + 1 < argc;
    if (!strcmp(argv[i], "--preset") && has_value) {
      preset = argv[++i];
    } else if (!strcmp(argv[i], "--steps") && has_value) {
      steps = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--threads") && has_value) {
      s.threads = atoi(argv[++i]);
    } else {
      fprintf(stderr, "usage: %s [--preset NAME] [--steps N] [--threads N]\n", argv[0]);
      return 2;
    }
  }

  const gpt2attn_status_t st = serve(&s, preset, steps);

  /* One cleanup path for success and failure: destroy functions accept NULL. Destroying the cache releases
   * any sequences still in it; releasing them one by one first is what a server does as requests end. */
  for (int64_t i = 0; i < s.n_live; ++i) gpt2attn_seq_release(s.cache, s.seqs[i]);
  if (st == GPT2ATTN_OK) {
    size_t bytes = 0;
    gpt2attn_workspace_bytes(s.ws, &bytes);
    printf("done: workspace %zu bytes\n", bytes);
  }
  gpt2attn_workspace_destroy(s.ws);
  gpt2attn_kv_cache_destroy(s.cache);
  gpt2attn_layer_destroy(s.layer);
  free(s.next);
  free(s.scratch);
  return st == GPT2ATTN_OK ? 0 : st == GPT2ATTN_ERR_INTERNAL ? 1 : 2;
}
