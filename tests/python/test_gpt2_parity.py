# tests/python/test_gpt2_parity.py: a whole GPT-2's logits (`gpt2attn logits`) against a float64 PyTorch GPT-2
# (tests/python/gpt2_reference.py, itself checked against Hugging Face transformers' GPT2LMHeadModel by
# python.hf_transformers) on the same checkpoints of scripts/make_gpt2_checkpoint.py with random biases and LayerNorm
# weights (--perturb-norms), teacher forced over 128 positions: a tiny model, gpt2-small's width with 2 layers and with
# its 12, f32 and bf16 compute, stored F32, BF16 (sharded, no prefix). Bound: model_tolerance of
# include/gpt2attn/tolerance.hpp, mirrored below; the figures each case prints are the measured errors.
import math
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpt2_reference  # noqa: E402
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402

SCRIPT = os.path.join(HERE, "..", "..", "scripts", "make_gpt2_checkpoint.py")
T = 128


def model_tolerance(compute, n_layer, inner, max_abs_logit):
    """tolerance.hpp's model_tolerance: (rtol, atol)."""
    rtol = 16.0 * 2.0 ** -24 * math.sqrt(max(1, inner))
    chain = 2 * n_layer + 1
    scale = max(1.0, max_abs_logit)
    atol = rtol * scale * chain
    if compute == "bf16":
        atol += (5 + 3) * 2.0 ** -8 * math.sqrt(chain) * scale
    return rtol, atol


def make(out, *args):
    subprocess.run([sys.executable, SCRIPT, out, "--perturb-norms"] + list(args), check=True, capture_output=True)
    return out


def parity(r, model, compute, n_layer, inner, extra=()):
    out = os.path.join(r.tmp, "logits.npy")
    ref_model = gpt2_reference.load_checkpoint(model)  # (config, tensors)
    ids = [(t * 7919 + 13) % ref_model[0]["vocab_size"] for t in range(T)]
    p = pc.run_cli(r.cli, ["logits", "--model", model, "--ids", ",".join(map(str, ids)), "--output", out,
                           "--dtype", compute, "--threads", "2"] + list(extra))
    check(p.returncode == 0, "logits failed: %s" % p.stderr.strip())
    got = np.load(out).astype(np.float64)
    want = np.asarray(gpt2_reference.logits(ref_model, ids), dtype=np.float64)
    check(got.shape == want.shape, "shape %s, expected %s" % (got.shape, want.shape))
    m = float(np.abs(want).max())
    rtol, atol = model_tolerance(compute, n_layer, inner, m)
    err = np.abs(got - want)
    bad = err > atol + rtol * np.abs(want)
    worst = np.unravel_index(int(err.argmax()), err.shape)
    check(not bad.any(), "%d logits out of tolerance; worst %s: got %.6g, expected %.6g (atol %.3g)"
          % (int(bad.sum()), worst, got[worst], want[worst], atol))
    agree = float((got.argmax(1) == want.argmax(1)).mean())
    return "max err %.2e = %.2e of max|logit| %.3f (allowed %.2e), mean %.2e, argmax agrees at %.3f" % (
        err.max(), err.max() / m, m, atol, err.mean(), agree)


def main():
    r = pc.Runner("GPT-2 logits against a float64 PyTorch GPT-2")
    tiny = make(os.path.join(r.tmp, "tiny"), "--n-embd", "64", "--n-head", "4", "--layers", "2", "--vocab", "500",
                "--n-positions", "160", "--seed", "3")
    tiny_bf16 = make(os.path.join(r.tmp, "tiny-bf16"), "--n-embd", "64", "--n-head", "4", "--layers", "2", "--vocab",
                     "500", "--n-positions", "160", "--seed", "4", "--dtype", "BF16", "--shards", "3", "--no-prefix")
    small2 = make(os.path.join(r.tmp, "small2"), "--preset", "gpt2-small", "--layers", "2", "--seed", "1")
    r.case("tiny_f32", parity, r, tiny, "f32", 2, 256)
    r.case("tiny_bf16", parity, r, tiny, "bf16", 2, 256)
    r.case("tiny_stored_bf16_sharded_f32", parity, r, tiny_bf16, "f32", 2, 256)
    r.case("small_2_layers_f32", parity, r, small2, "f32", 2, 3072)
    r.case("small_2_layers_bf16", parity, r, small2, "bf16", 2, 3072)
    small12 = make(os.path.join(r.tmp, "small12"), "--preset", "gpt2-small", "--seed", "2")
    r.case("small_12_layers_f32", parity, r, small12, "f32", 12, 3072)
    r.case("small_12_layers_bf16", parity, r, small12, "bf16", 12, 3072)
    r.finish()


if __name__ == "__main__":
    main()
