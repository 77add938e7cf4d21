// tests/fuzz/libfuzzer_main.cpp: the libFuzzer entry point of one target, chosen when it is compiled
// (-DGPT2ATTN_FUZZ_TARGET=fuzz_npy, ...). The harness itself lives in fuzz_<name>.cpp so the normal suite runs it too.
#include "tests/fuzz/fuzz_targets.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return gpt2attn::fuzz::GPT2ATTN_FUZZ_TARGET(data, size);
}
