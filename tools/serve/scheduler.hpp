// tools/serve/scheduler.hpp: the continuous-batching scheduler of `gpt2attn serve`: one thread owns a GPT2 and its
// ModelKvCache, admits queued completions while the cache can hold the whole of each, and runs one GPT2::step at a
// time over every running sequence's next token and prompt chunks. It speaks no HTTP and no JSON
// (tools/serve/server.hpp does), and uses only the library's public API.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpt2attn/gpt2.hpp"
#include "gpt2attn/model_kv_cache.hpp"
#include "gpt2attn/sampling.hpp"

namespace gpt2attn::serve {

// One prompt's generation, as a client asked for it (checked by Scheduler::check before it is queued).
struct CompletionParams {
  std::vector<int32_t> prompt;  // 1 or more ids in [0, vocab_size)
  int64_t max_tokens = 16;      // >= 1; prompt + max_tokens <= n_positions
  SamplingOptions sampling;     // this choice's seed already offset (choice i of a request: seed + i)
  std::vector<int32_t> stop;    // a sampled stop id ends the choice with "stop" (it is returned, the last id)
  bool logprobs = false;        // each id's log-probability under the raw logits (temperature 1)
};

// What one HTTP request asked for: one choice per prompt, each its own sequence in the cache. Written by the
// scheduler thread, read by the request's HTTP thread; everything below `mu` is guarded by it.
class Request {
 public:
  explicit Request(std::vector<CompletionParams> choices);

  size_t size() const { return params_.size(); }
  const CompletionParams& params(size_t i) const { return params_[i]; }  // immutable once made

  // One choice as it stands: ids and logprobs from index `from` on, appended to the vectors given.
  struct Progress {
    size_t tokens = 0;          // the choice's ids so far (all of them, not only those copied)
    bool finished = false;
    std::string finish_reason;  // "stop", "length", "cancelled", "error"; empty while running
    std::string error;          // with "error": what failed
  };
  Progress read(size_t choice, size_t from, std::vector<int32_t>* ids, std::vector<double>* logprobs) const;

  // Changes are counted: wait() returns the count once it passes `seen`, or at the timeout (the count as it is).
  uint64_t wait(uint64_t seen, std::chrono::milliseconds timeout) const;
  bool finished() const;  // every choice

  // Set by Scheduler::cancel; the scheduler finishes every unfinished choice with "cancelled" at its next step.
  bool cancel_requested() const { return cancel_.load(std::memory_order_acquire); }

 private:
  friend class Scheduler;
  void push(size_t choice, int32_t id, double logprob);  // the scheduler thread only
  void finish(size_t choice, const std::string& reason, const std::string& error = "");

  struct Choice {
    std::vector<int32_t> ids;
    std::vector<double> logprobs;
    std::string finish_reason, error;
  };
  const std::vector<CompletionParams> params_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<Choice> choices_;
  uint64_t version_ = 0;
  size_t unfinished_;
  std::atomic<bool> cancel_{false};
};

struct SchedulerOptions {
  int64_t max_batch_tokens = 512;  // tokens one step takes at most: running sequences' next tokens, then prompt chunks
  int64_t max_queue = 256;         // choices waiting for admission at most; past it a submission is refused
  RunOptions run;                  // the steps' threads, and batch_invariant (on unless the caller turns it off)
  SchedulerOptions() { run.batch_invariant = true; }
};

// The step-time histogram's upper bounds, in seconds (Prometheus' `le`), +Inf implied.
inline constexpr std::array<double, 13> kStepBuckets = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                        0.25,  0.5,    1.0,   2.5,  5.0,  10.0};

struct SchedulerMetrics {
  int64_t running = 0, waiting = 0;
  int64_t prompt_tokens = 0, tokens_generated = 0, prefix_tokens_shared = 0;
  int64_t kv_blocks_total = 0, kv_blocks_free = 0;
  std::map<std::string, int64_t> finished;  // choices by finish reason
  std::array<uint64_t, kStepBuckets.size() + 1> step_buckets{};  // per bucket (not cumulative); last is +Inf
  uint64_t steps = 0;
  double step_seconds = 0;
};

class Scheduler {
 public:
  // Takes the model and a cache made by it (model.make_cache); starts the scheduler thread.
  Scheduler(GPT2& model, ModelKvCache cache, const SchedulerOptions& options);
  ~Scheduler();  // cancels what is left and joins the thread
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  enum class Verdict {
    accepted,
    bad_request,    // a value a client may not send (an id outside the vocabulary, an empty prompt)
    too_long,       // prompt + max_tokens past n_positions, or more blocks than the whole cache holds
    queue_full,     // more waiting choices than max_queue: retry later
    shutting_down,  // stop_accepting() was called
  };
  struct Submission {
    Verdict verdict;
    std::string message;  // why, naming the choice and the value, when not accepted
  };
  // Checks every choice (nothing is queued unless all pass), then queues them in order. Thread-safe.
  Submission submit(const std::shared_ptr<Request>& request);
  // Asks the scheduler to finish the request's unfinished choices with "cancelled" (a client gone). Thread-safe.
  void cancel(Request& request);

  // Shutting down: refuse new submissions; wait (up to `deadline`) for queued and running choices to end; then
  // cancel_all() what is left. Each thread-safe.
  void stop_accepting();
  bool accepting() const { return accepting_.load(); }
  bool wait_idle(std::chrono::steady_clock::time_point deadline);
  void cancel_all();

  SchedulerMetrics metrics() const;
  const GPT2Config& model_config() const { return config_; }
  int64_t block_tokens() const { return block_tokens_; }

 private:
  struct Sequence;  // an admitted choice (scheduler.cpp)
  void loop();
  void admit(std::vector<Sequence>& running);
  void step(std::vector<Sequence>& running);
  void end(Sequence& s, const std::string& reason, const std::string& error = "");
  void publish(const std::vector<Sequence>& running);

  GPT2& model_;
  ModelKvCache cache_;  // the scheduler thread's alone once it runs
  const SchedulerOptions options_;
  const GPT2Config config_;
  const int64_t block_tokens_, total_blocks_;
  std::vector<float> logits_;  // (entries, vocab_size): the scheduler thread's step output

  mutable std::mutex mu_;  // guards the queue and the flags below it
  std::condition_variable cv_;       // the scheduler thread waits here for work
  std::condition_variable idle_cv_;  // wait_idle waits here
  struct Waiting {
    std::shared_ptr<Request> request;
    size_t choice;
  };
  std::deque<Waiting> waiting_;
  int64_t running_ = 0;  // admitted choices, as of the last publish
  bool cancel_all_ = false, quit_ = false;
  std::atomic<bool> accepting_{true};

  mutable std::mutex metrics_mu_;  // guards metrics_ (the scheduler thread writes, /metrics reads)
  SchedulerMetrics metrics_;

  std::thread thread_;
};

}  // namespace gpt2attn::serve
