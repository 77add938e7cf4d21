// engine/query_tiles.hpp: how the tiled attention kernel's work is cut into items and spread over the team, for the
// forward, extend and bench's Core alike. Orchestration only: the kernel computes, engine/team.hpp starts the team.
#pragma once

#include <cstdint>

#include "engine/team.hpp"
#include "kernels/attention.hpp"

namespace gpt2attn::detail {

// Runs the tiled kernel `kern` over (BH slices) x (query tiles of T rows, as many a call as the kernel asks for),
// taken dynamically slice by slice, each slice's longest (latest) tiles first; setup(args, bh) points args at slice
// bh's Q, K/V and output; thread t's scratch is scratch_base + t * scratch_stride. The forward, extend and bench's
// Core all run the core through here.
// Slice-major, so a slice's K and V stay in the threads' L2 from one query tile to the next: ordered tile-major
// (every slice's last tile, then every slice's tile before it) each item read its K/V from L3 or memory.
// Measured (Core, bench/ab.py, 3 rounds, medians): 2 threads, gpt2-small T=1024 7.37 -> 6.67 ms, T=4096 110 ->
// 102 ms, gpt2-xl T=4096 270 -> 199 ms. The causal triangle still balances: the last items are the last slice's
// shortest tiles.
template <class Setup>
void run_query_tiles(const kernels::AttentionKernel& kern, int64_t BH, int64_t T, const kernels::AttentionArgs& base,
                     float* scratch_base, int64_t scratch_stride, int threads, Setup&& setup) {
  const kernels::QueryItems q(kern, T, base.Tk, base.D);
  team_for(threads, BH * q.per_slice, [&](int64_t it, int thread) {
    const int64_t bh = it / q.per_slice, i = it % q.per_slice;
    kernels::AttentionArgs a = base;
    setup(a, bh);
    kern.run(a, q.row_begin(i), q.row_end(i), scratch_base + thread * scratch_stride);
  });
}

}  // namespace gpt2attn::detail
