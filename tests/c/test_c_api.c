/* tests/c/test_c_api.c: the C API exercised from C (compiled as C11, linked to libgpt2attn.so): prefill and batched
 * decode through a paged KV cache checked against the layer's own full forward, ragged steps against extend, the
 * error contract (status, message, no writes) and the struct_size rule of the ABI policy (older and newer callers'
 * structs). */
#include <gpt2attn/gpt2attn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <threads.h>

/* E = 64, H = 4: small enough to run in milliseconds, D = 16 still a real head. Blocks of 4 tokens make the
 * prompts (7 and 5 tokens) and the decode steps cross block boundaries; context 16 keeps the limit reachable. */
#define E 64
#define H 4
#define CTX 16
#define BLOCK 4
#define PROMPT_A 7
#define PROMPT_B 5
#define STEPS 4
#define LEN_A (PROMPT_A + STEPS)
#define LEN_B (PROMPT_B + STEPS)
#define SENTINEL 12345.0f
/* A handle value no call returns: *out starts here where a failing call must leave it as it was. Never dereferenced. */
static char unset_marker;
#define UNSET_LAYER ((gpt2attn_layer_t*)(void*)&unset_marker)

static int g_passed, g_failed;

#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (cond) {                                                   \
      ++g_passed;                                                 \
    } else {                                                      \
      ++g_failed;                                                 \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);        \
      fprintf(stderr, __VA_ARGS__);                               \
      fputc('\n', stderr);                                        \
    }                                                             \
  } while (0)

/* A call that must succeed; on failure prints the library's message. */
#define CHECK_OK(call)                                                                               \
  do {                                                                                               \
    gpt2attn_status_t st_ = (call);                                                                  \
    CHECK(st_ == GPT2ATTN_OK, "%s -> %s: %s", #call, gpt2attn_status_string(st_), gpt2attn_last_error()); \
  } while (0)

/* A call that must fail with `status` and a last-error message containing `needle`. */
#define CHECK_ERR(call, status, needle)                                                                     \
  do {                                                                                                      \
    gpt2attn_status_t st_ = (call);                                                                         \
    CHECK(st_ == (status), "%s -> %s, expected %s (%s)", #call, gpt2attn_status_string(st_),               \
          gpt2attn_status_string(status), gpt2attn_last_error());                                          \
    CHECK(st_ == GPT2ATTN_OK || strstr(gpt2attn_last_error(), (needle)) != NULL,                            \
          "%s: message \"%s\" does not mention \"%s\"", #call, gpt2attn_last_error(), (needle));            \
  } while (0)

/* Deterministic inputs in [-1, 1) without depending on the C library's rand(). */
static void fill(float* x, size_t n, uint32_t seed) {
  uint32_t s = seed * 2654435761u + 1u;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    x[i] = (float)(s >> 8) / (float)(1u << 24) * 2.0f - 1.0f;
  }
}

/* The tolerance of the brief: |got - expected| <= 1e-4 + 1e-4 |expected|; reports the first bad element. */
static void check_rows(const char* what, const float* got, const float* expected, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const double err = fabs((double)got[i] - (double)expected[i]);
    if (!(err <= 1e-4 + 1e-4 * fabs((double)expected[i]))) {
      CHECK(0, "%s: element %zu got %.7g expected %.7g (error %.3g)", what, i, got[i], expected[i], err);
      return;
    }
  }
  CHECK(1, "%s", what);
}

static int untouched(const float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (out[i] != SENTINEL) return 0;
  }
  return 1;
}

/* Fails a call on its own thread; returns whether that thread then read its own message. */
static int fail_on_another_thread(void* unused) {
  (void)unused;
  gpt2attn_seq_t s = 0;
  return gpt2attn_seq_create(NULL, &s) == GPT2ATTN_ERR_INVALID_ARGUMENT &&
         strncmp(gpt2attn_last_error(), "gpt2attn_seq_create", 19) == 0;
}

static void set_sentinel(float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = SENTINEL;
}

/* A config from its sizes, struct_size set as the ABI policy asks. */
static gpt2attn_config_t config_of(int64_t e, int64_t h, int64_t ctx, int qkv_bias, int out_bias, int64_t kv_heads) {
  gpt2attn_config_t c = gpt2attn_config_init();
  c.d_model = e;
  c.num_heads = h;
  c.context_length = ctx;
  c.qkv_bias = qkv_bias;
  c.out_bias = out_bias;
  c.num_kv_heads = kv_heads;
  return c;
}

static int64_t seq_len(const gpt2attn_kv_cache_t* cache, gpt2attn_seq_t s) {
  int64_t n = -1;
  if (gpt2attn_seq_length(cache, s, &n) != GPT2ATTN_OK) return -1;
  return n;
}

/* Library-level queries: version, isa, presets. */
static void test_library(gpt2attn_layer_t* layer) {
  char expected[32];
  snprintf(expected, sizeof expected, "%d.%d.%d", GPT2ATTN_VERSION_MAJOR, GPT2ATTN_VERSION_MINOR,
           GPT2ATTN_VERSION_PATCH);
  CHECK(strcmp(gpt2attn_version(), expected) == 0, "version %s, header says %s", gpt2attn_version(), expected);

  const char* best = gpt2attn_best_isa();
  CHECK(!strcmp(best, "avx512_bf16") || !strcmp(best, "avx512") || !strcmp(best, "avx2") || !strcmp(best, "scalar"),
        "best isa \"%s\"", best);
  const char* isa = NULL;
  const char* impl = NULL;
  CHECK_OK(gpt2attn_layer_describe(layer, &isa, &impl));
  CHECK(isa && impl && strstr(impl, isa) != NULL, "isa \"%s\" implementation \"%s\"", isa ? isa : "(null)",
        impl ? impl : "(null)");
  printf("library %s, layer isa %s (%s)\n", gpt2attn_version(), isa ? isa : "?", impl ? impl : "?");

  gpt2attn_config_t c = gpt2attn_config_init();
  CHECK_OK(gpt2attn_config_preset("gpt2-small", &c));
  CHECK(c.d_model == 768 && c.num_heads == 12 && c.d_in == 768 && c.context_length == 1024 && c.qkv_bias &&
            c.out_bias,
        "gpt2-small preset");
  CHECK_ERR(gpt2attn_config_preset("gpt2-tiny", &c), GPT2ATTN_ERR_INVALID_ARGUMENT, "gpt2-tiny");

  CHECK_OK(gpt2attn_layer_config(layer, &c));
  CHECK(c.d_model == E && c.num_heads == H && c.d_in == E && c.context_length == CTX, "layer config");

  /* block_tokens 0 = the default 64-token block, capped at this short context. */
  gpt2attn_kv_cache_t* cache = NULL;
  int64_t bt = 0, total = 0;
  CHECK_OK(gpt2attn_kv_cache_create(layer, 0, 40, &cache));
  CHECK_OK(gpt2attn_kv_cache_stats(cache, &bt, &total, NULL, NULL));
  CHECK(bt == CTX && total == 3, "default blocks: %lld blocks of %lld tokens", (long long)total, (long long)bt);
  gpt2attn_kv_cache_destroy(cache);
  CHECK_ERR(gpt2attn_kv_cache_create(layer, BLOCK, 0, &cache), GPT2ATTN_ERR_INVALID_ARGUMENT, "capacity_tokens");
}

/* Prefill A (7 tokens) and B (5 tokens), decode 4 steps of both at once, compare every output row with one
 * forward over the whole sequence; then a fork continues A. Returns A's and B's references for later tests. */
static void test_prefill_decode(gpt2attn_layer_t* layer, const float* xa, const float* xb, float* ref_a,
                                float* ref_b) {
  gpt2attn_kv_cache_t* cache = NULL;
  gpt2attn_workspace_t* ws = NULL;
  CHECK_OK(gpt2attn_kv_cache_create(layer, BLOCK, 64, &cache));
  CHECK_OK(gpt2attn_workspace_create(&ws));
  if (!cache || !ws) return;
  CHECK_OK(gpt2attn_layer_reserve(layer, 8, 2, 2, ws));
  size_t planned = 0, held = 0;
  CHECK_OK(gpt2attn_layer_reserve_bytes(layer, 8, 2, 2, &planned));
  CHECK_OK(gpt2attn_workspace_bytes(ws, &held));
  CHECK(planned == held && held > 0, "reserve_bytes %zu, a fresh workspace after reserve holds %zu", planned, held);

  /* The references: the layer's own cacheless forward over prompt + decoded tokens. */
  CHECK_OK(gpt2attn_layer_forward(layer, xa, 1, LEN_A, ref_a, 2, NULL));
  CHECK_OK(gpt2attn_layer_forward(layer, xb, 1, LEN_B, ref_b, 2, NULL));

  gpt2attn_seq_t a = -1, b = -1;
  CHECK_OK(gpt2attn_seq_create(cache, &a));
  CHECK_OK(gpt2attn_seq_create(cache, &b));
  CHECK(a != b, "distinct sequence ids");

  float ya[PROMPT_A * E], yb[PROMPT_B * E];
  CHECK_OK(gpt2attn_layer_extend(layer, cache, a, xa, PROMPT_A, ya, 2, ws));
  CHECK_OK(gpt2attn_layer_extend(layer, cache, b, xb, PROMPT_B, yb, 2, ws));
  check_rows("prefill A vs forward", ya, ref_a, PROMPT_A * E);
  check_rows("prefill B vs forward", yb, ref_b, PROMPT_B * E);

  const gpt2attn_seq_t seqs[2] = {a, b};
  for (int s = 0; s < STEPS; ++s) {
    float x[2 * E], y[2 * E];
    memcpy(x, xa + (PROMPT_A + s) * E, sizeof(float) * E);
    memcpy(x + E, xb + (PROMPT_B + s) * E, sizeof(float) * E);
    CHECK_OK(gpt2attn_layer_decode(layer, cache, seqs, 2, x, y, 2, ws));
    char what[64];
    snprintf(what, sizeof what, "decode step %d, A vs forward", s);
    check_rows(what, y, ref_a + (PROMPT_A + s) * E, E);
    snprintf(what, sizeof what, "decode step %d, B vs forward", s);
    check_rows(what, y + E, ref_b + (PROMPT_B + s) * E, E);
  }
  CHECK(seq_len(cache, a) == LEN_A && seq_len(cache, b) == LEN_B, "lengths after decode: %lld %lld",
        (long long)seq_len(cache, a), (long long)seq_len(cache, b));

  /* A fork shares A's 11 tokens (its last block is partly filled, so the first append copies it); one more
   * token on the fork must match a forward over A's tokens + that token, and A itself must be unchanged. */
  gpt2attn_seq_t f = -1;
  CHECK_OK(gpt2attn_seq_fork(cache, a, &f));
  CHECK(seq_len(cache, f) == LEN_A, "fork length %lld", (long long)seq_len(cache, f));
  float xf[(LEN_A + 1) * E], ref_f[(LEN_A + 1) * E], yf[E];
  memcpy(xf, xa, sizeof(float) * LEN_A * E);
  fill(xf + LEN_A * E, E, 99);
  CHECK_OK(gpt2attn_layer_forward(layer, xf, 1, LEN_A + 1, ref_f, 0, ws));
  CHECK_OK(gpt2attn_layer_decode(layer, cache, &f, 1, xf + LEN_A * E, yf, 0, ws));
  check_rows("decode on a fork vs forward", yf, ref_f + LEN_A * E, E);
  CHECK(seq_len(cache, a) == LEN_A && seq_len(cache, f) == LEN_A + 1, "lengths after fork decode");

  /* A prefix fork of A's first 6 tokens, then A truncated to 6 under it: each continues as a forward over its own
   * tokens (the forward of A's first 6 tokens plus the fork's token, ref_f's first rows being A's), and bad lengths
   * are refused by name. */
  gpt2attn_seq_t p = -1;
  CHECK_OK(gpt2attn_seq_fork_prefix(cache, a, 6, &p));
  CHECK(seq_len(cache, p) == 6, "prefix fork length %lld", (long long)seq_len(cache, p));
  float xp[7 * E], ref_p[7 * E], yp[E];
  memcpy(xp, xa, sizeof(float) * 6 * E);
  fill(xp + 6 * E, E, 98);
  CHECK_OK(gpt2attn_layer_forward(layer, xp, 1, 7, ref_p, 0, ws));
  CHECK_OK(gpt2attn_layer_decode(layer, cache, &p, 1, xp + 6 * E, yp, 0, ws));
  check_rows("decode on a prefix fork vs forward", yp, ref_p + 6 * E, E);
  CHECK_OK(gpt2attn_seq_truncate(cache, a, 6));
  CHECK(seq_len(cache, a) == 6, "truncated length %lld", (long long)seq_len(cache, a));
  CHECK_OK(gpt2attn_layer_decode(layer, cache, &a, 1, xp + 6 * E, yp, 0, ws));
  check_rows("decode after truncate vs forward", yp, ref_p + 6 * E, E);
  gpt2attn_seq_t untouched = -7;
  CHECK_ERR(gpt2attn_seq_fork_prefix(cache, a, 8, &untouched), GPT2ATTN_ERR_INVALID_ARGUMENT, "prefix_tokens 8");
  CHECK_ERR(gpt2attn_seq_truncate(cache, a, -1), GPT2ATTN_ERR_INVALID_ARGUMENT, "new_length -1");
  CHECK_ERR(gpt2attn_seq_truncate(NULL, a, 0), GPT2ATTN_ERR_INVALID_ARGUMENT, "cache");
  CHECK(untouched == -7 && seq_len(cache, a) == 7, "a refused fork or truncate changed something");
  CHECK_OK(gpt2attn_seq_release(cache, p));

  size_t ws_bytes = 0;
  CHECK_OK(gpt2attn_workspace_bytes(ws, &ws_bytes));
  CHECK(ws_bytes > 0, "workspace holds memory after use");

  CHECK_OK(gpt2attn_seq_release(cache, f));
  CHECK_OK(gpt2attn_seq_release(cache, a));
  CHECK_OK(gpt2attn_seq_release(cache, b));
  int64_t total = 0, free_blocks = 0, nseq = -1;
  CHECK_OK(gpt2attn_kv_cache_stats(cache, NULL, &total, &free_blocks, &nseq));
  CHECK(total == 16 && free_blocks == 16 && nseq == 0, "after release: %lld/%lld blocks free, %lld sequences",
        (long long)free_blocks, (long long)total, (long long)nseq);
  gpt2attn_workspace_destroy(ws);
  gpt2attn_kv_cache_destroy(cache);
}

/* gpt2attn_layer_step: a ragged step over A (6 cached tokens, 3 new), B (2 cached, 1 new: a decode token) and C (empty,
 * a 5-token prompt) gives, row for row, what extend of each entry alone gives on a second cache holding the same
 * tokens; then a smaller step on the layer's own workspace (NULL); then bad steps, which change no length. */
#define STEP_N 3
#define STEP_TOKENS 9 /* 3 + 1 + 5 */
static void test_step(gpt2attn_layer_t* layer) {
  gpt2attn_kv_cache_t *cache = NULL, *ref = NULL;
  gpt2attn_workspace_t *ws = NULL, *fresh = NULL;
  CHECK_OK(gpt2attn_kv_cache_create(layer, BLOCK, 64, &cache));
  CHECK_OK(gpt2attn_kv_cache_create(layer, BLOCK, 64, &ref));
  CHECK_OK(gpt2attn_workspace_create(&ws));
  CHECK_OK(gpt2attn_workspace_create(&fresh));
  if (!cache || !ref || !ws || !fresh) return;

  /* reserve_step sizes a workspace for the step below, as reserve_step_bytes says. */
  size_t planned = 0, held = 0;
  CHECK_OK(gpt2attn_layer_reserve_step_bytes(layer, STEP_TOKENS, STEP_N, 2, &planned));
  CHECK_OK(gpt2attn_layer_reserve_step(layer, STEP_TOKENS, STEP_N, 2, fresh));
  CHECK_OK(gpt2attn_workspace_bytes(fresh, &held));
  CHECK(planned == held && held > 0, "reserve_step_bytes %zu, a fresh workspace after reserve_step holds %zu",
        planned, held);
  CHECK_OK(gpt2attn_layer_reserve_step(layer, STEP_TOKENS, STEP_N, 2, ws));
  CHECK_OK(gpt2attn_layer_reserve_step(layer, STEP_TOKENS, STEP_N, 2, NULL));

  gpt2attn_seq_t s[STEP_N], r[STEP_N];
  for (int i = 0; i < STEP_N; ++i) {
    CHECK_OK(gpt2attn_seq_create(cache, &s[i]));
    CHECK_OK(gpt2attn_seq_create(ref, &r[i]));
  }
  static const int64_t cached[STEP_N] = {6, 2, 0}, fresh_tokens[STEP_N] = {3, 1, 5};
  float prompt[6 * E], y[6 * E];
  for (int i = 0; i < STEP_N; ++i) {
    if (cached[i] == 0) continue;
    fill(prompt, (size_t)(cached[i] * E), 40u + (uint32_t)i);
    CHECK_OK(gpt2attn_layer_extend(layer, cache, s[i], prompt, cached[i], y, 2, NULL));
    CHECK_OK(gpt2attn_layer_extend(layer, ref, r[i], prompt, cached[i], y, 2, NULL));
  }

  float x[STEP_TOKENS * E], out[STEP_TOKENS * E], want[STEP_TOKENS * E];
  fill(x, STEP_TOKENS * E, 50);
  gpt2attn_step_entry_t entries[STEP_N];
  int64_t row = 0;
  for (int i = 0; i < STEP_N; ++i) {
    entries[i].seq = s[i];
    entries[i].tokens = fresh_tokens[i];
    CHECK_OK(gpt2attn_layer_extend(layer, ref, r[i], x + row * E, fresh_tokens[i], want + row * E, 2, NULL));
    row += fresh_tokens[i];
  }
  set_sentinel(out, STEP_TOKENS * E);
  CHECK_OK(gpt2attn_layer_step(layer, cache, entries, STEP_N, x, out, 2, ws));
  check_rows("ragged step {A: 3, B: 1, C: 5} vs extend of each entry", out, want, STEP_TOKENS * E);
  for (int i = 0; i < STEP_N; ++i) {
    CHECK(seq_len(cache, s[i]) == cached[i] + fresh_tokens[i], "entry %d: length %lld after the step", i,
          (long long)seq_len(cache, s[i]));
  }

  /* The layer's own workspace (NULL), the entries in another order: C 2 tokens, A 1 token. */
  {
    const gpt2attn_step_entry_t two[2] = {{s[2], 2}, {s[0], 1}};
    float x2[3 * E], out2[3 * E], want2[3 * E];
    fill(x2, 3 * E, 51);
    CHECK_OK(gpt2attn_layer_extend(layer, ref, r[2], x2, 2, want2, 0, NULL));
    CHECK_OK(gpt2attn_layer_extend(layer, ref, r[0], x2 + 2 * E, 1, want2 + 2 * E, 0, NULL));
    CHECK_OK(gpt2attn_layer_step(layer, cache, two, 2, x2, out2, 0, NULL));
    check_rows("step on the layer's workspace {C: 2, A: 1} vs extend", out2, want2, 3 * E);
  }
  const int64_t len0 = seq_len(cache, s[0]), len1 = seq_len(cache, s[1]), len2 = seq_len(cache, s[2]);
  CHECK(len0 == 10 && len1 == 3 && len2 == 7, "lengths %lld %lld %lld", (long long)len0, (long long)len1,
        (long long)len2);

  /* Bad steps: refused as INVALID_ARGUMENT naming the problem; no sequence grows and out is not written. */
  {
    const gpt2attn_step_entry_t zero[2] = {{s[0], 1}, {s[1], 0}};
    const gpt2attn_step_entry_t twice[2] = {{s[1], 1}, {s[1], 2}};
    const gpt2attn_step_entry_t unknown[1] = {{987654, 1}};
    set_sentinel(out, STEP_TOKENS * E);
    CHECK_ERR(gpt2attn_layer_step(layer, cache, zero, 2, x, out, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT, "tokens=0");
    CHECK_ERR(gpt2attn_layer_step(layer, cache, twice, 2, x, out, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "twice");
    CHECK_ERR(gpt2attn_layer_step(layer, cache, unknown, 1, x, out, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT, "987654");
    CHECK_ERR(gpt2attn_layer_step(layer, cache, NULL, 1, x, out, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT, "entries");
    CHECK_ERR(gpt2attn_layer_step(layer, cache, entries, 0, x, out, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT, "n");
    CHECK_ERR(gpt2attn_layer_step(layer, cache, entries, -1, x, out, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "n");
    /* More entries than sequences is refused before the entries are read or copied. */
    CHECK_ERR(gpt2attn_layer_step(layer, cache, entries, INT64_MAX, x, out, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "distinct");
    CHECK_ERR(gpt2attn_layer_step(NULL, cache, entries, STEP_N, x, out, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "layer");
    CHECK_ERR(gpt2attn_layer_step(layer, NULL, entries, STEP_N, x, out, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "cache");
    CHECK_ERR(gpt2attn_layer_step(layer, cache, entries, STEP_N, NULL, out, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "x");
    CHECK_ERR(gpt2attn_layer_step(layer, cache, entries, STEP_N, x, NULL, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "out");
    CHECK_ERR(gpt2attn_layer_step(layer, cache, entries, STEP_N, x, out, -1, ws), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "threads");
    /* A's 10 tokens + 7 pass context_length 16. */
    const gpt2attn_step_entry_t too_long[2] = {{s[1], 1}, {s[0], 7}};
    CHECK_ERR(gpt2attn_layer_step(layer, cache, too_long, 2, x, out, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "context");
    CHECK(strncmp(gpt2attn_last_error(), "gpt2attn_layer_step", 19) == 0, "message names the function: \"%s\"",
          gpt2attn_last_error());
    CHECK(untouched(out, STEP_TOKENS * E), "refused steps wrote nothing");
    CHECK(seq_len(cache, s[0]) == len0 && seq_len(cache, s[1]) == len1 && seq_len(cache, s[2]) == len2,
          "refused steps changed no length: %lld %lld %lld", (long long)seq_len(cache, s[0]),
          (long long)seq_len(cache, s[1]), (long long)seq_len(cache, s[2]));
    size_t bytes = 12345;
    CHECK_ERR(gpt2attn_layer_reserve_step_bytes(layer, 2, 3, 0, &bytes), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "max_entries");
    CHECK_ERR(gpt2attn_layer_reserve_step_bytes(layer, 0, 0, 0, &bytes), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "max_tokens");
    CHECK_ERR(gpt2attn_layer_reserve_step_bytes(layer, 4, 1, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "out");
    CHECK(bytes == 12345, "a refused reserve_step_bytes left *out as it was");
    CHECK_ERR(gpt2attn_layer_reserve_step(layer, 2, 3, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT, "max_entries");
    CHECK_ERR(gpt2attn_layer_reserve_step(NULL, 4, 1, 0, ws), GPT2ATTN_ERR_INVALID_ARGUMENT, "layer");
    CHECK_ERR(gpt2attn_layer_reserve_step(layer, 4, 1, 100000, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "threads");
  }

  /* The step still runs after the refusals, on the workspace reserved for it. */
  {
    const gpt2attn_step_entry_t one[2] = {{s[1], 1}, {s[2], 1}};
    float x3[2 * E], out3[2 * E], want3[2 * E];
    fill(x3, 2 * E, 52);
    CHECK_OK(gpt2attn_layer_extend(layer, ref, r[1], x3, 1, want3, 0, NULL));
    CHECK_OK(gpt2attn_layer_extend(layer, ref, r[2], x3 + E, 1, want3 + E, 0, NULL));
    CHECK_OK(gpt2attn_layer_step(layer, cache, one, 2, x3, out3, 2, fresh));
    check_rows("step after refused steps vs extend", out3, want3, 2 * E);
  }
  gpt2attn_workspace_destroy(fresh);
  gpt2attn_workspace_destroy(ws);
  gpt2attn_kv_cache_destroy(ref);
  gpt2attn_kv_cache_destroy(cache);
}

/* Null handles and pointers, unknown and released ids, bad threads, a bad file: status + message, no write. */
static void test_argument_errors(gpt2attn_layer_t* layer, const float* xa) {
  gpt2attn_kv_cache_t* cache = NULL;
  CHECK_OK(gpt2attn_kv_cache_create(layer, BLOCK, 64, &cache));
  gpt2attn_seq_t s = -1;
  CHECK_OK(gpt2attn_seq_create(cache, &s));
  float y[PROMPT_A * E];

  set_sentinel(y, PROMPT_A * E);
  CHECK_ERR(gpt2attn_layer_forward(NULL, xa, 1, 2, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "layer");
  CHECK_ERR(gpt2attn_layer_extend(layer, NULL, s, xa, 2, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "cache");
  CHECK_ERR(gpt2attn_layer_extend(layer, cache, s, NULL, 2, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "x");
  CHECK_ERR(gpt2attn_layer_decode(layer, cache, NULL, 1, xa, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "seqs");
  CHECK_ERR(gpt2attn_layer_forward(layer, xa, 1, 2, NULL, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "out");
  CHECK_ERR(gpt2attn_seq_create(NULL, &s), GPT2ATTN_ERR_INVALID_ARGUMENT, "cache");
  CHECK_ERR(gpt2attn_layer_describe(NULL, NULL, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "layer");
  CHECK_ERR(gpt2attn_kv_cache_create(NULL, BLOCK, 64, &cache), GPT2ATTN_ERR_INVALID_ARGUMENT, "layer");
  CHECK_ERR(gpt2attn_layer_create_random(NULL, 1, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "config");
  CHECK_ERR(gpt2attn_layer_forward(layer, xa, 1, 2, y, -1, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "threads");
  /* libgomp cannot start a team of 100000 threads (stack overflow, or exit() when creation fails). */
  CHECK_ERR(gpt2attn_layer_forward(layer, xa, 1, 2, y, 100000, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "threads");
  CHECK(untouched(y, PROMPT_A * E), "outputs untouched by failed calls");
  gpt2attn_layer_destroy(NULL); /* no-ops, must not crash */
  gpt2attn_kv_cache_destroy(NULL);
  gpt2attn_workspace_destroy(NULL);

  /* The message is per thread and prefixed with the function that failed. */
  CHECK(strncmp(gpt2attn_last_error(), "gpt2attn_layer_forward", 22) == 0, "message names the function: \"%s\"",
        gpt2attn_last_error());
  {
    thrd_t other;
    int other_failed = 0;
    CHECK(thrd_create(&other, fail_on_another_thread, NULL) == thrd_success && thrd_join(other, &other_failed) ==
          thrd_success && other_failed, "another thread's call failed with its own message");
    CHECK(strncmp(gpt2attn_last_error(), "gpt2attn_layer_forward", 22) == 0,
          "another thread's failure left this thread's message: \"%s\"", gpt2attn_last_error());
  }
  CHECK_ERR(gpt2attn_layer_extend(layer, cache, s, xa, 2, y, 100000, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "threads");
  {
    /* A context length near INT64_MAX wrapped the layer's sizes and forward wrote past its workspace. */
    gpt2attn_config_t huge = gpt2attn_config_init();
    CHECK_OK(gpt2attn_config_preset("gpt2-small", &huge));
    gpt2attn_layer_t* none = UNSET_LAYER; /* not NULL: a create that wrote NULL on failure would show */
    huge.context_length = INT64_MAX;
    CHECK_ERR(gpt2attn_layer_create_random(&huge, 1, &none), GPT2ATTN_ERR_INVALID_ARGUMENT, "context_length");
    huge.context_length = (int64_t)1 << 62;
    CHECK_ERR(gpt2attn_layer_create_random(&huge, 1, &none), GPT2ATTN_ERR_INVALID_ARGUMENT, "context_length");
    CHECK(none == UNSET_LAYER, "a failed create left *out as it was");
  }
  {
    /* A size whose byte count overflows int64 can never be satisfied: INVALID_ARGUMENT naming the size, not the
     * OUT_OF_MEMORY a server reads as "retry later". */
    size_t bytes = 12345;
    CHECK_ERR(gpt2attn_layer_forward(layer, xa, INT64_MAX, 2, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "overflows");
    CHECK_ERR(gpt2attn_layer_reserve_bytes(layer, 0, INT64_MAX, 0, &bytes), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "overflows");
    CHECK(bytes == 12345, "a refused reserve_bytes left *out as it was");
    CHECK_ERR(gpt2attn_layer_reserve(layer, 0, INT64_MAX, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, "overflows");
    CHECK_ERR(gpt2attn_layer_decode(layer, cache, &s, INT64_MAX, xa, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
              "overflows");
    CHECK(untouched(y, PROMPT_A * E), "outputs untouched by impossible sizes");
  }

  /* Unknown and released sequence ids: refused, naming the id; the cache is unchanged. */
  const gpt2attn_seq_t unknown = 987654;
  CHECK_ERR(gpt2attn_layer_decode(layer, cache, &unknown, 1, xa, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "987654");
  CHECK_ERR(gpt2attn_layer_extend(layer, cache, unknown, xa, 2, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "987654");
  int64_t n = 0;
  CHECK_ERR(gpt2attn_seq_length(cache, unknown, &n), GPT2ATTN_ERR_INVALID_ARGUMENT, "987654");
  CHECK_OK(gpt2attn_layer_extend(layer, cache, s, xa, 2, y, 0, NULL));
  const gpt2attn_seq_t twice[2] = {s, s};
  float y2[2 * E];
  set_sentinel(y2, 2 * E);
  CHECK(gpt2attn_layer_decode(layer, cache, twice, 2, xa, y2, 0, NULL) == GPT2ATTN_ERR_INVALID_ARGUMENT,
        "one sequence twice in a decode batch is refused (%s)", gpt2attn_last_error());
  CHECK(untouched(y2, 2 * E) && seq_len(cache, s) == 2, "duplicate decode wrote nothing");
  CHECK_OK(gpt2attn_seq_release(cache, s));
  char id[32];
  snprintf(id, sizeof id, "%lld", (long long)s);
  set_sentinel(y, E);
  CHECK_ERR(gpt2attn_layer_decode(layer, cache, &s, 1, xa, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT, id);
  CHECK_ERR(gpt2attn_seq_release(cache, s), GPT2ATTN_ERR_INVALID_ARGUMENT, id);
  CHECK(untouched(y, E), "decode of a released sequence wrote nothing");

  /* A bad file is BAD_FILE naming the path; *out stays as it was. */
  gpt2attn_layer_t* none = UNSET_LAYER;
  CHECK_ERR(gpt2attn_layer_load_safetensors("/nonexistent/model.safetensors", "h.0.attn.", 12, 1024, &none),
            GPT2ATTN_ERR_BAD_FILE, "/nonexistent/model.safetensors");
  CHECK(none == UNSET_LAYER, "a failed load left *out as it was");
  /* A message longer than the library's buffer (a path of 10000 characters) keeps its start and the reason at
   * its end. */
  static char long_path[10001];
  memset(long_path, 'p', sizeof long_path - 1);
  long_path[0] = '/';
  CHECK_ERR(gpt2attn_layer_load_safetensors(long_path, "", 12, 1024, &none), GPT2ATTN_ERR_BAD_FILE, " ... ");
  const char* msg = gpt2attn_last_error();
  CHECK(strncmp(msg, "gpt2attn_layer_load_safetensors: /ppp", 37) == 0, "long message keeps its start: %.60s", msg);
  const char* reason = ": cannot open: File name too long";
  CHECK(strlen(msg) > strlen(reason) && strcmp(msg + strlen(msg) - strlen(reason), reason) == 0,
        "long message keeps its reason at the end: ...%s", msg + (strlen(msg) > 80 ? strlen(msg) - 80 : 0));
  gpt2attn_kv_cache_destroy(cache);
}

/* A sequence may not grow past context_length, by extend or by decode; the refused call changes nothing. */
static void test_context_limit(gpt2attn_layer_t* layer) {
  gpt2attn_kv_cache_t* cache = NULL;
  CHECK_OK(gpt2attn_kv_cache_create(layer, BLOCK, 64, &cache));
  gpt2attn_seq_t s = -1;
  CHECK_OK(gpt2attn_seq_create(cache, &s));
  float x[(CTX + 1) * E], y[(CTX + 1) * E];
  fill(x, (CTX + 1) * E, 7);
  CHECK_ERR(gpt2attn_layer_extend(layer, cache, s, x, CTX + 1, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "context_length");
  CHECK_OK(gpt2attn_layer_extend(layer, cache, s, x, CTX - 2, y, 0, NULL));
  /* Admission control: 14 tokens fill blocks of 4 up to 4 + 4 + 4 + 2, so 2 more fit in the last block. */
  int64_t need = -1;
  CHECK_OK(gpt2attn_seq_blocks_needed(cache, s, 2, &need));
  CHECK(need == 0, "2 tokens into a half-full last block need %lld blocks", (long long)need);
  CHECK_ERR(gpt2attn_seq_blocks_needed(cache, s, 3, &need), GPT2ATTN_ERR_INVALID_ARGUMENT, "context_length");
  CHECK_ERR(gpt2attn_seq_blocks_needed(cache, s, -1, &need), GPT2ATTN_ERR_INVALID_ARGUMENT, "tokens");
  gpt2attn_seq_t fresh = -1;
  CHECK_OK(gpt2attn_seq_create(cache, &fresh));
  CHECK_OK(gpt2attn_seq_blocks_needed(cache, fresh, 5, &need));
  CHECK(need == 2, "5 tokens of a new sequence need %lld blocks of 4", (long long)need);
  CHECK_OK(gpt2attn_seq_release(cache, fresh));
  set_sentinel(y, (CTX + 1) * E);
  CHECK_ERR(gpt2attn_layer_extend(layer, cache, s, x, 3, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "context_length");
  CHECK(seq_len(cache, s) == CTX - 2 && untouched(y, (CTX + 1) * E), "refused extend changed nothing");
  CHECK_OK(gpt2attn_layer_extend(layer, cache, s, x, 2, y, 0, NULL));
  CHECK(seq_len(cache, s) == CTX, "filled to context_length");
  set_sentinel(y, E);
  CHECK_ERR(gpt2attn_layer_decode(layer, cache, &s, 1, x, y, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "context_length");
  CHECK(seq_len(cache, s) == CTX && untouched(y, E), "refused decode changed nothing");
  gpt2attn_kv_cache_destroy(cache);
}

/* A pool of 4 blocks (16 tokens) holds A (7 tokens, 2 blocks) and B (5 tokens, 2 blocks) and nothing more:
 * the step that needs a fifth block fails with OUT_OF_MEMORY, writes nothing, and B alone still decodes to
 * the values the unconstrained run gave. Releasing A makes room again. */
static void test_pool_exhaustion(gpt2attn_layer_t* layer, const float* xa, const float* xb, const float* ref_a,
                                 const float* ref_b) {
  gpt2attn_kv_cache_t* cache = NULL;
  CHECK_OK(gpt2attn_kv_cache_create(layer, BLOCK, 4 * BLOCK, &cache));
  if (!cache) return;
  gpt2attn_seq_t a = -1, b = -1;
  CHECK_OK(gpt2attn_seq_create(cache, &a));
  CHECK_OK(gpt2attn_seq_create(cache, &b));
  float y[PROMPT_A * E];
  CHECK_OK(gpt2attn_layer_extend(layer, cache, a, xa, PROMPT_A, y, 0, NULL));
  CHECK_OK(gpt2attn_layer_extend(layer, cache, b, xb, PROMPT_B, y, 0, NULL));
  int64_t free_blocks = -1;
  CHECK_OK(gpt2attn_kv_cache_stats(cache, NULL, NULL, &free_blocks, NULL));
  CHECK(free_blocks == 0, "pool full after prefill: %lld free", (long long)free_blocks);

  /* Step 0 fits (A goes to 8 tokens, B to 6, both inside their second block). */
  const gpt2attn_seq_t seqs[2] = {a, b};
  float x[2 * E], out[2 * E];
  memcpy(x, xa + PROMPT_A * E, sizeof(float) * E);
  memcpy(x + E, xb + PROMPT_B * E, sizeof(float) * E);
  CHECK_OK(gpt2attn_layer_decode(layer, cache, seqs, 2, x, out, 0, NULL));
  check_rows("full pool, step 0, A", out, ref_a + PROMPT_A * E, E);
  check_rows("full pool, step 0, B", out + E, ref_b + PROMPT_B * E, E);

  /* Step 1 needs a new block for A: refused as a whole. */
  memcpy(x, xa + (PROMPT_A + 1) * E, sizeof(float) * E);
  memcpy(x + E, xb + (PROMPT_B + 1) * E, sizeof(float) * E);
  set_sentinel(out, 2 * E);
  gpt2attn_status_t st = gpt2attn_layer_decode(layer, cache, seqs, 2, x, out, 0, NULL);
  CHECK(st == GPT2ATTN_ERR_OUT_OF_MEMORY, "exhausted pool: %s (%s)", gpt2attn_status_string(st),
        gpt2attn_last_error());
  CHECK(strstr(gpt2attn_last_error(), "block") != NULL, "message names the pool's blocks: \"%s\"",
        gpt2attn_last_error());
  CHECK(untouched(out, 2 * E) && seq_len(cache, a) == PROMPT_A + 1 && seq_len(cache, b) == PROMPT_B + 1,
        "refused decode changed nothing");

  /* A new sequence cannot start either. */
  gpt2attn_seq_t c = -1;
  CHECK_OK(gpt2attn_seq_create(cache, &c));
  CHECK(gpt2attn_layer_extend(layer, cache, c, xa, 1, y, 0, NULL) == GPT2ATTN_ERR_OUT_OF_MEMORY,
        "extend into a full pool (%s)", gpt2attn_last_error());
  CHECK(seq_len(cache, c) == 0, "refused extend appended nothing");

  /* B alone still fits and gives the same values as the unconstrained run. */
  CHECK_OK(gpt2attn_layer_decode(layer, cache, &b, 1, x + E, out, 0, NULL));
  check_rows("B after the refused step", out, ref_b + (PROMPT_B + 1) * E, E);

  /* Releasing A returns its 2 blocks; the new sequence now fits. */
  CHECK_OK(gpt2attn_seq_release(cache, a));
  CHECK_OK(gpt2attn_kv_cache_stats(cache, NULL, NULL, &free_blocks, NULL));
  CHECK(free_blocks == 2, "release returned A's blocks: %lld free", (long long)free_blocks);
  CHECK_OK(gpt2attn_layer_extend(layer, cache, c, xa, PROMPT_A, y, 0, NULL));
  check_rows("new sequence after release", y, ref_a, PROMPT_A * E);
  gpt2attn_kv_cache_destroy(cache);
}

/* Explicit torch-layout arrays: with Q = K = 0 every causal key gets the same weight, so with W_v = I,
 * W_o = I and b_v = b_o = 0 row t of the output is the mean of x[0..t]; b_v then lands as a constant shift.
 * This pins in_proj_weight's row order ([W_q; W_k; W_v]) and the bias slices. */
static void test_explicit_weights(void) {
  enum { e = 8, h = 2, t = 3 };
  gpt2attn_config_t c = config_of(e, h, 8, 1, 1, 0);
  static float w_in[3 * e * e], b_in[3 * e], w_out[e * e], b_out[e];
  for (int i = 0; i < e; ++i) {
    w_in[(2 * e + i) * e + i] = 1.0f; /* W_v = I */
    w_out[i * e + i] = 1.0f;
    b_in[2 * e + i] = 0.5f; /* b_v */
    b_out[i] = 0.25f;
  }
  gpt2attn_layer_t* layer = NULL;
  CHECK_ERR(gpt2attn_layer_create(&c, w_in, NULL, w_out, b_out, &layer), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "in_proj_bias");
  CHECK_OK(gpt2attn_layer_create(&c, w_in, b_in, w_out, b_out, &layer));
  if (!layer) return;
  float x[t * e], y[t * e], want[t * e];
  fill(x, t * e, 3);
  for (int r = 0; r < t; ++r) {
    for (int i = 0; i < e; ++i) {
      float sum = 0.0f;
      for (int k = 0; k <= r; ++k) sum += x[k * e + i];
      want[r * e + i] = sum / (float)(r + 1) + 0.5f + 0.25f;
    }
  }
  CHECK_OK(gpt2attn_layer_forward(layer, x, 1, t, y, 1, NULL));
  check_rows("explicit weights: causal mean of x + b_v + b_o", y, want, t * e);
  gpt2attn_layer_destroy(layer);
}

/* Engine options from C: bf16 compute, a scalar cap and one thread on explicit weights (W_v = I, so row r is the
 * causal mean of x plus the biases, within bf16's rounding of x, W and the context); NULL for the defaults; every bad
 * field refused by name, with *out untouched. */
static void test_engine_options(void) {
  enum { e = 8, h = 2, t = 3 };
  gpt2attn_config_t c = config_of(e, h, 8, 1, 1, 0);
  static float w_in[3 * e * e], b_in[3 * e], w_out[e * e], b_out[e];
  for (int i = 0; i < e; ++i) {
    w_in[(2 * e + i) * e + i] = 1.0f;
    w_out[i * e + i] = 1.0f;
    b_in[2 * e + i] = 0.5f;
    b_out[i] = 0.25f;
  }
  gpt2attn_engine_options_t o = gpt2attn_engine_options_init();
  o.compute = "bf16";
  o.isa = "scalar";
  o.threads = 1;
  gpt2attn_layer_t* layer = NULL;
  CHECK_OK(gpt2attn_layer_create_with(&c, w_in, b_in, w_out, b_out, &o, &layer));
  if (!layer) return;
  const char *isa = NULL, *impl = NULL;
  CHECK_OK(gpt2attn_layer_describe(layer, &isa, &impl));
  CHECK(isa && strcmp(isa, "scalar") == 0, "options.isa = scalar: the layer runs at %s", isa ? isa : "(null)");
  CHECK(impl && strstr(impl, "bf16") != NULL, "options.compute = bf16: the layer runs %s", impl ? impl : "(null)");
  float x[t * e], y[t * e];
  fill(x, t * e, 3);
  CHECK_OK(gpt2attn_layer_forward(layer, x, 1, t, y, 0, NULL));
  double worst = 0;
  for (int r = 0; r < t; ++r) {
    for (int i = 0; i < e; ++i) {
      double sum = 0;
      for (int k = 0; k <= r; ++k) sum += x[k * e + i];
      const double want = sum / (r + 1) + 0.75;
      const double err = fabs(y[r * e + i] - want);
      worst = err > worst ? err : worst;
    }
  }
  CHECK(worst <= 0x1p-6 * 4, "bf16 layer: worst error %.3g against the causal mean", worst);
  gpt2attn_layer_destroy(layer);

  layer = NULL;
  CHECK_OK(gpt2attn_layer_create_random_with(&c, 7, NULL, &layer));
  CHECK_OK(gpt2attn_layer_describe(layer, NULL, &impl));
  CHECK(impl && strstr(impl, "kernels f32") != NULL, "NULL options: f32 compute, got %s", impl ? impl : "(null)");
  gpt2attn_layer_destroy(layer);

  /* The field appended after the first release: quantized weights, named in the implementation. */
  layer = NULL;
  o = gpt2attn_engine_options_init();
  o.weights = "int4";
  CHECK_OK(gpt2attn_layer_create_random_with(&c, 7, &o, &layer));
  if (layer) {
    CHECK_OK(gpt2attn_layer_describe(layer, NULL, &impl));
    CHECK(impl && strstr(impl, "int4 weights") != NULL, "options.weights = int4: the layer runs %s",
          impl ? impl : "(null)");
    gpt2attn_layer_destroy(layer);
  }

  gpt2attn_layer_t* untouched_layer = (gpt2attn_layer_t*)&o; /* any non-NULL value: must survive each failure */
  layer = untouched_layer;
  o = gpt2attn_engine_options_init();
  o.compute = "f16";
  CHECK_ERR(gpt2attn_layer_create_random_with(&c, 7, &o, &layer), GPT2ATTN_ERR_INVALID_ARGUMENT, "f16");
  o = gpt2attn_engine_options_init();
  o.weights = "int3";
  CHECK_ERR(gpt2attn_layer_create_random_with(&c, 7, &o, &layer), GPT2ATTN_ERR_INVALID_ARGUMENT, "int3");
  o = gpt2attn_engine_options_init();
  o.isa = "sse9";
  CHECK_ERR(gpt2attn_layer_create_random_with(&c, 7, &o, &layer), GPT2ATTN_ERR_INVALID_ARGUMENT, "sse9");
  o = gpt2attn_engine_options_init();
  o.threads = -1;
  CHECK_ERR(gpt2attn_layer_create_random_with(&c, 7, &o, &layer), GPT2ATTN_ERR_INVALID_ARGUMENT, "threads");
  o = gpt2attn_engine_options_init();
  o.struct_size = 0;
  CHECK_ERR(gpt2attn_layer_create_random_with(&c, 7, &o, &layer), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "options.struct_size");
  CHECK_ERR(gpt2attn_layer_load_safetensors_with("/nonexistent.safetensors", NULL, 2, 8, NULL, &layer),
            GPT2ATTN_ERR_BAD_FILE, "gpt2attn_layer_load_safetensors_with: /nonexistent.safetensors");
  CHECK(layer == untouched_layer, "a failed create wrote *out");
}

/* bfloat16 as C holds it: the high half of a float32, rounded to nearest even. */
static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static float from_bf16(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* gpt2attn_layer_forward_typed: bf16 activations in (either compute type) and out (a bf16 layer), read and written
 * in place; against the f32 calls on the same values. */
static void test_forward_typed(void) {
  enum { b = 2, t = 5 };
  gpt2attn_config_t c = config_of(E, H, CTX, 1, 1, 0);
  gpt2attn_engine_options_t o = gpt2attn_engine_options_init();
  gpt2attn_layer_t *f32 = NULL, *bf16 = NULL;
  CHECK_OK(gpt2attn_layer_create_random_with(&c, 11, NULL, &f32));
  o.compute = "bf16";
  CHECK_OK(gpt2attn_layer_create_random_with(&c, 11, &o, &bf16));
  if (!f32 || !bf16) return;
  static float x[b * t * E], xw[b * t * E], y[b * t * E], want[b * t * E];
  static uint16_t xb[b * t * E], yb[b * t * E];
  fill(x, b * t * E, 5);
  for (int i = 0; i < b * t * E; ++i) {
    xb[i] = to_bf16(x[i]);
    xw[i] = from_bf16(xb[i]);
  }
  /* A bf16 x is its values widened exactly: the same output as the f32 call on them. */
  CHECK_OK(gpt2attn_layer_forward(f32, xw, b, t, want, 0, NULL));
  CHECK_OK(gpt2attn_layer_forward_typed(f32, xb, "bf16", b, t, y, NULL, 0, NULL));
  CHECK(memcmp(y, want, sizeof y) == 0, "f32 layer: a bf16 x differs from its widened f32 values");
  /* A bf16 layer writes bf16: its f32 output rounded once (within one bf16 step: the GEMM may sum in another order). */
  CHECK_OK(gpt2attn_layer_forward(bf16, x, b, t, want, 0, NULL));
  CHECK_OK(gpt2attn_layer_forward_typed(bf16, x, "f32", b, t, yb, "bf16", 0, NULL));
  double worst = 0;
  for (int i = 0; i < b * t * E; ++i) {
    const double err = fabs(from_bf16(yb[i]) - want[i]) / (fabs(want[i]) + 1e-3);
    worst = err > worst ? err : worst;
  }
  CHECK(worst <= 0x1p-7, "bf16 layer: bf16 out is %.3g (relative) from its f32 out", worst);
  /* Refusals name the argument and write nothing. */
  for (int i = 0; i < b * t * E; ++i) y[i] = SENTINEL;
  CHECK_ERR(gpt2attn_layer_forward_typed(f32, x, NULL, b, t, y, "bf16", 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "bf16");
  CHECK_ERR(gpt2attn_layer_forward_typed(f32, x, "f16", b, t, y, NULL, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "x_dtype 'f16'");
  CHECK_ERR(gpt2attn_layer_forward_typed(f32, x, NULL, b, t, y, "i8", 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "out_dtype 'i8'");
  CHECK_ERR(gpt2attn_layer_forward_typed(f32, NULL, NULL, b, t, y, NULL, 0, NULL), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "x is NULL");
  CHECK(y[0] == SENTINEL && y[b * t * E - 1] == SENTINEL, "a failed forward_typed wrote out");
  gpt2attn_layer_destroy(f32);
  gpt2attn_layer_destroy(bf16);
}

/* Multi-query (num_kv_heads = 1): in_proj_weight is (E + 2 KW, E) with KW = D = 4. With Q = K = 0 and W_v taking
 * x[0..4), both query heads read the one K/V head, so row t is [mean x[0..t][0..4) twice] + b_v + b_o. */
static void test_grouped_kv_heads(void) {
  enum { e = 8, h = 2, d = 4, t = 3 };
  gpt2attn_config_t c = config_of(e, h, 8, 0, 1, 3);
  gpt2attn_layer_t* layer = NULL;
  static float w_in[(e + 2 * d) * e], w_out[e * e], b_out[e];
  CHECK_ERR(gpt2attn_layer_create_random(&c, 1, &layer), GPT2ATTN_ERR_INVALID_ARGUMENT, "num_kv_heads");
  c.num_kv_heads = 1;
  for (int i = 0; i < d; ++i) w_in[(e + d + i) * e + i] = 1.0f; /* W_v rows: x[0..4) */
  for (int i = 0; i < e; ++i) {
    w_out[i * e + i] = 1.0f;
    b_out[i] = 0.25f;
  }
  CHECK_OK(gpt2attn_layer_create(&c, w_in, NULL, w_out, b_out, &layer));
  if (!layer) return;
  gpt2attn_config_t back = gpt2attn_config_init();
  CHECK_OK(gpt2attn_layer_config(layer, &back));
  CHECK(back.num_kv_heads == 1, "layer_config reports num_kv_heads = 1");
  float x[t * e], y[t * e], want[t * e];
  fill(x, t * e, 4);
  for (int r = 0; r < t; ++r) {
    for (int i = 0; i < e; ++i) {
      float sum = 0.0f;
      for (int k = 0; k <= r; ++k) sum += x[k * e + i % d];
      want[r * e + i] = sum / (float)(r + 1) + 0.25f;
    }
  }
  CHECK_OK(gpt2attn_layer_forward(layer, x, 1, t, y, 1, NULL));
  check_rows("multi-query: both heads read the one K/V head", y, want, t * e);
  gpt2attn_layer_destroy(layer);
}

/* bf16 and int8 caches through the options struct: half (bf16) and a quarter plus the scales (i8) of an f32
 * block's bytes, the same outputs within storage rounding, and bad options refused by name. */
static void test_bf16_cache(gpt2attn_layer_t* layer, const float* xa) {
  gpt2attn_kv_cache_options_t o = gpt2attn_kv_cache_options_init();
  o.block_tokens = BLOCK;
  o.capacity_tokens = 64;
  gpt2attn_kv_cache_t *f32 = NULL, *bf = NULL, *q8 = NULL;
  CHECK_OK(gpt2attn_kv_cache_create_with(layer, &o, &f32));
  o.kv_dtype = "bf16";
  CHECK_OK(gpt2attn_kv_cache_create_with(layer, &o, &bf));
  o.kv_dtype = "int8";  /* the CLI's and the Python module's name, taken too */
  gpt2attn_kv_cache_t* q8_alias = NULL;
  CHECK_OK(gpt2attn_kv_cache_create_with(layer, &o, &q8_alias));
  gpt2attn_kv_cache_destroy(q8_alias);
  o.kv_dtype = "i8";
  CHECK_OK(gpt2attn_kv_cache_create_with(layer, &o, &q8));
  /* fp8 (e4m3): a quarter of the bytes plus a scale per row, as int8 */
  gpt2attn_kv_cache_t* f8 = NULL;
  o.kv_dtype = "fp8";
  CHECK_OK(gpt2attn_kv_cache_create_with(layer, &o, &f8));
  if (f8) {
    uint64_t f32b = 0, f8b = 0;
    const char* f8t = NULL;
    uint64_t q8b = 0;
    CHECK_OK(gpt2attn_kv_cache_bytes(f32, &f32b, NULL, NULL));
    CHECK_OK(gpt2attn_kv_cache_bytes(f8, &f8b, NULL, &f8t));
    CHECK_OK(gpt2attn_kv_cache_bytes(q8, &q8b, NULL, NULL));
    CHECK(f8b == q8b && 4 * f8b > f32b && 3 * f8b < f32b && f8t && strcmp(f8t, "fp8") == 0,
          "fp8 blocks are int8's size, a quarter of f32's plus the scales (%llu vs %llu, int8 %llu), dtype %s",
          (unsigned long long)f8b, (unsigned long long)f32b, (unsigned long long)q8b, f8t ? f8t : "(null)");
    gpt2attn_kv_cache_destroy(f8);
  }
  if (!f32 || !bf || !q8) return;
  uint64_t fb = 0, bb = 0, qb = 0;
  const char *dt = NULL, *qt = NULL;
  CHECK_OK(gpt2attn_kv_cache_bytes(f32, &fb, NULL, NULL));
  CHECK_OK(gpt2attn_kv_cache_bytes(bf, &bb, NULL, &dt));
  CHECK_OK(gpt2attn_kv_cache_bytes(q8, &qb, NULL, &qt));
  CHECK(fb == 2 * bb && dt && strcmp(dt, "bf16") == 0, "bf16 blocks are half the bytes (%llu vs %llu), dtype %s",
        (unsigned long long)bb, (unsigned long long)fb, dt ? dt : "(null)");
  /* i8: 2 * H * BLOCK * D bytes of rows and 2 * H * BLOCK f32 scales */
  CHECK(qb == fb / 4 + 2 * H * BLOCK * 4 && qt && strcmp(qt, "i8") == 0, "i8 blocks are %llu bytes (f32 %llu), dtype %s",
        (unsigned long long)qb, (unsigned long long)fb, qt ? qt : "(null)");
  gpt2attn_seq_t a = -1, b = -1, c = -1;
  CHECK_OK(gpt2attn_seq_create(f32, &a));
  CHECK_OK(gpt2attn_seq_create(bf, &b));
  CHECK_OK(gpt2attn_seq_create(q8, &c));
  float ya[PROMPT_A * E], yb[PROMPT_A * E], yc[PROMPT_A * E];
  CHECK_OK(gpt2attn_layer_extend(layer, f32, a, xa, PROMPT_A, ya, 1, NULL));
  CHECK_OK(gpt2attn_layer_extend(layer, bf, b, xa, PROMPT_A, yb, 1, NULL));
  CHECK_OK(gpt2attn_layer_extend(layer, q8, c, xa, PROMPT_A, yc, 1, NULL));
  double worst = 0, worst8 = 0;
  for (int i = 0; i < PROMPT_A * E; ++i) worst = fmax(worst, fabs((double)ya[i] - (double)yb[i]));
  for (int i = 0; i < PROMPT_A * E; ++i) worst8 = fmax(worst8, fabs((double)ya[i] - (double)yc[i]));
  CHECK(worst > 0 && worst < 1e-2, "bf16 cache outputs within storage rounding of f32 ones (max diff %.3g)", worst);
  CHECK(worst8 > 0 && worst8 < 5e-2, "i8 cache outputs within quantisation of f32 ones (max diff %.3g)", worst8);
  gpt2attn_kv_cache_destroy(f32);
  gpt2attn_kv_cache_destroy(bf);
  gpt2attn_kv_cache_destroy(q8);

  gpt2attn_kv_cache_t* bad = NULL;
  o.kv_dtype = "u8";
  CHECK_ERR(gpt2attn_kv_cache_create_with(layer, &o, &bad), GPT2ATTN_ERR_INVALID_ARGUMENT, "KvCacheOptions.dtype");
  o.kv_dtype = "f64";
  CHECK_ERR(gpt2attn_kv_cache_create_with(layer, &o, &bad), GPT2ATTN_ERR_INVALID_ARGUMENT, "f64");
  o.kv_dtype = NULL;
  o.struct_size = 8;
  CHECK_ERR(gpt2attn_kv_cache_create_with(layer, &o, &bad), GPT2ATTN_ERR_INVALID_ARGUMENT, "struct_size");
  o.struct_size = sizeof o;
  o.capacity_bytes = 1 << 20; /* both capacities set */
  CHECK_ERR(gpt2attn_kv_cache_create_with(layer, &o, &bad), GPT2ATTN_ERR_INVALID_ARGUMENT, "exactly one");
  CHECK(bad == NULL, "a refused create writes no handle");
}

/* The struct_size rule (ABI policy in gpt2attn.h), seen from callers compiled against other headers. A newer header
 * is modelled by a struct with one more int64_t field after ours: accepted while that field is 0 (its default),
 * refused once set; a struct the library fills gets the field zeroed. A missing or wild struct_size is refused, and
 * a refused call writes nothing. (An older, shorter struct cannot be made yet: these are the first versions.) */
static void test_struct_size(gpt2attn_layer_t* layer) {
  struct newer_config {
    gpt2attn_config_t base;
    int64_t future;
  } newer;
  memset(&newer, 0, sizeof newer);
  newer.base = config_of(E, H, CTX, 1, 1, 0);
  newer.base.struct_size = sizeof newer;
  gpt2attn_layer_t* made = NULL;
  CHECK_OK(gpt2attn_layer_create_random(&newer.base, 7, &made));
  gpt2attn_layer_destroy(made);
  made = NULL;
  newer.future = 1;
  CHECK_ERR(gpt2attn_layer_create_random(&newer.base, 7, &made), GPT2ATTN_ERR_INVALID_ARGUMENT, "newer gpt2attn.h");
  CHECK(made == NULL, "no layer from a config with an unknown field set");

  newer.future = 77;
  newer.base.d_model = 1;
  CHECK_OK(gpt2attn_layer_config(layer, &newer.base));
  CHECK(newer.base.d_model == E && newer.base.struct_size == sizeof newer && newer.future == 0,
        "layer_config into a newer struct: d_model %lld, struct_size %u, unknown field %lld",
        (long long)newer.base.d_model, newer.base.struct_size, (long long)newer.future);

  gpt2attn_config_t c = config_of(E, H, CTX, 1, 1, 0);
  c.struct_size = 0; /* forgotten */
  CHECK_ERR(gpt2attn_layer_create_random(&c, 7, &made), GPT2ATTN_ERR_INVALID_ARGUMENT, "config.struct_size is 0");
  c.struct_size = 1u << 20; /* garbage */
  CHECK_ERR(gpt2attn_layer_create_random(&c, 7, &made), GPT2ATTN_ERR_INVALID_ARGUMENT, "sizeof(gpt2attn_config_t)");
  c.struct_size = 8;
  c.d_model = 1;
  CHECK_ERR(gpt2attn_config_preset("gpt2-small", &c), GPT2ATTN_ERR_INVALID_ARGUMENT, "out.struct_size is 8");
  CHECK_ERR(gpt2attn_layer_config(layer, &c), GPT2ATTN_ERR_INVALID_ARGUMENT, "out.struct_size");
  CHECK(c.d_model == 1 && c.struct_size == 8, "a refused fill wrote nothing");
  CHECK(made == NULL, "no layer from a bad struct_size");

  struct newer_options {
    gpt2attn_kv_cache_options_t base;
    int64_t future;
  } opt;
  memset(&opt, 0, sizeof opt);
  opt.base = gpt2attn_kv_cache_options_init();
  opt.base.struct_size = sizeof opt;
  opt.base.capacity_tokens = 16;
  gpt2attn_kv_cache_t* cache = NULL;
  CHECK_OK(gpt2attn_kv_cache_create_with(layer, &opt.base, &cache));
  gpt2attn_kv_cache_destroy(cache);
  cache = NULL;
  opt.future = -1;
  CHECK_ERR(gpt2attn_kv_cache_create_with(layer, &opt.base, &cache), GPT2ATTN_ERR_INVALID_ARGUMENT,
            "options.struct_size");
  CHECK(cache == NULL, "no pool from options with an unknown field set");
}

int main(void) {
  gpt2attn_config_t cfg = config_of(E, H, CTX, 1, 1, 0);
  gpt2attn_layer_t* layer = NULL;
  if (gpt2attn_layer_create_random(&cfg, 1234, &layer) != GPT2ATTN_OK) {
    fprintf(stderr, "cannot create the layer: %s\n0 passed, 1 failed\n", gpt2attn_last_error());
    return 1;
  }
  static float xa[LEN_A * E], xb[LEN_B * E], ref_a[LEN_A * E], ref_b[LEN_B * E];
  fill(xa, LEN_A * E, 1);
  fill(xb, LEN_B * E, 2);

  test_library(layer);
  test_prefill_decode(layer, xa, xb, ref_a, ref_b);
  test_step(layer);
  test_argument_errors(layer, xa);
  test_context_limit(layer);
  test_pool_exhaustion(layer, xa, xb, ref_a, ref_b);
  test_explicit_weights();
  test_engine_options();
  test_forward_typed();
  test_grouped_kv_heads();
  test_bf16_cache(layer, xa);
  test_struct_size(layer);
  gpt2attn_layer_destroy(layer);

  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
