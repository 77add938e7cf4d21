#!/usr/bin/env python3
"""A/B: two builds, instruction sets or settings timed against each other, alternated round by round.

On a shared machine the speed drifts 5-10% from one minute to the next, more than most changes this project measures.
So each round runs side A and side B back to back, the order swapped every round (A B, B A, A B, ...). The tool
prints, per case, the median time of each side and the median of the per-round ratios B / A, with their range and
how many rounds B was faster. A change is worth quoting when the ratios' range lies on one side of 1.

Each side is a command line; the arguments after `--` are appended to both. Leading NAME=value words set
environment variables for that side. Both sides must print the same cases, either as `gpt2attn bench --json` rows
(the time is median_ms, or a model's step_median_ms) or as Google Benchmark JSON (`--benchmark_format=json`; the
time is the median aggregate's real_time, in ms).

Usage: bench/ab.py --a CMD --b CMD [--rounds 5] [--json] -- COMMON_ARGS...
  bench/ab.py --a /tmp/old/gpt2attn --b build/gpt2attn -- bench --preset gpt2-small --mode decode --cache cold --batch 16 --json
  bench/ab.py --a 'build/gpt2attn bench --isa avx512' --b 'build/gpt2attn bench --isa avx512_bf16' -- --dtype bf16 --json
  bench/ab.py --a 'GPT2ATTN_ISA=avx2 build/bench/bench_gpt2attn' --b 'GPT2ATTN_ISA=avx512 build/bench/bench_gpt2attn' \\
      -- --benchmark_filter='^Core/gpt2-small/T:1024/threads:2/' --benchmark_format=json
"""
import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys

_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
# The fields of a gpt2attn bench row that name its case; the others (isa, implementation, timings) may differ.
_CASE_FIELDS = ("preset", "model", "mode", "dtype", "weights_dtype", "kv_dtype", "kv_heads", "batch", "seq", "threads",
                "cache")


def split_side(cmd, common):
    """(argv, env, label) of one side: its words, NAME=value words first, then the common arguments; the label is
    the whole line as run, the assignments included."""
    words = shlex.split(cmd)
    env = dict(os.environ)
    assigns = []
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        assigns.append(words.pop(0))
        name, value = assigns[-1].split("=", 1)
        env[name] = value
    if not words:
        raise SystemExit(f"ab.py: side '{cmd}' has no command")
    argv = words + list(common)
    return argv, env, shlex.join(assigns + argv)


def parse_times(text):
    """{case: ms} from a command's standard output, in either format."""
    stripped = text.strip()
    if stripped.startswith("{") and '"benchmarks"' in stripped:
        doc = json.loads(stripped)
        times = {}
        for b in doc["benchmarks"]:
            if b.get("run_type") == "aggregate" and b.get("aggregate_name") == "median":
                times[b["run_name"]] = b["real_time"] * _UNIT_MS[b.get("time_unit", "ns")]
        return times
    times = {}
    for line in text.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            # A layer's row times its call (median_ms); a whole model's (--mode model), its decode step.
            key = "median_ms" if "median_ms" in row else "step_median_ms" if "step_median_ms" in row else None
            if key:
                case = " ".join(f"{k}={row[k]}" for k in _CASE_FIELDS if k in row)
                times[case] = row[key]
    return times


def run_side(argv, env):
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    times = parse_times(out)
    if not times:
        raise SystemExit(f"ab.py: '{shlex.join(argv)}' printed no timings (gpt2attn --json rows or Google Benchmark "
                         "JSON with median aggregates)")
    return times


def summarise(a_runs, b_runs):
    """Per case: A's and B's median ms, and the per-round ratios B / A (rounds where both sides have the case)."""
    cases = [c for c in a_runs[0] if all(c in r for r in a_runs + b_runs)]
    if not cases:
        raise SystemExit("ab.py: the two sides printed no case in common")
    rows = []
    for c in cases:
        a = [r[c] for r in a_runs]
        b = [r[c] for r in b_runs]
        ratios = [y / x for x, y in zip(a, b)]
        rows.append({"case": c, "a_ms": statistics.median(a), "b_ms": statistics.median(b),
                     "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "b_faster": sum(y < x for x, y in zip(a, b)), "rounds": len(ratios)})
    return rows


def main():
    argv = sys.argv[1:]
    common = []
    if "--" in argv:
        cut = argv.index("--")
        argv, common = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="side A's command line")
    p.add_argument("--b", required=True, help="side B's command line")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help="one JSON line per case instead of the table")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("ab.py: --rounds must be 1 or more")
    sides = {"A": split_side(args.a, common), "B": split_side(args.b, common)}
    runs = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("AB" if r % 2 == 0 else "BA"):
            runs[name].append(run_side(*sides[name][:2]))
            print(f"ab.py: round {r + 1}/{args.rounds} side {name} done", file=sys.stderr)
    rows = summarise(runs["A"], runs["B"])
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"A: {sides['A'][2]}\nB: {sides['B'][2]}\n"
          f"{args.rounds} rounds, order alternated; ratio = B / A per round (below 1: B faster)")
    print("| case | A ms | B ms | B / A (median) | range | B faster |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['case']} | {row['a_ms']:.4g} | {row['b_ms']:.4g} | {row['ratio']:.3f} | "
              f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f} | {row['b_faster']}/{row['rounds']} |")


if __name__ == "__main__":
    main()
