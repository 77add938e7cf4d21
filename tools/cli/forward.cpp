// tools/cli/forward.cpp: `gpt2attn forward`, one multi-head attention layer on .npy inputs with the weights of a
// safetensors file: read_request() -> make_layer() -> run -> write. A Runner makes and runs the layer: in this
// process (LocalRunner), or tensor parallel over the ranks of mpirun (ShardedRunner).
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tools/cli/commands.hpp"
#include "tools/npy.hpp"
#ifdef GPT2ATTN_HAVE_MPI
#include "gpt2attn/parallel.hpp"
#endif

namespace gpt2attn::cli {

namespace {

const char* kAbout = R"(forward  runs one multi-head attention layer (torch.nn.MultiheadAttention semantics, batch_first) with the
         weights of a safetensors file (torch or Hugging Face GPT-2 naming) and writes float32 (B, T, E).
         Inputs are float32/float64 .npy; masks bool, uint8 or float (a key padding bool or uint8, nonzero
         = padding); without --key/--value it is self-attention. An unbatched (T, d_in) query, as torch
         takes it, gives a (T, E) output. --config
         reads a Hugging Face GPT-2 config.json (n_embd, n_head, n_positions) or one of configs/*.json:
         the heads, K/V heads, causality (GPT-2's is) and the default context length come from it, a
         --heads or --kv-heads that disagrees is refused, and so are weights whose widths or biases differ
         from what it says. Weights in GPT-2's Conv1D layout (c_attn, c_proj) are a GPT-2 block and run
         causal without --config too; --no-causal drops the mask. A mask without --mask-kind is read as
         torch reads it: bool or
         uint8 blocks where nonzero (block), float is added to the scores (additive); --mask-kind keep
         reads it as scores.masked_fill(mask == 0, -inf) does (nonzero may attend). Mask shapes: (T, Tk),
         (B, T, Tk), (B, H, T,
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
         f32. --weights may be a file `gpt2attn quantize` wrote (told apart by its metadata): the layer
         then holds its int8 or int4 codes as saved and computes bit for bit what --weights-dtype of that
         format computes on the float file; --weights-dtype may only name the file's format, and --prefix
         is refused. Such a file does not record causality: pass --causal or a causal --config for a GPT-2
         block.
)";

// a * b for the output's element count, or an invalid_argument error naming `what` when it overflows int64: sizes
// from a file must never wrap into a small allocation that is then overrun.
int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) {
    invalid(what + " overflows int64 (" + std::to_string(a) + " x " + std::to_string(b) + ")");
  }
  return r;
}

// Runs f, putting "--output " before the path a file error names, so the message says which option it was.
template <class F>
void naming_output(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::bad_file) throw;
    throw Error(e.code(), std::string("--output ") + e.what());
  }
}

TensorView view_of(const npy::Array& arr, const std::string& what) {
  if (arr.shape.size() > 4) invalid(what + ": rank " + std::to_string(arr.shape.size()) + " > 4");
  const bool f32 = arr.kind == npy::Kind::f32;
  return TensorView::contiguous(f32 ? static_cast<const void*>(arr.f32.data()) : arr.u8.data(),
                                f32 ? DType::f32 : DType::u8, arr.shape);
}

npy::Array read_float_input(const std::string& path, const std::string& what) {
  npy::Array a = npy::read(path);
  if (a.kind != npy::Kind::f32) {
    invalid(what + " (" + path + "): expected float32 or float64 data, got dtype " + a.descr);
  }
  return a;
}

// What the command line asks for (read_request, which reads no file), then what the files add: the config file,
// the inputs and, once the layer exists, its shapes. A Runner calls the steps in the order its layer needs them.
struct Request {
  std::string weights, prefix, config_path, output;
  std::optional<int64_t> heads, kv_heads, context_length;  // as given
  std::string query, key, value, mask, mask_kind, key_padding;
  bool causal = false, no_causal = false;  // --causal, --no-causal
  std::string weights_dtype;               // --weights-dtype as given ("" when absent)
  EngineOptions opts;
  double mpi_timeout_s = 0;  // under mpirun: the sharded layer's deadline of one wait in a collective

  std::optional<Config> file_cfg;  // --config's contents
  Config cfg;                      // the layer's
  npy::Array q, k, v, mask_arr, padding;
  AttentionInputs in;
  bool unbatched = false;
  std::vector<float> out;

  // --config (a Hugging Face GPT-2 config.json, or ours) says the heads and the context length; a --heads that
  // disagrees is an error, since another dividing head count would silently compute another layer.
  void read_config() {
    if (!config_path.empty()) file_cfg = load_any_config(config_path);
    cfg.num_heads = heads.value_or(file_cfg ? file_cfg->num_heads : 0);
    if (file_cfg && cfg.num_heads != file_cfg->num_heads) {
      invalid("--heads " + std::to_string(cfg.num_heads) + " disagrees with " + config_path + ", which says " +
              std::to_string(file_cfg->num_heads) + " heads");
    }
    // The file's K/V heads likewise: a config that names none has as many as heads (a Hugging Face GPT-2 config
    // never names them). Without a config file the weights' K/V width decides.
    const int64_t file_kv_heads = file_cfg ? file_cfg->kv_heads() : 0;
    cfg.num_kv_heads = kv_heads.value_or(file_kv_heads);
    if (file_kv_heads != 0 && cfg.num_kv_heads != file_kv_heads) {
      invalid("--kv-heads " + std::to_string(cfg.num_kv_heads) + " disagrees with " + config_path + ", which says " +
              std::to_string(file_kv_heads) + " K/V heads");
    }
    // Causal when the flag or the config file says so (a Hugging Face GPT-2 config always does: GPT-2 is causal);
    // --no-causal against a config that says causal would compute another model's layer.
    if (no_causal && file_cfg && file_cfg->causal) {
      invalid("--no-causal disagrees with " + config_path + ", which says the layer is causal");
    }
    cfg.causal = causal || (file_cfg && file_cfg->causal);
  }

  // Weights in Hugging Face GPT-2's Conv1D layout (c_attn, c_proj) are a GPT-2 block, whose attention is causal:
  // causal unless --no-causal says otherwise, so that a run without --config computes GPT-2's layer, not another.
  void read_layout_causality(const std::string& naming) {
    if (naming == "hf-gpt2" && !no_causal) cfg.causal = true;
  }

  // The write checks again; checking now refuses a device or FIFO before any work is done.
  void check_output_path() const {
    naming_output([&] { npy::check_write_target(output); });
  }

  // The inputs (a tensor-parallel rank reads them itself, so each must see the files).
  void read_inputs() {
    q = read_float_input(query, "query");
    in.query = view_of(q, "query");
    // Unbatched, as torch takes it: a (T, d_in) query (with (Tk, kdim) key and value, (Tk,) key padding) is a batch
    // of one, and the output is written (T, E).
    unbatched = in.query.rank == 2;
    auto batch_of_one = [&](TensorView t, int rank) {
      if (!unbatched || t.rank != rank) return t;
      for (int d = t.rank; d > 0; --d) t.shape[d] = t.shape[d - 1], t.strides[d] = t.strides[d - 1];
      t.shape[0] = 1, t.strides[0] = 0, ++t.rank;
      return t;
    };
    in.query = batch_of_one(in.query, 2);
    if (!key.empty()) {
      k = read_float_input(key, "key");
      v = read_float_input(value, "value");
      in.key = batch_of_one(view_of(k, "key"), 2);
      in.value = batch_of_one(view_of(v, "value"), 2);
    }
    if (!mask.empty()) {
      mask_arr = npy::read(mask);
      in.attn_mask = view_of(mask_arr, "mask");
      // torch's layouts too: size-1 B or H axes broadcast, (B * H, T, Tk) as (B, H, T, Tk)
      if (in.query.rank == 3) in.attn_mask = torch_mask_view(in.attn_mask, in.query.shape[0], cfg.num_heads);
      // Without --mask-kind, torch's reading of its dtype.
      in.mask_kind = !mask_kind.empty() ? mask_kind_from_string(mask_kind) : torch_mask_kind(in.attn_mask.dtype);
    }
    if (!key_padding.empty()) {
      padding = npy::read(key_padding);
      in.key_padding = batch_of_one(view_of(padding, "key-padding"), 1);
      // torch adds a float key_padding_mask to the scores; the library reads nonzero as padding. Refused rather
      // than read another way than torch reads it.
      if (in.key_padding.dtype == DType::f32) {
        invalid("--key-padding " + key_padding + ": a float mask (torch adds it to the scores); pass "
                "a bool or uint8 one, nonzero = padding");
      }
    }
  }

  // The context length: --context-length, the config file's, or enough for the inputs.
  void set_context() {
    const int64_t T = in.query.rank == 3 ? in.query.shape[1] : 0;
    const int64_t Tk = in.key.rank == 3 ? in.key.shape[1] : T;
    cfg.context_length =
        context_length.value_or(file_cfg ? file_cfg->context_length : std::max<int64_t>({1024, T, Tk}));
  }

  // What the config file says of the layer's shape must be what the weights file holds: a config is never
  // silently half-applied. (Its dropout is for training; forward is inference.)
  void check_against_config(const Config& c) const {
    if (file_cfg) check_config_against_weights(*file_cfg, config_path, c, weights);
  }

  // The output buffer, (B, T, E) of the layer `c`.
  void size_output(const Config& c) {
    if (in.query.rank != 3) invalid("query: expected shape (B, T, d_in), got " + in.query.shape_str());
    const int64_t BT = checked_mul(in.query.shape[0], in.query.shape[1], "output size B*T");
    out.resize(static_cast<size_t>(checked_mul(BT, c.d_model, "output size B*T*E")));
  }
};

void refuse_output_over_an_input(const Request& r) {
  refuse_output_over_inputs(r.output, {{"weights", r.weights},
                                       {"config", r.config_path},
                                       {"query", r.query},
                                       {"key", r.key},
                                       {"value", r.value},
                                       {"mask", r.mask},
                                       {"key-padding", r.key_padding}});
}

// The options, checked; no file is read yet.
Request read_request(const Args& a) {
  Request r;
  r.opts.compute = compute_dtypes(a).front();
  r.opts.weights = weight_format_for(weights_dtype_names(a).front(), r.opts.compute);
  r.weights_dtype = a.get("weights-dtype");
  r.output = a.required("output");
  if (!a.has("heads") && !a.has("config")) throw UsageError("missing required option --heads (or --config)");
  r.config_path = a.get("config");
  if (a.has("heads")) r.heads = a.integer<int64_t>("heads", 0, 1);
  if (a.has("kv-heads")) r.kv_heads = a.integer<int64_t>("kv-heads", 0, 1);
  if (a.has("context-length")) r.context_length = a.integer<int64_t>("context-length", 0, 1);
  r.opts.threads = threads_option(a);
  r.mpi_timeout_s = mpi_timeout_option(a);
  if (a.has("key") != a.has("value")) throw UsageError("--key and --value must be given together");
  if (a.has("mask-kind") && !a.has("mask")) throw UsageError("--mask-kind given without --mask");
  r.opts.isa = isa_option(a);
  r.weights = a.required("weights");
  r.prefix = a.get("prefix");
  r.query = a.required("query");
  r.key = a.get("key"), r.value = a.get("value");
  r.mask = a.get("mask"), r.mask_kind = a.get("mask-kind"), r.key_padding = a.get("key-padding");
  r.causal = a.flag("causal");
  r.no_causal = a.flag("no-causal");
  if (r.causal && r.no_causal) throw UsageError("--causal and --no-causal contradict each other");
  refuse_output_over_an_input(r);
  return r;
}

// Where the layer runs. make_layer reads the files and makes the layer (r.cfg then holds its shapes and r.out its
// size); run computes r.out; writes says whether this process writes the output file.
class Runner {
 public:
  virtual ~Runner() = default;
  virtual void make_layer(Request& r) = 0;
  virtual void run(Request& r) = 0;
  virtual bool writes() const { return true; }
};

// This process alone, with the whole layer: from a float checkpoint, or from a file of `gpt2attn quantize`, told apart
// by its "gpt2attn.weights" metadata (so --weights takes either, as the library's loaders do).
class LocalRunner : public Runner {
 public:
  void make_layer(Request& r) override {
    r.read_config();
    r.check_output_path();
    const std::optional<QuantizedLayerShapes> quantized = quantized_layer_shapes(r.weights);
    const LayerShapes* shapes = nullptr;
    if (quantized) {
      check_quantized_options(r, *quantized);
      shapes = &*quantized;
    } else {
      shapes = &stored_.emplace(open_safetensors_layer(r.weights, r.prefix));
      r.read_layout_causality(shapes->naming);
    }
    r.read_inputs();
    try {
      r.cfg = apply_loaded_shapes(r.cfg, *shapes);
    } catch (const Error& e) {
      throw Error(e.code(), r.weights + ": " + e.what());  // which file the sizes came from
    }
    r.check_against_config(r.cfg);
    r.set_context();
    r.cfg.validate();
    if (quantized) {
      layer_.emplace(r.cfg, load_quantized(r.weights, r.cfg), r.opts);
    } else {
      layer_.emplace(r.cfg, stored_->weights, r.opts);
    }
    r.size_output(r.cfg);
  }
  void run(Request& r) override { layer_->forward(r.in, r.out.data()); }

 private:
  // A quantized file holds one layer under fixed names, in one format: a --prefix would name nothing, and a
  // --weights-dtype other than the file's would ask for weights it does not hold (re-quantizing its codes would lose
  // more than quantizing the float weights once).
  static void check_quantized_options(const Request& r, const QuantizedLayerShapes& q) {
    const std::string what = r.weights + " holds " + to_string(q.format) + " weights written by `gpt2attn quantize`";
    if (!r.prefix.empty()) throw UsageError("--prefix " + r.prefix + ": " + what + ", one layer without a prefix");
    if (!r.weights_dtype.empty() && r.weights_dtype != to_string(q.format)) {
      throw UsageError("--weights-dtype " + r.weights_dtype + ": " + what + "; give --weights-dtype " +
                       to_string(q.format) + " or leave it out");
    }
  }

  std::optional<StoredLayer> stored_;  // a float file's tensors, as stored, for as long as the layer
  std::optional<MultiHeadAttention> layer_;
};

#ifdef GPT2ATTN_HAVE_MPI
// Tensor parallel over MPI_COMM_WORLD: every rank reads the config and the inputs itself, and all agree they are
// good before the layer's first collective (so one rank's unreadable file fails them all); each maps the weights
// file and reads only its heads' slices. Rank 0 alone writes.
class ShardedRunner : public Runner {
 public:
  void make_layer(Request& r) override {
    run_agreed(MPI_COMM_WORLD, "forward", [&] {
      if (world().prints()) r.check_output_path();
      r.read_config();
      // ShardedAttention reads its heads' slices of float tensors; codes are not sliced (yet).
      if (quantized_layer_shapes(r.weights)) {
        invalid(r.weights + ": quantized weights (gpt2attn quantize) run in one process; tensor-parallel forward "
                "under mpirun reads a float safetensors file");
      }
      r.read_layout_causality(open_safetensors_layer(r.weights, r.prefix).naming);  // a mapping, read no further
      r.read_inputs();
      r.set_context();
      r.size_output(Config{.d_model = 1});  // the query's shape; the layer's width comes with the layer
    }, r.mpi_timeout_s);
    layer_.emplace(r.cfg, r.weights, r.prefix, MPI_COMM_WORLD, r.opts, WeightCheck::full, r.mpi_timeout_s);
    r.cfg = layer_->config();
    run_agreed(MPI_COMM_WORLD, "forward", [&] {  // each rank's config file against the layer, before forward
      r.check_against_config(r.cfg);
      r.size_output(r.cfg);
    }, r.mpi_timeout_s);
  }
  void run(Request& r) override { layer_->forward(r.in, r.out.data()); }
  bool writes() const override { return world().prints(); }

 private:
  std::optional<ShardedAttention> layer_;
};
#endif

std::unique_ptr<Runner> make_runner() {
#ifdef GPT2ATTN_HAVE_MPI
  if (world().parallel()) return std::make_unique<ShardedRunner>();
#endif
  return std::make_unique<LocalRunner>();
}

void write(const Request& r) {
  const int64_t B = r.in.query.shape[0], T = r.in.query.shape[1];
  naming_output([&] {
    if (r.unbatched) {
      npy::write_f32(r.output, r.out.data(), {T, r.cfg.d_model});
    } else {
      npy::write_f32(r.output, r.out.data(), {B, T, r.cfg.d_model});
    }
  });
}

int run_forward(const Args& a) {
  Request r = read_request(a);
  // EngineOptions::isa picks gpt2attn's kernels; oneDNN's cap is process-wide and fixed at its first dispatch, and
  // this process is the CLI's: --isa caps oneDNN's GEMMs too, before any layer exists.
  limit_gemm_isa(r.opts.isa);
  const std::unique_ptr<Runner> runner = make_runner();
  runner->make_layer(r);
  runner->run(r);
  if (runner->writes()) write(r);
  return 0;
}

}  // namespace

const Command& forward_command() {
  static const Command c{
      "forward",
      "one attention layer on .npy inputs, written to --output.",
      {
          required("weights", "W.safetensors",
                   "the layer's weights (torch or Hugging Face GPT-2 naming), or a file of gpt2attn quantize."),
          value("prefix", "P", "the layer's tensor-name prefix in the weights file."),
          value("heads", "H", "attention heads; required unless --config gives them."),
          value("config", "config.json", "a Hugging Face GPT-2 config.json or one of configs/*.json (see below)."),
          value("kv-heads", "N", "K/V heads (grouped-query attention), dividing H; default: from the weights."),
          required("query", "q.npy", "the query (B, T, d_in), or (T, d_in) unbatched."),
          value("key", "k.npy", "the key; with --value (without both: self-attention)."),
          value("value", "v.npy", "the value; with --key."),
          value("mask", "m.npy", "an attention mask (see below for its shapes)."),
          value("mask-kind", "keep|block|additive", "how --mask is read; default: by its dtype, as torch reads it."),
          value("key-padding", "kp.npy", "a key padding mask (B, Tk), bool or uint8, nonzero = padding."),
          flag("causal", "causal attention (also when --config says so, or the weights are GPT-2's Conv1D layout)."),
          flag("no-causal", "attention without the causal mask, even over GPT-2 Conv1D weights (not with a causal "
                            "--config)."),
          value("context-length", "N", "the layer's context length; default max(1024, T, Tk) or --config's."),
          compute_row(false),
          weights_row(false),
          threads_row(),
          isa_row(),
          mpi_timeout_row(),
          required("output", "y.npy", "the float32 output, written atomically."),
      },
      kAbout,
      run_forward};
  return c;
}

}  // namespace gpt2attn::cli
