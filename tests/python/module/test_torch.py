"""gpt2attn.torch: MultiheadAttention as a torch.nn.Module (parity with torch.nn.MultiheadAttention, state_dict,
module trees, when torch computes instead and that it says so), replace_attention, and tensors in, tensors out
from the library's own classes. Run by ctest with the rest of tests/python/module."""
import json
import os
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import parity_common as pc  # noqa: E402  (the float32 tolerance policy of tests/tolerance.hpp)

import gpt2attn  # noqa: E402
import gpt2attn.torch as gt  # noqa: E402

torch.manual_seed(0)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def reference(module, query, key, value, **kwargs):
    """torch's module computed in float64 (a copy; the module is left as it is), need_weights=False."""
    m64 = nn.MultiheadAttention(module.embed_dim, module.num_heads, bias=module.in_proj_bias is not None,
                                kdim=module.kdim, vdim=module.vdim, batch_first=module.batch_first).double().eval()
    m64.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    with torch.no_grad():
        return m64(query.double(), key.double(), value.double(), need_weights=False, **kwargs)[0]


# ---------------------------------------------------------------------------------------------------------
# Parity with torch.nn.MultiheadAttention: from_torch, under torch.no_grad(), computed by gpt2attn.

# (E, H, N, L, S, kdim, vdim, bias, batch_first, unbatched, mask, key_padding, is_causal)
CASES = [
    (16, 2, 2, 7, 7, None, None, True, True, False, None, False, False),
    (16, 2, 2, 7, 7, None, None, False, False, False, None, False, False),
    (24, 3, 1, 1, 1, None, None, True, True, False, None, False, False),  # T = 1
    (32, 4, 3, 5, 9, 20, 12, True, True, False, None, False, False),     # cross-attention, kdim/vdim
    (32, 4, 2, 6, 11, None, None, True, False, False, "bool", False, False),
    (32, 4, 2, 6, 6, None, None, True, True, False, "float", False, False),
    (32, 4, 2, 6, 8, None, None, True, True, False, "bool3d", False, False),
    (32, 4, 3, 7, 10, None, None, True, False, False, None, True, False),
    (48, 6, 2, 33, 33, None, None, True, True, False, None, False, True),   # causal
    (48, 6, 2, 13, 13, None, None, True, True, False, "float", True, True),  # causal + additive + padding
    (64, 8, 1, 9, 9, None, None, True, True, True, "bool", False, False),   # unbatched (L, E)
    (768, 12, 1, 113, 113, None, None, True, True, False, None, False, True),  # gpt2-small width
]


def make_mask(kind, rng, N, H, L, S):
    """A mask that leaves every query row at least one key (torch gives NaN for a fully masked row)."""
    if kind is None:
        return None
    blocked = rng.random((N * H if kind == "bool3d" else 1, L, S)) < 0.4
    blocked[..., 0] = False
    if kind == "float":
        return torch.from_numpy(np.where(blocked[0], -np.inf, rng.standard_normal((L, S))).astype(np.float32))
    return torch.from_numpy(blocked if kind == "bool3d" else blocked[0])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"E{c[0]}-H{c[1]}-L{c[3]}-S{c[4]}-{c[10]}" for c in CASES])
def test_parity_with_torch_mha(index):
    E, H, N, L, S, kdim, vdim, bias, batch_first, unbatched, mask_kind, padding, is_causal = CASES[index]
    rng = np.random.default_rng(100 + index)
    module = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first).eval()
    ours = gt.MultiheadAttention.from_torch(module, context_length=256, threads=2)

    def shaped(width, length):
        if unbatched:
            return torch.from_numpy(rand(rng, length, width))
        return torch.from_numpy(rand(rng, N, length, width) if batch_first else rand(rng, length, N, width))

    self_attn = kdim is None and S == L and not padding
    q = shaped(E, L)
    k = q if self_attn else shaped(kdim or E, S)
    v = q if self_attn else shaped(vdim or E, S)
    mask = make_mask(mask_kind, rng, 1 if unbatched else N, H, L, S)
    pad = None
    if padding:
        p = rng.random((N, S)) < 0.3
        p[:, 0] = False
        pad = torch.from_numpy(p)
    causal = None
    if is_causal:
        causal = torch.triu(torch.ones(L, S, dtype=torch.bool), diagonal=S - L + 1)

    with torch.no_grad():
        got, weights = ours(q, k, v, attn_mask=mask, key_padding_mask=pad, is_causal=is_causal, need_weights=False)
    assert weights is None and isinstance(got, torch.Tensor) and ours.last_path == "gpt2attn"

    # torch in float64 is the reference: the torch mask with the causal part merged in, as torch 1.13 needs
    ref_mask = mask if causal is None else pc.with_causal(mask, causal)
    want = reference(module, q, k, v, key_padding_mask=pad, attn_mask=None if ref_mask is None else (
        ref_mask if ref_mask.dtype == torch.bool else ref_mask.double()))
    assert got.shape == want.shape
    pc.compare(got.numpy(), want.numpy(), pc.reduction_length(E, S))




def test_uint8_masks_read_as_bool_ones():
    """torch reads a uint8 attn_mask as a bool one; so does the module, through the library's default kind."""
    rng = np.random.default_rng(25)
    ours = gt.MultiheadAttention(16, 2, batch_first=True, context_length=32).eval()
    q = torch.from_numpy(rand(rng, 2, 5, 16))
    blocked = rng.random((5, 5)) < 0.4
    blocked[:, 0] = False
    with torch.no_grad():
        want, _ = ours(q, q, q, attn_mask=torch.from_numpy(blocked), is_causal=True, need_weights=False)
        got, _ = ours(q, q, q, attn_mask=torch.from_numpy(blocked.astype(np.uint8)), is_causal=True,
                      need_weights=False)
    np.testing.assert_array_equal(got.numpy(), want.numpy())


# ---------------------------------------------------------------------------------------------------------
# A torch module: its constructor, parameters, state_dict, module trees.

def test_is_a_torch_module_with_torch_state_dict():
    torch.manual_seed(1)
    theirs = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours = gt.MultiheadAttention(32, 4, batch_first=True, threads=1).eval()
    assert isinstance(ours, nn.MultiheadAttention) and isinstance(ours, nn.Module)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        got = ours(x, x, x, need_weights=False)[0]
    assert ours.last_path == "gpt2attn"
    pc.compare(got.numpy(), reference(theirs, x, x, x).numpy(), pc.reduction_length(32, 9))


def test_from_torch_shares_parameters_and_follows_their_changes():
    """Nothing is copied at from_torch; a change to a parameter (here in place, as an optimizer step or
    load_state_dict makes it) reaches the next call, which rebuilds the library's layer."""
    theirs = nn.MultiheadAttention(32, 4).eval()
    ours = gt.MultiheadAttention.from_torch(theirs, threads=1)
    assert ours.in_proj_weight is theirs.in_proj_weight and ours.out_proj is theirs.out_proj
    x = torch.randn(6, 2, 32)
    with torch.no_grad():
        before = ours(x, x, x, need_weights=False)[0].clone()
        theirs.out_proj.weight.mul_(-2.0)
        after = ours(x, x, x, need_weights=False)[0]
    assert not torch.allclose(before, after)
    pc.compare(after.numpy(), reference(theirs, x, x, x).numpy(), pc.reduction_length(32, 6))
    theirs.load_state_dict(nn.MultiheadAttention(32, 4).state_dict())
    with torch.no_grad():
        pc.compare(ours(x, x, x, need_weights=False)[0].numpy(), reference(theirs, x, x, x).numpy(),
                   pc.reduction_length(32, 6))


def test_a_call_longer_than_context_length_rebuilds_the_layer():
    ours = gt.MultiheadAttention(16, 2, batch_first=True, context_length=8, threads=1).eval()
    x = torch.randn(1, 37, 16)
    with torch.no_grad():
        got = ours(x, x, x, need_weights=False, is_causal=True)[0]
    assert ours.last_path == "gpt2attn"
    causal = torch.triu(torch.ones(37, 37, dtype=torch.bool), 1)
    pc.compare(got.numpy(), reference(ours, x, x, x, attn_mask=causal).numpy(), pc.reduction_length(16, 37))


class Block(nn.Module):
    """A pre-norm transformer block of the kind users write, its attention a torch.nn.MultiheadAttention."""

    def __init__(self, E, H):
        super().__init__()
        self.norm = nn.LayerNorm(E)
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(E, 4 * E), nn.GELU(), nn.Linear(4 * E, E))

    def forward(self, x):
        h = self.norm(x)
        T = x.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


def test_replace_attention_in_a_module_tree():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(48, 48), Block(48, 6), nn.ModuleList([Block(48, 6)]), nn.Linear(48, 48)).eval()
    model = nn.Sequential(*model[:2], model[2][0], model[3]).eval()
    x = torch.randn(2, 21, 48)
    with torch.no_grad():
        want = model.double()(x.double())
    model.float()
    replaced = gt.replace_attention(model, threads=2)
    assert replaced == ["1.attn", "2.attn"]
    assert all(isinstance(model[i].attn, gt.MultiheadAttention) for i in (1, 2))
    assert gt.replace_attention(model) == []  # gpt2attn's own modules are left as they are
    with torch.inference_mode():
        got = model(x)
    assert [model[i].attn.last_path for i in (1, 2)] == ["gpt2attn", "gpt2attn"]
    pc.compare(got.numpy(), want.numpy(), pc.reduction_length(4 * 48, 21))


def test_replace_attention_refuses_a_bare_module_and_names_the_encoder_fast_path():
    with pytest.raises(TypeError, match="from_torch"):
        gt.replace_attention(nn.MultiheadAttention(16, 2))
    layer = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, batch_first=True), 2)
    with pytest.warns(RuntimeWarning, match="layers.0.self_attn, layers.1.self_attn sit in torch.nn.Transformer"):
        assert gt.replace_attention(layer) == ["layers.0.self_attn", "layers.1.self_attn"]
    seq_first = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (L, N, E): torch's fused path is not taken, the module is called
        gt.replace_attention(seq_first)


# ---------------------------------------------------------------------------------------------------------
# When torch computes, and that the module says so.

def test_gradients_need_torch_which_computes_and_warns_once():
    """With grad mode on and parameters that require grad, torch's math computes the call (its result and its
    gradients), the module warns once and last_path names the reason."""
    torch.manual_seed(3)
    theirs = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    ours = gt.MultiheadAttention.from_torch(theirs, threads=1)
    x = torch.randn(2, 5, 16, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="a gradient is asked for"):
        got = ours(x, x, x, need_weights=False)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(x, x, x, need_weights=False)  # the same reason again: no second warning
    assert ours.last_path.startswith("torch: a gradient is asked for")
    assert got.grad_fn is not None
    got.sum().backward()
    assert x.grad is not None and theirs.in_proj_weight.grad is not None
    np.testing.assert_array_equal(got.detach().numpy(), theirs(x, x, x, need_weights=False)[0].detach().numpy())


def test_need_weights_and_training_dropout_are_torchs():
    theirs = nn.MultiheadAttention(16, 2, dropout=0.5).eval()
    ours = gt.MultiheadAttention.from_torch(theirs, threads=1)
    x = torch.randn(5, 2, 16)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="need_weights=True"):
            out, weights = ours(x, x, x)  # torch's default need_weights=True
        want_out, want_weights = theirs(x, x, x)
        np.testing.assert_array_equal(weights.numpy(), want_weights.numpy())
        np.testing.assert_array_equal(out.numpy(), want_out.numpy())
        ours.train()
        with pytest.warns(RuntimeWarning, match="training mode with dropout 0.5"):
            ours(x, x, x, need_weights=False)
        ours.eval()
        ours(x, x, x, need_weights=False)
        assert ours.last_path == "gpt2attn"
        with pytest.warns(RuntimeWarning, match="float key_padding_mask"):
            ours(x, x, x, need_weights=False, key_padding_mask=torch.zeros(2, 5))


def test_bfloat16_module_computes_in_bf16_and_returns_bf16():
    """A bfloat16 module computes with compute='bf16' and returns bfloat16; its error against float64 is at most
    1.5x torch's own bf16 module's (the bound of tests/python/test_torch_bf16_parity.py)."""
    torch.manual_seed(4)
    theirs = nn.MultiheadAttention(64, 4, batch_first=True).eval()
    x = torch.randn(2, 33, 64)
    want = reference(theirs, x, x, x)
    theirs.bfloat16()
    xb = x.bfloat16()
    ours = gt.MultiheadAttention.from_torch(theirs, threads=2)
    with torch.no_grad():
        got = ours(xb, xb, xb, need_weights=False)[0]
        torch_bf16 = theirs(xb, xb, xb, need_weights=False)[0]
    assert got.dtype == torch.bfloat16 and ours.last_path == "gpt2attn" and "bf16" in ours.implementation
    err = float((got.double() - want).abs().max())
    theirs_err = float((torch_bf16.double() - want).abs().max())
    assert 0 < err <= 1.5 * theirs_err, (err, theirs_err)
    f32_compute = gt.MultiheadAttention.from_torch(theirs, threads=2, compute="f32")
    with torch.no_grad():
        got = f32_compute(xb, xb, xb, need_weights=False)[0]
    assert got.dtype == torch.bfloat16 and "kernels f32" in f32_compute.implementation
    assert float((got.double() - want).abs().max()) <= 1.5 * theirs_err
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="a torch.float32 tensor where the parameters are "):
        with pytest.raises(RuntimeError):  # torch's own refusal of mixed dtypes
            ours(x, x, x, need_weights=False)


# ---------------------------------------------------------------------------------------------------------
# The library's classes: tensors in, tensors out; no silent detach; one name per concept; config.json.

def test_layers_return_tensors_for_tensors_and_refuse_recorded_gradients():
    cfg = gpt2attn.Config(32, 4, context_length=64, causal=True)
    layer = gpt2attn.CausalSelfAttention(cfg, gpt2attn.Weights.random(cfg, 5), threads=1)
    x = np.random.default_rng(5).standard_normal((2, 7, 32)).astype(np.float32)
    want = layer.forward(x)
    assert isinstance(want, np.ndarray)
    got = layer.forward(torch.from_numpy(x))
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), want)
    cache = gpt2attn.KvCache(cfg, block_tokens=16, capacity_tokens=64)
    seq = cache.create()
    assert isinstance(layer.extend(cache, seq, torch.from_numpy(x[0])), torch.Tensor)
    assert isinstance(layer.decode(cache, [seq], torch.from_numpy(x[1, :1])), torch.Tensor)
    tracked = torch.from_numpy(x).requires_grad_()
    with pytest.raises(gpt2attn.InvalidArgument, match="x: the tensor requires grad and grad mode is on"):
        layer.forward(tracked)
    with torch.no_grad():
        np.testing.assert_array_equal(layer.forward(tracked).numpy(), want)
    mha = gpt2attn.MultiHeadAttention(cfg, gpt2attn.Weights.random(cfg, 5), threads=1)
    with pytest.raises(gpt2attn.InvalidArgument, match="query: the tensor requires grad"):
        mha.forward(tracked)
    ref = gpt2attn.reference_forward(cfg, gpt2attn.Weights.random(cfg, 5), torch.from_numpy(x))
    assert isinstance(ref, torch.Tensor) and ref.dtype == torch.float64


def test_library_layer_reads_bf16_tensors_in_place_and_writes_bf16():
    cfg = gpt2attn.Config(32, 4)
    w = gpt2attn.Weights.random(cfg, 6)
    x = torch.randn(2, 7, 32).bfloat16()
    f32 = gpt2attn.MultiHeadAttention(cfg, w, threads=1)
    np.testing.assert_array_equal(f32.forward(x).numpy(), f32.forward(x.float()).numpy())  # exact widening
    bf16 = gpt2attn.MultiHeadAttention(cfg, w, threads=1, compute="bf16")
    out = torch.empty(2, 7, 32, dtype=torch.bfloat16)
    assert bf16.forward(x, out=out) is out
    with pytest.raises(gpt2attn.InvalidArgument, match="output"):
        f32.forward(x, out=out)  # an f32 layer writes float32
    with pytest.raises(gpt2attn.InvalidArgument, match="x: a torch.bfloat16 tensor, where this call takes float32"):
        gpt2attn.CausalSelfAttention(gpt2attn.Config(32, 4, causal=True), w).forward(x)


def test_one_class_name_per_concept():
    with pytest.raises(AttributeError, match="gpt2attn.torch.MultiheadAttention"):
        gpt2attn.MultiheadAttention  # noqa: B018
    assert issubclass(gt.MultiheadAttention, nn.MultiheadAttention)


def test_load_config_reads_a_hugging_face_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 96, "n_head": 4, "n_positions": 128,
                                "n_layer": 2, "vocab_size": 50257}))
    cfg = gpt2attn.load_config(str(path))
    assert (cfg.d_model, cfg.num_heads, cfg.context_length, cfg.causal, cfg.qkv_bias) == (96, 4, 128, True, True)
    path.write_text("{")
    with pytest.raises(gpt2attn.BadFile, match="config.json"):
        gpt2attn.load_config(str(path))
