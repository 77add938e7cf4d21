// tools/examples/continuous_batching.cpp: a continuous-batching loop over one attention layer (C++ API). Every step
// gathers what each live request needs now (the next chunk of its prompt, one next token, or a speculative draft to
// verify) and runs all of it as one CausalSelfAttention::step, so the layer's weights stream once a step and no
// request waits for another's prefill. Requests arrive and leave; every request shares a system prompt (a prefix fork);
// drafts that the "model" rejects are dropped with KvCache::truncate. Random weights, no model around the layer.
//
//   continuous_batching [--preset gpt2-small] [--steps 24] [--threads 0]
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

constexpr int64_t kChunk = 64;        // prompt tokens a request prefills per step (chunked prefill)
constexpr int64_t kStepBudget = 192;  // tokens per step, all requests together
constexpr int64_t kDraft = 4;         // tokens a speculating request proposes per step

struct Request {
  ga::SequenceId seq;
  std::vector<float> prompt;  // (T, E): what is left of it is prefilled chunk by chunk
  int64_t prefilled = 0, generated = 0, wanted = 0;
  bool speculative = false;   // drafts kDraft tokens a step once its prompt is in
  std::vector<float> next;    // (E): the next token's input once decoding
};

std::vector<float> random_rows(int64_t n, int64_t E, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * E));
  for (float& v : x) v = u(rng);
  return x;
}

int run(const std::string& preset, int steps, int threads) {
  const ga::Config cfg = ga::preset(preset);
  const int64_t E = cfg.d_model;
  ga::CausalSelfAttention attn(cfg, ga::Weights::random(cfg, /*seed=*/42));
  ga::KvCacheOptions pool;
  pool.capacity_tokens = 4096;
  ga::KvCache cache(cfg, pool);
  ga::Workspace ws;
  attn.reserve_step(kStepBudget, /*max_entries=*/16, threads, &ws);  // steps up to this size allocate nothing
  ga::RunOptions run;
  run.threads = threads;
  std::mt19937 rng(7);

  // The system prompt every request starts with, computed once; each request forks it (its blocks are shared).
  const ga::SequenceId system = cache.create();
  {
    const std::vector<float> x = random_rows(40, E, rng);
    std::vector<float> out(x.size());
    attn.extend(cache, system, x.data(), 40, out.data(), run, &ws);
  }

  std::vector<Request> live;
  const auto arrive = [&](int64_t prompt_tokens, int64_t wanted, bool speculative) {
    Request r{cache.fork(system, cache.length(system)), random_rows(prompt_tokens, E, rng), 0, 0, wanted,
              speculative, {}};
    std::printf("  + sequence %lld arrives: prompt of %lld tokens after the shared 40%s\n",
                static_cast<long long>(r.seq), static_cast<long long>(prompt_tokens),
                speculative ? ", speculative" : "");
    live.push_back(std::move(r));
  };
  arrive(150, 6, false);
  arrive(20, 10, true);
  arrive(90, 8, false);

  std::vector<ga::SequenceId> seqs;
  std::vector<int64_t> tokens;
  std::vector<float> x, y;
  for (int s = 0; s < steps && !live.empty(); ++s) {
    if (s == 3) arrive(200, 5, false);
    if (s == 6) arrive(30, 12, true);
    // Gather the step: each request's next chunk, next token or draft, within the token budget.
    seqs.clear(), tokens.clear(), x.clear();
    int64_t budget = kStepBudget, chunks = 0, decodes = 0, drafts = 0;
    for (Request& r : live) {
      const int64_t left = static_cast<int64_t>(r.prompt.size()) / E - r.prefilled;
      int64_t n = 0;
      if (left > 0) {
        n = std::min({left, kChunk, budget});
        if (n == 0) continue;
        x.insert(x.end(), r.prompt.begin() + r.prefilled * E, r.prompt.begin() + (r.prefilled + n) * E);
        ++chunks;
      } else if (r.speculative) {
        n = std::min(kDraft, budget);
        if (n == 0) continue;
        // A draft model would propose these tokens; here the next input and random rows stand in.
        x.insert(x.end(), r.next.begin(), r.next.end());
        const std::vector<float> rest = random_rows(n - 1, E, rng);
        x.insert(x.end(), rest.begin(), rest.end());
        ++drafts;
      } else {
        if (budget == 0) continue;
        n = 1;
        x.insert(x.end(), r.next.begin(), r.next.end());
        ++decodes;
      }
      seqs.push_back(r.seq), tokens.push_back(n), budget -= n;
    }
    const int64_t M = kStepBudget - budget;
    y.resize(static_cast<size_t>(M * E));
    attn.step(cache, seqs.data(), tokens.data(), static_cast<int64_t>(seqs.size()), x.data(), y.data(), run, &ws);

    // Hand each request its rows of y. A real model takes them through the rest of the network and samples.
    int64_t row = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Request& r = *std::find_if(live.begin(), live.end(), [&](const Request& q) { return q.seq == seqs[i]; });
      const int64_t n = tokens[i];
      const bool prefill = r.prefilled < static_cast<int64_t>(r.prompt.size()) / E;
      int64_t accepted = 1;  // a prefill chunk ends in one sampled token once the prompt is in; a decode in one
      if (prefill) {
        r.prefilled += n;
        accepted = r.prefilled == static_cast<int64_t>(r.prompt.size()) / E ? 1 : 0;
      } else if (r.speculative) {
        // The target model accepts a prefix of the draft (drawn here) and the rest is dropped from the cache.
        accepted = std::uniform_int_distribution<int64_t>(1, n)(rng);
        cache.truncate(r.seq, cache.length(r.seq) - (n - accepted));
      }
      if (accepted > 0) {
        const int64_t last = row + (prefill ? n : accepted) - 1;
        r.next.assign(y.begin() + last * E, y.begin() + (last + 1) * E);
        r.generated += accepted;
      }
      row += n;
    }
    std::printf("step %2d: %lld tokens: %lld prompt chunks, %lld decode tokens, %lld drafts; %lld of %lld blocks free\n",
                s, static_cast<long long>(M), static_cast<long long>(chunks), static_cast<long long>(decodes),
                static_cast<long long>(drafts), static_cast<long long>(cache.free_blocks()),
                static_cast<long long>(cache.total_blocks()));
    // Finished requests leave: their blocks go back, the shared prefix stays with the system prompt.
    for (auto it = live.begin(); it != live.end();) {
      if (it->generated >= it->wanted) {
        std::printf("  - sequence %lld leaves with %lld tokens\n", static_cast<long long>(it->seq),
                    static_cast<long long>(cache.length(it->seq)));
        cache.release(it->seq);
        it = live.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const Request& r : live) cache.release(r.seq);
  cache.release(system);
  std::printf("done: %lld sequences left, %lld of %lld blocks free, workspace %zu bytes\n",
              static_cast<long long>(cache.num_sequences()), static_cast<long long>(cache.free_blocks()),
              static_cast<long long>(cache.total_blocks()), ws.bytes());
  return cache.free_blocks() == cache.total_blocks() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "gpt2-small";
  int steps = 24, threads = 0;
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
  try {
    return run(preset, steps, threads);
  } catch (const ga::Error& e) {
    std::fprintf(stderr, "continuous_batching: %s\n", e.what());
    return e.code() == ga::ErrorCode::internal ? 1 : 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "continuous_batching: internal error: %s\n", e.what());
    return 1;
  }
}
