// tests/fuzz/no_presets.cpp: the fuzz build compiles engine/config.cpp without the preset table CMake generates for
// the library (tests/fuzz is configured before it); the targets never call preset(), so an empty table links it.
#include <string_view>
#include <utility>

namespace gpt2attn::detail {
extern const std::pair<std::string_view, std::string_view> kPresetJson[];
extern const int kPresetCount;
const std::pair<std::string_view, std::string_view> kPresetJson[] = {{"", ""}};
const int kPresetCount = 0;
}  // namespace gpt2attn::detail
