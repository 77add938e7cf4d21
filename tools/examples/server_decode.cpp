// tools/examples/server_decode.cpp: how a server drives one attention layer through a paged KV cache (C++ API):
// sequences arrive and are prefilled, decode together one token per step, leave. Random weights, no model around it.
//
//   server_decode [--preset gpt2-small] [--steps 16] [--threads 0]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gpt2attn/gpt2attn.hpp>

namespace ga = gpt2attn;

namespace {

// One live request: its id in the cache and its next input token (E floats).
struct Request {
  ga::SequenceId seq;
  std::vector<float> next;
};

// Stand-in for a tokenizer + embedding: a prompt of T random token vectors, (T, E).
std::vector<float> random_prompt(int64_t T, int64_t E, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T * E));
  for (float& v : x) v = u(rng);
  return x;
}

// Admits a request: a new sequence, its prompt prefilled in one extend(). The last output row becomes the
// next input. Returns false, with nothing kept, when the pool has no room for the prompt now.
bool admit(ga::CausalSelfAttention& attn, ga::KvCache& cache, ga::Workspace& ws, const ga::RunOptions& run,
           int64_t T, std::mt19937& rng, std::vector<Request>& live) {
  const int64_t E = attn.config().d_model;
  const ga::SequenceId seq = cache.create();
  // Admission control: the pool is fixed, so ask before prefilling rather than fail half-way.
  if (cache.blocks_needed(seq, T) > cache.free_blocks()) {
    cache.release(seq);
    std::printf("  . a prompt of %lld tokens waits for room in the pool\n", static_cast<long long>(T));
    return false;
  }
  const std::vector<float> prompt = random_prompt(T, E, rng);
  std::vector<float> out(static_cast<size_t>(T * E));
  try {
    attn.extend(cache, seq, prompt.data(), T, out.data(), run, &ws);
  } catch (...) {
    cache.release(seq);  // never leak a sequence: its blocks would be lost to every later request
    throw;
  }
  // A real model would take this row through the residual, the MLP, the other layers, the LM head and
  // sampling, and embed the sampled token. Here the attention output itself is fed back.
  live.push_back({seq, std::vector<float>(out.end() - E, out.end())});
  std::printf("  + sequence %lld arrives: prompt of %lld tokens\n", static_cast<long long>(seq),
              static_cast<long long>(T));
  return true;
}

int run(const std::string& preset, int steps, int threads) {
  const ga::Config cfg = ga::preset(preset);
  const int64_t E = cfg.d_model;
  ga::CausalSelfAttention attn(cfg, ga::Weights::random(cfg, /*seed=*/42));
  std::printf("%s: E=%lld H=%lld, kernels %s\n", preset.c_str(), static_cast<long long>(E),
              static_cast<long long>(cfg.num_heads), attn.layer().implementation().c_str());

  // The pool is sized in tokens for the whole server, allocated once; sequences take 64-token blocks from it.
  ga::KvCacheOptions pool;
  pool.capacity_tokens = 1024;
  ga::KvCache cache(cfg, pool);
  // One workspace per serving thread, reserved for the largest prompt and batch: decode steps allocate nothing.
  const int64_t max_prompt = 32, max_batch = 4;
  ga::Workspace ws;
  attn.reserve_serving(max_prompt, max_batch, threads, &ws);
  ga::RunOptions run;
  run.threads = threads;

  std::mt19937 rng(7);
  std::vector<Request> live;
  for (int64_t T : {12, 32, 20}) admit(attn, cache, ws, run, T, rng, live);

  std::vector<ga::SequenceId> seqs;
  std::vector<float> x, y;
  for (int step = 0; step < steps && !live.empty(); ++step) {
    // Mid-way the oldest request finishes and leaves, and a new one arrives in its place.
    if (step == steps / 2) {
      std::printf("  - sequence %lld leaves after %lld tokens\n", static_cast<long long>(live.front().seq),
                  static_cast<long long>(cache.length(live.front().seq)));
      cache.release(live.front().seq);
      live.erase(live.begin());
      admit(attn, cache, ws, run, 16, rng, live);
    }
    // One decode step for every live sequence: gather their next tokens into x (B, E).
    const int64_t B = static_cast<int64_t>(live.size());
    seqs.clear();
    x.clear();
    for (const Request& r : live) {
      seqs.push_back(r.seq);
      x.insert(x.end(), r.next.begin(), r.next.end());
    }
    y.resize(static_cast<size_t>(B * E));
    attn.decode(cache, seqs.data(), B, x.data(), y.data(), run, &ws);
    for (int64_t b = 0; b < B; ++b) {
      // As in admit(): a real model would turn y's row into the next token's embedding.
      std::copy(y.begin() + b * E, y.begin() + (b + 1) * E, live[b].next.begin());
    }
    std::printf("step %d: decoded %lld sequences, %lld of %lld blocks free\n", step, static_cast<long long>(B),
                static_cast<long long>(cache.free_blocks()), static_cast<long long>(cache.total_blocks()));
  }

  for (const Request& r : live) cache.release(r.seq);
  std::printf("done: %lld sequences left, workspace %zu bytes\n", static_cast<long long>(cache.num_sequences()),
              ws.bytes());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "gpt2-small";
  int steps = 16, threads = 0;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--preset") && has_value) {
      preset = argv[++i];
    } else if (!std::strcmp(argv[i], "--steps") && has_value) {
      steps = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--threads") && has_value) {
      threads = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--preset NAME] [--steps N] [--threads N]\n", argv[0]);
      return 2;
    }
  }
  // Every library failure is a gpt2attn::Error whose code says whose fault it was.
  try {
    return run(preset, steps, threads);
  } catch (const ga::Error& e) {
    std::fprintf(stderr, "server_decode: %s\n", e.what());
    return e.code() == ga::ErrorCode::internal ? 1 : 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "server_decode: internal error: %s\n", e.what());
    return 1;
  }
}
