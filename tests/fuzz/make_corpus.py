#!/usr/bin/python3
"""Writes the fuzz targets' seed corpus (tests/fuzz/corpus/<target>/): small valid files of every kind each parser
accepts, and a few it refuses for a documented reason (so the fuzzer starts next to those checks). The generated
files are kept in the tree; run this again only to change them: /usr/bin/python3 tests/fuzz/make_corpus.py
(Debian's python3 with python3-numpy and python3-torch).

Deterministic: the same files on every run (fixed seeds, no timestamps), each a few KB at most.
"""
import io
import json
import os
import shutil
import struct
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from export_safetensors import safetensors_bytes  # noqa: E402  (the writer the tests and users share)

rng = np.random.default_rng(15)  # reseeded per target in main(): a seed added to one target changes no other's


def mat(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def torch_mha_state(E, H, kdim=None, vdim=None, bias=True):
    torch.manual_seed(E * 100 + H)
    m = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim)
    return {k: v.detach() for k, v in m.state_dict().items()}


def prefixed(prefix, tensors):
    return {prefix + k: v for k, v in tensors.items()}


def hf_gpt2_block(E, KW=None, bias=True):
    """c_attn (E, E + 2 KW) and c_proj (E, E), Conv1D layout (in, out), plus a neighbour the loader must ignore."""
    KW = E if KW is None else KW
    t = {"c_attn.weight": mat(E, E + 2 * KW), "c_proj.weight": mat(E, E)}
    if bias:
        t["c_attn.bias"] = mat(E + 2 * KW)
        t["c_proj.bias"] = mat(E)
    return t


def torch_gqa(E, KW, d_in):
    """A fused grouped-query in_proj_weight (E + 2 KW, d_in), as the loader reads it."""
    return {"in_proj_weight": mat(E + 2 * KW, d_in), "in_proj_bias": mat(E + 2 * KW),
            "out_proj.weight": mat(E, E), "out_proj.bias": mat(E)}


def layers():
    """(file name, tensors, dtype) of the attention layers: both namings, each dtype, the prefixes fuzz_layer tries."""
    ln = {"h.0.ln_1.weight": mat(8), "h.0.ln_1.bias": mat(8)}
    return [
        ("torch_fused_f32.safetensors", torch_mha_state(4, 2), "F32"),
        ("torch_fused_nobias_f16_layer0.safetensors", prefixed("layer0.", torch_mha_state(4, 1, bias=False)), "F16"),
        ("torch_separate_bf16_h0.safetensors", prefixed("h.0.attn.", torch_mha_state(4, 2, kdim=3, vdim=5)), "BF16"),
        ("torch_separate_f32.safetensors", torch_mha_state(6, 3, kdim=2, vdim=4), "F32"),
        ("torch_gqa_f32.safetensors", torch_gqa(8, 4, 8), "F32"),
        ("hf_gpt2_f32_h0.safetensors", {**prefixed("h.0.attn.", hf_gpt2_block(8)), **ln}, "F32"),
        ("hf_gpt2_bf16.safetensors", hf_gpt2_block(4), "BF16"),
        ("hf_gpt2_gqa_f16_layer0.safetensors", prefixed("layer0.", hf_gpt2_block(8, KW=4)), "F16"),
        ("hf_gpt2_nobias_f32.safetensors", hf_gpt2_block(4, bias=False), "F32"),
    ]


def safetensors_corpus():
    for name, tensors, dtype in layers():
        data = safetensors_bytes(tensors, dtype, metadata={"format": "pt"})
        write("safetensors", name, data)
        write("layer", name, data)
    # What the reader accepts beyond attention layers: every dtype it lists, rank 0 and rank 5, empty tensors at a
    # boundary, no tensors at all. safetensors_bytes() writes F32/F16/BF16/F64; the integer dtypes are raw bytes.
    mixed = {"a": mat(2, 3), "scalar": np.float32(1.5), "empty": np.zeros((0, 3), np.float32),
             "r5": mat(1, 2, 1, 2, 1), "d": mat(3)}
    write("safetensors", "mixed_ranks.safetensors",
          safetensors_bytes(mixed, {"a": "F32", "scalar": "F16", "empty": "BF16", "r5": "F32", "d": "F64"}))
    raw = {"i64": ("I64", [2], struct.pack("<2q", -1, 2)), "i32": ("I32", [1], struct.pack("<i", 7)),
           "i16": ("I16", [2], struct.pack("<2h", 1, -1)), "i8": ("I8", [1], b"\x80"),
           "u8": ("U8", [3], b"\x00\x01\xff"), "b": ("BOOL", [2], b"\x00\x01")}
    header, blob = {"__metadata__": {"format": "pt", "note": "integer dtypes"}}, b""
    for key, (dtype, shape, data) in raw.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    h = json.dumps(header).encode()
    write("safetensors", "int_dtypes.safetensors", struct.pack("<Q", len(h)) + h + blob)
    write("safetensors", "no_tensors.safetensors", struct.pack("<Q", 2) + b"{}")
    # An empty tensor's other dimensions are bounded by no bytes: a seed one mutation away from ones too wide for int64.
    write("safetensors", "empty_wide.safetensors",
          safetensors_bytes({"e": np.zeros((0, 65536, 65536), np.float32), "w": mat(2)}, "F32"))
    write("layer", "torch_and_neighbours.safetensors",
          safetensors_bytes({**prefixed("h.0.attn.", torch_mha_state(4, 4)), **prefixed("h.1.attn.", hf_gpt2_block(4))},
                            "F32"))


def quantized_bytes(fmt, E, KW, d_in, kdim=None, vdim=None, qkv_bias=True, out_bias=True):
    """A file in save_quantized's format (gpt2attn/weights.hpp), written here apart from the library: codes in the
    format's range (int4 two a byte, 2i low, 2i + 1 high, 0 past an odd width), positive scales, f32 biases."""
    header, blob = {}, b""
    meta = {"gpt2attn.weights": fmt, "gpt2attn.group": "32" if fmt == "int4" else "row"}

    def add(name, dtype, shape, data):
        nonlocal blob
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data

    for name, rows, cols, bias in (("q_proj", E, d_in, qkv_bias), ("k_proj", KW, kdim or d_in, qkv_bias),
                                   ("v_proj", KW, vdim or d_in, qkv_bias), ("out_proj", E, E, out_bias)):
        meta[name + ".cols"] = str(cols)
        if fmt == "int8":
            add(name + ".codes", "I8", [rows, cols], rng.integers(-127, 128, (rows, cols)).astype(np.int8).tobytes())
            groups = 1
        else:
            nib = (rng.integers(-8, 8, (rows, cols)) & 0xF).astype(np.uint8)
            packed = nib[:, 0::2].copy()
            packed[:, :cols // 2] |= nib[:, 1::2] << 4
            add(name + ".codes", "U8", [rows, (cols + 1) // 2], packed.tobytes())
            groups = -(-cols // 32)
        add(name + ".scales", "F32", [rows, groups], (0.05 * rng.random((rows, groups)) + 1e-3).astype("<f4").tobytes())
        if bias:
            add(name + ".bias", "F32", [rows], mat(rows).astype("<f4").tobytes())
    header["__metadata__"] = meta
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + blob


def quantized_corpus():
    write("quantized", "int8_mha.safetensors", quantized_bytes("int8", 8, 8, 8))
    write("quantized", "int4_gqa_odd_d_in.safetensors", quantized_bytes("int4", 8, 4, 5))
    write("quantized", "int4_two_groups_nobias.safetensors",
          quantized_bytes("int4", 4, 4, 40, qkv_bias=False, out_bias=False))
    write("quantized", "int8_cross_widths_out_bias.safetensors",
          quantized_bytes("int8", 4, 4, 6, kdim=3, vdim=5, qkv_bias=False))
    # A float checkpoint: not one of ours (no "gpt2attn.weights"), the other way through the harness.
    write("quantized", "float_checkpoint.safetensors", safetensors_bytes(torch_mha_state(4, 2), "F32"))


def npy_bytes(a, version=None, fortran=False):
    f = io.BytesIO()
    a = np.asfortranarray(a) if fortran else a
    if version is None:
        np.save(f, a)
    else:
        np.lib.format.write_array(f, a, version=version)
    return f.getvalue()


def npy_corpus():
    arrays = {
        "f32_2x3.npy": mat(2, 3),
        "f64_4.npy": rng.standard_normal(4),
        "f16_2x2x2.npy": mat(2, 2, 2).astype(np.float16),
        "u8_5.npy": np.arange(5, dtype=np.uint8),
        "bool_3.npy": np.array([True, False, True]),
        "f32_scalar.npy": np.float32(3.25),
        "f32_empty_0x3.npy": np.zeros((0, 3), np.float32),
        "f32_empty_wide.npy": np.zeros((0, 65536, 65536), np.float32),
        "f32_rank4.npy": mat(1, 2, 1, 3),
        "f32_special.npy": np.array([np.inf, -np.inf, np.nan, -0.0, 1e-45], np.float32),
    }
    for name, a in arrays.items():
        write("npy", name, npy_bytes(a))
    write("npy", "f32_v2.npy", npy_bytes(mat(2, 2), version=(2, 0)))
    write("npy", "f32_v3.npy", npy_bytes(mat(3), version=(3, 0)))
    # Refused for a documented reason: Fortran order and big-endian data.
    write("npy", "f32_fortran.npy", npy_bytes(mat(2, 3), fortran=True))
    write("npy", "f4_bigendian.npy", npy_bytes(mat(2).astype(">f4")))


def config_corpus():
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".json"):
            shutil.copyfile(os.path.join(ROOT, "configs", name), os.path.join(HERE, "corpus", "config", name))
    every_key = {"d_model": 64, "num_heads": 8, "num_kv_heads": 2, "d_in": 32, "kdim": 16, "vdim": 24,
                 "context_length": 128, "qkv_bias": False, "out_bias": True, "causal": False, "dropout": 0.1}
    write("config", "every_key.json", json.dumps(every_key, indent=2).encode())
    # A Hugging Face GPT-2 config.json as the hub serves it for "gpt2" (other keys are ignored by the reader).
    hf = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
          "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
          "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
          "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None,
          "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
          "summary_use_proj": True, "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
          "vocab_size": 50257}
    write("config", "hf_gpt2_config.json", json.dumps(hf, indent=2).encode())
    write("config", "hf_n_ctx_only.json", json.dumps({"n_embd": 16, "n_head": 4, "n_ctx": 32}).encode())


def main():
    for target in ("safetensors", "layer", "npy", "config", "quantized"):
        d = os.path.join(HERE, "corpus", target)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    global rng
    for make in (safetensors_corpus, npy_corpus, config_corpus, quantized_corpus):
        rng = np.random.default_rng(15)
        make()
    for target in sorted(os.listdir(os.path.join(HERE, "corpus"))):
        d = os.path.join(HERE, "corpus", target)
        sizes = [os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)]
        print("%-12s %2d files, largest %d bytes" % (target, len(sizes), max(sizes)))


if __name__ == "__main__":
    main()
