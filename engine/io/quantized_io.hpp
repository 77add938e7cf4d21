// engine/io/quantized_io.hpp: save_quantized's files inside the engine: the checks and decoding of a file already
// parsed (safetensors::read, map or parse). load_quantized and quantized_layer_shapes are read() or map() + these; the
// fuzz target calls them on parsed bytes. The format itself is documented at save_quantized (gpt2attn/weights.hpp).
#pragma once

#include <optional>

#include "engine/io/safetensors.hpp"
#include "gpt2attn/config.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn::detail {

// quantized_layer_shapes(f.path), of the parsed file: reads the header's shapes and metadata only, never f.data.
std::optional<QuantizedLayerShapes> quantized_layer_shapes(const safetensors::File& f);

// load_quantized(f.path, c), of the parsed file, with the same checks and messages.
QuantizedWeights load_quantized(const safetensors::File& f, const Config& c);

}  // namespace gpt2attn::detail
