// model/sampling.cpp: the Sampler (greedy, temperature, top-k, top-p over a counter-based draw), log_probability and
// argmax. Scalar and single-threaded on purpose: a position's choice is a few passes over the vocabulary's logits,
// where the LM head that made them read the whole (vocab, E) embedding matrix. No engine or kernel code: public API.

#include "gpt2attn/sampling.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "gpt2attn/error.hpp"

namespace gpt2attn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// gpt2attn/options.hpp's dropout contract, the same generator: a draw is a pure function of (seed, n).
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double uniform(uint64_t seed, uint64_t n) { return double(splitmix64(seed ^ splitmix64(n)) >> 40) * 0x1p-24; }

// A float's bits as an int32 key in the float's order (the magnitude bits flipped for negatives; -0 then sorts just
// below +0), and whether they are a NaN's: integer compares that GCC vectorizes at the baseline instruction set,
// where a float max does not (its NaN rule): the pass over the vocabulary costs about three SSE2 operations a logit.
int32_t float_key(int32_t b) { return b ^ ((b >> 31) & 0x7fffffff); }
bool nan_bits(int32_t b) { return (b & 0x7fffffff) > 0x7f800000; }

// The checks every entry shares, and argmax: per chunk of the vocabulary the largest key and whether a NaN is there,
// then the first logit equal to the largest in the first chunk that holds it (+0 and -0 tie, as they compare equal).
// Ties keep the first index, as torch.argmax. Greedy decoding calls it once a sequence and step: 16 x 50257 logits
// took 0.71 ms as one scalar pass with branches, 0.33-0.37 ms this way (a throwaway program over the public argmax,
// 200 rounds, the 2-vCPU Xeon VM).
int32_t checked_argmax(const float* logits, int64_t vocab, const char* who) {
  if (logits == nullptr) invalid(std::string(who) + ": logits is null");
  if (vocab < 1 || vocab > std::numeric_limits<int32_t>::max()) {
    invalid(std::string(who) + ": vocab must be in [1, 2^31 - 1], got " + std::to_string(vocab));
  }
  constexpr int64_t kChunk = 1024;
  float best = -kInf;
  int64_t best_chunk = 0;  // the first chunk holding the largest logit: where the last scan starts
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    int32_t top = std::numeric_limits<int32_t>::min(), bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int32_t b = std::bit_cast<int32_t>(logits[c0 + i]);
      const int32_t k = float_key(b);
      top = k > top ? k : top;
      bad |= nan_bits(b);
    }
    if (bad) {  // the first NaN is the index to name
      int64_t at = c0;
      while (!std::isnan(logits[at])) ++at;
      invalid(std::string(who) + ": logits[" + std::to_string(at) + "] is NaN");
    }
    // Compared as floats (float_key is its own inverse): a chunk's +0 does not pass an earlier chunk's -0.
    const float t = std::bit_cast<float>(float_key(top));
    if (t > best) best = t, best_chunk = c0;
  }
  // The first logit at the largest: the argmax, or the first +inf to name.
  int64_t at = best_chunk;
  while (logits[at] != best) ++at;
  if (best == kInf) invalid(std::string(who) + ": logits[" + std::to_string(at) + "] is +inf");
  if (best == -kInf) invalid(std::string(who) + ": every logit is -inf, so no token is possible");
  return int32_t(at);
}

// Sort keys whose ascending order is the sampling order: descending logit, then ascending id. The logit's float_key,
// made unsigned (its sign bit flipped), inverted, and put above the id; one integer sort then replaces a comparator
// that reads the logits. -0 is made +0 first: they are equal logits, so they must tie and fall to the id.
uint64_t order_key(float x, int32_t id) {
  const uint32_t b = uint32_t(float_key(std::bit_cast<int32_t>(x == 0.0f ? 0.0f : x))) ^ 0x80000000u;
  return (uint64_t(~b) << 32) | uint32_t(id);
}
int32_t key_id(uint64_t key) { return int32_t(uint32_t(key)); }

// The candidate search's buckets by d = (max - logit) / T = -ln w: bucket floor(2 d) (half a nat wide), the last one
// holding everything below w = e^-31.5 (and the -inf logits, d = inf). One pass sums each bucket's weight, so the
// buckets that hold the nucleus (or the draw) are known before anything is sorted; only their tokens are.
constexpr int kBuckets = 64;
int bucket_of(double d) { return d < (kBuckets - 1) * 0.5 ? int(d * 2.0) : kBuckets - 1; }

// The kept tokens: all of [0, vocab), or top-k's list. A template parameter, so that the loops over the whole
// vocabulary (no top-k, the common case) carry no indirection.
struct AllIds {
  int32_t operator[](int64_t j) const { return int32_t(j); }
};
struct ListedIds {
  const int32_t* ids;
  int32_t operator[](int64_t j) const { return ids[j]; }
};

// Steps 1, 3 and 4 of the header over the n kept tokens `ids`, max logit mx. weight (vocab) and order (n) are the
// Sampler's scratch, passed as plain pointers so the loops keep everything in registers (through the members, every
// store into the scratch made the compiler reload them: 15% of a call's time at top_p 0.9).
template <class Ids>
int32_t choose(const float* logits, Ids ids, int64_t n, double mx, double inv_t, float top_p, double u, double* weight,
               uint64_t* order) {
  // w = exp(-d), d = (max - logit) / T: the softmax numerators, in double with the max subtracted.
  double mass[kBuckets] = {};
  double total = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const int32_t i = ids[j];
    const double d = (mx - double(logits[i])) * inv_t;
    const double w = std::exp(-d);
    weight[i] = w;
    total += w;
    mass[bucket_of(d)] += w;
  }
  // The weight the walk must reach: top_p of the kept mass to end the nucleus, or u of it to place the draw; and the
  // first bucket by which the bucket sums reach it.
  const bool nucleus = top_p < 1.0f;
  const double reach = (nucleus ? double(top_p) : u) * total;
  int upto = kBuckets - 1;
  double acc = 0.0;
  for (int b = 0; b < kBuckets; ++b) {
    acc += mass[b];
    if (nucleus ? acc >= reach : acc > reach) {
      upto = b;
      break;
    }
  }
  // The tokens of buckets [0, last] (d < (last + 1) / 2), sorted; found by comparing the logit with a bound a hair
  // below the bucket's edge, in double (a float bound would round by more than the hair at GPT-2's logits, about
  // -100). Whatever the bound, the set is a prefix of the sampling order (every token at or above a logit), and the
  // walks below check that it reaches far enough.
  auto gather = [=](int last) {
    const double cut = last == kBuckets - 1 ? -kInf : mx - (last + 1) * 0.5 * (1.0 + 1e-6) / inv_t;
    size_t m = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int32_t i = ids[j];
      const float x = logits[i];
      if (double(x) >= cut) order[m++] = order_key(x, i);
    }
    std::sort(order, order + m);
    return m;
  };
  // The first position of order[0, m) whose running sum reaches `target` (>= when `inclusive`, else >), and that
  // sum; m and the whole sum when none does.
  struct Walk {
    size_t at;
    double sum;
  };
  auto walk = [=](size_t m, double target, bool inclusive) {
    double sum = 0.0;
    for (size_t j = 0; j < m; ++j) {
      sum += weight[key_id(order[j])];
      if (inclusive ? sum >= target : sum > target) return Walk{j, sum};
    }
    return Walk{m, sum};
  };
  // The bucket sums ran in id order, the walks run in sampling order: rounding can leave a walk a hair short of its
  // target inside the gathered buckets. Then everything is gathered (correct, and rare).
  size_t m = gather(upto);
  double target = reach;
  if (nucleus) {
    Walk w = walk(m, reach, true);
    if (w.at == m && upto < kBuckets - 1) m = gather(upto = kBuckets - 1), w = walk(m, reach, true);
    if (w.at < m) m = w.at + 1;
    target = u * w.sum;  // u < 1, so the draw lands inside the nucleus
  }
  Walk w = walk(m, target, false);
  if (w.at == m && !nucleus && upto < kBuckets - 1) m = gather(kBuckets - 1), w = walk(m, target, false);
  if (w.at == m) {  // rounding again: the last token that has any weight (the first, the max, has weight 1)
    w.at = m - 1;
    while (w.at > 0 && weight[key_id(order[w.at])] == 0.0) --w.at;
  }
  return key_id(order[w.at]);
}

}  // namespace

void SamplingOptions::validate() const {
  if (!std::isfinite(temperature) || temperature < 0.0f) {
    invalid("SamplingOptions.temperature must be finite and at least 0 (0 = greedy), got " +
            std::to_string(temperature));
  }
  if (top_k < 0) invalid("SamplingOptions.top_k must be at least 0 (0 = off), got " + std::to_string(top_k));
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    invalid("SamplingOptions.top_p must be in (0, 1] (1 = off), got " + std::to_string(top_p));
  }
}

Sampler::Sampler(const SamplingOptions& options, int64_t draws) : options_(options), draws_(draws) {
  options_.validate();
  if (draws < 0) invalid("Sampler: draws must be at least 0, got " + std::to_string(draws));
}

// Cost per call at vocab 50257, logits N(0, 3): greedy 21 us, temperature 1 460 us, top_k 50 115 us, top_p 0.9
// 570 us, top_k 50 + top_p 0.9 118 us (a throwaway program: 2000 calls after 50 warm-up ones, thread CPU time, median
// of 5 runs; g++ 12 -O2, one thread of a 2-core "Intel(R) Xeon(R) Processor" VM shared with other work, which moved
// the figures by up to half again). Without top-k, the 50257 std::exp calls are half of it; the nucleus (2000
// tokens on average here) is found by the buckets and sorted alone, where a full sort of the keys costs 2.9 ms.
int32_t Sampler::sample(const float* logits, int64_t vocab) {
  const int32_t top = checked_argmax(logits, vocab, "Sampler::sample");
  const double u = uniform(options_.seed, uint64_t(draws_));
  if (options_.temperature == 0.0f) {
    ++draws_;  // greedy still uses up its draw: see the header
    return top;
  }
  const int32_t V = int32_t(vocab);
  const double mx = logits[top];
  // One reciprocal: d is computed the same way wherever a token's bucket is.
  const double inv_t = 1.0 / double(options_.temperature);
  if (weight_.size() < size_t(V)) weight_.resize(V);
  if (order_.size() < size_t(V)) order_.resize(V);

  // Top-k: the k-th largest logit from a k-element min-heap (one pass; a logit below the heap's top costs one
  // comparison), then every token at or above it, so ties at the boundary are all kept.
  const int64_t k = options_.top_k;
  int32_t token;
  if (k > 0 && k < V) {
    heap_.reserve(k);
    heap_.assign(logits, logits + k);
    std::make_heap(heap_.begin(), heap_.end(), std::greater<float>());
    for (int32_t i = int32_t(k); i < V; ++i) {
      if (logits[i] > heap_.front()) {
        std::pop_heap(heap_.begin(), heap_.end(), std::greater<float>());
        heap_.back() = logits[i];
        std::push_heap(heap_.begin(), heap_.end(), std::greater<float>());
      }
    }
    const float kth = heap_.front();
    kept_.reserve(V);
    kept_.clear();
    for (int32_t i = 0; i < V; ++i) {
      if (logits[i] >= kth && logits[i] > -kInf) kept_.push_back(i);
    }
    token = choose(logits, ListedIds{kept_.data()}, int64_t(kept_.size()), mx, inv_t, options_.top_p, u,
                   weight_.data(), order_.data());
  } else {
    token = choose(logits, AllIds{}, V, mx, inv_t, options_.top_p, u, weight_.data(), order_.data());
  }
  ++draws_;
  return token;
}

double log_probability(const float* logits, int64_t vocab, int32_t token) {
  const int32_t top = checked_argmax(logits, vocab, "log_probability");
  if (token < 0 || token >= vocab) {
    invalid("log_probability: token " + std::to_string(token) + " is outside [0, " + std::to_string(vocab) + ")");
  }
  const double mx = logits[top];
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - mx);
  return (double(logits[token]) - mx) - std::log(sum);
}

int32_t argmax(const float* logits, int64_t vocab) { return checked_argmax(logits, vocab, "argmax"); }

}  // namespace gpt2attn
