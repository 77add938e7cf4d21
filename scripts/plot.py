#!/usr/bin/python3
"""Draws the benchmark's pictures from the JSON the tools print (Debian's python3-matplotlib; no network, no
display: the Agg backend writes PNG files).

    scripts/plot.py --out build/plots --bench bench.jsonl [--peak peak.jsonl] [--triad triad.jsonl]
                    [--peer peer.jsonl] [--peers peers.jsonl] [--gbench gbench.json]

Inputs, each optional and repeatable where it makes sense:
  --bench   `gpt2attn bench --json` lines, prefill and decode rows
  --peak    `bench/fma_peak_cli` lines ("op": "fma" and, with --op bf16dot, "bf16dot")
  --triad   `bench/stream_triad_cli` lines
  --peer    `bench/peer_torch.py --json` lines (our f32 and bf16 ms and PyTorch's, per preset and T)
  --peers   `bench/peers/run.py` lines (peers.jsonl: ours and PyTorch 2, ONNX Runtime, OpenVINO per case)
  --gbench  a Google Benchmark JSON file (`bench_gpt2attn --benchmark_format=json`): its layer and core rows
Outputs (each when its inputs are there), in --out:
  roofline.png             GFLOP/s against FLOPs per byte: the FMA (and bf16) peak and the triad bandwidth roofs,
                           and a line per bench series through its points (prefill: bytes = weights at 4 or 2
                           bytes by dtype + f32 input and output; decode: the bytes per step the row reports)
  ms_vs_t.png              prefill ms against T, ours beside PyTorch (--peer) and the Google Benchmark rows
  decode_tokens_per_s.png  decode tokens/s against the batch
  peers_speedup.png        --peers: per case, a bar per peer engine of its ms / ours (our speed over the peer's;
                           above 1: ours faster), log scale, whiskers from the rounds' lowest to highest ratio; a
                           peer that could not run the case (its row carries the error) is a grey cross at 1
  peers_roofline.png       --peers: every engine's cases on one roofline (GFLOP/s against FLOPs per byte moved, as
                           run.py counts them), a marker per engine, a colour per case kind, with the FMA peak and
                           triad roofs the same run measured at each thread count
  plots.json               per picture: its title, axis labels and legend entries, so that what a PNG shows can
                           be checked without looking at it
Each series is one (engine, preset, compute dtype, ISA, K/V dtype and heads, cache mode, threads): rows that differ
in any of these are never joined into one line. A row `gpt2attn bench` marked busy (its threads waited for a CPU)
is drawn hollow. Titles name the CPU and date the rows carry.
Prints the files written, one per line. Exit 2 on a file it cannot read, a line that is not JSON or a row without
the fields its series needs (NEEDS).
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
from matplotlib.ticker import LogFormatter, NullLocator, ScalarFormatter  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")
BUSY_NOTE = "hollow marker: a run gpt2attn bench marked busy (it waited for a CPU)"


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


# The fields a row's series and point are drawn from, by kind of row: a row without one (an older tool's) is
# refused, not guessed.
NEEDS = {"prefill": ("preset", "dtype", "isa", "threads", "batch", "seq", "median_ms", "gflops", "busy"),
         "decode": ("preset", "dtype", "isa", "threads", "batch", "seq", "median_ms", "gflops", "busy",
                    "kv_dtype", "cache", "tokens_per_s", "bytes_per_step"),
         "peer": ("preset", "seq", "threads", "allocator_headline", "ours_f32_ms", "ours_bf16_ms", "torch",
                  "torch_ms"),
         "peers": ("mode", "preset", "seq", "batch", "heads", "kv_heads", "dtype", "threads", "engine", "error",
                   "cpu", "timestamp")}


def rows_of(path, kinds):
    """The rows of the given kinds (a bench row's mode, or "peer") in a file, each checked against NEEDS."""
    rows = []
    for r in json_lines(path):
        # bench/peers/run.py's rows say "kind": "peers" (they carry a mode too); its header lines other kinds.
        kind = "peers" if r.get("kind") == "peers" else None if "kind" in r else \
            r.get("mode") or ("peer" if "torch_ms" in r else None)
        if kind in kinds:
            missing = [k for k in NEEDS[kind] if k not in r]
            if missing:
                raise InputError("%s: a %s row without %s (from an older version? run it again)"
                                 % (path, kind, ", ".join(missing)))
            rows.append(r)
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
        # Layer/P/..., Core/P/... (f32) and F32/layer/P/..., Bf16/core/P/...; other families time other things.
        m = re.match(r"((?:F32|Bf16)/layer|(?:F32|Bf16)/core|Layer|Core)/([\w.-]+)/T:(\d+)/threads:(\d+)",
                     b.get("name", ""))
        if not m:
            continue
        unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        rows.append({"family": m.group(1), "dtype": "bf16" if m.group(1).startswith("Bf16") else "f32",
                     "preset": m.group(2), "seq": int(m.group(3)), "threads": int(m.group(4)),
                     "ms": b["real_time"] * unit, "timestamp": doc.get("context", {}).get("date", "")})
    return rows


def nthreads(n):
    return "%d thread%s" % (n, "" if n == 1 else "s")


def case(r, *fields):
    """A bench row's series name: preset, compute dtype and ISA, the given fields, grouped K/V heads, threads."""
    E, H = preset_width(r["preset"])
    kvh = [] if r.get("kv_heads") in (None, H) else ["%d K/V heads" % r["kv_heads"]]
    return ", ".join(["%s %s %s" % (r["preset"], r["dtype"], r["isa"])] + list(fields) + kvh
                     + [nthreads(r["threads"])])


def decode_case(r):
    return case(r, "T=%d" % r["seq"], "%s K/V" % r["kv_dtype"], "%s cache" % r["cache"])


def machine(rows):
    """'CPU, date' from the rows that carry them, for a title: every CPU and the span of dates, never a guess."""
    cpus = sorted({r["cpu"] for r in rows if r.get("cpu")})
    dates = sorted({r["timestamp"][:10] for r in rows if r.get("timestamp")})
    date = (dates[0] if len(dates) == 1 else "%s to %s" % (dates[0], dates[-1])) if dates else "date not recorded"
    return "%s, %s" % (" / ".join(cpus) or "CPU not recorded", date)


def colours(n):
    # tab10 repeats after ten series; tab20 keeps up to twenty apart.
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def draw(ax, series, marker=lambda label: "o", dashed=lambda label: False):
    """A line per series (label -> [(x, y, busy)]) through its points in x order; busy points hollow."""
    busy = False
    for (label, pts), c in zip(sorted(series.items()), colours(len(series))):
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if dashed(label) else "-", color=c,
                marker=marker(label), markersize=5, label=label)
        hollow = [p for p in pts if p[2]]
        if hollow:  # drawn again over the filled markers, white inside
            busy = True
            ax.plot([p[0] for p in hollow], [p[1] for p in hollow], linestyle="none", marker=marker(label),
                    markersize=5, color=c, markerfacecolor="white")
    if busy:
        ax.plot([], [], linestyle="none", marker="o", color="gray", markerfacecolor="white", label=BUSY_NOTE)


def measured_ticks(ax, series):
    """x ticks at the measured T or B, y in plain numbers: "64" and "20" read at a glance, 2^6 and 2x10^1 do not."""
    ax.set_xticks(sorted({p[0] for pts in series.values() for p in pts}))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    if ax.get_yscale() == "log":
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def finish(fig, ax, out, name, xlabel, ylabel, title, index):
    """Labels, grid and legend (outside the axes, so it never covers a point); writes out/name, notes it in
    index, and returns the path."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    labels = ax.get_legend_handles_labels()[1]
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0,
              ncol=1 if len(labels) <= 30 else 2)
    path = os.path.join(out, name)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the box grows to hold the legend and the labels
    plt.close(fig)
    index[name] = {"title": title, "xlabel": xlabel, "ylabel": ylabel, "legend": labels}
    return path


def prefill_bytes(r):
    """Bytes a prefill call must move at least: the weights (4 bytes each in f32, 2 in bf16), the f32 input and
    output."""
    E, H = preset_width(r["preset"])
    if E is None:
        return None
    KW = r.get("kv_heads", H) * (E // H)
    B, T = r["batch"], r["seq"]
    return (2.0 if r["dtype"] == "bf16" else 4.0) * ((E + 2 * KW) * E + E * E) + 4.0 * 2 * B * T * E


def draw_roofs(ax, x, peaks, triads, threads):
    """The FMA (and bf16 dot) peak and triad roofs over the x range, a grey per thread count: the highest of the
    peak rows ({"threads", "gflops"[, "op"]}) and triad rows ({"threads", "gbps"}) at each count."""
    for n, grey in zip(threads, ("black", "dimgray", "darkgray", "silver") * len(threads)):
        for op, style, name in (("fma", "-", "fp32 FMA peak"), ("bf16dot", "--", "bf16 dot peak (vdpbf16ps)")):
            p = [q["gflops"] for q in peaks if q.get("op", "fma") == op and q["threads"] == n]
            if p:
                ax.plot(x, [max(p)] * 2, style, color=grey, label="%s, %s: %.0f GFLOP/s" % (name, nthreads(n), max(p)))
        t = [q["gbps"] for q in triads if q["threads"] == n]
        if t:
            ax.plot(x, [max(t) * xi for xi in x], ":", color=grey,
                    label="triad bandwidth, %s: %.0f GB/s" % (nthreads(n), max(t)))


def roofline(bench, peaks, triads, out, index):
    # A series per case; its points run along T (prefill) or B (decode), which the label lists, so that no point
    # needs a text of its own (the old per-point labels overlapped).
    series, swept = defaultdict(list), defaultdict(set)
    for r in bench:
        flops = r["gflops"] * 1e9 * r["median_ms"] * 1e-3
        if r["mode"] == "decode":
            nbytes, key, x = r["bytes_per_step"], ("decode " + decode_case(r), "B"), r["batch"]
        else:
            nbytes, key, x = prefill_bytes(r), ("prefill " + case(r, "B=%d" % r["batch"]), "T"), r["seq"]
        if nbytes:
            series[key].append((flops / nbytes, r["gflops"], r["busy"], r))
            swept[key].add(x)
    if not series or not (peaks or triads):
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [p[0] for pts in series.values() for p in pts]
    x = [min(xs) / 4, max(xs) * 4]
    draw_roofs(ax, x, peaks, triads, sorted({p[3]["threads"] for pts in series.values() for p in pts}))
    draw(ax, {"%s: %s=%s" % (k[0], k[1], ", ".join(map(str, sorted(swept[k])))): [p[:3] for p in v]
              for k, v in series.items()}, marker=lambda label: "o" if label.startswith("prefill") else "s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    return finish(fig, ax, out, "roofline.png", "arithmetic intensity (FLOP per byte moved)", "GFLOP/s (median run)",
                  "gpt2attn roofline\n%s" % machine(bench), index)


def ms_vs_t(bench, peer, gbench, out, index):
    series = defaultdict(list)  # label -> [(T, ms, busy)]
    for r in bench:
        if r["mode"] == "prefill":
            series["gpt2attn " + case(r, "B=%d" % r["batch"])].append((r["seq"], r["median_ms"], r["busy"]))
    for r in peer:
        # peer_torch.py times ours (f32, bf16) and PyTorch (fp32; bf16: the faster of its two paths) in one run.
        head, where = r["allocator_headline"], "%s, %s (peer_torch.py)" % (r["preset"], nthreads(r["threads"]))
        for label, ms in (("gpt2attn f32", r["ours_f32_ms"]), ("gpt2attn bf16", r["ours_bf16_ms"]),
                          ("PyTorch %s fp32" % r["torch"], r["torch_ms"]),
                          ("PyTorch %s bf16" % r["torch"], r["torch_bf16_best_ms_" + head])):
            series["%s %s" % (label, where)].append((r["seq"], ms, False))
    for r in gbench:
        series["bench_gpt2attn %s %s %s, %s" % (r["family"], r["preset"], r["dtype"], nthreads(r["threads"]))].append(
            (r["seq"], r["ms"], False))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    draw(ax, series, dashed=lambda label: label.startswith("PyTorch"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    measured_ticks(ax, series)
    return finish(fig, ax, out, "ms_vs_t.png", "T (tokens per sequence)", "ms per call (median run)",
                  "prefill: time per call against sequence length\n%s" % machine(bench + gbench), index)


def decode_tokens(bench, out, index):
    series = defaultdict(list)
    for r in bench:
        if r["mode"] == "decode":
            series[decode_case(r)].append((r["batch"], r["tokens_per_s"], r["busy"]))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    draw(ax, series)
    ax.set_xscale("log", base=2)
    measured_ticks(ax, series)
    return finish(fig, ax, out, "decode_tokens_per_s.png", "B (sequences per decode step)",
                  "tokens/s (B / median step time)", "decode throughput against batch\n%s" % machine(bench), index)


def peers_case(r):
    """A bench/peers/run.py case's name on the x axis: mode, preset, T (and B, grouped heads), dtype, threads."""
    what = "%s %s T=%d" % (r["mode"], r["preset"].replace("gpt2-", ""), r["seq"])
    if r["mode"] == "decode":
        what += " B=%d" % r["batch"]
    if r["kv_heads"] != r["heads"]:
        what += " kvh=%d" % r["kv_heads"]
    return "%s %s %dt" % (what, r["dtype"], r["threads"])


def peers_speedup(rows, out, index):
    peers = [r for r in rows if r["engine"] != "gpt2attn"]
    if not peers:
        return None
    cases = list(dict.fromkeys(peers_case(r) for r in peers))  # run order
    engines = list(dict.fromkeys(r["engine"] for r in peers))
    width = 0.8 / len(engines)
    # About a third of an inch per bar, between 8 and 20 inches wide (a full run has ~25 cases x 7 engines).
    fig, ax = plt.subplots(figsize=(min(20, max(8, 0.3 * len(cases) * len(engines) / 2)), 6))
    failed = False
    for i, (e, c) in enumerate(zip(engines, colours(len(engines)))):
        xs, ys, lo, hi, fx = [], [], [], [], []
        for r in peers:
            if r["engine"] != e:
                continue
            x = cases.index(peers_case(r)) - 0.4 + width * (i + 0.5)
            if r["error"]:
                fx.append(x)
                continue
            xs.append(x)
            ys.append(r["speedup"])
            lo.append(r["speedup"] - r.get("speedup_min", r["speedup"]))
            hi.append(r.get("speedup_max", r["speedup"]) - r["speedup"])
        ax.bar(xs, ys, width, color=c, label=e, yerr=[lo, hi], error_kw={"elinewidth": 0.8, "capsize": 1.5})
        if fx:
            failed = True
            ax.plot(fx, [1.0] * len(fx), linestyle="none", marker="x", color="grey")
    if failed:
        ax.plot([], [], linestyle="none", marker="x", color="grey", label="could not run (its row has the error)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.6, len(cases) - 0.4)
    return finish(fig, ax, out, "peers_speedup.png", "case (mode, preset, T, batch, K/V heads, dtype, threads)",
                  "peer ms / ours (above 1: ours faster)",
                  "gpt2attn against the peers at their best, same run\n%s" % machine(rows), index)


def peers_roofline(rows, runs, out, index):
    """Every engine's timed rows (those carrying flops and bytes) at their arithmetic intensity, with the roofs of the
    run header(s) in `runs`."""
    pts = [r for r in rows if r.get("gflops") and r.get("bytes")]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [r["flops"] / r["bytes"] for r in pts]
    x = [min(xs) / 3, max(xs) * 3]
    # The run headers' roofs ({"peak": {threads: GFLOP/s}, "triad": {threads: GB/s}}) as the probes' rows.
    peaks = [{"threads": int(n), "gflops": g} for h in runs for n, g in h.get("roofs", {}).get("peak", {}).items()]
    triads = [{"threads": int(n), "gbps": b} for h in runs for n, b in h.get("roofs", {}).get("triad", {}).items()]
    draw_roofs(ax, x, peaks, triads, sorted({q["threads"] for q in peaks + triads}))
    engines = list(dict.fromkeys(r["engine"] for r in pts))
    markers = dict(zip(engines, "o^svDP*XhpH<>"))
    kinds = list(dict.fromkeys("%s %s %dt" % (r["mode"], r["dtype"], r["threads"]) for r in pts))
    colour = dict(zip(kinds, colours(len(kinds))))
    for r in pts:
        k = "%s %s %dt" % (r["mode"], r["dtype"], r["threads"])
        ax.plot([r["flops"] / r["bytes"]], [r["gflops"]], linestyle="none", marker=markers[r["engine"]],
                color=colour[k], markersize=6, markerfacecolor="white" if r.get("busy") else colour[k])
    for e in engines:
        ax.plot([], [], linestyle="none", marker=markers[e], color="gray", label=e)
    for k in kinds:
        ax.plot([], [], linestyle="none", marker="s", color=colour[k], label=k)
    if any(r.get("busy") for r in pts):
        ax.plot([], [], linestyle="none", marker="o", color="gray", markerfacecolor="white", label=BUSY_NOTE)
    ax.set_xscale("log")
    ax.set_yscale("log")
    return finish(fig, ax, out, "peers_roofline.png", "arithmetic intensity (FLOP per byte the case must move)",
                  "GFLOP/s (median)", "every engine on the roofline, same run\n%s" % machine(pts), index)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    for name in ("bench", "peak", "triad", "peer", "peers", "gbench"):
        ap.add_argument("--" + name, action="append", default=[])
    a = ap.parse_args(argv)
    try:
        bench = [r for p in a.bench for r in rows_of(p, ("prefill", "decode"))]
        peaks = [r for p in a.peak for r in json_lines(p)]
        triads = [r for p in a.triad for r in json_lines(p)]
        peer = [r for p in a.peer for r in rows_of(p, ("peer",))]
        peers = [r for p in a.peers for r in rows_of(p, ("peers",))]
        peer_runs = [r for p in a.peers for r in json_lines(p) if r.get("kind") == "run"]
        gbench = [r for p in a.gbench for r in gbench_rows(p)]
    except InputError as e:
        print("plot.py: %s" % e, file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    index = {}
    written = [p for p in (roofline(bench, peaks, triads, a.out, index), ms_vs_t(bench, peer, gbench, a.out, index),
                           decode_tokens(bench, a.out, index), peers_speedup(peers, a.out, index),
                           peers_roofline(peers, peer_runs, a.out, index)) if p]
    if not written:
        print("plot.py: nothing to draw (no bench, peer, peers or Google Benchmark rows)", file=sys.stderr)
        return 2
    written.append(os.path.join(a.out, "plots.json"))
    with open(written[-1], "w") as f:
        json.dump(index, f, indent=1)
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
