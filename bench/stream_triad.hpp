// bench/stream_triad.hpp: the machine's measured memory bandwidth, the denominator of the decode benchmarks'
// bw_frac: a STREAM-style triad a[i] = b[i] + s*c[i] over three float arrays far larger than any cache,
// measured in the same run as the benchmarks. Not a datasheet figure and not a model of the decode kernel.
#pragma once

#include <cstddef>

namespace gpt2attn::bench {

// Bytes counted per element: 12 (read b[i] and c[i], write a[i], 4 bytes each), STREAM's own convention.
// The write-allocate read of a[i] that ordinary stores cause (the line is fetched before it is written) is
// NOT counted, as STREAM does not count it; the decode benchmarks likewise count only the bytes their
// algorithm has to move (weights and K/V read), never cache-line side traffic, so the two are consistent.
inline constexpr double kTriadBytesPerElement = 12.0;

// GB/s (1e9 bytes) of `threads` OpenMP threads running the triad together over arrays of `array_bytes`
// each (default 64 MiB: 192 MiB in all, far beyond the last-level cache), each thread on its own static
// slice (first-touched by the same thread); the best of `trials` passes (other load only lowers a pass).
double stream_triad_gbps(int threads, size_t array_bytes = size_t{64} << 20, int trials = 10);

}  // namespace gpt2attn::bench
