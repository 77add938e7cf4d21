"""torch.nn.MultiheadAttention's calling conventions over gpt2attn's MultiHeadAttention.

    mha = gpt2attn.MultiheadAttention.from_torch(torch_module)      # weights copied once
    out, _ = mha(query, key, value, attn_mask=..., key_padding_mask=..., is_causal=False)

follows torch's argument names and layouts: (L, N, E) inputs, or (N, L, E) when the module is batch_first, or
unbatched (L, E); a bool attn_mask blocks where True, a float one is added to the scores; attn_mask is (L, S) or
torch's (N * num_heads, L, S); key_padding_mask (N, S) is bool, True = ignore that key. It returns
(output, None), what torch returns for need_weights=False: a torch tensor when the query was one, a numpy array
otherwise (for (L, N, E) layouts a transposed view of the library's (N, L, E) result; a torch tensor is made
contiguous, as torch's is). Inputs are read in place: a transposed layout is passed to the
library as strides, not copied. Not supported (refused with a message): add_bias_kv, add_zero_attn, float
key_padding_mask, and a module in training mode with dropout (gpt2attn's dropout draws differ from torch's;
from_torch refuses it). float16 and bfloat16 tensors are refused as inputs (pass x.float()); a bf16 or f16 module's
weights are widened exactly.
"""
import numpy as np

from ._gpt2attn import CausalSelfAttention, Config, InvalidArgument, MultiHeadAttention, Weights


def _is_torch(x):
    return type(x).__module__.startswith("torch")


def _array(x, name):
    """x as a numpy array sharing its memory (a CPU torch tensor included)."""
    if _is_torch(x):
        if x.device.type != "cpu":
            raise InvalidArgument(f"{name}: a {x.device.type} tensor; gpt2attn computes on the CPU (pass x.cpu())")
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):  # numpy has no bfloat16; .numpy() would raise TypeError
            raise InvalidArgument(f"{name}: a {x.dtype} tensor; gpt2attn takes float32 arrays (pass x.float(), and "
                                  f"compute='bf16' to compute in bf16)")
        return x.detach().numpy()
    return np.asarray(x)


def _f32(t):
    """A parameter as a float32 array: a bf16 or f16 module's values widen exactly."""
    return np.ascontiguousarray(t.detach().cpu().float().numpy(), dtype=np.float32)


class MultiheadAttention:
    """A torch.nn.MultiheadAttention computed by gpt2attn (see the module docstring for the conventions)."""

    def __init__(self, config, weights, batch_first=False, threads=0, isa="best", compute="f32"):
        self.layer = MultiHeadAttention(config, weights, threads=threads, isa=isa, compute=compute)
        self.batch_first = batch_first
        self.num_heads = config.num_heads

    @classmethod
    def from_torch(cls, module, context_length=8192, threads=0, isa="best", compute="f32"):
        """Copies a torch.nn.MultiheadAttention's weights; context_length bounds L and S."""
        if getattr(module, "bias_k", None) is not None or getattr(module, "add_zero_attn", False):
            raise InvalidArgument("from_torch: add_bias_kv and add_zero_attn are not supported")
        # Refused here, not at the call: the weights are copied now, and a later module.eval() reaches only the module.
        if module.training and module.dropout > 0.0:
            raise InvalidArgument(f"from_torch: the torch module is in training mode with dropout {module.dropout} "
                                  f"(gpt2attn's dropout draws differ from torch's): call module.eval() before from_torch")
        E, H = module.embed_dim, module.num_heads
        if module._qkv_same_embed_dim:
            w = module.in_proj_weight
            w_q, w_k, w_v = _f32(w[:E]), _f32(w[E:2 * E]), _f32(w[2 * E:])
        else:
            w_q, w_k, w_v = _f32(module.q_proj_weight), _f32(module.k_proj_weight), _f32(module.v_proj_weight)
        b = module.in_proj_bias
        biases = (None, None, None) if b is None else (_f32(b[:E]), _f32(b[E:2 * E]), _f32(b[2 * E:]))
        b_o = None if module.out_proj.bias is None else _f32(module.out_proj.bias)
        cfg = Config(E, H, kdim=0 if module.kdim == E else module.kdim, vdim=0 if module.vdim == E else module.vdim,
                     context_length=context_length, qkv_bias=b is not None, out_bias=b_o is not None)
        weights = Weights(w_q, w_k, w_v, _f32(module.out_proj.weight), biases[0], biases[1], biases[2], b_o)
        self = cls(cfg, weights, batch_first=getattr(module, "batch_first", False), threads=threads, isa=isa,
                   compute=compute)
        return self

    def __call__(self, query, key=None, value=None, attn_mask=None, key_padding_mask=None, is_causal=False,
                 need_weights=False):
        if need_weights:
            raise InvalidArgument("need_weights=True: gpt2attn never materialises the attention weights")
        torch_out = _is_torch(query)
        if (key is None) != (value is None):  # torch refuses it too; taking it as self-attention would drop one
            raise InvalidArgument("key and value: give both or neither (neither: self-attention)")
        self_attention = key is None or (key is query and value is query)
        q = _array(query, "query")
        if q.ndim not in (2, 3):
            raise InvalidArgument(f"query: expected (L, E) or {'(N, L, E)' if self.batch_first else '(L, N, E)'}, "
                                  f"got shape {tuple(q.shape)}")
        unbatched = q.ndim == 2
        k = None if self_attention else _array(key, "key")
        v = None if self_attention else _array(value, "value")
        for name, a in (("key", k), ("value", v)):
            if a is not None and a.ndim != q.ndim:
                raise InvalidArgument(f"{name}: {a.ndim}-D where the query is {q.ndim}-D (shape {tuple(a.shape)})")

        # To the library's (N, L, E): add the batch axis, or swap (L, N, E) by strides.
        def to_nle(a):
            if a is None:
                return None
            if unbatched:
                return a[np.newaxis]
            return a if self.batch_first else a.transpose(1, 0, 2)

        q3, k3, v3 = to_nle(q), to_nle(k), to_nle(v)
        N, L = q3.shape[0], q3.shape[1]
        S = L if k3 is None else k3.shape[1]

        # The library reads a mask by its dtype as torch does (bool or uint8 block, float adds): no kind to pass.
        mask = None if attn_mask is None else _array(attn_mask, "attn_mask")
        if is_causal:
            causal = np.triu(np.ones((L, S), dtype=np.bool_), k=S - L + 1)
            if mask is None:
                mask = causal
            elif np.issubdtype(mask.dtype, np.floating):
                mask = np.where(causal, np.float32(-np.inf), mask).astype(np.float32)
            else:
                mask = mask | causal
        pad = None
        if key_padding_mask is not None:
            pad = _array(key_padding_mask, "key_padding_mask")
            if pad.dtype != np.bool_:
                raise InvalidArgument("key_padding_mask: only a bool mask (True = ignore) is supported")
            if unbatched:
                pad = pad[np.newaxis]

        out = self.layer.forward(q3, k3, v3, attn_mask=mask, key_padding=pad)  # (N, L, E)
        if unbatched:
            out = out[0]
        elif not self.batch_first:
            out = out.transpose(1, 0, 2)
        if torch_out:
            import torch
            out = torch.from_numpy(np.ascontiguousarray(out))
        return out, None


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

    c_attn, c_proj = get("c_attn.weight"), get("c_proj.weight")
    E = c_proj.shape[0]
    if c_attn.ndim != 2 or c_attn.shape[1] != 3 * E or c_proj.shape != (E, E):
        raise InvalidArgument(f"from_hf_gpt2_block: c_attn.weight {c_attn.shape} and c_proj.weight {c_proj.shape} "
                              f"are not (d_in, 3E) and (E, E)")
    w = np.ascontiguousarray(c_attn.T)  # torch layout (3E, d_in): Q, K, V rows
    b_attn, b_proj = get("c_attn.bias", False), get("c_proj.bias", False)
    buffer_context = _hf_causal_buffer_context(state_dict.get(prefix + "bias"), prefix + "bias")
    if context_length is None:
        context_length = buffer_context if buffer_context is not None else 1024
    cfg = Config(E, num_heads, d_in=0 if c_attn.shape[0] == E else c_attn.shape[0], context_length=context_length,
                 qkv_bias=b_attn is not None, out_bias=b_proj is not None, causal=True)
    qkv_b = (None, None, None) if b_attn is None else (b_attn[:E], b_attn[E:2 * E], b_attn[2 * E:])
    weights = Weights(w[:E], w[E:2 * E], w[2 * E:], np.ascontiguousarray(c_proj.T),
                      qkv_b[0], qkv_b[1], qkv_b[2], b_proj)
    return CausalSelfAttention(cfg, weights, threads=threads, isa=isa, compute=compute)
