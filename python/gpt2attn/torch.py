"""gpt2attn inside PyTorch models: torch.nn modules whose forward gpt2attn computes.

    import torch, gpt2attn.torch
    replaced = gpt2attn.torch.replace_attention(model)    # in place; the names of the modules replaced
    with torch.inference_mode():
        y = model(x)                                        # their attention computed by gpt2attn

MultiheadAttention is a torch.nn.MultiheadAttention (a subclass: the same constructor, parameters, state_dict
keys and isinstance) whose forward gpt2attn computes when it can, and torch's own math otherwise, so that
training and attention weights keep working. gpt2attn computes a call when
  - no gradient is asked for: grad mode is off (torch.no_grad(), torch.inference_mode()), or neither the
    parameters nor the inputs require grad;
  - need_weights=False (torch's default is True: gpt2attn never forms the attention weights);
  - the module is in eval mode or its dropout is 0, and has no bias_k/bias_v or add_zero_attn;
  - the tensors are on the CPU, of the parameters' dtype, float32 or bfloat16, and a float key_padding_mask is
    not given.
Otherwise torch computes the call and the module warns once per reason (RuntimeWarning); `last_path` says who
computed the last call ("gpt2attn", or "torch: <reason>").

Memory: from_torch and replace_attention share the module's parameters (nothing is copied). The first call that
gpt2attn computes converts the parameters into the library's layout (one copy of the weights, held by the
module), and again after any change to a parameter (an optimizer step, load_state_dict, .to()). Inputs are read
where they lie, a (L, N, E) layout through its strides; the result for a (L, N, E) query is a transposed view of
the library's (N, L, E) output, as torch's own batch_first result is a transposed view. A bfloat16 module computes
in bf16 (gpt2attn's compute="bf16") and returns bfloat16; a bfloat16 float attn_mask is widened to float32 (a copy
of the mask).
"""
import warnings

import numpy as np
import torch
from torch import nn

from . import _gpt2attn as _lib
from .hf import conv1d_attention

_COMPUTE = {torch.float32: "f32", torch.bfloat16: "bf16"}
_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # what nn.Module.__init__ sets: not the attention's own state


class _Computed:
    """What gpt2attn's torch modules share: their options, the library layer built from their parameters, and the
    rule that torch computes a call gpt2attn cannot, saying why once per reason."""

    def _init_gpt2attn(self, threads, isa, compute, context_length):
        if compute not in (None, "f32", "bf16"):
            raise _lib.InvalidArgument(f"compute {compute!r}: expected None (the parameters' dtype), 'f32' or 'bf16'")
        self.threads, self.isa, self.compute, self.context_length = threads, isa, compute, context_length
        self._layer = self._layer_key = None
        self._warned = set()
        self.last_path = None

    def _torch_computes(self, why):
        self.last_path = "torch: " + why
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"gpt2attn.torch: {type(self).__name__}: torch computes this call: {why}", RuntimeWarning,
                          stacklevel=3)

    def _tensor_reason(self, tensors, dtype):
        """Why gpt2attn cannot compute over these inputs and this module's parameters (of `dtype`); None if it can."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in [*tensors, *self.parameters()]):
            return ("a gradient is asked for (grad mode is on and the parameters or inputs require grad): run under "
                    "torch.no_grad() or torch.inference_mode() for gpt2attn")
        if dtype not in _COMPUTE:
            return f"parameters of dtype {dtype} (gpt2attn takes float32 and bfloat16)"
        for t in [*tensors, *self.parameters()]:
            if t.device.type != "cpu":
                return f"a {t.device.type} tensor (gpt2attn computes on the CPU)"
            if t.dtype != dtype:
                return f"a {t.dtype} tensor where the parameters are {dtype}"
        return None

    def _compute_of(self, dtype):
        return self.compute or _COMPUTE[dtype]

    def _run(self, layer, dtype, shape, *args, **kwargs):
        """layer.forward(*args, **kwargs) returning `dtype`, the parameters' and the inputs' dtype, as torch does:
        a bf16 layer writes bf16 itself; an f32 layer of a bf16 module (compute="f32") returns f32, narrowed here
        (a copy)."""
        if dtype != torch.bfloat16:
            return layer.forward(*args, **kwargs, threads=self.threads)
        if self._compute_of(dtype) == "bf16":
            return layer.forward(*args, **kwargs, out=torch.empty(shape, dtype=dtype), threads=self.threads)
        return layer.forward(*args, **kwargs, threads=self.threads).to(dtype)

    def _cached_layer(self, params, dtype, tokens, build):
        """The library's layer over `params`, built again by build(compute, context) when one has changed (its
        storage or its version counter, which every in-place write bumps) or a call needs a longer context."""
        compute = self._compute_of(dtype)
        key = (compute, tuple(None if p is None else (p.data_ptr(), p._version, p.dtype) for p in params))
        if self._layer is not None and self._layer_key == key and self._layer.config.context_length >= tokens:
            return self._layer
        context = self.context_length
        while context < tokens:
            context *= 2
        self._layer = None  # the old layer's memory is free before the new one is made
        self._layer = build(compute, context)
        self._layer_key = key
        return self._layer

    @property
    def implementation(self):
        """What gpt2attn runs for this module (its kernels and GEMMs), once a call has built its layer."""
        return None if self._layer is None else self._layer.implementation


class MultiheadAttention(_Computed, nn.MultiheadAttention):
    """torch.nn.MultiheadAttention computed by gpt2attn (see the module's docstring for when).

    The gpt2attn options are keyword-only: threads (0: the library's default), isa ("best" or a level name),
    compute (None: the parameters' dtype, "f32" or "bf16"), context_length (the longest L or S a call is planned
    for; a longer call rebuilds the library's layer for it)."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, threads=0, isa="best",
                 compute=None, context_length=2048):
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first,
                         device=device, dtype=dtype)
        self._init_gpt2attn(threads, isa, compute, context_length)

    @classmethod
    def from_torch(cls, module, *, threads=0, isa="best", compute=None, context_length=2048):
        """A MultiheadAttention over `module`'s own parameters and submodules (shared, not copied), in its mode."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"from_torch: expected a torch.nn.MultiheadAttention, got {type(module).__name__}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        for name, value in vars(module).items():
            if name not in _MODULE_INTERNALS:
                setattr(self, name, value)  # embed_dim, num_heads, batch_first, _qkv_same_embed_dim, ...
        for name, p in module._parameters.items():
            self.register_parameter(name, p)
        for name, b in module._buffers.items():
            self.register_buffer(name, b, persistent=name not in module._non_persistent_buffers_set)
        for name, m in module._modules.items():
            self.add_module(name, m)
        self.train(module.training)
        self._init_gpt2attn(threads, isa, compute, context_length)
        return self

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        why = self._torch_reason(query, key, value, key_padding_mask, need_weights)
        if why is None:
            self.last_path = "gpt2attn"
            return self._gpt2attn_forward(query, key, value, key_padding_mask, attn_mask, is_causal), None
        self._torch_computes(why)
        if is_causal:  # torch 1.13's forward has no is_causal: the same mask, given as one
            attn_mask = _with_causal(attn_mask, self._length(query), self._length(key), query.device)
        return super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                               attn_mask=attn_mask, average_attn_weights=average_attn_weights)

    def _length(self, t):
        """L or S of a query or key in this module's layout."""
        return t.shape[-2] if t.dim() == 2 or self.batch_first else t.shape[0]

    def _torch_reason(self, query, key, value, key_padding_mask, need_weights):
        """Why torch, not gpt2attn, computes this call; None when gpt2attn can."""
        if need_weights:
            return ("need_weights=True (torch's default) asks for the attention weights, which gpt2attn never "
                    "forms: pass need_weights=False")
        if self.bias_k is not None or self.add_zero_attn:
            return "add_bias_kv and add_zero_attn are torch's alone"
        if self.training and self.dropout > 0.0:
            return f"training mode with dropout {self.dropout} (gpt2attn's dropout draws differ from torch's)"
        why = self._tensor_reason([t for t in (query, key, value) if t is not None], self.out_proj.weight.dtype)
        if why is not None:
            return why
        if key_padding_mask is not None and key_padding_mask.is_floating_point():
            return "a float key_padding_mask (gpt2attn reads a bool one)"
        return None

    def _gpt2attn_forward(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        unbatched = query.dim() == 2
        if unbatched and (key.dim() != 2 or value.dim() != 2):
            raise _lib.InvalidArgument(f"key and value: {key.dim()}-D and {value.dim()}-D where the query is 2-D")

        def to_nle(t):  # the library's (N, L, E), as a view
            if unbatched:
                return t.unsqueeze(0)
            return t if self.batch_first else t.transpose(0, 1)

        q = to_nle(query)
        self_attention = key is query and value is query
        k, v = (None, None) if self_attention else (to_nle(key), to_nle(value))
        N, L = q.shape[0], q.shape[1]
        S = L if k is None else k.shape[1]

        mask = None if attn_mask is None else attn_mask.detach()
        if mask is not None and mask.is_floating_point() and mask.dtype != torch.float32:
            mask = mask.float()  # the library reads float32 masks; a bf16 module's mask is widened (a copy)
        if is_causal:
            mask = _with_causal(mask, L, S, query.device)
        pad = None if key_padding_mask is None else key_padding_mask.detach()
        if pad is not None and unbatched:
            pad = pad.unsqueeze(0)

        out = self._run(self._library_layer(max(L, S)), self.out_proj.weight.dtype, (N, L, self.embed_dim), q, k, v,
                        attn_mask=None if mask is None else mask.numpy(),
                        key_padding=None if pad is None else pad.numpy())
        if unbatched:
            return out[0]
        return out if self.batch_first else out.transpose(0, 1)

    def _library_layer(self, tokens):
        params = [self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight,
                  self.in_proj_bias, self.out_proj.weight, self.out_proj.bias]

        def build(compute, context):
            E = self.embed_dim
            if self._qkv_same_embed_dim:
                w = self.in_proj_weight
                w_q, w_k, w_v = _f32(w[:E]), _f32(w[E:2 * E]), _f32(w[2 * E:])
            else:
                w_q, w_k, w_v = _f32(self.q_proj_weight), _f32(self.k_proj_weight), _f32(self.v_proj_weight)
            b = self.in_proj_bias
            b_q, b_k, b_v = (None, None, None) if b is None else (_f32(b[:E]), _f32(b[E:2 * E]), _f32(b[2 * E:]))
            b_o = None if self.out_proj.bias is None else _f32(self.out_proj.bias)
            cfg = _lib.Config(E, self.num_heads, kdim=0 if self.kdim == E else self.kdim,
                              vdim=0 if self.vdim == E else self.vdim, context_length=context,
                              qkv_bias=b is not None, out_bias=b_o is not None)
            weights = _lib.Weights(w_q, w_k, w_v, _f32(self.out_proj.weight), b_q, b_k, b_v, b_o)
            return _lib.MultiHeadAttention(cfg, weights, threads=self.threads, isa=self.isa, compute=compute)

        return self._cached_layer(params, self.out_proj.weight.dtype, tokens, build)


class _HFGPT2Attention(_Computed):
    """Mixed into a Hugging Face GPT2Attention's own class by replace_attention (the module keeps its parameters,
    state_dict and isinstance): gpt2attn computes a causal self-attention call without a KV cache, attention mask,
    head mask, cross-attention or attention weights; any other call is the original forward's, with a warning."""

    _DEFAULTS = {"layer_past": None, "past_key_value": None, "past_key_values": None, "cache_position": None,
                 "attention_mask": None, "head_mask": None, "encoder_hidden_states": None,
                 "encoder_attention_mask": None, "use_cache": False, "output_attentions": False}

    def forward(self, hidden_states, *args, **kwargs):
        why = self._hf_reason(hidden_states, args, kwargs)
        if why is not None:
            self._torch_computes(why)
            return super().forward(hidden_states, *args, **kwargs)
        self.last_path = "gpt2attn"
        x = hidden_states
        layer = self._library_layer(x.shape[1], x.dtype)
        return self._run(layer, x.dtype, x.shape[:2] + (self.embed_dim,), x), None

    def _hf_reason(self, x, args, kwargs):
        given = [name for name, v in kwargs.items() if name not in self._DEFAULTS or (v is not None and v is not False)]
        if any(a is not None and a is not False for a in args) or given:
            names = given or ["a positional argument"]
            return (f"{', '.join(names)} (gpt2attn computes a Hugging Face block without a KV cache, mask or "
                    f"attention weights: call the model with use_cache=False and no attention_mask)")
        if getattr(self, "is_cross_attention", False) or not getattr(self, "scale_attn_weights", True) or \
                getattr(self, "scale_attn_by_inverse_layer_idx", False):
            return "cross-attention, unscaled scores or scores scaled by the layer index (config options)"
        if self.training and (self.attn_dropout.p > 0 or self.resid_dropout.p > 0):
            return "training mode with dropout (gpt2attn's dropout draws differ from torch's)"
        if x.dim() != 3:
            return f"hidden_states of rank {x.dim()}"
        return self._tensor_reason([x], self.c_attn.weight.dtype)

    def _library_layer(self, tokens, dtype):
        params = [self.c_attn.weight, self.c_attn.bias, self.c_proj.weight, self.c_proj.bias]

        def build(compute, context):
            cfg, weights = conv1d_attention(type(self).__name__, *(None if p is None else _f32(p) for p in params),
                                            self.num_heads, context)
            return _lib.MultiHeadAttention(cfg, weights, threads=self.threads, isa=self.isa, compute=compute)

        return self._cached_layer(params, dtype, tokens, build)


def _hf_attention_class():
    """Hugging Face's GPT2Attention when transformers imports (GPT2SdpaAttention and the like subclass it)."""
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    except Exception:  # not installed, or a release that cannot import beside this torch
        return None
    return GPT2Attention


_hf_swapped = {}


def _as_gpt2attn_hf(module, **options):
    """module's class swapped in place for one that mixes in _HFGPT2Attention (a class per original class)."""
    cls = type(module)
    if cls not in _hf_swapped:
        _hf_swapped[cls] = type("Gpt2attn" + cls.__name__, (_HFGPT2Attention, cls), {"__module__": __name__})
    module.__class__ = _hf_swapped[cls]
    module._init_gpt2attn(**options)


def _f32(t):
    """A parameter as a float32 array (a view for float32, bf16 widened exactly); the library copies it."""
    return np.ascontiguousarray(t.detach().float().numpy())


def _with_causal(mask, L, S, device):
    """attn_mask with the causal mask of torch's is_causal added: query i may not attend key j > i + S - L."""
    causal = torch.triu(torch.ones(L, S, dtype=torch.bool, device=device), diagonal=S - L + 1)
    if mask is None:
        return causal
    if mask.is_floating_point():
        return mask.masked_fill(causal, float("-inf"))
    return mask.bool() | causal


def replace_attention(model, *, threads=0, isa="best", compute=None, context_length=2048):
    """Replaces, in place, every torch.nn.MultiheadAttention in model's module tree by a gpt2attn
    MultiheadAttention over the same parameters (from_torch), and every Hugging Face GPT2Attention when
    transformers is installed (its class is swapped for one whose forward gpt2attn computes when it can: see
    _HFGPT2Attention; parameters, state_dict and isinstance are kept), and returns the qualified names replaced, in
    module order. Modules already gpt2attn's, and subclasses of torch's (which may compute something else), are
    left as they are. torch.nn.TransformerEncoderLayer's fused inference path (eval mode, batch_first, no grad)
    computes attention itself from the module's weights and never calls it: batch_first modules under one are
    replaced and named in a RuntimeWarning."""
    if isinstance(model, nn.MultiheadAttention):
        raise TypeError("replace_attention: the model is itself a MultiheadAttention, which has no parent to "
                        "replace it in: use gpt2attn.torch.MultiheadAttention.from_torch(model)")
    options = dict(threads=threads, isa=isa, compute=compute, context_length=context_length)
    hf = _hf_attention_class()
    replaced, bypassed = [], []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            qualified = f"{parent_name}.{name}" if parent_name else name
            if hf is not None and isinstance(child, hf) and not isinstance(child, _Computed):
                _as_gpt2attn_hf(child, **options)
                replaced.append(qualified)
                continue
            if type(child) is not nn.MultiheadAttention:  # a subclass may compute something else: left alone
                continue
            setattr(parent, name, MultiheadAttention.from_torch(child, **options))
            replaced.append(qualified)
            if isinstance(parent, nn.TransformerEncoderLayer) and child.batch_first:
                bypassed.append(qualified)
    if bypassed:
        warnings.warn(f"replace_attention: {', '.join(bypassed)} sit in torch.nn.TransformerEncoderLayer, whose "
                      f"fused inference path (eval, batch_first, no grad) computes attention itself and never calls "
                      f"them", RuntimeWarning, stacklevel=2)
    return replaced
