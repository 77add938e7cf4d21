# bench/peers/worker_common.py: what every peer worker (torch2_worker.py, ort_worker.py, openvino_worker.py)
# shares: its command line, the case's inputs the driver wrote, and the protocol the driver speaks with it.
#
# A worker is a long-lived child of bench/peers/run.py, run by the peers venv's python (build/peers-venv), so that
# the driver can interleave it with our CLI round by round without paying the peer's import and graph build every
# round. The protocol, one JSON object per line on stdout:
#   1. the worker builds its layer from the driver's .npy files (the same weights and input as ours), runs it once,
#      writes the output to <dir>/out_<tag>.npy for the driver to check, and prints {"ready": true, "info": {...}}
#      (versions, the kernel it ran), or {"error": "..."} and exits 0 when the peer cannot run the case;
#   2. then, for each line "time K W" on stdin: W (0 or 1) untimed calls (as our CLI makes one per process), K
#      timed calls, and {"ms": [K times]}; "quit" or end of input ends it.
# Only numpy is needed here: each worker imports its own runtime.
import argparse
import json
import os
import sys
import time
import traceback

import numpy as np


def parse_args():
    ap = argparse.ArgumentParser(description="a peer worker of bench/peers/run.py (not meant to be run by hand)")
    ap.add_argument("--dir", required=True, help="folder with the case's .npy inputs (written by run.py)")
    ap.add_argument("--mode", choices=["prefill", "decode"], required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--dtype", required=True, help="fp32, bf16 or fp16 (what the peer computes in)")
    ap.add_argument("--variant", required=True, help="which of the worker's paths (e.g. sdpa, mha)")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--tag", required=True, help="names the output file out_<tag>.npy")
    return ap.parse_args()


def load_inputs(a):
    """The case's arrays, float32: w_in (E + 2KW, E) = [W_q; W_k; W_v] as torch stores in_proj_weight (y = x W^T
    + b), b_in, w_out (E, E), b_out; prefill: x (B, T, E); decode: x (B, 1, E), the new token of each sequence, and
    past_k, past_v (B, KVH, T, D), the keys and values of the T cached tokens."""
    names = ["w_in", "b_in", "w_out", "b_out", "x"] + (["past_k", "past_v"] if a.mode == "decode" else [])
    return {n: np.load(os.path.join(a.dir, n + ".npy")) for n in names}


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(build):
    """Runs the protocol. build(args, inputs) -> (call, output, info[, after]): call() runs one layer call (timed),
    output() gives the last call's result as a float32 array (B, T or 1, E) (not timed), info a dict for the row;
    after(), where given, runs untimed after every call (a stateful peer puts its K/V cache back to the T cached
    tokens there, as the others' calls leave theirs). An exception in build or in the first call becomes the row's
    error message."""
    a = parse_args()
    try:
        built = build(a, load_inputs(a))
        call, output, info = built[:3]
        after = built[3] if len(built) > 3 else (lambda: None)
        call()
        np.save(os.path.join(a.dir, "out_%s.npy" % a.tag), np.asarray(output(), dtype=np.float32))
        after()
    except Exception as e:  # noqa: BLE001 - any failure of the peer is reported as its row's message
        msg = "%s: %s" % (type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
        emit({"error": msg[:500]})
        traceback.print_exc(file=sys.stderr)
        return
    emit({"ready": True, "info": info})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] != "time" or len(cmd) != 3:
            emit({"error": "unknown command %r" % line.strip()})
            break
        for _ in range(int(cmd[2])):
            call()  # untimed, as our CLI's warm-up call in each of its processes
            after()
        ms = []
        for _ in range(int(cmd[1])):
            t0 = time.perf_counter()
            call()
            ms.append((time.perf_counter() - t0) * 1e3)
            after()
        emit({"ms": ms})
