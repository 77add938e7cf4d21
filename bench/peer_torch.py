#!/usr/bin/python3
# bench/peer_torch.py: the peer comparison, measured in one run: PyTorch 1.13's nn.MultiheadAttention and our
# layer (`gpt2attn bench`) on the same causal prefill case, interleaved per case, with our GFLOP/s as a
# fraction of the FMA peak measured by bench/fma_peak_cli. It does not compare outputs: the parity tests do.
#
#   /usr/bin/python3 bench/peer_torch.py [--preset P]... [--seq T] [--threads N] [--repeats R]
#                                        [--cli build/gpt2attn] [--peak-cli build/bench/fma_peak_cli] [--json]
#
# Torch runs in a child process per case with OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS set
# to the thread count as well as torch.set_num_threads(N): Debian's torch calls the system BLAS
# (OpenBLAS, pthread build), whose pool size torch.set_num_threads does not govern (peer_common.thread_env).
import argparse
import json
import os
import statistics
import sys
import time

from peer_common import ROOT, presets_table, run_json_lines, thread_env

DEFAULT_PRESETS = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"]


def layer_flops(E, T):
    # Causal attention counted once (the lower triangle), B = 1, d_in = E: as `gpt2attn bench` counts.
    return 2 * T * E * 3 * E + 2 * T * E * E + 4 * E * T * (T + 1) / 2


def torch_worker(E, H, T, threads, repeats):
    """Child process: times torch.nn.MultiheadAttention(E, H, batch_first=True), eval, no_grad."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(1, T, E)
    mask = torch.triu(torch.ones(T, T), 1).bool()  # True = not allowed to attend
    ms = []
    with torch.no_grad():
        for _ in range(2):  # warm-up
            mha(x, x, x, attn_mask=mask, need_weights=False)
        for _ in range(repeats):
            t0 = time.perf_counter()
            mha(x, x, x, attn_mask=mask, need_weights=False)
            ms.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"median_ms": statistics.median(ms), "torch": torch.__version__,
                      "threads": torch.get_num_threads()}))


def main():
    ap = argparse.ArgumentParser(description="PyTorch nn.MultiheadAttention vs gpt2attn, same run")
    ap.add_argument("--preset", action="append", help="repeatable; default gpt2-small..gpt2-xl")
    ap.add_argument("--seq", type=int, default=1024, help="T (default 1024)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per side, median reported (default 10)")
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "gpt2attn"))
    ap.add_argument("--peak-cli", default=os.path.join(ROOT, "build", "bench", "fma_peak_cli"))
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of the table")
    ap.add_argument("--torch-worker", nargs=5, type=int, metavar=("E", "H", "T", "THREADS", "REPEATS"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        torch_worker(*a.torch_worker)
        return
    if a.seq < 1 or a.threads < 1 or a.repeats < 1:
        sys.exit("peer_torch: --seq, --threads and --repeats must be >= 1")

    shapes = presets_table(a.cli)
    presets = a.preset or DEFAULT_PRESETS
    for p in presets:
        if p not in shapes:
            sys.exit(f"peer_torch: unknown preset {p} (known: {', '.join(sorted(shapes))})")
    peak = run_json_lines([a.peak_cli, "--threads", str(a.threads)])[0]

    rows = []
    for p in presets:
        E, H = shapes[p]
        T, n = a.seq, a.threads
        torch_r = run_json_lines([sys.executable, os.path.abspath(__file__), "--torch-worker", str(E), str(H), str(T),
                                  str(n), str(a.repeats)], env=thread_env(n))[0]
        ours = run_json_lines([a.cli, "bench", "--preset", p, "--seq", str(T), "--threads", str(n), "--repeats",
                               str(a.repeats), "--json", "--no-check"], env=thread_env(n))[0]
        row = {
            "preset": p, "seq": T, "threads": n,
            "torch_ms": torch_r["median_ms"], "ours_ms": ours["median_ms"],
            "speedup": torch_r["median_ms"] / ours["median_ms"],
            "torch_gflops": layer_flops(E, T) / (torch_r["median_ms"] * 1e6),
            "ours_gflops": ours["gflops"], "peak_gflops": peak["gflops"],
            "peak_frac": ours["gflops"] / peak["gflops"], "isa": ours["isa"], "torch": torch_r["torch"], "torch_threads": torch_r["threads"],
        }
        rows.append(row)
        print("peer_torch: [%d/%d] %s T=%d: torch %.2f ms, ours %.2f ms" % (len(rows), len(presets), p, T,
              row["torch_ms"], row["ours_ms"]), file=sys.stderr, flush=True)  # progress; stdout carries the rows
        if a.json:
            print(json.dumps(row), flush=True)

    # Measured again at the end: a drop means other processes shared the cores during the run.
    peak_end = run_json_lines([a.peak_cli, "--threads", str(a.threads)])[0]["gflops"]
    if peak_end < 0.9 * peak["gflops"]:
        print(f"WARNING: the FMA peak fell from {peak['gflops']:.1f} to {peak_end:.1f} GFLOP/s during the run: "
              "other load? These timings are not worth quoting.", file=sys.stderr)
    elif peak_end > 1.1 * peak["gflops"]:
        print(f"WARNING: the FMA peak rose from {peak['gflops']:.1f} to {peak_end:.1f} GFLOP/s: the first measurement "
              "was disturbed; the table divides by the higher one.", file=sys.stderr)
    # The larger of the two measurements is the machine's peak: a disturbed one only lowers it.
    for r in rows:
        r["peak_gflops"] = max(peak["gflops"], peak_end)
        r["peak_frac"] = r["ours_gflops"] / r["peak_gflops"]

    if not a.json:
        print(f"FMA peak ({peak['isa']}, {a.threads} thread(s)): {peak['gflops']:.1f} GFLOP/s "
              f"(at the end: {peak_end:.1f}; peak_frac divides by the higher); "
              f"torch {rows[0]['torch']} nn.MultiheadAttention (need_weights=False) vs gpt2attn ({rows[0]['isa']}); "
              f"B=1, median of {a.repeats}")
        print(f"{'preset':<12} {'T':>5} {'threads':>7} {'torch_ms':>9} {'ours_ms':>9} {'speedup':>8} "
              f"{'torch_GF/s':>10} {'ours_GF/s':>9} {'peak_frac':>9}")
        for r in rows:
            print(f"{r['preset']:<12} {r['seq']:>5} {r['threads']:>7} {r['torch_ms']:>9.2f} {r['ours_ms']:>9.2f} "
                  f"{r['speedup']:>7.2f}x {r['torch_gflops']:>10.1f} {r['ours_gflops']:>9.1f} {r['peak_frac']:>9.3f}")


if __name__ == "__main__":
    main()
