// tests/fuzz/serial_team.cpp: the fuzz build compiles engine/convert.cpp, whose large conversions run on the engine's
// team (engine/team.hpp), without engine/team.cpp and its threads (this build has no threads and no OpenMP). Here
// every region runs on the calling thread, as team.cpp runs a region of one thread (engine/team_serial.cpp).
#include "engine/team.hpp"

namespace gpt2attn::detail {

int run_region(int, const RegionWork& work) { return run_serial(work); }

}  // namespace gpt2attn::detail
