# bench/peer_common.py: what the peer scripts (peer_torch.py, peer_torch_decode.py) share: the thread
# environment both sides run under, running a tool that prints JSON lines, and the compiled-in preset shapes.
# It times nothing itself.
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def thread_env(threads):
    """The environment for a child (torch or our CLI) at `threads` threads. Debian's torch calls the system
    BLAS (OpenBLAS, pthread build), whose pool torch.set_num_threads does not size: the variables do."""
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[k] = str(threads)
    return env


def run_json_lines(cmd, env=None):
    """Runs cmd; returns the JSON objects of its stdout lines that start with '{'. Exits on failure."""
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        prog = os.path.splitext(os.path.basename(sys.argv[0]))[0]
        sys.exit(f"{prog}: {' '.join(cmd)} failed ({p.returncode}):\n{p.stderr}")
    return [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]


def presets_table(cli):
    """preset -> (E, H) from `gpt2attn presets` (the compiled-in presets, so both sides use the same shapes)."""
    p = subprocess.run([cli, "presets"], capture_output=True, text=True, check=True)
    table = {}
    for line in p.stdout.splitlines()[1:]:
        f = line.split()
        if len(f) >= 3:
            table[f[0]] = (int(f[1]), int(f[2]))
    return table
