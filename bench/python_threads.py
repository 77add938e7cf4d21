#!/usr/bin/python3
"""What releasing the GIL buys: the same gpt2-small forward calls (layer threads=1, T=256, 5 calls per thread's
sequence) made by one Python thread one after the other, then by 4 Python threads with their own Workspace, in
rounds; prints both times and the speedup per round (bounded by the cores: about 2x on 2).

    PYTHONPATH=build/python OMP_NUM_THREADS=1 /usr/bin/python3 bench/python_threads.py [--rounds 3] [--threads 4]
"""
import argparse
import threading
import time

import numpy as np

import gpt2attn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    a = ap.parse_args()
    cfg = gpt2attn.preset("gpt2-small")
    layer = gpt2attn.CausalSelfAttention(cfg, gpt2attn.Weights.random(cfg, 0), threads=1)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, 256, 768)).astype(np.float32) for _ in range(a.threads)]
    workspaces = [gpt2attn.Workspace() for _ in range(a.threads)]

    def calls(x, ws):
        for _ in range(5):
            layer.forward(x, workspace=ws)

    for r in range(a.rounds):
        t0 = time.perf_counter()
        for x, ws in zip(xs, workspaces):
            calls(x, ws)
        one = time.perf_counter() - t0
        threads = [threading.Thread(target=calls, args=(x, ws)) for x, ws in zip(xs, workspaces)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        many = time.perf_counter() - t0
        print("round %d: 1 Python thread %.0f ms, %d Python threads %.0f ms, speedup %.2fx"
              % (r, one * 1e3, a.threads, many * 1e3, one / many), flush=True)


if __name__ == "__main__":
    main()
