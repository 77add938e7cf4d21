// gpt2attn/sampling.hpp: choosing the next token from one position's logits (greedy, temperature, top-k, top-p), with
// a counter-based random stream so a sequence's tokens never depend on threads or batch composition; and the log
// probability and argmax of raw logits. No repetition penalty, no beam search. Part of the model library
// (gpt2attn::model).
#pragma once

#include <cstdint>
#include <vector>

#include "gpt2attn/export.h"

namespace gpt2attn {

struct GPT2ATTN_API SamplingOptions {
  float temperature = 1.0f;  // 0 = greedy (argmax; top_k and top_p are then ignored); else finite and above 0
  int64_t top_k = 0;         // 0 = off; else keep the tokens whose logit >= the k-th largest (boundary ties kept)
  float top_p = 1.0f;        // in (0, 1]; 1 = off
  uint64_t seed = 0;

  // Throws invalid_argument naming the field: temperature negative or not finite, top_k below 0, top_p NaN or
  // outside (0, 1].
  void validate() const;
};

// One sequence's sampler: sample() is called once per generated position, in order. Not thread-safe; a server keeps
// one per sequence.
//
// Semantics, in Hugging Face transformers' order (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper):
//   1. weight w_i = exp(-(max logit - logit_i) x (1 / temperature)) in double: softmax(logits / temperature)'s
//      numerators with the max subtracted (a -inf logit has weight 0: masked).
//   2. top-k: keep the tokens whose logit >= the k-th largest logit (all tokens if k >= vocab).
//   3. top-p: order the kept tokens by descending logit (so descending probability), ties lower id first; keep the
//      shortest prefix whose weight sum reaches top_p x (the kept weights' sum), at least one token.
//   4. u = uniform(seed, n), n = draws() (the number of sample() calls made before on this Sampler); return the first
//      token, in that same order, whose running weight sum exceeds u x (the sum of the weights still kept: summed in
//      id order, or under top-p the nucleus's running sum).
//   uniform(seed, n) = (splitmix64(seed ^ splitmix64(n)) >> 40) * 2^-24, splitmix64 as in gpt2attn/options.hpp's
//   dropout contract: a draw depends only on (seed, n), so a sequence's tokens depend only on its logits, seed and
//   position.
// Greedy (temperature 0) returns argmax(logits) and consumes a draw too, so that draws() is always the number of
// tokens chosen: a sequence switched between greedy and sampling (a new Sampler constructed at the old one's draws())
// draws at each position what it would have drawn had it sampled throughout. A call that throws consumes none.
// sample() allocates nothing after its first call, unless a later call brings a larger vocabulary.
class GPT2ATTN_API Sampler {
 public:
  // Validates options; draws (at least 0, else invalid_argument naming it) is the position to start at: a sequence
  // resumed or switched to other options continues its stream there.
  explicit Sampler(const SamplingOptions& options, int64_t draws = 0);

  // The next token id for logits[0, vocab). Throws invalid_argument for a null logits, vocab below 1 or above
  // 2^31 - 1, a NaN or +inf logit (naming its index), or every logit -inf (no token possible).
  int32_t sample(const float* logits, int64_t vocab);

  int64_t draws() const { return draws_; }
  const SamplingOptions& options() const { return options_; }

 private:
  SamplingOptions options_;
  int64_t draws_ = 0;
  // Scratch, sized on first use at a vocabulary (so sample() stops allocating once warm):
  std::vector<double> weight_;    // (vocab) w_i of the tokens top-k kept; others unread
  std::vector<int32_t> kept_;     // ids top-k kept, ascending (unused without top-k)
  std::vector<float> heap_;       // (top_k) the k largest logits, a min-heap: its top is the k-th largest
  std::vector<uint64_t> order_;   // (vocab) sort keys of the candidates: descending logit, then ascending id
};

// log softmax(logits)[token] in double: raw logits (temperature 1, no filtering); -inf for a masked (-inf) token.
// Throws invalid_argument as Sampler::sample does, and for a token outside [0, vocab).
GPT2ATTN_API double log_probability(const float* logits, int64_t vocab, int32_t token);

// The index of the largest logit, the lowest on ties (torch.argmax's). Throws invalid_argument as Sampler::sample.
GPT2ATTN_API int32_t argmax(const float* logits, int64_t vocab);

}  // namespace gpt2attn
