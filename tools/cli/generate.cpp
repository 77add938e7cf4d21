// tools/cli/generate.cpp: `gpt2attn generate` (token ids in, sampled token ids out, through GPT2::generate) and
// `gpt2attn logits` (one sequence's teacher-forced logits to a .npy), over a whole GPT-2 from a Hugging Face
// checkpoint directory or random weights of a preset. Token ids only: no tokenizer (GPT-2's BPE files are not part
// of a checkpoint's tensors, and cannot be fetched where this runs).
#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gpt2attn/gpt2.hpp"
#include "tools/cli/commands.hpp"
#include "tools/npy.hpp"

namespace gpt2attn::cli {

namespace {

const char* kGenerateAbout = R"(generate generates from token ids with a whole GPT-2 (GPT2::generate: the prompts batched into each step,
         prefill in chunks of --max-step-tokens) and prints, per prompt in the order given, the new ids as one
         comma-separated line, or with --json one object per line: prompt_ids, new_ids, finish_reason ("stop":
         a --stop-ids token, which is the last new id; "length": --max-new-tokens or n_positions reached),
         logprobs (with --logprobs: each new id's log-probability under the model's raw logits),
         first_token_ms and total_ms (from the call's start). Tokenization is the caller's: ids in, ids out
         (GPT-2's BPE vocabulary is not in a checkpoint; "The quick brown" is 464,2068,1893). --prompts-file
         is a JSON array of prompts, each an array of ids ([[464, 2068], [40]]), which may repeat a prompt
         (--prompt-ids refuses a repeat). A prompt holds 1 to n_positions - 1 ids, each in [0, vocab_size).
         --temperature 0 (the default) is greedy; --top-k and --top-p apply to sampling only and are refused
         without a --temperature above 0. Prompt i samples with the seed --seed + i from a counter-based
         stream: a draw depends on the seed and the position alone, not on --threads or the other prompts.
         --model opens a checkpoint directory (config.json and model.safetensors or its shards, F32, F16 or
         BF16); --preset draws random weights of gpt2-small, gpt2-medium, gpt2-large or gpt2-xl (random_gpt2,
         seed --seed-weights), to try a size without a checkpoint. --dtype and --weights-dtype apply to every
         matrix: attention, MLPs and the LM head (int8 under int4: its logits are what sampling reads).
)";

const char* kLogitsAbout = R"(logits   computes one sequence's logits at every position, teacher forced (GPT2::logits: no cache, no
         sampling), and writes them to --output as float32 (T, vocab_size): row t scores the id after
         --ids[0..t]. T is 1 to n_positions. --output is written atomically and may not be a file of --model.
         The model options are generate's.
)";

// Ids as given on the command line: comma-separated integers (spaces around them allowed). Whether each is in the
// vocabulary is the model's to say (it names the id and its position); here only what is not an id at all.
std::vector<int32_t> parse_ids(const std::string& option, const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    const size_t b = item.find_first_not_of(' '), e = item.find_last_not_of(' ');
    const std::string t = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    const size_t sign = !t.empty() && (t[0] == '-' || t[0] == '+') ? 1 : 0;
    if (t.size() == sign || t.find_first_not_of("0123456789", sign) != std::string::npos) {
      throw UsageError("--" + option + " '" + s + "': expected comma-separated token ids, got '" + item + "'");
    }
    errno = 0;
    const long long v = std::strtoll(t.c_str(), nullptr, 10);
    if (errno == ERANGE || v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
      throw UsageError("--" + option + " '" + s + "': token id " + t + " is outside the 32-bit range");
    }
    ids.push_back(static_cast<int32_t>(v));
  }
  // getline yields nothing for "" and drops a trailing empty item ("1,2,"): both are refused here.
  if (ids.empty() || s.back() == ',') {
    throw UsageError("--" + option + " '" + s + "': expected comma-separated token ids");
  }
  return ids;
}

// --prompts-file: a JSON array of arrays of integer ids. Error(bad_file) naming the file and the prompt.
std::vector<std::vector<int32_t>> read_prompts_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(ErrorCode::bad_file, "--prompts-file " + path + ": cannot open it");
  std::stringstream text;
  text << f.rdbuf();
  const auto bad = [&](const std::string& what) {
    fail(ErrorCode::bad_file, "--prompts-file " + path + ": " + what);
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {
    bad(std::string("not JSON: ") + e.what());
  }
  if (!j.is_array() || j.empty()) bad("expected a non-empty JSON array of prompts, each an array of token ids");
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < j.size(); ++i) {
    const nlohmann::json& p = j[i];
    const std::string which = "prompt " + std::to_string(i);
    if (!p.is_array() || p.empty()) bad(which + " is not a non-empty array of token ids");
    std::vector<int32_t> ids;
    for (const nlohmann::json& id : p) {
      // An unsigned value past int64 would wrap in get<int64_t>(): it is out of range as it stands.
      const bool in_range = id.is_number_unsigned()  ? id.get<uint64_t>() <= std::numeric_limits<int32_t>::max()
                            : id.is_number_integer() ? id.get<int64_t>() >= std::numeric_limits<int32_t>::min() &&
                                                           id.get<int64_t>() <= std::numeric_limits<int32_t>::max()
                                                     : false;
      if (!in_range) bad(which + " holds " + id.dump() + ", not a 32-bit integer token id");
      ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    prompts.push_back(std::move(ids));
  }
  return prompts;
}

// A finite real number, the whole value.
double real(const Args& a, const std::string& k, double def) {
  if (!a.has(k)) return def;
  const std::string s = a.get(k);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v)) {
    throw UsageError("--" + k + ": expected a finite number, got '" + s + "'");
  }
  return v;
}

}  // namespace

// The model options generate, logits and serve share (declared in commands.hpp).
std::vector<Option> model_rows() {
  return {value("model", "DIR", "a Hugging Face GPT-2 checkpoint directory (or --preset)."),
          value("preset", "NAME", "random weights of gpt2-small, gpt2-medium, gpt2-large or gpt2-xl (or --model)."),
          value("seed-weights", "S", "with --preset: the random weights' seed; default 0.")};
}

Option cache_dtype_row() {
  Option kv = kv_dtype_row();
  kv.repeatable = false;
  kv.help = "the KV cache's storage type; default f32.";
  return kv;
}

EngineOptions engine_options(const Args& a) {
  EngineOptions o;
  o.compute = compute_dtypes(a).front();
  o.weights = weight_format_for(weights_dtype_names(a).front(), o.compute);
  o.threads = threads_option(a);
  o.isa = isa_option(a);
  return o;
}

void check_model_options(const Args& a) {
  if (a.has("model") == a.has("preset")) {
    throw UsageError(a.has("model") ? "give one of --model and --preset: each names the weights"
                                    : "missing required option --model (or --preset)");
  }
  if (a.has("seed-weights") && !a.has("preset")) throw UsageError("--seed-weights applies to --preset only");
}

GPT2 load_model(const Args& a, const EngineOptions& opts) {
  // As forward does: the whole model at --isa, oneDNN's GEMMs included, before anything dispatches.
  limit_gemm_isa(opts.isa);
  if (a.has("model")) {
    GPT2Checkpoint checkpoint;
    try {
      checkpoint = open_gpt2_checkpoint(a.get("model"));
    } catch (const Error& e) {
      if (e.code() != ErrorCode::bad_file) throw;
      throw Error(e.code(), std::string("--model ") + e.what());  // which option the unreadable path was
    }
    return GPT2(checkpoint, opts);
  }
  GPT2Config c;
  try {
    c = gpt2_preset(a.get("preset"));
  } catch (const Error& e) {
    throw UsageError(std::string("--preset: ") + e.what());
  }
  const uint64_t seed = static_cast<uint64_t>(a.integer<int64_t>("seed-weights", 0, 0));
  const int threads = opts.threads ? opts.threads : std::clamp(omp_get_max_threads(), 1, max_threads());
  return GPT2(random_gpt2(c, seed, DType::f32, threads), opts);
}

namespace {

// --output may not replace a file of the checkpoint directory (config.json, a shard, the index).
void refuse_output_over_model(const Args& a, const std::string& output) {
  if (!a.has("model")) return;
  std::vector<std::string> files;  // kept alive: the pairs below point into it
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(a.get("model"), ec)) {
    files.push_back(entry.path().string());
  }
  std::vector<std::pair<const char*, std::string>> inputs;
  for (const std::string& f : files) inputs.emplace_back("model", f);
  refuse_output_over_inputs(output, inputs);
}

nlohmann::ordered_json generation_json(const Generation& g, bool logprobs) {
  nlohmann::ordered_json j = {
      {"prompt_ids", g.prompt_ids}, {"new_ids", g.new_ids}, {"finish_reason", g.finish_reason}};
  if (logprobs) j["logprobs"] = g.logprobs;
  j["first_token_ms"] = g.first_token_ms;
  j["total_ms"] = g.total_ms;
  return j;
}

int run_generate(const Args& a) {
  check_model_options(a);
  if (a.has("prompt-ids") == a.has("prompts-file")) {
    throw UsageError(a.has("prompts-file") ? "give one of --prompt-ids and --prompts-file"
                                           : "missing required option --prompt-ids (or --prompts-file)");
  }
  GenerateOptions g;
  if (!a.has("max-new-tokens")) throw UsageError("missing required option --max-new-tokens");
  g.max_new_tokens = a.integer<int64_t>("max-new-tokens", 0, 1);
  g.sampling.temperature = static_cast<float>(real(a, "temperature", 0.0));
  if (g.sampling.temperature < 0) throw UsageError("--temperature: must be at least 0 (0 = greedy), got " +
                                                   a.get("temperature"));
  // Under greedy decoding top-k and top-p change nothing: refused rather than silently ignored.
  for (const char* k : {"top-k", "top-p"}) {
    if (a.has(k) && g.sampling.temperature == 0) {
      throw UsageError(std::string("--") + k + " applies to sampling only; give a --temperature above 0 with it");
    }
  }
  g.sampling.top_k = a.integer<int64_t>("top-k", 0, 0);
  g.sampling.top_p = static_cast<float>(real(a, "top-p", 1.0));
  if (!(g.sampling.top_p > 0 && g.sampling.top_p <= 1)) {
    throw UsageError("--top-p: must be in (0, 1] (1 = off), got " + a.get("top-p"));
  }
  g.sampling.seed = static_cast<uint64_t>(a.integer<int64_t>("seed", 0, 0));
  if (a.has("stop-ids")) g.stop_tokens = parse_ids("stop-ids", a.get("stop-ids"));
  g.max_step_tokens = a.integer<int64_t>("max-step-tokens", g.max_step_tokens, 1);
  g.logprobs = a.flag("logprobs");
  const bool json = a.flag("json");
  if (g.logprobs && !json) throw UsageError("--logprobs needs --json (the plain output is the ids alone)");
  g.kv_dtype = dtype_from_string(kv_dtype_names(a).front());
  const EngineOptions opts = engine_options(a);

  std::vector<std::vector<int32_t>> prompts;
  if (a.has("prompts-file")) {
    prompts = read_prompts_file(a.get("prompts-file"));
  } else {
    prompts = a.distinct<std::vector<int32_t>>("prompt-ids", [](const std::string& s) {
      return parse_ids("prompt-ids", s);
    });
  }

  GPT2 model = load_model(a, opts);
  const std::vector<Generation> out = model.generate(prompts, g);
  for (const Generation& r : out) {
    if (json) {
      std::printf("%s\n", generation_json(r, g.logprobs).dump().c_str());
      continue;
    }
    std::string line;
    for (int32_t id : r.new_ids) {
      if (!line.empty()) line += ',';
      line += std::to_string(id);
    }
    std::printf("%s\n", line.c_str());
  }
  return 0;
}

int run_logits(const Args& a) {
  check_model_options(a);
  const std::vector<int32_t> ids = parse_ids("ids", a.required("ids"));
  const std::string output = a.required("output");
  const EngineOptions opts = engine_options(a);
  refuse_output_over_model(a, output);
  try {
    npy::check_write_target(output);  // before the model is read: a bad path costs nothing
  } catch (const Error& e) {
    if (e.code() != ErrorCode::bad_file) throw;
    throw Error(e.code(), std::string("--output ") + e.what());
  }

  GPT2 model = load_model(a, opts);
  const int64_t T = static_cast<int64_t>(ids.size()), V = model.config().vocab_size;
  // T is checked by logits() against n_positions before anything is computed, but the buffer comes first.
  if (T > model.config().n_positions) {
    invalid("--ids: " + std::to_string(T) + " ids, more than n_positions = " +
            std::to_string(model.config().n_positions));
  }
  std::vector<float> logits(static_cast<size_t>(T * V));
  model.logits(ids.data(), T, logits.data());
  try {
    npy::write_f32(output, logits.data(), {T, V});
  } catch (const Error& e) {
    if (e.code() != ErrorCode::bad_file) throw;
    throw Error(e.code(), std::string("--output ") + e.what());
  }
  return 0;
}

}  // namespace

const Command& generate_command() {
  static const Command c{
      "generate",
      "new token ids for each prompt of ids, with a whole GPT-2 (greedy or sampled).",
      [] {
        std::vector<Option> rows = model_rows();
        const std::vector<Option> more = {
            values("prompt-ids", "ID,ID,...", "one prompt's token ids (or --prompts-file)."),
            value("prompts-file", "FILE.json", "a JSON array of prompts, each an array of token ids."),
            required("max-new-tokens", "N", "the most new ids per prompt (1 or more)."),
            value("temperature", "T", "0 (default) greedy, else sampling at temperature T."),
            value("top-k", "K", "sample among the K largest logits (ties kept); default 0 = off."),
            value("top-p", "P", "sample in the nucleus of probability P, in (0, 1]; default 1 = off."),
            value("seed", "S", "the sampling seed of prompt 0 (prompt i: S + i); default 0."),
            value("stop-ids", "ID,ID,...", "ids that end a sequence when generated (e.g. 50256, <|endoftext|>)."),
            compute_row(false),
            cache_dtype_row(),
            weights_row(false),
            threads_row(),
            isa_row(),
            value("max-step-tokens", "N", "prompt tokens one step takes at most; default 512."),
            flag("logprobs", "with --json: each new id's log-probability."),
            flag("json", "one JSON object per prompt per line instead of the ids."),
        };
        rows.insert(rows.end(), more.begin(), more.end());
        return rows;
      }(),
      kGenerateAbout,
      run_generate};
  return c;
}

const Command& logits_command() {
  static const Command c{
      "logits",
      "one sequence's teacher-forced logits (T, vocab_size), written to a .npy file.",
      [] {
        std::vector<Option> rows = model_rows();
        const std::vector<Option> more = {
            required("ids", "ID,ID,...", "the sequence's token ids, from position 0."),
            compute_row(false),
            weights_row(false),
            threads_row(),
            isa_row(),
            required("output", "logits.npy", "the float32 (T, vocab_size) logits, written atomically."),
        };
        rows.insert(rows.end(), more.begin(), more.end());
        return rows;
      }(),
      kLogitsAbout,
      run_logits};
  return c;
}

}  // namespace gpt2attn::cli
