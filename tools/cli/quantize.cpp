// tools/cli/quantize.cpp: `gpt2attn quantize`, one attention layer of a float safetensors file quantized to int8 or
// int4 once and saved (save_quantized), so that forward, or a server through load_quantized, starts from the codes.
// Reads the layer as forward does (open_safetensors_layer, a --config or --preset checked against it); computes
// nothing else.
#include <optional>
#include <string>

#include "tools/cli/commands.hpp"

namespace gpt2attn::cli {

namespace {

const char* kAbout = R"(quantize quantizes one attention layer of a safetensors file (torch or Hugging Face GPT-2 naming, F32,
         F16 or BF16, under --prefix) to int8 (one scale per output row) or int4 (one per row and 32
         inputs) and writes the codes, scales and f32 biases to --output as a safetensors file (its format:
         save_quantized in gpt2attn/weights.hpp). `gpt2attn forward --weights` takes that file, as do
         load_quantized and the Python module's from_quantized: a layer built from it computes bit for bit
         what one quantizing the float file at load (--weights-dtype) computes. The heads come from --heads,
         --config (a Hugging Face GPT-2 config.json or one of configs/*.json) or --preset; the codes do not
         depend on them, but the K/V width must be whole K/V heads, and a --config or --preset whose
         widths or biases differ from the file's is refused. Non-finite weights, and a file quantized
         already, are refused. --output is written atomically and may not be --weights or --config.
)";

// The heads, and a config to check the weights against: --heads alone (no check), --config's or --preset's.
struct HeadsSource {
  Config cfg;                   // num_heads, num_kv_heads (0: from the weights' K/V width)
  std::optional<Config> said;   // --config's or --preset's whole layer
  std::string name;             // its path or preset name
};

HeadsSource heads_source(const Args& a) {
  const int given = a.has("heads") + a.has("config") + a.has("preset");
  if (given == 0) throw UsageError("missing required option --heads (or --config or --preset)");
  if (given > 1) throw UsageError("give one of --heads, --config and --preset: each says the heads");
  HeadsSource s;
  if (a.has("heads")) {
    s.cfg.num_heads = a.integer<int64_t>("heads", 0, 1);
    return s;
  }
  if (a.has("config")) {
    s.name = a.get("config");
    s.said = load_any_config(s.name);
  } else {
    s.name = "preset " + a.get("preset");
    try {
      s.said = preset(a.get("preset"));
    } catch (const Error& e) {
      throw UsageError(std::string("--preset: ") + e.what());
    }
  }
  s.cfg.num_heads = s.said->num_heads;
  s.cfg.num_kv_heads = s.said->kv_heads();  // a config that names no K/V heads has as many as heads
  return s;
}

int run_quantize(const Args& a) {
  const WeightFormat format =
      weight_format_from_string(choice("weights-dtype", a.required("weights-dtype"), {"int8", "int4"}));
  const std::string weights = a.required("weights"), output = a.required("output"), prefix = a.get("prefix");
  HeadsSource heads = heads_source(a);
  refuse_output_over_inputs(output, {{"weights", weights}, {"config", a.get("config")}});

  if (const std::optional<QuantizedLayerShapes> q = quantized_layer_shapes(weights)) {
    invalid(weights + ": already quantized (" + to_string(q->format) + ", written by gpt2attn quantize); quantize "
            "the float weights it came from: codes quantized again lose more than quantizing once");
  }
  const StoredLayer stored = open_safetensors_layer(weights, prefix);
  Config c;
  try {
    c = apply_loaded_shapes(heads.cfg, stored);
  } catch (const Error& e) {
    throw Error(e.code(), weights + ": " + e.what());  // which file the sizes came from
  }
  if (heads.said) check_config_against_weights(*heads.said, heads.name, c, weights);
  stored.weights.validate(c);
  const QuantizedWeights q = QuantizedWeights::quantize(stored.weights, format);
  try {
    save_quantized(output, c, q);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::bad_file) throw;
    throw Error(e.code(), std::string("--output ") + e.what());  // which option the unwritable path was
  }
  return 0;
}

}  // namespace

const Command& quantize_command() {
  static const Command c{
      "quantize",
      "one attention layer's weights quantized to int8 or int4, saved for forward and load_quantized.",
      {
          required("weights", "W.safetensors", "the layer's float weights (torch or Hugging Face GPT-2 naming)."),
          value("prefix", "P", "the layer's tensor-name prefix in the weights file."),
          value("heads", "H", "attention heads (or --config, or --preset)."),
          value("config", "config.json", "a Hugging Face GPT-2 config.json or one of configs/*.json."),
          value("preset", "NAME", "a compiled-in preset (gpt2attn presets) giving the heads and the shapes."),
          required("weights-dtype", "int8|int4", "the format to quantize to."),
          required("output", "Q.safetensors", "the quantized file, written atomically."),
      },
      kAbout,
      run_quantize};
  return c;
}

}  // namespace gpt2attn::cli
