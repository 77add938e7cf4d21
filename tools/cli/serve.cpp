// tools/cli/serve.cpp: `gpt2attn serve`: a GPT-2 behind an HTTP completions API (tools/serve/server.hpp) with
// continuous batching (tools/serve/scheduler.hpp): the options, loading the model, and an orderly end on SIGTERM or
// SIGINT. It does no scheduling and no HTTP itself.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gpt2attn/gpt2.hpp"
#include "tools/cli/commands.hpp"
#include "tools/serve/scheduler.hpp"
#include "tools/serve/server.hpp"

namespace gpt2attn::cli {

namespace {

const char* kServeAbout = R"(serve    serves a GPT-2 over HTTP until SIGTERM or SIGINT, and prints `listening on
         http://HOST:PORT` once it listens (--port 0: a free port the system picks). Token ids in and out, no
         tokenizer. POST /v1/completions takes OpenAI's completions fields: prompt (an array of ids, or an array
         of such arrays: one choice each, prompt i sampling with seed + i), max_tokens (default 16), temperature
         (default 1, as OpenAI's; 0 is greedy and then top_k and top_p are ignored), top_k (0 = off), top_p (1 =
         off), seed (default 0), stop (ids ending a choice with "stop"; the stop id is the choice's last), stream
         and logprobs (booleans). It answers {"id", "object": "text_completion", "created", "model", "choices":
         [{"index", "token_ids", "logprobs": {"token_logprobs"} or null, "finish_reason"}], "usage"}, or with
         stream true server-sent events: one per token, one per choice with its finish_reason, one with the
         usage, then `data: [DONE]`. finish_reason is "length", "stop", or "cancelled" (the server stopped); a
         failed model step answers 500, or ends a stream with finish_reason "error" and an error object. Refusals
         are JSON {"error": {"message", "type", "code"}}: 400 for malformed JSON, a wrong type or value, an id
         outside the vocabulary; 413 for prompt + max_tokens past n_positions or the KV cache, or a body over 1
         MiB; 503 with Retry-After while --max-queue prompts wait, or while shutting down. GET /v1/models gives
         the model's name, vocab_size and n_positions; GET /health {"status":"ok"}; GET /metrics Prometheus text.
         Scheduling: a prompt is admitted once the KV cache can hold it and its max_tokens whole (blocks
         reserved, so nothing is ever preempted), first come first served; each model step takes every running
         sequence's next token, then prompt chunks up to --max-batch-tokens; a prompt whose first whole blocks
         match a running sequence's tokens shares them (a fork) instead of computing them. Batch invariant
         (unless --no-batch-invariant): a request's ids and log-probabilities are the same bits alone or among
         any others, at any --threads; prompts then run in chunks of --max-batch-tokens from their start, and
         forks share whole such chunks. A client that
         disconnects has its request cancelled at the next write to it (a token, or the SSE comment a waiting
         stream gets each second). On SIGTERM or SIGINT new requests get 503, those admitted or queued run on for
         up to --shutdown-timeout seconds and are then cancelled, and the server exits 0.
)";

// The responses' "model": the checkpoint directory's name, or the preset's.
std::string model_name(const Args& a) {
  if (!a.has("model")) return a.get("preset");
  const std::filesystem::path p = std::filesystem::path(a.get("model")).lexically_normal();
  const std::string name = p.has_filename() ? p.filename().string() : p.parent_path().filename().string();
  return name.empty() ? a.get("model") : name;
}

int run_serve(const Args& a) {
  check_model_options(a);
  serve::ServerOptions server_options;
  server_options.host = a.get("host", "127.0.0.1");
  server_options.port = a.integer<int>("port", 0, 0, 65535);
  server_options.http_threads = a.integer<int>("http-threads", server_options.http_threads, 1, 65536);
  serve::SchedulerOptions scheduling;
  scheduling.max_batch_tokens = a.integer<int64_t>("max-batch-tokens", scheduling.max_batch_tokens, 1);
  scheduling.max_queue = a.integer<int64_t>("max-queue", scheduling.max_queue, 1);
  const int64_t kv_tokens = a.integer<int64_t>("kv-capacity-tokens", 0, 1);
  const int shutdown_s = a.integer<int>("shutdown-timeout", 10, 0, 86400);
  KvCacheOptions kv;
  kv.dtype = dtype_from_string(kv_dtype_names(a).front());
  const EngineOptions opts = engine_options(a);
  scheduling.run.threads = opts.threads;
  scheduling.run.batch_invariant = !a.flag("no-batch-invariant");

  // SIGTERM and SIGINT are blocked in every thread (each thread started from here on inherits the mask) and taken
  // by sigwait() below: no handler runs at all, so nothing happens in signal context.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  // A client gone mid-response makes a write fail with EPIPE; the default SIGPIPE would end the server.
  signal(SIGPIPE, SIG_IGN);

  GPT2 model = load_model(a, opts);
  // A signal that came while the model loaded (which it does not interrupt) ends the command before it serves.
  sigset_t pending;
  sigpending(&pending);
  if (sigismember(&pending, SIGTERM) || sigismember(&pending, SIGINT)) {
    std::fprintf(stderr, "gpt2attn serve: stopped by a signal before serving\n");
    return 0;
  }
  // Default: room for four sequences of the model's whole context.
  kv.capacity_tokens = kv_tokens ? kv_tokens : 4 * model.config().n_positions;
  serve::Scheduler scheduler(model, model.make_cache(kv), scheduling);
  server_options.model_name = model_name(a);
  serve::Server server(scheduler, server_options);
  const int port = server.bind();
  std::printf("listening on http://%s:%d\n", server_options.host.c_str(), port);
  std::fflush(stdout);

  std::atomic<bool> serving_failed{false};
  std::thread http([&] {
    if (!server.run()) {
      serving_failed = true;
      kill(getpid(), SIGTERM);  // wakes the sigwait below
    }
  });
  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);

  if (!serving_failed) {
    std::fprintf(stderr, "gpt2attn serve: %s: finishing the requests in flight (up to %d s)\n",
                 strsignal(signal_number), shutdown_s);
  }
  using clock = std::chrono::steady_clock;
  scheduler.stop_accepting();
  if (!scheduler.wait_idle(clock::now() + std::chrono::seconds(shutdown_s))) {
    std::fprintf(stderr, "gpt2attn serve: cancelling the requests still running after %d s\n", shutdown_s);
    scheduler.cancel_all();
    scheduler.wait_idle(clock::now() + std::chrono::seconds(30));  // one step at most, the step in progress
  }
  // Every request has its answer; let their threads write the last events before the connections close.
  server.wait_responses(clock::now() + std::chrono::seconds(5));
  server.stop();
  http.join();
  if (serving_failed) {
    std::fprintf(stderr, "gpt2attn serve: the HTTP server stopped serving\n");
    return 1;
  }
  return 0;
}

}  // namespace

const Command& serve_command() {
  static const Command c{
      "serve",
      "an HTTP completions server (token ids) over a whole GPT-2, with continuous batching.",
      [] {
        std::vector<Option> rows = model_rows();
        const std::vector<Option> more = {
            value("host", "ADDR", "the address to listen on; default 127.0.0.1."),
            value("port", "P", "the port; default 0: one the system picks (printed)."),
            threads_row(),
            value("max-batch-tokens", "N", "tokens one model step takes at most (prompt chunks after the running "
                                           "sequences' next tokens); default 512."),
            value("kv-capacity-tokens", "N", "the KV cache's size in tokens (per layer); default 4 x n_positions."),
            value("max-queue", "N", "prompts that may wait for room in the KV cache; past it 503; default 256."),
            value("http-threads", "N", "connections served at once (a streaming client holds one throughout); "
                                       "default 256."),
            value("shutdown-timeout", "S", "on SIGTERM/SIGINT, seconds the requests in flight may run on before "
                                           "they are cancelled; default 10."),
            flag("no-batch-invariant", "let a request's bits depend on its batch-mates (long prompts' prefill up to "
                                       "10% faster; see docs/serving.md)."),
            compute_row(false),
            cache_dtype_row(),
            weights_row(false),
            isa_row(),
        };
        rows.insert(rows.end(), more.begin(), more.end());
        return rows;
      }(),
      kServeAbout,
      run_serve};
  return c;
}

}  // namespace gpt2attn::cli
