# tests/python/test_ab.py: bench/ab.py alternates its two sides round by round (A B, B A, ...), reads both output
# formats (gpt2attn bench --json rows, Google Benchmark JSON), reports the per-round ratio B / A, and refuses output
# it cannot compare. Timings come from stand-in commands with known values, and one run drives the real CLI.
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "ab.py")

# A stand-in benchmark: appends $SIDE to the log file, then prints its timing in the format asked for.
FAKE = r'''
import json, os, sys
fmt, ms, log = sys.argv[1], float(sys.argv[2]), sys.argv[3]
with open(log, "a") as f:
    f.write(os.environ.get("SIDE", "?"))
if fmt == "rows":
    for seq in (32, 64):
        print(json.dumps({"preset": "gpt2-small", "mode": "prefill", "dtype": "f32", "batch": 1, "seq": seq,
                          "threads": 1, "isa": os.environ.get("SIDE"), "median_ms": ms * seq / 32}))
elif fmt == "gbench":
    bench = [{"name": "Core/x_median", "run_name": "Core/x", "run_type": "aggregate", "aggregate_name": "median",
              "real_time": ms * 1000.0, "time_unit": "us"},
             {"name": "Core/x_mean", "run_name": "Core/x", "run_type": "aggregate", "aggregate_name": "mean",
              "real_time": 1.0, "time_unit": "us"}]
    print(json.dumps({"context": {}, "benchmarks": bench}, indent=2))
elif fmt == "other":
    print(json.dumps({"preset": "gpt2-xl", "mode": "prefill", "median_ms": ms}))
'''


def ab(args):
    return subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, timeout=600)


def fake_side(wd, side, fmt, ms):
    fake = os.path.join(wd, "fake.py")
    if not os.path.exists(fake):
        with open(fake, "w") as f:
            f.write(FAKE)
    return "SIDE=%s %s %s %s %s %s" % (side, sys.executable, fake, fmt, ms, os.path.join(wd, "order.log"))


def rows_of(p):
    check(p.returncode == 0, "exit %d: %s" % (p.returncode, p.stderr[-400:]))
    return [json.loads(line) for line in p.stdout.splitlines()]


def alternates_and_reads_rows(r):
    wd = r.workdir()
    rows = rows_of(ab(["--a", fake_side(wd, "A", "rows", 2.0), "--b", fake_side(wd, "B", "rows", 1.5),
                       "--rounds", "3", "--json"]))
    check(len(rows) == 2, "two cases (seq 32 and 64, the isa field ignored), got %r" % rows)
    for row in rows:
        check(abs(row["ratio"] - 0.75) < 1e-12 and row["ratio_min"] == row["ratio_max"],
              "B / A is 0.75 in every round: %r" % row)
        check(row["b_faster"] == 3 and row["rounds"] == 3, "B faster in 3 of 3 rounds: %r" % row)
    check(abs(rows[1]["a_ms"] - 4.0) < 1e-12, "seq 64's A time is 4 ms: %r" % rows[1])
    with open(os.path.join(wd, "order.log")) as f:
        order = f.read()
    check(order == "ABBAAB", "the order swaps every round: %r" % order)


def reads_google_benchmark_medians(r):
    wd = r.workdir()
    p = ab(["--a", fake_side(wd, "A", "gbench", 4.0), "--b", fake_side(wd, "B", "gbench", 5.0), "--rounds", "2"])
    check(p.returncode == 0, "exit %d: %s" % (p.returncode, p.stderr[-400:]))
    check("| Core/x | 4 | 5 | 1.250 | 1.250-1.250 | 0/2 |" in p.stdout, "the median aggregate in ms: %s" % p.stdout)
    check("A: SIDE=A " in p.stdout and "B: SIDE=B " in p.stdout, "each side shown with its variables: %s" % p.stdout)


def refuses_what_it_cannot_compare(r):
    wd = r.workdir()
    p = ab(["--a", fake_side(wd, "A", "rows", 1.0), "--b", fake_side(wd, "B", "other", 1.0), "--rounds", "1"])
    check(p.returncode != 0 and "no case in common" in p.stderr, "disjoint cases: %d %s" % (p.returncode, p.stderr))
    p = ab(["--a", fake_side(wd, "A", "rows", 1.0), "--b", fake_side(wd, "B", "none", 1.0), "--rounds", "1"])
    check(p.returncode != 0 and "printed no timings" in p.stderr, "no timings: %d %s" % (p.returncode, p.stderr))
    p = ab(["--a", "SIDE=A", "--b", fake_side(wd, "B", "rows", 1.0)])
    check(p.returncode != 0 and "has no command" in p.stderr, "no command: %d %s" % (p.returncode, p.stderr))


def drives_the_cli(r):
    rows = rows_of(ab(["--a", r.cli + " bench", "--b", r.cli + " bench", "--rounds", "2", "--json", "--",
                       "--preset", "gpt2-small", "--seq", "32", "--repeats", "1", "--threads", "1", "--json"]))
    check(len(rows) == 1 and rows[0]["a_ms"] > 0 and rows[0]["b_ms"] > 0 and rows[0]["rounds"] == 2,
          "one case timed on both sides: %r" % rows)
    check("preset=gpt2-small" in rows[0]["case"] and "seq=32" in rows[0]["case"], "the case is named: %r" % rows)


def main():
    r = pc.Runner("bench/ab.py")
    r.case("alternates_and_reads_rows", lambda: alternates_and_reads_rows(r))
    r.case("reads_google_benchmark_medians", lambda: reads_google_benchmark_medians(r))
    r.case("refuses_what_it_cannot_compare", lambda: refuses_what_it_cannot_compare(r))
    r.case("drives_the_cli", lambda: drives_the_cli(r))
    r.finish()


if __name__ == "__main__":
    main()
