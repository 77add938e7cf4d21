// engine/io/weights_io.hpp: the layer loader's step after safetensors::read(): one attention layer of a file already
// parsed in memory. open_safetensors_layer() is read() + this; the fuzz targets call it on parsed bytes.
#pragma once

#include <memory>
#include <string>

#include "engine/io/safetensors.hpp"
#include "gpt2attn/weights.hpp"

namespace gpt2attn::detail {

// What open_safetensors_layer(file.path, prefix) gives, with the same checks and messages; the layer's storage
// keeps `file` alive.
StoredLayer open_safetensors_layer(std::shared_ptr<const safetensors::File> file, const std::string& prefix);

}  // namespace gpt2attn::detail
