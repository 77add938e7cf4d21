// engine/io/safetensors_file.cpp: gpt2attn::SafetensorsFile, the public face of the strict reader (safetensors::map).
// Adds no check of its own but one: a name the file lacks is a bad file here, since its callers read names a
// checkpoint format requires.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/io/safetensors.hpp"
#include "gpt2attn/error.hpp"
#include "gpt2attn/safetensors.hpp"

namespace gpt2attn {

struct SafetensorsFile::Impl {
  safetensors::File file;

  const safetensors::Tensor& tensor(const std::string& name) const {
    const auto it = file.tensors.find(name);
    if (it == file.tensors.end()) fail(ErrorCode::bad_file, file.path + ": no tensor named '" + name + "'");
    return it->second;
  }
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  return SafetensorsFile(std::make_shared<const Impl>(Impl{safetensors::map(path)}));
}

const std::string& SafetensorsFile::path() const { return impl_->file.path; }

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> names;
  names.reserve(impl_->file.tensors.size());
  for (const auto& entry : impl_->file.tensors) names.push_back(entry.first);
  return names;
}

bool SafetensorsFile::has(const std::string& name) const { return impl_->file.has(name); }

std::string SafetensorsFile::dtype(const std::string& name) const { return impl_->tensor(name).dtype; }

std::vector<int64_t> SafetensorsFile::shape(const std::string& name) const { return impl_->tensor(name).shape; }

TensorView SafetensorsFile::view(const std::string& name) const {
  impl_->tensor(name);  // File::view says invalid_argument for a missing name: the caller's mistake, not the file's
  return impl_->file.view(name);
}

const std::map<std::string, std::string>& SafetensorsFile::metadata() const { return impl_->file.metadata; }

// The Impl holds the File, whose Bytes hold the mapping.
std::shared_ptr<const void> SafetensorsFile::storage() const { return impl_; }

}  // namespace gpt2attn
