"""Hugging Face GPT-2 checkpoints as gpt2attn layers: a block's attention tensors (a state dict of torch tensors or
arrays) as a CausalSelfAttention. gpt2attn.load_config reads the checkpoint's config.json.

    cfg = gpt2attn.load_config("gpt2/config.json")
    layer = gpt2attn.from_hf_gpt2_block(model.state_dict(), prefix="h.3.attn.", num_heads=cfg.num_heads)
"""
import numpy as np

from ._gpt2attn import CausalSelfAttention, Config, InvalidArgument, Weights


def _is_torch(x):
    return type(x).__module__.startswith("torch")


def _hf_causal_buffer_context(buf, name):
    """The context length a Hugging Face GPT-2 block's registered `bias` buffer says (its side), or None without
    one. The buffer decides what the block computes: lower-triangular ones are causal attention over n_ctx
    positions; all ones (what a non-causal block registers) or any other pattern or shape is not the causal layer
    this builds, so it is refused rather than read as causal, and a (1, 1, 8192, 1) buffer is not a context of 1."""
    if buf is None:
        return None
    if _is_torch(buf):
        buf = buf.detach().cpu()
        buf = (buf.float() if buf.is_floating_point() else buf).numpy()  # a bf16 buffer has no numpy dtype
    m = np.asarray(buf)
    if m.ndim < 2 or m.shape[-1] != m.shape[-2] or any(d != 1 for d in m.shape[:-2]):
        raise InvalidArgument(f"from_hf_gpt2_block: '{name}' has shape {tuple(m.shape)}; a GPT-2 block's causal "
                              f"buffer is square, (1, 1, n_ctx, n_ctx)")
    m = m.reshape(m.shape[-2:]) != 0
    n = m.shape[0]
    lower = np.tril(np.ones((n, n), dtype=bool))
    if np.array_equal(m, lower):
        return n
    if m.all():
        raise InvalidArgument(f"from_hf_gpt2_block: '{name}' is all ones, a non-causal block; from_hf_gpt2_block "
                              f"builds a causal CausalSelfAttention (use MultiHeadAttention for non-causal attention)")
    raise InvalidArgument(f"from_hf_gpt2_block: '{name}' is neither lower-triangular ones (causal) nor all ones; "
                          f"it is not a GPT-2 block's attention mask")


def from_hf_gpt2_block(state_dict, prefix="", num_heads=None, context_length=None, threads=0, isa="best",
                       compute="f32"):
    """A CausalSelfAttention from a Hugging Face GPT-2 block's attention tensors (torch tensors or arrays):
    <prefix>c_attn.weight (E, 3E) and <prefix>c_proj.weight (E, E), Conv1D weights applied as x @ W + b, and their
    biases when present (prefix e.g. "h.3.attn."). num_heads is config.json's n_head: the tensors do not hold it.
    Weights of any floating dtype (bf16 and f16 included) are widened to float32 exactly. context_length defaults
    to the side of the block's registered causal buffer (<prefix>bias, (1, 1, n_ctx, n_ctx)) when the state dict
    has it, else 1024. That buffer is read for what it says: it must be square and lower-triangular ones (a causal
    block); an all-ones buffer (a non-causal block) or any other one is refused with InvalidArgument naming it."""
    if not num_heads:
        raise InvalidArgument("from_hf_gpt2_block: num_heads is required (config.json's n_head)")

    def get(name, required=True):
        t = state_dict.get(prefix + name)
        if t is None and required:
            raise InvalidArgument(f"from_hf_gpt2_block: no tensor '{prefix + name}' in the state dict")
        if t is None:
            return None
        if _is_torch(t):
            t = t.detach().cpu()
            # numpy has no bfloat16 (.numpy() raises TypeError); every floating dtype widens to float32 exactly.
            if t.is_floating_point():
                t = t.float()
            elif t.is_complex() or str(t.dtype) == "torch.bool":
                raise InvalidArgument(f"from_hf_gpt2_block: '{prefix + name}' is a {t.dtype} tensor; expected a "
                                      f"floating-point one")
            t = t.numpy()
        return np.asarray(t, dtype=np.float32)

    buffer_context = _hf_causal_buffer_context(state_dict.get(prefix + "bias"), prefix + "bias")
    if context_length is None:
        context_length = buffer_context if buffer_context is not None else 1024
    cfg, weights = conv1d_attention("from_hf_gpt2_block", get("c_attn.weight"), get("c_attn.bias", False),
                                    get("c_proj.weight"), get("c_proj.bias", False), num_heads, context_length)
    return CausalSelfAttention(cfg, weights, threads=threads, isa=isa, compute=compute)


def conv1d_attention(what, c_attn, b_attn, c_proj, b_proj, num_heads, context_length):
    """The causal Config and the Weights of a GPT-2 block's attention from its Conv1D tensors as float32 arrays:
    c_attn (d_in, 3E) and c_proj (E, E), applied as x @ W + b, and their biases or None. `what` names the caller in
    the error for tensors of other shapes."""
    E = c_proj.shape[0]
    if c_attn.ndim != 2 or c_attn.shape[1] != 3 * E or c_proj.shape != (E, E):
        raise InvalidArgument(f"{what}: c_attn.weight {c_attn.shape} and c_proj.weight {c_proj.shape} "
                              f"are not (d_in, 3E) and (E, E)")
    w = np.ascontiguousarray(c_attn.T)  # torch layout (3E, d_in): Q, K, V rows
    cfg = Config(E, num_heads, d_in=0 if c_attn.shape[0] == E else c_attn.shape[0], context_length=context_length,
                 qkv_bias=b_attn is not None, out_bias=b_proj is not None, causal=True)
    qkv_b = (None, None, None) if b_attn is None else (b_attn[:E], b_attn[E:2 * E], b_attn[2 * E:])
    weights = Weights(w[:E], w[E:2 * E], w[2 * E:], np.ascontiguousarray(c_proj.T),
                      qkv_b[0], qkv_b[1], qkv_b[2], b_proj)
    return cfg, weights
