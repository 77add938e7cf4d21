// tests/fuzz/fuzz_quantized.cpp: the quantized-weights loader (engine/io/quantized_io.cpp) on arbitrary bytes:
// quantized_layer_shapes, then load_quantized under configs completed from those shapes (a few head counts) and one
// that disagrees with them. Weights it accepts must pass QuantizedWeights::validate, and are checked code for code and
// bit for bit against the file's bytes, so a wrong nibble order or offset is a finding too, not only a crash.
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "engine/io/quantized_io.hpp"
#include "engine/io/safetensors.hpp"
#include "gpt2attn/weights.hpp"
#include "tests/fuzz/fuzz_targets.hpp"

namespace gpt2attn::fuzz {
namespace {

const std::string kPath = "fuzz-input.safetensors";

// The bytes of tensor `name` as the file holds them.
std::vector<uint8_t> raw(const safetensors::File& f, const std::string& name) {
  const safetensors::Tensor& t = f.tensors.at(name);
  return std::vector<uint8_t>(f.data.data() + t.begin, f.data.data() + t.end);
}

// One matrix the loader accepted, against its tensors read independently: the codes re-encoded as the format stores
// them (int4: code 2i in the low nibble of byte i, 2i + 1 in the high one, 0 past an odd width) are the file's bytes;
// scales and bias are the file's F32 values, bit for bit.
void check_matrix(const safetensors::File& f, const std::string& name, WeightFormat format, const QuantizedMatrix& m,
                  const std::vector<float>& bias) {
  check(static_cast<int64_t>(m.codes.size()) == m.rows * m.cols, name + ": code count disagrees with its shape");
  std::vector<uint8_t> encoded;
  if (format == WeightFormat::int8) {
    encoded.assign(m.codes.size(), 0);
    if (!m.codes.empty()) std::memcpy(encoded.data(), m.codes.data(), m.codes.size());
  } else {
    const int64_t width = (m.cols + 1) / 2;
    encoded.assign(static_cast<size_t>(m.rows * width), 0);
    for (int64_t r = 0; r < m.rows; ++r) {
      for (int64_t k = 0; k < m.cols; ++k) {
        const int8_t c = m.codes[static_cast<size_t>(r * m.cols + k)];
        check(c >= -8 && c <= 7, name + ": an int4 code outside [-8, 7] loaded");
        encoded[static_cast<size_t>(r * width + k / 2)] |= static_cast<uint8_t>((c & 0xF) << (k % 2 ? 4 : 0));
      }
    }
  }
  check(encoded == raw(f, name + ".codes"), name + ": the codes loaded are not the file's");
  check(same_bits(m.scales, f.to_f32(name + ".scales")), name + ": the scales loaded are not the file's");
  if (bias.empty()) {
    check(!f.has(name + ".bias"), name + ": the file's bias was dropped");
  } else {
    check(same_bits(bias, f.to_f32(name + ".bias")), name + ": the bias loaded is not the file's");
  }
}

}  // namespace

int fuzz_quantized(const uint8_t* data, size_t size) {
  if (size > kMaxInput) return 0;
  safetensors::File f;
  if (!returns({ErrorCode::bad_file}, kPath, [&] { f = safetensors::parse(kPath, data, size); })) return 0;
  std::optional<QuantizedLayerShapes> shapes;
  const bool read = returns({ErrorCode::bad_file}, kPath, [&] { shapes = detail::quantized_layer_shapes(f); });
  Config any;  // a valid config: what load_quantized says of a file the shapes refused or did not recognise
  any.d_model = 8, any.num_heads = 2;
  if (!read || !shapes) {
    // The same file refused by the loader too, for the same reason: it is the same layout check.
    check(!returns({ErrorCode::bad_file}, kPath, [&] { detail::load_quantized(f, any); }),
          "load_quantized accepted a file quantized_layer_shapes refused or did not recognise");
    return 0;
  }
  for (int64_t heads : {1, 2, 3, 4, 8}) {
    Config c;
    c.num_heads = heads;
    if (!returns({ErrorCode::invalid_argument}, kPath, [&] { c = apply_loaded_shapes(c, *shapes); })) continue;
    QuantizedWeights q;
    if (!returns({ErrorCode::bad_file}, kPath, [&] { q = detail::load_quantized(f, c); })) continue;
    check(q.format == shapes->format, "the format loaded is not the one the shapes said");
    returns({}, kPath, [&] { q.validate(c); });  // any Error here is a finding: the loader let it through
    check_matrix(f, "q_proj", q.format, q.w_q, q.b_q);
    check_matrix(f, "k_proj", q.format, q.w_k, q.b_k);
    check_matrix(f, "v_proj", q.format, q.w_v, q.b_v);
    check_matrix(f, "out_proj", q.format, q.w_o, q.b_o);

    // A config one input wider than the file's layer is refused (or, past the config's limits, the config is), never
    // read past.
    Config wider = c;
    wider.d_in = c.query_width() + 1;
    check(!returns({ErrorCode::bad_file, ErrorCode::invalid_argument}, kPath,
                   [&] { detail::load_quantized(f, wider); }),
          "load_quantized accepted a config wider than the file's q_proj");
  }
  return 0;
}

}  // namespace gpt2attn::fuzz
