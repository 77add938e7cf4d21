/* tests/c/header_c.c: include/gpt2attn/gpt2attn.h as a program sees it, built as C99, C11 and (header_cxx.cpp) C++
 * under strict warnings. It runs as well: the loaded library is the header's release, and the *_init() helpers
 * give struct sizes the library accepts. Written in the common subset of C99 and C++, without casts. */
#include <gpt2attn/gpt2attn.h> /* first: the header brings what it uses */

#include <stdio.h>
#include <string.h>

#ifdef __cplusplus
#define LANGUAGE "C++"
#else
#define LANGUAGE "C"
#endif

int main(void) {
  int failed = 0;
  char header_version[32];
  snprintf(header_version, sizeof header_version, "%d.%d.%d", GPT2ATTN_VERSION_MAJOR, GPT2ATTN_VERSION_MINOR,
           GPT2ATTN_VERSION_PATCH);
  if (strcmp(gpt2attn_version(), header_version) != 0) {
    fprintf(stderr, "FAIL: library %s, header %s\n", gpt2attn_version(), header_version);
    failed = 1;
  }

  gpt2attn_config_t cfg = gpt2attn_config_init();
  gpt2attn_kv_cache_options_t opt = gpt2attn_kv_cache_options_init();
  if (cfg.struct_size != sizeof cfg || opt.struct_size != sizeof opt || cfg.d_model != 0 || opt.kv_dtype) {
    fprintf(stderr, "FAIL: the init helpers give struct_size %u and %u, fields not zero\n", cfg.struct_size,
            opt.struct_size);
    failed = 1;
  }
  const gpt2attn_status_t st = gpt2attn_config_preset("gpt2-small", &cfg);
  if (st != GPT2ATTN_OK || cfg.d_model != 768 || cfg.struct_size != sizeof cfg) {
    fprintf(stderr, "FAIL: gpt2attn_config_preset: %s (%s)\n", gpt2attn_status_string(st), gpt2attn_last_error());
    failed = 1;
  }
  printf("%s: gpt2attn.h of %s (ABI %d) against library %s: %s\n", LANGUAGE, header_version, GPT2ATTN_ABI_VERSION,
         gpt2attn_version(), failed ? "FAILED" : "ok");
  return failed;
}
