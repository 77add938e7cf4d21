# tests/python/test_cli_quantize.py: `gpt2attn quantize` writes a layer's int8 or int4 codes once, and `gpt2attn forward
# --weights` takes that file: its output is bit for bit forward's on the float file with --weights-dtype, for a torch
# layer with grouped K/V heads (their count read from the file's widths) in f32 and bf16, and a Hugging Face GPT-2
# block under a prefix with a --config. Refusals: a --weights-dtype or --prefix the quantized file does not hold, an --output
# over the input, no heads, a --config or --preset that disagrees with the weights, a quantized file cut short.
import json
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402


def quantize(r, args):
    p = pc.run_cli(r.cli, ["quantize"] + args)
    check(p.returncode == 0, "exit %d: %s; stderr: %s" % (p.returncode, pc.fmt_cmd(r.cli, ["quantize"] + args),
                                                           p.stderr.strip()[-500:]))
    return p


def refused(r, args, pattern):
    """Exit 2 with one stderr line matching `pattern` (the bad-input contract)."""
    p = pc.run_cli(r.cli, args)
    msg = p.stderr.strip()
    check(p.returncode == 2, "exit %d (expected 2): %s; stderr %r" % (p.returncode, pc.fmt_cmd(r.cli, args), msg))
    check(len(msg.splitlines()) == 1, "stderr is not one line: %r" % msg)
    check(re.search(pattern, msg), "stderr %r does not match %r" % (msg, pattern))
    return msg


def torch_gqa_file(wd, E=64, KW=32, seed=3):
    """A torch-named layer with grouped K/V heads: in_proj_weight (E + 2 KW, E)."""
    g = torch.Generator().manual_seed(seed)
    sd = {"in_proj_weight": torch.randn(E + 2 * KW, E, generator=g) * 0.1,
          "in_proj_bias": torch.randn(E + 2 * KW, generator=g) * 0.1,
          "out_proj.weight": torch.randn(E, E, generator=g) * 0.1, "out_proj.bias": torch.randn(E, generator=g) * 0.1}
    return pc.write_safetensors(os.path.join(wd, "gqa.safetensors"), sd)


def same_as_quantizing_at_load(r):
    wd = r.workdir()
    rng = np.random.default_rng(5)
    weights = torch_gqa_file(wd)
    x = rng.standard_normal((2, 11, 64)).astype(np.float32)
    notes = []
    for fmt in ("int8", "int4"):
        q = os.path.join(wd, fmt + ".safetensors")
        quantize(r, ["--weights", weights, "--heads", "4", "--weights-dtype", fmt, "--output", q])
        for dtype in ("f32", "bf16"):
            want = pc.forward(r.cli, wd, weights, 4, x, causal=True, extra=["--weights-dtype", fmt, "--dtype", dtype],
                              tag="want")
            got = pc.forward(r.cli, wd, q, 4, x, causal=True, extra=["--dtype", dtype], tag="got")
            check(np.array_equal(want, got), "%s %s: forward on the quantized file differs from --weights-dtype "
                  "(max |diff| %.3g)" % (fmt, dtype, float(np.abs(want - got).max())))
            named = pc.forward(r.cli, wd, q, 4, x, causal=True, extra=["--dtype", dtype, "--weights-dtype", fmt],
                               tag="named")
            check(np.array_equal(named, got), "%s %s: naming the file's format changed the output" % (fmt, dtype))
        notes.append("%s %d bytes" % (fmt, os.path.getsize(q)))
    return ", ".join(notes) + " (float file %d bytes)" % os.path.getsize(weights)


def hf_block_with_config(r):
    wd = r.workdir()
    rng = np.random.default_rng(6)
    module = torch.nn.MultiheadAttention(48, 4, batch_first=True)
    weights = pc.write_safetensors(os.path.join(wd, "hf.safetensors"),
                                   pc.hf_gpt2_layout(pc.state_dict_of(module), "h.2.attn."))
    config = os.path.join(wd, "config.json")
    with open(config, "w") as f:
        json.dump({"n_embd": 48, "n_head": 4, "n_positions": 64}, f)
    q = os.path.join(wd, "q.safetensors")
    quantize(r, ["--weights", weights, "--prefix", "h.2.attn.", "--config", config, "--weights-dtype", "int4",
                 "--output", q])
    x = rng.standard_normal((1, 9, 48)).astype(np.float32)
    want = pc.forward(r.cli, wd, weights, None, x, prefix="h.2.attn.", extra=["--config", config,
                                                                              "--weights-dtype", "int4"], tag="want")
    got = pc.forward(r.cli, wd, q, None, x, extra=["--config", config], tag="got")
    check(np.array_equal(want, got), "the GPT-2 block from the quantized file differs (max |diff| %.3g)"
          % float(np.abs(want - got).max()))
    return "int4, causal from --config"


def refusals(r):
    wd = r.workdir()
    weights = torch_gqa_file(wd)
    q = os.path.join(wd, "q.safetensors")
    quantize(r, ["--weights", weights, "--heads", "4", "--weights-dtype", "int8", "--output", q])
    query = pc.save_npy(os.path.join(wd, "x.npy"), np.zeros((1, 3, 64), np.float32))
    out = os.path.join(wd, "y.npy")
    fwd = ["forward", "--weights", q, "--heads", "4", "--query", query, "--output", out]
    refused(r, fwd + ["--weights-dtype", "int4"], r"--weights-dtype int4: .*q\.safetensors holds int8 weights")
    refused(r, fwd + ["--weights-dtype", "f32"], r"--weights-dtype f32: .*give --weights-dtype int8")
    refused(r, fwd + ["--prefix", "h.0."], r"--prefix h\.0\.: .*one layer without a prefix")
    refused(r, ["forward", "--weights", q, "--heads", "4", "--kv-heads", "4", "--query", query, "--output", out],
            r"q\.safetensors: .*K/V")
    base = ["quantize", "--weights", weights, "--weights-dtype", "int8"]
    refused(r, base + ["--heads", "4", "--output", weights], r"same file as --weights")
    refused(r, ["quantize", "--weights", q, "--weights-dtype", "int4", "--heads", "4", "--output", out],
            r"q\.safetensors: already quantized \(int8")
    refused(r, base + ["--output", q], r"missing required option --heads \(or --config or --preset\)")
    refused(r, base + ["--heads", "4", "--preset", "gpt2-small", "--output", q], r"give one of --heads")
    refused(r, base + ["--preset", "gpt2-small", "--output", q], r"gqa\.safetensors: .*num_heads=12")
    config = os.path.join(wd, "config.json")
    with open(config, "w") as f:
        json.dump({"d_model": 128, "num_heads": 4, "num_kv_heads": 2}, f)
    refused(r, base + ["--config", config, "--output", q],
            r"config\.json says d_model 128 but the weights in .*gqa\.safetensors have d_model 64")
    refused(r, ["quantize", "--weights", weights, "--heads", "4", "--weights-dtype", "bf16", "--output", q],
            r"--weights-dtype bf16 is not supported \(supported: int8, int4\)")
    with open(q, "rb") as f:
        data = f.read()
    cut = os.path.join(wd, "cut.safetensors")
    with open(cut, "wb") as f:
        f.write(data[:-5])
    refused(r, ["forward", "--weights", cut, "--heads", "4", "--query", query, "--output", out],
            r"cut\.safetensors: tensor '\w+_proj\.\w+'.*truncated")
    check(not os.path.exists(out), "a refused forward wrote its output")
    return "each refused with its reason"


def main():
    r = pc.Runner("gpt2attn quantize and forward over its files")
    r.case("same_as_quantizing_at_load", same_as_quantizing_at_load, r)
    r.case("hf_block_with_config", hf_block_with_config, r)
    r.case("refusals", refusals, r)
    r.finish()


if __name__ == "__main__":
    main()
