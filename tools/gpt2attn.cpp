// tools/gpt2attn.cpp: the command-line tool: `forward` on .npy/.safetensors files, `bench` over the presets,
// `presets`. Exit status: 0 ok, 2 bad input (one line on stderr), 1 internal error. Only main() exits.
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "engine/io/file_io.hpp"
#include "engine/linear.hpp"
#include "engine/team.hpp"
#include "engine/util.hpp"
#include "tools/npy.hpp"
#include "gpt2attn/gpt2attn.h"
#include "gpt2attn/gpt2attn.hpp"
#ifdef GPT2ATTN_HAVE_MPI
#include "gpt2attn/parallel.hpp"
#endif

namespace ga = gpt2attn;

namespace {

// The MPI world. Under mpirun with more than one rank, forward and bench run tensor parallel (gpt2attn/parallel.hpp):
// every rank computes its heads, rank 0 alone writes files and prints. Without mpirun MPI is never initialised.
struct World {
  int rank = 0, ranks = 1;
  bool parallel() const { return ranks > 1; }
  bool prints() const { return rank == 0; }
};
World g_world;

const char* kUsage = R"(usage:
  gpt2attn --version | --help
  gpt2attn forward --weights W.safetensors [--prefix P] (--heads H | --config config.json) [--kv-heads N] --query q.npy
                   [--key k.npy --value v.npy] [--mask m.npy --mask-kind keep|block|additive]
                   [--key-padding kp.npy] [--causal] [--context-length N] [--dtype f32|bf16]
                   [--threads N] [--isa best|avx512_bf16|avx512|avx2|scalar] --output y.npy
  gpt2attn bench   [--preset NAME ...] [--batch B] [--seq T] [--mode prefill|decode] [--dtype f32|bf16 ...]
                   [--kv-heads N ...]
                   [--kv-dtype f32|bf16|int8 ...] [--interleave]
                   [--threads N] [--isa ...] [--repeats N] [--cache warm|cold] [--check | --no-check] [--json]
  gpt2attn presets

forward  runs one multi-head attention layer (torch.nn.MultiheadAttention semantics, batch_first) with the
         weights of a safetensors file (torch or Hugging Face GPT-2 naming) and writes float32 (B, T, E).
         Inputs are float32/float64 .npy; masks bool, uint8 or float (a key padding bool or uint8, nonzero
         = padding); without --key/--value it is self-attention. An unbatched (T, d_in) query, as torch
         takes it, gives a (T, E) output. --config
         reads a Hugging Face GPT-2 config.json (n_embd, n_head, n_positions) or one of configs/*.json:
         the heads, K/V heads, causality (GPT-2's is) and the default context length come from it, a
         --heads or --kv-heads that disagrees is refused, and so are weights whose widths or biases differ
         from what it says. A mask without --mask-kind is read as torch reads it: bool or
         uint8 blocks where nonzero (block), float is added to the scores (additive); --mask-kind keep
         gives seeds 002/003's reading (nonzero may attend). Mask shapes: (T, Tk), (B, T, Tk), (B, H, T,
         Tk), torch's (B*H, T, Tk), and size-1 B or H axes, which broadcast. --kv-heads N (grouped-query
         attention: N K/V heads, dividing H) must match the file's K/V width; without it the K/V heads are
         read from that width. --context-length defaults to max(1024, T, Tk). --output is written
         atomically (a temporary file next to it, renamed onto it); a symbolic link is followed, so the
         link stays and its target gets the data (a link to a missing file is refused), and an existing
         --output that is not a regular file (a device such as /dev/null, a FIFO, a directory) is refused.
         --dtype bf16 computes in bf16 (weights, projections and the attention core; f32 accumulation,
         softmax and output; see the README's accuracy section); on a CPU or --isa without AVX512-BF16 the
         attention core widens the bf16 Q, K and V to f32 and multiplies in f32 (the softmax weights are
         not rounded to bf16 there), so its results differ from AVX512-BF16's within the bf16 bound. Default
         f32.
bench    times the whole layer (QKV projection, causal attention, output projection) on random weights for
         each preset (default: gpt2-small, gpt2-medium, gpt2-large, gpt2-xl, gpt3-175b; gpt3-175b at
         min(T, 128) unless --preset names it); the median of --repeats runs (default 5). --dtype (f32 or
         bf16, default f32) is the compute type; given more than once, every preset runs in each, in the
         order given, and each row says which. --kv-heads N gives
         every preset N K/V heads (grouped-query attention; N must divide its heads; default: as many as heads);
         given more than once, every case runs with each (the kvh column).
         --mode prefill (default): B sequences of T tokens through forward(). GFLOP/s counts causal
         attention once (the lower triangle): 2*B*T*d_in*(E+2KW) + 2*B*T*E*E + 4*E*B*T*(T+1)/2, where KW = E
         unless --kv-heads groups K/V heads (KW = N*D). --check (default
         in the table, off with --json) compares the first rows of batch 0 with the naive reference.
         --mode decode: B sequences in a KV cache, each prefilled with T tokens by extend(); one timed step
         is decode() of one new token for each of the B sequences (QKV projection, attention over the cache,
         output projection); every step appends, so the cache grows by 2 + repeats tokens per sequence
         (context length raised to fit). GFLOP/s: 2*B*d_in*(E+2KW) + 2*B*E*E + 4*E*B*(T+1); tokens/s = B / step;
         bytes per step = weights ((E+2KW)*d_in + E*E)*(4 or 2 by --dtype) + K/V read B*T*2*KW*(4, 2 or 1 by
         --kv-dtype), plus for int8 B*T*2*N*4 of scales (N K/V heads); GB/s = bytes per step / step.
         --kv-dtype bf16 stores the cache's K/V in bf16 (half the K/V bytes); int8 in symmetric int8 with one
         f32 scale per token and K/V head (about a quarter); default f32. Given more than once (like
         --dtype), every case runs with each cache, so one run compares them. --interleave (with --cache
         cold) sets every case up first and then takes one step of each case in turn, so that all of them
         meet the same minutes of a shared machine; each row then also carries x_first, the median over the
         timed steps of the first case's step time over this case's (the first case's is 1).
         A sweep of several presets reports each finished case on stderr (one line rewritten in place on a
         terminal) when its rows go to --json or to a pipe; stdout carries the rows alone.
         --check compares sequence 0's output of the first timed step with the last row of the naive
         reference run causally over that sequence's whole token history (with a bf16 or int8 cache,
         within the bound of gpt2attn/tolerance.hpp's kv_storage_tolerance). --cache warm (default) runs the
         steps back to back, so a small case's weights and K/V stay in the CPU caches; --cache cold streams
         256 MiB (or twice the reported last-level cache, if more) through the caches before each timed step,
         as a model's other layers would (GPT-2 small's 12 layers move about 190 MB per step), so every byte
         comes from memory. A case whose weights and activations (and KV cache) need more bytes than the
         machine's physical memory is refused before anything is allocated. --json rows carry peak_rss_mb,
         the process's peak resident memory so far (getrusage): for a run of one case, that case's.
presets  lists the compiled-in presets.

--isa caps the instruction set of the whole layer: gpt2attn's kernels, and oneDNN's GEMMs (avx512_bf16: oneDNN's
avx512_core_bf16, so no AMX; avx512: avx512_core; avx2: avx2; scalar: sse41), unless ONEDNN_MAX_CPU_ISA or
DNNL_MAX_CPU_ISA is set in the environment, which is then kept; best caps neither. Below avx512 oneDNN has no
bf16 GEMM, and --dtype bf16 projections multiply the bf16-rounded values in f32 GEMMs.
--threads N is 1 to 1024 (default: every core OpenMP offers); --repeats N is 1 to 2147483647; --heads,
--kv-heads, --context-length, --batch and --seq are 1 or more. A value out of range is refused, never narrowed.
An option that takes one value (all but bench's --preset, --dtype, --kv-dtype and --kv-heads) given twice is refused;
so is a value given twice to one of those four.

exit status: 0 success, 2 bad input or usage, 1 internal error.
)";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// `gpt2attn forward --help` and the like: main prints the usage and exits 0.
struct HelpRequested {};

// The library's kMaxThreads (include/gpt2attn/attention.hpp), which refuses more too; checked here first so
// the message names --threads.
constexpr int kMaxThreads = 1024;

// a * b for element and byte counts, or an invalid_argument error naming `what` when it overflows int64: a
// size from the command line or a file must never wrap into a small allocation that is then overrun.
int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) {
    ga::invalid(what + " overflows int64 (" + std::to_string(a) + " x " + std::to_string(b) + ")");
  }
  return r;
}

// a + b, likewise.
int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) {
    ga::invalid(what + " overflows int64 (" + std::to_string(a) + " + " + std::to_string(b) + ")");
  }
  return r;
}

// Runs f, putting "--output " before the path a file error names, so the message says which option it was.
template <class F>
void naming_output(F&& f) {
  try {
    f();
  } catch (const ga::Error& e) {
    if (e.code() != ga::ErrorCode::bad_file) throw;
    throw ga::Error(e.code(), std::string("--output ") + e.what());
  }
}

// --name value options; flags have no value. Repeated options keep every value.
struct Args {
  std::map<std::string, std::vector<std::string>> values;
  std::vector<std::string> flags;

  bool flag(const std::string& f) const { return std::find(flags.begin(), flags.end(), f) != flags.end(); }
  bool has(const std::string& k) const { return values.count(k) != 0; }
  // The value of single-valued option --k (`def` when absent); given twice, it is refused rather than the last one
  // silently taken (the options that repeat, --preset, --dtype, --kv-dtype and --kv-heads, are read from `values`).
  std::string get(const std::string& k, const std::string& def = "") const {
    auto it = values.find(k);
    if (it == values.end()) return def;
    if (it->second.size() > 1) throw UsageError("--" + k + " given more than once");
    return it->second.front();
  }
  std::string required(const std::string& k) const {
    if (!has(k)) throw UsageError("missing required option --" + k);
    return get(k);
  }
  // The value of integer option --k (`def` when absent) as the type I it is stored in, refused unless it lies in
  // [min_value, max_value]: a value is never narrowed after the check (--threads 4294967296 is not 0).
  template <class I>
  I integer(const std::string& k, I def, I min_value, I max_value = std::numeric_limits<I>::max()) const {
    return has(k) ? integer_of<I>(k, get(k), min_value, max_value) : def;
  }
  // Every value of repeatable option --k in the order given (none when absent), each read by `read` (which refuses
  // a bad one); a value read twice is refused: a repeat would run or report a case twice.
  template <class T, class Read>
  std::vector<T> distinct(const std::string& k, Read&& read) const {
    std::vector<T> out;
    if (!has(k)) return out;
    for (const std::string& s : values.at(k)) {
      T v = read(s);
      if (std::find(out.begin(), out.end(), v) != out.end()) throw UsageError("--" + k + " " + s + " given twice");
      out.push_back(std::move(v));
    }
    return out;
  }
  // Every value of a repeatable integer option, each checked as integer() checks one.
  template <class I>
  std::vector<I> integers(const std::string& k, I min_value, I max_value = std::numeric_limits<I>::max()) const {
    return distinct<I>(k, [&](const std::string& s) { return integer_of<I>(k, s, min_value, max_value); });
  }
  template <class I>
  static I integer_of(const std::string& k, const std::string& s, I min_value, I max_value) {
    static_assert(std::is_signed_v<I> && sizeof(I) <= sizeof(long long));
    const size_t digits = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;  // one optional sign
    if (s.size() == digits || s.find_first_not_of("0123456789", digits) != std::string::npos) {
      throw UsageError("--" + k + ": expected an integer, got '" + s + "'");
    }
    const std::string range =
        "must be in [" + std::to_string(min_value) + ", " + std::to_string(max_value) + "], got " + s;
    long long v = 0;
    try {
      v = std::stoll(s);
    } catch (const std::out_of_range&) {  // beyond int64, so beyond every I
      throw UsageError("--" + k + ": " + range + " (out of the 64-bit range)");
    }
    if (v < min_value || v > max_value) throw UsageError("--" + k + ": " + range);
    return static_cast<I>(v);
  }
};

// --isa (default best) by the library's names; an unknown name is a usage error that says which option it was.
ga::Isa isa_option(const Args& a) {
  try {
    return ga::isa_from_string(a.get("isa", "best"));
  } catch (const ga::Error& e) {
    throw UsageError(std::string("--isa: ") + e.what());
  }
}

Args parse(int argc, char** argv, int first, const std::vector<std::string>& value_opts,
           const std::vector<std::string>& flag_opts) {
  Args a;
  for (int i = first; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--help" || s == "-h") throw HelpRequested{};
    if (s.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + s + "'");
    s = s.substr(2);
    if (std::find(flag_opts.begin(), flag_opts.end(), s) != flag_opts.end()) {
      a.flags.push_back(s);
    } else if (std::find(value_opts.begin(), value_opts.end(), s) != value_opts.end()) {
      if (i + 1 >= argc) throw UsageError("option --" + s + " needs a value");
      // `--output --causal` would otherwise write a file named "--causal" and compute without the mask.
      const std::string value = argv[i + 1];
      const auto is_option = [&](const std::vector<std::string>& names) {
        return value.rfind("--", 0) == 0 && std::find(names.begin(), names.end(), value.substr(2)) != names.end();
      };
      if (is_option(value_opts) || is_option(flag_opts) || value == "--help") {
        throw UsageError("option --" + s + " needs a value, got the option " + value);
      }
      a.values[s].push_back(argv[++i]);
    } else {
      throw UsageError("unknown option --" + s);
    }
  }
  return a;
}

// The compute types --dtype asks for, in the order given (default f32); `repeatable` false allows one.
std::vector<ga::DType> compute_dtypes(const Args& a, bool repeatable) {
  if (!a.has("dtype")) return {ga::DType::f32};
  if (!repeatable && a.values.at("dtype").size() > 1) throw UsageError("--dtype given more than once");
  return a.distinct<ga::DType>("dtype", [](const std::string& dt) {
    if (dt != "f32" && dt != "bf16") throw UsageError("--dtype " + dt + " is not supported (supported: f32, bf16)");
    return ga::dtype_from_string(dt);
  });
}

ga::TensorView view_of(const ga::npy::Array& arr, const std::string& what) {
  if (arr.shape.size() > 4) ga::invalid(what + ": rank " + std::to_string(arr.shape.size()) + " > 4");
  const bool f32 = arr.kind == ga::npy::Kind::f32;
  return ga::TensorView::contiguous(f32 ? static_cast<const void*>(arr.f32.data()) : arr.u8.data(),
                                    f32 ? ga::DType::f32 : ga::DType::u8, arr.shape);
}

ga::npy::Array read_float_input(const std::string& path, const std::string& what) {
  ga::npy::Array a = ga::npy::read(path);
  if (a.kind != ga::npy::Kind::f32) {
    ga::invalid(what + " (" + path + "): expected float32 or float64 data, got dtype " + a.descr);
  }
  return a;
}

int cmd_forward(int argc, char** argv) {
  const Args a = parse(argc, argv, 2,
                       {"weights", "prefix", "config", "heads", "kv-heads", "query", "key", "value", "mask",
                        "mask-kind", "key-padding", "context-length", "dtype", "threads", "isa", "output"},
                       {"causal"});
  const ga::DType compute = compute_dtypes(a, false).front();
  const std::string out_path = a.required("output");
  if (!a.has("heads") && !a.has("config")) throw UsageError("missing required option --heads (or --config)");
  // --config (a Hugging Face GPT-2 config.json, or ours) says the heads and the context length; a --heads that
  // disagrees is an error, since another dividing head count would silently compute another layer. Read on every
  // rank, under mpirun inside the ranks' agreement, so that one rank's unreadable file fails them all.
  std::optional<ga::Config> file_cfg;
  int64_t heads = 0, kv_heads = 0;
  auto read_config = [&] {
    if (a.has("config")) file_cfg = ga::load_any_config(a.get("config"));
    heads = a.integer<int64_t>("heads", file_cfg ? file_cfg->num_heads : 0, 1);
    if (file_cfg && heads != file_cfg->num_heads) {
      ga::invalid("--heads " + std::to_string(heads) + " disagrees with " + a.get("config") + ", which says " +
                  std::to_string(file_cfg->num_heads) + " heads");
    }
    // The file's K/V heads likewise: a config that names none has as many as heads (a Hugging Face GPT-2 config
    // never names them). Without a config file the weights' K/V width decides.
    const int64_t file_kv_heads = file_cfg ? file_cfg->kv_heads() : 0;
    kv_heads = a.integer<int64_t>("kv-heads", file_kv_heads, 1);
    if (file_kv_heads != 0 && kv_heads != file_kv_heads) {
      ga::invalid("--kv-heads " + std::to_string(kv_heads) + " disagrees with " + a.get("config") + ", which says " +
                  std::to_string(file_kv_heads) + " K/V heads");
    }
  };
  if (!g_world.parallel()) read_config();
  const int threads = a.integer<int>("threads", 0, 1, kMaxThreads);
  // The write checks again; checking now refuses a device or FIFO before any work is done (on the rank that writes).
  auto check_output_path = [&] { naming_output([&] { ga::io::resolve_write_target(out_path); }); };
  if (!g_world.parallel()) check_output_path();
  if (a.has("key") != a.has("value")) throw UsageError("--key and --value must be given together");
  if (a.has("mask-kind") && !a.has("mask")) throw UsageError("--mask-kind given without --mask");

  ga::npy::Array q, k, v, mask, padding;
  ga::AttentionInputs in;
  bool unbatched = false;
  // The inputs, read on every rank (a tensor-parallel rank reads them itself, so each must see the files).
  auto read_inputs = [&] {
    q = read_float_input(a.required("query"), "query");
    in.query = view_of(q, "query");
    // Unbatched, as torch takes it: a (T, d_in) query (with (Tk, kdim) key and value, (Tk,) key padding) is a batch
    // of one, and the output is written (T, E).
    unbatched = in.query.rank == 2;
    auto batch_of_one = [&](ga::TensorView t, int rank) {
      if (!unbatched || t.rank != rank) return t;
      for (int d = t.rank; d > 0; --d) t.shape[d] = t.shape[d - 1], t.strides[d] = t.strides[d - 1];
      t.shape[0] = 1, t.strides[0] = 0, ++t.rank;
      return t;
    };
    in.query = batch_of_one(in.query, 2);
    if (a.has("key")) {
      k = read_float_input(a.get("key"), "key");
      v = read_float_input(a.get("value"), "value");
      in.key = batch_of_one(view_of(k, "key"), 2);
      in.value = batch_of_one(view_of(v, "value"), 2);
    }
    if (a.has("mask")) {
      mask = ga::npy::read(a.get("mask"));
      in.attn_mask = view_of(mask, "mask");
      // torch's layouts too: size-1 B or H axes broadcast, (B * H, T, Tk) as (B, H, T, Tk)
      if (in.query.rank == 3) in.attn_mask = ga::torch_mask_view(in.attn_mask, in.query.shape[0], heads);
      // Without --mask-kind, torch's reading of its dtype.
      in.mask_kind = a.has("mask-kind") ? ga::mask_kind_from_string(a.get("mask-kind"))
                                        : ga::torch_mask_kind(in.attn_mask.dtype);
    }
    if (a.has("key-padding")) {
      padding = ga::npy::read(a.get("key-padding"));
      in.key_padding = batch_of_one(view_of(padding, "key-padding"), 1);
      // torch adds a float key_padding_mask to the scores; the library reads nonzero as padding. Refused rather
      // than read another way than torch reads it.
      if (in.key_padding.dtype == ga::DType::f32) {
        ga::invalid("--key-padding " + a.get("key-padding") + ": a float mask (torch adds it to the scores); pass "
                    "a bool or uint8 one, nonzero = padding");
      }
    }
  };

  ga::Config cfg;
  auto configure = [&] {  // after read_config
    cfg.num_heads = heads;
    cfg.num_kv_heads = kv_heads;
    // Causal when the flag or the config file says so (a Hugging Face GPT-2 config always does: GPT-2 is causal).
    cfg.causal = a.flag("causal") || (file_cfg && file_cfg->causal);
  };
  // The context length: --context-length, the config file's, or enough for the inputs.
  auto set_context = [&] {
    const int64_t T = in.query.rank == 3 ? in.query.shape[1] : 0;
    const int64_t Tk = in.key.rank == 3 ? in.key.shape[1] : T;
    cfg.context_length = a.integer<int64_t>("context-length",
                                            file_cfg ? file_cfg->context_length : std::max<int64_t>({1024, T, Tk}), 1);
  };
  // What the config file says of the layer's shape must be what the weights file holds: a config is never
  // silently half-applied. (Its dropout is for training; forward is inference.)
  auto check_against_config = [&](const ga::Config& c) {
    if (!file_cfg) return;
    const ga::Config& f = *file_cfg;
    const auto yes_no = [](bool b) { return std::string(b ? "true" : "false"); };
    const std::pair<std::string, std::pair<std::string, std::string>> fields[] = {
        {"d_model", {std::to_string(f.d_model), std::to_string(c.d_model)}},
        {"d_in", {std::to_string(f.query_width()), std::to_string(c.query_width())}},
        {"kdim", {std::to_string(f.key_width()), std::to_string(c.key_width())}},
        {"vdim", {std::to_string(f.value_width()), std::to_string(c.value_width())}},
        {"qkv_bias", {yes_no(f.qkv_bias), yes_no(c.qkv_bias)}},
        {"out_bias", {yes_no(f.out_bias), yes_no(c.out_bias)}},
    };
    for (const auto& [name, says] : fields) {
      if (says.first != says.second) {
        ga::invalid(a.get("config") + " says " + name + " " + says.first + " but the weights in " +
                    a.get("weights") + " have " + name + " " + says.second);
      }
    }
  };

  ga::EngineOptions opts;
  opts.threads = threads;
  opts.isa = isa_option(a);
  // EngineOptions::isa picks gpt2attn's kernels; oneDNN's cap is process-wide and fixed at its first dispatch, and
  // this process is the CLI's: --isa caps oneDNN's GEMMs too, before any layer exists.
  ga::detail::cap_onednn(opts.isa);
  opts.compute = compute;
  std::vector<float> out;
  auto output_size = [&](const ga::Config& c) {
    if (in.query.rank != 3) ga::invalid("query: expected shape (B, T, d_in), got " + in.query.shape_str());
    out.resize(static_cast<size_t>(checked_mul(checked_mul(in.query.shape[0], in.query.shape[1], "output size B*T"),
                                               c.d_model, "output size B*T*E")));
  };
  if (g_world.parallel()) {
#ifdef GPT2ATTN_HAVE_MPI
    // Every rank reads the inputs and agrees they are good before the layer's first collective; each maps the
    // weights file and reads only its heads' slices.
    ga::run_agreed(MPI_COMM_WORLD, "forward", [&] {
      if (g_world.prints()) check_output_path();
      read_config();
      configure();
      read_inputs();
      set_context();
      output_size(ga::Config{.d_model = 1});
    });
    ga::ShardedAttention mha(cfg, a.required("weights"), a.get("prefix"), MPI_COMM_WORLD, opts);
    cfg = mha.config();
    ga::run_agreed(MPI_COMM_WORLD, "forward", [&] {  // each rank's config file against the layer, before forward
      check_against_config(cfg);
      output_size(cfg);
    });
    mha.forward(in, out.data());
    if (!g_world.prints()) return 0;
#endif
  } else {
    configure();
    const ga::StoredLayer layer = ga::open_safetensors_layer(a.required("weights"), a.get("prefix"));
    read_inputs();
    try {
      cfg = ga::apply_loaded_shapes(cfg, layer);
    } catch (const ga::Error& e) {
      throw ga::Error(e.code(), a.required("weights") + ": " + e.what());  // which file the sizes came from
    }
    check_against_config(cfg);
    set_context();
    cfg.validate();
    ga::MultiHeadAttention mha(cfg, layer.weights, opts);
    output_size(cfg);
    mha.forward(in, out.data());
  }
  const int64_t B = in.query.shape[0], T = in.query.shape[1];
  naming_output([&] {
    if (unbatched) {
      ga::npy::write_f32(out_path, out.data(), {T, cfg.d_model});
    } else {
      ga::npy::write_f32(out_path, out.data(), {B, T, cfg.d_model});
    }
  });
  return 0;
}

int cmd_presets() {
  std::printf("%-13s %8s %6s %5s %8s\n", "preset", "d_model", "heads", "D", "context");
  for (const auto& name : ga::preset_names()) {
    const ga::Config c = ga::preset(name);
    std::printf("%-13s %8ld %6ld %5ld %8ld\n", name.c_str(), static_cast<long>(c.d_model),
                static_cast<long>(c.num_heads), static_cast<long>(c.head_dim()), static_cast<long>(c.context_length));
  }
  return 0;
}

struct BenchResult {
  std::string preset;
  ga::DType compute;
  int64_t B, T;
  int threads;
  double median_ms, gflops;
  std::string isa, impl;
  bool checked = false;
  double max_abs_err = 0, mean_abs_err = 0, allowed = 0;
  // decode only
  double tokens_per_s = 0, bytes_per_step = 0, gb_per_s = 0;
  // tensor parallel (mpirun): ranks, and the median time of a call's all-reduce on rank 0 (which includes waiting
  // for the slowest rank)
  int ranks = 1;
  double allreduce_ms = 0;
  // decode --interleave only: the median over the timed steps of the first case's step time over this case's
  double x_first = 0;
};

// The process's peak resident memory so far, in MB (getrusage): for a bench of one case, that case's, inputs, weights,
// KV pool and activations included; over several cases, the largest so far.
double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

double causal_layer_flops(const ga::Config& c, int64_t B, int64_t T) {
  const double E = static_cast<double>(c.d_model), d_in = static_cast<double>(c.query_width());
  const double KW = static_cast<double>(c.kv_width());
  const double b = static_cast<double>(B), t = static_cast<double>(T);
  return 2 * b * t * d_in * (E + 2 * KW) + 2 * b * t * E * E + 4 * E * b * t * (t + 1) / 2;
}

double decode_step_flops(const ga::Config& c, int64_t B, int64_t T) {
  const double E = static_cast<double>(c.d_model), d_in = static_cast<double>(c.query_width());
  const double KW = static_cast<double>(c.kv_width());
  const double b = static_cast<double>(B), t = static_cast<double>(T);
  return 2 * b * d_in * (E + 2 * KW) + 2 * b * E * E + 4 * E * b * (t + 1);
}

// What one decode step has to read from memory: every weight once (QKV and output projections; biases
// ignored) and the cached K and V of every sequence. T is the nominal cached length; the cache grows by one
// token per step, which the figure ignores (it understates the traffic by (warm-up + repeats) / T at most).
double decode_step_bytes(const ga::Config& c, int64_t B, int64_t T, ga::DType compute, ga::DType kv_dtype) {
  const double E = static_cast<double>(c.d_model), d_in = static_cast<double>(c.query_width());
  const double KW = static_cast<double>(c.kv_width());
  const double weights = ((E + 2 * KW) * d_in + E * E) * static_cast<double>(ga::size_of(compute));
  // Per token: K and V rows of every K/V head, plus int8's two f32 scales per K/V head.
  const double scales = kv_dtype == ga::DType::i8 ? 2.0 * static_cast<double>(c.kv_heads()) * sizeof(float) : 0.0;
  const double kv = static_cast<double>(B) * static_cast<double>(T) * (2.0 * KW * ga::size_of(kv_dtype) + scales);
  return weights + kv;
}

constexpr int kDecodeWarmup = 2;  // untimed decode steps: the first touches the new blocks and the decode primitives

// A bench case's buffers in elements, and the bytes it allocates for certain whatever the library's workspace
// adds, from one function so that the sizes checked are the sizes allocated. Every product is checked: a
// --batch and --seq whose product wraps int64 is refused, never allocated small and then overrun.
//   prefill: x (B, T, d_in), y (B, T, E); bytes add the layer's projected Q, K, V and attention output
//            (4 x (B, T, E), an upper bound with grouped K/V heads) and the weights (3E x d_in + E x E + 4E, ditto).
//   decode:  x (B, d_in), y (B, E) per step; the prompt (T, d_in) and its output (T, E); the KV cache of
//            kv_tokens = B x ceil((T + steps) / block) x block tokens (K and V, KW floats each); the weights.
struct BenchSizes {
  int64_t x = 0, y = 0, prompt_x = 0, prompt_y = 0, kv_tokens = 0, bytes = 0;
};

BenchSizes bench_sizes(const std::string& name, const ga::Config& cfg, int64_t B, int64_t T, bool decode,
                       int repeats) {
  const std::string what = name + " at --batch " + std::to_string(B) + " --seq " + std::to_string(T);
  const int64_t E = cfg.d_model, d_in = cfg.query_width();
  auto mul = [&](int64_t a, int64_t b, const char* q) { return checked_mul(a, b, what + ": " + q); };
  auto add = [&](int64_t a, int64_t b, const char* q) { return checked_add(a, b, what + ": " + q); };
  BenchSizes s;
  int64_t floats = add(mul(mul(3, E, "weights"), d_in, "weights"), mul(E, E + 4, "weights"), "weights");
  if (!decode) {
    const int64_t BT = mul(B, T, "B*T");
    s.x = mul(BT, d_in, "input B*T*d_in");
    s.y = mul(BT, E, "output B*T*E");
    floats = add(add(floats, s.x, "activations"), mul(s.y, 5, "activations"), "activations");
  } else {
    const int64_t bt = ga::KvCache::default_block_tokens(cfg);
    const int64_t tokens = add(T, kDecodeWarmup + repeats, "cached tokens T + steps");
    s.kv_tokens = mul(B, mul(tokens / bt + (tokens % bt != 0), bt, "cached tokens"), "KV cache tokens");
    s.x = mul(B, d_in, "step input B*d_in");
    s.y = mul(B, E, "step output B*E");
    s.prompt_x = mul(T, d_in, "prompt T*d_in");
    s.prompt_y = mul(T, E, "prompt output T*E");
    floats = add(floats, mul(mul(2, s.kv_tokens, "KV cache"), cfg.kv_width(), "KV cache"), "KV cache");
    floats = add(add(floats, s.prompt_x, "activations"), s.prompt_y, "activations");
  }
  s.bytes = mul(floats, sizeof(float), "bytes");
  return s;
}

// The median of the timed runs. Callers time at least one (--repeats >= 1); an empty list is still refused
// rather than read past its end.
double median(std::vector<double> ms) {
  if (ms.empty()) ga::fail(ga::ErrorCode::internal, "bench: no timed runs to take the median of");
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::vector<float> random_normal(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& f : v) f = nd(rng);
  return v;
}

// The check both modes share: `got` against the reference rows `ref`, with the library's one tolerance for
// chained reductions of `reduction_length`, scaled by the largest reference value compared.
void check_rows(BenchResult& r, const float* got, const std::vector<double>& ref, int64_t reduction_length,
                ga::DType kv = ga::DType::f32, int64_t head_dim = 1) {
  double max_ref = 0;
  for (double e : ref) max_ref = std::max(max_ref, std::fabs(e));
  const ga::Tolerance tol = ga::layer_tolerance(r.compute, kv, head_dim, reduction_length, max_ref);
  r.checked = true;
  r.allowed = tol.atol;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    r.max_abs_err = std::isnan(err) ? INFINITY : std::max(r.max_abs_err, err);
    r.mean_abs_err += err / static_cast<double>(ref.size());
    if (!tol.accepts(got[i], ref[i])) r.allowed = -1;  // marks failure
  }
}

// The bench's layers run at the flags' compute type, thread count and instruction set.
ga::EngineOptions engine_options(ga::DType compute, int threads, ga::Isa isa) {
  ga::EngineOptions o;
  o.threads = threads, o.isa = isa, o.compute = compute;
  return o;
}

// A case's inputs and timings, whatever runs it: one process (CausalSelfAttention) or tensor parallel over MPI
// (ShardedAttention, whose calls take the same arguments). `sync` runs before each timed call (a barrier across
// ranks, or nothing); `allreduce_ms` reads the last call's all-reduce time (tensor parallel only).
struct Timings {
  std::vector<double> ms, allreduce_ms;
};

// B sequences of T tokens through forward(): a warm-up, then `repeats` timed calls. x (B, T, d_in), y (B, T, E).
template <class Forward, class Sync, class Allreduce>
Timings time_prefill(int repeats, Forward&& forward, Sync&& sync, Allreduce&& allreduce_ms) {
  forward();  // warm-up: the workspace, the GEMM primitives, the caches
  Timings t;
  for (int r = 0; r < repeats; ++r) {
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    forward();
    t.ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    t.allreduce_ms.push_back(allreduce_ms());
  }
  return t;
}

// Causal rows t < Tc depend only on tokens < Tc, so the reference on batch 0's first Tc tokens checks those rows
// exactly at a cost the naive loops can afford (~2 GFLOP in double).
void check_prefill(BenchResult& r, const ga::Config& cfg, const ga::Weights& w, const std::vector<float>& x,
                   const std::vector<float>& y, int64_t T) {
  const double E = static_cast<double>(cfg.d_model);
  const int64_t tc = std::min(T, std::clamp<int64_t>(static_cast<int64_t>(2e9 / (8 * E * E)), 4, 64));
  ga::AttentionInputs in;
  in.query = ga::TensorView::f32(x.data(), {1, tc, cfg.query_width()});
  check_rows(r, y.data(), ga::reference_forward(cfg, w, in), std::max(cfg.query_width(), T));
}

BenchResult bench_prefill(const std::string& name, ga::Config cfg, int64_t B, int64_t T, ga::DType compute,
                          int threads, ga::Isa isa, int repeats, bool check) {
  const BenchSizes sizes = bench_sizes(name, cfg, B, T, false, repeats);
  cfg.context_length = std::max(cfg.context_length, T);
  ga::Weights w = ga::Weights::random(cfg, 1234);
  ga::CausalSelfAttention layer(cfg, w, engine_options(compute, threads, isa));
  if (!check) w = {};  // the layer holds its own copies; without --check the process holds no more than a server
  std::vector<float> y(static_cast<size_t>(sizes.y));
  std::mt19937 rng(42);
  const std::vector<float> x = random_normal(static_cast<size_t>(sizes.x), rng);
  layer.layer().reserve(B, T, T);  // the workspace and every thread's GEMM primitives
  const Timings t = time_prefill(repeats, [&] { layer.forward(x.data(), B, T, y.data()); }, [] {}, [] { return 0.0; });
  BenchResult r{name, compute, B, T, layer.layer().default_threads(), median(t.ms), 0,
                ga::to_string(layer.layer().isa()), layer.layer().implementation()};
  r.gflops = causal_layer_flops(cfg, B, T) / (r.median_ms * 1e6);
  if (check) check_prefill(r, cfg, w, x, y, T);
  return r;
}

// Evicts the CPU caches by reading a buffer far larger than any last-level cache. Reading only: the caches are
// left full of clean lines, as after the other layers of a model, which mostly read weights and K/V. A flush that
// writes leaves them full of dirty lines instead, whose write-back then shares the memory bus with the timed step
// (measured: it cost a gpt2-small B=16 int8-cache decode step a quarter of its time). The buffer is written once,
// at its first use, so that its pages are real pages rather than the shared zero page.
// The read runs on the step's `threads`, each a share of the buffer: so every core's private L2 is evicted, not only
// the calling thread's, and the step finds the OpenMP team as a server's back-to-back layer calls leave it, awake.
// Read by one thread, the flush left the other cores' L2 warm and their threads asleep long enough to fall back to
// the kernel: every cold step then began with a futex wake-up, which cost 150-270 us on this 2-vCPU VM (measured by
// timing each thread's entry into the step's parallel region; a server that idles between steps pays it too, and
// OMP_WAIT_POLICY / GOMP_SPINCOUNT are its levers, README "Sharing cores").
// Its size: 256 MiB, or twice the last-level cache the CPU reports where that is more (a 2-vCPU VM on a 5th-generation
// Xeon reports its host's 300 MiB L3).
size_t flush_bytes() {
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return std::max(size_t{256} << 20, llc > 0 ? 2 * static_cast<size_t>(llc) : 0);
}

void flush_caches(int threads) {
  static const std::vector<uint64_t> buffer = [] {
    std::vector<uint64_t> b(flush_bytes() / sizeof(uint64_t));
    for (size_t i = 0; i < b.size(); ++i) b[i] = i;
    return b;
  }();
  const int64_t lines = static_cast<int64_t>(buffer.size() / 8);
  ga::detail::team_run(threads, [&](int t, int team) {
    const auto [begin, end] = ga::detail::static_share(lines, team, t);
    uint64_t sum = 0;
    for (int64_t i = begin; i < end; ++i) sum += buffer[static_cast<size_t>(i) * 8];
    asm volatile("" : : "r"(sum));  // keep the reads
  });
}

// B sequences of T cached tokens in a paged cache (prefilled one by one with extend()), then warm-up and `repeats`
// timed decode steps, each appending one token to every sequence (after a cache flush with `cold`). The cache and the
// context length are sized so that the last step still fits. With --check, sequence 0's history and first timed
// output are kept.
struct DecodeRun {
  Timings t;
  std::vector<float> history, first_out;  // sequence 0's inputs (T + kDecodeWarmup + 1, d_in) and its output (E)
};
// One case's decode steps, taken one at a time by the caller: time_decode takes them back to back, --interleave
// takes a step of each case in turn. The constructor prefills the B sequences.
template <class Layer, class Cache>
class DecodeSteps {
 public:
  DecodeSteps(Layer& layer, Cache& cache, const BenchSizes& sizes, int64_t B, int64_t T, int64_t d_in, int64_t E,
              bool check)
      : layer_(layer), cache_(cache), B_(B), d_in_(d_in), E_(E), check_(check), seqs_(static_cast<size_t>(B)),
        x_(static_cast<size_t>(sizes.x)), y_(static_cast<size_t>(sizes.y)) {
    std::vector<float> prompt_out(static_cast<size_t>(sizes.prompt_y));
    for (int64_t b = 0; b < B; ++b) {
      const std::vector<float> prompt = random_normal(static_cast<size_t>(sizes.prompt_x), rng_);
      seqs_[b] = cache.create();
      layer.extend(cache, seqs_[b], prompt.data(), T, prompt_out.data());
      if (b == 0 && check) run_.history = prompt;
    }
  }
  // The next step: the first kDecodeWarmup are not timed.
  template <class Sync, class Allreduce>
  void step(int threads, bool cold, Sync&& sync, Allreduce&& allreduce_ms) {
    const int64_t s = taken_++;
    x_ = random_normal(x_.size(), rng_);  // a new token per sequence, drawn outside the timed region
    if (check_ && s <= kDecodeWarmup) run_.history.insert(run_.history.end(), x_.begin(), x_.begin() + d_in_);
    if (cold) flush_caches(threads);
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    layer_.decode(cache_, seqs_.data(), B_, x_.data(), y_.data());
    const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s < kDecodeWarmup) return;
    run_.t.ms.push_back(t);
    run_.t.allreduce_ms.push_back(allreduce_ms());
    if (s == kDecodeWarmup) run_.first_out.assign(y_.begin(), y_.begin() + E_);
  }
  const DecodeRun& run() const { return run_; }

 private:
  Layer& layer_;
  Cache& cache_;
  int64_t B_, d_in_, E_;
  bool check_;
  std::mt19937 rng_{42};  // the prompts, then each step's tokens
  std::vector<ga::SequenceId> seqs_;
  std::vector<float> x_, y_;
  DecodeRun run_;
  int64_t taken_ = 0;
};

template <class Layer, class Cache, class Sync, class Allreduce>
DecodeRun time_decode(Layer& layer, Cache& cache, const BenchSizes& sizes, int64_t B, int64_t T, int64_t d_in,
                      int64_t E, int threads, int repeats, bool check, bool cold, Sync&& sync,
                      Allreduce&& allreduce_ms) {
  DecodeSteps<Layer, Cache> steps(layer, cache, sizes, B, T, d_in, E, check);
  for (int64_t s = 0; s < kDecodeWarmup + repeats; ++s) steps.step(threads, cold, sync, allreduce_ms);
  return steps.run();
}

// The decode figures of a timed run, and with --check sequence 0's first timed output against the last row of the
// reference run causally over its whole token history: exactly what decode computed for it.
void finish_decode(BenchResult& r, const ga::Config& cfg, const DecodeRun& run, int64_t B, int64_t T, bool check,
                   ga::DType compute, ga::DType kv_dtype, const std::function<ga::Weights()>& weights) {
  r.gflops = decode_step_flops(cfg, B, T) / (r.median_ms * 1e6);
  r.tokens_per_s = static_cast<double>(B) / (r.median_ms * 1e-3);
  r.bytes_per_step = decode_step_bytes(cfg, B, T, compute, kv_dtype);
  r.gb_per_s = r.bytes_per_step / (r.median_ms * 1e6);
  if (!check) return;
  const int64_t d_in = cfg.query_width(), E = cfg.d_model, n = static_cast<int64_t>(run.history.size()) / d_in;
  ga::AttentionInputs in;
  in.query = ga::TensorView::f32(run.history.data(), {1, n, d_in});
  const std::vector<double> ref = ga::reference_forward(cfg, weights(), in);
  check_rows(r, run.first_out.data(), std::vector<double>(ref.end() - E, ref.end()), std::max(d_in, n), kv_dtype,
             cfg.head_dim());
}

// A single-process decode case, set up to be stepped: its layer (random weights), its cache, its B prefilled
// sequences of T tokens.
class DecodeCase {
 public:
  DecodeCase(const std::string& name, ga::Config cfg, int64_t B, int64_t T, ga::DType compute, int threads,
             ga::Isa isa, int repeats, bool check, ga::DType kv_dtype)
      : name_(name), B_(B), T_(T), compute_(compute), kv_dtype_(kv_dtype), check_(check) {
    const BenchSizes sizes = bench_sizes(name, cfg, B, T, true, repeats);
    cfg.context_length = std::max(cfg.context_length, T + kDecodeWarmup + repeats + 1);
    cfg_ = cfg;
    w_ = ga::Weights::random(cfg, 1234);
    layer_ = std::make_unique<ga::CausalSelfAttention>(cfg, w_, engine_options(compute, threads, isa));
    if (!check) w_ = {};  // the layer holds its own copies; without --check the process holds no more than a server
    // Blocks are per sequence, so each needs ceil((T + steps) / block_tokens) of them.
    ga::KvCacheOptions kv_opts;
    kv_opts.capacity_tokens = sizes.kv_tokens;
    kv_opts.dtype = kv_dtype;
    cache_ = std::make_unique<ga::KvCache>(cfg, kv_opts);
    layer_->reserve_serving(T, B);
    steps_ = std::make_unique<DecodeSteps<ga::CausalSelfAttention, ga::KvCache>>(
        *layer_, *cache_, sizes, B, T, cfg.query_width(), cfg.d_model, check);
  }
  void step(bool cold) { steps_->step(layer_->layer().default_threads(), cold, [] {}, [] { return 0.0; }); }
  const std::vector<double>& step_ms() const { return steps_->run().t.ms; }
  BenchResult result() const {
    BenchResult r{name_, compute_, B_, T_, layer_->layer().default_threads(), median(step_ms()), 0,
                  ga::to_string(layer_->layer().isa()), layer_->layer().implementation()};
    finish_decode(r, cfg_, steps_->run(), B_, T_, check_, compute_, kv_dtype_, [&] { return w_; });
    return r;
  }

 private:
  std::string name_;
  ga::Config cfg_;
  int64_t B_, T_;
  ga::DType compute_, kv_dtype_;
  bool check_;
  ga::Weights w_;
  std::unique_ptr<ga::CausalSelfAttention> layer_;
  std::unique_ptr<ga::KvCache> cache_;
  std::unique_ptr<DecodeSteps<ga::CausalSelfAttention, ga::KvCache>> steps_;
};

BenchResult bench_decode(const std::string& name, const ga::Config& cfg, int64_t B, int64_t T, ga::DType compute,
                         int threads, ga::Isa isa, int repeats, bool check, bool cold, ga::DType kv_dtype) {
  DecodeCase c(name, cfg, B, T, compute, threads, isa, repeats, check, kv_dtype);
  for (int64_t s = 0; s < kDecodeWarmup + repeats; ++s) c.step(cold);
  return c.result();
}

// --interleave: every case is set up first, then the cases take their steps in turn (step s of each, then step
// s + 1 of each), so that all of them meet the same minutes of a shared machine, whose speed drifts by more than
// most differences between them. Each result also carries x_first, the median over the timed steps of the first
// case's step time over this case's, the two steps of each pair taken milliseconds apart.
struct DecodeSpec {
  std::string name;
  ga::Config cfg;
  int64_t T;
  ga::DType compute, kv_dtype;
};
std::vector<BenchResult> bench_decode_interleaved(const std::vector<DecodeSpec>& specs, int64_t B, int threads,
                                                  ga::Isa isa, int repeats, bool check, bool cold) {
  std::vector<std::unique_ptr<DecodeCase>> cases;
  for (const DecodeSpec& c : specs) {
    cases.push_back(
        std::make_unique<DecodeCase>(c.name, c.cfg, B, c.T, c.compute, threads, isa, repeats, check, c.kv_dtype));
  }
  for (int64_t s = 0; s < kDecodeWarmup + repeats; ++s) {
    for (const auto& c : cases) c->step(cold);
  }
  std::vector<BenchResult> out;
  const std::vector<double>& first = cases.front()->step_ms();
  for (const auto& c : cases) {
    BenchResult r = c->result();
    std::vector<double> ratios;
    for (size_t i = 0; i < first.size(); ++i) ratios.push_back(first[i] / c->step_ms()[i]);
    r.x_first = median(ratios);
    out.push_back(r);
  }
  return out;
}

#ifdef GPT2ATTN_HAVE_MPI
// The bench cases tensor parallel over MPI_COMM_WORLD (under mpirun): every rank generates and holds only its heads'
// weights (ShardedAttention::random, the same values as Weights::random) and its heads' KV cache, and draws the same
// inputs. Each call is timed on every rank after a barrier; rank 0's median is reported: a call ends with the
// all-reduce, which waits for the slowest rank. --check compares on rank 0 against the reference over the whole
// layer's weights, which it then generates.
// The threads a sharded layer's calls run on, given --threads (0: the OpenMP default, within the library's limit).
int sharded_team(int threads) { return threads > 0 ? threads : std::min(omp_get_max_threads(), ga::max_threads()); }

BenchResult sharded_result(const std::string& name, ga::DType compute, int64_t B, int64_t T, int threads,
                           const ga::ShardedAttention& layer, const Timings& t) {
  BenchResult r{name, compute, B, T, sharded_team(threads), median(t.ms), 0, ga::to_string(layer.isa()),
                layer.implementation()};
  r.ranks = layer.ranks();
  r.allreduce_ms = median(t.allreduce_ms);
  return r;
}

BenchResult bench_prefill_sharded(const std::string& name, ga::Config cfg, int64_t B, int64_t T, ga::DType compute,
                                  int threads, ga::Isa isa, int repeats, bool check) {
  const BenchSizes sizes = bench_sizes(name, cfg, B, T, false, repeats);
  cfg.context_length = std::max(cfg.context_length, T);
  ga::ShardedAttention layer =
      ga::ShardedAttention::random(cfg, 1234, MPI_COMM_WORLD, engine_options(compute, threads, isa));
  std::vector<float> y(static_cast<size_t>(sizes.y));
  std::mt19937 rng(42);
  const std::vector<float> x = random_normal(static_cast<size_t>(sizes.x), rng);
  ga::AttentionInputs in;
  in.query = ga::TensorView::f32(x.data(), {B, T, cfg.query_width()});
  const Timings t = time_prefill(
      repeats, [&] { layer.forward(in, y.data()); }, [] { MPI_Barrier(MPI_COMM_WORLD); },
      [&] { return layer.last_call_times().allreduce_s * 1e3; });
  BenchResult r = sharded_result(name, compute, B, T, threads, layer, t);
  r.gflops = causal_layer_flops(cfg, B, T) / (r.median_ms * 1e6);
  if (check && g_world.prints()) check_prefill(r, cfg, ga::Weights::random(cfg, 1234), x, y, T);
  return r;
}

BenchResult bench_decode_sharded(const std::string& name, ga::Config cfg, int64_t B, int64_t T, ga::DType compute,
                                 int threads, ga::Isa isa, int repeats, bool check, bool cold, ga::DType kv_dtype) {
  const BenchSizes sizes = bench_sizes(name, cfg, B, T, true, repeats);
  cfg.context_length = std::max(cfg.context_length, T + kDecodeWarmup + repeats + 1);
  ga::ShardedAttention layer =
      ga::ShardedAttention::random(cfg, 1234, MPI_COMM_WORLD, engine_options(compute, threads, isa));
  ga::KvCacheOptions kv_opts;
  kv_opts.capacity_tokens = sizes.kv_tokens;
  kv_opts.dtype = kv_dtype;
  ga::ShardedKvCache cache(layer, kv_opts);
  const DecodeRun run = time_decode(
      layer, cache, sizes, B, T, cfg.query_width(), cfg.d_model, sharded_team(threads), repeats, check, cold,
      [] { MPI_Barrier(MPI_COMM_WORLD); }, [&] { return layer.last_call_times().allreduce_s * 1e3; });
  BenchResult r = sharded_result(name, compute, B, T, threads, layer, run.t);
  finish_decode(r, cfg, run, B, T, check && g_world.prints(), compute, kv_dtype,
                [&] { return ga::Weights::random(cfg, 1234); });
  return r;
}
#endif

int cmd_bench(int argc, char** argv) {
  const Args a = parse(argc, argv, 2,
                       {"preset", "batch", "seq", "mode", "dtype", "kv-heads", "kv-dtype", "threads", "isa", "repeats",
                        "cache"},
                       {"check", "no-check", "json", "interleave"});
  const std::vector<ga::DType> computes = compute_dtypes(a, true);
  const std::string mode = a.get("mode", "prefill");
  if (mode != "prefill" && mode != "decode") {
    throw UsageError("--mode " + mode + " is not supported (supported: prefill, decode)");
  }
  const bool decode = mode == "decode";
  const std::string cache = a.get("cache", "warm");
  if (cache != "warm" && cache != "cold") throw UsageError("--cache must be warm or cold, got " + cache);
  if (a.has("cache") && !decode) throw UsageError("--cache applies to --mode decode only");
  if (a.has("kv-dtype") && !decode) throw UsageError("--kv-dtype applies to --mode decode only");
  const bool interleave = a.flag("interleave");
  if (interleave && (!decode || cache != "cold")) {
    throw UsageError("--interleave applies to --mode decode --cache cold only (warm cases would evict each other)");
  }
  if (interleave && g_world.parallel()) throw UsageError("--interleave is not supported under mpirun");
  // --kv-dtype, like --dtype, may repeat: every case runs with each cache, so one run compares them.
  std::vector<std::string> kv_names = a.distinct<std::string>("kv-dtype", [](const std::string& n) {
    if (n != "f32" && n != "bf16" && n != "int8") {
      throw UsageError("--kv-dtype " + n + " is not supported (supported: f32, bf16, int8)");
    }
    return n;
  });
  if (kv_names.empty()) kv_names = {"f32"};
  auto kv_dtype_of = [](const std::string& n) { return n == "int8" ? ga::DType::i8 : ga::dtype_from_string(n); };
  const auto B = a.integer<int64_t>("batch", 1, 1), T = a.integer<int64_t>("seq", 1024, 1);
  const int threads = a.integer<int>("threads", 0, 1, kMaxThreads);
  const int repeats = a.integer<int>("repeats", 5, 1);
  const bool json = a.flag("json");
  if (a.flag("check") && a.flag("no-check")) throw UsageError("--check and --no-check contradict each other");
  const bool check = a.flag("check") || (!json && !a.flag("no-check"));
  const ga::Isa isa = isa_option(a);
  ga::detail::cap_onednn(isa);  // as forward does: the whole layer at --isa, GEMMs included
  // --kv-heads may repeat too (0: as many as the preset's heads).
  std::vector<int64_t> kv_heads_list = a.integers<int64_t>("kv-heads", 1);
  if (kv_heads_list.empty()) kv_heads_list = {0};
  // A preset with a --kv-heads value applied; a count that does not divide its heads is refused naming the flag.
  auto config_for = [&](const std::string& name, int64_t kv_heads) {
    ga::Config c = ga::preset(name);
    if (kv_heads > 0 && c.num_heads % kv_heads != 0) {
      throw UsageError("--kv-heads " + std::to_string(kv_heads) + " does not divide " + name + "'s " +
                       std::to_string(c.num_heads) + " heads");
    }
    c.num_kv_heads = kv_heads;
    return c;
  };
  std::vector<std::string> presets;
  const bool explicit_presets = a.has("preset");
  if (explicit_presets) {
    presets = a.distinct<std::string>("preset", [](const std::string& p) { return p; });
    // Unknown names and bad --kv-heads fail before any timing.
    for (const auto& p : presets) {
      for (const int64_t h : kv_heads_list) (void)config_for(p, h);
    }
  } else {
    presets = {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-175b"};
  }
  // gpt3-175b's weights are 2.4 GB and its layer ~100x gpt2-small's: by default it runs at a small T.
  auto seq_for = [&](const std::string& name) {
    return (!explicit_presets && name == "gpt3-175b") ? std::min<int64_t>(T, 128) : T;
  };
  // Every case is sized before any runs: one this machine cannot hold is refused up front, naming the bytes,
  // rather than failing (or swapping) partway through the table.
  // --interleave holds every case at once: their sum is checked too.
  const int64_t physical = ga::detail::physical_memory_bytes();
  int64_t all_cases = 0;
  for (const auto& name : presets) {
    for (const int64_t h : kv_heads_list) {
      const int64_t need = bench_sizes(name, config_for(name, h), B, seq_for(name), decode, repeats).bytes;
      if (need > physical) {
        ga::invalid(name + " at --batch " + std::to_string(B) + " --seq " + std::to_string(seq_for(name)) +
                    ": needs at least " + std::to_string(need) + " bytes for weights, activations" +
                    (decode ? " and KV cache" : "") + ", more than the " + std::to_string(physical) +
                    " bytes of physical memory");
      }
      all_cases = checked_add(all_cases, checked_mul(need, static_cast<int64_t>(computes.size() * kv_names.size()),
                                                     "--interleave: bytes"), "--interleave: bytes");
    }
  }
  if (interleave && all_cases > physical) {
    ga::invalid("--interleave: the cases together need at least " + std::to_string(all_cases) +
                " bytes, more than the " + std::to_string(physical) + " bytes of physical memory");
  }

  if (!json && g_world.prints()) {
    std::printf("%-12s %-8s %-5s %3s %3s %6s %7s %10s %9s ", "preset", "mode", "dtype", "kvh", "B", "T", "threads",
                "median_ms", "GFLOP/s");
    if (decode) std::printf("%-4s %10s %9s %7s ", "kv", "tokens/s", "MB/step", "GB/s");
    if (interleave) std::printf("%7s ", "x_first");
    std::printf("%-11s %s\n", "ISA", check ? "max_err (allowed)" : "");
  }
  bool all_ok = true;
  // Progress on stderr, never on stdout: a line per finished case, or one line rewritten in place when stderr is
  // a terminal; only for a sweep of several cases whose rows are not already appearing on that terminal.
  struct Case {
    ga::DType compute;
    std::string kv_name, preset;
    ga::Config cfg;  // the preset with this case's --kv-heads
    int64_t T;
  };
  // Every preset with each --kv-heads, in each --kv-dtype, in each --dtype, in the order given.
  std::vector<Case> cases;
  for (const ga::DType compute : computes) {
    for (const std::string& kv : kv_names) {
      for (const int64_t h : kv_heads_list) {
        for (const auto& name : presets) cases.push_back({compute, kv, name, config_for(name, h), seq_for(name)});
      }
    }
  }
  const size_t n_cases = cases.size();
  const bool progress = n_cases > 1 && (json || isatty(STDOUT_FILENO) == 0);
  const bool bar = progress && isatty(STDERR_FILENO) != 0;
  size_t done = 0;
  auto run_case = [&](const Case& c) {
    const ga::Config& cfg = c.cfg;
    const int64_t t = c.T;
    BenchResult r;
    if (g_world.parallel()) {
#ifdef GPT2ATTN_HAVE_MPI
      r = decode ? bench_decode_sharded(c.preset, cfg, B, t, c.compute, threads, isa, repeats, check,
                                        cache == "cold", kv_dtype_of(c.kv_name))
                 : bench_prefill_sharded(c.preset, cfg, B, t, c.compute, threads, isa, repeats, check);
#endif
    } else {
      r = decode ? bench_decode(c.preset, cfg, B, t, c.compute, threads, isa, repeats, check, cache == "cold",
                                kv_dtype_of(c.kv_name))
                 : bench_prefill(c.preset, cfg, B, t, c.compute, threads, isa, repeats, check);
    }
    return r;
  };
  auto report = [&](const Case& c, const BenchResult& r) {
    if (!g_world.prints()) return;
    const ga::Config& cfg = c.cfg;
    const std::string& kv_name = c.kv_name;
    const char* dtype = ga::to_string(c.compute);
    const bool ok = !r.checked || r.allowed >= 0;
    all_ok = all_ok && ok;
    if (json) {
      nlohmann::json j = {{"preset", r.preset}, {"mode", mode}, {"dtype", dtype}, {"kv_heads", cfg.kv_heads()},
                          {"batch", r.B}, {"seq", r.T},
                          {"threads", r.threads}, {"median_ms", r.median_ms}, {"gflops", r.gflops},
                          {"isa", r.isa}, {"implementation", r.impl}, {"peak_rss_mb", peak_rss_mb()}};
      if (g_world.parallel()) {
        j["ranks"] = r.ranks;
        j["allreduce_ms"] = r.allreduce_ms;
      }
      if (decode) {
        j["cache"] = cache;
        j["kv_dtype"] = kv_name;
        j["tokens_per_s"] = r.tokens_per_s;
        j["bytes_per_step"] = r.bytes_per_step;
        j["gb_per_s"] = r.gb_per_s;
        if (interleave) j["x_first"] = r.x_first;
      }
      if (r.checked) {
        j["max_abs_err"] = r.max_abs_err;
        j["mean_abs_err"] = r.mean_abs_err;
        j["check"] = ok ? "ok" : "FAIL";
      }
      std::printf("%s\n", j.dump().c_str());
    } else {
      char err[64] = "";
      if (r.checked) std::snprintf(err, sizeof err, "%.2e %s", r.max_abs_err, ok ? "ok" : "FAIL");
      std::printf("%-12s %-8s %-5s %3ld %3ld %6ld %7d %10.3f %9.1f ", r.preset.c_str(), mode.c_str(), dtype,
                  static_cast<long>(cfg.kv_heads()), static_cast<long>(r.B), static_cast<long>(r.T), r.threads,
                  r.median_ms, r.gflops);
      if (decode) {
        std::printf("%-4s %10.0f %9.1f %7.1f ", kv_name.c_str(), r.tokens_per_s, r.bytes_per_step * 1e-6, r.gb_per_s);
        if (interleave) std::printf("%7.2f ", r.x_first);
      }
      std::printf("%-11s %s\n", r.isa.c_str(), err);
    }
    std::fflush(stdout);
    if (progress) {
      std::fprintf(stderr, "%sgpt2attn bench: [%zu/%zu] %s %s B=%ld T=%ld: %.3f ms%s", bar ? "\r\033[K" : "", ++done,
                   n_cases, r.preset.c_str(), mode.c_str(), static_cast<long>(r.B), static_cast<long>(r.T),
                   r.median_ms, bar ? "" : "\n");
      if (bar && done == n_cases) std::fputc('\n', stderr);
      std::fflush(stderr);
    }
  };
  if (interleave) {
    std::vector<DecodeSpec> specs;
    for (const Case& c : cases) {
      specs.push_back({c.preset, c.cfg, c.T, c.compute, kv_dtype_of(c.kv_name)});
    }
    const std::vector<BenchResult> results = bench_decode_interleaved(specs, B, threads, isa, repeats, check, true);
    for (size_t i = 0; i < cases.size(); ++i) report(cases[i], results[i]);
  } else {
    for (const Case& c : cases) report(c, run_case(c));
  }
  if (!json && g_world.prints()) {
    for (const ga::DType compute : computes) {
      const BenchResult r =
          bench_prefill("gpt2-small", ga::preset("gpt2-small"), 1, 1, compute, threads, isa, 1, false);
      std::printf("implementation (%s): %s\n", ga::to_string(compute), r.impl.c_str());
    }
  }
  if (!all_ok) {
    std::fprintf(stderr, "gpt2attn: bench: check against the naive reference FAILED\n");
    return 1;
  }
  return 0;
}

// The command, with its errors turned into the exit status and one line on stderr (printed by rank 0 alone under
// mpirun: every rank of a tensor-parallel call gets the same error).
int run(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  auto say = [](const char* fmt, const char* what) {
    if (g_world.prints()) std::fprintf(stderr, fmt, what);
  };
  try {
    if (cmd == "forward") return cmd_forward(argc, argv);
    if (cmd == "bench") return cmd_bench(argc, argv);
    if (cmd == "presets") return cmd_presets();
    if (cmd == "--help" || cmd == "-h" || cmd == "help") {
      if (g_world.prints()) std::fputs(kUsage, stdout);
      return 0;
    }
    if (cmd == "--version") {
      if (g_world.prints()) std::printf("gpt2attn %s\n", gpt2attn_version());
      return 0;
    }
    throw UsageError(cmd.empty() ? "missing command (forward, bench or presets)" : "unknown command '" + cmd + "'");
  } catch (const HelpRequested&) {
    if (g_world.prints()) std::fputs(kUsage, stdout);
    return 0;
  } catch (const UsageError& e) {
    say("gpt2attn: %s (see gpt2attn --help)\n", e.what());
    return 2;
  } catch (const ga::Error& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    say("gpt2attn: %s\n", msg.c_str());
    return e.code() == ga::ErrorCode::internal ? 1 : 2;
  } catch (const std::bad_alloc&) {
    say("gpt2attn: %s\n", "out of memory");
    return 2;
  } catch (const std::exception& e) {
    say("gpt2attn: internal error: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  // MPI only when mpirun (or another PMI launcher) started this process: a plain run never initialises it.
  const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK");
  if (!launched) return run(argc, argv);
#ifdef GPT2ATTN_HAVE_MPI
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_world.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_world.ranks);
  const int status = run(argc, argv);
  MPI_Finalize();
  return status;
#else
  const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (size && std::atoi(size) > 1) {
    std::fprintf(stderr, "gpt2attn: started by mpirun with %s ranks, but this build has no MPI support\n", size);
    return 2;
  }
  return run(argc, argv);
#endif
}
