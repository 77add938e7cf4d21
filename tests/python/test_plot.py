# tests/python/test_plot.py: the pictures of `scripts/bench.sh --plot --peer`, run on small cases with the real CLI,
# are written as PNGs whose legends hold one series per (engine, preset, compute dtype, K/V dtype, threads) of the
# rows the run printed (so f32 and bf16 are never one line, and threads are named), with units on the axes and the
# rows' CPU and date in the titles (read from the plots.json plot.py writes beside them); busy rows are flagged;
# Google Benchmark's rows are drawn per dtype; bench/peers/run.py's rows (--peers) give a bar per peer engine and a
# cross for a peer that could not run; input plot.py cannot read is refused with exit 2. The cases that need
# build/bench/'s programs are skipped, saying so, where they are not built (GPT2ATTN_BUILD_BENCH=OFF).
import json
import os
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "scripts", "plot.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from plot import BUSY_NOTE  # noqa: E402


def plot(args):
    return subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, timeout=300)


def png_size(path):
    """(width, height) of a PNG file, after checking its signature and IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    check(head[:8] == b"\x89PNG\r\n\x1a\n", "%s is not a PNG (signature %r)" % (path, head[:8]))
    check(head[12:16] == b"IHDR", "%s: no IHDR chunk first" % path)
    return struct.unpack(">II", head[16:24])


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def threads(n):
    return "%d thread%s" % (n, "" if n == 1 else "s")


def one_series(legend, what, start, *parts):
    """The one legend entry that begins with start and holds every part; a merge leaves none, a split two."""
    hits = [label for label in legend if label.startswith(start) and all(p in label for p in parts)]
    check(len(hits) == 1, "%s: %d legend entries begin %r and hold %s: %s" % (what, len(hits), start, parts, legend))


def titled(fig, name, bench):
    """The rows' CPU and date (every row's) in the title."""
    for r in bench:
        check(r["cpu"] in fig["title"] and r["timestamp"][:10] in fig["title"],
              "%s title %r lacks the rows' CPU %r or date %r" % (name, fig["title"], r["cpu"], r["timestamp"]))


def missing_tools(r, *names):
    """The bench programs (build/bench/) not built, e.g. with GPT2ATTN_BUILD_BENCH=OFF: a case that needs them is
    skipped with their names rather than failed."""
    return [n for n in names if not os.path.exists(os.path.join(os.path.dirname(r.cli), "bench", n))]


def bench_sh_pictures(r):
    """scripts/bench.sh --plot --peer itself, at --quick sizes on one thread, with the binaries under test."""
    missing = missing_tools(r, "fma_peak_cli", "stream_triad_cli")
    if missing:
        return "skipped: %s not built" % ", ".join(missing)
    out = os.path.join(r.workdir(), "plots")
    env = dict(os.environ, GPT2ATTN_BUILD_DIR=os.path.dirname(r.cli))
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "bench.sh"), "--plot", "--peer", "--quick", "--no-build",
                        "--threads", "1", "--out", out], capture_output=True, text=True, timeout=600, env=env)
    check(p.returncode == 0, "bench.sh --plot exit %d: %s" % (p.returncode, p.stderr[-600:]))
    written = p.stdout.split()
    names = sorted(os.path.basename(w) for w in written)
    check(names == ["decode_tokens_per_s.png", "ms_vs_t.png", "plots.json", "roofline.png"], "wrote %s" % names)
    sizes = [png_size(w) for w in written if w.endswith(".png")]
    check(all(w >= 400 and h >= 300 for w, h in sizes), "image sizes %s" % sizes)
    with open(os.path.join(out, "plots.json")) as f:
        figs = json.load(f)
    bench = rows(os.path.join(out, "bench.jsonl"))
    prefill = [b for b in bench if b["mode"] == "prefill"]
    decode = [b for b in bench if b["mode"] == "decode"]
    check({b["dtype"] for b in bench} == {"f32", "bf16"} and len({b["kv_dtype"] for b in decode}) == 3,
          "bench.sh ran dtypes %s, K/V dtypes %s" % ({b["dtype"] for b in bench}, {b["kv_dtype"] for b in decode}))

    fig = figs["ms_vs_t.png"]
    keys = {(b["preset"], b["dtype"], b["threads"]) for b in prefill}
    for preset, dtype, n in keys:
        one_series(fig["legend"], "ms_vs_t", "gpt2attn %s %s " % (preset, dtype), threads(n))
    ours = [label for label in fig["legend"] if label.startswith("gpt2attn gpt2") and "peer_torch" not in label]
    check(len(ours) == len(keys), "ms_vs_t: %d bench series for the %d cases %s" % (len(ours), len(keys), ours))
    for peer in rows(os.path.join(out, "peer.jsonl")):
        for engine in ("gpt2attn f32", "gpt2attn bf16", "PyTorch %s fp32" % peer["torch"],
                       "PyTorch %s bf16" % peer["torch"]):
            one_series(fig["legend"], "ms_vs_t", engine + " " + peer["preset"], threads(peer["threads"]), "peer_torch")
    check("ms" in fig["ylabel"] and "tokens" in fig["xlabel"], "ms_vs_t axes %r, %r" % (fig["xlabel"], fig["ylabel"]))
    titled(fig, "ms_vs_t", prefill)

    fig = figs["decode_tokens_per_s.png"]
    keys = {(b["dtype"], b["kv_dtype"], b["seq"], b["threads"]) for b in decode}
    for dtype, kv, t, n in keys:
        one_series(fig["legend"], "decode", "gpt2-small %s " % dtype, "T=%d," % t, " %s K/V" % kv, threads(n))
    check(len([label for label in fig["legend"] if label != BUSY_NOTE]) == len(keys),
          "decode: %d series for %d cases" % (len(fig["legend"]), len(keys)))
    check("tokens/s" in fig["ylabel"] and "sequences" in fig["xlabel"], "decode axes %r" % fig)
    check((BUSY_NOTE in fig["legend"]) == any(b["busy"] for b in decode), "decode busy note: %s" % fig["legend"])
    titled(fig, "decode", decode)

    fig = figs["roofline.png"]
    for q in rows(os.path.join(out, "peak.jsonl")) + rows(os.path.join(out, "triad.jsonl")):
        roof = "%.0f GFLOP/s" % q["gflops"] if "gflops" in q else "%.0f GB/s" % q["gbps"]
        check(any(roof in label and threads(q["threads"]) in label for label in fig["legend"]),
              "roofline: no roof %r: %s" % (roof, fig["legend"]))
    for b in prefill:
        one_series(fig["legend"], "roofline", "prefill %s %s " % (b["preset"], b["dtype"]), threads(b["threads"]))
    for b in decode:
        one_series(fig["legend"], "roofline", "decode gpt2-small %s " % b["dtype"], " %s K/V" % b["kv_dtype"])
    check("GFLOP/s" in fig["ylabel"] and "FLOP per byte" in fig["xlabel"], "roofline axes %r" % fig)
    titled(fig, "roofline", bench)
    return "%d bench rows, 3 PNGs %s" % (len(bench), sizes[0])


def busy_rows_flagged(r):
    """A row marked busy adds the hollow-marker note to the legend; without one there is no note."""
    wd = r.workdir()
    p = pc.run_cli(r.cli, ["bench", "--preset", "gpt2-small", "--mode", "decode", "--seq", "16", "--batch", "2",
                           "--repeats", "1", "--threads", "1", "--json"])
    check(p.returncode == 0, "bench exit %d" % p.returncode)
    row = json.loads(p.stdout.splitlines()[0])
    notes = []
    for busy in (False, True):
        path = os.path.join(wd, "busy_%s.jsonl" % busy)
        with open(path, "w") as f:
            f.write(json.dumps(dict(row, busy=busy)) + "\n")
        q = plot(["--out", os.path.join(wd, str(busy)), "--bench", path])
        check(q.returncode == 0, "plot.py exit %d: %s" % (q.returncode, q.stderr[-300:]))
        with open(os.path.join(wd, str(busy), "plots.json")) as f:
            notes.append(BUSY_NOTE in json.load(f)["decode_tokens_per_s.png"]["legend"])
    check(notes == [False, True], "busy note present (not busy, busy): %s" % notes)
    return None


def google_benchmark_rows(r):
    """bench_gpt2attn's F32/layer and Bf16/layer JSON: a series each, naming the dtype and threads."""
    if missing_tools(r, "bench_gpt2attn"):
        return "skipped: bench_gpt2attn not built"
    exe = os.path.join(os.path.dirname(r.cli), "bench", "bench_gpt2attn")
    wd = r.workdir()
    gb = os.path.join(wd, "gbench.json")
    with open(gb, "w") as f:
        p = subprocess.run([exe, "--benchmark_filter=^(F32|Bf16)/layer/gpt2-small/T:1024/",
                            "--benchmark_format=json"], stdout=f, stderr=subprocess.PIPE, text=True, timeout=300)
    check(p.returncode == 0, "bench_gpt2attn exit %d: %s" % (p.returncode, p.stderr[-300:]))
    q = plot(["--out", wd, "--gbench", gb])
    check(q.returncode == 0, "plot.py exit %d: %s" % (q.returncode, q.stderr[-300:]))
    with open(os.path.join(wd, "plots.json")) as f:
        fig = json.load(f)["ms_vs_t.png"]
    with open(gb) as f:
        doc = json.load(f)
    for name in {b["run_name"] for b in doc["benchmarks"]}:  # F32/layer/gpt2-small/T:1024/threads:2/...
        family, kind, preset, _, n = name.split("/")[:5]
        one_series(fig["legend"], "gbench", "bench_gpt2attn %s/%s %s %s" % (family, kind, preset, family.lower()),
                   threads(int(n.split(":")[1])))
    check(len(fig["legend"]) == 2, "gbench: series %s" % fig["legend"])
    date = doc["context"]["date"][:10]
    check(date in fig["title"], "title %r lacks the run's date %s" % (fig["title"], date))
    return "%d series" % len(fig["legend"])


def peers_rows(r):
    """bench/peers/run.py's lines (written here as it writes them: the run header with its roofs, our rows, peer rows,
    a peer's error row): peers_speedup.png with a legend entry per peer engine and one for the peer that could not
    run, ours never a bar, the rows' CPU and date in the title; and peers_roofline.png with every engine that has a
    timed row (ours too, the failed peer not) and the header's roofs at its thread count."""
    wd = r.workdir()
    path = os.path.join(wd, "peers.jsonl")
    base = {"kind": "peers", "mode": "prefill", "preset": "gpt2-small", "seq": 1024, "batch": 1, "heads": 12,
            "kv_heads": 12, "threads": 2, "cpu": "Test CPU", "timestamp": "2026-11-29T08:00:00Z"}
    work = {"flops": 6.4e9, "bytes": 1.6e7}
    lines = [{"kind": "run", "cpu": "Test CPU", "date": "2026-11-29T08:00:00Z",
              "roofs": {"triad": {"2": 13.5}, "peak": {"2": 185.0}}},
             dict(base, dtype="fp32", engine="gpt2attn", error=None, median_ms=70.0, speedup=1.0, gflops=91.0, **work),
             dict(base, dtype="fp32", engine="torch-sdpa", error=None, median_ms=140.0, speedup=2.0,
                  speedup_min=1.8, speedup_max=2.2, gflops=46.0, **work),
             dict(base, dtype="fp32", engine="openvino-sdpa", error=None, median_ms=63.0, speedup=0.9, gflops=101.0,
                  **work),
             dict(base, dtype="bf16", engine="gpt2attn", error=None, median_ms=60.0, speedup=1.0, gflops=107.0,
                  **work),
             dict(base, dtype="bf16", engine="ort-mha", error="NOT_IMPLEMENTED: no bf16 kernel", median_ms=None)]
    with open(path, "w") as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))
    p = plot(["--out", os.path.join(wd, "o"), "--peers", path])
    check(p.returncode == 0, "plot.py exit %d: %s" % (p.returncode, p.stderr[-300:]))
    names = [os.path.basename(w) for w in p.stdout.split()]
    check(names == ["peers_speedup.png", "peers_roofline.png", "plots.json"], "wrote %r" % p.stdout)
    png_size(p.stdout.split()[0])
    png_size(p.stdout.split()[1])
    with open(os.path.join(wd, "o", "plots.json")) as f:
        figs = json.load(f)
    roof = figs["peers_roofline.png"]["legend"]
    for label in ("gpt2attn", "torch-sdpa", "openvino-sdpa", "prefill fp32 2t", "prefill bf16 2t",
                  "fp32 FMA peak, 2 threads: 185 GFLOP/s", "triad bandwidth, 2 threads: 14 GB/s"):
        check(label in roof, "roofline: no legend entry %r: %s" % (label, roof))
    check("ort-mha" not in roof, "roofline: the failed peer drawn: %s" % roof)
    fig = figs["peers_speedup.png"]
    for e in ("torch-sdpa", "openvino-sdpa", "ort-mha"):
        check(e in fig["legend"], "peers: no legend entry for %s: %s" % (e, fig["legend"]))
    check("gpt2attn" not in fig["legend"], "peers: ours drawn as a peer: %s" % fig["legend"])
    check(any(label.startswith("could not run") for label in fig["legend"]), "peers: no cross: %s" % fig["legend"])
    check("Test CPU" in fig["title"] and "2026-11-29" in fig["title"], "peers: title %r" % fig["title"])
    return None


def only_what_inputs_allow(r):
    """Decode rows alone: the decode picture and nothing that needs prefill, peer or peak rows."""
    wd = r.workdir()
    bench = os.path.join(wd, "decode.jsonl")
    p = pc.run_cli(r.cli, ["bench", "--preset", "gpt2-small", "--mode", "decode", "--seq", "16", "--batch", "2",
                           "--repeats", "1", "--threads", "1", "--json"])
    check(p.returncode == 0, "bench exit %d" % p.returncode)
    with open(bench, "w") as f:
        f.write(p.stdout)
    p = plot(["--out", os.path.join(wd, "o"), "--bench", bench])
    check(p.returncode == 0, "plot.py exit %d: %s" % (p.returncode, p.stderr[-300:]))
    names = [os.path.basename(w) for w in p.stdout.split()]
    check(names == ["decode_tokens_per_s.png", "plots.json"], "wrote %r" % p.stdout)
    png_size(p.stdout.split()[0])
    return None


def bad_input(r):
    wd = r.workdir()
    broken = os.path.join(wd, "broken.jsonl")
    with open(broken, "w") as f:
        f.write('{"mode": "prefill", "gflops": \n')
    p = plot(["--out", os.path.join(wd, "o"), "--bench", broken])
    check(p.returncode == 2 and "not JSON" in p.stderr, "exit %d, stderr %r" % (p.returncode, p.stderr))
    p = plot(["--out", os.path.join(wd, "o"), "--bench", os.path.join(wd, "missing.jsonl")])
    check(p.returncode == 2 and "missing.jsonl" in p.stderr, "exit %d, stderr %r" % (p.returncode, p.stderr))
    empty = os.path.join(wd, "empty.jsonl")
    open(empty, "w").close()
    p = plot(["--out", os.path.join(wd, "o"), "--bench", empty])
    check(p.returncode == 2 and "nothing to draw" in p.stderr, "exit %d, stderr %r" % (p.returncode, p.stderr))
    old = os.path.join(wd, "old.jsonl")  # a row without the fields a series is named by
    with open(old, "w") as f:
        f.write('{"mode": "prefill", "preset": "gpt2-small", "seq": 64, "batch": 1, "median_ms": 1.0, "gflops": 9}\n')
    p = plot(["--out", os.path.join(wd, "o"), "--bench", old])
    check(p.returncode == 2 and "prefill row without dtype, isa, threads" in p.stderr,
          "exit %d, stderr %r" % (p.returncode, p.stderr))
    return None


def main():
    r = pc.Runner("scripts/plot.py")
    r.case("bench_sh_pictures", lambda: bench_sh_pictures(r))
    r.case("busy_rows_flagged", lambda: busy_rows_flagged(r))
    r.case("google_benchmark_rows", lambda: google_benchmark_rows(r))
    r.case("peers_rows", lambda: peers_rows(r))
    r.case("only_what_inputs_allow", lambda: only_what_inputs_allow(r))
    r.case("bad_input", lambda: bad_input(r))
    r.finish()


if __name__ == "__main__":
    main()
