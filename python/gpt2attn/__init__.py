"""gpt2attn: GPT-2-style causal multi-head attention on CPUs, from Python.

The C++ library itself (gpt2attn._gpt2attn), over float32 numpy arrays and CPU torch tensors without copying them:

    import numpy as np, gpt2attn
    cfg = gpt2attn.preset("gpt2-small")          # or gpt2attn.load_config("config.json")
    layer = gpt2attn.CausalSelfAttention(cfg, gpt2attn.Weights.random(cfg, seed=0), threads=2)
    y = layer.forward(np.random.randn(1, 128, 768).astype(np.float32))   # (1, 128, 768)

A whole GPT-2 (token ids in, logits or generated ids out; no tokenizer):

    model = gpt2attn.GPT2.from_pretrained("gpt2-dir")     # a Hugging Face checkpoint directory
    [out] = model.generate([464, 3290, 318], max_new_tokens=16)   # out["new_ids"], out["finish_reason"], ...

Inside a PyTorch model, gpt2attn.torch (imported on its own: `import gpt2attn` does not import torch) has
MultiheadAttention, a torch.nn.MultiheadAttention that gpt2attn computes, and replace_attention(model).

Inputs must be float32 (float64 is refused with a message, not converted); a torch tensor in gives a torch tensor
out (sharing the result's memory); a tensor that requires grad is refused while grad mode is on (gpt2attn computes
no gradients) and read through .detach() under torch.no_grad(); out= arrays are written in place and returned;
errors are gpt2attn.Error subclasses (InvalidArgument is a ValueError) carrying the library's message.

Compute calls release the GIL and read inputs (and write out=) where they lie, so while a call runs no other
thread may free, shrink or move those arrays' memory. The call holds a reference to each, which stops a checked
arr.resize(); arr.resize(..., refcheck=False), torch's resize_()/set_(), or closing the mmap an array views skip
that protection by design and are a use-after-free: the caller's contract, which no reference can enforce.
"""
from ._gpt2attn import (  # noqa: F401
    GPT2, BadFile, CausalSelfAttention, Config, Error, GPT2Config, InternalError, InvalidArgument, KvCache,
    ModelKvCache, MultiHeadAttention, OutOfMemory, Weights, Workspace, best_isa, compiled_isas, gelu_tanh,
    gpt2_preset, layer_norm, load_config, load_safetensors, preset, preset_names, reference_forward, save_quantized,
    version)
from ._gpt2attn import _input_address  # noqa: F401  (tests: the address a compute call reads an array at)
from .hf import from_hf_gpt2_block  # noqa: F401

__version__ = version()


def __getattr__(name):
    # One class name per concept: the torch module has torch's name, in gpt2attn.torch.
    if name == "MultiheadAttention":
        raise AttributeError("gpt2attn.MultiheadAttention is gpt2attn.torch.MultiheadAttention (a torch.nn.Module; "
                             "`import gpt2attn.torch`); gpt2attn.MultiHeadAttention is the library's layer over arrays")
    raise AttributeError(f"module 'gpt2attn' has no attribute '{name}'")
