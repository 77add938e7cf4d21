#!/usr/bin/env python3
"""The whole-model decode table: model x dtype x weights x batch, in one run, against the same run's STREAM triad.

Runs `gpt2attn bench --mode model --json` with the arguments given after `--` (e.g. --preset gpt2-small --preset
gpt2-medium --dtype f32 --dtype bf16 --weights-dtype compute --weights-dtype int8 --batch 1,16 --seq 128
--new-tokens 128 --threads 2), with the triad measured before and after. Per case it prints the decode step's median
ms, tokens/s, the bytes a step streams (every weight once in its format and every layer's K/V), GB/s, the fraction of
the triad (the mean of the two triads) and, for each batch past the first of a case, its tokens/s over the first
batch's.

Usage: bench/model_table.py [--cli build/gpt2attn] [--triad build/bench/stream_triad_cli] [--threads 2] [--json]
                            -- BENCH ARGS
"""
import argparse
import json
import statistics
import subprocess
import sys


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def triad(cli, threads):
    return run_json([cli, "--threads", str(threads), "--mib", "1024"])[-1]["gbps"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", default="build/gpt2attn")
    ap.add_argument("--triad", default="build/bench/stream_triad_cli")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="the rows as JSON lines, with the triad fields added")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the bench arguments")
    a = ap.parse_args(argv)
    bench_args = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    t0 = triad(a.triad, a.threads)
    rows = run_json([a.cli, "bench", "--mode", "model", "--json", "--threads", str(a.threads)] + bench_args)
    t1 = triad(a.triad, a.threads)
    bw = statistics.mean([t0, t1])
    first = {}
    for r in rows:
        key = (r["model"], r["dtype"], r["weights_dtype"], r["kv_dtype"])
        first.setdefault(key, r)
        r["triad_gbps"] = [t0, t1]
        r["triad_fraction"] = r["gbps"] / bw
        r["x_first_batch"] = r["tokens_per_s"] / first[key]["tokens_per_s"]
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    cpu = rows[0]["cpu"] if rows else "?"
    print(f"CPU: {cpu}; triad {t0:.1f} / {t1:.1f} GB/s (before / after); commit {rows[0]['commit'] if rows else '?'}")
    print("| model | dtype | weights | kv | B | prefill ms | step ms (min-max) | tokens/s | MB/step | GB/s | "
          "of triad | x B=first |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['dtype']} | {r['weights_dtype']} | {r['kv_dtype']} | {r['batch']} | "
              f"{r['prefill_ms']:.1f} | {r['step_median_ms']:.2f} ({r['step_min_ms']:.2f}-{r['step_max_ms']:.2f}) | "
              f"{r['tokens_per_s']:.1f} | {r['bytes_per_step'] / 1e6:.1f} | {r['gbps']:.1f} | "
              f"{r['triad_fraction']:.2f} | {r['x_first_batch']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
