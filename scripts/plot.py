#!/usr/bin/python3
"""Draws the benchmark's pictures from the JSON the tools print (Debian's python3-matplotlib; no network, no
display: the Agg backend writes PNG files).

    scripts/plot.py --out build/plots --bench bench.jsonl [--peak peak.jsonl] [--triad triad.jsonl]
                    [--peer peer.jsonl] [--gbench gbench.json]

Inputs, each optional and repeatable where it makes sense:
  --bench   `gpt2attn bench --json` lines, prefill and decode rows
  --peak    `bench/fma_peak_cli` lines ("op": "fma" and, with --op bf16dot, "bf16dot")
  --triad   `bench/stream_triad_cli` lines
  --peer    `bench/peer_torch.py --json` lines (our and PyTorch's ms per preset and T)
  --gbench  a Google Benchmark JSON file (`bench_gpt2attn --benchmark_format=json`): its Layer/Core rows
Outputs (each when its inputs are there), in --out:
  roofline.png             GFLOP/s against FLOPs per byte: the FMA (and bf16) peak and the triad bandwidth roofs,
                           each bench row a point (prefill: bytes = weights + input + output, 4 bytes each; decode:
                           the bytes per step the row reports)
  ms_vs_t.png              prefill ms against T per preset, ours beside PyTorch (--peer) and the Google Benchmark rows
  decode_tokens_per_s.png  decode tokens/s against the batch, a line per (preset, T, K/V dtype, K/V heads)
Prints the files written, one per line. Exit 2 on a file it cannot read or a line that is not JSON.
"""
import argparse
import functools
import json
import os
import re
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")


@functools.lru_cache(maxsize=None)
def preset_width(name):
    """(E, H) of a preset, from configs/<name>.json (the files the library compiles in)."""
    try:
        with open(os.path.join(CONFIGS, name + ".json")) as f:
            c = json.load(f)
        return c["d_model"], c["num_heads"]
    except (OSError, KeyError, json.JSONDecodeError):
        return None, None


class InputError(Exception):
    pass


def json_lines(path):
    rows = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line.startswith("{"):
                    continue  # tables, blank lines
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError("%s:%d: not JSON: %s" % (path, n, e))
    except OSError as e:
        raise InputError("%s: %s" % (path, e.strerror))
    return rows


def gbench_rows(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InputError("%s: %s" % (path, e))
    benchmarks = doc.get("benchmarks", [])
    # With repetitions, the median aggregate; without, the single run.
    medians = [b for b in benchmarks if b.get("run_type") == "aggregate" and b.get("aggregate_name") == "median"]
    rows = []
    for b in medians or [b for b in benchmarks if b.get("run_type", "iteration") == "iteration"]:
        m = re.match(r"(\w+)/([\w.-]+)/T:(\d+)/threads:(\d+)", b.get("name", ""))
        if not m:
            continue
        unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        rows.append({"kind": m.group(1), "preset": m.group(2), "seq": int(m.group(3)), "threads": int(m.group(4)),
                     "ms": b["real_time"] * unit})
    return rows


def prefill_bytes(r):
    """Bytes a prefill call must move at least: the weights, the input and the output, 4 bytes each."""
    E, H = preset_width(r["preset"])
    if E is None:
        return None
    KW = r.get("kv_heads", H) * (E // H)
    B, T = r["batch"], r["seq"]
    return 4.0 * ((E + 2 * KW) * E + E * E + 2 * B * T * E)


def finish(fig, ax, out, name, xlabel, ylabel, title, legend_size=7, legend_loc="best"):
    """Labels, grid and legend of a figure, written to out/name; returns the path."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size, loc=legend_loc)
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def roofline(bench, peaks, triads, out):
    points = []
    for r in bench:
        flops = r["gflops"] * 1e9 * r["median_ms"] * 1e-3
        nbytes = r.get("bytes_per_step") if r["mode"] == "decode" else prefill_bytes(r)
        if nbytes:
            points.append((flops / nbytes, r["gflops"], r))
    if not points or not (peaks or triads):
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [p[0] for p in points]
    x = [min(xs) / 4, max(xs) * 4]
    threads = max(r["threads"] for _, _, r in points)
    for op, style, label in (("fma", "-", "fp32 FMA peak"), ("bf16dot", "--", "bf16 dot peak (vdpbf16ps)")):
        p = [q["gflops"] for q in peaks if q.get("op", "fma") == op and q["threads"] == threads]
        if p:
            ax.plot(x, [max(p)] * 2, style, color="black", label="%s, %d threads: %.0f GFLOP/s" % (label, threads,
                                                                                                 max(p)))
    t = [q["gbps"] for q in triads if q["threads"] == threads]
    if t:
        ax.plot(x, [max(t) * xi for xi in x], ":", color="gray",
                label="triad bandwidth, %d threads: %.0f GB/s" % (threads, max(t)))
    # Prefill points labelled by preset and T; decode points grouped by K/V dtype (one legend entry each),
    # labelled by their batch.
    groups = defaultdict(list)
    for p in points:
        r = p[2]
        groups["prefill" if r["mode"] == "prefill" else "decode, %s K/V" % r.get("kv_dtype", "f32")].append(p)
    for i, (label, sel) in enumerate(sorted(groups.items())):
        ax.scatter([p[0] for p in sel], [p[1] for p in sel], marker="o" if label == "prefill" else "s", label=label,
                   zorder=3)
        for j, (xi, yi, r) in enumerate(sel):
            text = ("%s T=%d" % (r["preset"].replace("gpt2-", ""), r["seq"]) if r["mode"] == "prefill"
                    else "B=%d" % r["batch"])
            ax.annotate(text, (xi, yi), fontsize=7, xytext=(4, -10 if j % 2 else 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    return finish(fig, ax, out, "roofline.png", "FLOPs per byte moved", "GFLOP/s", "gpt2attn on this machine: roofline",
                  legend_size=8, legend_loc="lower right")


def ms_vs_t(bench, peer, gbench, out):
    series = defaultdict(list)  # label -> [(T, ms)]
    for r in bench:
        if r["mode"] == "prefill":
            series["ours %s (gpt2attn bench, B=%d)" % (r["preset"], r["batch"])].append((r["seq"], r["median_ms"]))
    for r in peer:
        series["ours %s (peer run)" % r["preset"]].append((r["seq"], r["ours_ms"]))
        series["PyTorch %s" % r["preset"]].append((r["seq"], r["torch_ms"]))
    for r in gbench:
        series["%s %s (Google Benchmark, %d threads)" % (r["kind"], r["preset"], r["threads"])].append(
            (r["seq"], r["ms"]))
    series = {k: sorted(v) for k, v in series.items() if v}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for label, pts in sorted(series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if label.startswith("PyTorch") else "-",
                marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    return finish(fig, ax, out, "ms_vs_t.png", "T (tokens)", "ms per call", "prefill time against sequence length")


def decode_tokens(bench, out):
    series = defaultdict(list)
    for r in bench:
        if r["mode"] == "decode":
            key = "%s T=%d %s K/V, %d K/V heads" % (r["preset"], r["seq"], r.get("kv_dtype", "f32"),
                                                     r.get("kv_heads", 0))
            series[key].append((r["batch"], r["tokens_per_s"]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    return finish(fig, ax, out, "decode_tokens_per_s.png", "batch (sequences per decode step)", "tokens/s",
                  "decode throughput against batch")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    for name in ("bench", "peak", "triad", "peer", "gbench"):
        ap.add_argument("--" + name, action="append", default=[])
    a = ap.parse_args(argv)
    try:
        bench = [r for p in a.bench for r in json_lines(p) if r.get("mode") in ("prefill", "decode")]
        peaks = [r for p in a.peak for r in json_lines(p)]
        triads = [r for p in a.triad for r in json_lines(p)]
        peer = [r for p in a.peer for r in json_lines(p) if "torch_ms" in r]
        gbench = [r for p in a.gbench for r in gbench_rows(p)]
    except InputError as e:
        print("plot.py: %s" % e, file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    written = [p for p in (roofline(bench, peaks, triads, a.out), ms_vs_t(bench, peer, gbench, a.out),
                           decode_tokens(bench, a.out)) if p]
    if not written:
        print("plot.py: nothing to draw (no bench, peer or Google Benchmark rows)", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
