// tests/fuzz/serial_team.cpp: the fuzz build compiles engine/convert.cpp, whose large conversions run on the engine's
// team (engine/team.hpp), without engine/team.cpp and its threads (this build has no threads and no OpenMP). Here a
// region runs every item in order on the calling thread, as team.cpp runs a region of one thread.
#include "engine/team.hpp"

namespace gpt2attn::detail {

int run_region(int, const RegionWork& work) {
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
