// tools/cli/layer_files.cpp: the checks forward and quantize apply alike to the files of one layer: an --output that
// would overwrite an input, and a --config (or preset) that disagrees with the weights' shapes. No reading or writing.
#include <sys/stat.h>

#include <string>
#include <utility>
#include <vector>

#include "tools/cli/commands.hpp"

namespace gpt2attn::cli {

// Device and inode decide, as the kernel sees the files, so a symbolic link, a hard link or another spelling of an
// input's path is caught; an output that does not exist yet cannot be an input (inputs must exist), and one that
// cannot be stat'ed is left to the write, which reports it.
void refuse_output_over_inputs(const std::string& output,
                               const std::vector<std::pair<const char*, std::string>>& inputs) {
  struct stat out {};
  if (::stat(output.c_str(), &out) != 0) return;
  for (const auto& [option, path] : inputs) {
    struct stat in {};
    if (path.empty() || ::stat(path.c_str(), &in) != 0) continue;
    if (in.st_dev == out.st_dev && in.st_ino == out.st_ino) {
      throw UsageError("--output " + output + " is the same file as --" + option + " " + path +
                       ": writing the result would replace that input; choose another output path");
    }
  }
}

// A config is never silently half-applied. (Its dropout is for training; neither command trains.)
void check_config_against_weights(const Config& said, const std::string& source, const Config& layer,
                                  const std::string& weights) {
  const auto yes_no = [](bool b) { return std::string(b ? "true" : "false"); };
  const std::pair<std::string, std::pair<std::string, std::string>> fields[] = {
      {"d_model", {std::to_string(said.d_model), std::to_string(layer.d_model)}},
      {"d_in", {std::to_string(said.query_width()), std::to_string(layer.query_width())}},
      {"kdim", {std::to_string(said.key_width()), std::to_string(layer.key_width())}},
      {"vdim", {std::to_string(said.value_width()), std::to_string(layer.value_width())}},
      {"qkv_bias", {yes_no(said.qkv_bias), yes_no(layer.qkv_bias)}},
      {"out_bias", {yes_no(said.out_bias), yes_no(layer.out_bias)}},
  };
  for (const auto& [name, says] : fields) {
    if (says.first != says.second) {
      invalid(source + " says " + name + " " + says.first + " but the weights in " + weights + " have " + name + " " +
              says.second);
    }
  }
}

}  // namespace gpt2attn::cli
