/* tests/c/test_model_c_api.c: the model library's C API (gpt2attn_model.h) from C99, linked to libgpt2attn_model.so:
 * a checkpoint directory (argv[1], which ctest's fixture writes with scripts/make_gpt2_checkpoint.py) opened, its
 * logits causal and finite, greedy generation equal to the argmax of the model's own teacher-forced logits, stop ids,
 * and the error contract (status, message in gpt2attn_model_last_error(), nothing written) for a bad id, a NULL
 * handle, a missing directory and bad options. */
#include <gpt2attn/gpt2attn_model.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROMPT 5
#define NEW 8
#define T_FULL 16
#define SENTINEL 12345.0f

static int g_passed, g_failed;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (cond) {                                            \
      ++g_passed;                                          \
    } else {                                               \
      ++g_failed;                                          \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fputc('\n', stderr);                                 \
    }                                                      \
  } while (0)

#define CHECK_OK(call)                                                                                         \
  do {                                                                                                         \
    gpt2attn_status_t st_ = (call);                                                                            \
    CHECK(st_ == GPT2ATTN_OK, "%s -> %s: %s", #call, gpt2attn_status_string(st_), gpt2attn_model_last_error()); \
  } while (0)

/* A call that must fail with `status` and a model last-error message containing `needle`. */
#define CHECK_ERR(call, status, needle)                                                                      \
  do {                                                                                                       \
    gpt2attn_status_t st_ = (call);                                                                          \
    CHECK(st_ == (status), "%s -> %s, expected %s (%s)", #call, gpt2attn_status_string(st_),                \
          gpt2attn_status_string(status), gpt2attn_model_last_error());                                     \
    CHECK(st_ == GPT2ATTN_OK || strstr(gpt2attn_model_last_error(), (needle)) != NULL,                       \
          "%s: message \"%s\" does not mention \"%s\"", #call, gpt2attn_model_last_error(), (needle));       \
  } while (0)

static int argmax(const float* row, int64_t n) {
  int64_t best = 0, i;
  for (i = 1; i < n; ++i) {
    if (row[i] > row[best]) best = i;
  }
  return (int)best;
}

static double max_abs(const float* x, size_t n) {
  double m = 0.0;
  size_t i;
  for (i = 0; i < n; ++i) m = fabs((double)x[i]) > m ? fabs((double)x[i]) : m;
  return m;
}

int main(int argc, char** argv) {
  gpt2attn_model_t* model = NULL;
  gpt2attn_model_t* unset = NULL;
  gpt2attn_gpt2_config_t cfg = gpt2attn_gpt2_config_init();
  gpt2attn_generate_options_t gen = gpt2attn_generate_options_init();
  gpt2attn_model_options_t opts = gpt2attn_model_options_init();
  int32_t ids[T_FULL], out_ids[NEW], seq[PROMPT + NEW];
  int64_t V, n_out = -1, i;
  int finish = 0;
  float *full, *prefix;
  char missing[4096];

  if (argc != 2) {
    fprintf(stderr, "usage: %s CHECKPOINT_DIR (scripts/make_gpt2_checkpoint.py writes one)\n", argv[0]);
    return 2;
  }
  CHECK(strcmp(gpt2attn_model_last_error(), "") == 0, "no failure yet, but the message is \"%s\"",
        gpt2attn_model_last_error());

  /* ---- a good model ---- */
  CHECK_OK(gpt2attn_model_open(argv[1], NULL, &model));
  if (model == NULL) return 1;
  CHECK_OK(gpt2attn_model_config(model, &cfg));
  CHECK(cfg.vocab_size > PROMPT + NEW && cfg.n_positions >= T_FULL && cfg.n_layer >= 1 && cfg.n_head >= 1 &&
            cfg.n_embd % cfg.n_head == 0 && cfg.n_inner == 4 * cfg.n_embd && cfg.layer_norm_epsilon > 0.0,
        "config: vocab %lld positions %lld E %lld L %lld H %lld inner %lld", (long long)cfg.vocab_size,
        (long long)cfg.n_positions, (long long)cfg.n_embd, (long long)cfg.n_layer, (long long)cfg.n_head,
        (long long)cfg.n_inner);
  V = cfg.vocab_size;
  for (i = 0; i < T_FULL; ++i) ids[i] = (int32_t)((i * 37 + 11) % V);
  full = malloc(sizeof(float) * (size_t)(T_FULL * V));
  prefix = malloc(sizeof(float) * (size_t)(T_FULL * V));
  if (!full || !prefix) return 1;

  /* Logits: finite, and causal: a prefix's rows are the full sequence's first rows. */
  CHECK_OK(gpt2attn_model_logits(model, ids, T_FULL, full));
  CHECK_OK(gpt2attn_model_logits(model, ids, 7, prefix));
  {
    const double scale = max_abs(full, (size_t)(T_FULL * V));
    double worst = 0.0;
    int finite = 1;
    for (i = 0; i < T_FULL * V; ++i) finite = finite && isfinite(full[i]);
    for (i = 0; i < 7 * V; ++i) {
      const double e = fabs((double)full[i] - (double)prefix[i]);
      worst = e > worst ? e : worst;
    }
    CHECK(finite && scale > 0.0, "logits not finite, or all zero");
    CHECK(worst <= 1e-4 * scale, "a 7-id prefix's logits differ from the full sequence's by %g (max |logit| %g)",
          worst, scale);
  }

  /* Greedy generation: each new id is the argmax (or a near tie) of the teacher-forced logits before it. */
  gen.max_new_tokens = NEW;
  CHECK_OK(gpt2attn_model_generate(model, ids, PROMPT, &gen, out_ids, NEW, &n_out, &finish));
  CHECK(n_out == NEW && finish == GPT2ATTN_FINISH_LENGTH, "n_out %lld finish %d", (long long)n_out, finish);
  memcpy(seq, ids, sizeof(int32_t) * PROMPT);
  memcpy(seq + PROMPT, out_ids, sizeof(int32_t) * NEW);
  CHECK_OK(gpt2attn_model_logits(model, seq, PROMPT + NEW - 1, full));
  {
    const double scale = max_abs(full, (size_t)((PROMPT + NEW - 1) * V));
    for (i = 0; i < NEW; ++i) {
      const float* row = full + (PROMPT - 1 + i) * V;
      const int best = argmax(row, V);
      CHECK((double)row[out_ids[i]] >= (double)row[best] - 1e-4 * scale, "new id %lld is %d, the argmax %d",
            (long long)i, out_ids[i], best);
    }
  }

  /* A stop id ends generation and is returned; NULL options are greedy with 16 new ids. */
  {
    int32_t stop = out_ids[2], got[NEW];
    int64_t first = 0;
    while (out_ids[first] != stop) ++first;
    gen.stop_ids = &stop;
    gen.n_stop = 1;
    CHECK_OK(gpt2attn_model_generate(model, ids, PROMPT, &gen, got, NEW, &n_out, &finish));
    CHECK(n_out == first + 1 && finish == GPT2ATTN_FINISH_STOP &&
              memcmp(got, out_ids, sizeof(int32_t) * (size_t)n_out) == 0,
          "stop: n_out %lld (expected %lld), finish %d", (long long)n_out, (long long)(first + 1), finish);
    gen.stop_ids = NULL;
    gen.n_stop = 0;
  }
  {
    int32_t many[16];
    CHECK_OK(gpt2attn_model_generate(model, ids, PROMPT, NULL, many, 16, &n_out, NULL));
    CHECK(n_out == 16 && memcmp(many, out_ids, sizeof(int32_t) * NEW) == 0, "NULL options: n_out %lld",
          (long long)n_out);
  }

  /* ---- errors: a status, the message, nothing written ---- */
  for (i = 0; i < V; ++i) prefix[i] = SENTINEL;
  ids[3] = (int32_t)V;
  CHECK_ERR(gpt2attn_model_logits(model, ids, 4, prefix), GPT2ATTN_ERR_INVALID_ARGUMENT, "outside the vocabulary");
  CHECK(strncmp(gpt2attn_model_last_error(), "gpt2attn_model_logits: ", 23) == 0, "message \"%s\" names no function",
        gpt2attn_model_last_error());
  CHECK(prefix[0] == SENTINEL && prefix[V - 1] == SENTINEL, "a refused logits call wrote out");
  n_out = -1;
  CHECK_ERR(gpt2attn_model_generate(model, ids, PROMPT, &gen, out_ids, NEW, &n_out, &finish),
            GPT2ATTN_ERR_INVALID_ARGUMENT, "outside the vocabulary");
  CHECK(n_out == -1, "a refused generate wrote n_out");
  ids[3] = 3;
  CHECK_ERR(gpt2attn_model_logits(NULL, ids, 4, prefix), GPT2ATTN_ERR_INVALID_ARGUMENT, "model is NULL");
  CHECK_ERR(gpt2attn_model_logits(model, NULL, 4, prefix), GPT2ATTN_ERR_INVALID_ARGUMENT, "ids is NULL");
  CHECK_ERR(gpt2attn_model_logits(model, ids, 0, prefix), GPT2ATTN_ERR_INVALID_ARGUMENT, "1 <= T <= n_positions");
  CHECK_ERR(gpt2attn_model_config(NULL, &cfg), GPT2ATTN_ERR_INVALID_ARGUMENT, "model is NULL");
  CHECK_ERR(gpt2attn_model_generate(NULL, ids, PROMPT, &gen, out_ids, NEW, &n_out, &finish),
            GPT2ATTN_ERR_INVALID_ARGUMENT, "model is NULL");
  CHECK_ERR(gpt2attn_model_generate(model, ids, PROMPT, &gen, out_ids, NEW - 1, &n_out, &finish),
            GPT2ATTN_ERR_INVALID_ARGUMENT, "capacity is 7 ids; this call can return 8");
  CHECK_ERR(gpt2attn_model_generate(model, ids, cfg.n_positions, &gen, out_ids, NEW, &n_out, &finish),
            GPT2ATTN_ERR_INVALID_ARGUMENT, "prompt ids; expected 1 to n_positions - 1");
  gen.temperature = -1.0f;
  CHECK_ERR(gpt2attn_model_generate(model, ids, PROMPT, &gen, out_ids, NEW, &n_out, &finish),
            GPT2ATTN_ERR_INVALID_ARGUMENT, "temperature");
  gen.temperature = 0.0f;
  gen.struct_size = 0;
  CHECK_ERR(gpt2attn_model_generate(model, ids, PROMPT, &gen, out_ids, NEW, &n_out, &finish),
            GPT2ATTN_ERR_INVALID_ARGUMENT, "options.struct_size is 0");
  gen.struct_size = GPT2ATTN_STRUCT_SIZE(gpt2attn_generate_options_t);
  gpt2attn_model_free(NULL); /* a no-op */

  /* struct_size from a newer header: a longer struct is read when its unknown tail is 0, refused otherwise, and
   * filled with its unknown tail zeroed. */
  {
    struct {
      gpt2attn_generate_options_t g;
      uint64_t newer;
    } longer;
    struct {
      gpt2attn_gpt2_config_t c;
      uint64_t newer;
    } filled;
    memset(&longer, 0, sizeof longer);
    longer.g.struct_size = (uint32_t)sizeof longer;
    longer.g.max_new_tokens = 2;
    CHECK_OK(gpt2attn_model_generate(model, ids, PROMPT, &longer.g, out_ids, NEW, &n_out, &finish));
    CHECK(n_out == 2, "a longer options struct: n_out %lld", (long long)n_out);
    longer.newer = 1;
    CHECK_ERR(gpt2attn_model_generate(model, ids, PROMPT, &longer.g, out_ids, NEW, &n_out, &finish),
              GPT2ATTN_ERR_INVALID_ARGUMENT, "a field of a newer gpt2attn_model.h");
    memset(&filled, 0xff, sizeof filled);
    filled.c.struct_size = (uint32_t)sizeof filled;
    CHECK_OK(gpt2attn_model_config(model, &filled.c));
    CHECK(filled.newer == 0 && filled.c.vocab_size == V && filled.c.struct_size == (uint32_t)sizeof filled,
          "a longer config struct was not filled as the ABI policy says");
  }

  snprintf(missing, sizeof missing, "%s/no-such-dir", argv[1]);
  unset = (gpt2attn_model_t*)(void*)&finish; /* a value no call returns: a failed open must leave it */
  CHECK_ERR(gpt2attn_model_open(missing, NULL, &unset), GPT2ATTN_ERR_BAD_FILE, "no such checkpoint directory");
  CHECK(unset == (gpt2attn_model_t*)(void*)&finish, "a failed open wrote *out");
  CHECK_ERR(gpt2attn_model_open(NULL, NULL, &unset), GPT2ATTN_ERR_INVALID_ARGUMENT, "dir is NULL");
  opts.dtype = "f16";
  CHECK_ERR(gpt2attn_model_open(argv[1], &opts, &unset), GPT2ATTN_ERR_INVALID_ARGUMENT, "options.dtype 'f16'");
  opts.dtype = "bf16";
  opts.weights = "int2";
  CHECK_ERR(gpt2attn_model_open(argv[1], &opts, &unset), GPT2ATTN_ERR_INVALID_ARGUMENT, "options.weights 'int2'");

  /* A bf16 model computes the same logits, coarser. */
  opts.weights = NULL;
  opts.threads = 1;
  {
    gpt2attn_model_t* bf16 = NULL;
    CHECK_OK(gpt2attn_model_open(argv[1], &opts, &bf16));
    if (bf16) {
      const double scale = max_abs(full, (size_t)((PROMPT + NEW - 1) * V));
      double worst = 0.0;
      CHECK_OK(gpt2attn_model_logits(bf16, seq, PROMPT + NEW - 1, prefix));
      for (i = 0; i < (PROMPT + NEW - 1) * V; ++i) {
        const double e = fabs((double)full[i] - (double)prefix[i]);
        worst = e > worst ? e : worst;
      }
      CHECK(worst <= 3e-2 * scale, "bf16 logits differ from f32 by %g (max |logit| %g)", worst, scale);
      gpt2attn_model_free(bf16);
    }
  }

  free(full);
  free(prefix);
  gpt2attn_model_free(model);
  printf("%d checks passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
