// tools/cli/presets.cpp: `gpt2attn presets`, the compiled-in presets as a table.
#include <cstdio>

#include "tools/cli/commands.hpp"

namespace gpt2attn::cli {

namespace {

int run_presets(const Args&) {
  std::printf("%-13s %8s %6s %5s %8s\n", "preset", "d_model", "heads", "D", "context");
  for (const auto& name : preset_names()) {
    const Config c = preset(name);
    std::printf("%-13s %8ld %6ld %5ld %8ld\n", name.c_str(), static_cast<long>(c.d_model),
                static_cast<long>(c.num_heads), static_cast<long>(c.head_dim()), static_cast<long>(c.context_length));
  }
  return 0;
}

}  // namespace

const Command& presets_command() {
  static const Command c{"presets", "lists the compiled-in presets.", {}, "", run_presets};
  return c;
}

}  // namespace gpt2attn::cli
