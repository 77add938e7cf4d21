#!/usr/bin/python3
# bench/peer_torch.py: the peer comparison, measured in one run: PyTorch 1.13 and our layer (`gpt2attn bench`,
# f32 and bf16) on the same causal prefill case, interleaved per case, with our GFLOP/s as fractions of the
# FMA peak (f32) and the bf16 dot-product peak (bf16) measured by bench/fma_peak_cli. It does not compare
# outputs: the parity tests do.
#
#   /usr/bin/python3 bench/peer_torch.py [--preset P]... [--seq T] [--threads N] [--repeats R]
#                                        [--allocator tuned|default|both] [--cli build/gpt2attn]
#                                        [--peak-cli build/bench/fma_peak_cli] [--json]
#
# PyTorch runs three ways per case, each in its own child process: fp32 nn.MultiheadAttention, the same
# module in bf16, and bf16 through torch 1.13's private F._scaled_dot_product_attention between F.linear
# in/out projections (the whole layer, as ours is timed). Each child runs under each allocator asked for:
# "default" (glibc malloc) and "tuned" (jemalloc preloaded, keeping its pages: see TUNED_MALLOC_CONF). The
# tuned allocator gives the headline ratios.
#
# Children run with OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS set to the thread count as well
# as torch.set_num_threads(N): Debian's torch calls the system BLAS (OpenBLAS, pthread build), whose pool
# size torch.set_num_threads does not govern (peer_common.thread_env).
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from peer_common import ROOT, presets_table, run_json_lines, thread_env

DEFAULT_PRESETS = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"]
TORCH_PATHS = ["fp32", "bf16_mha", "bf16_sdpa"]  # worker paths; the bf16 ones are compared with ours in bf16
ALLOCATORS = ["tuned", "default"]  # in this order: the first one run is the headline
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
# retain: keep virtual memory mapped rather than unmapping it; decay -1: never purge dirty or muzzy pages back
# to the OS. A layer that allocates the same buffers every call then reuses faulted-in pages, as ours does.
TUNED_MALLOC_CONF = "retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1"


def layer_flops(E, T):
    # Causal attention counted once (the lower triangle), B = 1, d_in = E: as `gpt2attn bench` counts.
    return 2 * T * E * 3 * E + 2 * T * E * E + 4 * E * T * (T + 1) / 2


def torch_worker(E, H, T, threads, repeats, path):
    """Child process: times one PyTorch path on x (1, T, E), eval, no_grad, causal:
    fp32      nn.MultiheadAttention(E, H, batch_first=True), bool mask triu(ones(T, T), 1), need_weights=False
    bf16_mha  the same module .to(torch.bfloat16), bf16 input
    bf16_sdpa the bf16 module's weights through F.linear (QKV) -> F._scaled_dot_product_attention(q, k, v,
              None, 0.0, False, True) per head -> F.linear (output)"""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(1, T, E)
    mask = torch.triu(torch.ones(T, T), 1).bool()  # True = not allowed to attend
    if path != "fp32":
        mha = mha.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    if path == "bf16_sdpa":
        if not hasattr(F, "_scaled_dot_product_attention"):
            sys.exit(f"peer_torch: torch {torch.__version__} has no F._scaled_dot_product_attention")
        D = E // H
        w_in, b_in, w_out, b_out = mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias

        def step():
            q, k, v = (t.view(1, T, H, D).transpose(1, 2) for t in F.linear(x, w_in, b_in).split(E, dim=-1))
            # torch 1.13: (query, key, value, attn_mask, dropout_p, need_attn_weights, is_causal) -> (out, weights)
            o = F._scaled_dot_product_attention(q, k, v, None, 0.0, False, True)[0]
            return F.linear(o.transpose(1, 2).reshape(1, T, E), w_out, b_out)
    else:
        def step():
            return mha(x, x, x, attn_mask=mask, need_weights=False)[0]
    ms = []
    with torch.no_grad():
        for _ in range(2):  # warm-up
            step()
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            ms.append((time.perf_counter() - t0) * 1e3)
    with open("/proc/self/maps") as f:
        jemalloc = any("libjemalloc" in l for l in f)
    print(json.dumps({"median_ms": statistics.median(ms), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "jemalloc": jemalloc}))


def allocator_env(threads, allocator):
    env = thread_env(threads)
    for k in ("LD_PRELOAD", "MALLOC_CONF"):
        env.pop(k, None)
    if allocator == "tuned":
        env["LD_PRELOAD"] = JEMALLOC
        env["MALLOC_CONF"] = TUNED_MALLOC_CONF
    return env


def run_torch(E, H, T, threads, repeats, path, allocator):
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", str(E), str(H), str(T), str(threads),
           str(repeats), "--torch-path", path]
    p = subprocess.run(cmd, capture_output=True, text=True, env=allocator_env(threads, allocator))
    what = f"torch {path} ({allocator} allocator)"
    if p.returncode != 0:
        sys.exit(f"peer_torch: {what} failed ({p.returncode}):\n{p.stderr}")
    # jemalloc reports a bad MALLOC_CONF on stderr and goes on with its defaults; ld.so ignores a bad preload.
    if "<jemalloc>" in p.stderr or "LD_PRELOAD" in p.stderr:
        sys.exit(f"peer_torch: {what} did not get the allocator asked for:\n{p.stderr}")
    r = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")][0]
    if r["jemalloc"] != (allocator == "tuned"):
        sys.exit(f"peer_torch: {what}: jemalloc {'not ' if allocator == 'tuned' else ''}loaded in the child")
    return r


def measure_peaks(peak_cli, threads):
    """(FMA peak JSON, bf16-dot peak JSON or None), from fma_peak_cli at its default ISA (the best this CPU has;
    on an AVX512-BF16 CPU its f32 FMAs are avx512's)."""
    cmd = [peak_cli, "--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"peer_torch: no FMA peak measured: {' '.join(cmd)}: {p.stderr.strip()}")
    fma = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")][0]
    p = subprocess.run([peak_cli, "--threads", str(threads), "--op", "bf16dot"], capture_output=True, text=True)
    bf16 = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")][0] if p.returncode == 0 else None
    if bf16 is None:
        print(f"peer_torch: no bf16 dot peak on this CPU ({p.stderr.strip()}); bf16_peak_frac left out",
              file=sys.stderr)
    return fma, bf16


def ratio(num, den):
    return None if num is None or den is None else num / den


def main():
    ap = argparse.ArgumentParser(description="PyTorch (fp32 and bf16) vs gpt2attn (f32 and bf16), same run")
    ap.add_argument("--preset", action="append", help="repeatable; default gpt2-small..gpt2-xl")
    ap.add_argument("--seq", type=int, default=1024, help="T (default 1024)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per side, median reported (default 10)")
    ap.add_argument("--allocator", choices=["tuned", "default", "both"], default="both",
                    help="PyTorch's allocator: tuned (jemalloc, headline), default (glibc malloc) or both (default)")
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "gpt2attn"))
    ap.add_argument("--peak-cli", default=os.path.join(ROOT, "build", "bench", "fma_peak_cli"))
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of the table")
    ap.add_argument("--torch-worker", nargs=5, type=int, metavar=("E", "H", "T", "THREADS", "REPEATS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--torch-path", choices=TORCH_PATHS, default="fp32", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        torch_worker(*a.torch_worker, a.torch_path)
        return
    if a.seq < 1 or a.threads < 1 or a.repeats < 1:
        sys.exit("peer_torch: --seq, --threads and --repeats must be >= 1")
    allocs = [x for x in ALLOCATORS if a.allocator in (x, "both")]
    if "tuned" in allocs and not os.path.exists(JEMALLOC):
        sys.exit(f"peer_torch: the tuned allocator needs {JEMALLOC}: install the Debian package libjemalloc2 "
                 "(scripts/install-deps.sh), or run with --allocator default")
    head = allocs[0]

    shapes = presets_table(a.cli)
    presets = a.preset or DEFAULT_PRESETS
    for p in presets:
        if p not in shapes:
            sys.exit(f"peer_torch: unknown preset {p} (known: {', '.join(sorted(shapes))})")
    peak, bf16_peak = measure_peaks(a.peak_cli, a.threads)

    rows = []
    for p in presets:
        E, H = shapes[p]
        T, n = a.seq, a.threads
        tms = {}
        info = None
        for path in TORCH_PATHS:
            for al in allocs:
                info = run_torch(E, H, T, n, a.repeats, path, al)
                tms[(path, al)] = info["median_ms"]
        ours = {r["dtype"]: r for r in run_json_lines(
            [a.cli, "bench", "--preset", p, "--seq", str(T), "--threads", str(n), "--repeats", str(a.repeats),
             "--json", "--no-check", "--dtype", "f32", "--dtype", "bf16"], env=thread_env(n))}
        f32, bf = ours["f32"], ours["bf16"]
        row = {"preset": p, "seq": T, "threads": n, "allocator_headline": head,
               "ours_f32_ms": f32["median_ms"], "ours_bf16_ms": bf["median_ms"]}
        for al in allocs:
            for path in TORCH_PATHS:
                row[f"torch_{path}_ms_{al}"] = tms[(path, al)]
            best = min(tms[("bf16_mha", al)], tms[("bf16_sdpa", al)])
            row[f"torch_bf16_best_ms_{al}"] = best
            row[f"torch_bf16_best_path_{al}"] = "mha" if tms[("bf16_mha", al)] <= tms[("bf16_sdpa", al)] else "sdpa"
            # Speedups (PyTorch ms / ours ms): > 1 means ours is faster.
            row[f"bf16_vs_torch_bf16_{al}"] = best / bf["median_ms"]
            row[f"bf16_vs_torch_fp32_{al}"] = tms[("fp32", al)] / bf["median_ms"]
        row.update({
            "bf16_vs_torch_bf16": row[f"bf16_vs_torch_bf16_{head}"],
            "bf16_vs_torch_fp32": row[f"bf16_vs_torch_fp32_{head}"],
            "bf16_vs_f32": f32["median_ms"] / bf["median_ms"],
            # The earlier fields, for scripts/plot.py: fp32 PyTorch (headline allocator) against ours in f32.
            "torch_ms": tms[("fp32", head)], "ours_ms": f32["median_ms"],
            "speedup": tms[("fp32", head)] / f32["median_ms"],
            "torch_gflops": layer_flops(E, T) / (tms[("fp32", head)] * 1e6),
            "ours_gflops": f32["gflops"], "ours_bf16_gflops": bf["gflops"],
            "peak_gflops": peak["gflops"], "peak_frac": f32["gflops"] / peak["gflops"],
            "bf16_peak_gflops": bf16_peak["gflops"] if bf16_peak else None,
            "bf16_peak_frac": ratio(bf["gflops"], bf16_peak["gflops"] if bf16_peak else None),
            "isa": f32["isa"], "isa_bf16": bf["isa"], "implementation_f32": f32.get("implementation"),
            "implementation_bf16": bf.get("implementation"),
            "torch": info["torch"], "torch_threads": info["threads"],
        })
        rows.append(row)
        print("peer_torch: [%d/%d] %s T=%d: ours f32 %.2f ms, bf16 %.2f ms; torch (%s) fp32 %.2f ms, bf16 %.2f ms"
              % (len(rows), len(presets), p, T, row["ours_f32_ms"], row["ours_bf16_ms"], head, row["torch_ms"],
                 row[f"torch_bf16_best_ms_{head}"]), file=sys.stderr, flush=True)  # progress; stdout: the rows
        if a.json:
            print(json.dumps(row), flush=True)

    # Measured again at the end: a drop means other processes shared the cores during the run.
    peak_end, bf16_end = measure_peaks(a.peak_cli, a.threads)
    for name, first, last in (("FMA", peak, peak_end), ("bf16 dot", bf16_peak, bf16_end)):
        if first is None or last is None:
            continue
        if last["gflops"] < 0.9 * first["gflops"]:
            print(f"WARNING: the {name} peak fell from {first['gflops']:.1f} to {last['gflops']:.1f} GFLOP/s during "
                  "the run: other load? These timings are not worth quoting.", file=sys.stderr)
        elif last["gflops"] > 1.1 * first["gflops"]:
            print(f"WARNING: the {name} peak rose from {first['gflops']:.1f} to {last['gflops']:.1f} GFLOP/s: the "
                  "first measurement was disturbed; the table divides by the higher one.", file=sys.stderr)
    # The larger of the two measurements is the machine's peak: a disturbed one only lowers it.
    peak_max = max(peak["gflops"], peak_end["gflops"])
    bf16_max = max(bf16_peak["gflops"], bf16_end["gflops"]) if bf16_peak and bf16_end else None
    for r in rows:
        r["peak_gflops"] = peak_max
        r["peak_frac"] = r["ours_gflops"] / peak_max
        r["bf16_peak_gflops"] = bf16_max
        r["bf16_peak_frac"] = ratio(r["ours_bf16_gflops"], bf16_max)

    if not a.json:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        bf16_txt = (f"bf16 dot peak {bf16_peak['gflops']:.1f} (end {bf16_end['gflops']:.1f})" if bf16_peak and bf16_end
                    else "no bf16 dot peak")
        print(f"FMA peak ({peak['isa']}, {a.threads} thread(s)): {peak['gflops']:.1f} GFLOP/s (end "
              f"{peak_end['gflops']:.1f}), {bf16_txt}; the fractions divide by the higher of each pair. "
              f"torch {rows[0]['torch']} vs gpt2attn (f32 {rows[0]['isa']}, bf16 {rows[0]['isa_bf16']}); B=1, median of {a.repeats}; "
              f"allocators: {', '.join(allocs)} (headline {head})")
        print("times (ms): ours f32/bf16; torch fp32 = nn.MultiheadAttention, mha = the same in bf16, "
              "sdpa = bf16 F.linear + F._scaled_dot_product_attention; /tuned = jemalloc, /default = glibc")
        cols = [("ours_f32", "ours_f32_ms"), ("ours_bf16", "ours_bf16_ms")]
        for al in allocs:
            cols += [(f"fp32/{al}", f"torch_fp32_ms_{al}"), (f"mha/{al}", f"torch_bf16_mha_ms_{al}"),
                     (f"sdpa/{al}", f"torch_bf16_sdpa_ms_{al}")]
        print(f"{'preset':<12} {'T':>5} {'thr':>3} " + " ".join(f"{c:>{max(9, len(c))}}" for c, _ in cols))
        for r in rows:
            print(f"{r['preset']:<12} {r['seq']:>5} {r['threads']:>3} " +
                  " ".join(f"{r[k]:>{max(9, len(c))}.2f}" for c, k in cols))
        print("ratios: speedup = PyTorch ms / ours ms (> 1: ours faster); bf16 vs torch bf16 takes the faster "
              "of mha and sdpa (which one in brackets); bf16/f32 = ours f32 ms / ours bf16 ms; f32 frac = "
              "ours f32 GFLOP/s / FMA peak, bf16 frac = ours bf16 GFLOP/s / bf16 dot peak")
        rcols = [f"vs_bf16/{al}" for al in allocs] + [f"vs_fp32/{al}" for al in allocs]
        print(f"{'preset':<12} " + " ".join(f"{c:>18}" for c in rcols[:len(allocs)]) + " " +
              " ".join(f"{c:>15}" for c in rcols[len(allocs):]) +
              f" {'bf16/f32':>8} {'f32_GF/s':>8} {'bf16_GF/s':>9} {'f32_frac':>8} {'bf16_frac':>9}")
        for r in rows:
            vb = " ".join(f"{r[f'bf16_vs_torch_bf16_{al}']:>10.2f}x {'(' + r[f'torch_bf16_best_path_{al}'] + ')':>6}"
                          for al in allocs)
            vf = " ".join(f"{r[f'bf16_vs_torch_fp32_{al}']:>14.2f}x" for al in allocs)
            print(f"{r['preset']:<12} {vb} {vf} {r['bf16_vs_f32']:>7.2f}x {r['ours_gflops']:>8.1f} "
                  f"{r['ours_bf16_gflops']:>9.1f} {r['peak_frac']:>8.3f} {fmt(r['bf16_peak_frac'], '>9.3f')}")


if __name__ == "__main__":
    main()
