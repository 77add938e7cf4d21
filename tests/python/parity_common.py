# tests/python/parity_common.py: shared helpers for the CLI parity scripts (test_*.py): a tiny safetensors
# writer, running `gpt2attn forward`, the float32 tolerance policy of tests/tolerance.hpp, and the case runner.
# It never works around the CLI: a result that breaks the contract is reported as a failure.
import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import traceback

import numpy as np
import torch

CLI_TIMEOUT_S = 60


# ---------------------------------------------------------------------------------------------------------
# Case runner: one line per case (`ok name` / `FAIL name: detail`), closing `N passed, M failed`.

class CaseFailure(Exception):
    pass


def check(cond, detail):
    if not cond:
        raise CaseFailure(detail)


class Runner:
    def __init__(self, description):
        ap = argparse.ArgumentParser(description=description)
        ap.add_argument("--cli", required=True, help="path to the gpt2attn binary")
        ap.add_argument("-k", dest="filter", default=None, help="run only cases whose name contains this")
        self.args = ap.parse_args()
        self.cli = os.path.abspath(self.args.cli)
        self.passed = 0
        self.failed = 0
        self._tmp = tempfile.TemporaryDirectory(prefix="gpt2attn_py_")
        self.tmp = self._tmp.name
        self._n = 0
        torch.set_num_threads(2)

    def workdir(self):
        """A fresh, empty directory for one case's files."""
        self._n += 1
        d = os.path.join(self.tmp, "case%03d" % self._n)
        os.makedirs(d)
        return d

    def case(self, name, fn, *args, **kwargs):
        if self.args.filter and self.args.filter not in name:
            return
        try:
            extra = fn(*args, **kwargs)
        except CaseFailure as e:
            self.failed += 1
            print("FAIL %s: %s" % (name, e), flush=True)
            return
        except Exception:  # a bug in the test itself still counts as a failure, with its trace
            self.failed += 1
            print("FAIL %s: test raised %s" % (name, traceback.format_exc().strip().replace("\n", " | ")),
                  flush=True)
            return
        self.passed += 1
        print("ok %s%s" % (name, (" (%s)" % extra) if extra else ""), flush=True)

    def finish(self):
        print("%d passed, %d failed" % (self.passed, self.failed), flush=True)
        self._tmp.cleanup()
        sys.exit(0 if self.failed == 0 and self.passed > 0 else 1)


# ---------------------------------------------------------------------------------------------------------
# safetensors files: the writer is scripts/export_safetensors.py, the supported exporter, used here as users use it.

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from export_safetensors import safetensors_bytes, write_safetensors  # noqa: E402,F401


def state_dict_of(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def hf_gpt2_layout(sd, prefix=""):
    """torch MHA state dict (fused in_proj_weight) -> Hugging Face GPT-2 Conv1D names (x @ W + b)."""
    out = {prefix + "c_attn.weight": sd["in_proj_weight"].t().contiguous(),
           prefix + "c_proj.weight": sd["out_proj.weight"].t().contiguous()}
    if "in_proj_bias" in sd:
        out[prefix + "c_attn.bias"] = sd["in_proj_bias"]
    if "out_proj.bias" in sd:
        out[prefix + "c_proj.bias"] = sd["out_proj.bias"]
    return out


# ---------------------------------------------------------------------------------------------------------
# Running the CLI.

def save_npy(path, a):
    np.save(path, a, allow_pickle=False)
    return path


def run_cli(cli, args, timeout=CLI_TIMEOUT_S):
    """subprocess.CompletedProcess of `cli args...`; a timeout is a CaseFailure."""
    try:
        return subprocess.run([cli] + [str(a) for a in args], capture_output=True, text=True,
                              timeout=timeout, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        raise CaseFailure("timed out after %ds: %s" % (timeout, fmt_cmd(cli, args)))


def fmt_cmd(cli, args):
    return " ".join([os.path.basename(cli)] + [str(a) for a in args])


def forward(cli, wd, weights, heads, query, key=None, value=None, mask=None, mask_kind=None,
            key_padding=None, causal=False, context_length=None, threads=None, prefix=None,
            extra=(), tag="y", timeout=CLI_TIMEOUT_S):
    """Runs `gpt2attn forward` on numpy inputs saved in wd; returns the float32 output array.

    Anything but exit 0 with a float32 (B, T, E) output is a CaseFailure carrying the command and stderr."""
    args = ["forward", "--weights", weights] + ([] if heads is None else ["--heads", heads])  # None: --config in extra
    args += ["--query", save_npy(os.path.join(wd, tag + "_q.npy"), query)]
    if prefix is not None:
        args += ["--prefix", prefix]
    if key is not None:
        args += ["--key", save_npy(os.path.join(wd, tag + "_k.npy"), key)]
    if value is not None:
        args += ["--value", save_npy(os.path.join(wd, tag + "_v.npy"), value)]
    if mask is not None:  # mask_kind None: the CLI's default, torch's reading of the mask's dtype
        args += ["--mask", save_npy(os.path.join(wd, tag + "_m.npy"), mask)]
        args += [] if mask_kind is None else ["--mask-kind", mask_kind]
    if key_padding is not None:
        args += ["--key-padding", save_npy(os.path.join(wd, tag + "_kp.npy"), key_padding)]
    if causal:
        args += ["--causal"]
    if context_length is not None:
        args += ["--context-length", context_length]
    if threads is not None:
        args += ["--threads", threads]
    args += list(extra)
    out = os.path.join(wd, tag + "_out.npy")
    args += ["--output", out]
    p = run_cli(cli, args, timeout=timeout)
    if p.returncode != 0:
        raise CaseFailure("exit %d (expected 0): %s; stderr: %s"
                          % (p.returncode, fmt_cmd(cli, args), p.stderr.strip()[-500:]))
    check(os.path.exists(out), "exit 0 but no output file: %s" % fmt_cmd(cli, args))
    y = np.load(out, allow_pickle=False)
    check(y.dtype == np.float32, "output dtype %s, expected float32" % y.dtype)
    return y


# ---------------------------------------------------------------------------------------------------------
# Comparison: the policy of tests/tolerance.hpp, for float32 computation against a float64 reference.

def tolerance(reduction_length, max_abs_ref, unit_roundoff=2.0 ** -24):
    rtol = 16.0 * unit_roundoff * math.sqrt(max(1, reduction_length))
    return rtol, rtol * max(1.0, max_abs_ref)


def compare(got, expected, reduction_length, what="output"):
    """Raises CaseFailure unless got ~= expected (float64) element-wise; NaN where expected is finite fails.
    Returns a short 'max err' note for the ok line."""
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    check(got.shape == expected.shape, "%s shape %s, expected %s" % (what, got.shape, expected.shape))
    check(np.all(np.isfinite(expected)), "test bug: reference for %s is not finite" % what)
    max_ref = float(np.max(np.abs(expected))) if expected.size else 0.0
    rtol, atol = tolerance(reduction_length, max_ref)
    err = np.abs(got - expected)
    allowed = atol + rtol * np.abs(expected)
    bad = ~(np.isfinite(got) & (err <= allowed))
    if np.any(bad):
        idx = np.argwhere(bad)[:4]
        parts = ["[%s] expected %.9g got %.9g err %.3g allowed %.3g"
                 % (",".join(map(str, i)), expected[tuple(i)], got[tuple(i)], err[tuple(i)], allowed[tuple(i)])
                 for i in idx]
        raise CaseFailure("%s: %d of %d elements out of tolerance (rtol %.3g, atol %.3g): %s"
                          % (what, int(bad.sum()), bad.size, rtol, atol, "; ".join(parts)))
    return "max err %.2g" % (float(np.max(err)) if err.size else 0.0)


def compare_with_dead_rows(got, expected, dead_rows, out_bias, reduction_length, what="output"):
    """Like compare(), but rows (b, t) in dead_rows (a (B, T) bool array: nothing may be attended) must equal
    the output bias (zeros when the layer has none) where torch gives NaN."""
    expected = np.array(expected, dtype=np.float64)
    dead_rows = np.asarray(dead_rows, dtype=bool)
    E = expected.shape[-1]
    bias = np.zeros(E) if out_bias is None else np.asarray(out_bias, dtype=np.float64)
    # torch must be NaN exactly on the dead rows (guards the test's own idea of which rows are dead)
    nan_rows = np.all(np.isnan(expected), axis=-1)
    check(np.array_equal(nan_rows, dead_rows), "test bug: torch NaN rows %s != expected dead rows %s"
          % (np.argwhere(nan_rows).tolist(), np.argwhere(dead_rows).tolist()))
    expected[dead_rows] = bias
    note = compare(got, expected, reduction_length, what)
    return note + ", %d dead rows = bias" % int(dead_rows.sum())


# ---------------------------------------------------------------------------------------------------------
# torch references.

def torch_mha(module, q, k, v, attn_mask=None, key_padding_mask=None):
    """Output of a batch_first nn.MultiheadAttention on numpy inputs, in the module's dtype, as numpy (a bfloat16
    module's as float32, exactly: numpy has no bfloat16)."""
    dt = next(module.parameters()).dtype
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)).to(dt) for a in (q, k, v))
    am = None if attn_mask is None else torch.as_tensor(attn_mask)
    if am is not None and am.is_floating_point():
        am = am.to(dt)
    kpm = None if key_padding_mask is None else torch.as_tensor(key_padding_mask)
    # grad stays enabled: torch 1.13's fast path (and its NaN/zero conventions) is then never taken
    y, _ = module(tq, tk, tv, attn_mask=am, key_padding_mask=kpm, need_weights=False)
    y = y.detach()
    return (y.float() if y.dtype == torch.bfloat16 else y).numpy()


def causal_block_mask(T, Tk):
    """torch-style bool attn_mask (True = may not attend) for bottom-right-aligned causality."""
    return torch.triu(torch.ones(T, Tk), diagonal=Tk - T + 1).bool()


def with_causal(t_mask, causal):
    """A torch attn_mask (None, bool or float) with the bool causal mask merged in, as torch 1.13 takes both."""
    if t_mask is None:
        return causal
    if t_mask.dtype == torch.bool:
        return t_mask | causal
    return t_mask.masked_fill(causal, float("-inf"))


def reduction_length(E, Tk):
    return max(E, Tk)
