#!/usr/bin/env python3
# tests/mpi/test_deadline.py: runs test_deadline (a rank that stops itself with SIGSTOP) under mpiexec on 2 ranks and
# checks from outside what that program cannot: that the job ends (MPI_Abort from rank 0 ends the stopped rank too),
# nonzero, well within the watchdog, and that rank 0 printed "test_deadline: ok: <the deadline error>". ctest runs it
# as mpi.deadline.before and mpi.deadline.during.
import argparse
import os
import shlex
import signal
import subprocess
import sys
import time

WATCHDOG_S = 60  # a job still running after this hangs: it is killed (its process group) and the test fails


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--program", required=True)
    ap.add_argument("--mode", required=True, choices=["before", "during"])
    ap.add_argument("--mpiexec", default="mpiexec")
    ap.add_argument("--np-flag", default="-n")
    ap.add_argument("--mpiexec-flags", default="--oversubscribe --allow-run-as-root")
    a = ap.parse_args()
    cmd = [a.mpiexec, a.np_flag, "2"] + shlex.split(a.mpiexec_flags) + [a.program, a.mode]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=WATCHDOG_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        print("FAIL: the job did not end within %d s (killed): %s\n  stdout: %r\n  stderr: %r" % (
            WATCHDOG_S, " ".join(cmd), out[-1500:], err[-1500:]))
        return 1
    seconds = time.monotonic() - t0
    lines = [l for l in out.splitlines() if l.startswith("test_deadline: ")]
    print("exit %d after %.1f s: %s" % (p.returncode, seconds, " ".join(cmd)))
    for l in lines:
        print("  " + l)
    problems = []
    if p.returncode == 0:
        problems.append("the job ended with status 0, but rank 0 must end it with MPI_Abort")
    if len(lines) != 1 or not lines[0].startswith("test_deadline: ok: "):
        problems.append("expected one 'test_deadline: ok:' line from rank 0")
    if problems:
        print("FAIL: " + "; ".join(problems) + "\n  stdout: %r\n  stderr: %r" % (out[-1500:], err[-1500:]))
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
