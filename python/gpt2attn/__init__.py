"""gpt2attn: GPT-2-style causal multi-head attention on CPUs, from Python.

The C++ library itself (gpt2attn._gpt2attn), over float32 numpy arrays and CPU torch tensors without copying them:

    import numpy as np, gpt2attn
    cfg = gpt2attn.preset("gpt2-small")
    layer = gpt2attn.CausalSelfAttention(cfg, gpt2attn.Weights.random(cfg, seed=0), threads=2)
    y = layer.forward(np.random.randn(1, 128, 768).astype(np.float32))   # (1, 128, 768)

Inputs must be float32 (float64 is refused with a message, not converted); out= arrays are written in place;
errors are gpt2attn.Error subclasses (InvalidArgument is a ValueError) carrying the library's message.

Compute calls release the GIL and read inputs (and write out=) where they lie, so while a call runs no other
thread may free, shrink or move those arrays' memory. The call holds a reference to each, which stops a checked
arr.resize(); arr.resize(..., refcheck=False), torch's resize_()/set_(), or closing the mmap an array views skip
that protection by design and are a use-after-free: the caller's contract, which no reference can enforce.
"""
from ._gpt2attn import (  # noqa: F401
    BadFile, CausalSelfAttention, Config, Error, InternalError, InvalidArgument, KvCache, MultiHeadAttention,
    OutOfMemory, Weights, Workspace, best_isa, compiled_isas, load_safetensors, preset, preset_names,
    reference_forward, version)
from ._gpt2attn import _input_address  # noqa: F401  (tests: the address a compute call reads an array at)
from .torch_compat import MultiheadAttention, from_hf_gpt2_block  # noqa: F401

__version__ = version()
