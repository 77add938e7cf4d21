// model/gpt2.cpp: the GPT-2 runner (gpt2attn/gpt2.hpp) over the public API: CausalSelfAttention's forward and ragged
// step, Linear for the MLPs and the LM head, the row operations for LayerNorm, GELU and the residuals.
#include "gpt2attn/gpt2.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gpt2attn/attention.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/linear.hpp"
#include "gpt2attn/ops.hpp"

namespace gpt2attn {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

std::vector<float> f32_copy(const TensorView& v) {
  std::vector<float> out(static_cast<size_t>(v.numel()));
  copy_to_f32(v, out.data());
  return out;
}

struct Block {
  std::vector<float> ln_1_w, ln_1_b, ln_2_w, ln_2_b;
  CausalSelfAttention attn;
  Linear fc, proj;
};

// The LM head's format: the model's, except that int4 keeps the head at int8 (gpt2.hpp says why).
EngineOptions head_options(EngineOptions o) {
  if (o.weights == WeightFormat::int4) o.weights = WeightFormat::int8;
  return o;
}

// Grows v to at least n elements (never shrinks): the runner's scratch allocates only when a call is larger than
// every one before it.
void grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

struct GPT2::Impl {
  GPT2Config cfg;
  EngineOptions opts;
  std::vector<float> wte, wpe;  // (vocab, E), (n_positions, E) f32: the embeddings gathered per token
  std::vector<Block> blocks;
  std::vector<float> ln_f_w, ln_f_b;
  Linear head;                  // (vocab, E) = wte, few-row panels only (LinearPaths::few_rows)
  Workspace ws;                 // every layer's and Linear's scratch, one call at a time
  std::mutex mu;
  // Scratch of a call, (rows, E) unless said: h the residual stream, a the normalised input of a sublayer, o a
  // sublayer's output, ff (rows, inner) the MLP's hidden activations.
  std::vector<float> h, a, o, ff;
  std::vector<int64_t> lengths, positions;
  std::vector<SequenceId> layer_ids;

  // `checked`: c's weights passed GPT2Weights::validate's checks already (open_gpt2_checkpoint runs them, naming the
  // file), so they are not scanned a second time here; the layers built below check what they take either way.
  Impl(const GPT2Checkpoint& c, const EngineOptions& o, bool checked);

  RowOpOptions row_options(const RunOptions& run) const { return {run.threads ? run.threads : opts.threads, opts.isa}; }
  void check_ids(const int32_t* ids, int64_t n, const char* call) const {
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= cfg.vocab_size) {
        invalid(std::string(call) + ": token id " + str(ids[i]) + " at " + str(i) + " is outside the vocabulary [0, " +
                str(cfg.vocab_size) + ")");
      }
    }
  }
  // h[r] = wte[ids[r]] + wpe[positions[r]] for r < M.
  void embed(const int32_t* ids, const int64_t* positions, int64_t M) {
    const int64_t E = cfg.n_embd;
    for (int64_t r = 0; r < M; ++r) {
      const float* t = wte.data() + ids[r] * E;
      const float* p = wpe.data() + positions[r] * E;
      float* y = h.data() + r * E;
      for (int64_t e = 0; e < E; ++e) y[e] = t[e] + p[e];
    }
  }
  // Block l's MLP half on M rows of h: h += c_proj(gelu(c_fc(ln_2(h)))).
  void mlp(Block& b, int64_t M, const RunOptions& run) {
    const int64_t E = cfg.n_embd, I = cfg.inner();
    const RowOpOptions r = row_options(run);
    layer_norm(h.data(), M, E, b.ln_2_w.data(), b.ln_2_b.data(), cfg.layer_norm_epsilon, a.data(), r);
    b.fc.forward(a.data(), M, ff.data(), run, &ws);
    gelu_tanh(ff.data(), M * I, r);
    b.proj.forward(ff.data(), M, o.data(), run, &ws);
    residual_add(h.data(), o.data(), M * E, r);
  }
  void reserve_rows(int64_t M) {
    grow(h, M * cfg.n_embd), grow(a, M * cfg.n_embd), grow(o, M * cfg.n_embd), grow(ff, M * cfg.inner());
  }
};

namespace {
// c's wte once c is checked (validate() unless the caller checked it): the head is the first member built from it.
const TensorView& checked_wte(const GPT2Checkpoint& c, bool checked) {
  if (!checked) c.weights.validate(c.config);
  return c.weights.wte;
}
}  // namespace

GPT2::Impl::Impl(const GPT2Checkpoint& c, const EngineOptions& o, bool checked)
    : cfg(c.config),
      opts(o),
      head(checked_wte(c, checked), {}, head_options(o),
           LinearPaths::few_rows) {
  opts.threads = head.default_threads();
  const GPT2Weights& w = c.weights;
  wte = f32_copy(w.wte), wpe = f32_copy(w.wpe);
  ln_f_w = f32_copy(w.ln_f_weight), ln_f_b = f32_copy(w.ln_f_bias);
  blocks.reserve(static_cast<size_t>(cfg.n_layer));
  for (const GPT2BlockWeights& b : w.blocks) {
    blocks.push_back(Block{f32_copy(b.ln_1_weight), f32_copy(b.ln_1_bias), f32_copy(b.ln_2_weight),
                           f32_copy(b.ln_2_bias), CausalSelfAttention(cfg.attention(), b.attn, o),
                           Linear(b.fc_weight, b.fc_bias, o), Linear(b.proj_weight, b.proj_bias, o)});
  }
}

GPT2::GPT2(const GPT2Checkpoint& checkpoint, const EngineOptions& options)
    : impl_(std::make_unique<Impl>(checkpoint, options, /*checked=*/false)) {}
GPT2::GPT2(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GPT2 GPT2::from_pretrained(const std::string& dir, const EngineOptions& options) {
  return GPT2(std::make_unique<Impl>(open_gpt2_checkpoint(dir), options, /*checked=*/true));
}
GPT2::~GPT2() = default;
GPT2::GPT2(GPT2&&) noexcept = default;
GPT2& GPT2::operator=(GPT2&&) noexcept = default;

const GPT2Config& GPT2::config() const { return impl_->cfg; }
const EngineOptions& GPT2::options() const { return impl_->opts; }

size_t GPT2::weight_bytes() const {
  const Impl& m = *impl_;
  size_t n = (m.wte.size() + m.wpe.size() + m.ln_f_w.size() + m.ln_f_b.size()) * sizeof(float) + m.head.weight_bytes();
  for (const Block& b : m.blocks) {
    n += b.fc.weight_bytes() + b.proj.weight_bytes() + 4 * b.ln_1_w.size() * sizeof(float);
    // Attention: decode's panels and the GEMMs' copy of 4 E x E weights, in the format's bytes (and the biases).
    const double per = m.opts.weights == WeightFormat::int4   ? 0.5 + 0.5
                       : m.opts.weights == WeightFormat::int8 ? 1.0 + 1.0
                                                              : 2.0 * static_cast<double>(size_of(m.opts.compute));
    n += static_cast<size_t>(per * 4.0 * static_cast<double>(m.cfg.n_embd * m.cfg.n_embd));
  }
  return n;
}

ModelKvCache GPT2::make_cache(const KvCacheOptions& options) const {
  return ModelKvCache(impl_->cfg.attention(), impl_->cfg.n_layer, options);
}

void GPT2::logits(const int32_t* ids, int64_t T, float* out, const RunOptions& run) {
  Impl& m = *impl_;
  if (T < 1 || T > m.cfg.n_positions) {
    invalid("GPT2::logits: expected 1 <= T <= n_positions = " + str(m.cfg.n_positions) + ", got T = " + str(T));
  }
  if (!ids || !out) invalid("GPT2::logits: ids and out must not be null");
  m.check_ids(ids, T, "GPT2::logits");
  std::lock_guard<std::mutex> lock(m.mu);
  m.reserve_rows(T);
  std::vector<int64_t>& pos = m.positions;
  pos.resize(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = t;
  m.embed(ids, pos.data(), T);
  const int64_t E = m.cfg.n_embd;
  const RowOpOptions r = m.row_options(run);
  for (Block& b : m.blocks) {
    layer_norm(m.h.data(), T, E, b.ln_1_w.data(), b.ln_1_b.data(), m.cfg.layer_norm_epsilon, m.a.data(), r);
    b.attn.forward(m.a.data(), 1, T, m.o.data(), run, &m.ws);
    residual_add(m.h.data(), m.o.data(), T * E, r);
    m.mlp(b, T, run);
  }
  layer_norm(m.h.data(), T, E, m.ln_f_w.data(), m.ln_f_b.data(), m.cfg.layer_norm_epsilon, m.a.data(), r);
  m.head.forward(m.a.data(), T, out, run, &m.ws);
}

void GPT2::step(ModelKvCache& cache, const SequenceId* seqs, const int64_t* tokens, int64_t n, const int32_t* ids,
                float* logits, bool all_positions, const RunOptions& run) {
  Impl& m = *impl_;
  const GPT2Config& c = m.cfg;
  if (n < 1) invalid("GPT2::step: expected n >= 1 entries, got " + str(n));
  if (!seqs || !tokens || !ids || !logits) invalid("GPT2::step: seqs, tokens, ids and logits must not be null");
  if (cache.layers() != c.n_layer || cache.config().d_model != c.n_embd || cache.config().num_heads != c.n_head) {
    invalid("GPT2::step: the cache is for " + str(cache.layers()) + " layers of d_model " +
            str(cache.config().d_model) + ", " + str(cache.config().num_heads) + " heads; this model has " +
            str(c.n_layer) + " of " + str(c.n_embd) + ", " + str(c.n_head) + " (make it with GPT2::make_cache)");
  }
  std::lock_guard<std::mutex> lock(m.mu);
  m.lengths.resize(static_cast<size_t>(n));
  int64_t M = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 1) invalid("GPT2::step: entry " + str(i) + " has " + str(tokens[i]) + " tokens (at least 1)");
    const int64_t len = cache.length(seqs[i]);  // invalid_argument for an unknown sequence
    if (len + tokens[i] > c.n_positions) {
      invalid("GPT2::step: entry " + str(i) + " (sequence " + str(seqs[i]) + ") would hold " + str(len + tokens[i]) +
              " tokens, past n_positions = " + str(c.n_positions));
    }
    m.lengths[static_cast<size_t>(i)] = len;
    M += tokens[i];
  }
  m.check_ids(ids, M, "GPT2::step");
  // Every pool holds the same blocks, so one count tells whether each layer's step can run; checked here so that a
  // step refused for room fails before layer 0 appends anything.
  const int64_t need = cache.blocks_needed(seqs, tokens, n), free = cache.free_blocks();
  if (need > free) {
    fail(ErrorCode::out_of_memory, "GPT2::step: the step needs " + str(need) + " KV blocks a layer, the cache has " +
                                       str(free) + " free");
  }
  m.layer_ids.resize(static_cast<size_t>(n * c.n_layer));
  cache.layer_ids(seqs, n, m.layer_ids.data());

  m.reserve_rows(M);
  m.positions.resize(static_cast<size_t>(M));
  for (int64_t i = 0, r = 0; i < n; ++i) {
    for (int64_t t = 0; t < tokens[i]; ++t) m.positions[static_cast<size_t>(r++)] = m.lengths[static_cast<size_t>(i)] + t;
  }
  m.embed(ids, m.positions.data(), M);
  const int64_t E = c.n_embd;
  const RowOpOptions r = m.row_options(run);
  try {
    for (int64_t l = 0; l < c.n_layer; ++l) {
      Block& b = m.blocks[static_cast<size_t>(l)];
      layer_norm(m.h.data(), M, E, b.ln_1_w.data(), b.ln_1_b.data(), c.layer_norm_epsilon, m.a.data(), r);
      b.attn.step(cache.layer(l), m.layer_ids.data() + l * n, tokens, n, m.a.data(), m.o.data(), run, &m.ws);
      residual_add(m.h.data(), m.o.data(), M * E, r);
      m.mlp(b, M, run);
    }
    // The rows whose logits are asked for: every row, or each entry's last, gathered to the front of `a`.
    int64_t rows = M;
    if (all_positions) {
      layer_norm(m.h.data(), M, E, m.ln_f_w.data(), m.ln_f_b.data(), c.layer_norm_epsilon, m.a.data(), r);
    } else {
      rows = n;
      for (int64_t i = 0, end = 0; i < n; ++i) {
        end += tokens[i];
        std::copy_n(m.h.data() + (end - 1) * E, E, m.o.data() + i * E);
      }
      layer_norm(m.o.data(), n, E, m.ln_f_w.data(), m.ln_f_b.data(), c.layer_norm_epsilon, m.a.data(), r);
    }
    m.head.forward(m.a.data(), rows, logits, run, &m.ws);
  } catch (...) {
    // A layer refused after earlier ones appended (a non-finite value, memory): every sequence back to its length.
    for (int64_t i = 0; i < n; ++i) {
      try {
        cache.truncate(seqs[i], m.lengths[static_cast<size_t>(i)]);
      } catch (...) {  // the sequence is unknown no more than it was; the first error is the one to report
      }
    }
    throw;
  }
}

std::vector<Generation> GPT2::generate(const std::vector<std::vector<int32_t>>& prompts,
                                       const GenerateOptions& options) {
  const GPT2Config& c = impl_->cfg;
  if (options.max_new_tokens < 1) {
    invalid("GPT2::generate: max_new_tokens must be at least 1, got " + str(options.max_new_tokens));
  }
  KvCacheOptions k;
  k.dtype = options.kv_dtype;
  const int64_t bt = KvCache::default_block_tokens(c.attention());
  for (const std::vector<int32_t>& p : prompts) {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(p.size()) + options.max_new_tokens, c.n_positions);
    k.capacity_tokens += (len + bt - 1) / bt * bt;
  }
  k.capacity_tokens = std::max<int64_t>(k.capacity_tokens, bt);
  ModelKvCache cache = make_cache(k);
  return generate(cache, prompts, options);
}

std::vector<Generation> GPT2::generate(ModelKvCache& cache, const std::vector<std::vector<int32_t>>& prompts,
                                       const GenerateOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const GPT2Config& c = impl_->cfg;
  options.sampling.validate();
  if (options.max_new_tokens < 1) {
    invalid("GPT2::generate: max_new_tokens must be at least 1, got " + str(options.max_new_tokens));
  }
  if (options.max_step_tokens < 1) {
    invalid("GPT2::generate: max_step_tokens must be at least 1, got " + str(options.max_step_tokens));
  }
  if (prompts.empty()) invalid("GPT2::generate: no prompts");
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t len = static_cast<int64_t>(prompts[i].size());
    if (len < 1 || len >= c.n_positions) {
      invalid("GPT2::generate: prompt " + str(static_cast<int64_t>(i)) + " has " + str(len) +
              " ids; expected 1 to n_positions - 1 = " + str(c.n_positions - 1));
    }
    impl_->check_ids(prompts[i].data(), len, ("GPT2::generate: prompt " + str(static_cast<int64_t>(i))).c_str());
  }
  for (int32_t s : options.stop_tokens) {
    if (s < 0 || s >= c.vocab_size) invalid("GPT2::generate: stop token " + str(s) + " is outside the vocabulary");
  }

  const int64_t P = static_cast<int64_t>(prompts.size());
  std::vector<Generation> out(static_cast<size_t>(P));
  std::vector<SequenceId> seq;
  // Every sequence made here is released on the way out, whatever happens.
  struct Release {
    ModelKvCache& cache;
    std::vector<SequenceId>& seq;
    ~Release() {
      for (SequenceId s : seq) {
        try {
          cache.release(s);
        } catch (...) {
        }
      }
    }
  } release{cache, seq};
  std::vector<Sampler> samplers;
  std::vector<int64_t> fed(static_cast<size_t>(P), 0);  // prompt ids fed so far
  std::vector<bool> done(static_cast<size_t>(P), false);
  for (int64_t i = 0; i < P; ++i) {
    seq.push_back(cache.create());
    SamplingOptions s = options.sampling;
    s.seed += static_cast<uint64_t>(i);
    samplers.emplace_back(s);
    out[static_cast<size_t>(i)].prompt_ids = prompts[static_cast<size_t>(i)];
  }

  std::vector<SequenceId> step_seqs;
  std::vector<int64_t> step_tokens, step_owner;
  std::vector<int32_t> step_ids;
  std::vector<float> logits;
  const int64_t V = c.vocab_size;
  for (;;) {
    step_seqs.clear(), step_tokens.clear(), step_owner.clear(), step_ids.clear();
    int64_t budget = options.max_step_tokens;
    bool chunked = false;  // a prompt chunk is in this step
    // Running sequences' next tokens first (one each: their latency; every one of them, whatever the budget, so none
    // waits behind the others), then prompt chunks in the budget left. Batch
    // invariant: a prompt is cut into chunks of max_step_tokens from its start, whatever shares its steps (a chunk's
    // length picks its attention kernel, which its later layers' inputs depend on), and a step takes whole chunks,
    // at least one.
    const bool fixed_chunks = options.run.batch_invariant;
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t i = 0; i < P && (pass == 0 || budget > 0 || (fixed_chunks && !chunked)); ++i) {
        const size_t u = static_cast<size_t>(i);
        const std::vector<int32_t>& p = prompts[u];
        const bool prefilling = fed[u] < static_cast<int64_t>(p.size());
        if (done[u] || prefilling != (pass == 1)) continue;
        const int64_t rest = static_cast<int64_t>(p.size()) - fed[u];
        int64_t take = prefilling ? std::min<int64_t>(budget, rest) : 1;
        if (prefilling && fixed_chunks) {
          take = std::min<int64_t>(options.max_step_tokens, rest);
          if (chunked && take > budget) continue;
        }
        chunked = chunked || prefilling;
        if (prefilling) {
          step_ids.insert(step_ids.end(), p.begin() + fed[u], p.begin() + fed[u] + take);
          fed[u] += take;
        } else {
          step_ids.push_back(out[u].new_ids.back());
        }
        step_seqs.push_back(seq[u]), step_tokens.push_back(take), step_owner.push_back(i);
        budget = std::max<int64_t>(0, budget - take);
      }
    }
    if (step_seqs.empty()) break;
    const int64_t n = static_cast<int64_t>(step_seqs.size());
    grow(logits, n * V);
    step(cache, step_seqs.data(), step_tokens.data(), n, step_ids.data(), logits.data(), false, options.run);
    for (int64_t e = 0; e < n; ++e) {
      const size_t u = static_cast<size_t>(step_owner[static_cast<size_t>(e)]);
      if (fed[u] < static_cast<int64_t>(prompts[u].size())) continue;  // a chunk short of the prompt's end
      const float* row = logits.data() + e * V;
      Generation& g = out[u];
      const int32_t id = samplers[u].sample(row, V);
      g.new_ids.push_back(id);
      if (options.logprobs) g.logprobs.push_back(log_probability(row, V, id));
      g.total_ms = ms_since(t0);
      if (g.new_ids.size() == 1) g.first_token_ms = g.total_ms;
      const bool stop = std::find(options.stop_tokens.begin(), options.stop_tokens.end(), id) !=
                        options.stop_tokens.end();
      // The next step would append this token: the sequence then holds prompt + new ids, at most n_positions.
      const int64_t held = static_cast<int64_t>(prompts[u].size() + g.new_ids.size());
      if (stop || static_cast<int64_t>(g.new_ids.size()) == options.max_new_tokens || held >= c.n_positions) {
        done[u] = true;
        g.finish_reason = stop ? "stop" : "length";
      }
    }
  }
  return out;
}

}  // namespace gpt2attn
