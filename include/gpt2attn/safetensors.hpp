// gpt2attn/safetensors.hpp: a safetensors file opened for reading, mapped, as views of its tensors: what a program over
// the public API (the model library, a user's own loader) reads checkpoints with. The format's checks are the
// library's strict reader's; mapping tensor names to a model is the caller's.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpt2attn/export.h"
#include "gpt2attn/tensor.hpp"

namespace gpt2attn {

// A safetensors file mapped read-only: only the pages a caller reads are read from disk. Copies share the mapping.
// The file must not shrink while a copy lives (a read past its new end raises SIGBUS, as with any mapped file).
class GPT2ATTN_API SafetensorsFile {
 public:
  // Checks the whole header before any tensor is trusted: the header length, JSON with no key given twice, each
  // entry's dtype, shape and data_offsets, and offsets that tile the data section exactly (no overlap, gap or
  // trailing bytes; a file cut short names the tensor it ends in). Error(bad_file) naming the path otherwise, and
  // for a path that is missing or not a regular file.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const;
  std::vector<std::string> names() const;  // every tensor, sorted; "__metadata__" is not one
  bool has(const std::string& name) const;
  // As the header gives them: "F32", "F16", "BF16", "I64", ... and the shape at any rank. Error(bad_file) naming the
  // file and the tensor for a name the file lacks (has() asks without throwing).
  std::string dtype(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  // A contiguous view of the tensor's bytes as stored (F32, F16 or BF16; not necessarily aligned), valid while a
  // copy of this file or storage() lives. Error(bad_file) naming the file and the tensor for a name the file lacks,
  // another dtype, or a rank past TensorView's 4.
  TensorView view(const std::string& name) const;
  // The header's "__metadata__" string pairs ({"format": "pt"}); empty without one.
  const std::map<std::string, std::string>& metadata() const;
  // Keeps the mapping alive: hold it where views outlive the SafetensorsFile.
  std::shared_ptr<const void> storage() const;

 private:
  struct GPT2ATTN_LOCAL Impl;  // engine/io/safetensors_file.cpp
  explicit SafetensorsFile(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace gpt2attn
