// tests/consumers/consumer.cpp: the smallest C++ program against gpt2attn: a layer with random weights, a prompt of
// three tokens through a KV cache, one decode step, and an error thrown inside libgpt2attn.so caught here by type.
#include <gpt2attn/gpt2attn.hpp>

#include <cstdio>
#include <vector>

int main() {
  gpt2attn::Config cfg;
  cfg.d_model = 32;
  cfg.num_heads = 4;
  cfg.context_length = 8;
  cfg.causal = true;
  gpt2attn::CausalSelfAttention attn(cfg, gpt2attn::Weights::random(cfg, 1));
  gpt2attn::KvCacheOptions pool;
  pool.capacity_tokens = 8;
  gpt2attn::KvCache cache(cfg, pool);
  const gpt2attn::SequenceId seq = cache.create();
  std::vector<float> x(8 * 32, 0.25f), y(8 * 32);  // (T, E), T up to context_length
  attn.extend(cache, seq, x.data(), 3, y.data());
  attn.decode(cache, &seq, 1, x.data() + 3 * 32, y.data() + 3 * 32);
  try {
    attn.extend(cache, seq, x.data(), 8, y.data());  // 4 cached + 8 > context_length
  } catch (const gpt2attn::Error& e) {  // thrown in the library: the type must match across the boundary
    std::printf("consumer_cpp: %s kernels, an over-long extend refused: %s\n", to_string(attn.layer().isa()), e.what());
    return 0;
  }
  std::puts("consumer_cpp: an over-long extend was accepted");
  return 1;
}
