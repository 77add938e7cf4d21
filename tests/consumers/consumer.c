/* tests/consumers/consumer.c: the smallest C program against gpt2attn: a layer with random weights, a prompt of three
 * tokens through a KV cache, one decode step. Exit status 0 when every call succeeds. */
#include <gpt2attn/gpt2attn.h>

#include <stdio.h>

int main(void) {
  enum { E = 32, T = 3 };
  float x[(T + 1) * E], y[(T + 1) * E];
  for (int i = 0; i < (T + 1) * E; ++i) x[i] = (float)(i % 7) / 7.0f - 0.5f;
  gpt2attn_config_t cfg = gpt2attn_config_init(); /* struct_size set: see the ABI policy in gpt2attn.h */
  cfg.d_model = E;
  cfg.num_heads = 4;
  cfg.context_length = 8;
  gpt2attn_layer_t* layer = NULL;
  gpt2attn_kv_cache_t* cache = NULL;
  gpt2attn_seq_t seq = 0;
  gpt2attn_status_t st = gpt2attn_layer_create_random(&cfg, 1, &layer);
  if (st == GPT2ATTN_OK) st = gpt2attn_kv_cache_create(layer, 0, 8, &cache);
  if (st == GPT2ATTN_OK) st = gpt2attn_seq_create(cache, &seq);
  if (st == GPT2ATTN_OK) st = gpt2attn_layer_extend(layer, cache, seq, x, T, y, 1, NULL);
  if (st == GPT2ATTN_OK) st = gpt2attn_layer_decode(layer, cache, &seq, 1, x + T * E, y + T * E, 1, NULL);
  printf("consumer_c: gpt2attn %s (header %d.%d.%d): %s\n", gpt2attn_version(), GPT2ATTN_VERSION_MAJOR,
         GPT2ATTN_VERSION_MINOR, GPT2ATTN_VERSION_PATCH, st == GPT2ATTN_OK ? "ok" : gpt2attn_last_error());
  gpt2attn_kv_cache_destroy(cache);
  gpt2attn_layer_destroy(layer);
  return st == GPT2ATTN_OK ? 0 : 1;
}
