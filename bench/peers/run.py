#!/usr/bin/python3
# bench/peers/run.py: our layer against the other CPU engines at their best, side by side in one run: PyTorch 2
# (F.scaled_dot_product_attention between F.linear, and nn.MultiheadAttention), ONNX Runtime (MatMul projections
# around com.microsoft.MultiHeadAttention or GroupQueryAttention), OpenVINO (an opset13
# ScaledDotProductAttention layer) and llama.cpp (a one-block GGUF), on GPT-2 prefill and decode cases.
#
#   /usr/bin/python3 bench/peers/run.py [--quick] [--threads N] [--rounds R] [--out DIR] [--cli build/gpt2attn]
#                                       [--python build/peers-venv/bin/python] [--only ENGINE ...]
#                                       [--mode prefill|decode]
#
# Runs under Debian's python3 (numpy only). Each peer runs in a worker process under the peers venv's python
# (scripts/bench.sh --peers makes it; bench/peers/requirements.txt pins it); ours runs through our CLI
# (`gpt2attn bench --json`). For each case:
#   1. the driver draws the weights and the input with numpy and computes the layer in float64 (the reference);
#      ours (`gpt2attn forward` on the same weights, written as safetensors) and every peer run on them once and
#      are checked against it: max |out - ref| / max |ref| within 1e-4 (fp32) or 3e-2 (bf16, fp16). A peer that
#      fails to build, to run or to match gets a row carrying the error and is not timed.
#   2. rounds: ours (a `gpt2attn bench` process: a warm-up call, then K timed calls) and each peer (the worker's
#      warm-up call, dropped for calls over a second, then K timed calls), one after the other, the order
#      reversed every other round (A B C, C B A, ...), so that all engines meet the same minutes of the machine.
#      The first round takes one timed call each; later rounds take as many as fit in --budget-ms per engine (at
#      most 200). Decode cases take --decode-rounds rounds (default 9), prefill --rounds (default 3): a decode call
#      is under a few milliseconds, and on a shared 2-vCPU VM its rounds varied 2-3x (gpt2-small B=1, 2 threads:
#      ours 0.37-0.89 ms, ORT 0.51-1.14 ms over 3 rounds), a prefill call's rounds about 1.3x. Each round gives
#      each engine the median of its calls; a row reports the median of its rounds'
#      medians, their min and max, and the speedup = the peer's ms / ours (> 1: ours faster), with the min and max
#      of the per-round speedups.
# Prefill cases compare ours in f32 with the peers in fp32, ours in bf16 compute with the peers in bf16 (and ORT in
# fp16, its only half type with CPU kernels); decode cases time ours with each K/V cache storage (f32, bf16, int8,
# fp8 for f32 compute; bf16 for bf16 compute) and divide the peers' times by ours with the f32 cache (bf16 for bf16).
# PyTorch runs under the tuned jemalloc set-up of bench/peer_torch.py (the allocator it is fastest with); every
# engine runs at the same thread count: ours --threads N, torch set_num_threads(N) and OMP_NUM_THREADS, ORT
# intra_op_num_threads, OpenVINO INFERENCE_NUM_THREADS.
#
# The same run measures the machine's roofs at its start, and again at its end to show any drift (bench/stream_triad_cli
# and bench/fma_peak_cli, at each of the run's thread counts): every row carries its case's FLOPs and the bytes it must
# move at least (the weights in the engine's type, the K/V cache in its type for decode, the f32 input and output),
# and with them its fraction of the FMA peak (prefill) or of the triad bound, bytes / triad bandwidth (decode).
# Output in DIR (default build/peers): peers.jsonl, a header line ("kind": "run": machine, date, commit, command,
# versions, the roofs) and one line per (case, engine) ("kind": "peers"); table.md, the table of the run; logs/, each
# worker's stderr. scripts/plot.py --peers DIR/peers.jsonl draws the speedups and a roofline of every engine.
import argparse
import json
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: the peer scripts' shared set-up
from peer_common import presets_table, thread_env  # noqa: E402
from peer_torch import JEMALLOC, allocator_env  # noqa: E402

TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 3e-2}
PRESETS = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"]
MAX_CALLS = 200
WARMUP_MS = 1000.0  # a peer whose call takes longer skips the per-round warm-up call (see Peer.time)
PAUSE_S = 0.1  # between engines: lets the last one's idle worker threads stop spinning before the next is timed

# (engine, worker file, variant, {case dtype: the dtype the peer computes in}[, the modes it runs; default both]).
# The ORT fp16 row sits in the bf16 cases: half precision is what both stand for, and ORT's CPU provider has no bf16
# MultiHeadAttention (the bf16 ort-mha row records its error). ort-gqa is GroupQueryAttention: grouped K/V heads and a shared-buffer K/V cache.
PEERS = [
    ("torch-sdpa", "torch2_worker.py", "sdpa", {"fp32": "fp32", "bf16": "bf16"}),
    # nn.MultiheadAttention in fp32 only: in bf16 it runs the same kernels as torch-sdpa (it calls F.linear and
    # the flash SDPA kernel, as the profiler's op names in its fp32 rows show), at the run's slowest speed.
    ("torch-mha", "torch2_worker.py", "mha", {"fp32": "fp32"}),
    ("ort-mha", "ort_worker.py", "mha", {"fp32": "fp32", "bf16": "bf16"}),
    ("ort-mha-fp16", "ort_worker.py", "mha", {"bf16": "fp16"}),
    ("ort-gqa", "ort_worker.py", "gqa", {"fp32": "fp32"}),
    ("ort-gqa-fp16", "ort_worker.py", "gqa", {"bf16": "fp16"}),
    ("openvino-sdpa", "openvino_worker.py", "sdpa", {"fp32": "fp32", "bf16": "bf16"}),
    # OpenVINO's decode with the K/V cache as model state (ReadValue/Assign), the form its CPU plugin can append to in
    # place (on the Zen 3 VM it concatenated instead: each row records the runtime graph).
    ("openvino-stateful", "openvino_worker.py", "stateful", {"fp32": "fp32", "bf16": "bf16"}, ("decode",)),
    # llama.cpp: our layer as a one-block GGUF fed embeddings (llamacpp_worker.py says how, and what it returns).
    ("llamacpp", "llamacpp_worker.py", "gguf", {"fp32": "fp32", "bf16": "bf16"}),
]


def log(msg):
    print("peers: " + msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- the cases

def cases(quick, threads):
    """[(geometry, [(dtype, [thread counts])])]: a geometry is (mode, preset, T, B, kv_heads or None for all
    heads). With --threads, every case runs at those counts. Otherwise every case at 2 threads and, at 1 thread,
    gpt2-small's prefill at T = 1024 and its fp32 decode: the larger presets and T = 4096 at 1 thread would double
    the run (to over an hour on 2 cores) for the same ordering."""
    def at(one):
        return threads or ([2, 1] if one else [2])
    if quick:
        return [(("prefill", "gpt2-small", 64, 1, None), [("fp32", threads or [2]), ("bf16", threads or [2])]),
                (("decode", "gpt2-small", 64, 2, None), [("fp32", threads or [2]), ("bf16", threads or [2])]),
                (("decode", "gpt2-small", 64, 2, 4), [("fp32", threads or [2])])]
    out = [(("prefill", p, 1024, 1, None), [("fp32", at(p == "gpt2-small")), ("bf16", at(p == "gpt2-small"))])
           for p in PRESETS]
    out.append((("prefill", "gpt2-small", 4096, 1, None), [("fp32", at(False)), ("bf16", at(False))]))
    for kvh in (None, 4):
        for B in (1, 16):
            out.append((("decode", "gpt2-small", 1024, B, kvh), [("fp32", at(True)), ("bf16", at(False))]))
    return out


# ----------------------------------------------------------------------------------- inputs and the reference

def write_safetensors(path, tensors):
    """float32 tensors in the safetensors format (an 8-byte little-endian header length, the JSON header padded
    with spaces to 8 bytes, the raw data), as `gpt2attn forward --weights` reads; no package needed."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        data = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def attention64(q, k, v, causal):
    """softmax(q k^T / sqrt(D) [+ causal mask]) v in float64, q (Tq, D), k and v (Tk, D); a causal q's rows are the
    last Tq of the Tk positions."""
    s = q @ k.T / np.sqrt(q.shape[1])
    if causal:
        Tq, Tk = s.shape
        s = np.where(np.arange(Tk)[None, :] > (np.arange(Tq) + Tk - Tq)[:, None], -np.inf, s)
    s = np.exp(s - s.max(axis=1, keepdims=True))
    return (s / s.sum(axis=1, keepdims=True)) @ v


def make_case(d, geometry, E, H):
    """Writes the case's inputs to folder d and returns the reference output, float64 (B, S, E): weights N(0, 1/E)
    (scores of order 1), biases N(0, 0.01), tokens N(0, 1) rescaled to mean 0 and variance 1 per row (so that a peer
    that runs the layer inside a pre-norm block, llama.cpp, can make its layer norm the identity). Prefill: x
    (B, T, E), the reference over all T rows. Decode: a history of T + 1 tokens per sequence; the peers get past_k,
    past_v (the first T tokens' keys and values, float32) and x, the last token; the reference is the last token's
    row, and ours runs `forward` over the whole history (its last row is what a decode step over T cached tokens
    returns)."""
    mode, _, T, B, kvh = geometry
    KVH = kvh or H
    D = E // H
    KW = KVH * D
    G = H // KVH
    rng = np.random.default_rng(20261129)
    w_in = (rng.standard_normal((E + 2 * KW, E)) / np.sqrt(E)).astype(np.float32)
    b_in = (0.1 * rng.standard_normal(E + 2 * KW)).astype(np.float32)
    w_out = (rng.standard_normal((E, E)) / np.sqrt(E)).astype(np.float32)
    b_out = (0.1 * rng.standard_normal(E)).astype(np.float32)
    n = T if mode == "prefill" else T + 1
    hist = rng.standard_normal((B, n, E))
    hist = ((hist - hist.mean(axis=-1, keepdims=True)) / hist.std(axis=-1, keepdims=True)).astype(np.float32)
    for name, a in (("w_in", w_in), ("b_in", b_in), ("w_out", w_out), ("b_out", b_out)):
        np.save(os.path.join(d, name + ".npy"), a)
    write_safetensors(os.path.join(d, "w.safetensors"), {"in_proj_weight": w_in, "in_proj_bias": b_in,
                                                         "out_proj.weight": w_out, "out_proj.bias": b_out})
    np.save(os.path.join(d, "history.npy"), hist)  # ours' query
    w_in64, b_in64, w_out64, b_out64 = (a.astype(np.float64) for a in (w_in, b_in, w_out, b_out))
    S = T if mode == "prefill" else 1  # rows of the output
    ref = np.empty((B, S, E))
    past_k = np.empty((B, KVH, T, D), np.float32)  # decode only: the cached tokens' keys and values
    past_v = np.empty((B, KVH, T, D), np.float32)
    for b in range(B):
        xb = hist[b].astype(np.float64)
        q = xb[n - S:] @ w_in64[:E].T + b_in64[:E]
        kv = xb @ w_in64[E:].T + b_in64[E:]
        k, v = kv[:, :KW], kv[:, KW:]
        o = np.empty((S, E))
        for h in range(H):
            g = h // G  # query head h reads K/V head h // G, as torch's enable_gqa does
            o[:, h * D:(h + 1) * D] = attention64(q[:, h * D:(h + 1) * D], k[:, g * D:(g + 1) * D],
                                                  v[:, g * D:(g + 1) * D], causal=True)
        ref[b] = o @ w_out64.T + b_out64
        if mode == "decode":
            past_k[b] = k[:T].reshape(T, KVH, D).transpose(1, 0, 2)
            past_v[b] = v[:T].reshape(T, KVH, D).transpose(1, 0, 2)
    if mode == "decode":
        np.save(os.path.join(d, "past_k.npy"), past_k)
        np.save(os.path.join(d, "past_v.npy"), past_v)
        np.save(os.path.join(d, "x.npy"), hist[:, T:])
    else:
        np.save(os.path.join(d, "x.npy"), hist)
    return ref


def compare(out, ref, dtype):
    """(max abs error, relative error = max abs error / max |ref|, tolerance, error message or None)."""
    out = np.asarray(out, dtype=np.float64).reshape(ref.shape) if out.size == ref.size else None
    if out is None:
        return None, None, TOLERANCE[dtype], "output has the wrong shape"
    err = float(np.max(np.abs(out - ref)))
    rel = err / float(np.max(np.abs(ref)))
    if not np.isfinite(rel) or rel > TOLERANCE[dtype]:
        return err, rel, TOLERANCE[dtype], "output differs from the float64 reference: max |err| / max |ref| = " \
            "%.3g > %.0e" % (rel, TOLERANCE[dtype])
    return err, rel, TOLERANCE[dtype], None


# ---------------------------------------------------------------------------------------------------- engines

class Ours:
    """Our side of a measurement: one `gpt2attn bench` process per round."""

    def __init__(self, cli, geometry, dtype, threads):
        mode, preset, T, B, kvh = geometry
        self.name = "gpt2attn"
        self.cmd = [cli, "bench", "--preset", preset, "--mode", mode, "--seq", str(T), "--batch", str(B),
                    "--dtype", "f32" if dtype == "fp32" else "bf16", "--threads", str(threads), "--json", "--no-check"]
        if kvh:
            self.cmd += ["--kv-heads", str(kvh)]
        if mode == "decode":
            for kv in (["f32", "bf16", "int8", "fp8"] if dtype == "fp32" else ["bf16"]):
                self.cmd += ["--kv-dtype", kv]
        self.env = thread_env(threads)
        self.rounds = {}  # kv dtype (or "-") -> [round medians]
        self.rows = {}  # the last JSON row of each kv dtype (cpu, isa, version, busy...)
        self.busy = False

    def time(self, calls):
        p = subprocess.run(self.cmd + ["--repeats", str(calls)], capture_output=True, text=True, env=self.env)
        if p.returncode != 0:
            raise RuntimeError("%s failed (%d): %s" % (" ".join(self.cmd), p.returncode, p.stderr.strip()))
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                key = r.get("kv_dtype", "-")
                self.rounds.setdefault(key, []).append(r["median_ms"])
                self.rows[key] = r
                self.busy = self.busy or r.get("busy", False)
        return max(r[-1] for r in self.rounds.values())  # the slowest K/V variant sizes the calls

    def headline(self):
        """The kv dtype whose rounds the peers are divided by: f32 for f32 compute, bf16 for bf16, '-' in prefill."""
        for k in ("-", "f32", "bf16"):
            if k in self.rounds:
                return k
        raise RuntimeError("gpt2attn bench printed no rows")


class Peer:
    """A peer worker process (worker_common.py's protocol)."""

    def __init__(self, spec, python, d, geometry, H, dtype, threads, logdir, ref):
        self.name, worker, self.variant, dtypes = spec[:4]
        self.dtype = dtypes[dtype]
        mode, preset, T, B, kvh = geometry
        self.error, self.info, self.rounds, self.proc = None, {}, [], None
        self.err = self.rel = self.tol = None
        self.allocator = "default"
        env = thread_env(threads)
        if worker.startswith("torch"):
            # bench/peer_torch.py's tuned set-up (jemalloc keeping its pages), when the machine has jemalloc.
            if os.path.exists(JEMALLOC):
                env, self.allocator = allocator_env(threads, "tuned"), "jemalloc (tuned)"
        tag = "%s_%s" % (self.name, self.dtype)
        self.logpath = os.path.join(logdir, "%s_%s_T%d_B%d_kvh%s_%s_%dt_%s.log"
                                    % (mode, preset, T, B, kvh or H, dtype, threads, tag))
        cmd = [python, os.path.join(HERE, worker), "--dir", d, "--mode", mode, "--heads", str(H),
               "--kv-heads", str(kvh or H), "--dtype", self.dtype, "--variant", self.variant,
               "--threads", str(threads), "--tag", tag]
        self.stderr = open(self.logpath, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env, cwd=d)
        first = self.read()
        if first is None:
            self.fail("the worker exited (%s) before it was ready; see %s" % (self.proc.wait(), self.logpath))
        elif "error" in first:
            self.fail(first["error"])
        else:
            self.info = first["info"]
            out = np.load(os.path.join(d, "out_%s.npy" % tag))
            if self.info.get("output") == "layernorm(x + y)":
                # The worker returns its block's output norm of the residual sum (llamacpp_worker.py): check that
                # against the same transform of the reference, x being the rows the output belongs to.
                v = np.load(os.path.join(d, "x.npy")).astype(np.float64) + ref
                v -= v.mean(axis=-1, keepdims=True)
                ref = v / np.sqrt((v * v).mean(axis=-1, keepdims=True) + self.info["norm_eps"])
            self.err, self.rel, self.tol, msg = compare(out, ref, self.dtype)
            if msg:
                self.fail(msg)

    def read(self):
        line = self.proc.stdout.readline()
        return json.loads(line) if line.strip() else None

    def fail(self, msg):
        self.error = msg
        self.close()

    def time(self, calls):
        # A warm-up call before the timed ones, as our CLI makes, unless a call takes long enough (WARMUP_MS) that
        # warm caches no longer matter and the extra call would only double the run's time.
        warm = 0 if self.rounds and self.rounds[0] > WARMUP_MS else 1
        self.proc.stdin.write("time %d %d\n" % (calls, warm))
        self.proc.stdin.flush()
        r = self.read()
        if r is None or "ms" not in r:
            why = r.get("error") if r else "the worker exited; see " + self.logpath
            raise RuntimeError("%s: %s" % (self.name, why))
        self.rounds.append(statistics.median(r["ms"]))
        return self.rounds[-1]

    def close(self):
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


# ------------------------------------------------------------------------------------------------- measurement

def ours_check(cli, d, geometry, H, dtype, ref):
    """Our output on the case's weights and tokens (`gpt2attn forward`), checked like a peer's."""
    mode, _, T, B, kvh = geometry
    out_path = os.path.join(d, "out_gpt2attn_%s.npy" % dtype)
    cmd = [cli, "forward", "--weights", os.path.join(d, "w.safetensors"), "--heads", str(H),
           "--kv-heads", str(kvh or H), "--query", os.path.join(d, "history.npy"), "--causal",
           "--dtype", "f32" if dtype == "fp32" else "bf16", "--output", out_path]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), p.returncode, p.stderr.strip()))
    out = np.load(out_path)
    if mode == "decode":
        out = out[:, -1:]  # the last token's row: what decode() over the T cached tokens returns
    return compare(out, ref, dtype)


def work(geometry, E, H, dtype, kv_bytes):
    """(FLOPs, bytes) of one call of the case: the projections' and the attention core's multiply-adds (2 FLOPs
    each; the causal core over T (T + 1) / 2 query-key pairs per head in prefill, T + 1 keys per token in decode), and
    the bytes it must move at least: the weights in `dtype` (4 bytes in fp32, else 2), the f32 input and output and,
    in decode, the T + 1 cached keys and values per sequence at kv_bytes each."""
    mode, _, T, B, kvh = geometry
    KW = (kvh or H) * (E // H)
    params = E * (E + 2 * KW) + E * E
    weights = params * (4 if dtype == "fp32" else 2)
    if mode == "prefill":
        rows, keys = B * T, B * H * T * (T + 1) // 2
        return 2 * rows * params + 4 * (E // H) * keys, weights + 8 * rows * E
    return 2 * B * params + 4 * E * B * (T + 1), weights + 8 * B * E + B * (T + 1) * 2 * KW * kv_bytes


KV_BYTES = {"fp32": 4, "f32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1}


def roofs(a, threads):
    """The machine's roofs now: {"triad": {threads: GB/s}, "peak": {threads: GFLOP/s}}; {} where a probe is missing or
    fails (its error is logged, and the rows then carry no fraction)."""
    out = {}
    for name, tool, key in (("triad", a.triad_cli, "gbps"), ("peak", a.peak_cli, "gflops")):
        cmd = [tool] + [x for n in threads for x in ("--threads", str(n))]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            log("%s: %s" % (" ".join(cmd), e))
            continue
        if p.returncode != 0:
            log("%s failed (%d): %s" % (" ".join(cmd), p.returncode, p.stderr.strip()))
            continue
        rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
        out[name] = {r["threads"]: r[key] for r in rows}
    return out


def with_roofs(row, flops, nbytes, probes):
    """row plus its case's flops and bytes and, where the run measured the roofs at its thread count, gflops, gbps and
    its fraction of the FMA peak (prefill) or of the triad bound (decode: bytes / triad over its time)."""
    row.update(flops=flops, bytes=nbytes)
    ms = row.get("median_ms")
    if ms is None:
        return row
    row.update(gflops=flops / ms * 1e-6, gbps=nbytes / ms * 1e-6)
    n = row["threads"]
    if row["mode"] == "decode" and n in probes.get("triad", {}):
        row["triad_bound_ms"] = nbytes / probes["triad"][n] * 1e-6
        row["of_triad"] = row["triad_bound_ms"] / ms
    if row["mode"] == "prefill" and n in probes.get("peak", {}):
        row["of_peak"] = row["gflops"] / probes["peak"][n]
    return row


def spread(xs):
    return {"median_ms": statistics.median(xs), "min_ms": min(xs), "max_ms": max(xs), "round_ms": xs}


def measure(a, geometry, E, H, dtype, threads, d, ref, ours_err, header, out):
    mode, preset, T, B, kvh = geometry
    base = {"kind": "peers", "mode": mode, "preset": preset, "seq": T, "batch": B, "heads": H,
            "kv_heads": kvh or H, "dtype": dtype, "threads": threads}
    ours = Ours(a.cli, geometry, dtype, threads)
    peers = []
    for spec in PEERS:
        modes = spec[4] if len(spec) > 4 else ("prefill", "decode")
        if dtype not in spec[3] or (a.only and spec[0] not in a.only) or mode not in modes:
            continue
        peers.append(Peer(spec, a.python, d, geometry, H, dtype, threads, a.logdir, ref))
        if peers[-1].error:
            log("%s %s: %s" % (label(base), spec[0], peers[-1].error))
    live = [p for p in peers if not p.error]
    engines = [ours] + live
    calls = {e: 1 for e in engines}
    try:
        for r in range(a.decode_rounds if mode == "decode" else a.rounds):
            for e in (engines if r % 2 == 0 else engines[::-1]):
                ms = e.time(calls[e])
                if r == 0:  # the probe round sets how many calls fit the budget
                    calls[e] = max(1, min(MAX_CALLS, int(a.budget_ms / max(ms, 1e-3))))
                time.sleep(PAUSE_S)
    finally:
        for p in peers:
            p.close()
    head = ours.headline()
    ours_rounds = ours.rounds[head]
    ours_ms = statistics.median(ours_rounds)
    rows = []
    for kv, rounds in ours.rounds.items():
        r0 = ours.rows[kv]
        row = dict(base, engine="gpt2attn", engine_dtype=r0["dtype"], kv_dtype=kv if kv != "-" else r0["dtype"],
                   version=r0.get("version"), commit=r0.get("commit"), isa=r0.get("isa"),
                   implementation=r0.get("implementation"), busy=r0.get("busy"), calls_per_round=calls[ours],
                   ours_ms=ours_ms, speedup=ours_ms / statistics.median(rounds), error=None,
                   max_abs_err=ours_err[0], rel_err=ours_err[1], tolerance=ours_err[2], **spread(rounds))
        if mode == "decode" and kv not in ("f32", "bf16"):
            row["checked"] = "the f32-cache forward; this cache's error is bounded by the library's tests"
        flops, nbytes = work(geometry, E, H, dtype, KV_BYTES.get(row["kv_dtype"], 4))
        rows.append(with_roofs(row, flops, r0.get("bytes_per_step", nbytes), header["roofs"]))
    for p in peers:
        row = dict(base, engine=p.name, engine_dtype=p.dtype, kv_dtype=p.dtype, variant=p.variant, info=p.info,
                   allocator=p.allocator, error=p.error, max_abs_err=p.err, rel_err=p.rel, tolerance=p.tol,
                   ours_ms=ours_ms)
        if not p.error:
            per_round = [pm / om for pm, om in zip(p.rounds, ours_rounds)]
            row.update(spread(p.rounds), calls_per_round=calls[p], speedup=statistics.median(p.rounds) / ours_ms,
                       speedup_min=min(per_round), speedup_max=max(per_round))
        rows.append(with_roofs(row, *work(geometry, E, H, p.dtype, KV_BYTES[p.dtype]), header["roofs"]))
    for row in rows:
        row.update(cpu=header["cpu"], timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        out.write(json.dumps(row) + "\n")
    out.flush()
    log("%s: ours %.3f ms%s; %s" % (label(base), ours_ms, " (busy)" if ours.busy else "", ", ".join(
        "%s %s" % (p.name, "%.3f ms" % statistics.median(p.rounds) if not p.error else "error") for p in peers)))
    return rows


def label(r):
    what = "%s %s T=%d B=%d" % (r["mode"], r["preset"], r["seq"], r["batch"])
    if r["kv_heads"] != r["heads"]:
        what += " kvh=%d" % r["kv_heads"]
    return "%s %s %dt" % (what, r["dtype"], r["threads"])


# ------------------------------------------------------------------------------------------------------ table

def table(rows, header):
    """The run as a markdown table: a line per case (and our K/V cache in decode), a column per engine: median ms
    and, for a peer, its ms over ours (x > 1: ours faster); errors in a list below."""
    engines = ["gpt2attn"] + [s[0] for s in PEERS if any(r["engine"] == s[0] for r in rows)]
    lines = ["| case | threads | " + " | ".join(engines) + " | ours: of peak / triad bound |",
             "|---|---|" + "---|" * (len(engines) + 1)]
    errors = {}
    keyed = {}
    for r in rows:
        keyed.setdefault((r["mode"], r["preset"], r["seq"], r["batch"], r["kv_heads"], r["heads"], r["dtype"],
                          r["threads"]), []).append(r)
    for key, rs in keyed.items():
        mode, preset, T, B, kvh, H, dtype, n = key
        what = "%s %s T=%d%s%s %s" % (mode, preset, T, " B=%d" % B if mode == "decode" else "",
                                      " kvh=%d" % kvh if kvh != H else "", dtype)
        ours_rows = [r for r in rs if r["engine"] == "gpt2attn"]
        for i, o in enumerate(ours_rows):
            cells = ["%.3g%s" % (o["median_ms"], "*" if o.get("busy") else "")]
            for e in engines[1:]:
                pr = [r for r in rs if r["engine"] == e]
                if i > 0 or not pr:  # peers appear on the headline line only
                    cells.append("" if i > 0 else "n/a")
                elif pr[0]["error"]:
                    errors.setdefault((e, pr[0]["error"]), []).append("%s, %dt" % (what, n))
                    cells.append("error [%s]" % e)
                else:
                    cells.append("%.3g (%.2fx)" % (pr[0]["median_ms"], pr[0]["speedup"]))
            kvtxt = " (ours: %s K/V)" % o["kv_dtype"] if mode == "decode" else ""
            roof = ("%.2f of triad" % o["of_triad"]) if "of_triad" in o else \
                ("%.2f of peak" % o["of_peak"]) if "of_peak" in o else ""
            lines.append("| %s%s | %d | %s | %s |" % (what, kvtxt, n, " | ".join(cells), roof))
    lines.append("")
    roofs = header.get("roofs", {})
    lines.append("Roofs at the run's start: triad %s GB/s, FMA peak %s GFLOP/s (by thread count); of peak = the case's "
                 "FLOPs (causal core) / ms / peak; of triad = bytes it must move / triad / ms (above 1: caches held "
                 "part of them)." % (roofs.get("triad"), roofs.get("peak")))
    lines.append("ms: median over rounds of each round's median call; (Nx): the peer's ms / ours (ours with the f32 "
                 "K/V cache in fp32 decode, bf16 in bf16), > 1 = ours faster; * = `gpt2attn bench` saw its threads "
                 "wait for a CPU (busy machine).")
    if errors:
        lines.append("")
        lines.append("Errors (not timed):")
        for (e, msg), where in errors.items():
            lines.append("- %s: %s (%s)" % (e, msg, "; ".join(where)))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------- main

def machine_header(a, versions):
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in lscpu.splitlines() if l.startswith("Flags")), [])
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"kind": "run", "cpu": model, "cpus": os.cpu_count(),
            "isa_flags": [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit,
            "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]), "rounds": a.rounds,
            "decode_rounds": a.decode_rounds,
            "budget_ms": a.budget_ms, "loadavg_start": os.getloadavg(), "versions": versions,
            "python": platform.python_version()}


def peer_versions(python):
    code = ("import json, importlib.metadata as m\nv = {}\nfor p in ('torch', 'onnxruntime', 'onnx', 'openvino', "
            "'llama_cpp_python', 'numpy'):\n    try: v[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: v[p] = None\nprint(json.dumps(v))")
    p = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("peers: %s cannot run (%s); make the venv with scripts/bench.sh --peers" % (python, p.stderr.strip()))
    return json.loads(p.stdout)


def main():
    ap = argparse.ArgumentParser(description="gpt2attn against PyTorch 2, ONNX Runtime and OpenVINO, one run")
    ap.add_argument("--quick", action="store_true", help="tiny cases, 2 rounds: a smoke test")
    ap.add_argument("--threads", type=int, action="append",
                    help="repeatable; every case at each (default: 2, and 1 for gpt2-small; --quick: 2)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per prefill case (default 3; --quick 2)")
    ap.add_argument("--decode-rounds", type=int, help="interleaved rounds per decode case (default 9; --quick 2)")
    ap.add_argument("--budget-ms", type=float, help="per engine and round after the first (default 400; --quick 20)")
    ap.add_argument("--only", action="append", help="peer engines to run (default all), e.g. torch-sdpa")
    ap.add_argument("--mode", action="append", choices=["prefill", "decode"],
                    help="only the prefill or decode cases (default both)")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "peers"))
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "gpt2attn"))
    ap.add_argument("--python", default=os.path.join(ROOT, "build", "peers-venv", "bin", "python"))
    ap.add_argument("--triad-cli", help="default: bench/stream_triad_cli beside --cli")
    ap.add_argument("--peak-cli", help="default: bench/fma_peak_cli beside --cli")
    a = ap.parse_args()
    a.triad_cli = a.triad_cli or os.path.join(os.path.dirname(a.cli), "bench", "stream_triad_cli")
    a.peak_cli = a.peak_cli or os.path.join(os.path.dirname(a.cli), "bench", "fma_peak_cli")
    a.rounds = a.rounds or (2 if a.quick else 3)
    a.decode_rounds = a.decode_rounds or (2 if a.quick else 9)
    a.budget_ms = a.budget_ms or (20.0 if a.quick else 400.0)
    if min(a.rounds, a.decode_rounds) < 1 or min(a.threads or [1]) < 1:
        sys.exit("peers: --rounds, --decode-rounds and --threads must be >= 1")
    os.makedirs(a.out, exist_ok=True)
    a.logdir = os.path.join(a.out, "logs")
    os.makedirs(a.logdir, exist_ok=True)
    shapes = presets_table(a.cli)
    header = machine_header(a, peer_versions(a.python))
    counts = sorted({n for _, dtypes in cases(a.quick, a.threads) for _, ns in dtypes for n in ns})
    header["roofs"] = roofs(a, counts)  # what the rows are divided by
    log("%s, %s; %s" % (header["cpu"], header["date"], ", ".join("%s %s" % kv for kv in header["versions"].items())))
    rows = []
    with open(os.path.join(a.out, "peers.jsonl"), "w") as out:
        out.write(json.dumps(header) + "\n")
        for geometry, dtypes in cases(a.quick, a.threads):
            if a.mode and geometry[0] not in a.mode:
                continue
            E, H = shapes[geometry[1]]
            d = tempfile.mkdtemp(prefix="gpt2attn_peers_")
            try:
                ref = make_case(d, geometry, E, H)
                for dtype, threads in dtypes:
                    ours_err = ours_check(a.cli, d, geometry, H, dtype, ref)
                    if ours_err[3]:
                        sys.exit("peers: ours does not match the reference on %s %s: %s"
                                 % (geometry, dtype, ours_err[3]))
                    for n in threads:
                        rows += measure(a, geometry, E, H, dtype, n, d, ref, ours_err, header, out)
            finally:
                shutil.rmtree(d, ignore_errors=True)
        header_end = dict(header, kind="run_end", loadavg_end=os.getloadavg(), roofs_end=roofs(a, counts),
                          date_end=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        out.write(json.dumps(header_end) + "\n")
    md = table(rows, header)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(md)
    print(md)
    print("peers: wrote %s and %s" % (os.path.join(a.out, "peers.jsonl"), os.path.join(a.out, "table.md")))


if __name__ == "__main__":
    main()
