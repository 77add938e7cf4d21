// gpt2attn/gpt2.hpp: a whole GPT-2 on the library's public API (the model library, gpt2attn::model): token and position
// embeddings, n_layer blocks of ln_1 -> causal self-attention -> residual -> ln_2 -> MLP (c_fc, GELU tanh, c_proj) ->
// residual, ln_f and the LM head tied to the token embeddings. Logits out for a batch of sequences of a KV cache
// (ModelKvCache) through the attention layers' ragged step, and generation with sampling in C++. Token ids in and
// out: tokenization is the caller's (GPT-2's BPE vocabulary and merges are not part of a checkpoint's tensors).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpt2attn/export.h"
#include "gpt2attn/gpt2_checkpoint.hpp"
#include "gpt2attn/kv_cache.hpp"
#include "gpt2attn/model_kv_cache.hpp"
#include "gpt2attn/options.hpp"
#include "gpt2attn/sampling.hpp"

namespace gpt2attn {

struct GenerateOptions {
  int64_t max_new_tokens = 16;       // >= 1; a sequence also stops at n_positions tokens
  SamplingOptions sampling = SamplingOptions{0.0f};  // greedy by default (temperature 0); prompt i: seed + i
  std::vector<int32_t> stop_tokens;  // a sampled stop token ends its sequence (it is returned, as the last new id)
  int64_t max_step_tokens = 512;     // a step's budget: every running sequence's next token (always all of them),
                                     // then prompt chunks in what is left (with run.batch_invariant, chunks of
                                     // exactly this from each prompt's start, at least one a step, so a request's
                                     // results do not depend on what shares its steps)
  bool logprobs = false;             // return each new token's log-probability under the model (temperature 1)
  DType kv_dtype = DType::f32;       // the storage of the cache generate() makes for itself (kv_cache_dtypes())
  RunOptions run;                    // threads, check_finite
};

struct Generation {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> new_ids;
  std::vector<double> logprobs;      // one per new id with GenerateOptions::logprobs, else empty
  std::string finish_reason;         // "stop" (a stop token), "length" (max_new_tokens or n_positions)
  double first_token_ms = 0.0;       // from the call's start to this sequence's first new token
  double total_ms = 0.0;             // from the call's start to this sequence's last
};

// Immutable after construction but for its own scratch: calls on one GPT2 are serialised (a server runs one model
// step at a time, batching its sequences into it).
class GPT2ATTN_API GPT2 {
 public:
  // Builds every layer from the checkpoint's views (converted or quantized once: EngineOptions' compute type and
  // weight format, which apply to attention, the MLPs and the LM head alike; under int4 the LM head stays int8, as
  // llama.cpp keeps a 4-bit model's output matrix at 6 bits or more: its 50257 logits are what sampling reads). The
  // checkpoint's storage may go afterwards. invalid_argument naming the tensor for bad weights (GPT2Weights::validate).
  explicit GPT2(const GPT2Checkpoint& checkpoint, const EngineOptions& options = {});
  // open_gpt2_checkpoint(dir), then the above.
  static GPT2 from_pretrained(const std::string& dir, const EngineOptions& options = {});
  ~GPT2();
  GPT2(GPT2&&) noexcept;
  GPT2& operator=(GPT2&&) noexcept;

  const GPT2Config& config() const;
  const EngineOptions& options() const;  // as given, threads resolved
  // Bytes of weights the model holds (every layer's copies).
  size_t weight_bytes() const;

  // A cache for this model: one pool per layer (ModelKvCache), of the attention layers' config.
  ModelKvCache make_cache(const KvCacheOptions& options) const;

  // Logits of every position of one sequence, teacher forced, without a cache: ids (T) from position 0,
  // 1 <= T <= n_positions; out (T, vocab_size) f32.
  void logits(const int32_t* ids, int64_t T, float* out, const RunOptions& run = {});

  // One step of continuous batching: entry i appends tokens[i] >= 1 ids to sequence seqs[i] of `cache` (distinct
  // sequences; ids packed in entry order, sum(tokens) of them): a prompt or a chunk of one, a sampled token, in any
  // mix. Writes the logits of each entry's last new token to logits (n, vocab_size), or with all_positions of every
  // new token (sum(tokens), vocab_size). Checked before anything runs: ids in [0, vocab_size), lengths within
  // n_positions, the cache's layers and config this model's, the pools able to hold the step; a failure later (a
  // non-finite value) truncates every sequence back. On error every sequence and `logits` are as they were.
  void step(ModelKvCache& cache, const SequenceId* seqs, const int64_t* tokens, int64_t n, const int32_t* ids,
            float* logits, bool all_positions = false, const RunOptions& run = {});

  // Generates for each prompt (each of 1 .. n_positions - 1 ids) with continuous batching over a cache of its own,
  // sized for every prompt's tokens plus max_new_tokens: every step takes each running sequence's next token and
  // prompt chunks up to max_step_tokens. Results in prompt order.
  std::vector<Generation> generate(const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options);
  // The same over the caller's cache (its sequences are created and released here): Error out_of_memory, with
  // every sequence released, when the cache cannot hold a step.
  std::vector<Generation> generate(ModelKvCache& cache, const std::vector<std::vector<int32_t>>& prompts,
                                   const GenerateOptions& options);

  struct GPT2ATTN_LOCAL Impl;  // model/gpt2.cpp

 private:
  explicit GPT2(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpt2attn
