// tools/cli/bench_model.cpp: `gpt2attn bench --mode model`: a whole GPT-2 (gpt2attn/gpt2.hpp) timed as a server runs
// it: B prompts of --seq tokens prefilled in one ragged step, then --new-tokens decode steps of one token for each,
// greedy. Per case: prefill ms, decode ms per step (median, min, max), tokens/s, and the bytes a decode step streams
// (every layer's weights once, the K/V of every layer) over its median time. The triad bound is the reader's:
// bench/model_table.py measures the same run's STREAM triad and divides.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "gpt2attn/gpt2.hpp"
#include "gpt2attn/gpt2attn.h"
#include "tools/cli/commands.hpp"

namespace gpt2attn::cli {

namespace {

struct ModelCase {
  std::string source;  // --model's directory, or a preset name (random weights)
  bool preset = false;
  DType compute;
  std::string weights_name;
  std::string kv_name;
  int64_t B;
};

std::vector<int64_t> batch_list(const Args& a) {
  std::vector<int64_t> out;
  const std::string s = a.get("batch", "1");
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = std::min(s.find(',', at), s.size());
    const std::string part = s.substr(at, comma - at);
    char* end = nullptr;
    const long long v = std::strtoll(part.c_str(), &end, 10);
    if (part.empty() || *end != '\0' || v < 1 || v > 4096) {
      throw UsageError("--batch " + s + ": expected sequence counts from 1 to 4096, comma-separated (e.g. 1,16)");
    }
    out.push_back(v);
    at = comma + 1;
  }
  return out;
}

// Bytes one decode step streams: every weight matrix once (attention's 4 E x E, the MLP's 2 E x inner, the LM head's
// vocab x E, each in its format; the few-row kernels read each panel once a step) and every layer's cached K/V.
double step_bytes(const GPT2Config& c, bench::Precision p, int64_t B, int64_t T, DType kv) {
  const Config a = c.attention();
  const double E = static_cast<double>(c.n_embd), I = static_cast<double>(c.inner());
  // The LM head is int8 under int4 (gpt2.hpp).
  const bench::Precision head(p.compute, p.weights == WeightFormat::int4 ? WeightFormat::int8 : p.weights);
  const double per_layer = bench::decode_weight_bytes(a, p) + bench::matrix_bytes(I, E, p) +
                           bench::matrix_bytes(E, I, p) + bench::decode_kv_bytes(a, B, T, kv);
  return static_cast<double>(c.n_layer) * per_layer + bench::matrix_bytes(static_cast<double>(c.vocab_size), E, head);
}

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

int run_model_bench(const Args& a) {
  for (const char* k : {"prefill", "decode", "draft", "interleave", "cache", "kv-heads", "config", "check"}) {
    if (a.has(k) || a.flag(k)) throw UsageError(std::string("--") + k + " does not apply to --mode model");
  }
  if (a.has("model") == a.has("preset")) throw UsageError("--mode model takes --model DIR or --preset NAME (one)");
  std::vector<std::string> sources;
  if (a.has("model")) {
    sources = {a.get("model")};
  } else {
    sources = a.distinct<std::string>("preset", [](const std::string& p) {
      try {
        (void)gpt2_preset(p);
      } catch (const Error& e) {
        throw UsageError(std::string("--preset: ") + e.what());
      }
      return p;
    });
  }
  const std::vector<DType> computes = compute_dtypes(a);
  const std::vector<std::string> weights = weights_dtype_names(a);
  for (const DType c : computes) {
    for (const std::string& w : weights) (void)weight_format_for(w, c);
  }
  const std::vector<std::string> kvs = kv_dtype_names(a);
  const std::vector<int64_t> batches = batch_list(a);
  const std::vector<int64_t> seqs = a.integers<int64_t>("seq", 1);
  if (seqs.size() > 1) throw UsageError("--mode model takes one --seq (the prompt length)");
  const int64_t T = seqs.empty() ? 128 : seqs.front();
  const int64_t new_tokens = a.integer<int64_t>("new-tokens", 128, 1, 1 << 20);
  const int threads = threads_option(a);
  const Isa isa = isa_option(a);
  const bool json = a.flag("json");
  RunOptions run;
  run.batch_invariant = a.flag("batch-invariant");
  limit_gemm_isa(isa);

  if (!json) {
    std::printf("%-14s %-10s %-5s %3s %5s %5s %7s %10s %10s %9s %9s %9s %8s\n", "model", "dtype", "kv", "B", "T", "new",
                "threads", "prefill_ms", "step_ms", "min_ms", "tokens/s", "MB/step", "GB/s");
  }
  for (const std::string& src : sources) {
    const bool is_preset = !a.has("model");
    // The checkpoint once per source: a large one takes seconds to read or draw.
    const GPT2Checkpoint ck = is_preset ? random_gpt2(gpt2_preset(src), 0, DType::f32,
                                                      threads > 0 ? threads : max_threads() < 2 ? 1 : 2)
                                        : open_gpt2_checkpoint(src);
    const GPT2Config& c = ck.config;
    if (T + new_tokens > c.n_positions) {
      throw UsageError("--seq " + std::to_string(T) + " + --new-tokens " + std::to_string(new_tokens) +
                       " passes the model's n_positions " + std::to_string(c.n_positions));
    }
    for (const DType compute : computes) {
      for (const std::string& wname : weights) {
        const bench::Precision p(compute, weight_format_for(wname, compute));
        const auto b0 = std::chrono::steady_clock::now();
        GPT2 model(ck, bench::engine_options(p, threads, isa));
        const double build_ms = ms_between(b0, std::chrono::steady_clock::now());
        for (const std::string& kv : kvs) {
          for (const int64_t B : batches) {
            KvCacheOptions k;
            k.dtype = dtype_from_string(kv);
            const int64_t bt = KvCache::default_block_tokens(c.attention());
            k.capacity_tokens = B * ((T + new_tokens + bt - 1) / bt * bt);
            ModelKvCache cache = model.make_cache(k);
            std::vector<int32_t> prompt(static_cast<size_t>(B * T));
            for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919) % c.vocab_size);
            std::vector<int64_t> tokens(static_cast<size_t>(B), T), ones(static_cast<size_t>(B), 1);
            std::vector<float> logits(static_cast<size_t>(B * c.vocab_size));
            std::vector<SequenceId> seqs(static_cast<size_t>(B));
            std::vector<int32_t> next(static_cast<size_t>(B));
            double prefill_ms = 0;
            std::vector<double> steps;
            // Twice: the first run creates the GEMM primitives of its shapes and touches the pool's pages; the
            // second is timed.
            for (int pass = 0; pass < 2; ++pass) {
              for (SequenceId& s : seqs) s = cache.create();
              const auto p0 = std::chrono::steady_clock::now();
              model.step(cache, seqs.data(), tokens.data(), B, prompt.data(), logits.data(), false, run);
              prefill_ms = ms_between(p0, std::chrono::steady_clock::now());
              steps.clear();
              for (int64_t t = 0; t < (pass == 0 ? 2 : new_tokens); ++t) {
                for (int64_t b = 0; b < B; ++b) next[static_cast<size_t>(b)] = argmax(logits.data() + b * c.vocab_size, c.vocab_size);
                const auto s0 = std::chrono::steady_clock::now();
                model.step(cache, seqs.data(), ones.data(), B, next.data(), logits.data(), false, run);
                steps.push_back(ms_between(s0, std::chrono::steady_clock::now()));
              }
              for (SequenceId s : seqs) cache.release(s);
            }
            const double med = bench::median(steps);
            const double bytes = step_bytes(c, p, B, T + new_tokens / 2, k.dtype);
            const double tps = static_cast<double>(B) / (med * 1e-3);
            const std::string name = is_preset ? src : "model";
            if (json) {
              const nlohmann::json j = {{"mode", "model"}, {"model", src}, {"n_layer", c.n_layer},
                                        {"n_embd", c.n_embd}, {"dtype", to_string(compute)},
                                        {"weights_dtype", to_string(p.weights)}, {"kv_dtype", kv}, {"batch", B},
                                        {"seq", T}, {"new_tokens", new_tokens}, {"threads", model.options().threads},
                                        {"build_ms", build_ms}, {"prefill_ms", prefill_ms},
                                        {"prefill_tokens_per_s", static_cast<double>(B * T) / (prefill_ms * 1e-3)},
                                        {"step_median_ms", med},
                                        {"step_min_ms", *std::min_element(steps.begin(), steps.end())},
                                        {"step_max_ms", *std::max_element(steps.begin(), steps.end())},
                                        {"tokens_per_s", tps}, {"bytes_per_step", bytes}, {"batch_invariant", run.batch_invariant},
                                        {"gbps", bytes / (med * 1e-3) / 1e9},
                                        {"weight_bytes", model.weight_bytes()}, {"cpu", bench::cpu_model()},
                                        {"version", gpt2attn_version()}, {"commit", GPT2ATTN_COMMIT}};
              std::printf("%s\n", j.dump().c_str());
            } else {
              std::printf("%-14s %-10s %-5s %3ld %5ld %5ld %7d %10.1f %10.2f %9.2f %9.1f %9.1f %8.1f\n", name.c_str(),
                          p.name().c_str(), kv.c_str(), static_cast<long>(B), static_cast<long>(T),
                          static_cast<long>(new_tokens), model.options().threads, prefill_ms, med,
                          *std::min_element(steps.begin(), steps.end()), tps, bytes / 1e6,
                          bytes / (med * 1e-3) / 1e9);
            }
            std::fflush(stdout);
          }
        }
      }
    }
  }
  return 0;
}

}  // namespace gpt2attn::cli
