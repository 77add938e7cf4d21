#!/usr/bin/python3
# bench/peer_torch_decode.py: the decode peer comparison, measured in one run: one decode step the way Hugging
# Face GPT-2's attention does it in PyTorch 1.13 eager (Conv1D addmm, concatenate onto past keys/values,
# attention, output projection) and our `gpt2attn bench --mode decode` on the same shapes, interleaved per
# case, with our bytes/s as a fraction of the STREAM-style triad bandwidth (bench/stream_triad_cli).
# It does not compare outputs: the parity tests do.
#
#   /usr/bin/python3 bench/peer_torch_decode.py [--preset P]... [--batch B]... [--seq T] [--threads N]
#       [--repeats R] [--cli build/gpt2attn] [--triad-cli build/bench/stream_triad_cli] [--json]
#
# Torch runs in a child process per case with torch.set_num_threads(N) and the BLAS thread variables set
# (peer_common.thread_env), as peer_torch.py does. Besides the HF step (torch_ms, the comparison) it times the
# same step with the two concatenations written into preallocated tensors (`torch.cat(..., out=)`,
# torch_prealloc_ms): HF's step allocates a fresh (B, H, T+1, D) key and value tensor every call, and where
# page faults are expensive (a VM) that allocation, not the arithmetic, can dominate torch's time. The second
# column shows how much of the speedup is that.
import argparse
import json
import os
import statistics
import sys
import time

from peer_common import ROOT, presets_table, run_json_lines, thread_env

WARMUP = 3


def torch_worker(E, H, B, T, threads, repeats):
    """Child process: times one HF GPT-2 attention step for B sequences with T cached tokens each.

    Mirrors transformers' GPT2Attention.forward with use_cache (eval, no_grad): x (B, 1, E);
    qkv = addmm(c_attn.bias, x.view(-1, E), c_attn.weight) with Conv1D's (E, 3E) weight; split into q, k, v;
    heads (B, H, 1, D); k, v concatenated onto past_key / past_value (B, H, T, D) (a new (B, H, T+1, D) tensor
    each step, as HF returns `present`); scores q k^T / sqrt(D), softmax, times v (no mask: the one new token
    sees every cached one); heads merged; addmm with c_proj. past is the same tensor every step, so each timed
    step has exactly T cached tokens."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    D = E // H
    c_attn_weight = torch.randn(E, 3 * E) * 0.02  # Conv1D: y = x @ W + b, W (in, out)
    c_attn_bias = torch.randn(3 * E) * 0.02
    c_proj_weight = torch.randn(E, E) * 0.02
    c_proj_bias = torch.randn(E) * 0.02
    past_key = torch.randn(B, H, T, D)
    past_value = torch.randn(B, H, T, D)
    x = torch.randn(B, 1, E)
    key_buf = torch.empty(B, H, T + 1, D)  # for the preallocated variant only
    value_buf = torch.empty(B, H, T + 1, D)

    def split_heads(t):  # (B, 1, E) -> (B, H, 1, D)
        return t.view(B, 1, H, D).permute(0, 2, 1, 3)

    def step(prealloc=False):
        qkv = torch.addmm(c_attn_bias, x.view(-1, E), c_attn_weight).view(B, 1, 3 * E)
        query, key, value = qkv.split(E, dim=2)
        query, key, value = split_heads(query), split_heads(key), split_heads(value)
        if prealloc:
            key = torch.cat((past_key, key), dim=-2, out=key_buf)
            value = torch.cat((past_value, value), dim=-2, out=value_buf)
        else:
            key = torch.cat((past_key, key), dim=-2)
            value = torch.cat((past_value, value), dim=-2)
        w = torch.matmul(query, key.transpose(-1, -2))
        w = w / torch.full([], value.size(-1) ** 0.5, dtype=w.dtype)
        w = torch.nn.functional.softmax(w, dim=-1)
        a = torch.matmul(w, value)
        a = a.permute(0, 2, 1, 3).contiguous().view(B, 1, E)
        return torch.addmm(c_proj_bias, a.view(-1, E), c_proj_weight).view(B, 1, E), key, value

    def median_ms(prealloc):
        ms = []
        for _ in range(WARMUP):
            step(prealloc)
        for _ in range(repeats):
            t0 = time.perf_counter()
            step(prealloc)
            ms.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ms)

    with torch.no_grad():
        hf = median_ms(False)
        prealloc = median_ms(True)
    print(json.dumps({"median_ms": hf, "prealloc_median_ms": prealloc, "torch": torch.__version__,
                      "threads": torch.get_num_threads()}))


def main():
    ap = argparse.ArgumentParser(description="PyTorch eager HF GPT-2 decode step vs gpt2attn, same run")
    ap.add_argument("--preset", action="append", help="repeatable; default gpt2-small")
    ap.add_argument("--batch", type=int, action="append", help="B, repeatable; default 1 and 16")
    ap.add_argument("--seq", type=int, default=1024, help="T cached tokens per sequence (default 1024)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    ap.add_argument("--repeats", type=int, default=20, help="timed steps per side, median reported (default 20)")
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "gpt2attn"))
    ap.add_argument("--triad-cli", default=os.path.join(ROOT, "build", "bench", "stream_triad_cli"))
    ap.add_argument("--json", action="store_true", help="one JSON object per case instead of the table")
    ap.add_argument("--torch-worker", nargs=6, type=int, metavar=("E", "H", "B", "T", "THREADS", "REPEATS"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_worker:
        torch_worker(*a.torch_worker)
        return
    batches = a.batch or [1, 16]
    if a.seq < 1 or a.threads < 1 or a.repeats < 1 or min(batches) < 1:
        sys.exit("peer_torch_decode: --batch, --seq, --threads and --repeats must be >= 1")

    shapes = presets_table(a.cli)
    presets = a.preset or ["gpt2-small"]
    for p in presets:
        if p not in shapes:
            sys.exit(f"peer_torch_decode: unknown preset {p} (known: {', '.join(sorted(shapes))})")
    triad = run_json_lines([a.triad_cli, "--threads", str(a.threads)])[0]["gbps"]

    rows = []
    for p in presets:
        E, H = shapes[p]
        for B in batches:
            T, n = a.seq, a.threads
            torch_r = run_json_lines([sys.executable, os.path.abspath(__file__), "--torch-worker", str(E), str(H),
                                      str(B), str(T), str(n), str(a.repeats)], env=thread_env(n))[0]
            ours = run_json_lines([a.cli, "bench", "--mode", "decode", "--preset", p, "--batch", str(B), "--seq",
                                   str(T), "--threads", str(n), "--repeats", str(a.repeats), "--json", "--no-check"],
                                  env=thread_env(n))[0]
            row = {
                "preset": p, "batch": B, "seq": T, "threads": n,
                "torch_ms": torch_r["median_ms"], "torch_prealloc_ms": torch_r["prealloc_median_ms"],
                "ours_ms": ours["median_ms"], "speedup": torch_r["median_ms"] / ours["median_ms"],
                "speedup_prealloc": torch_r["prealloc_median_ms"] / ours["median_ms"],
                "torch_tokens_per_s": B / (torch_r["median_ms"] * 1e-3),
                "ours_tokens_per_s": ours["tokens_per_s"], "ours_gb_per_s": ours["gb_per_s"],
                "bytes_per_step": ours["bytes_per_step"], "triad_gbps": triad, "bw_frac": ours["gb_per_s"] / triad,
                "isa": ours["isa"], "torch": torch_r["torch"], "torch_threads": torch_r["threads"],
            }
            rows.append(row)
            print("peer_torch_decode: [%d/%d] %s B=%d T=%d: torch %.3f ms, ours %.3f ms" % (
                len(rows), len(presets) * len(batches), p, B, T, row["torch_ms"], row["ours_ms"]),
                file=sys.stderr, flush=True)  # progress; stdout carries the rows
            if a.json:
                print(json.dumps(row), flush=True)

    # Measured again at the end: a drop means other processes shared the memory system during the run.
    triad_end = run_json_lines([a.triad_cli, "--threads", str(a.threads)])[0]["gbps"]
    if triad_end < 0.9 * triad:
        print(f"WARNING: the triad bandwidth fell from {triad:.1f} to {triad_end:.1f} GB/s during the run: "
              "other load? These timings are not worth quoting.", file=sys.stderr)

    if not a.json:
        print(f"triad ({a.threads} thread(s)): {triad:.1f} GB/s (at the end: {triad_end:.1f}); "
              f"torch {rows[0]['torch']} eager HF GPT-2 decode step vs gpt2attn decode ({rows[0]['isa']}); "
              f"median of {a.repeats} steps")
        print(f"{'preset':<12} {'B':>3} {'T':>5} {'threads':>7} {'torch_ms':>9} {'ours_ms':>9} {'speedup':>8} "
              f"{'ours_tok/s':>10} {'ours_GB/s':>9} {'triad_GB/s':>10} {'bw_frac':>7} "
              f"{'torch_prealloc_ms':>17} {'speedup_prealloc':>16}")
        for r in rows:
            print(f"{r['preset']:<12} {r['batch']:>3} {r['seq']:>5} {r['threads']:>7} {r['torch_ms']:>9.3f} "
                  f"{r['ours_ms']:>9.3f} {r['speedup']:>7.2f}x {r['ours_tokens_per_s']:>10.0f} "
                  f"{r['ours_gb_per_s']:>9.1f} {r['triad_gbps']:>10.1f} {r['bw_frac']:>7.3f} "
                  f"{r['torch_prealloc_ms']:>17.3f} {r['speedup_prealloc']:>15.2f}x")
    # tokens/s of each batch over the smallest batch's, per preset (batching's gain: the weights are read once
    # per step whatever B is).
    for p in presets:
        per_b = {r["batch"]: r["ours_tokens_per_s"] for r in rows if r["preset"] == p}
        b0 = min(per_b)
        for B in sorted(per_b):
            if B != b0:
                ratio = per_b[B] / per_b[b0]
                if a.json:
                    print(json.dumps({"preset": p, "seq": a.seq, "tokens_per_s_ratio": ratio, "batch": B,
                                      "over_batch": b0}))
                else:
                    print(f"{p}: tokens/s at B={B} / tokens/s at B={b0} = {ratio:.2f}")


if __name__ == "__main__":
    main()
