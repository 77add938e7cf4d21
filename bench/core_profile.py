#!/usr/bin/python3
"""bench/core_profile.py: where the attention core's cycles go, from a perf profile of bench_gpt2attn.

The core is two functions after inlining (TiledAttention::step, one query tile over one key tile, with its
micro-kernel, and TiledAttention::with_units, which packs the queries and writes the output of a group of tiles), so
perf's symbols cannot split it; this attributes each sampled instruction to a stage by its inline chain (addr2line -i)
in a build with debug info: the innermost frame that is a micro-kernel step (score_rows, pv_rows, pack_queries,
store_output) or exp2, else the source line of step() it sits on (the softmax's max, exponentials and sums, the
causal band).
It reads a profile; it does not run one. Usage (bench/README.md, "Where the core's cycles go"):

  cmake -S . -B /tmp/build-prof -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS=-g -DGPT2ATTN_BUILD_TESTS=OFF
  cmake --build /tmp/build-prof --target bench_gpt2attn -j2
  perf record -F 3999 -o core.data -- /tmp/build-prof/bench/bench_gpt2attn \\
      --benchmark_filter='^Core/gpt2-small/T:1024/threads:1/'
  bench/core_profile.py core.data /tmp/build-prof/bench/bench_gpt2attn
"""
import collections
import re
import subprocess
import sys

# Stage of a frame's function name, checked from the innermost frame outward.
STAGES = [
    ("score_rows", "Q.K^T score tile (score_rows)"),
    ("scores(", "Q.K^T score tile (score_rows)"),
    ("pv_rows", "P.V (pv_rows, with the alpha rescale of acc)"),
    ("accumulate_pv", "P.V (pv_rows, with the alpha rescale of acc)"),
    ("pack_queries", "query packing, transposed (pack_queries)"),
    ("store_output", "write-out, transposed, times 1/l (store_output)"),
    ("exp2", "softmax: exp2"),
]


def mapping(data, binary):
    """(start, pgoff) of the binary's executable mapping in the profile."""
    out = subprocess.run(["perf", "script", "-i", data, "--show-mmap-events"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "MMAP" in line and "r-xp" in line and line.rstrip().endswith(binary):
            m = re.search(r"\[(0x[0-9a-f]+)\((0x[0-9a-f]+)\) @ (0x[0-9a-f]+)", line)
            if m:
                return int(m.group(1), 16), int(m.group(3), 16)
    sys.exit(f"core_profile: no executable mapping of {binary} in {data}")


_sources = {}


def enclosing_function(loc):
    """The name of the function whose body holds file:line: the nearest `static ... name(` above it. Debug info
    sometimes names the caller (tile) for a loop inlined from a micro-kernel step; the source line still says which."""
    path, _, line = loc.partition(":")
    line = int(line.split(" ")[0]) if line.split(" ")[0].isdigit() else 0
    if path not in _sources:
        try:
            _sources[path] = open(path).read().splitlines()
        except OSError:
            _sources[path] = []
    for text in reversed(_sources[path][:line]):
        m = re.match(r"\s*static .*?(\w+)\(", text)
        if m:
            return m.group(1) + "("
    return ""


def stage_of(frames):
    for func, loc in frames:
        for name in (func, enclosing_function(loc)):
            for key, stage in STAGES:
                if key in name:
                    return stage
    for func, loc in frames:
        if "step<" in func or "group<" in func:
            return "softmax and masking in step(): " + loc.split("/")[-1].split(" ")[0]
    return "other: " + frames[0][0][:60]


# The core's functions as perf names them: which of them the compiler keeps out of line changes from build to build
# (step and with_units, or group and the micro-kernel's scores), so all are taken.
CORE = re.compile(r"TiledAttention<.*::(step|with_units|group)<|MicroF32<.*::(scores|pv_rows|score_rows)")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    data, binary = sys.argv[1], sys.argv[2]
    start, pgoff = mapping(data, binary)
    out = subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym"], capture_output=True, text=True).stdout
    ips = collections.Counter()
    all_samples = 0
    for line in out.splitlines():
        parts = line.split(None, 1)
        if len(parts) < 2:
            continue
        all_samples += 1
        if CORE.search(parts[1]):
            ips[int(parts[0], 16) - start + pgoff] += 1
    core = sum(ips.values())
    if core == 0:
        sys.exit("core_profile: no samples in the core (TiledAttention's step, group or with_units, MicroF32's steps)")
    stages = collections.Counter()
    for addr, n in ips.items():
        text = subprocess.run(["addr2line", "-i", "-f", "-C", "-e", binary, hex(addr)], capture_output=True,
                              text=True).stdout.split("\n")
        frames = [(text[i], text[i + 1]) for i in range(0, len(text) - 1, 2)]
        stages[stage_of(frames)] += n
    print(f"{core} samples in the core ({100.0 * core / all_samples:.1f}% of the profile)")
    for stage, n in stages.most_common():
        print(f"{100.0 * n / core:6.1f}%  {stage}")


if __name__ == "__main__":
    main()
