#!/usr/bin/env python3
"""Writes a Hugging Face GPT-2 checkpoint directory with random weights: config.json and model.safetensors (or
model-0000k-of-0000n.safetensors shards and model.safetensors.index.json), the names, shapes and layout a real GPT-2
checkpoint has, so that what reads one (transformers' GPT2LMHeadModel.from_pretrained, and gpt2attn's loaders) reads
this. No checkpoint can be downloaded on the machines this project runs on; the tests and benchmarks use these.

Usage: scripts/make_gpt2_checkpoint.py OUT_DIR [--preset gpt2-small|gpt2-medium|gpt2-large|gpt2-xl]
       [--layers N] [--n-embd E --n-head H] [--vocab V] [--n-positions P] [--dtype F32|F16|BF16] [--shards N]
       [--no-prefix] [--seed S] [--perturb-norms]

The weights follow GPT-2's initialization (as transformers' GPT2PreTrainedModel._init_weights): every matrix and
embedding N(0, 0.02), the residual projections (attn.c_proj, mlp.c_proj) N(0, 0.02 / sqrt(2 n_layer)), biases 0,
LayerNorm weight 1 and bias 0 (with --perturb-norms, every bias N(0, 0.02) and LayerNorm weight 1 + N(0, 0.1),
so that a test comparing two implementations sees those parameters too). The LM head is tied to wte and not stored, as in GPT-2's own files. Names carry the
"transformer." prefix unless --no-prefix (older files have none). Each tensor comes from its own generator seeded by
(seed, its index), so a tensor is the same whatever the shards, and only one tensor is held in memory at a time: a
gpt2-xl checkpoint (1.56 G parameters, 6.2 GB in F32) needs well under its size in memory.
"""
import argparse
import json
import math
import os
import struct
import sys

import torch

PRESETS = {  # n_embd, n_head, n_layer (vocab 50257, 1024 positions)
    "gpt2-small": (768, 12, 12),
    "gpt2-medium": (1024, 16, 24),
    "gpt2-large": (1280, 20, 36),
    "gpt2-xl": (1600, 25, 48),
}
DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2)}


def tensor_specs(n_embd, n_layer, vocab, n_positions):
    """[(name without prefix, shape, init)] in a real checkpoint's order; init is ("normal", std), "zeros" or "ones"."""
    E = n_embd
    std, resid = 0.02, 0.02 / math.sqrt(2 * n_layer)
    specs = [("wte.weight", (vocab, E), ("normal", std)), ("wpe.weight", (n_positions, E), ("normal", std))]
    for i in range(n_layer):
        h = f"h.{i}."
        specs += [
            (h + "ln_1.weight", (E,), "ones"), (h + "ln_1.bias", (E,), "zeros"),
            (h + "attn.c_attn.weight", (E, 3 * E), ("normal", std)), (h + "attn.c_attn.bias", (3 * E,), "zeros"),
            (h + "attn.c_proj.weight", (E, E), ("normal", resid)), (h + "attn.c_proj.bias", (E,), "zeros"),
            (h + "ln_2.weight", (E,), "ones"), (h + "ln_2.bias", (E,), "zeros"),
            (h + "mlp.c_fc.weight", (E, 4 * E), ("normal", std)), (h + "mlp.c_fc.bias", (4 * E,), "zeros"),
            (h + "mlp.c_proj.weight", (4 * E, E), ("normal", resid)), (h + "mlp.c_proj.bias", (E,), "zeros"),
        ]
    specs += [("ln_f.weight", (E,), "ones"), ("ln_f.bias", (E,), "zeros")]
    return specs


def make_tensor(shape, init, seed, index, dtype, perturb=False):
    if perturb and init in ("ones", "zeros"):
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        noise = torch.empty(shape).normal_(0.0, 0.1 if init == "ones" else 0.02, generator=g)
        t = noise + (1.0 if init == "ones" else 0.0)
    elif init == "ones":
        t = torch.ones(shape)
    elif init == "zeros":
        t = torch.zeros(shape)
    else:
        g = torch.Generator().manual_seed(seed * 1_000_003 + index)
        t = torch.empty(shape).normal_(0.0, init[1], generator=g)
    return t.to(DTYPES[dtype][0]).contiguous()


def tensor_bytes(t):
    # bf16 has no numpy dtype: its 16-bit patterns, as int16, are the bytes safetensors stores.
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2").tobytes()
    return t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()


def write_file(path, entries, dtype, seed, perturb=False):
    """entries: [(stored name, shape, init, index)], written in that order with their offsets."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    size = DTYPES[dtype][1]
    for name, shape, _, _ in entries:
        n = math.prod(shape) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, shape, init, index in entries:
            f.write(tensor_bytes(make_tensor(shape, init, seed, index, dtype, perturb)))
    os.replace(tmp, path)
    return offset


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpt2-small")
    ap.add_argument("--layers", type=int, help="n_layer instead of the preset's")
    ap.add_argument("--n-embd", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--n-positions", type=int, default=1024)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="F32")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--no-prefix", action="store_true", help='names without "transformer."')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--perturb-norms", action="store_true", help="random biases and LayerNorm weights")
    a = ap.parse_args(argv)
    n_embd, n_head, n_layer = PRESETS[a.preset]
    n_embd, n_head = a.n_embd or n_embd, a.n_head or n_head
    n_layer = a.layers if a.layers is not None else n_layer
    for what, v in (("--n-embd", n_embd), ("--n-head", n_head), ("--layers", n_layer), ("--vocab", a.vocab),
                    ("--n-positions", a.n_positions), ("--shards", a.shards)):
        if v < 1:
            ap.error(f"{what} must be at least 1, got {v}")
    if n_embd % n_head:
        ap.error(f"--n-embd {n_embd} is not a multiple of --n-head {n_head}")

    prefix = "" if a.no_prefix else "transformer."
    specs = [(prefix + name, shape, init, i)
             for i, (name, shape, init) in enumerate(tensor_specs(n_embd, n_layer, a.vocab, a.n_positions))]
    if a.shards > len(specs):
        ap.error(f"--shards {a.shards} exceeds the {len(specs)} tensors")
    os.makedirs(a.out, exist_ok=True)
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "vocab_size": a.vocab, "n_positions": a.n_positions, "n_ctx": a.n_positions, "n_embd": n_embd,
        "n_layer": n_layer, "n_head": n_head, "n_inner": None, "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "scale_attn_weights": True, "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256,
        "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[a.dtype],
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    if a.shards == 1:
        total = write_file(os.path.join(a.out, "model.safetensors"), specs, a.dtype, a.seed, a.perturb_norms)
    else:
        # Contiguous runs of tensors of about equal bytes, in order, as transformers' save_pretrained shards.
        size = DTYPES[a.dtype][1]
        bytes_of = [math.prod(s[1]) * size for s in specs]
        target, groups, run, acc = sum(bytes_of) / a.shards, [], [], 0
        for i, (spec, n) in enumerate(zip(specs, bytes_of)):
            run.append(spec)
            acc += n
            shards_left, tensors_left = a.shards - len(groups) - 1, len(specs) - i - 1
            if shards_left > 0 and (acc >= target * (len(groups) + 1) or tensors_left == shards_left):
                groups.append(run)
                run = []
        groups.append(run)
        weight_map, total = {}, 0
        for k, run in enumerate(groups):
            file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            total += write_file(os.path.join(a.out, file), run, a.dtype, a.seed, a.perturb_norms)
            weight_map.update({name: file for name, _, _, _ in run})
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    params = sum(math.prod(s[1]) for s in specs)
    print(f"{a.out}: GPT-2 n_embd={n_embd} n_head={n_head} n_layer={n_layer} vocab={a.vocab} "
          f"n_positions={a.n_positions}, {params} parameters, {total} bytes of {a.dtype} in {a.shards} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
