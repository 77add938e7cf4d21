// The Sampler against its header's contract (a naive full-sort reference in double, token for token), its emitted
// distributions by chi-square, its draw stream, and its errors; log_probability and argmax.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gpt2attn/error.hpp"
#include "gpt2attn/sampling.hpp"

namespace gpt2attn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
// Chi-square critical value, fixed and generous: the 0.999 quantile is 24.3 at 7 degrees of freedom (the most any
// test here has), so a correct sampler fails by chance far less than once in a thousand runs; a wrong one (the
// rejection checks) lands in the hundreds.
constexpr double kChi2Critical = 40.0;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
double uniform(uint64_t seed, uint64_t n) { return double(splitmix64(seed ^ splitmix64(n)) >> 40) * 0x1p-24; }

std::vector<float> normal_logits(int64_t vocab, float sigma, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> l(vocab);
  for (float& x : l) x = dist(gen);
  return l;
}

// The header's steps, done the plain way: a full stable sort by descending logit (ties keep ascending ids).
// The kept tokens in sampling order, their weights, and the sum the draw scales: the id-order sum of every kept
// weight, or the nucleus's own (sampling-order) sum under top-p.
struct Kept {
  std::vector<int32_t> ids;
  std::vector<double> w;
  double sum = 0.0;
};
Kept reference_kept(const std::vector<float>& l, const SamplingOptions& o) {
  const int64_t V = int64_t(l.size());
  std::vector<int32_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  const float kth = (o.top_k > 0 && o.top_k < V) ? l[order[o.top_k - 1]] : -kInf;
  const double mx = l[order[0]], inv_t = 1.0 / double(o.temperature);
  std::vector<double> w(V, 0.0);
  double total = 0.0;
  for (int32_t i = 0; i < V; ++i) {
    if (l[i] >= kth && l[i] > -kInf) total += (w[i] = std::exp(-(mx - double(l[i])) * inv_t));
  }
  Kept k;
  for (int32_t i : order) {
    if (!(l[i] >= kth && l[i] > -kInf)) continue;
    if (o.top_p < 1.0f && k.sum >= double(o.top_p) * total) break;
    k.ids.push_back(i), k.w.push_back(w[i]), k.sum += w[i];
  }
  if (o.top_p == 1.0f) k.sum = total;
  return k;
}
int32_t reference_sample(const std::vector<float>& l, const SamplingOptions& o, uint64_t n) {
  if (o.temperature == 0.0f) return int32_t(std::max_element(l.begin(), l.end()) - l.begin());
  const Kept k = reference_kept(l, o);
  const double target = uniform(o.seed, n) * k.sum;
  double sum = 0.0;
  for (size_t j = 0; j < k.ids.size(); ++j) {
    if ((sum += k.w[j]) > target) return k.ids[j];
  }
  return k.ids.back();
}

// Draws `n` tokens from `l` and returns the chi-square of their counts against p (infinite if a token with p = 0
// appears).
double chi_square(const std::vector<float>& l, const SamplingOptions& o, int n, const std::vector<double>& p) {
  Sampler s(o);
  std::vector<int64_t> count(l.size(), 0);
  for (int i = 0; i < n; ++i) ++count.at(s.sample(l.data(), int64_t(l.size())));
  double chi2 = 0.0;
  for (size_t t = 0; t < l.size(); ++t) {
    if (p[t] == 0.0 && count[t] > 0) return kInf;
    if (p[t] > 0.0) chi2 += (count[t] - n * p[t]) * (count[t] - n * p[t]) / (n * p[t]);
  }
  return chi2;
}
std::vector<double> softmax(const std::vector<float>& l, double temperature) {
  std::vector<double> p(l.size());
  const double mx = *std::max_element(l.begin(), l.end());
  double sum = 0.0;
  for (size_t i = 0; i < l.size(); ++i) sum += (p[i] = std::exp((l[i] - mx) / temperature));
  for (double& x : p) x /= sum;
  return p;
}
std::vector<double> by_token(const Kept& k, size_t vocab) {  // the kept tokens' renormalized probabilities
  std::vector<double> p(vocab, 0.0);
  const double sum = std::accumulate(k.w.begin(), k.w.end(), 0.0);
  for (size_t j = 0; j < k.ids.size(); ++j) p[k.ids[j]] = k.w[j] / sum;
  return p;
}

const std::vector<float> kSmall = {1.0f, 0.5f, 2.0f, -1.0f, 0.0f, 1.5f, -0.5f, 0.8f};

TEST(SamplingGreedy, IsArgmaxWhateverTopKAndTopP) {
  for (uint32_t seed = 0; seed < 5; ++seed) {
    const std::vector<float> l = normal_logits(50257, 3.0f, seed);
    const int32_t want = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
    EXPECT_EQ(argmax(l.data(), int64_t(l.size())), want);
    for (const SamplingOptions& o : {SamplingOptions{0.0f, 0, 1.0f, seed}, SamplingOptions{0.0f, 5, 0.3f, seed}}) {
      Sampler s(o);
      EXPECT_EQ(s.sample(l.data(), int64_t(l.size())), want) << "seed " << seed;
      EXPECT_EQ(s.draws(), 1) << "greedy consumes its draw";
    }
  }
  const std::vector<float> tied = {-kInf, 1.0f, 3.0f, 2.0f, 3.0f, 3.0f};
  EXPECT_EQ(argmax(tied.data(), 6), 2);
  EXPECT_EQ(Sampler({0.0f}).sample(tied.data(), 6), 2);
}

TEST(SamplingDistribution, TemperatureMatchesSoftmaxOfScaledLogits) {
  const SamplingOptions o{0.7f, 0, 1.0f, 11};
  EXPECT_LT(chi_square(kSmall, o, 20000, softmax(kSmall, 0.7)), kChi2Critical);
  // The same draws against temperature 1's distribution must be rejected, or this test could not fail.
  EXPECT_GT(chi_square(kSmall, o, 20000, softmax(kSmall, 1.0)), kChi2Critical);
}

TEST(SamplingTopK, NeverLeavesTheTopKAndKeepsBoundaryTies) {
  const std::vector<float> l = normal_logits(1000, 3.0f, 3);  // distinct values
  std::vector<float> sorted = l;
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  Sampler s({2.0f, 10, 1.0f, 5});  // a high temperature, so the k-th token is drawn often too
  std::set<int32_t> seen;
  for (int i = 0; i < 5000; ++i) {
    const int32_t t = s.sample(l.data(), 1000);
    ASSERT_GE(l[t], sorted[9]) << "token " << t << " outside the top 10, draw " << i;
    seen.insert(t);
  }
  EXPECT_EQ(seen.size(), 10u);
  // k = 3 over {5, 4, 1, 1, 1, 0}: the three 1s tie at the boundary and are all kept; 0 never is.
  const std::vector<float> tied = {1.0f, 5.0f, 0.0f, 1.0f, 4.0f, 1.0f};
  const SamplingOptions o{3.0f, 3, 1.0f, 7};
  const std::vector<double> p = by_token(reference_kept(tied, o), tied.size());
  ASSERT_GT(p[0] * p[3] * p[5], 0.0);
  EXPECT_LT(chi_square(tied, o, 20000, p), kChi2Critical);
  EXPECT_GT(chi_square(tied, o, 20000, softmax(tied, 3.0)), kChi2Critical);  // token 2 appearing counts as rejected
}

TEST(SamplingTopP, NeverLeavesTheNucleus) {
  const std::vector<float> l = normal_logits(50257, 3.0f, 4);
  for (const SamplingOptions& o : {SamplingOptions{1.0f, 0, 0.9f, 1}, SamplingOptions{0.8f, 50, 0.9f, 2},
                                   SamplingOptions{1.5f, 2000, 0.5f, 3}}) {
    const Kept k = reference_kept(l, o);
    const std::set<int32_t> nucleus(k.ids.begin(), k.ids.end());
    Sampler s(o);
    for (int i = 0; i < 300; ++i) {
      const int32_t t = s.sample(l.data(), int64_t(l.size()));
      ASSERT_TRUE(nucleus.count(t)) << "token " << t << " outside the nucleus of " << nucleus.size() << ", top_k "
                                    << o.top_k << ", draw " << i;
    }
  }
}

TEST(SamplingTopP, ThePrefixThatReachesTopPExactlyIsTheNucleus) {
  const std::vector<float> flat(4, 1.0f);  // weights 1: the first two tokens reach 0.5 x 4 exactly
  Sampler s({1.0f, 0, 0.5f, 9});
  std::set<int32_t> seen;
  for (int i = 0; i < 200; ++i) seen.insert(s.sample(flat.data(), 4));
  EXPECT_EQ(seen, (std::set<int32_t>{0, 1}));
}

TEST(SamplingTopP, KeptTokensAreDrawnInRenormalizedProportion) {
  for (const SamplingOptions& o : {SamplingOptions{1.0f, 0, 0.8f, 21}, SamplingOptions{1.0f, 5, 1.0f, 22},
                                   SamplingOptions{0.7f, 6, 0.9f, 23}}) {
    const Kept k = reference_kept(kSmall, o);
    ASSERT_GT(k.ids.size(), 2u);
    ASSERT_LT(k.ids.size(), kSmall.size());
    EXPECT_LT(chi_square(kSmall, o, 20000, by_token(k, kSmall.size())), kChi2Critical) << o.top_k << " " << o.top_p;
    // Probabilities over the kept set but not renormalized (the rest spread on the others) must be rejected.
    std::vector<double> unfiltered = softmax(kSmall, o.temperature);
    EXPECT_GT(chi_square(kSmall, o, 20000, unfiltered), kChi2Critical) << o.top_k << " " << o.top_p;
  }
}

// Token for token against the reference: checks the order, the boundaries and the draw formula all at once, on the
// common vocabulary, on heavy ties (logits rounded to integers), on masked tokens and at GPT-2's offset; one Sampler
// across vocabulary sizes, so stale scratch would show.
TEST(SamplingContract, EveryTokenIsTheReferencesChoice) {
  std::vector<std::vector<float>> cases = {normal_logits(50257, 3.0f, 8), normal_logits(50257, 3.0f, 9),
                                           normal_logits(300, 1.0f, 10), {0.5f, -kInf, 0.5f, -0.0f, 0.0f, -kInf},
                                           normal_logits(50257, 3.0f, 14)};
  for (float& x : cases[1]) x = std::round(x);
  for (float& x : cases[4]) x -= 100.0f;  // where GPT-2's logits lie
  for (size_t i = 0; i < cases[2].size(); i += 3) cases[2][i] = -kInf;
  const SamplingOptions opts[] = {{1.0f, 0, 1.0f, 1},    {0.7f, 50, 1.0f, 2},   {1.0f, 0, 0.9f, 3},
                                  {1.3f, 50, 0.9f, 4},   {0.5f, 3000, 0.5f, 5}, {2.0f, 3, 1.0f, 6},
                                  {0.05f, 0, 0.99f, 7},  {1.0f, 1, 1.0f, 8}};
  for (const SamplingOptions& o : opts) {
    Sampler s(o);
    for (int64_t n = 0; n < 24; ++n) {
      const std::vector<float>& l = cases[n % cases.size()];
      ASSERT_EQ(s.sample(l.data(), int64_t(l.size())), reference_sample(l, o, uint64_t(n)))
          << "T " << o.temperature << " top_k " << o.top_k << " top_p " << o.top_p << " draw " << n << " vocab "
          << l.size();
    }
    EXPECT_EQ(s.draws(), 24);
  }
}

TEST(SamplingStream, DependsOnlyOnSeedAndPosition) {
  // Equal logits over 1024 tokens: the order is by id, so draw n is floor(u * 1024), the top 10 bits of the 24-bit
  // uniform: the header's formula, checked bit for bit.
  // The stream runs until a draw with u * 1024 an integer too, where "exceeds" (not "reaches") decides the token.
  const std::vector<float> flat(1024, 0.25f);
  uint64_t exact = 0;
  while ((splitmix64(42 ^ splitmix64(exact)) >> 40) % (1 << 14) != 0) ++exact;
  Sampler a({1.0f, 0, 1.0f, 42}), b({1.0f, 0, 1.0f, 42}), c({1.0f, 0, 1.0f, 43});
  int differ = 0;
  for (uint64_t n = 0; n < std::max<uint64_t>(200, exact + 1); ++n) {
    const int32_t t = a.sample(flat.data(), 1024);
    ASSERT_EQ(t, int32_t(splitmix64(42 ^ splitmix64(n)) >> 54)) << "draw " << n;
    ASSERT_EQ(b.sample(flat.data(), 1024), t) << "same seed, draw " << n;
    differ += c.sample(flat.data(), 1024) != t;
  }
  EXPECT_GT(differ, 150) << "seeds 42 and 43 gave nearly the same stream";
  EXPECT_LT(exact, 1000000u);
  // Draw 10 is the same whether the 10 calls before it saw these logits or others.
  const std::vector<float> other = normal_logits(77, 2.0f, 12);
  Sampler d({1.0f, 0, 1.0f, 42}), e({1.0f, 0, 1.0f, 42});
  for (int i = 0; i < 10; ++i) d.sample(flat.data(), 1024), e.sample(other.data(), 77);
  const int32_t tenth = d.sample(flat.data(), 1024);
  EXPECT_EQ(e.sample(flat.data(), 1024), tenth);
  EXPECT_EQ(e.draws(), 11);
  // Ten greedy tokens, then sampling from the greedy Sampler's position: draw 10 again.
  Sampler greedy({0.0f, 0, 1.0f, 42});
  for (int i = 0; i < 10; ++i) greedy.sample(other.data(), 77);
  EXPECT_EQ(Sampler({1.0f, 0, 1.0f, 42}, greedy.draws()).sample(flat.data(), 1024), tenth);
}

void expect_invalid(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "accepted; wanted an error naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(SamplingErrors, BadOptionsAndLogitsAreNamed) {
  const std::pair<SamplingOptions, const char*> bad[] = {
      {{-0.5f}, "temperature"}, {{kNaN}, "temperature"},     {{kInf}, "temperature"},
      {{1.0f, -1}, "top_k"},    {{1.0f, 0, 0.0f}, "top_p"},  {{1.0f, 0, 1.5f}, "top_p"},
      {{1.0f, 0, kNaN}, "top_p"}, {{1.0f, 0, -0.2f}, "top_p"}};
  for (const auto& [o, field] : bad) {
    expect_invalid([&] { o.validate(); }, std::string("SamplingOptions.") + field);
    expect_invalid([&] { Sampler s(o); }, std::string("SamplingOptions.") + field);
  }
  expect_invalid([] { Sampler s({}, -1); }, "draws");
  Sampler s({1.0f, 0, 0.9f, 1});
  std::vector<float> l(10, 0.0f);
  l[7] = kNaN;
  expect_invalid([&] { s.sample(l.data(), 10); }, "logits[7] is NaN");
  l[7] = kInf;
  expect_invalid([&] { s.sample(l.data(), 10); }, "logits[7] is +inf");
  expect_invalid([&] { s.sample(nullptr, 10); }, "logits is null");
  expect_invalid([&] { s.sample(l.data(), 0); }, "vocab");
  std::fill(l.begin(), l.end(), -kInf);
  expect_invalid([&] { s.sample(l.data(), 10); }, "no token is possible");
  expect_invalid([&] { argmax(l.data(), 10); }, "no token is possible");
  EXPECT_EQ(s.draws(), 0) << "a refused call consumed a draw";
  l[3] = 1.0f;
  expect_invalid([&] { log_probability(l.data(), 10, 10); }, "token 10");
  expect_invalid([&] { log_probability(l.data(), 10, -1); }, "token -1");
  l[4] = kNaN;
  expect_invalid([&] { log_probability(l.data(), 10, 3); }, "logits[4] is NaN");
}

// argmax reads the logits in chunks of 1024 as integer keys: against a plain first-maximum scan over lengths around
// the chunk's, with the maximum tied across chunks, at the last element, among negatives only, as +0 against -0, and
// beside -inf; the first NaN or +inf named wherever it lies.
TEST(SamplingGreedy, ArgmaxIsTheFirstMaximumAcrossChunks) {
  const auto naive = [](const std::vector<float>& l) {
    size_t at = 0;
    for (size_t i = 1; i < l.size(); ++i) at = l[i] > l[at] ? i : at;
    return int32_t(at);
  };
  std::mt19937 gen(77);
  for (size_t n : {size_t{1}, size_t{2}, size_t{1023}, size_t{1024}, size_t{1025}, size_t{3000}, size_t{50257}}) {
    std::uniform_int_distribution<size_t> pick(0, n - 1);
    for (int trial = 0; trial < 8; ++trial) {
      std::vector<float> l = normal_logits(int64_t(n), 3.0f, uint32_t(n + trial));
      const float top = *std::max_element(l.begin(), l.end());
      switch (trial) {
        case 1: l[pick(gen)] = top + 1.0f, l[pick(gen)] = top + 1.0f; break;  // a tie, maybe across chunks
        case 2: l.back() = top + 1.0f; break;
        case 3: for (float& x : l) x = -std::abs(x) - 1.0f; break;
        case 4: std::fill(l.begin(), l.end(), -1.0f), l[pick(gen)] = -0.0f, l[pick(gen)] = 0.0f; break;
        case 5: std::fill(l.begin(), l.end(), -kInf), l[pick(gen)] = -3.0f; break;
        case 6: std::fill(l.begin(), l.end(), 0.0f); break;
        case 7: for (size_t i = 0; i < n; i += 3) l[i] = -kInf; l[n / 2] = top + 2.0f; break;
        default: break;
      }
      EXPECT_EQ(argmax(l.data(), int64_t(n)), naive(l)) << "n " << n << " trial " << trial;
    }
    std::vector<float> l = normal_logits(int64_t(n), 3.0f, 5);
    const size_t a = pick(gen), b = pick(gen), first = std::min(a, b), second = std::max(a, b);
    l[first] = kInf, l[second] = kInf;
    expect_invalid([&] { argmax(l.data(), int64_t(n)); }, "logits[" + std::to_string(first) + "] is +inf");
    l[second] = kNaN;  // a NaN anywhere is named before any +inf
    expect_invalid([&] { argmax(l.data(), int64_t(n)); }, "logits[" + std::to_string(second) + "] is NaN");
  }
}

TEST(SamplingLogProbability, MatchesNaiveLogSoftmax) {
  std::vector<float> l = normal_logits(50257, 3.0f, 13);
  l[5] = -kInf;
  double mx = -kInf, sum = 0.0;
  for (float x : l) mx = std::max(mx, double(x));
  for (float x : l) sum += std::exp(double(x) - mx);
  for (int32_t t : {0, 1, 777, 50256, int32_t(std::max_element(l.begin(), l.end()) - l.begin())}) {
    const double want = double(l[t]) - mx - std::log(sum);
    EXPECT_NEAR(log_probability(l.data(), int64_t(l.size()), t), want, 1e-12 * std::abs(want) + 1e-12) << t;
  }
  EXPECT_EQ(log_probability(l.data(), int64_t(l.size()), 5), -std::numeric_limits<double>::infinity());
  const float one = 3.0f;
  EXPECT_EQ(log_probability(&one, 1, 0), 0.0);
}

}  // namespace
}  // namespace gpt2attn
