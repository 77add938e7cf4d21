// python/model_bindings.cpp: the model library (gpt2attn/gpt2.hpp) for Python: GPT2 (teacher-forced logits, the
// ragged step over a ModelKvCache for servers written in Python, generation), GPT2Config, gpt2_preset. Token ids in
// and out; no tokenizer. Its own source file so that module.cpp's attention bindings are not recompiled with it.
//
// Token ids: a list of ints, or a 1-D array or tensor of any integer dtype. Ids are exact in every integer type, so
// reading an int64 array's ids as the library's int32 changes no value (one outside int32 is reported as outside the
// vocabulary, as the library words it); float and bool arrays are refused, never rounded. Logits come back as new
// float32 numpy arrays. Compute calls release the GIL; calls on one GPT2 are serialised by the library.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <charconv>
#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "bindings.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/gpt2.hpp"
#include "gpt2attn/gpt2_checkpoint.hpp"
#include "gpt2attn/model_kv_cache.hpp"
#include "gpt2attn/options.hpp"

namespace py = pybind11;
namespace ga = gpt2attn;

namespace {

using gpt2attn_py::invalid;

std::string str(int64_t v) { return std::to_string(v); }

// The library's wording for an id outside the vocabulary, for ids that do not even fit its int32.
template <class T>
[[noreturn]] void outside_vocabulary(const std::string& call, T id, int64_t i, int64_t vocab) {
  invalid(call + ": token id " + std::to_string(id) + " at " + str(i) + " is outside the vocabulary [0, " + str(vocab) +
          ")");
}

template <class T>
void read_ids(const py::array& a, std::vector<int32_t>& out, const std::string& call, int64_t vocab) {
  const auto v = a.unchecked<T, 1>();
  out.resize(static_cast<size_t>(v.shape(0)));
  for (py::ssize_t i = 0; i < v.shape(0); ++i) {
    const T id = v(i);
    bool fits;
    if constexpr (std::is_signed_v<T>) {
      fits = id >= 0 && static_cast<int64_t>(id) <= INT32_MAX;
    } else {
      fits = static_cast<uint64_t>(id) <= INT32_MAX;
    }
    if (!fits) outside_vocabulary(call, id, i, vocab);
    out[static_cast<size_t>(i)] = static_cast<int32_t>(id);
  }
}

// One sequence's token ids (see the file's comment). `call` prefixes the errors, as the library's own do; the
// library then checks each id against the vocabulary.
std::vector<int32_t> ids_of(const py::handle& obj, const char* name, const std::string& call, int64_t vocab) {
  const py::array a = gpt2attn_py::as_array(obj, name);
  if (a.ndim() != 1) {
    invalid(call + ": " + name + " has " + str(a.ndim()) + " dimensions; expected a 1-D sequence of token ids");
  }
  std::vector<int32_t> ids;
  if (a.size() == 0) return ids;  // np.asarray([]) is float64: the library names the empty sequence instead
  const char kind = a.dtype().kind();
  const auto size = a.itemsize();
  if (kind == 'i' && size == 1) read_ids<int8_t>(a, ids, call, vocab);
  else if (kind == 'i' && size == 2) read_ids<int16_t>(a, ids, call, vocab);
  else if (kind == 'i' && size == 4) read_ids<int32_t>(a, ids, call, vocab);
  else if (kind == 'i' && size == 8) read_ids<int64_t>(a, ids, call, vocab);
  else if (kind == 'u' && size == 1) read_ids<uint8_t>(a, ids, call, vocab);
  else if (kind == 'u' && size == 2) read_ids<uint16_t>(a, ids, call, vocab);
  else if (kind == 'u' && size == 4) read_ids<uint32_t>(a, ids, call, vocab);
  else if (kind == 'u' && size == 8) read_ids<uint64_t>(a, ids, call, vocab);
  else {
    invalid(call + ": " + name + " has dtype " + std::string(py::str(a.dtype())) +
            "; token ids are integers (a list of ints or an integer array)");
  }
  return ids;
}

bool is_integer_scalar(const py::handle& x) {
  // A handle, deliberately never released: a static py::object would be decref'ed after the interpreter is gone.
  static const py::handle np_integer = py::object(py::module_::import("numpy").attr("integer")).release();
  return PyLong_Check(x.ptr()) || py::isinstance(x, np_integer);
}

// generate()'s prompts: one prompt (a flat list of ints, a 1-D array) or several (a list of them, a 2-D array).
std::vector<std::vector<int32_t>> prompts_of(const py::object& obj, int64_t vocab) {
  const std::string call = "GPT2::generate";
  std::vector<std::vector<int32_t>> prompts;
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    const py::sequence s = obj;
    if (s.size() == 0) return prompts;  // the library says "no prompts"
    if (is_integer_scalar(s[0])) {
      prompts.push_back(ids_of(obj, "prompts", call + ": prompt 0", vocab));
      return prompts;
    }
    for (size_t i = 0; i < s.size(); ++i) {
      prompts.push_back(ids_of(s[i], "prompt", call + ": prompt " + str(static_cast<int64_t>(i)), vocab));
    }
    return prompts;
  }
  const py::array a = gpt2attn_py::as_array(obj, "prompts");
  if (a.ndim() == 1) {
    prompts.push_back(ids_of(a, "prompts", call + ": prompt 0", vocab));
  } else if (a.ndim() == 2) {
    for (py::ssize_t i = 0; i < a.shape(0); ++i) {
      prompts.push_back(ids_of(a[py::int_(i)], "prompt", call + ": prompt " + str(i), vocab));
    }
  } else {
    invalid(call + ": prompts has " + str(a.ndim()) +
            " dimensions; give one prompt (a list of ints) or several (a list of them, or a 2-D array)");
  }
  return prompts;
}

// from_pretrained's and random's options: dtype is the compute type, weights_dtype the matrices' format.
ga::EngineOptions model_options(const std::string& dtype, const std::optional<std::string>& weights_dtype,
                                int threads, const std::string& isa) {
  if (weights_dtype && *weights_dtype != "compute" && *weights_dtype != "int8" && *weights_dtype != "int4") {
    invalid("weights_dtype '" + *weights_dtype + "' (supported: 'compute', 'int8', 'int4')");
  }
  if (dtype != "f32" && dtype != "bf16") invalid("dtype '" + dtype + "' (supported: 'f32', 'bf16')");
  const bool compute = !weights_dtype || *weights_dtype == "compute";
  return gpt2attn_py::engine_options(threads, isa, dtype, compute ? std::nullopt : weights_dtype);
}

// GPT2.random's config: a preset name, a GPT2Config, or a dict of GPT2Config's fields (the rest at their defaults).
ga::GPT2Config config_of(const py::object& obj) {
  if (py::isinstance<py::str>(obj)) return ga::gpt2_preset(obj.cast<std::string>());
  if (py::isinstance<ga::GPT2Config>(obj)) return obj.cast<ga::GPT2Config>();
  if (!py::isinstance<py::dict>(obj)) {
    invalid("config: a preset name, a GPT2Config or a dict of its fields, got " +
            std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  ga::GPT2Config c;
  for (const auto& [key, value] : obj.cast<py::dict>()) {
    const std::string k = py::str(key);
    if (k == "vocab_size") c.vocab_size = value.cast<int64_t>();
    else if (k == "n_positions") c.n_positions = value.cast<int64_t>();
    else if (k == "n_embd") c.n_embd = value.cast<int64_t>();
    else if (k == "n_layer") c.n_layer = value.cast<int64_t>();
    else if (k == "n_head") c.n_head = value.cast<int64_t>();
    else if (k == "n_inner") c.n_inner = value.is_none() ? 0 : value.cast<int64_t>();
    else if (k == "layer_norm_epsilon") c.layer_norm_epsilon = value.cast<float>();
    else {
      invalid("config: unknown key '" + k +
              "' (GPT2Config's fields: vocab_size, n_positions, n_embd, n_layer, n_head, n_inner, "
              "layer_norm_epsilon)");
    }
  }
  return c;
}

ga::RunOptions run_of(int threads, bool batch_invariant = false) {
  ga::RunOptions r;
  r.threads = threads;
  r.batch_invariant = batch_invariant;
  return r;
}

// The shortest text that reads back as the same float (1e-05, not 9.999999747378752e-06).
std::string shortest(float x) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

std::string config_repr(const ga::GPT2Config& c) {
  return "gpt2attn.GPT2Config(vocab_size=" + str(c.vocab_size) + ", n_positions=" + str(c.n_positions) +
         ", n_embd=" + str(c.n_embd) + ", n_layer=" + str(c.n_layer) + ", n_head=" + str(c.n_head) +
         ", n_inner=" + str(c.n_inner) + ", layer_norm_epsilon=" + shortest(c.layer_norm_epsilon) + ")";
}

}  // namespace

void gpt2attn_py::bind_model(py::module_& m) {
  py::class_<ga::GPT2Config>(m, "GPT2Config", "A GPT-2's sizes, in Hugging Face's GPT2Config names.")
      .def(py::init([](int64_t vocab_size, int64_t n_positions, int64_t n_embd, int64_t n_layer, int64_t n_head,
                       int64_t n_inner, float layer_norm_epsilon) {
             ga::GPT2Config c;
             c.vocab_size = vocab_size, c.n_positions = n_positions, c.n_embd = n_embd, c.n_layer = n_layer;
             c.n_head = n_head, c.n_inner = n_inner, c.layer_norm_epsilon = layer_norm_epsilon;
             return c;
           }),
           py::arg("vocab_size") = 50257, py::arg("n_positions") = 1024, py::arg("n_embd") = 768,
           py::arg("n_layer") = 12, py::arg("n_head") = 12, py::arg("n_inner") = 0,
           py::arg("layer_norm_epsilon") = 1e-5f, "n_inner 0: 4 n_embd.")
      .def_readwrite("vocab_size", &ga::GPT2Config::vocab_size)
      .def_readwrite("n_positions", &ga::GPT2Config::n_positions)
      .def_readwrite("n_embd", &ga::GPT2Config::n_embd)
      .def_readwrite("n_layer", &ga::GPT2Config::n_layer)
      .def_readwrite("n_head", &ga::GPT2Config::n_head)
      .def_readwrite("n_inner", &ga::GPT2Config::n_inner)
      .def_readwrite("layer_norm_epsilon", &ga::GPT2Config::layer_norm_epsilon)
      .def("validate", &ga::GPT2Config::validate)
      .def("to_dict",
           [](const ga::GPT2Config& c) {
             py::dict d;
             d["vocab_size"] = c.vocab_size, d["n_positions"] = c.n_positions, d["n_embd"] = c.n_embd;
             d["n_layer"] = c.n_layer, d["n_head"] = c.n_head, d["n_inner"] = c.n_inner;
             d["layer_norm_epsilon"] = c.layer_norm_epsilon;
             return d;
           })
      .def("__eq__",
           [](const ga::GPT2Config& a, const ga::GPT2Config& b) {
             return a.vocab_size == b.vocab_size && a.n_positions == b.n_positions && a.n_embd == b.n_embd &&
                    a.n_layer == b.n_layer && a.n_head == b.n_head && a.inner() == b.inner() &&
                    a.layer_norm_epsilon == b.layer_norm_epsilon;
           })
      .def("__repr__", &config_repr);
  m.def("gpt2_preset", &ga::gpt2_preset, py::arg("name"),
        "The GPT2Config of 'gpt2-small', 'gpt2-medium', 'gpt2-large' or 'gpt2-xl'.");

  py::class_<ga::ModelKvCache>(m, "ModelKvCache",
                               "A whole model's KV cache (one pool per layer, one id per sequence); GPT2.make_cache.")
      .def("create", &ga::ModelKvCache::create, "A new empty sequence's id.")
      .def(
          "fork",
          [](ga::ModelKvCache& c, ga::SequenceId parent, std::optional<int64_t> prefix_tokens) {
            return prefix_tokens ? c.fork(parent, *prefix_tokens) : c.fork(parent);
          },
          py::arg("parent"), py::arg("prefix_tokens") = py::none(),
          "A new sequence sharing the parent's tokens, or its first prefix_tokens of them.")
      .def("truncate", &ga::ModelKvCache::truncate, py::arg("seq"), py::arg("new_length"),
           "Drops the sequence's tokens past new_length.")
      .def("release", &ga::ModelKvCache::release, py::arg("seq"))
      .def("length", &ga::ModelKvCache::length, py::arg("seq"))
      .def("__contains__", &ga::ModelKvCache::contains)
      .def("blocks_needed",
           py::overload_cast<ga::SequenceId, int64_t>(&ga::ModelKvCache::blocks_needed, py::const_),
           py::arg("seq"), py::arg("tokens"), "Blocks appending `tokens` to seq takes from each layer's pool.")
      .def_property_readonly("layers", &ga::ModelKvCache::layers)
      .def_property_readonly("free_blocks", &ga::ModelKvCache::free_blocks, "Per layer.")
      .def_property_readonly("total_blocks", &ga::ModelKvCache::total_blocks, "Per layer.")
      .def_property_readonly("block_tokens", &ga::ModelKvCache::block_tokens)
      .def_property_readonly("num_sequences", &ga::ModelKvCache::num_sequences)
      .def_property_readonly("capacity_bytes", &ga::ModelKvCache::capacity_bytes, "All layers together.")
      .def_property_readonly("dtype",
                             [](const ga::ModelKvCache& c) { return std::string(ga::to_string(c.dtype())); });

  py::class_<ga::GPT2>(m, "GPT2", "A whole GPT-2 (gpt2attn/gpt2.hpp): token ids in, logits or generated ids out.")
      .def_static(
          "from_pretrained",
          [](const std::string& dir, const std::string& dtype, const std::optional<std::string>& weights_dtype,
             int threads, const std::string& isa) {
            const ga::EngineOptions o = model_options(dtype, weights_dtype, threads, isa);
            py::gil_scoped_release nogil;  // reads, checks and converts every weight: seconds at gpt2-xl
            return ga::GPT2::from_pretrained(dir, o);
          },
          py::arg("dir"), py::arg("dtype") = "f32", py::arg("weights_dtype") = "compute", py::arg("threads") = 0,
          py::arg("isa") = "best",
          "A Hugging Face GPT-2 checkpoint directory (config.json + model.safetensors or shards). dtype: compute "
          "'f32' or 'bf16'; weights_dtype: 'compute', 'int8' or 'int4'.")
      .def_static(
          "random",
          [](const py::object& config, uint64_t seed, const std::string& dtype,
             const std::optional<std::string>& weights_dtype, int threads, const std::string& isa) {
            const ga::GPT2Config c = config_of(config);
            const ga::EngineOptions o = model_options(dtype, weights_dtype, threads, isa);
            py::gil_scoped_release nogil;
            return ga::GPT2(ga::random_gpt2(c, seed, ga::DType::f32, threads > 0 ? threads : ga::max_threads()), o);
          },
          py::arg("config"), py::arg("seed") = 0, py::arg("dtype") = "f32", py::arg("weights_dtype") = "compute",
          py::arg("threads") = 0, py::arg("isa") = "best",
          "GPT-2's initialization at a preset name ('gpt2-small'), a GPT2Config or a dict of its fields, "
          "reproducible from the seed.")
      .def_property_readonly("config", [](const ga::GPT2& g) { return g.config(); })  // a copy
      .def_property_readonly("threads", [](const ga::GPT2& g) { return g.options().threads; })
      .def_property_readonly("weight_bytes", &ga::GPT2::weight_bytes)
      .def(
          "logits",
          [](ga::GPT2& self, const py::object& ids, int threads) {
            const std::vector<int32_t> v = ids_of(ids, "ids", "GPT2::logits", self.config().vocab_size);
            const auto T = static_cast<int64_t>(v.size());
            // An empty or too long sequence gets no array: the library refuses T first, naming it.
            const bool sized = T >= 1 && T <= self.config().n_positions;
            py::array_t<float> out(std::vector<py::ssize_t>{sized ? T : 0, self.config().vocab_size});
            float* dst = out.mutable_data();
            {
              py::gil_scoped_release nogil;
              self.logits(v.data(), T, dst, run_of(threads));
            }
            return out;
          },
          py::arg("ids"), py::arg("threads") = 0,
          "Teacher-forced logits (T, vocab_size) float32 of ids at positions 0..T-1, without a cache.")
      .def(
          "make_cache",
          [](const ga::GPT2& self, int64_t capacity_tokens, int64_t block_tokens, size_t capacity_bytes,
             const std::string& dtype) {
            ga::KvCacheOptions o;
            o.capacity_tokens = capacity_tokens, o.block_tokens = block_tokens, o.capacity_bytes = capacity_bytes;
            o.dtype = gpt2attn_py::kv_dtype_of(dtype);
            return self.make_cache(o);
          },
          py::arg("capacity_tokens") = 0, py::arg("block_tokens") = 0, py::arg("capacity_bytes") = 0,
          py::arg("dtype") = "f32",
          "A ModelKvCache for step(): capacity_tokens per layer (or capacity_bytes in all); dtype 'f32', 'bf16', "
          "'int8' or 'fp8'.")
      .def(
          "step",
          [](ga::GPT2& self, ga::ModelKvCache& cache, const std::vector<ga::SequenceId>& seqs,
             const std::vector<int64_t>& tokens, const py::object& ids, bool all_positions, int threads,
             bool batch_invariant) {
            const ga::GPT2Config& c = self.config();
            if (tokens.size() != seqs.size()) {
              invalid("GPT2::step: seqs has " + str(static_cast<int64_t>(seqs.size())) + " entries and tokens " +
                      str(static_cast<int64_t>(tokens.size())) + "; give one token count per sequence");
            }
            const std::vector<int32_t> v = ids_of(ids, "ids", "GPT2::step", c.vocab_size);
            const auto n = static_cast<int64_t>(seqs.size());
            // The counts the library takes (each 1..n_positions, so the sum cannot overflow) size the result and
            // must match the ids; other counts the library refuses, naming the entry, before it reads or writes.
            bool counts_ok = n >= 1;
            int64_t total = 0;
            for (int64_t t : tokens) {
              counts_ok = counts_ok && t >= 1 && t <= c.n_positions;
              if (counts_ok) total += t;
            }
            if (counts_ok && static_cast<int64_t>(v.size()) != total) {
              invalid("GPT2::step: " + str(static_cast<int64_t>(v.size())) + " ids, expected sum(tokens) = " +
                      str(total));
            }
            const int64_t rows = !counts_ok ? 0 : all_positions ? total : n;
            // No ids where the counts are refused: a valid pointer all the same, so the library names the count
            // rather than a null ids.
            static const int32_t no_ids = 0;
            const int32_t* id_ptr = v.empty() ? &no_ids : v.data();
            py::array_t<float> out(std::vector<py::ssize_t>{rows, c.vocab_size});
            float* dst = out.mutable_data();
            {
              py::gil_scoped_release nogil;
              self.step(cache, seqs.data(), tokens.data(), n, id_ptr, dst, all_positions,
                        run_of(threads, batch_invariant));
            }
            return out;
          },
          py::arg("cache"), py::arg("seqs"), py::arg("tokens"), py::arg("ids"), py::arg("all_positions") = false,
          py::arg("threads") = 0, py::arg("batch_invariant") = false,
          "One continuous-batching step: entry i appends tokens[i] >= 1 ids (packed in entry order in ids) to "
          "sequence seqs[i]. Returns each entry's last logits (n, vocab_size), or with all_positions every new "
          "token's (sum(tokens), vocab_size). A refused step changes no sequence. batch_invariant: each token's "
          "logits the same bits whatever shares the step (RunOptions::batch_invariant).")
      .def(
          "generate",
          [](ga::GPT2& self, const py::object& prompts, int64_t max_new_tokens, float temperature, int64_t top_k,
             float top_p, uint64_t seed, const std::vector<int32_t>& stop, bool logprobs, const std::string& kv_dtype,
             int64_t max_step_tokens, int threads, bool batch_invariant) {
            const std::vector<std::vector<int32_t>> p = prompts_of(prompts, self.config().vocab_size);
            ga::GenerateOptions o;
            o.max_new_tokens = max_new_tokens;
            o.sampling.temperature = temperature, o.sampling.top_k = top_k, o.sampling.top_p = top_p;
            o.sampling.seed = seed;
            o.stop_tokens = stop;
            o.logprobs = logprobs;
            o.kv_dtype = gpt2attn_py::kv_dtype_of(kv_dtype);
            o.max_step_tokens = max_step_tokens;
            o.run = run_of(threads, batch_invariant);
            std::vector<ga::Generation> gens;
            {
              py::gil_scoped_release nogil;
              gens = self.generate(p, o);
            }
            py::list out;
            for (const ga::Generation& g : gens) {
              py::dict d;
              d["prompt_ids"] = py::cast(g.prompt_ids);
              d["new_ids"] = py::cast(g.new_ids);
              d["finish_reason"] = g.finish_reason;
              if (logprobs) d["logprobs"] = py::cast(g.logprobs);
              d["first_token_ms"] = g.first_token_ms;
              d["total_ms"] = g.total_ms;
              out.append(d);
            }
            return out;
          },
          py::arg("prompts"), py::arg("max_new_tokens") = 16, py::arg("temperature") = 0.0f, py::arg("top_k") = 0,
          py::arg("top_p") = 1.0f, py::arg("seed") = 0, py::arg("stop") = std::vector<int32_t>{},
          py::arg("logprobs") = false, py::arg("kv_dtype") = "f32", py::arg("max_step_tokens") = 512,
          py::arg("threads") = 0, py::arg("batch_invariant") = false,
          "Generates for one prompt (a list of ids) or several (a list of lists), batched; returns one dict per "
          "prompt: prompt_ids, new_ids, finish_reason ('stop' or 'length'), logprobs (if asked), first_token_ms, "
          "total_ms. temperature 0 is greedy; prompt i samples with seed + i. batch_invariant: each prompt's "
          "results the same bits as generated alone.");
}
