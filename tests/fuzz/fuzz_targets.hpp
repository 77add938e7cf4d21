// tests/fuzz/fuzz_targets.hpp: the fuzz harnesses of the file parsers, one function per target, shared by the
// libFuzzer binaries (libfuzzer_main.cpp, the `fuzz` preset) and the normal suite (tests/test_fuzz_regressions.cpp),
// plus the one policy they apply to what the library throws. Harnesses only; no parser code lives here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpt2attn/error.hpp"

namespace gpt2attn::fuzz {

// Each takes one input and returns 0 (libFuzzer's convention). A documented gpt2attn::Error is an expected outcome
// and is caught; anything else escapes: a Finding (a harness check failed), another exception type (std::bad_alloc,
// a nlohmann exception), an Error with a code the call does not document, or a sanitizer report.
int fuzz_safetensors(const uint8_t* data, size_t size);  // safetensors::parse, then view() and to_f32() of each tensor
int fuzz_npy(const uint8_t* data, size_t size);          // npy::parse
int fuzz_config(const uint8_t* data, size_t size);       // our config JSON and Hugging Face GPT-2 config.json
int fuzz_layer(const uint8_t* data, size_t size);        // the layer loader, both namings, several prefixes
int fuzz_quantized(const uint8_t* data, size_t size);    // load_quantized's checks, under configs from the file

// Inputs past this are skipped: everything the parsers allocate is bounded by a small multiple of the input size,
// so this bounds the harnesses' memory (scripts/fuzz.sh caps inputs at 64 KiB anyway).
inline constexpr size_t kMaxInput = size_t{1} << 20;

// A harness's own check failed. Thrown rather than abort()ed so that the normal suite reports it as a failure naming
// the input; under libFuzzer it escapes LLVMFuzzerTestOneInput and is reported as a crash with this message.
class Finding : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

[[noreturn]] inline void finding(const std::string& what) { throw Finding("fuzz finding: " + what); }
inline void check(bool ok, const std::string& what) {
  if (!ok) finding(what);
}

// Runs f(); true when it returned. An Error whose code is in `allowed` is an expected refusal (false); a bad_file
// message must name the file (start with "<path>: "). Any other Error is a finding; other exceptions pass through.
template <class F>
bool returns(std::initializer_list<ErrorCode> allowed, const std::string& path, F&& f) {
  try {
    f();
    return true;
  } catch (const Error& e) {
    bool ok = false;
    for (ErrorCode c : allowed) ok = ok || e.code() == c;
    check(ok, "undocumented error code " + std::to_string(static_cast<int>(e.code())) + ": " + e.what());
    if (e.code() == ErrorCode::bad_file)
      check(std::string(e.what()).rfind(path + ": ", 0) == 0,
            std::string("bad_file message does not name the file: ") + e.what());
    return false;
  }
}

// Float vectors compared bit for bit: exactness is the contract, and NaN payloads must survive too.
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

}  // namespace gpt2attn::fuzz
