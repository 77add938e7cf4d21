# tests/python/test_plot.py: scripts/plot.py on a small bench run of the real CLI writes valid PNGs, one per
# picture its inputs allow, and refuses input it cannot read with exit 2.
import json
import os
import struct
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "plot.py")


def plot(args):
    return subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, timeout=300)


def png_size(path):
    """(width, height) of a PNG file, after checking its signature and IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    check(head[:8] == b"\x89PNG\r\n\x1a\n", "%s is not a PNG (signature %r)" % (path, head[:8]))
    check(head[12:16] == b"IHDR", "%s: no IHDR chunk first" % path)
    return struct.unpack(">II", head[16:24])


def bench_lines(r, wd):
    path = os.path.join(wd, "bench.jsonl")
    with open(path, "w") as f:
        for args in (["--seq", "32"], ["--seq", "64"], ["--mode", "decode", "--seq", "32", "--batch", "1"],
                     ["--mode", "decode", "--seq", "32", "--batch", "4"],
                     ["--mode", "decode", "--seq", "32", "--batch", "4", "--kv-dtype", "int8"]):
            p = pc.run_cli(r.cli, ["bench", "--preset", "gpt2-small", "--repeats", "1", "--threads", "1", "--json"]
                           + args)
            check(p.returncode == 0, "bench %s: exit %d %s" % (args, p.returncode, p.stderr[-300:]))
            f.write(p.stdout)
    return path


def all_pictures(r):
    wd = r.workdir()
    bench = bench_lines(r, wd)
    peak, triad, peer = (os.path.join(wd, n) for n in ("peak.jsonl", "triad.jsonl", "peer.jsonl"))
    with open(peak, "w") as f:  # the schemas of fma_peak_cli, stream_triad_cli and peer_torch.py --json
        f.write('{"threads": 1, "gflops": 220.0, "isa": "avx512", "op": "fma"}\n')
        f.write('{"threads": 1, "gflops": 440.0, "isa": "avx512_bf16", "op": "bf16dot"}\n')
    with open(triad, "w") as f:
        f.write('{"threads": 1, "gbps": 35.0}\n')
    with open(peer, "w") as f:
        for t, ours, torch_ms in ((32, 0.4, 1.1), (64, 0.7, 2.0)):
            f.write(json.dumps({"preset": "gpt2-small", "seq": t, "threads": 1, "ours_ms": ours,
                                "torch_ms": torch_ms}) + "\n")
    out = os.path.join(wd, "plots")
    p = plot(["--out", out, "--bench", bench, "--peak", peak, "--triad", triad, "--peer", peer])
    check(p.returncode == 0, "plot.py exit %d: %s" % (p.returncode, p.stderr[-400:]))
    written = p.stdout.split()
    names = sorted(os.path.basename(w) for w in written)
    check(names == ["decode_tokens_per_s.png", "ms_vs_t.png", "roofline.png"], "wrote %s" % names)
    sizes = [png_size(w) for w in written]
    check(all(w >= 400 and h >= 300 for w, h in sizes), "image sizes %s" % sizes)
    return "3 PNGs %s" % sizes[0:1]


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
    check([os.path.basename(w) for w in p.stdout.split()] == ["decode_tokens_per_s.png"], "wrote %r" % p.stdout)
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
    return None


def main():
    r = pc.Runner("scripts/plot.py")
    r.case("all_pictures", lambda: all_pictures(r))
    r.case("only_what_inputs_allow", lambda: only_what_inputs_allow(r))
    r.case("bad_input", lambda: bad_input(r))
    r.finish()


if __name__ == "__main__":
    main()
