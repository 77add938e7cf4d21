// engine/team_serial.cpp: a region run on the calling thread alone (engine/team.hpp's run_serial), apart from the
// team's threads so that the fuzz build, which has no threads, runs convert.cpp's regions through the same code.
#include "engine/team.hpp"

namespace gpt2attn::detail {

int run_serial(const RegionWork& work) {
  if (work.each) {
    work.call(work.f, 0, 0, 0, 1);
    return 1;
  }
  for (int s = 0; s < work.stages; ++s) {
    for (int64_t i = 0; i < work.starts[s + 1] - work.starts[s]; ++i) work.call(work.f, s, i, 0, 1);
  }
  return 1;
}

}  // namespace gpt2attn::detail
