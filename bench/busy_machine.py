#!/usr/bin/python3
"""How the layer's latency degrades when another process takes a core: decode steps (gpt2-small, B=1 T=128, whose
step is a fraction of a scheduler slice, and B=16 T=1024), a ragged continuous-batching step, an extend and a prefill
timed quiet and beside a one-core CPU hog (a busy loop in a child process in a session of its own, as another service
on a server), in interleaved rounds, for each build given and each OpenMP wait policy asked for. Reports medians and
the slowdown against the quiet run of the same build and policy.

    /usr/bin/python3 bench/busy_machine.py [--cli [LABEL=]build/gpt2attn]... [--policy default|active|passive|spin10k]...
                                           [--threads 2] [--rounds 3] [--json]

Several --cli compare builds in the same run (e.g. --cli new=build/gpt2attn --cli old=/tmp/old/build/gpt2attn).
Policies (default: default and passive): OMP_WAIT_POLICY unset (libgomp spins a while, then sleeps), active (spins),
passive (sleeps at once), and passive with GOMP_SPINCOUNT=10000 (a short spin first). The layer's calls run on its own
thread team (engine/team.hpp), which these variables do not govern; they still govern libgomp's teams (oneDNN's
weight reorders while a layer is built, a build older than the engine's team).
"""
import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys

POLICIES = {
    "default": {},
    "active": {"OMP_WAIT_POLICY": "active"},
    "passive": {"OMP_WAIT_POLICY": "passive"},
    "spin10k": {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "10000"},
}
CASES = {
    "decode B=1 T=128": ["--mode", "decode", "--batch", "1", "--seq", "128", "--repeats", "51"],
    "decode B=16 T=1024": ["--mode", "decode", "--batch", "16", "--seq", "1024", "--repeats", "21"],
    "step 2x32 + 14 decode, T=512": ["--mode", "step", "--prefill", "2x32", "--decode", "14", "--seq", "512",
                                     "--repeats", "21"],
    "extend 64 over 512": ["--mode", "step", "--prefill", "1x64", "--seq", "512", "--repeats", "21"],
    "prefill T=256": ["--seq", "256", "--repeats", "11"],
}


def hog():
    # Its own session, hence its own scheduler autogroup, as any other service on a server: in ours, the kernel's
    # autogroup fair share would hand it our threads' time instead of taking a core.
    os.setsid()
    while True:
        pass


def run(cli, threads, case, policy):
    env = dict(os.environ, **POLICIES[policy])
    for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if k not in POLICIES[policy]:
            env.pop(k, None)
    cmd = [cli, "bench", "--preset", "gpt2-small", "--threads", str(threads), "--json", "--no-check"] + CASES[case]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.splitlines()[0])["median_ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cli", action="append", help="[LABEL=]path of a gpt2attn binary (repeatable)")
    ap.add_argument("--policy", action="append", choices=sorted(POLICIES), help="OpenMP wait policy (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    clis = {}
    for c in a.cli or ["build/gpt2attn"]:
        label, _, path = c.rpartition("=")
        clis[label or path] = path
    policies = a.policy or ["default", "passive"]
    times = {(c, b, p, busy): [] for c in CASES for b in clis for p in policies for busy in (False, True)}
    total, done = a.rounds * len(times), 0
    for _ in range(a.rounds):
        for (c, b, p, busy) in times:
            h = multiprocessing.Process(target=hog, daemon=True) if busy else None
            if h:
                h.start()
            try:
                times[(c, b, p, busy)].append(run(clis[b], a.threads, c, p))
            finally:
                if h:
                    h.terminate()
                    h.join()
            done += 1
            print("busy_machine: [%d/%d] %s, %s, %s%s: %.3f ms" % (done, total, c, b, p, ", hog" if busy else "",
                                                                    times[(c, b, p, busy)][-1]),
                  file=sys.stderr, flush=True)
    rows = []
    for c in CASES:
        for b in clis:
            for p in policies:
                quiet, busy = statistics.median(times[(c, b, p, False)]), statistics.median(times[(c, b, p, True)])
                rows.append({"case": c, "build": b, "policy": p, "threads": a.threads, "quiet_ms": quiet,
                             "hog_ms": busy, "slowdown": busy / quiet,
                             "quiet_spread_ms": [min(times[(c, b, p, False)]), max(times[(c, b, p, False)])],
                             "hog_spread_ms": [min(times[(c, b, p, True)]), max(times[(c, b, p, True)])]})
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print("gpt2-small, %d threads, a one-core busy loop beside it; medians of %d interleaved rounds"
          % (a.threads, a.rounds))
    print("| case | build | OpenMP wait | quiet ms | with hog ms | slowdown |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %s | %s | %.3f | %.3f | %.1fx |" % (r["case"], r["build"], r["policy"], r["quiet_ms"], r["hog_ms"],
                                                       r["slowdown"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
