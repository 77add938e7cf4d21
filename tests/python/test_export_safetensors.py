# tests/python/test_export_safetensors.py: scripts/export_safetensors.py as users run it (torch.save'd state dicts,
# whole modules, a GPT-2-style model dict), then `gpt2attn forward` on the file against torch in float64.
import json
import os
import subprocess
import sys

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "export_safetensors.py")


def export(args):
    return subprocess.run([sys.executable, SCRIPT] + [str(a) for a in args], capture_output=True, text=True,
                          timeout=300)


def exported(wd, obj, extra=()):
    src, dst = os.path.join(wd, "in.pt"), os.path.join(wd, "out.safetensors")
    torch.save(obj, src)
    p = export([src, dst] + list(extra))
    check(p.returncode == 0, "export exit %d: %s" % (p.returncode, p.stderr.strip()[-400:]))
    return dst


def torch_causal_or_not(m, x, causal):
    mask = pc.causal_block_mask(x.shape[1], x.shape[1]) if causal else None
    with torch.no_grad():
        t = torch.from_numpy(x).double()
        y, _ = m.double()(t, t, t, attn_mask=mask, need_weights=False)
    return y.numpy()


def torch_save_round_trip(r, seed, E, H, B, T, bias, whole_module):
    """An nn.MultiheadAttention torch.save'd as its state dict, or whole, exported and run by the CLI."""
    wd = r.workdir()
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(E, H, batch_first=True, bias=bias)
    w = exported(wd, m if whole_module else m.state_dict())
    x = np.random.default_rng(seed).standard_normal((B, T, E)).astype(np.float32)
    ours = pc.forward(r.cli, wd, w, H, x)
    return pc.compare(ours, torch_causal_or_not(m, x, False), pc.reduction_length(E, T))


def gpt2_model_dict(r):
    """A GPT-2-shaped checkpoint: blocks h.N.attn.c_attn/c_proj (Conv1D), an integer buffer, other layers."""
    wd = r.workdir()
    torch.manual_seed(3)
    blocks = [nn.MultiheadAttention(64, 4, batch_first=True) for _ in range(2)]
    sd = {"wte.weight": torch.randn(50, 64), "h.0.attn.masked_bias": torch.tensor(-1e4),
          "h.1.ln_1.weight": torch.ones(64), "step": torch.tensor(7, dtype=torch.int64)}
    for i, b in enumerate(blocks):
        sd.update(pc.hf_gpt2_layout(pc.state_dict_of(b), "h.%d.attn." % i))
    w = exported(wd, {"model": sd})
    x = np.random.default_rng(3).standard_normal((1, 11, 64)).astype(np.float32)
    # the model's config.json gives the heads (and the context length): no --heads to guess
    config = os.path.join(wd, "config.json")
    with open(config, "w") as f:
        json.dump({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_positions": 32, "n_layer": 2,
                   "vocab_size": 50, "attn_pdrop": 0.1}, f)
    ours = pc.forward(r.cli, wd, w, None, x, causal=True, prefix="h.1.attn.", extra=["--config", config])
    return pc.compare(ours, torch_causal_or_not(blocks[1], x, True), pc.reduction_length(64, 11))


def bf16_export(r):
    """--dtype BF16 rounds the weights once: the output is torch's over the same rounded weights."""
    wd = r.workdir()
    torch.manual_seed(4)
    m = nn.MultiheadAttention(32, 2, batch_first=True)
    w = exported(wd, m.state_dict(), ["--dtype", "BF16"])
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    x = np.random.default_rng(4).standard_normal((2, 5, 32)).astype(np.float32)
    ours = pc.forward(r.cli, wd, w, 2, x)
    return pc.compare(ours, torch_causal_or_not(m, x, False), pc.reduction_length(32, 5))


def bad_input(r):
    wd = r.workdir()
    junk = os.path.join(wd, "junk.pt")
    with open(junk, "wb") as f:
        f.write(b"not a torch file")
    p = export([junk, os.path.join(wd, "o.safetensors")])
    check(p.returncode == 2 and "junk.pt" in p.stderr, "exit %d, stderr %r" % (p.returncode, p.stderr[-300:]))
    check(not os.path.exists(os.path.join(wd, "o.safetensors")), "an output file was written")
    ints = os.path.join(wd, "ints.pt")
    torch.save({"step": torch.tensor(3)}, ints)
    p = export([ints, os.path.join(wd, "o.safetensors")])
    check(p.returncode == 2 and "no floating-point" in p.stderr, "exit %d, stderr %r" % (p.returncode, p.stderr))
    return None


def main():
    r = pc.Runner(__doc__ or "export_safetensors.py")
    r.case("mha_state_dict", lambda: torch_save_round_trip(r, 1, 32, 4, 2, 9, bias=True, whole_module=False))
    r.case("whole_module", lambda: torch_save_round_trip(r, 2, 48, 6, 1, 7, bias=False, whole_module=True))
    r.case("gpt2_model_dict_prefix", lambda: gpt2_model_dict(r))
    r.case("bf16_export", lambda: bf16_export(r))
    r.case("bad_input", lambda: bad_input(r))
    r.finish()


if __name__ == "__main__":
    main()
