#!/usr/bin/env python3
"""The KV-cache decode table: K/V storage dtype x K/V heads x batch, in one run.

Runs `gpt2attn bench --mode decode --cache cold --json` for every (kv_dtype, kv_heads, B) case, interleaved over
--rounds rounds (so a noisy neighbour hits every case alike), with the STREAM triad measured before and after, and
prints per case the median ms per step, tokens/s, bytes per step, GB/s, the fraction of the triad (median of the
start and end triads), the max error against the naive reference (the first round checks), and the speedup of
tokens/s over the f32 cache with as many K/V heads as query heads at the same B.

Usage: bench/decode_table.py [--preset gpt2-small] [--seq 1024] [--batches 1,16,64] [--kv-dtypes f32,bf16,int8]
                             [--kv-heads 12,4,1] [--threads 2] [--repeats 11] [--rounds 3] [--json]
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
    rows = run_json([cli, "--threads", str(threads)])
    return rows[-1]["gbps"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cli", default="build/gpt2attn")
    p.add_argument("--triad-cli", default="build/bench/stream_triad_cli")
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--kv-dtypes", default="f32,bf16,int8")
    p.add_argument("--kv-heads", default="12,4,1")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON line per case instead of the table")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    dtypes = a.kv_dtypes.split(",")
    heads = [int(h) for h in a.kv_heads.split(",")]
    cases = [(d, h, b) for b in batches for h in heads for d in dtypes]

    tri = [triad(a.triad_cli, a.threads)]
    times = {c: [] for c in cases}
    first = {}
    done = 0
    for r in range(a.rounds):
        for c in cases:
            d, h, b = c
            cmd = [a.cli, "bench", "--preset", a.preset, "--mode", "decode", "--cache", "cold", "--json",
                   "--seq", str(a.seq), "--batch", str(b), "--kv-dtype", d, "--kv-heads", str(h),
                   "--threads", str(a.threads), "--repeats", str(a.repeats), "--check" if r == 0 else "--no-check"]
            row = run_json(cmd)[0]
            times[c].append(row["median_ms"])
            if r == 0:
                first[c] = row
            done += 1  # progress on stderr; stdout carries the table (or the JSON) alone
            print("decode_table: [%d/%d] round %d %s K/V, %d K/V heads, B=%d: %.3f ms"
                  % (done, a.rounds * len(cases), r + 1, d, h, b, row["median_ms"]), file=sys.stderr, flush=True)
    tri.append(triad(a.triad_cli, a.threads))
    tri_gbps = statistics.median(tri)

    results = []
    for c in cases:
        d, h, b = c
        ms = statistics.median(times[c])
        row = first[c]
        res = {"preset": a.preset, "seq": a.seq, "batch": b, "kv_dtype": d, "kv_heads": h, "threads": a.threads,
               "median_ms": ms, "tokens_per_s": b / (ms * 1e-3), "bytes_per_step": row["bytes_per_step"],
               "gb_per_s": row["bytes_per_step"] / (ms * 1e6), "triad_gb_per_s": tri_gbps,
               "max_abs_err": row.get("max_abs_err"), "check": row.get("check"), "rounds_ms": times[c]}
        res["triad_fraction"] = res["gb_per_s"] / tri_gbps
        results.append(res)
    base = {(r["batch"]): r for r in results if r["kv_dtype"] == "f32" and r["kv_heads"] == max(heads)}
    for r in results:
        b = base.get(r["batch"])
        r["speedup_vs_f32_mha"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None

    if a.json:
        for r in results:
            print(json.dumps(r))
        return
    print(f"{a.preset} T={a.seq} threads={a.threads} --cache cold; median of {a.rounds} interleaved rounds of "
          f"{a.repeats} steps; triad {tri[0]:.1f} / {tri[1]:.1f} GB/s (start / end)")
    print("| kv | kv heads | B | ms/step | tokens/s | MB/step | GB/s | of triad | x f32 MHA | max err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        sp = f"{r['speedup_vs_f32_mha']:.2f}" if r["speedup_vs_f32_mha"] else "-"
        err = f"{r['max_abs_err']:.1e} {r['check']}" if r["max_abs_err"] is not None else "-"
        print(f"| {r['kv_dtype']} | {r['kv_heads']} | {r['batch']} | {r['median_ms']:.3f} | {r['tokens_per_s']:.0f} | "
              f"{r['bytes_per_step'] / 1e6:.1f} | {r['gb_per_s']:.1f} | {r['triad_fraction']:.2f} | {sp} | {err} |")


if __name__ == "__main__":
    sys.exit(main())
