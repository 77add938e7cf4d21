#!/usr/bin/env python3
"""The KV-cache decode table: K/V storage dtype x K/V heads x batch, in one run.

For each batch size and each of --rounds rounds, one `gpt2attn bench --mode decode --cache cold --interleave --json`
process holds every (kv_dtype, kv_heads) case and takes one step of each in turn, so that every case meets the same
minutes of a shared machine (whose speed drifts by more than the differences measured here); the STREAM triad is
measured before and after. Per case it prints the median ms per step (the median of the rounds' medians), tokens/s,
bytes per step, GB/s, the fraction of the triad (median of the start and end triads), the max error against the
naive reference (the first round checks), and the speedup over the f32 cache with as many K/V heads as query heads
at the same B: the median over the rounds of each round's x_first, itself the median of the step-by-step ratios.

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
    # The f32 cache with the most K/V heads first: each call's x_first is then the speedup over it.
    dtypes = sorted(a.kv_dtypes.split(","), key=lambda d: d != "f32")
    heads = sorted((int(h) for h in a.kv_heads.split(",")), reverse=True)
    order = [(d, h) for d in dtypes for h in heads]  # the CLI's row order: each --kv-dtype, each --kv-heads within
    cases = [(d, h, b) for b in batches for h in heads for d in dtypes]

    tri = [triad(a.triad_cli, a.threads)]
    times = {c: [] for c in cases}
    x_first = {c: [] for c in cases}
    first = {}
    done = 0
    for r in range(a.rounds):
        for b in batches:
            cmd = [a.cli, "bench", "--preset", a.preset, "--mode", "decode", "--cache", "cold", "--interleave",
                   "--json", "--seq", str(a.seq), "--batch", str(b), "--threads", str(a.threads),
                   "--repeats", str(a.repeats), "--check" if r == 0 else "--no-check"]
            for d in dtypes:
                cmd += ["--kv-dtype", d]
            for h in heads:
                cmd += ["--kv-heads", str(h)]
            rows = run_json(cmd)
            if len(rows) != len(order):
                raise SystemExit("decode_table: %d rows from %s, expected %d" % (len(rows), " ".join(cmd), len(order)))
            for (d, h), row in zip(order, rows):
                c = (d, h, b)
                times[c].append(row["median_ms"])
                x_first[c].append(row["x_first"])
                if r == 0:
                    first[c] = row
            done += 1  # progress on stderr; stdout carries the table (or the JSON) alone
            print("decode_table: [%d/%d] round %d B=%d: %s" % (
                done, a.rounds * len(batches), r + 1, b,
                ", ".join("%s/%d %.3f ms" % (d, h, row["median_ms"]) for (d, h), row in zip(order, rows))),
                file=sys.stderr, flush=True)
    tri.append(triad(a.triad_cli, a.threads))
    tri_gbps = statistics.median(tri)

    mha_f32_first = "f32" in dtypes  # then order[0] is the f32 cache with the most K/V heads
    results = []
    for c in cases:
        d, h, b = c
        ms = statistics.median(times[c])
        row = first[c]
        res = {"preset": a.preset, "seq": a.seq, "batch": b, "kv_dtype": d, "kv_heads": h, "threads": a.threads,
               "median_ms": ms, "tokens_per_s": b / (ms * 1e-3), "bytes_per_step": row["bytes_per_step"],
               "gb_per_s": row["bytes_per_step"] / (ms * 1e6), "triad_gb_per_s": tri_gbps,
               "max_abs_err": row.get("max_abs_err"), "check": row.get("check"), "rounds_ms": times[c],
               "rounds_x_f32_mha": x_first[c] if mha_f32_first else None}
        res["triad_fraction"] = res["gb_per_s"] / tri_gbps
        res["speedup_vs_f32_mha"] = statistics.median(x_first[c]) if mha_f32_first else None
        results.append(res)

    if a.json:
        for r in results:
            print(json.dumps(r))
        return
    print(f"{a.preset} T={a.seq} threads={a.threads} --cache cold --interleave; median of {a.rounds} rounds of "
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
