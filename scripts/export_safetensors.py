#!/usr/bin/env python3
"""Writes a PyTorch state dict to a safetensors file that `gpt2attn forward --weights` and load_safetensors read,
without the `safetensors` package (Debian does not ship it).

Usage: scripts/export_safetensors.py IN.pt OUT.safetensors [--dtype F32|F16|BF16] [--only PREFIX]

IN is anything torch.load() gives: a state dict (an nn.MultiheadAttention's, or a whole Hugging Face GPT-2
model's pytorch_model.bin, whose blocks gpt2attn reads with --prefix h.N.attn.), an nn.Module (its state dict is
taken), or a checkpoint dict holding one under "state_dict" or "model". Every floating-point tensor is written as
--dtype (default F32: exact); other tensors (integer buffers) are skipped. --only keeps the tensors whose names start
with PREFIX. The format: an 8-byte little-endian header length, a JSON header padded with spaces to 8 bytes, then
the tensors' raw little-endian bytes in header order.
"""
import argparse
import json
import struct
import sys

import numpy as np
import torch


def tensor_bytes(t, dtype):
    """(bytes, shape) of a torch tensor or numpy array stored as dtype in {"F32", "F16", "BF16", "F64"}."""
    t = torch.as_tensor(np.asarray(t) if not isinstance(t, torch.Tensor) else t).detach().cpu().contiguous()
    shape = list(t.shape)
    if dtype == "F32":
        data = t.to(torch.float32).numpy().astype("<f4").tobytes()
    elif dtype == "F64":
        data = t.to(torch.float64).numpy().astype("<f8").tobytes()
    elif dtype == "F16":
        data = t.to(torch.float16).numpy().astype("<f2").tobytes()
    elif dtype == "BF16":  # numpy has no bfloat16: torch rounds, then the bits are reinterpreted as int16
        data = t.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    else:
        raise ValueError("dtype %r (expected F32, F16, BF16 or F64)" % (dtype,))
    return data, shape


def safetensors_bytes(tensors, dtype="F32", metadata=None, header_override=None):
    """The bytes of a safetensors file holding `tensors` ({name: tensor}); dtype is one for all or a dict.

    header_override(header_dict) may edit the header before it is serialised (the tests' corrupt files)."""
    header, blobs, off = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        dt = dtype[name] if isinstance(dtype, dict) else dtype
        data, shape = tensor_bytes(t, dt)
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    if header_override is not None:
        header_override(header)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)  # the format pads the header with spaces to 8-byte alignment
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def write_safetensors(path, tensors, dtype="F32", metadata=None, header_override=None):
    with open(path, "wb") as f:
        f.write(safetensors_bytes(tensors, dtype, metadata, header_override))
    return path


def state_dict_from(obj):
    """The state dict inside what torch.load returned."""
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if isinstance(obj, dict):
        for key in ("state_dict", "model"):
            if key in obj and isinstance(obj[key], (dict, torch.nn.Module)):
                return state_dict_from(obj[key])
        if all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj
    raise ValueError("not a state dict, an nn.Module or a checkpoint holding one under 'state_dict' or 'model'")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--dtype", default="F32", choices=["F32", "F16", "BF16"])
    ap.add_argument("--only", default="", metavar="PREFIX")
    a = ap.parse_args(argv)
    try:
        sd = state_dict_from(torch.load(a.input, map_location="cpu"))
    except Exception as e:  # a file torch cannot read, or one without a state dict: one line, exit 2
        print("export_safetensors: %s: %s" % (a.input, e), file=sys.stderr)
        return 2
    tensors = {k: v for k, v in sd.items() if k.startswith(a.only) and v.is_floating_point()}
    if not tensors:
        print("export_safetensors: %s: no floating-point tensors%s" % (a.input, " under " + a.only if a.only else ""),
              file=sys.stderr)
        return 2
    write_safetensors(a.output, tensors, a.dtype)
    print("export_safetensors: %d tensors (%s) -> %s" % (len(tensors), a.dtype, a.output), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
