#!/usr/bin/python3
"""ctest python.pip_install: `pip install .` and `pip wheel .` of the source tree into a fresh virtual environment,
then the package imported from a directory outside the tree, as a user who only has pip would use it.

    test_pip_install.py --source SRC --work DIR

The venv sees the system's site-packages (Debian's numpy and torch: nothing else is fetched at run time); pip fetches
the build backend (scikit-build-core) from the package index, so without the index the test is skipped (exit 77,
the reason printed)."""
import argparse
import os
import shutil
import subprocess
import sys
import zipfile

SKIP = 77


def run(cmd, **kw):
    print("$ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if r.returncode != 0:
        print(r.stdout[-6000:])
        raise SystemExit(f"FAIL: exit {r.returncode}: {' '.join(cmd)}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    venv = os.path.join(a.work, "venv")
    shutil.rmtree(venv, ignore_errors=True)
    os.makedirs(a.work, exist_ok=True)
    run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv])
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "--disable-pip-version-check"]
    probe = subprocess.run(pip + ["download", "--no-deps", "-q", "-d", os.path.join(a.work, "probe"),
                                 "scikit-build-core"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=300)
    if probe.returncode != 0:
        print("SKIP: pip cannot fetch the build backend scikit-build-core from the package index:\n" +
              probe.stdout[-1500:])
        return SKIP

    os.environ.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))  # scikit-build-core's make: -j1
    build_dir = os.path.join(a.work, "skbuild")
    opts = [f"--config-settings=build-dir={build_dir}", "--config-settings=cmake.define.GPT2ATTN_WERROR=ON"]
    # `pip install .` is `pip wheel .` (the backend's build_wheel) and the install of that wheel: done in those two
    # steps, the library is compiled once and the wheel itself can be inspected.
    wheels = os.path.join(a.work, "wheels")
    shutil.rmtree(wheels, ignore_errors=True)
    run(pip + ["wheel", "-q", "--no-deps", "-w", wheels] + opts + [a.source])

    # The wheel: the package's Python files, the module and one copy of each library under its SONAME (the model
    # library's is the release, gpt2attn-VERSION-....whl).
    (wheel,) = [f for f in os.listdir(wheels) if f.endswith(".whl")]
    version = wheel.split("-")[1]
    names = zipfile.ZipFile(os.path.join(wheels, wheel)).namelist()
    pkg = sorted(n for n in names if n.startswith("gpt2attn/"))
    print("wheel", wheel, pkg)
    for want in ("gpt2attn/__init__.py", "gpt2attn/torch.py", "gpt2attn/hf.py", "gpt2attn/libgpt2attn.so.1",
                 f"gpt2attn/libgpt2attn_model.so.{version}"):
        assert want in pkg, f"{want} is not in the wheel: {pkg}"
    assert sum(n.startswith("gpt2attn/_gpt2attn.") and n.endswith(".so") for n in pkg) == 1, pkg
    for lib in ("gpt2attn/libgpt2attn.", "gpt2attn/libgpt2attn_model."):
        assert sum(n.startswith(lib) for n in pkg) == 1, f"{lib} more than once: {pkg}"
    run(pip + ["install", "-q", os.path.join(wheels, wheel)])

    # Imported from outside the source tree: the venv's package, its bundled library, a layer, the torch module.
    check = r'''
import os, numpy as np, torch, gpt2attn, gpt2attn.torch
here = os.path.dirname(gpt2attn.__file__)
assert here.startswith(os.environ["VENV"]), here
libs = {l.split()[-1] for l in open("/proc/self/maps") if "libgpt2attn" in l}
assert libs == {os.path.join(here, "libgpt2attn.so.1"),
                os.path.join(here, "libgpt2attn_model.so." + gpt2attn.__version__)}, libs
cfg = gpt2attn.Config(64, 4, context_length=32, causal=True)
w = gpt2attn.Weights.random(cfg, 1)
x = np.random.default_rng(0).standard_normal((2, 9, 64)).astype(np.float32)
err = np.abs(gpt2attn.CausalSelfAttention(cfg, w).forward(x) - gpt2attn.reference_forward(cfg, w, x)).max()
assert err < 1e-5, err
m = gpt2attn.torch.MultiheadAttention(64, 4, batch_first=True).eval()
with torch.inference_mode():
    m(torch.from_numpy(x), torch.from_numpy(x), torch.from_numpy(x), need_weights=False)
assert m.last_path == "gpt2attn", m.last_path
gpt2 = gpt2attn.GPT2.random(dict(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2), threads=1)
assert len(gpt2.generate([1, 2, 3], max_new_tokens=4)[0]["new_ids"]) == 4
print("imported", gpt2attn.__version__, "from", here, "isa", gpt2attn.best_isa(), "max err", err)
'''
    env = dict(os.environ, VENV=venv)
    env.pop("PYTHONPATH", None)
    print(run([os.path.join(venv, "bin", "python"), "-c", check], cwd=a.work, env=env))
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
