#!/usr/bin/env python3
# tests/mpi/test_cli.py: the command-line tool under mpiexec. `gpt2attn forward` and `bench` run tensor parallel when
# the world has more than one rank: forward's output equals the single-process tool's, rank 0 alone writes it and
# prints; bench's JSON rows say "ranks"; bad input on one rank makes every rank exit 2 with one message, printed once;
# a rank killed mid-run ends the job instead of hanging it, and so does one stopped (SIGSTOP) past --mpi-timeout.
# numpy only (no torch): ctest runs it as mpi.cli.
import argparse
import json
import math
import os
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

RUN_TIMEOUT_S = 120  # any one mpiexec run; a hang fails the case and its process group is killed


class CaseFailure(Exception):
    pass


def check(cond, detail):
    if not cond:
        raise CaseFailure(detail)


class Ctx:
    def __init__(self):
        ap = argparse.ArgumentParser(description=__doc__)
        ap.add_argument("--cli", required=True, help="the gpt2attn binary")
        ap.add_argument("--mpiexec", default="mpiexec")
        ap.add_argument("--np-flag", default="-n")
        ap.add_argument("--mpiexec-flags", default="--oversubscribe --allow-run-as-root",
                        help="put between the rank count and the program, e.g. Open MPI's --oversubscribe")
        ap.add_argument("-k", dest="filter", default=None, help="run only cases whose name contains this")
        self.args = ap.parse_args()
        self.cli = os.path.abspath(self.args.cli)
        self._tmp = tempfile.TemporaryDirectory(prefix="gpt2attn_mpi_cli_")
        self.n = 0
        self.passed = self.failed = 0

    def workdir(self):
        self.n += 1
        d = os.path.join(self._tmp.name, "case%02d" % self.n)
        os.makedirs(d)
        return d

    def mpi(self, np_, argv):
        """The mpiexec command line running argv on np_ ranks."""
        return ([self.args.mpiexec, self.args.np_flag, str(np_)] + shlex.split(self.args.mpiexec_flags) +
                [str(a) for a in argv])

    def case(self, name, fn):
        if self.args.filter and self.args.filter not in name:
            return
        t0 = time.monotonic()
        try:
            extra = fn()
        except CaseFailure as e:
            self.failed += 1
            print("FAIL %s: %s" % (name, e), flush=True)
            return
        except Exception:  # a bug in the test itself still counts as a failure
            self.failed += 1
            print("FAIL %s: test raised %s" % (name, traceback.format_exc().strip().replace("\n", " | ")), flush=True)
            return
        self.passed += 1
        print("ok %s (%.1f s%s)" % (name, time.monotonic() - t0, ", " + extra if extra else ""), flush=True)

    def finish(self):
        print("%d passed, %d failed" % (self.passed, self.failed), flush=True)
        self._tmp.cleanup()
        sys.exit(0 if self.failed == 0 and self.passed > 0 else 1)


class Result:
    def __init__(self, returncode, stdout, stderr, seconds, cmd):
        self.returncode, self.stdout, self.stderr, self.seconds, self.cmd = returncode, stdout, stderr, seconds, cmd

    def describe(self):
        return "exit %s after %.1f s: %s\n  stdout: %r\n  stderr: %r" % (
            self.returncode, self.seconds, " ".join(shlex.quote(c) for c in self.cmd), self.stdout[-600:],
            self.stderr[-1500:])


def run(cmd, timeout=RUN_TIMEOUT_S, cwd=None):
    """Runs cmd in its own session; on timeout kills the whole process group (mpiexec and every rank) and fails."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise CaseFailure("did not end within %d s (killed): %s\n  stderr: %r" % (
            timeout, " ".join(shlex.quote(c) for c in cmd), err[-1500:]))
    return Result(p.returncode, out, err, time.monotonic() - t0, cmd)


def per_rank(ctx, np_, script_for_rank, tail, timeout=RUN_TIMEOUT_S):
    """mpiexec running `sh -c SCRIPT` where SCRIPT picks per-rank shell variables, then execs the CLI with `tail`.
    script_for_rank: shell text run first (it may set variables the tail refers to as "$W" etc.)."""
    script = script_for_rank + '; exec "$0" ' + " ".join(tail)
    return run(ctx.mpi(np_, ["sh", "-c", script, ctx.cli]), timeout=timeout)


# ---------------------------------------------------------------------------------------------------------------
# files

def write_safetensors(path, tensors):
    """F32 tensors in safetensors layout: 8-byte LE header length, JSON header (space padded to 8), raw data."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return path


def layer_file(d, E, H, seed=0):
    """A torch nn.MultiheadAttention layer (fused in_proj) of width E with random weights."""
    g = np.random.default_rng(seed)
    s = 1.0 / math.sqrt(E)
    return write_safetensors(os.path.join(d, "w.safetensors"), {
        "in_proj_weight": g.uniform(-s, s, (3 * E, E)).astype(np.float32),
        "in_proj_bias": g.uniform(-s, s, (3 * E,)).astype(np.float32),
        "out_proj.weight": g.uniform(-s, s, (E, E)).astype(np.float32),
        "out_proj.bias": g.uniform(-s, s, (E,)).astype(np.float32),
    })


def npy(d, name, a):
    p = os.path.join(d, name)
    np.save(p, a)
    return p


def f32_close(got, want, reduction_length):
    """tests/tolerance.hpp's f32 policy: rtol = 16 u sqrt(K), atol = rtol max(1, max |want|)."""
    rtol = 16.0 * 2.0 ** -24 * math.sqrt(reduction_length)
    atol = rtol * max(1.0, float(np.max(np.abs(want))))
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = err > atol + rtol * np.abs(want)
    return not bad.any(), float(err.max()), int(bad.sum())


# ---------------------------------------------------------------------------------------------------------------
# cases

E, H, B, T = 100, 25, 2, 20  # gpt2-xl's head count (D = 4): 13 + 12 heads on 2 ranks, 9 + 8 + 8 on 3


class Forward:
    def __init__(self, ctx):
        self.ctx = ctx
        self.dir = ctx.workdir()
        self.w = layer_file(self.dir, E, H)
        self.q = npy(self.dir, "q.npy", np.random.default_rng(1).standard_normal((B, T, E)).astype(np.float32))
        self.args = ["forward", "--weights", self.w, "--heads", str(H), "--query", self.q, "--causal",
                     "--threads", "1"]
        out = os.path.join(self.dir, "single.npy")
        r = run([ctx.cli] + self.args + ["--output", out])
        check(r.returncode == 0, "single-process forward failed: " + r.describe())
        self.single = np.load(out)
        check(self.single.shape == (B, T, E), "single-process output shape %s" % (self.single.shape,))

    def under_mpi(self, np_):
        d = self.ctx.workdir()
        out = os.path.join(d, "y.npy")
        r = run(self.ctx.mpi(np_, [self.ctx.cli] + self.args + ["--output", out]))
        check(r.returncode == 0, r.describe())
        check(r.stdout.strip() == "" and r.stderr.strip() == "",
              "forward printed something (the single-process tool prints nothing): " + r.describe())
        check(sorted(os.listdir(d)) == ["y.npy"], "output directory holds %s, expected only y.npy" % os.listdir(d))
        y = np.load(out)
        check(y.shape == self.single.shape, "shape %s, expected %s" % (y.shape, self.single.shape))
        ok, worst, nbad = f32_close(y, self.single, max(E, T))
        check(ok, "%d ranks: %d elements differ from the single-process output (worst %.3g)" % (np_, nbad, worst))
        return "worst |diff| %.2g, %.1f s" % (worst, r.seconds)

    def only_rank0_writes(self):
        """Each rank names its own --output; only rank 0's file may appear."""
        d = self.ctx.workdir()
        r = per_rank(self.ctx, 2, 'O=%s/y.rank$OMPI_COMM_WORLD_RANK.npy' % shlex.quote(d),
                     [shlex.quote(a) for a in self.args] + ['--output', '"$O"'])
        check(r.returncode == 0, r.describe())
        check(sorted(os.listdir(d)) == ["y.rank0.npy"],
              "files written: %s (only rank 0 may write --output)" % sorted(os.listdir(d)))
        ok, worst, nbad = f32_close(np.load(os.path.join(d, "y.rank0.npy")), self.single, max(E, T))
        check(ok, "%d elements differ (worst %.3g)" % (nbad, worst))


def bench_json(ctx):
    args = ["bench", "--preset", "gpt2-small", "--seq", "64", "--repeats", "2", "--threads", "1", "--json"]
    r = run(ctx.mpi(2, [ctx.cli] + args))
    check(r.returncode == 0, r.describe())
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    check(len(lines) == 1, "expected one JSON line (one case, printed by rank 0 alone), got %d: %r" % (
        len(lines), r.stdout[-800:]))
    j = json.loads(lines[0])
    check(j.get("ranks") == 2, "\"ranks\" is %r, expected 2: %s" % (j.get("ranks"), lines[0]))
    check(isinstance(j.get("allreduce_ms"), (int, float)) and j["allreduce_ms"] >= 0,
          "\"allreduce_ms\" missing or negative: %s" % lines[0])
    check(j.get("preset") == "gpt2-small" and j.get("seq") == 64 and j.get("threads") == 1,
          "row does not describe the case: %s" % lines[0])
    check(j.get("median_ms", 0) > 0, "median_ms: %s" % lines[0])

    # Without mpiexec the tool is as before: one row, no more than one rank.
    s = run([ctx.cli] + args)
    check(s.returncode == 0, s.describe())
    single = [ln for ln in s.stdout.splitlines() if ln.strip()]
    check(len(single) == 1, "single-process bench printed %d lines" % len(single))
    js = json.loads(single[0])
    check(js.get("ranks", 1) == 1, "single-process row says ranks %r" % js.get("ranks"))
    return "2 ranks %.2f ms (all-reduce %.2f ms), 1 rank %.2f ms" % (j["median_ms"], j["allreduce_ms"],
                                                                     js["median_ms"])


def bad_input_on_one_rank(ctx, fw):
    """Rank 1 names a missing weights file: every rank exits 2, rank 0 prints the failing rank's message once."""
    d = ctx.workdir()
    out = os.path.join(d, "y.npy")
    missing = "/nonexistent.safetensors"
    tail = [shlex.quote(a) for a in ["forward", "--weights"]] + ['"$W"'] + [
        shlex.quote(a) for a in fw.args[3:] + ["--output", out]]
    r = per_rank(ctx, 2, 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then W=%s; else W=%s; fi' % (
        missing, shlex.quote(fw.w)), tail, timeout=60)
    check(r.returncode == 2, "expected exit status 2: " + r.describe())
    check(r.seconds < 20, "took %.1f s to fail" % r.seconds)
    mentions = [ln for ln in r.stderr.splitlines() if missing in ln]
    check(len(mentions) == 1, "the missing file should be named in exactly one stderr line, got %d: %r" % (
        len(mentions), r.stderr[-1500:]))
    check("rank 1" in mentions[0], "the message does not name rank 1: %r" % mentions[0])
    check(mentions[0].startswith("gpt2attn: "), "not the tool's one-line error: %r" % mentions[0])
    check(not os.path.exists(out), "--output was written after the failure")
    return "%.1f s: %s" % (r.seconds, mentions[0])


def config_missing_on_one_rank(ctx, fw):
    """Rank 1 cannot read --config: every rank exits 2 with one message. Before, the config was read before the
    ranks' agreement: rank 1 exited silently and rank 0 waited in the agreement for good."""
    d = ctx.workdir()
    cfg = os.path.join(d, "cfg.json")
    with open(cfg, "w") as f:
        json.dump({"d_model": E, "num_heads": H, "causal": True}, f)
    missing = "/nonexistent-config.json"
    out = os.path.join(d, "y.npy")
    args = [a for a in fw.args if a not in ("--heads", str(H))]  # the heads come from the config
    tail = [shlex.quote(a) for a in args] + ["--config", '"$C"', "--output", shlex.quote(out)]
    r = per_rank(ctx, 2, 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then C=%s; else C=%s; fi' % (
        missing, shlex.quote(cfg)), tail, timeout=60)
    check(r.returncode == 2, "expected exit status 2: " + r.describe())
    check(r.seconds < 20, "took %.1f s to fail" % r.seconds)
    mentions = [ln for ln in r.stderr.splitlines() if missing in ln]
    check(len(mentions) == 1 and "rank 1" in mentions[0], "expected one line naming rank 1's config: %r" % (
        r.stderr[-1500:]))
    check(not os.path.exists(out), "--output was written after the failure")
    return "%.1f s: %s" % (r.seconds, mentions[0])


def nan_query_on_one_rank(ctx, fw):
    """Rank 1 reads a query holding a NaN (the library's collective check fails there): exit 2, one message."""
    d = ctx.workdir()
    q = np.load(fw.q)
    q[1, 3, 7] = np.nan
    bad_q = npy(d, "bad_q.npy", q)
    out = os.path.join(d, "y.npy")
    tail = [shlex.quote(a) for a in fw.args[:6]] + ['"$Q"'] + [shlex.quote(a) for a in fw.args[7:] +
                                                              ["--output", out]]
    r = per_rank(ctx, 3, 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then Q=%s; else Q=%s; fi' % (
        shlex.quote(bad_q), shlex.quote(fw.q)), tail, timeout=60)
    check(r.returncode == 2, "expected exit status 2: " + r.describe())
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("gpt2attn:")]
    check(len(lines) == 1, "expected one 'gpt2attn:' stderr line, got %d: %r" % (len(lines), r.stderr[-1500:]))
    check("rank 1" in lines[0] and "NaN" in lines[0], "the message does not name rank 1's NaN: %r" % lines[0])
    check(not os.path.exists(out), "--output was written after the failure")
    return "%.1f s: %s" % (r.seconds, lines[0])


def killed_rank(ctx):
    """Rank 1 is killed 3 s into a long bench: mpiexec must end the job (nonzero) instead of hanging."""
    tail = ["bench", "--preset", "gpt2-xl", "--seq", "512", "--repeats", "1000", "--threads", "1", "--json"]
    r = per_rank(ctx, 3, 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then (sleep 3; kill -9 $$) & fi', tail, timeout=60)
    check(r.returncode != 0, "the job ended with status 0 although rank 1 was killed: " + r.describe())
    check(r.seconds >= 3, "ended after %.1f s, before the kill (a different failure?): %s" % (
        r.seconds, r.describe()))
    return "ended with status %d after %.1f s" % (r.returncode, r.seconds)


def stopped_rank(ctx):
    """Rank 1 stops (SIGSTOP, never resumed) 3 s into a long bench: rank 0 waits --mpi-timeout 2 s in a collective,
    prints the deadline error naming itself, and ends the job with MPI_Abort, which ends the stopped rank too."""
    tail = ["bench", "--preset", "gpt2-xl", "--seq", "512", "--repeats", "1000", "--threads", "1", "--json",
            "--mpi-timeout", "2"]
    r = per_rank(ctx, 2, 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then (sleep 3; kill -STOP $$) & fi', tail, timeout=60)
    check(r.returncode != 0, "the job ended with status 0 although rank 1 was stopped: " + r.describe())
    check(r.seconds >= 5, "ended after %.1f s, before the stop and the deadline: %s" % (r.seconds, r.describe()))
    lines = [l for l in r.stderr.splitlines() if l.startswith("gpt2attn: ")]
    check(any("rank 0 of 2 waited 2 s (its deadline)" in l and "MPI_Abort" in l for l in lines),
          "no deadline error from rank 0 on stderr: " + r.describe())
    return "ended with status %d after %.1f s: %s" % (r.returncode, r.seconds, lines[0])


def bad_mpi_timeout(ctx):
    """--mpi-timeout must be a number of seconds above 0."""
    for bad in ["0", "-1", "nan", "inf", "2x"]:
        r = run([ctx.cli, "bench", "--preset", "gpt2-small", "--mpi-timeout", bad])
        check(r.returncode == 2, "--mpi-timeout %r: expected exit 2: %s" % (bad, r.describe()))
        check("--mpi-timeout %s: expected a number of seconds above 0" % bad in r.stderr,
              "--mpi-timeout %r: the message does not say why: %r" % (bad, r.stderr))
    return "refused 0, -1, nan, inf and 2x"


def main():
    ctx = Ctx()
    holder = {}

    def setup():
        holder["fw"] = Forward(ctx)
    ctx.case("forward single-process baseline", setup)
    fw = holder.get("fw")
    if fw:
        ctx.case("forward, 1 rank under mpiexec", lambda: fw.under_mpi(1))
        ctx.case("forward, 2 ranks", lambda: fw.under_mpi(2))
        ctx.case("forward, 3 ranks", lambda: fw.under_mpi(3))
        ctx.case("forward, only rank 0 writes --output", fw.only_rank0_writes)
        ctx.case("forward, missing weights file on rank 1", lambda: bad_input_on_one_rank(ctx, fw))
        ctx.case("forward, NaN query on rank 1 of 3", lambda: nan_query_on_one_rank(ctx, fw))
        ctx.case("forward, --config unreadable on rank 1", lambda: config_missing_on_one_rank(ctx, fw))
    ctx.case("bench --json, 2 ranks", lambda: bench_json(ctx))
    ctx.case("bench, rank 1 killed", lambda: killed_rank(ctx))
    ctx.case("bench, rank 1 stopped: the deadline ends the job", lambda: stopped_rank(ctx))
    ctx.case("--mpi-timeout out of range", lambda: bad_mpi_timeout(ctx))
    ctx.finish()


if __name__ == "__main__":
    main()
