// model/gpt2_checkpoint.cpp: a Hugging Face GPT-2 checkpoint directory read as views of its mapped tensors
// (config.json, model.safetensors or its shards), their checks, and random weights laid out as such a checkpoint is.
// Byte-level checks of each file are the safetensors reader's (gpt2attn/safetensors.hpp); nothing here converts a
// stored tensor.
//
// Names: "wte.weight", "h.3.mlp.c_fc.weight", ... as GPT2Model's state dict has them (GPT2LMHeadModel's add
// "transformer."). Conv1D weights are stored (inputs, outputs); GPT2Weights holds torch layout (outputs, inputs), so
// each is the transposed view, and c_attn's (E, 3E) is split by column into W_q, W_k, W_v.
#include "gpt2attn/gpt2_checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gpt2attn/error.hpp"
#include "gpt2attn/options.hpp"
#include "gpt2attn/safetensors.hpp"

namespace gpt2attn {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

[[noreturn]] void bad_file(const std::string& where, const std::string& problem) {
  fail(ErrorCode::bad_file, where + ": " + problem);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// ---- JSON files ----

// A small regular file's bytes. Opened non-blocking and checked on the descriptor, as the library's own readers do:
// a FIFO or device swapped in for config.json is refused, not read until it blocks or fills memory.
std::string read_text_file(const std::string& path, const char* noun, off_t limit) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    bad_file(path, std::string("cannot open ") + noun + ": " + (err == ENOENT ? "no such file" : std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) bad_file(path, std::string("not a regular file; a ") + noun + " must be one");
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) bad_file(path, std::string("cannot open ") + noun + ": " + std::strerror(errno));
  std::string text;
  std::string problem;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    problem = std::string("not a regular file; a ") + noun + " must be one";
  } else if (st.st_size > limit) {
    problem = std::to_string(st.st_size) + " bytes, over the " + std::to_string(limit) + "-byte limit on a " + noun;
  } else {
    text.resize(static_cast<size_t>(st.st_size) + 1);  // one byte more: a file that grew is seen, not cut short
    size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) problem = std::string("read failed: ") + std::strerror(errno);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    if (problem.empty() && got != static_cast<size_t>(st.st_size)) {
      problem = "changed size while being read";
    }
    text.resize(got);
  }
  ::close(fd);
  if (!problem.empty()) bad_file(path, problem);
  return text;
}

// JSON text as an object, refusing what the library's config and safetensors readers refuse: a UTF-8 byte-order
// mark, a NUL byte (nlohmann would stop there and accept "{...}\0garbage"), and a key given twice in one object
// (nlohmann keeps the last; another reader may take the first, so the file would mean two things).
json parse_json_object(const std::string& text, const std::string& origin) {
  if (text.rfind("\xEF\xBB\xBF", 0) == 0) {
    bad_file(origin, "not valid JSON: it starts with a UTF-8 byte-order mark (EF BB BF); save it as UTF-8 without one");
  }
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    bad_file(origin, "not valid JSON: NUL byte at offset " + std::to_string(nul));
  }
  std::vector<std::set<std::string>> open;  // the keys of each object being parsed, innermost last
  const auto on_event = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      open.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open.empty()) open.pop_back();
    } else if (event == json::parse_event_t::key && !open.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!open.back().insert(key).second) bad_file(origin, "key '" + key + "' given twice");
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, on_event);
  } catch (const json::exception& e) {
    bad_file(origin, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) bad_file(origin, "expected a JSON object");
  return j;
}

// An integer field, as the library's config reader takes one: a float (even 32.0) is refused, and an integer past
// int64 is reported as written rather than wrapped.
int64_t integer_field(const json& v, const std::string& origin, const std::string& key) {
  const bool past_int64 =
      (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) ||
      (v.is_number_float() && std::trunc(v.get<double>()) == v.get<double>() && std::fabs(v.get<double>()) >= 0x1p63);
  if (past_int64)
    bad_file(origin, "'" + key + "' is out of range: " + v.dump() + " does not fit a 64-bit signed integer");
  if (!v.is_number_integer()) bad_file(origin, "'" + key + "' must be an integer, got " + v.dump());
  return v.get<int64_t>();
}

// ---- Views of stored tensors ----

// The torch-layout (n, inputs) view of columns [offset, offset + n) of a Conv1D weight stored (inputs, outputs):
// output o of input i sits at i * ld + offset + o, so the view's strides are (1, ld).
TensorView conv1d_columns(const TensorView& stored, int64_t offset, int64_t n) {
  TensorView v = stored;
  v.data = static_cast<const std::byte*>(stored.data) +
           offset * stored.strides[1] * static_cast<int64_t>(size_of(stored.dtype));
  v.shape = {n, stored.shape[0], 0, 0};
  v.strides = {stored.strides[1], stored.strides[0], 0, 0};
  return v;
}
TensorView conv1d_weight(const TensorView& stored) { return conv1d_columns(stored, 0, stored.shape[1]); }

// Elements [offset, offset + n) of a rank-1 view.
TensorView elements(const TensorView& t, int64_t offset, int64_t n) {
  TensorView v = t;
  v.data = static_cast<const std::byte*>(t.data) + offset * t.strides[0] * static_cast<int64_t>(size_of(t.dtype));
  v.shape[0] = n;
  return v;
}

// A stored tensor by its checkpoint name and the shape the config gives it (the checkpoint's layout).
using Fetch = std::function<TensorView(const std::string& name, const std::vector<int64_t>& shape)>;

// GPT2Weights over the tensors `get` gives: the one place the checkpoint's names and layout meet the torch-layout
// fields, for the files (open_gpt2_checkpoint) and for random weights alike.
GPT2Weights assemble(const GPT2Config& c, const Fetch& get) {
  const int64_t E = c.n_embd, I = c.inner();
  GPT2Weights w;
  w.wte = get("wte.weight", {c.vocab_size, E});
  w.wpe = get("wpe.weight", {c.n_positions, E});
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    GPT2BlockWeights& b = w.blocks.emplace_back();
    b.ln_1_weight = get(h + "ln_1.weight", {E});
    b.ln_1_bias = get(h + "ln_1.bias", {E});
    const TensorView qkv = get(h + "attn.c_attn.weight", {E, 3 * E});
    b.attn.w_q = conv1d_columns(qkv, 0, E);
    b.attn.w_k = conv1d_columns(qkv, E, E);
    b.attn.w_v = conv1d_columns(qkv, 2 * E, E);
    const TensorView qkv_bias = get(h + "attn.c_attn.bias", {3 * E});
    b.attn.b_q = elements(qkv_bias, 0, E);
    b.attn.b_k = elements(qkv_bias, E, E);
    b.attn.b_v = elements(qkv_bias, 2 * E, E);
    b.attn.w_o = conv1d_weight(get(h + "attn.c_proj.weight", {E, E}));
    b.attn.b_o = get(h + "attn.c_proj.bias", {E});
    b.ln_2_weight = get(h + "ln_2.weight", {E});
    b.ln_2_bias = get(h + "ln_2.bias", {E});
    b.fc_weight = conv1d_weight(get(h + "mlp.c_fc.weight", {E, I}));
    b.fc_bias = get(h + "mlp.c_fc.bias", {I});
    b.proj_weight = conv1d_weight(get(h + "mlp.c_proj.weight", {I, E}));
    b.proj_bias = get(h + "mlp.c_proj.bias", {E});
  }
  w.ln_f_weight = get("ln_f.weight", {E});
  w.ln_f_bias = get("ln_f.bias", {E});
  return w;
}

// ---- Checks of GPT2Weights ----

// One field of GPT2Weights, by the checkpoint tensor it comes from.
struct Param {
  std::string name;            // "h.3.attn.c_attn.weight"
  const char* part;            // which of the tensor's parts the field is ("w_k"), or nullptr for all of it
  const TensorView* view;      // torch layout
  std::vector<int64_t> shape;  // what the config says the view's shape is
  bool conv1d;     // view element [o, i] is the stored tensor's [i, offset + o]; else [r, c] or [offset + r]
  int64_t offset;  // where the part starts among the stored tensor's columns (a bias: its elements)
};

std::vector<Param> params_of(const GPT2Weights& w, const GPT2Config& c) {
  const int64_t E = c.n_embd, I = c.inner();
  std::vector<Param> p;
  p.push_back({"wte.weight", nullptr, &w.wte, {c.vocab_size, E}, false, 0});
  p.push_back({"wpe.weight", nullptr, &w.wpe, {c.n_positions, E}, false, 0});
  for (size_t l = 0; l < w.blocks.size(); ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    const GPT2BlockWeights& b = w.blocks[l];
    p.push_back({h + "ln_1.weight", nullptr, &b.ln_1_weight, {E}, false, 0});
    p.push_back({h + "ln_1.bias", nullptr, &b.ln_1_bias, {E}, false, 0});
    p.push_back({h + "attn.c_attn.weight", "w_q", &b.attn.w_q, {E, E}, true, 0});
    p.push_back({h + "attn.c_attn.weight", "w_k", &b.attn.w_k, {E, E}, true, E});
    p.push_back({h + "attn.c_attn.weight", "w_v", &b.attn.w_v, {E, E}, true, 2 * E});
    p.push_back({h + "attn.c_attn.bias", "b_q", &b.attn.b_q, {E}, false, 0});
    p.push_back({h + "attn.c_attn.bias", "b_k", &b.attn.b_k, {E}, false, E});
    p.push_back({h + "attn.c_attn.bias", "b_v", &b.attn.b_v, {E}, false, 2 * E});
    p.push_back({h + "attn.c_proj.weight", nullptr, &b.attn.w_o, {E, E}, true, 0});
    p.push_back({h + "attn.c_proj.bias", nullptr, &b.attn.b_o, {E}, false, 0});
    p.push_back({h + "ln_2.weight", nullptr, &b.ln_2_weight, {E}, false, 0});
    p.push_back({h + "ln_2.bias", nullptr, &b.ln_2_bias, {E}, false, 0});
    p.push_back({h + "mlp.c_fc.weight", nullptr, &b.fc_weight, {I, E}, true, 0});
    p.push_back({h + "mlp.c_fc.bias", nullptr, &b.fc_bias, {I}, false, 0});
    p.push_back({h + "mlp.c_proj.weight", nullptr, &b.proj_weight, {E, I}, true, 0});
    p.push_back({h + "mlp.c_proj.bias", nullptr, &b.proj_bias, {E}, false, 0});
  }
  p.push_back({"ln_f.weight", nullptr, &w.ln_f_weight, {E}, false, 0});
  p.push_back({"ln_f.bias", nullptr, &w.ln_f_bias, {E}, false, 0});
  return p;
}

// The first element of a rank-1 or rank-2 view whose exponent bits are all ones (NaN or infinity), found by the
// bits alone (no conversion), reading memory in order: the inner loop runs along the smaller stride, so a transposed
// Conv1D view is read a stored row at a time, not a cache line per element. Returns false when every element is
// finite; else its view indices and bits.
template <class Bits, Bits kExponent>
bool find_nonfinite(const TensorView& v, int64_t& r_out, int64_t& c_out, Bits& bits_out) {
  const bool matrix = v.rank == 2;
  const int64_t rows = matrix ? v.shape[0] : 1, cols = matrix ? v.shape[1] : v.shape[0];
  const int64_t row_stride = matrix ? v.strides[0] : 0, col_stride = matrix ? v.strides[1] : v.strides[0];
  const bool along_rows = matrix && std::llabs(row_stride) < std::llabs(col_stride);  // inner loop over rows
  const int64_t outer_n = along_rows ? cols : rows, inner_n = along_rows ? rows : cols;
  const int64_t outer_stride = along_rows ? col_stride : row_stride,
                inner_stride = along_rows ? row_stride : col_stride;
  const auto* base = static_cast<const std::byte*>(v.data);
  const auto load = [&](int64_t outer, int64_t inner) {
    Bits b;
    std::memcpy(&b, base + (outer * outer_stride + inner * inner_stride) * int64_t{sizeof(Bits)}, sizeof b);
    return b;
  };
  for (int64_t o = 0; o < outer_n; ++o) {
    bool any = false;  // OR-reduced without a branch per element; the element is looked for only once one is bad
    for (int64_t i = 0; i < inner_n; ++i) any |= (load(o, i) & kExponent) == kExponent;
    if (!any) continue;
    for (int64_t i = 0; i < inner_n; ++i) {
      if ((load(o, i) & kExponent) != kExponent) continue;
      bits_out = load(o, i);
      r_out = along_rows ? i : o;
      c_out = along_rows ? o : i;
      return true;
    }
  }
  return false;
}

// Checks every field against c; `where(p)` begins each message ("GPT2Weights: tensor 'h.0.ln_1.bias'"), `code` is
// what the error says (the caller's weights: invalid_argument; a file's: bad_file).
void check_weights(const GPT2Weights& w, const GPT2Config& c, ErrorCode code,
                   const std::function<std::string(const Param&)>& where) {
  if (static_cast<int64_t>(w.blocks.size()) != c.n_layer) {
    fail(code,
         "GPT2Weights: " + std::to_string(w.blocks.size()) + " blocks, but n_layer is " + std::to_string(c.n_layer));
  }
  for (const Param& p : params_of(w, c)) {
    const TensorView& t = *p.view;
    const std::string what = where(p) + (p.part ? std::string(" (") + p.part + ")" : "");
    const std::vector<int64_t> got(t.shape.begin(), t.shape.begin() + std::clamp(t.rank, 0, 4));
    if (t.empty()) fail(code, what + " is missing (expected " + shape_text(p.shape) + ")");
    if (got != p.shape) fail(code, what + " has shape " + shape_text(got) + ", expected " + shape_text(p.shape));
    int64_t r = 0, col = 0;
    bool nan = false, found = false;
    if (t.dtype == DType::f32) {
      uint32_t b = 0;
      found = find_nonfinite<uint32_t, 0x7F800000u>(t, r, col, b);
      nan = (b & 0x007FFFFFu) != 0;
    } else if (t.dtype == DType::bf16) {
      uint16_t b = 0;
      found = find_nonfinite<uint16_t, 0x7F80u>(t, r, col, b);
      nan = (b & 0x007Fu) != 0;
    } else if (t.dtype == DType::f16) {
      uint16_t b = 0;
      found = find_nonfinite<uint16_t, 0x7C00u>(t, r, col, b);
      nan = (b & 0x03FFu) != 0;
    } else {
      fail(code, what + " has dtype " + to_string(t.dtype) + "; GPT-2 weights are f32, bf16 or f16");
    }
    if (!found) continue;
    // Named at its index in the checkpoint's tensor, where a user would look for it.
    const std::string index = p.conv1d ? "[" + std::to_string(col) + ", " + std::to_string(p.offset + r) + "]"
                              : p.shape.size() == 1 ? "[" + std::to_string(p.offset + col) + "]"
                                                    : "[" + std::to_string(r) + ", " + std::to_string(col) + "]";
    fail(code, what + ": element " + index + " is " + (nan ? "NaN" : "infinite"));
  }
}

// ---- Conversions (random weights are generated in f32, stored as asked) ----

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// Finite x to the nearest bf16, ties to even.
uint16_t bf16_of(float x) {
  uint32_t u = bits_of(x);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Finite x to the nearest f16, ties to even (overflow to infinity, underflow through the subnormals to zero).
uint16_t f16_of(float x) {
  const uint32_t u = bits_of(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // |x| >= 65520: rounds past 65504
  if (a >= 0x38800000u) {                                              // |x| >= 2^-14: normal
    uint32_t r = a - (112u << 23);                                     // exponent bias 127 -> 15
    r += 0xFFFu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // |x| <= 2^-25 rounds to 0 (the tie to even too)
  // Subnormal: |x| = m 2^(e - 150) is k 2^-24 with k = m >> (126 - e), rounded to nearest even.
  const uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u, s = 126 - e;
  uint32_t k = m >> s;
  const uint32_t rest = m & ((1u << s) - 1), half = 1u << (s - 1);
  if (rest > half || (rest == half && (k & 1u))) ++k;  // k = 0x400 is the smallest normal's encoding
  return static_cast<uint16_t>(sign | k);
}

// bf16 and f16 bits widened to f32's (exactly: each value is a float).
uint32_t f32_bits(const std::byte* p, DType t) {
  if (t == DType::f32) {
    uint32_t u;
    std::memcpy(&u, p, sizeof u);
    return u;
  }
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  if (t == DType::bf16) return static_cast<uint32_t>(h) << 16;
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return sign | 0x7F800000u | (m << 13);
  if (e != 0) return sign | ((e + 112) << 23) | (m << 13);
  if (m == 0) return sign;
  const float sub = std::ldexp(static_cast<float>(m), -24);  // a subnormal: m 2^-24, exact in f32
  return sign | bits_of(sub);
}

// ---- Random weights ----

// splitmix64's output function; element pair k of a tensor draws outputs k of its stream, so any element is a
// function of (seed, tensor, index) alone: filling in parallel chunks gives the same numbers as filling in order.
uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// Elements [begin, end) (begin even) of a tensor whose values are N(0, std^2) by Box-Muller on two uniforms a pair.
template <class Store>
void fill_normal(uint64_t stream, float stddev, int64_t begin, int64_t end, const Store& store) {
  for (int64_t i = begin; i < end; i += 2) {
    const uint64_t k = static_cast<uint64_t>(i / 2);
    const uint64_t a = mix(stream + (2 * k + 1) * kGolden), b = mix(stream + (2 * k + 2) * kGolden);
    // In float: gpt2-xl draws 1.56 G values, and 24-bit uniforms still reach 5.8 standard deviations out.
    const float u1 = static_cast<float>((a >> 40) + 1) * 0x1p-24f;  // (0, 1]: log(u1) is finite
    const float u2 = static_cast<float>(b >> 40) * 0x1p-24f;        // [0, 1)
    const float r = std::sqrt(-2.0f * std::log(u1)) * stddev, theta = 6.28318530717958647692f * u2;
    store(i, r * std::cos(theta));
    if (i + 1 < end) store(i + 1, r * std::sin(theta));
  }
}

// A stored tensor of `n` elements of `dtype` at dst: constant (stddev = 0: `value`), or normal. A large one is
// filled by `threads` threads in chunks (gpt2-xl holds 1.56 G values); the numbers do not depend on the split.
void fill_tensor(std::byte* dst, DType dtype, int64_t n, float value, float stddev, uint64_t stream, int threads) {
  const auto store = [dst, dtype](int64_t i, float x) {
    if (dtype == DType::f32) {
      std::memcpy(dst + 4 * i, &x, 4);
    } else {
      const uint16_t h = dtype == DType::bf16 ? bf16_of(x) : f16_of(x);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  };
  if (stddev == 0.0f) {
    for (int64_t i = 0; i < n; ++i) store(i, value);
    return;
  }
  constexpr int64_t kChunk = int64_t{1} << 17;  // even; big enough that a thread's start-up is noise
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::atomic<int64_t> next{0};
  const auto work = [&] {
    for (int64_t k; (k = next.fetch_add(1)) < chunks;) {
      fill_normal(stream, stddev, k * kChunk, std::min(n, (k + 1) * kChunk), store);
    }
  };
  run_on_threads(threads, [&](int, int) { work(); });
}

}  // namespace

// ---- Public API ----

GPT2Config gpt2_config_from_json(const std::string& json_text, const std::string& origin) {
  const json j = parse_json_object(json_text, origin);
  // n_embd, n_head, n_positions (or n_ctx), and the keys that change what attention computes, read as the
  // library's attention reader reads them, so a config.json means the same to both.
  const Config attention = hf_gpt2_config_from_json(json_text, origin);
  GPT2Config c;
  c.n_embd = attention.d_model;
  c.n_head = attention.num_heads;
  c.n_positions = attention.context_length;
  const auto required = [&](const char* key) {
    if (!j.contains(key)) bad_file(origin, std::string("no '") + key + "' (a Hugging Face GPT-2 config.json has it)");
    return integer_field(j[key], origin, key);
  };
  c.vocab_size = required("vocab_size");
  c.n_layer = required("n_layer");
  if (j.contains("n_inner") && !j["n_inner"].is_null()) {
    c.n_inner = integer_field(j["n_inner"], origin, "n_inner");
    // Hugging Face takes 0 as a width of 0, where GPT2Config's 0 means 4 n_embd: refused rather than read as either.
    if (c.n_inner < 1) bad_file(origin, "'n_inner' must be null or at least 1, got " + j["n_inner"].dump());
  }
  if (j.contains("layer_norm_epsilon")) {
    const json& v = j["layer_norm_epsilon"];
    if (!v.is_number()) bad_file(origin, "'layer_norm_epsilon' must be a number, got " + v.dump());
    c.layer_norm_epsilon = static_cast<float>(v.get<double>());  // validate() refuses one that rounds to 0 or inf
  }
  if (j.contains("activation_function")) {
    const json& v = j["activation_function"];
    const bool tanh_gelu = v.is_string() && (v.get_ref<const std::string&>() == "gelu_new" ||
                                             v.get_ref<const std::string&>() == "gelu_pytorch_tanh");
    if (!tanh_gelu) {
      bad_file(origin, "'activation_function' is " + v.dump() +
                           "; GPT-2's MLP computes the tanh GELU (\"gelu_new\" or \"gelu_pytorch_tanh\") and no other");
    }
  }
  // reorder_and_upcast_attn only moves the scaling and computes the scores in f32 under fp16 autocast: the same
  // model, so either value is read (as the library's attention reader reads it), but a non-boolean is a bad file.
  if (j.contains("reorder_and_upcast_attn") && !j["reorder_and_upcast_attn"].is_boolean()) {
    bad_file(origin, "'reorder_and_upcast_attn' must be true or false");
  }
  if (j.contains("tie_word_embeddings")) {
    const json& v = j["tie_word_embeddings"];
    if (!v.is_boolean()) bad_file(origin, "'tie_word_embeddings' must be true or false");
    if (!v.get<bool>()) {
      bad_file(origin,
               "'tie_word_embeddings' is false: the model has an LM head of its own; GPT-2's is wte, "
               "and gpt2attn computes the logits with wte");
    }
  }
  try {
    c.validate();
  } catch (const Error& e) {
    bad_file(origin, e.what());
  }
  return c;
}

void GPT2Weights::validate(const GPT2Config& c) const {
  c.validate();
  check_weights(*this, c, ErrorCode::invalid_argument,
                [](const Param& p) { return "GPT2Weights: tensor '" + p.name + "'"; });
}

GPT2Checkpoint open_gpt2_checkpoint(const std::string& dir) {
  {
    std::error_code ec;
    const fs::file_status st = fs::status(dir, ec);
    if (ec && ec != std::errc::no_such_file_or_directory)
      bad_file(dir, "cannot open checkpoint directory: " + ec.message());
    if (!fs::exists(st)) bad_file(dir, "no such checkpoint directory");
    if (!fs::is_directory(st)) bad_file(dir, "not a directory; a checkpoint is a directory holding config.json");
  }
  const std::string config_path = (fs::path(dir) / "config.json").string();
  GPT2Checkpoint ck;
  ck.config = gpt2_config_from_json(read_text_file(config_path, "config file", 1 << 20), config_path);
  const GPT2Config& c = ck.config;

  // The files and which one holds each tensor. model.safetensors is read where both it and an index are present,
  // as transformers' from_pretrained reads it.
  auto files = std::make_shared<std::vector<SafetensorsFile>>();
  std::map<std::string, size_t> file_of;  // stored name -> index in *files
  std::string listing;                    // what names the tensors, for "missing" messages
  const fs::path single = fs::path(dir) / "model.safetensors", index = fs::path(dir) / "model.safetensors.index.json";
  std::error_code ec;
  if (!fs::exists(single, ec) && !fs::exists(index, ec)) {
    bad_file(dir, "neither model.safetensors nor model.safetensors.index.json (with its shards) is there");
  }
  if (fs::exists(single, ec)) {
    files->push_back(SafetensorsFile::open(single.string()));
    for (const std::string& name : files->back().names()) file_of.emplace(name, 0);
    listing = single.string();
  } else {
    listing = index.string();
    const json j = parse_json_object(read_text_file(listing, "checkpoint index", 64 << 20), listing);
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
      bad_file(listing, "no 'weight_map' object (tensor name -> file name)");
    }
    std::map<std::string, size_t> opened;  // file name -> index in *files
    for (const auto& [name, v] : j["weight_map"].items()) {
      if (!v.is_string()) bad_file(listing, "weight_map['" + name + "'] is not a file name");
      const std::string& file = v.get_ref<const std::string&>();
      // A shard is a file beside the index: a path elsewhere ("../x", "/etc/x") is no checkpoint's.
      if (file.empty() || file == "." || file == ".." || file.find_first_of(std::string("/\0", 2)) != std::string::npos)
        bad_file(listing, "weight_map['" + name + "'] is '" + file + "', not a file name in the checkpoint directory");
      auto it = opened.find(file);
      if (it == opened.end()) {
        const fs::path path = fs::path(dir) / file;
        if (!fs::exists(path, ec))
          bad_file(listing, "names shard '" + file + "' (for '" + name + "'), which is missing");
        files->push_back(SafetensorsFile::open(path.string()));
        it = opened.emplace(file, files->size() - 1).first;
      }
      file_of.emplace(name, it->second);
    }
  }

  // A block past n_layer means config.json describes another model than the tensors do.
  for (const auto& [stored, f] : file_of) {
    const std::string name = stored.rfind("transformer.", 0) == 0 ? stored.substr(12) : stored;
    if (name.rfind("h.", 0) != 0) continue;
    const size_t dot = name.find('.', 2);
    const std::string digits = name.substr(2, dot == std::string::npos ? std::string::npos : dot - 2);
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    if (std::stoll(digits) >= c.n_layer) {
      bad_file((*files)[f].path(), "tensor '" + stored + "' is in block " + digits +
                                       ", but config.json says n_layer=" + std::to_string(c.n_layer));
    }
  }

  std::map<std::string, std::string> stored_of;  // checkpoint name -> the name it is stored under
  const auto find = [&](const std::string& name) -> const std::string* {
    const auto plain = file_of.find(name), prefixed = file_of.find("transformer." + name);
    if (plain != file_of.end() && prefixed != file_of.end()) {
      bad_file(listing, "both '" + name + "' and 'transformer." + name + "': which one is the model's is ambiguous");
    }
    return plain != file_of.end() ? &plain->first : prefixed != file_of.end() ? &prefixed->first : nullptr;
  };
  const Fetch get = [&](const std::string& name, const std::vector<int64_t>& shape) {
    const std::string* stored = find(name);
    if (!stored) {
      bad_file(listing, "no tensor '" + name + "' (nor 'transformer." + name + "')" +
                            (name.rfind("h.", 0) == 0 ? " though config.json says n_layer=" + std::to_string(c.n_layer)
                                                      : std::string()));
    }
    const SafetensorsFile& f = (*files)[file_of.at(*stored)];
    if (f.shape(*stored) != shape) {
      bad_file(f.path(), "tensor '" + *stored + "' has shape " + shape_text(f.shape(*stored)) + ", expected " +
                             shape_text(shape) + " by config.json");
    }
    stored_of[name] = *stored;
    return f.view(*stored);  // Error(bad_file) naming the file and the tensor for a dtype other than F32/F16/BF16
  };
  ck.weights = assemble(c, get);

  // GPT-2 computes its logits with wte; a stored LM head that differs would be a different model.
  if (const auto it = file_of.find("lm_head.weight"); it != file_of.end()) {
    const SafetensorsFile& f = (*files)[it->second];
    const std::vector<int64_t> want{c.vocab_size, c.n_embd};
    if (f.shape(it->first) != want) {
      bad_file(f.path(), "tensor 'lm_head.weight' has shape " + shape_text(f.shape(it->first)) + ", expected " +
                             shape_text(want) + ", wte's (GPT-2 ties them)");
    }
    const TensorView head = f.view(it->first), wte = ck.weights.wte;
    const auto* a = static_cast<const std::byte*>(head.data);
    const auto* b = static_cast<const std::byte*>(wte.data);
    const int64_t sa = static_cast<int64_t>(size_of(head.dtype)), sb = static_cast<int64_t>(size_of(wte.dtype));
    const bool same = head.dtype == wte.dtype && std::memcmp(a, b, static_cast<size_t>(head.numel() * sa)) == 0;
    for (int64_t i = 0; !same && i < head.numel(); ++i) {
      if (f32_bits(a + i * sa, head.dtype) == f32_bits(b + i * sb, wte.dtype)) continue;
      bad_file(f.path(), "tensor 'lm_head.weight' differs from wte at [" + std::to_string(i / c.n_embd) + ", " +
                             std::to_string(i % c.n_embd) + "]; GPT-2 ties them, and gpt2attn computes with wte");
    }
  }

  // The checks GPT2Weights::validate makes (shapes, dtypes, and every element finite: one pass over each tensor),
  // each failure naming the file and the tensor as stored.
  check_weights(ck.weights, c, ErrorCode::bad_file, [&](const Param& p) {
    const std::string& stored = stored_of.at(p.name);
    return (*files)[file_of.at(stored)].path() + ": tensor '" + stored + "'";
  });
  ck.storage = files;
  return ck;
}

GPT2Checkpoint random_gpt2(const GPT2Config& c, uint64_t seed, DType dtype, int threads) {
  c.validate();
  if (threads < 1 || threads > max_threads()) {
    invalid("random_gpt2: threads must be 1 to " + std::to_string(max_threads()) + ", got " + std::to_string(threads));
  }
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16) {
    invalid(std::string("random_gpt2: dtype ") + to_string(dtype) + "; GPT-2 weights are f32, bf16 or f16");
  }
  auto buffers = std::make_shared<std::vector<std::unique_ptr<std::byte[]>>>();
  const float resid = 0.02f / std::sqrt(2.0f * static_cast<float>(c.n_layer));
  const auto ends_with = [](const std::string& s, const std::string& t) {
    return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
  };
  // Each tensor its own stream (a random start in splitmix64's sequence), so one tensor's numbers do not depend on
  // the others' sizes.
  uint64_t tensor = 0;
  const Fetch make = [&](const std::string& name, const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const size_t bytes = static_cast<size_t>(n) * size_of(dtype);
    std::unique_ptr<std::byte[]>* buf = nullptr;
    try {
      buf = &buffers->emplace_back(std::make_unique_for_overwrite<std::byte[]>(bytes));
    } catch (const std::bad_alloc&) {
      fail(ErrorCode::out_of_memory,
           "random_gpt2: cannot allocate " + std::to_string(bytes) + " bytes for '" + name + "'");
    }
    // GPT-2's initialization (transformers' GPT2PreTrainedModel._init_weights, as scripts/make_gpt2_checkpoint.py).
    const bool bias = ends_with(name, ".bias"),
               norm = name.rfind("ln_", 0) == 0 || name.find(".ln_") != std::string::npos;
    const bool residual = ends_with(name, "c_proj.weight");
    const float stddev = bias || norm ? 0.0f : residual ? resid : 0.02f;
    fill_tensor(buf->get(), dtype, n, bias ? 0.0f : 1.0f, stddev, mix(mix(seed) ^ tensor++), threads);
    return TensorView::contiguous(buf->get(), dtype, shape);
  };
  GPT2Checkpoint ck;
  ck.config = c;
  ck.weights = assemble(c, make);
  ck.storage = buffers;
  return ck;
}

}  // namespace gpt2attn
