// tools/serve/scheduler.cpp: the continuous-batching loop of `gpt2attn serve` (see scheduler.hpp). Admission reserves
// each choice's whole length (prompt + max_tokens - 1 cached tokens) in KV blocks, so a running sequence never finds
// the cache full and nothing is ever preempted; the price is admitting fewer sequences than a cache that swapped or
// recomputed could. No HTTP here.
#include "tools/serve/scheduler.hpp"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <utility>

#include "gpt2attn/error.hpp"

namespace gpt2attn::serve {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The cached tokens a choice takes at most: its prompt and every sampled id but the last, which is never fed back.
int64_t final_tokens(const CompletionParams& p) { return static_cast<int64_t>(p.prompt.size()) + p.max_tokens - 1; }

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Request: the state one HTTP thread reads while the scheduler thread writes it.

Request::Request(std::vector<CompletionParams> choices)
    : params_(std::move(choices)), choices_(params_.size()), unfinished_(params_.size()) {}

Request::Progress Request::read(size_t choice, size_t from, std::vector<int32_t>* ids,
                                std::vector<double>* logprobs) const {
  std::lock_guard<std::mutex> lk(mu_);
  const Choice& c = choices_.at(choice);
  Progress p;
  p.tokens = c.ids.size();
  p.finished = !c.finish_reason.empty();
  p.finish_reason = c.finish_reason;
  p.error = c.error;
  if (from < c.ids.size()) {
    if (ids) ids->insert(ids->end(), c.ids.begin() + static_cast<ptrdiff_t>(from), c.ids.end());
    if (logprobs && !c.logprobs.empty()) {
      logprobs->insert(logprobs->end(), c.logprobs.begin() + static_cast<ptrdiff_t>(from), c.logprobs.end());
    }
  }
  return p;
}

uint64_t Request::wait(uint64_t seen, std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return version_ != seen; });
  return version_;
}

bool Request::finished() const {
  std::lock_guard<std::mutex> lk(mu_);
  return unfinished_ == 0;
}

void Request::push(size_t choice, int32_t id, double logprob) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    Choice& c = choices_[choice];
    c.ids.push_back(id);
    if (params_[choice].logprobs) c.logprobs.push_back(logprob);
    ++version_;
  }
  cv_.notify_all();
}

void Request::finish(size_t choice, const std::string& reason, const std::string& error) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    Choice& c = choices_[choice];
    if (!c.finish_reason.empty()) return;
    c.finish_reason = reason;
    c.error = error;
    --unfinished_;
    ++version_;
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------------------------
// Scheduler

struct Scheduler::Sequence {
  std::shared_ptr<Request> request;
  size_t choice;
  SequenceId seq;
  int64_t fed;                     // prompt ids in the cache (a fork starts at the prefix it shares)
  Sampler sampler;
  std::vector<int32_t> generated;  // the ids sampled so far; the last is fed at the next step
  bool ended = false;

  const CompletionParams& params() const { return request->params(choice); }
  int64_t prompt_size() const { return static_cast<int64_t>(params().prompt.size()); }
  // Token t of the sequence as the cache holds it (t < cached length): its prompt, then its sampled ids.
  int32_t token(int64_t t) const {
    const int64_t P = prompt_size();
    return t < P ? params().prompt[static_cast<size_t>(t)] : generated[static_cast<size_t>(t - P)];
  }
};

Scheduler::Scheduler(GPT2& model, ModelKvCache cache, const SchedulerOptions& options)
    : model_(model),
      cache_(std::move(cache)),
      options_(options),
      config_(model.config()),
      block_tokens_(cache_.block_tokens()),
      total_blocks_(cache_.total_blocks()) {
  if (options_.max_batch_tokens < 1) invalid("Scheduler: max_batch_tokens must be at least 1");
  if (options_.max_queue < 1) invalid("Scheduler: max_queue must be at least 1");
  metrics_.kv_blocks_total = total_blocks_;
  metrics_.kv_blocks_free = cache_.free_blocks();
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    quit_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

Scheduler::Submission Scheduler::submit(const std::shared_ptr<Request>& request) {
  const int64_t V = config_.vocab_size, N = config_.n_positions;
  const size_t n = request->size();
  if (n == 0) return {Verdict::bad_request, "no prompt"};
  for (size_t i = 0; i < n; ++i) {
    const CompletionParams& p = request->params(i);
    const std::string which = n > 1 ? "prompt " + std::to_string(i) + ": " : "prompt: ";
    const int64_t P = static_cast<int64_t>(p.prompt.size());
    if (P == 0) return {Verdict::bad_request, which + "no token ids"};
    for (int64_t j = 0; j < P; ++j) {
      const int32_t id = p.prompt[static_cast<size_t>(j)];
      if (id < 0 || id >= V) {
        return {Verdict::bad_request, which + "token id " + std::to_string(id) + " at " + std::to_string(j) +
                                          " is outside the vocabulary [0, " + std::to_string(V) + ")"};
      }
    }
    for (int32_t id : p.stop) {
      if (id < 0 || id >= V) {
        return {Verdict::bad_request,
                "stop: token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(V) + ")"};
      }
    }
    if (p.max_tokens < 1) return {Verdict::bad_request, "max_tokens must be at least 1"};
    try {
      p.sampling.validate();
    } catch (const Error& e) {
      return {Verdict::bad_request, e.what()};
    }
    if (p.max_tokens > N - P) {  // P + max_tokens > N, without overflow at a huge max_tokens
      return {Verdict::too_long, which + std::to_string(P) + " ids + max_tokens " + std::to_string(p.max_tokens) +
                                     " is more than the model's context (n_positions = " + std::to_string(N) +
                                     " tokens)"};
    }
    if (ceil_div(final_tokens(p), block_tokens_) > total_blocks_) {
      return {Verdict::too_long, which + std::to_string(P) + " ids + max_tokens " + std::to_string(p.max_tokens) +
                                     " need more than the whole KV cache holds (" +
                                     std::to_string(total_blocks_ * block_tokens_) + " tokens)"};
    }
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!accepting_.load()) return {Verdict::shutting_down, "the server is shutting down"};
    if (static_cast<int64_t>(waiting_.size() + n) > options_.max_queue) {
      return {Verdict::queue_full, std::to_string(waiting_.size()) + " prompts already wait for room (max-queue " +
                                       std::to_string(options_.max_queue) + "); retry later"};
    }
    for (size_t i = 0; i < n; ++i) waiting_.push_back({request, i});
  }
  cv_.notify_all();
  return {Verdict::accepted, ""};
}

void Scheduler::cancel(Request& request) {
  request.cancel_.store(true, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(mu_);  // so that a scheduler about to wait sees it
  }
  cv_.notify_all();
}

void Scheduler::stop_accepting() {
  std::lock_guard<std::mutex> lk(mu_);
  accepting_.store(false);
}

bool Scheduler::wait_idle(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  return idle_cv_.wait_until(lk, deadline, [&] { return running_ == 0 && waiting_.empty(); });
}

void Scheduler::cancel_all() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    cancel_all_ = true;
  }
  cv_.notify_all();
}

SchedulerMetrics Scheduler::metrics() const {
  std::lock_guard<std::mutex> lk(metrics_mu_);
  return metrics_;
}

void Scheduler::end(Sequence& s, const std::string& reason, const std::string& error) {
  try {
    cache_.release(s.seq);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt2attn serve: releasing sequence %lld: %s\n", static_cast<long long>(s.seq), e.what());
  }
  s.request->finish(s.choice, reason, error);
  s.ended = true;
  std::lock_guard<std::mutex> lk(metrics_mu_);
  ++metrics_.finished[reason];
}

void Scheduler::publish(const std::vector<Sequence>& running) {
  const int64_t free_blocks = cache_.free_blocks();
  bool idle = false;
  int64_t waiting = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    running_ = static_cast<int64_t>(running.size());
    waiting = static_cast<int64_t>(waiting_.size());
    idle = running_ == 0 && waiting_.empty();
  }
  {
    std::lock_guard<std::mutex> lk(metrics_mu_);
    metrics_.running = static_cast<int64_t>(running.size());
    metrics_.waiting = waiting;
    metrics_.kv_blocks_free = free_blocks;
  }
  if (idle) idle_cv_.notify_all();
}

void Scheduler::loop() {
  std::vector<Sequence> running;
  for (;;) {
    bool quit = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return quit_ || cancel_all_ || !running.empty() || !waiting_.empty(); });
      if (quit_ || cancel_all_) {
        for (const Waiting& w : waiting_) {
          w.request->finish(w.choice, "cancelled");
          std::lock_guard<std::mutex> mk(metrics_mu_);
          ++metrics_.finished["cancelled"];
        }
        waiting_.clear();
        quit = quit_;
        cancel_all_ = false;
      }
    }
    for (Sequence& s : running) {
      if (quit || s.request->cancel_requested()) end(s, "cancelled");
    }
    std::erase_if(running, [](const Sequence& s) { return s.ended; });
    if (quit) {
      publish(running);
      return;
    }
    admit(running);
    if (!running.empty()) step(running);
    publish(running);
  }
}

void Scheduler::admit(std::vector<Sequence>& running) {
  std::lock_guard<std::mutex> lk(mu_);
  // Blocks the running sequences will still take, each up to its whole length: admission leaves them untouched.
  std::vector<SequenceId> seqs;
  std::vector<int64_t> rest;
  for (const Sequence& s : running) {
    seqs.push_back(s.seq);
    rest.push_back(final_tokens(s.params()) - cache_.length(s.seq));
  }
  int64_t reserved = cache_.blocks_needed(seqs.data(), rest.data(), static_cast<int64_t>(seqs.size()));
  const int64_t free_blocks = cache_.free_blocks();
  int64_t admitted_prompt_tokens = 0, shared_tokens = 0;
  while (!waiting_.empty()) {
    const Waiting w = waiting_.front();
    if (w.request->cancel_requested()) {
      waiting_.pop_front();
      w.request->finish(w.choice, "cancelled");
      std::lock_guard<std::mutex> mk(metrics_mu_);
      ++metrics_.finished["cancelled"];
      continue;
    }
    const CompletionParams& p = w.request->params(w.choice);
    const int64_t P = static_cast<int64_t>(p.prompt.size());
    // Prefix sharing: the running sequence that shares the longest run of whole blocks with this prompt (at most
    // P - 1 tokens: the last prompt token must run to give the first logits), in its cached tokens or in the prompt
    // it is still prefilling. In the latter case the head waits for that prefill to reach the shared blocks (a step
    // or so) rather than compute them a second time: a burst of requests with one system prompt computes it once.
    // Batch invariant: a fork shares whole chunks (multiples of max_batch_tokens), so the child's own chunks end
    // where they would alone and the shared tokens were computed in the chunks it would have run.
    const int64_t unit = options_.run.batch_invariant ? options_.max_batch_tokens : block_tokens_;
    int64_t prefix = 0;
    const Sequence* parent = nullptr;
    for (const Sequence& s : running) {
      const int64_t limit = std::min(std::max(cache_.length(s.seq), s.prompt_size()), P - 1);
      if (limit < unit || limit <= prefix) continue;
      int64_t common = 0;
      while (common < limit && s.token(common) == p.prompt[static_cast<size_t>(common)]) ++common;
      const int64_t whole = common / unit * unit;
      if (whole > prefix) prefix = whole, parent = &s;
    }
    if (parent && cache_.length(parent->seq) < prefix) break;
    // FIFO: the head waits for room rather than be overtaken by smaller requests behind it (no starvation).
    const int64_t need = ceil_div(final_tokens(p) - prefix, block_tokens_);
    if (reserved + need > free_blocks) break;
    const SequenceId seq = parent ? cache_.fork(parent->seq, prefix) : cache_.create();
    running.push_back(Sequence{w.request, w.choice, seq, prefix, Sampler(p.sampling), {}});
    reserved += need;
    admitted_prompt_tokens += P;
    shared_tokens += prefix;
    waiting_.pop_front();
  }
  if (running.empty() && !waiting_.empty()) {
    // Not reachable: an empty cache holds any choice submit() let through. Ended rather than waited on forever.
    const Waiting w = waiting_.front();
    waiting_.pop_front();
    w.request->finish(w.choice, "error", "the KV cache cannot hold this prompt and max_tokens");
  }
  running_ = static_cast<int64_t>(running.size());
  std::lock_guard<std::mutex> mk(metrics_mu_);
  metrics_.prompt_tokens += admitted_prompt_tokens;
  metrics_.prefix_tokens_shared += shared_tokens;
  metrics_.waiting = static_cast<int64_t>(waiting_.size());
  metrics_.running = running_;
}

void Scheduler::step(std::vector<Sequence>& running) {
  std::vector<SequenceId> seqs;
  std::vector<int64_t> tokens;
  std::vector<size_t> owner;
  std::vector<int32_t> ids;
  // Every running sequence's next token first (its latency is the stream's inter-token time), then prompt chunks in
  // the budget left, oldest admission first. The budget bounds the prompt chunks: a step always takes every decode.
  // Batch invariant (the default): a prompt's chunks end at multiples of max_batch_tokens from its start, whatever
  // else runs (a chunk's length picks its attention kernel, which the prompt's later layers depend on), and a step
  // takes whole chunks, at least one.
  const bool fixed = options_.run.batch_invariant;
  const int64_t chunk = options_.max_batch_tokens;
  int64_t budget = options_.max_batch_tokens;
  bool chunked = false;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < running.size(); ++i) {
      Sequence& s = running[i];
      const bool prefilling = s.fed < s.prompt_size();
      if (prefilling != (pass == 1)) continue;
      if (prefilling && budget <= 0 && (chunked || !fixed)) break;
      int64_t take = prefilling ? std::min(budget, s.prompt_size() - s.fed) : 1;
      if (prefilling && fixed) {
        take = std::min((s.fed / chunk + 1) * chunk, s.prompt_size()) - s.fed;
        if (chunked && take > budget) continue;
      }
      chunked = chunked || prefilling;
      if (prefilling) {
        const auto& prompt = s.params().prompt;
        ids.insert(ids.end(), prompt.begin() + s.fed, prompt.begin() + s.fed + take);
      } else {
        ids.push_back(s.generated.back());
      }
      seqs.push_back(s.seq), tokens.push_back(take), owner.push_back(i);
      budget = std::max<int64_t>(0, budget - take);
    }
  }
  const int64_t n = static_cast<int64_t>(seqs.size()), V = config_.vocab_size;
  if (n == 0) return;
  logits_.resize(static_cast<size_t>(n * V));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    model_.step(cache_, seqs.data(), tokens.data(), n, ids.data(), logits_.data(), false, options_.run);
  } catch (const std::exception& e) {
    // The step changed no sequence; its sequences end, the others carry on.
    std::fprintf(stderr, "gpt2attn serve: a step of %lld sequences failed: %s\n", static_cast<long long>(n),
                 e.what());
    for (size_t i : owner) end(running[i], "error", e.what());
    std::erase_if(running, [](const Sequence& s) { return s.ended; });
    return;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t generated = 0;
  for (int64_t e = 0; e < n; ++e) {
    Sequence& s = running[owner[static_cast<size_t>(e)]];
    if (s.fed < s.prompt_size()) s.fed += tokens[static_cast<size_t>(e)];
    if (s.fed < s.prompt_size()) continue;  // a chunk short of the prompt's end: its logits are not needed
    const float* row = logits_.data() + e * V;
    const CompletionParams& p = s.params();
    int32_t id = 0;
    double logprob = 0;
    try {
      id = s.sampler.sample(row, V);
      if (p.logprobs) logprob = log_probability(row, V, id);
    } catch (const std::exception& ex) {
      end(s, "error", ex.what());
      continue;
    }
    s.generated.push_back(id);
    s.request->push(s.choice, id, logprob);
    ++generated;
    if (std::find(p.stop.begin(), p.stop.end(), id) != p.stop.end()) {
      end(s, "stop");
    } else if (static_cast<int64_t>(s.generated.size()) == p.max_tokens) {
      end(s, "length");
    }
  }
  std::erase_if(running, [](const Sequence& s) { return s.ended; });
  std::lock_guard<std::mutex> lk(metrics_mu_);
  metrics_.tokens_generated += generated;
  ++metrics_.steps;
  metrics_.step_seconds += seconds;
  const auto bucket = std::lower_bound(kStepBuckets.begin(), kStepBuckets.end(), seconds) - kStepBuckets.begin();
  ++metrics_.step_buckets[static_cast<size_t>(bucket)];
}

}  // namespace gpt2attn::serve
