// gpt2attn/error.hpp: the one exception type the library throws, with a code the C API maps to status.
// Every message names the offending argument, field, file or tensor (but one: an out-of-memory error raised where
// the heap cannot spare even its message, "gpt2attn: out of memory (too little left to name the call)"); nothing is
// thrown across the C API.
#pragma once

#include <stdexcept>
#include <string>

#include "gpt2attn/export.h"

namespace gpt2attn {

enum class ErrorCode : int {
  invalid_argument = 1,  // a config field, shape, option or value the caller passed is wrong
  bad_file = 2,          // a weights/npy/json file is missing, truncated, corrupt or inconsistent
  out_of_memory = 3,     // an allocation or the KV pool was exhausted; nothing was written (a size whose byte
                         // count overflows int64 is invalid_argument: no machine could hold it)
  internal = 4,          // a bug or an unexpected failure inside a dependency (oneDNN)
};

class GPT2ATTN_API Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

[[noreturn]] inline void fail(ErrorCode code, const std::string& what) { throw Error(code, what); }
[[noreturn]] inline void invalid(const std::string& what) { throw Error(ErrorCode::invalid_argument, what); }

}  // namespace gpt2attn
