// tools/serve/server.cpp: the HTTP endpoints of `gpt2attn serve` over cpp-httplib (see server.hpp): parsing and
// checking a completion request's JSON, answering it whole or as server-sent events while the scheduler thread
// produces its tokens, and the health and metrics pages. It never touches the model or the cache: the scheduler does.
#include "tools/serve/server.hpp"

#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "gpt2attn/error.hpp"

// cpp-httplib as Debian builds it (its pkg-config Cflags): the header must see the same options as the library.
#ifndef CPPHTTPLIB_OPENSSL_SUPPORT
#define CPPHTTPLIB_OPENSSL_SUPPORT
#endif
#ifndef CPPHTTPLIB_ZLIB_SUPPORT
#define CPPHTTPLIB_ZLIB_SUPPORT
#endif
#ifndef CPPHTTPLIB_BROTLI_SUPPORT
#define CPPHTTPLIB_BROTLI_SUPPORT
#endif
#include <httplib.h>

namespace gpt2attn::serve {

using json = nlohmann::ordered_json;

namespace {

// A stream with nothing new for this long gets an SSE comment line: clients ignore it, and writing it is how a
// client that went away while its request waited is noticed (the write fails), as a token's write would.
constexpr std::chrono::milliseconds kKeepAliveInterval{1000};
// The accept queue's length (httplib listens with 5, which drops connections a burst of clients opens at once).
constexpr int kListenBacklog = 1024;

// A request the client got wrong: the HTTP status, OpenAI's error type and code, and the message.
struct Refusal {
  int status;
  std::string type, code, message;
};

void set_error(httplib::Response& res, int status, const std::string& type, const std::string& code,
               const std::string& message) {
  res.status = status;
  json err = {{"message", message}, {"type", type}, {"code", code.empty() ? json(nullptr) : json(code)}};
  res.set_content(json{{"error", err}}.dump() + "\n", "application/json");
}

Refusal bad(const std::string& message) { return {400, "invalid_request_error", "invalid_value", message}; }

// A token id as JSON gives it: an integer in int32's range (its place in the vocabulary is the scheduler's check).
std::optional<int32_t> token_id(const json& v) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) return std::nullopt;
    return static_cast<int32_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if (x < std::numeric_limits<int32_t>::min() || x > std::numeric_limits<int32_t>::max()) return std::nullopt;
    return static_cast<int32_t>(x);
  }
  return std::nullopt;
}

std::vector<int32_t> token_ids(const json& v, const std::string& field, std::optional<Refusal>& error) {
  std::vector<int32_t> ids;
  if (!v.is_array()) {
    error = bad(field + ": expected an array of token ids (integers), got " + std::string(v.type_name()));
    return ids;
  }
  for (size_t i = 0; i < v.size(); ++i) {
    const std::optional<int32_t> id = token_id(v[i]);
    if (!id) {
      error = bad(field + "[" + std::to_string(i) + "]: expected a token id (an integer), got " + v[i].dump());
      return ids;
    }
    ids.push_back(*id);
  }
  return ids;
}

struct Parsed {
  std::vector<CompletionParams> choices;
  bool stream = false;
};

// The body of POST /v1/completions, checked for types and ranges; the vocabulary and the context are the
// scheduler's to check.
std::optional<Refusal> parse_completion(const std::string& body, Parsed& out) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::parse_error& e) {
    return Refusal{400, "invalid_request_error", "invalid_json", std::string("malformed JSON: ") + e.what()};
  }
  if (!j.is_object()) return bad("the body must be a JSON object, got " + std::string(j.type_name()));
  std::optional<Refusal> error;
  const auto has = [&](const char* k) { return j.contains(k) && !j[k].is_null(); };

  // Fields of OpenAI's completions this server does not implement: refused rather than silently ignored.
  if (has("n") && j["n"] != 1) return bad("n: only 1 is supported (send several prompts instead)");
  if (has("best_of") && j["best_of"] != 1) return bad("best_of: only 1 is supported");
  if (has("echo") && j["echo"] != false) return bad("echo: not supported");
  if (has("suffix")) return bad("suffix: not supported");
  for (const char* k : {"presence_penalty", "frequency_penalty"}) {
    if (has(k) && j[k] != 0) return bad(std::string(k) + ": not supported (only 0)");
  }
  if (has("logit_bias") && !j["logit_bias"].empty()) return bad("logit_bias: not supported");

  if (!has("prompt")) return bad("prompt: missing (an array of token ids, or an array of such arrays)");
  const json& prompt = j["prompt"];
  std::vector<std::vector<int32_t>> prompts;
  if (prompt.is_string() || (prompt.is_array() && !prompt.empty() && prompt[0].is_string())) {
    return bad("prompt: token ids expected, not text (the server has no tokenizer)");
  }
  if (!prompt.is_array() || prompt.empty()) {
    return bad("prompt: expected a non-empty array of token ids, or an array of such arrays");
  }
  if (prompt[0].is_array()) {
    for (size_t i = 0; i < prompt.size(); ++i) {
      prompts.push_back(token_ids(prompt[i], "prompt[" + std::to_string(i) + "]", error));
      if (error) return error;
    }
  } else {
    prompts.push_back(token_ids(prompt, "prompt", error));
    if (error) return error;
  }

  CompletionParams p;
  if (has("max_tokens")) {
    const json& m = j["max_tokens"];
    if (!m.is_number_integer() || (m.is_number_unsigned() ? false : m.get<int64_t>() < 1)) {
      return bad("max_tokens: expected an integer of 1 or more, got " + m.dump());
    }
    p.max_tokens = m.is_number_unsigned() && m.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                       ? INT64_MAX
                       : m.get<int64_t>();
  }
  const auto number = [&](const char* k, double def) -> std::optional<double> {
    if (!has(k)) return def;
    if (!j[k].is_number()) {
      error = bad(std::string(k) + ": expected a number, got " + j[k].dump());
      return std::nullopt;
    }
    return j[k].get<double>();
  };
  const std::optional<double> temperature = number("temperature", 1.0), top_p = number("top_p", 1.0);
  if (error) return error;
  if (!(*temperature >= 0) || !std::isfinite(*temperature)) {
    return bad("temperature: expected a finite number of 0 (greedy) or more, got " + j["temperature"].dump());
  }
  if (!(*top_p > 0 && *top_p <= 1)) return bad("top_p: expected a number in (0, 1], got " + j["top_p"].dump());
  p.sampling.temperature = static_cast<float>(*temperature);
  p.sampling.top_p = static_cast<float>(*top_p);
  if (has("top_k")) {
    const json& k = j["top_k"];
    if (!k.is_number_integer() || (!k.is_number_unsigned() && k.get<int64_t>() < 0)) {
      return bad("top_k: expected an integer of 0 (off) or more, got " + k.dump());
    }
    p.sampling.top_k = k.is_number_unsigned() && k.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                           ? INT64_MAX
                           : k.get<int64_t>();
  }
  if (has("seed")) {
    const json& s = j["seed"];
    if (!s.is_number_integer() || (!s.is_number_unsigned() && s.get<int64_t>() < 0)) {
      return bad("seed: expected an integer of 0 or more, got " + s.dump());
    }
    p.sampling.seed = s.get<uint64_t>();
  }
  if (has("stop")) {
    const json& s = j["stop"];
    if (s.is_array()) {
      p.stop = token_ids(s, "stop", error);
      if (error) return error;
    } else if (const std::optional<int32_t> id = token_id(s)) {
      p.stop = {*id};
    } else {
      return bad("stop: expected a token id or an array of token ids (the server has no tokenizer), got " + s.dump());
    }
  }
  for (const char* k : {"stream", "logprobs"}) {
    if (has(k) && !j[k].is_boolean()) return bad(std::string(k) + ": expected true or false, got " + j[k].dump());
  }
  out.stream = has("stream") && j["stream"].get<bool>();
  p.logprobs = has("logprobs") && j["logprobs"].get<bool>();

  for (size_t i = 0; i < prompts.size(); ++i) {
    CompletionParams c = p;
    c.prompt = std::move(prompts[i]);
    c.sampling.seed = p.sampling.seed + i;  // prompt i: seed + i, as `gpt2attn generate` does
    out.choices.push_back(std::move(c));
  }
  return std::nullopt;
}

json logprobs_json(const CompletionParams& p, const std::vector<double>& lps) {
  return p.logprobs ? json{{"token_logprobs", lps}} : json(nullptr);
}

}  // namespace

struct Server::Impl {
  Scheduler& scheduler;
  const ServerOptions options;
  httplib::Server http;
  int listen_fd = -1;
  std::atomic<int64_t> active_responses{0};  // completion responses not yet fully written
  std::atomic<uint64_t> next_id{0};
  std::mutex refusals_mu;
  std::map<std::string, int64_t> refusals;  // completion requests refused, by reason

  Impl(Scheduler& s, const ServerOptions& o) : scheduler(s), options(o) {}

  void refuse(httplib::Response& res, const Refusal& r, const std::string& reason) {
    set_error(res, r.status, r.type, r.code, r.message);
    std::lock_guard<std::mutex> lk(refusals_mu);
    ++refusals[reason];
  }

  json head(const std::string& id, int64_t created) const {
    return json{{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", options.model_name}};
  }

  void completions(const httplib::Request& req, httplib::Response& res);
  void stream(httplib::Response& res, std::shared_ptr<Request> request, const std::string& id, int64_t created);
  std::string metrics();
};

void Server::Impl::completions(const httplib::Request& req, httplib::Response& res) {
  if (!scheduler.accepting()) {
    return refuse(res, {503, "unavailable", "shutting_down", "the server is shutting down"}, "shutting_down");
  }
  Parsed parsed;
  if (const std::optional<Refusal> r = parse_completion(req.body, parsed)) return refuse(res, *r, "bad_request");
  auto request = std::make_shared<Request>(std::move(parsed.choices));
  const Scheduler::Submission sub = scheduler.submit(request);
  switch (sub.verdict) {
    case Scheduler::Verdict::accepted:
      break;
    case Scheduler::Verdict::bad_request:
      return refuse(res, bad(sub.message), "bad_request");
    case Scheduler::Verdict::too_long:
      return refuse(res, {413, "invalid_request_error", "context_length_exceeded", sub.message}, "too_long");
    case Scheduler::Verdict::queue_full:
      res.set_header("Retry-After", std::to_string(options.retry_after_s));
      return refuse(res, {503, "server_overloaded", "queue_full", sub.message}, "queue_full");
    case Scheduler::Verdict::shutting_down:
      return refuse(res, {503, "unavailable", "shutting_down", sub.message}, "shutting_down");
  }
  const std::string id = "cmpl-" + std::to_string(next_id.fetch_add(1));
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  if (parsed.stream) return stream(res, std::move(request), id, created);

  for (uint64_t seen = 0; !request->finished();) seen = request->wait(seen, std::chrono::milliseconds(1000));
  json choices = json::array();
  int64_t prompt_tokens = 0, completion_tokens = 0;
  for (size_t i = 0; i < request->size(); ++i) {
    std::vector<int32_t> ids;
    std::vector<double> lps;
    const Request::Progress p = request->read(i, 0, &ids, &lps);
    if (p.finish_reason == "error") {
      // The model step failed (a non-finite value, say): the whole answer is lost, and it is the server's fault.
      return set_error(res, 500, "server_error", "step_failed", "generation failed: " + p.error);
    }
    prompt_tokens += static_cast<int64_t>(request->params(i).prompt.size());
    completion_tokens += static_cast<int64_t>(ids.size());
    choices.push_back({{"index", i},
                       {"token_ids", ids},
                       {"logprobs", logprobs_json(request->params(i), lps)},
                       {"finish_reason", p.finish_reason}});
  }
  json body = head(id, created);
  body["choices"] = std::move(choices);
  body["usage"] = {{"prompt_tokens", prompt_tokens},
                   {"completion_tokens", completion_tokens},
                   {"total_tokens", prompt_tokens + completion_tokens}};
  res.set_content(body.dump() + "\n", "application/json");
}

// Server-sent events: one event per token (choices[0] = that choice, its one id), one with each choice's
// finish_reason as it finishes, one with the usage, then `data: [DONE]`. The provider runs on this request's
// HTTP thread, waiting on the request; a write that fails (the client went away) cancels the request.
void Server::Impl::stream(httplib::Response& res, std::shared_ptr<Request> request, const std::string& id,
                          int64_t created) {
  struct State {
    std::shared_ptr<Request> request;
    std::vector<size_t> sent;       // ids sent per choice
    std::vector<bool> final_sent;   // finish_reason sent per choice
    uint64_t seen = 0;              // the request's change count last read
    bool done = false;
  };
  auto state = std::make_shared<State>();
  state->request = request;
  state->sent.assign(request->size(), 0);
  state->final_sent.assign(request->size(), false);
  const json base = head(id, created);
  ++active_responses;
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, state, base](size_t, httplib::DataSink& sink) -> bool {
        if (state->done) {
          sink.done();
          return true;
        }
        Request& r = *state->request;
        const uint64_t seen = r.wait(state->seen, kKeepAliveInterval);
        std::string out;
        if (seen == state->seen) {
          out = ": waiting\n\n";
        } else {
          state->seen = seen;
          bool all_final = true;
          for (size_t i = 0; i < r.size(); ++i) {
            if (state->final_sent[i]) continue;
            std::vector<int32_t> ids;
            std::vector<double> lps;
            const Request::Progress p = r.read(i, state->sent[i], &ids, &lps);
            const CompletionParams& params = r.params(i);
            for (size_t k = 0; k < ids.size(); ++k) {
              json ev = base;
              json lp = params.logprobs ? json{{"token_logprobs", json::array({lps[k]})}} : json(nullptr);
              ev["choices"] = json::array(
                  {{{"index", i}, {"token_ids", json::array({ids[k]})}, {"logprobs", lp}, {"finish_reason", nullptr}}});
              out += "data: " + ev.dump() + "\n\n";
            }
            state->sent[i] += ids.size();
            if (p.finished) {
              json ev = base;
              ev["choices"] = json::array({{{"index", i},
                                            {"token_ids", json::array()},
                                            {"logprobs", nullptr},
                                            {"finish_reason", p.finish_reason}}});
              if (p.finish_reason == "error") {
                ev["error"] = {{"message", "generation failed: " + p.error},
                               {"type", "server_error"},
                               {"code", "step_failed"}};
              }
              out += "data: " + ev.dump() + "\n\n";
              state->final_sent[i] = true;
            } else {
              all_final = false;
            }
          }
          if (all_final) {
            int64_t prompt_tokens = 0, completion_tokens = 0;
            for (size_t i = 0; i < r.size(); ++i) {
              prompt_tokens += static_cast<int64_t>(r.params(i).prompt.size());
              completion_tokens += static_cast<int64_t>(state->sent[i]);
            }
            json ev = base;
            ev["choices"] = json::array();
            ev["usage"] = {{"prompt_tokens", prompt_tokens},
                           {"completion_tokens", completion_tokens},
                           {"total_tokens", prompt_tokens + completion_tokens}};
            out += "data: " + ev.dump() + "\n\ndata: [DONE]\n\n";
            state->done = true;
          }
        }
        if (!out.empty() && !sink.write(out.data(), out.size())) {
          scheduler.cancel(r);
          return false;
        }
        return true;
      },
      [this, state](bool) {
        // The response is gone (written, or its client disconnected): a request still running is not wanted.
        if (!state->request->finished()) scheduler.cancel(*state->request);
        --active_responses;
      });
}

std::string Server::Impl::metrics() {
  const SchedulerMetrics m = scheduler.metrics();
  std::ostringstream o;
  const auto gauge = [&](const char* name, const char* help, const char* type, double v) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n' << name << ' ' << v << '\n';
  };
  gauge("gpt2attn_requests_running", "Completions (one per prompt) holding a sequence in the KV cache.", "gauge",
        static_cast<double>(m.running));
  gauge("gpt2attn_requests_waiting", "Completions queued for room in the KV cache.", "gauge",
        static_cast<double>(m.waiting));
  gauge("gpt2attn_tokens_generated_total", "Tokens sampled.", "counter", static_cast<double>(m.tokens_generated));
  gauge("gpt2attn_prompt_tokens_total", "Prompt tokens admitted.", "counter", static_cast<double>(m.prompt_tokens));
  gauge("gpt2attn_prefix_tokens_shared_total", "Prompt tokens forked from a running sequence, not computed.",
        "counter", static_cast<double>(m.prefix_tokens_shared));
  gauge("gpt2attn_kv_blocks_used", "KV cache blocks in use (per layer).", "gauge",
        static_cast<double>(m.kv_blocks_total - m.kv_blocks_free));
  gauge("gpt2attn_kv_blocks_free", "KV cache blocks free (per layer).", "gauge", static_cast<double>(m.kv_blocks_free));
  gauge("gpt2attn_kv_blocks_total", "KV cache blocks (per layer).", "gauge", static_cast<double>(m.kv_blocks_total));
  gauge("gpt2attn_http_responses_streaming", "Completion responses still being written.", "gauge",
        static_cast<double>(active_responses.load()));

  o << "# HELP gpt2attn_step_seconds Time of one model step (GPT2::step over the batch).\n"
    << "# TYPE gpt2attn_step_seconds histogram\n";
  uint64_t cumulative = 0;
  for (size_t b = 0; b < kStepBuckets.size(); ++b) {
    cumulative += m.step_buckets[b];
    o << "gpt2attn_step_seconds_bucket{le=\"" << kStepBuckets[b] << "\"} " << cumulative << '\n';
  }
  cumulative += m.step_buckets.back();
  o << "gpt2attn_step_seconds_bucket{le=\"+Inf\"} " << cumulative << '\n'
    << "gpt2attn_step_seconds_sum " << m.step_seconds << '\n'
    << "gpt2attn_step_seconds_count " << m.steps << '\n';

  // Finished completions by finish reason, and refused completion requests by reason: every series always shown.
  std::map<std::string, int64_t> total = {{"stop", 0},        {"length", 0},    {"cancelled", 0},
                                          {"error", 0},       {"bad_request", 0}, {"too_long", 0},
                                          {"too_large", 0},   {"queue_full", 0}, {"shutting_down", 0}};
  for (const auto& [k, v] : m.finished) total[k] += v;
  {
    std::lock_guard<std::mutex> lk(refusals_mu);
    for (const auto& [k, v] : refusals) total[k] += v;
  }
  o << "# HELP gpt2attn_requests_total Completions finished, by finish reason, and requests refused, by reason.\n"
    << "# TYPE gpt2attn_requests_total counter\n";
  for (const auto& [k, v] : total) o << "gpt2attn_requests_total{status=\"" << k << "\"} " << v << '\n';
  return o.str();
}

Server::Server(Scheduler& scheduler, const ServerOptions& options)
    : impl_(std::make_unique<Impl>(scheduler, options)) {
  Impl& s = *impl_;
  const int threads = options.http_threads;
  s.http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  s.http.set_payload_max_length(options.max_body_bytes);
  s.http.set_socket_options([&s](int fd) {
    const int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    s.listen_fd = fd;
  });
  s.http.Post("/v1/completions", [&s](const httplib::Request& req, httplib::Response& res) {
    s.completions(req, res);
  });
  s.http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("{\"status\":\"ok\"}\n", "application/json");
  });
  // OpenAI's model list, with the sizes a client needs to make valid requests (there is no tokenizer to ask).
  s.http.Get("/v1/models", [&s](const httplib::Request&, httplib::Response& res) {
    const GPT2Config& c = s.scheduler.model_config();
    const json model = {{"id", s.options.model_name},
                        {"object", "model"},
                        {"owned_by", "gpt2attn"},
                        {"vocab_size", c.vocab_size},
                        {"n_positions", c.n_positions}};
    res.set_content(json{{"object", "list"}, {"data", json::array({model})}}.dump() + "\n", "application/json");
  });
  s.http.Get("/metrics", [&s](const httplib::Request&, httplib::Response& res) {
    res.set_content(s.metrics(), "text/plain; version=0.0.4");
  });
  // Errors httplib answers itself (an unknown path, a body over the limit, a request it cannot read) get the same
  // JSON error body as ours; ours already have one.
  s.http.set_error_handler([&s](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 413) {
      s.refuse(res,
               {413, "invalid_request_error", "payload_too_large",
                "the request body is over the limit of " + std::to_string(s.options.max_body_bytes) + " bytes"},
               "too_large");
      return;
    }
    const std::string what = res.status == 404   ? "no such endpoint"
                             : res.status == 414 ? "the request line is too long"
                             : res.status == 400 ? "the request could not be read"
                                                 : "HTTP status " + std::to_string(res.status);
    set_error(res, res.status, res.status == 404 ? "not_found" : "invalid_request_error", "",
              what + ": " + req.method + " " + req.path);
  });
  s.http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    set_error(res, 500, "server_error", "", "internal error: " + what);
  });
}

Server::~Server() = default;

int Server::bind() {
  Impl& s = *impl_;
  const int port = s.options.port == 0 ? s.http.bind_to_any_port(s.options.host)
                                       : (s.http.bind_to_port(s.options.host, s.options.port) ? s.options.port : -1);
  if (port < 0) {
    invalid("cannot listen on " + s.options.host + ":" + std::to_string(s.options.port) +
            " (in use, or not an address of this machine)");
  }
  // Listening again on a listening socket only changes its backlog (Linux).
  if (s.listen_fd >= 0) ::listen(s.listen_fd, kListenBacklog);
  return port;
}

bool Server::run() { return impl_->http.listen_after_bind(); }

bool Server::wait_responses(std::chrono::steady_clock::time_point deadline) {
  while (impl_->active_responses.load() > 0) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

void Server::stop() { impl_->http.stop(); }

}  // namespace gpt2attn::serve
