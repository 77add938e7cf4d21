"""A plain PyTorch GPT-2 in float64, for tests: reads a Hugging Face GPT-2 checkpoint directory (config.json and
model.safetensors, or sharded files with model.safetensors.index.json; names with or without "transformer."; F32,
F16 or BF16) without the `safetensors` package, and computes logits the textbook way:

    x = wte[ids] + wpe[positions]
    per block: x = x + c_proj(attention(ln_1(x)));  x = x + mlp_c_proj(gelu_tanh(c_fc(ln_2(x))))
    logits = ln_f(x) @ wte^T

Attention is causal softmax(q k^T / sqrt(D)) v per head; Conv1D weights are (in, out): y = x @ W + b; LayerNorm
eps from the config (1e-5). The model runner's tests compare against this when transformers is not installed.
"""
import json
import math
import os
import struct

import numpy as np
import torch

_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2), "F64": ("<f8", 8)}


def read_safetensors(path):
    """{name: float64 torch tensor} of a safetensors file (F32, F16, BF16, F64 tensors)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        np_dtype, _ = _DTYPES[e["dtype"]]
        begin, end = e["data_offsets"]
        a = np.frombuffer(data[begin:end], dtype=np_dtype)
        if e["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = torch.from_numpy(a.astype(np.float64).reshape(e["shape"]))
    return out


def load_checkpoint(directory):
    """(config dict, {name without "transformer.": float64 tensor}) of a GPT-2 checkpoint directory."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(directory, "model.safetensors.index.json")
    tensors = {}
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for file in files:
        tensors.update(read_safetensors(os.path.join(directory, file)))
    return config, {(k[len("transformer."):] if k.startswith("transformer.") else k): v for k, v in tensors.items()}


def _layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def logits(directory_or_loaded, ids):
    """(T, vocab) float64 logits of the token ids (a list of ints) at positions 0..T-1."""
    config, w = load_checkpoint(directory_or_loaded) if isinstance(directory_or_loaded, str) else directory_or_loaded
    E, H, L = config["n_embd"], config["n_head"], config["n_layer"]
    eps, D, T = config.get("layer_norm_epsilon", 1e-5), E // H, len(ids)
    x = w["wte.weight"][torch.tensor(ids)] + w["wpe.weight"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(L):
        p = f"h.{i}."
        h = _layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (t.reshape(T, H, D).transpose(0, 1) for t in qkv.split(E, dim=-1))
        s = (q @ k.transpose(1, 2)) / math.sqrt(D)
        a = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ v
        x = x + a.transpose(0, 1).reshape(T, E) @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = _layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        m = _gelu_tanh(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + m @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    return _layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], eps) @ w["wte.weight"].T
