#!/usr/bin/env python3
"""The model runner against Hugging Face transformers' generate on the same checkpoint, in one run.

For each --dtype and --batch: transformers' GPT2LMHeadModel.generate (greedy, its KV cache, torch under jemalloc
keeping its pages, as bench/peer_torch.py tunes it; --threads intra-op threads) and `gpt2attn bench --mode model`,
each over B prompts of --seq ids and --new-tokens new tokens, alternating which goes first per round; ours keeps its
K/V in the compute type, as transformers' cache is in the model's dtype. Per side: the prefill (generate of one
token), the decode time per step ((all tokens - prefill) / (new - 1)), tokens/s = B / step; and ours over theirs.
transformers comes from a venv (tests/python/module/with_transformers.py makes build/venv-hf).

Usage: bench/peer_hf_generate.py --model DIR [--venv build/venv-hf] [--cli build/gpt2attn] [--batch 1,16]
                                 [--dtype f32,bf16] [--seq 128] [--new-tokens 128] [--threads 2] [--rounds 2] [--json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from peer_torch import JEMALLOC, allocator_env  # noqa: E402

WORKER = r"""
import json, sys, time, torch
from transformers import GPT2LMHeadModel
model_dir, dtype, B, T, N, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(threads)
model = GPT2LMHeadModel.from_pretrained(model_dir, torch_dtype={"f32": torch.float32, "bf16": torch.bfloat16}[dtype]).eval()
V = model.config.vocab_size
ids = torch.tensor([[(b * T + i) * 7919 % V for i in range(T)] for b in range(B)])
mask = torch.ones_like(ids)
def gen(n):
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             use_cache=True, pad_token_id=0)
    return (time.perf_counter() - t0) * 1e3, out
gen(2)  # warm-up
prefill, _ = gen(1)
total, out = gen(N)
step = (total - prefill) / (N - 1)
print(json.dumps({"prefill_ms": prefill, "step_ms": step, "tokens_per_s": B / (step * 1e-3),
                  "new_tokens": int(out.shape[1] - T), "torch": torch.__version__,
                  "transformers": __import__("transformers").__version__}))
"""


def hf(a, dtype, B):
    env = allocator_env(a.threads, "tuned" if os.path.exists(JEMALLOC) else "default")
    p = subprocess.run([os.path.join(a.venv, "bin", "python"), "-c", WORKER, a.model, dtype, str(B), str(a.seq),
                        str(a.new_tokens), str(a.threads)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"peer_hf_generate: transformers failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def ours(a, dtype, B):
    # K/V in the compute type, as transformers keeps its cache in the model's dtype.
    p = subprocess.run([a.cli, "bench", "--mode", "model", "--model", a.model, "--dtype", dtype, "--kv-dtype", dtype,
                        "--batch", str(B), "--seq", str(a.seq), "--new-tokens", str(a.new_tokens), "--threads",
                        str(a.threads), "--json"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"peer_hf_generate: gpt2attn failed:\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return {"prefill_ms": r["prefill_ms"], "step_ms": r["step_median_ms"], "tokens_per_s": r["tokens_per_s"],
            "cpu": r["cpu"], "commit": r["commit"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--venv", default="build/venv-hf")
    ap.add_argument("--cli", default="build/gpt2attn")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--dtype", default="f32,bf16")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    for dtype in a.dtype.split(","):
        for B in (int(b) for b in a.batch.split(",")):
            theirs_r, ours_r = [], []
            for k in range(a.rounds):
                for side in ((hf, theirs_r), (ours, ours_r))[:: 1 if k % 2 == 0 else -1]:
                    side[1].append(side[0](a, dtype, B))
            med = lambda rs, f: statistics.median(r[f] for r in rs)  # noqa: E731
            row = {"dtype": dtype, "batch": B, "seq": a.seq, "new_tokens": a.new_tokens, "threads": a.threads,
                   "ours_step_ms": med(ours_r, "step_ms"), "ours_prefill_ms": med(ours_r, "prefill_ms"),
                   "hf_step_ms": med(theirs_r, "step_ms"), "hf_prefill_ms": med(theirs_r, "prefill_ms"),
                   "ours_tokens_per_s": med(ours_r, "tokens_per_s"), "hf_tokens_per_s": med(theirs_r, "tokens_per_s"),
                   "cpu": ours_r[0]["cpu"], "commit": ours_r[0]["commit"], "transformers": theirs_r[0]["transformers"],
                   "torch": theirs_r[0]["torch"], "allocator": "jemalloc (tuned)" if os.path.exists(JEMALLOC) else "default"}
            row["x_hf"] = row["ours_tokens_per_s"] / row["hf_tokens_per_s"]
            rows.append(row)
            if a.json:
                print(json.dumps(row), flush=True)
    if not a.json:
        print(f"CPU: {rows[0]['cpu']}; commit {rows[0]['commit']}; transformers {rows[0]['transformers']}, torch "
              f"{rows[0]['torch']}, {rows[0]['allocator']}; {a.threads} threads; medians of {a.rounds} rounds")
        print("| dtype | B | ours prefill ms | ours ms/step | ours tokens/s | HF prefill ms | HF ms/step | HF tokens/s | x HF |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['dtype']} | {r['batch']} | {r['ours_prefill_ms']:.1f} | {r['ours_step_ms']:.2f} | "
                  f"{r['ours_tokens_per_s']:.1f} | {r['hf_prefill_ms']:.1f} | {r['hf_step_ms']:.2f} | "
                  f"{r['hf_tokens_per_s']:.1f} | {r['x_hf']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
