// tools/serve/server.hpp: the HTTP side of `gpt2attn serve`, over cpp-httplib: POST /v1/completions (OpenAI's legacy
// completions shape, token ids in and out, streamed as server-sent events or whole), GET /v1/models (the model's
// name, vocab_size and n_positions), GET /health and GET /metrics (Prometheus text). Requests are parsed and answered
// here; the scheduling is tools/serve/scheduler.hpp's. httplib stays out of this header: only server.cpp needs it.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "tools/serve/scheduler.hpp"

namespace gpt2attn::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                     // 0: the system picks a free port (bind() returns it)
  int http_threads = 256;           // connections served at once: each client holds one for its whole answer
  size_t max_body_bytes = 1 << 20;  // a larger request body is refused with 413
  std::string model_name;           // the responses' "model"
  int retry_after_s = 1;            // the Retry-After of a 503 for a full queue
};

class Server {
 public:
  Server(Scheduler& scheduler, const ServerOptions& options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds options.host:options.port and listens; returns the port. Error(invalid_argument) naming them if it cannot.
  int bind();
  // Serves until stop(): call on one thread after bind(). Returns false if serving failed.
  bool run();
  // Waits (up to `deadline`) until no completion response is still being written to its client.
  bool wait_responses(std::chrono::steady_clock::time_point deadline);
  // Stops serving: run() returns once the connections' threads have ended. Thread-safe.
  void stop();

  struct Impl;  // server.cpp

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpt2attn::serve
