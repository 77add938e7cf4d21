"""The Python module (python/): parity with torch.nn.MultiheadAttention through the module (not the CLI), zero-copy
inputs and in-place out=, the KV cache, the GIL released during compute, and bad input as Python exceptions.
Run by ctest as `python3 -m pytest tests/python/module` with PYTHONPATH=build/python."""
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import parity_common as pc  # noqa: E402  (the float32 tolerance policy of tests/tolerance.hpp)

import gpt2attn  # noqa: E402

torch.manual_seed(0)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_masks_broadcast_over_size_one_axes_and_torch_3d_layout():
    rng = np.random.default_rng(21)
    cfg = gpt2attn.Config(32, 4)
    layer = gpt2attn.MultiHeadAttention(cfg, gpt2attn.Weights.random(cfg, 22))
    x = rand(rng, 3, 5, 32)
    full = rng.standard_normal((3, 4, 5, 5)).astype(np.float32)
    for small in (full[:1], full[:, :1], full[:1, :1], full[0, :1]):  # (1,H,..), (B,1,..), (1,1,..), (1,T,Tk)
        want = layer.forward(x, attn_mask=np.ascontiguousarray(np.broadcast_to(small.reshape((1,) * (4 - small.ndim)
                                                                                              + small.shape),
                                                                               full.shape)),
                             mask_kind="additive")
        np.testing.assert_array_equal(layer.forward(x, attn_mask=small, mask_kind="additive"), want)
    np.testing.assert_array_equal(layer.forward(x, attn_mask=full.reshape(12, 5, 5), mask_kind="additive"),
                                  layer.forward(x, attn_mask=full, mask_kind="additive"))
    with pytest.raises(gpt2attn.InvalidArgument, match="attn_mask"):
        layer.forward(x, attn_mask=full[:2], mask_kind="additive")


def test_mask_without_a_kind_is_read_as_torch_reads_it():
    rng = np.random.default_rng(23)
    cfg = gpt2attn.Config(32, 4)
    layer = gpt2attn.MultiHeadAttention(cfg, gpt2attn.Weights.random(cfg, 24))
    x = rand(rng, 2, 6, 32)
    blocked = rng.random((6, 6)) < 0.4
    blocked[:, 0] = False
    np.testing.assert_array_equal(layer.forward(x, attn_mask=blocked),
                                  layer.forward(x, attn_mask=blocked, mask_kind="block"))
    np.testing.assert_array_equal(layer.forward(x, attn_mask=blocked.astype(np.uint8)),
                                  layer.forward(x, attn_mask=blocked, mask_kind="block"))
    additive = rng.standard_normal((6, 6)).astype(np.float32)
    np.testing.assert_array_equal(layer.forward(x, attn_mask=additive),
                                  layer.forward(x, attn_mask=additive, mask_kind="additive"))
    # keep is block's complement: nonzero attends (seeds 002/003)
    np.testing.assert_array_equal(layer.forward(x, attn_mask=~blocked, mask_kind="keep"),
                                  layer.forward(x, attn_mask=blocked, mask_kind="block"))
    pc.compare(layer.forward(x, attn_mask=(~blocked).astype(np.float32), mask_kind="keep"),
               gpt2attn.reference_forward(cfg, gpt2attn.Weights.random(cfg, 24), x, attn_mask=blocked,
                                          mask_kind="block"), pc.reduction_length(32, 6))


def test_hf_gpt2_block_matches_causal_torch_mha():
    rng = np.random.default_rng(20)
    module = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    hf = pc.hf_gpt2_layout(pc.state_dict_of(module), "h.0.attn.")
    hf["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 96, 96))  # GPT-2's registered causal buffer: n_ctx = 96
    layer = gpt2attn.from_hf_gpt2_block(hf, "h.0.attn.", num_heads=4)
    assert layer.config.context_length == 96 and layer.config.causal
    x = rand(rng, 2, 17, 64)
    got = layer.forward(x)
    m64 = module.double()
    with torch.no_grad():
        t = torch.from_numpy(x).double()
        want, _ = m64(t, t, t, attn_mask=pc.causal_block_mask(17, 17), need_weights=False)
    pc.compare(got, want.numpy(), pc.reduction_length(64, 17))
    with pytest.raises(gpt2attn.InvalidArgument, match="c_proj.weight"):
        gpt2attn.from_hf_gpt2_block({k: v for k, v in hf.items() if "c_proj.weight" not in k}, "h.0.attn.", 4)
    with pytest.raises(gpt2attn.InvalidArgument, match="n_head"):
        gpt2attn.from_hf_gpt2_block(hf, "h.0.attn.")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hf_gpt2_block_widens_a_bf16_or_f16_state_dict(dtype):
    """A bf16 state dict (model.to(torch.bfloat16).state_dict()) raised torch's raw TypeError from .numpy(); its
    values widen to float32 exactly, so the layer is the one its float32 copy builds."""
    module = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    hf = pc.hf_gpt2_layout(pc.state_dict_of(module), "h.0.attn.")
    low = {k: v.to(dtype) for k, v in hf.items()}
    widened = {k: v.float() for k, v in low.items()}
    x = rand(np.random.default_rng(26), 2, 5, 32)
    got = gpt2attn.from_hf_gpt2_block(low, "h.0.attn.", num_heads=4).forward(x)
    np.testing.assert_array_equal(got, gpt2attn.from_hf_gpt2_block(widened, "h.0.attn.", num_heads=4).forward(x))
    with pytest.raises(gpt2attn.InvalidArgument, match=r"'h\.0\.attn\.c_proj\.weight' is a torch\.bool tensor"):
        gpt2attn.from_hf_gpt2_block(dict(hf, **{"h.0.attn.c_proj.weight": torch.ones(32, 32, dtype=torch.bool)}),
                                    "h.0.attn.", num_heads=4)


def test_hf_gpt2_block_reads_what_its_causal_buffer_says():
    """The registered `bias` buffer was read as causal whatever it held (an all-ones one means a non-causal block),
    and its last axis as the context (a (1, 1, 8192, 1) buffer gave context 1): now lower-triangular ones give the
    causal layer with the buffer's side as its context, and anything else is refused, naming the buffer."""
    module = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    hf = pc.hf_gpt2_layout(pc.state_dict_of(module), "h.0.attn.")
    for tril in (torch.tril(torch.ones(1, 1, 40, 40, dtype=torch.bool)),
                 torch.tril(torch.ones(40, 40)).to(torch.uint8), torch.tril(torch.ones(1, 1, 40, 40)).bfloat16()):
        layer = gpt2attn.from_hf_gpt2_block(dict(hf, **{"h.0.attn.bias": tril}), "h.0.attn.", num_heads=4)
        assert layer.config.context_length == 40 and layer.config.causal
    refused = {
        "all ones, a non-causal block": torch.ones(1, 1, 40, 40, dtype=torch.bool),
        r"shape \(1, 1, 8192, 1\)": torch.ones(1, 1, 8192, 1, dtype=torch.bool),
        r"shape \(2, 1, 4, 4\)": torch.tril(torch.ones(2, 1, 4, 4, dtype=torch.bool)),
        "neither lower-triangular ones": torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool)),
    }
    for words, buf in refused.items():
        with pytest.raises(gpt2attn.InvalidArgument, match=r"'h\.0\.attn\.bias' .*" + words):
            gpt2attn.from_hf_gpt2_block(dict(hf, **{"h.0.attn.bias": buf}), "h.0.attn.", num_heads=4)
        # An explicit context_length does not make a non-causal or malformed buffer causal.
        with pytest.raises(gpt2attn.InvalidArgument, match=r"'h\.0\.attn\.bias'"):
            gpt2attn.from_hf_gpt2_block(dict(hf, **{"h.0.attn.bias": buf}), "h.0.attn.", num_heads=4,
                                        context_length=64)


@pytest.mark.parametrize("weights_dtype, bound", [("int8", 0.05), ("int4", 0.6)])
def test_quantized_weights_decode_and_forward(weights_dtype, bound):
    """weights_dtype= quantizes the projections once: the layer says so, its forward and decode agree with each other
    (the same quantized values) and stay near the unquantized layer (int8 ~1e-2 of the output's rms, int4 ~1e-1); a
    name that is no format is refused."""
    rng = np.random.default_rng(31)
    cfg = gpt2attn.Config(64, 4, context_length=64)
    w = gpt2attn.Weights.random(cfg, 32)
    dense = gpt2attn.CausalSelfAttention(cfg, w)
    q = gpt2attn.CausalSelfAttention(cfg, w, weights_dtype=weights_dtype)
    assert weights_dtype + " weights" in q.implementation
    x = rand(rng, 1, 9, 64)
    want, got = dense.forward(x), q.forward(x)
    rms = float(np.sqrt(np.mean(want.astype(np.float64) ** 2)))
    assert float(np.abs(got - want).max()) / rms < bound
    cache = gpt2attn.KvCache(q.config, block_tokens=16, capacity_tokens=64)
    seq = cache.create()
    q.extend(cache, seq, x[0, :8])
    step = q.decode(cache, [seq], x[0, 8:9])
    np.testing.assert_allclose(step[0], got[0, 8], rtol=2e-2, atol=2e-2 * rms)
    with pytest.raises(gpt2attn.InvalidArgument, match="weights_dtype"):
        gpt2attn.CausalSelfAttention(cfg, w, weights_dtype="int3")


def test_bf16_compute_is_as_accurate_as_torch_bf16():
    """compute="bf16" through from_hf_gpt2_block: error against fp64 at most 1.5x that of the same
    torch module run in bfloat16 (the CLI's test_torch_bf16_parity.py covers the shapes; this covers the option)."""
    rng = np.random.default_rng(21)
    module = torch.nn.MultiheadAttention(96, 6, batch_first=True).eval()
    hf = pc.hf_gpt2_layout(pc.state_dict_of(module), "h.0.attn.")
    x = rand(rng, 2, 33, 96)
    mask = pc.causal_block_mask(33, 33)
    with torch.no_grad():
        t = torch.from_numpy(x)
        want, _ = module.double()(t.double(), t.double(), t.double(), attn_mask=mask, need_weights=False)
        b = t.bfloat16()
        theirs, _ = module.bfloat16()(b, b, b, attn_mask=mask, need_weights=False)
    torch_err = float((theirs.double() - want).abs().max())
    layer = gpt2attn.from_hf_gpt2_block(hf, "h.0.attn.", num_heads=6, compute="bf16")
    assert "bf16/" in layer.implementation and ("avx512_core_bf16" in layer.implementation or
                                                "avx512_core_amx_bf16" in layer.implementation) or \
        gpt2attn.best_isa() != "avx512_bf16", layer.implementation
    ours_err = float(np.abs(layer.forward(x) - want.numpy()).max())
    assert ours_err <= 1.5 * torch_err, (ours_err, torch_err)
    assert ours_err > 1e-4, "compute='bf16' gave an f32-accurate result: the option did not reach the layer"
    with pytest.raises(gpt2attn.InvalidArgument, match="compute 'fp8'"):
        gpt2attn.from_hf_gpt2_block(hf, "h.0.attn.", num_heads=6, compute="fp8")


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_from_safetensors_builds_the_layer_of_its_f32_copy(tmp_path, dtype):
    """from_safetensors reads the file's tensors as stored (a BF16 file reaches a bf16 layer without an f32 copy); the
    layer equals, bitwise, the one built from load_safetensors' exact f32 copy of the same file."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts"))
    from export_safetensors import write_safetensors
    rng = np.random.default_rng(22)
    module = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    path = str(tmp_path / "w.safetensors")
    write_safetensors(path, pc.hf_gpt2_layout(pc.state_dict_of(module), "h.1.attn."), dtype=dtype)
    cfg = gpt2attn.preset("gpt2-small")
    cfg.num_heads, cfg.context_length = 4, 64
    x = rand(rng, 2, 19, 64)
    for compute in ("f32", "bf16"):
        stored = gpt2attn.CausalSelfAttention.from_safetensors(path, cfg, prefix="h.1.attn.", compute=compute)
        loaded_cfg, weights = gpt2attn.load_safetensors(path, "h.1.attn.", cfg)
        copy = gpt2attn.CausalSelfAttention(loaded_cfg, weights, compute=compute)
        assert stored.config.d_model == 64 and stored.config.qkv_bias
        np.testing.assert_array_equal(stored.forward(x), copy.forward(x))
        mha = gpt2attn.MultiHeadAttention.from_safetensors(path, cfg, prefix="h.1.attn.", compute=compute)
        mha_copy = gpt2attn.MultiHeadAttention(loaded_cfg, weights, compute=compute)
        np.testing.assert_array_equal(mha.forward(x), mha_copy.forward(x))
    with pytest.raises(gpt2attn.BadFile, match="no attention layer"):
        gpt2attn.CausalSelfAttention.from_safetensors(path, cfg, prefix="h.7.attn.")


@pytest.mark.parametrize("weights_dtype", ["int8", "int4"])
def test_save_quantized_then_from_quantized_builds_the_same_layer(tmp_path, weights_dtype):
    """save_quantized writes the codes once; from_quantized builds, from the file and a config of the heads alone,
    layers that compute bit for bit what weights_dtype= quantizing the same weights computes (grouped K/V heads:
    forward, extend and decode; an odd d_in: MultiHeadAttention). The other format, a float file, an unknown format
    and K/V heads the file does not hold are refused."""
    rng = np.random.default_rng(41)
    cfg = gpt2attn.Config(64, 4, num_kv_heads=2, context_length=64, causal=True)
    w = gpt2attn.Weights.random(cfg, 42)
    path = str(tmp_path / "q.safetensors")
    gpt2attn.save_quantized(path, cfg, w, weights_dtype)
    heads = gpt2attn.Config(64, 4, context_length=64)  # the sizes, K/V heads and biases come from the file
    loaded = gpt2attn.CausalSelfAttention.from_quantized(path, heads, threads=2)
    direct = gpt2attn.CausalSelfAttention(cfg, w, threads=2, weights_dtype=weights_dtype)
    assert loaded.config.kv_heads == 2 and weights_dtype + " weights" in loaded.implementation
    x = rand(rng, 2, 9, 64)
    np.testing.assert_array_equal(loaded.forward(x), direct.forward(x))
    outs = []
    for layer in (loaded, direct):
        cache = gpt2attn.KvCache(layer.config, block_tokens=16, capacity_tokens=64)
        seq = cache.create()
        outs.append((layer.extend(cache, seq, x[0, :8]), layer.decode(cache, [seq], x[0, 8:9])))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])

    odd = gpt2attn.Config(32, 4, d_in=37, context_length=32)
    w_odd = gpt2attn.Weights.random(odd, 43)
    odd_path = str(tmp_path / "odd.safetensors")
    gpt2attn.save_quantized(odd_path, odd, w_odd, weights_dtype)
    mha = gpt2attn.MultiHeadAttention.from_quantized(odd_path, gpt2attn.Config(32, 4, context_length=32),
                                                     weights_dtype=weights_dtype)
    assert mha.config.d_in == 37
    x_odd = rand(rng, 2, 5, 37)
    np.testing.assert_array_equal(mha.forward(x_odd),
                                  gpt2attn.MultiHeadAttention(odd, w_odd, weights_dtype=weights_dtype).forward(x_odd))

    other = "int4" if weights_dtype == "int8" else "int8"
    with pytest.raises(gpt2attn.InvalidArgument, match="EngineOptions.weights"):
        gpt2attn.CausalSelfAttention.from_quantized(path, heads, weights_dtype=other)
    with pytest.raises(gpt2attn.InvalidArgument, match="K/V"):
        gpt2attn.CausalSelfAttention.from_quantized(path, gpt2attn.Config(64, 4, num_kv_heads=4))
    with pytest.raises(gpt2attn.InvalidArgument, match="weights_dtype 'int3'"):
        gpt2attn.save_quantized(path, cfg, w, "int3")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts"))
    from export_safetensors import write_safetensors
    floats = write_safetensors(str(tmp_path / "f.safetensors"),
                               pc.state_dict_of(torch.nn.MultiheadAttention(64, 4, batch_first=True)))
    with pytest.raises(gpt2attn.BadFile, match="gpt2attn.weights"):
        gpt2attn.MultiHeadAttention.from_quantized(floats, heads)
    with open(path, "r+b") as f:  # cut short: the file and the tensor it ends in are named
        f.truncate(os.path.getsize(path) - 3)
    with pytest.raises(gpt2attn.BadFile, match=r"q\.safetensors: tensor '\w+_proj\.\w+'.*truncated"):
        gpt2attn.CausalSelfAttention.from_quantized(path, heads)


# ---------------------------------------------------------------------------------------------------------
# Zero copy: inputs are read where they lie, out= is written in place.

def test_contiguous_and_strided_inputs_reach_the_library_uncopied():
    x = rand(np.random.default_rng(1), 2, 5, 16)
    t = torch.from_numpy(x)
    assert gpt2attn._input_address(x) == x.ctypes.data
    assert gpt2attn._input_address(t) == t.data_ptr()
    view = x.transpose(1, 0, 2)  # (5, 2, 16), not contiguous
    assert gpt2attn._input_address(view) == view.ctypes.data


def test_strided_query_gives_the_contiguous_result():
    rng = np.random.default_rng(2)
    cfg = gpt2attn.Config(32, 4)
    layer = gpt2attn.MultiHeadAttention(cfg, gpt2attn.Weights.random(cfg, 3))
    base = rand(rng, 7, 3, 32)
    strided = base.transpose(1, 0, 2)  # (3, 7, 32) as strides
    np.testing.assert_array_equal(layer.forward(strided), layer.forward(np.ascontiguousarray(strided)))


def test_out_is_written_in_place_numpy_and_torch():
    rng = np.random.default_rng(4)
    cfg = gpt2attn.preset("gpt2-small")
    cfg.context_length = 64
    layer = gpt2attn.CausalSelfAttention(cfg, gpt2attn.Weights.random(cfg, 5), threads=2)
    x = rand(rng, 2, 9, 768)
    want = layer.forward(x)
    out = np.full((2, 9, 768), np.nan, dtype=np.float32)
    got = layer.forward(x, out=out)
    assert got is out or got.ctypes.data == out.ctypes.data
    np.testing.assert_array_equal(out, want)
    tout = torch.full((2, 9, 768), float("nan"))
    layer.forward(torch.from_numpy(x), out=tout)
    np.testing.assert_array_equal(tout.numpy(), want)


# ---------------------------------------------------------------------------------------------------------
# The KV cache from Python.

def serving_layer(capacity_tokens=256):
    cfg = gpt2attn.Config(64, 4, context_length=128)
    w = gpt2attn.Weights.random(cfg, 11)
    return cfg, gpt2attn.CausalSelfAttention(cfg, w, threads=2), gpt2attn.KvCache(cfg, capacity_tokens=capacity_tokens)


def test_prefill_decode_fork_release_match_forward():
    rng = np.random.default_rng(6)
    cfg, layer, cache = serving_layer()
    a, b = cache.create(), cache.create()
    xa, xb = rand(rng, 10, 64), rand(rng, 5, 64)
    ya = layer.extend(cache, a, xa[:9])
    yb = layer.extend(cache, b, xb[:4])
    step = layer.decode(cache, [a, b], np.stack([xa[9], xb[4]]))
    full_a, full_b = layer.forward(xa[np.newaxis])[0], layer.forward(xb[np.newaxis])[0]
    pc.compare(ya, full_a[:9].astype(np.float64), 64)
    pc.compare(yb, full_b[:4].astype(np.float64), 64)
    pc.compare(step, np.stack([full_a[9], full_b[4]]).astype(np.float64), 64)
    assert (cache.length(a), cache.length(b)) == (10, 5)

    child = cache.fork(a)
    xc = rand(rng, 1, 64)
    yc = layer.decode(cache, [child], xc)
    pc.compare(yc[0], layer.forward(np.concatenate([xa, xc])[np.newaxis])[0, 10].astype(np.float64), 64)
    assert cache.length(child) == 11 and cache.length(a) == 10
    cache.release(child)
    assert child not in cache and cache.num_sequences == 2


def test_prefix_fork_and_truncate():
    """fork(seq, prefix_tokens) shares a prompt's first tokens; truncate drops rejected draft tokens; each then
    continues as a forward over its own tokens."""
    rng = np.random.default_rng(8)
    cfg, layer, cache = serving_layer()
    a = cache.create()
    x = rand(rng, 80, 64)
    layer.extend(cache, a, x[:70])
    free = cache.free_blocks
    p = cache.fork(a, prefix_tokens=40)
    assert cache.length(p) == 40 and cache.free_blocks == free  # shared, not copied
    nxt = rand(rng, 1, 64)
    want = layer.forward(np.concatenate([x[:40], nxt])[np.newaxis])[0, 40].astype(np.float64)
    pc.compare(layer.decode(cache, [p], nxt)[0], want, 64)
    cache.truncate(a, 40)  # a's second block goes back; the fork's decode copied the first, which a keeps
    assert cache.length(a) == 40 and cache.free_blocks == free
    pc.compare(layer.decode(cache, [a], nxt)[0], want, 64)
    cache.release(p)
    cache.truncate(a, 10)
    assert cache.free_blocks == free + 1  # the fork's copy back; a still holds one block
    with pytest.raises(gpt2attn.InvalidArgument, match="new_length 11"):
        cache.truncate(a, 11)
    with pytest.raises(gpt2attn.InvalidArgument, match="prefix_tokens -1"):
        cache.fork(a, -1)


def test_ragged_step_matches_extend_of_each_entry():
    """step() over entries of 3, 1 and 5 new tokens, on sequences holding 6, 2 and 0, gives each entry's rows as
    extend() of that entry alone gives them on a second cache holding the same tokens. seqs and tokens come as a
    list, a tuple or a numpy int array; a torch tensor in gives a torch tensor out; out= is written in place."""
    rng = np.random.default_rng(9)
    cfg, layer, cache = serving_layer()
    ref = gpt2attn.KvCache(cfg, capacity_tokens=256)
    cached, new = [6, 2, 0], [3, 1, 5]
    seqs, refs = [cache.create() for _ in cached], [ref.create() for _ in cached]
    for s, r, n in zip(seqs, refs, cached):
        if n:
            prompt = rand(rng, n, 64)
            layer.extend(cache, s, prompt)
            layer.extend(ref, r, prompt)

    def extend_each(refs, new, x):
        rows = np.cumsum([0] + list(new))
        return np.concatenate([layer.extend(ref, r, x[rows[i]:rows[i + 1]]) for i, r in enumerate(refs)])

    x = rand(rng, sum(new), 64)
    want = extend_each(refs, new, x)
    ws = gpt2attn.Workspace()
    layer.reserve_step(sum(new), len(new), workspace=ws)
    assert ws.bytes == layer.step_workspace_bytes(sum(new), len(new)) > 0
    y = layer.step(cache, np.array(seqs), tuple(new), x, workspace=ws)
    assert y.shape == (9, 64) and y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    assert [cache.length(s) for s in seqs] == [9, 3, 5]

    # Another order and mix, torch in and out, on the layer's own workspace.
    x2 = rand(rng, 3, 64)
    want2 = extend_each([refs[2], refs[0]], [2, 1], x2)
    y2 = layer.step(cache, [seqs[2], seqs[0]], np.array([2, 1]), torch.from_numpy(x2))
    assert isinstance(y2, torch.Tensor)
    np.testing.assert_allclose(y2.numpy(), want2, rtol=1e-4, atol=1e-4)

    # out= is the result, written in place.
    x3 = rand(rng, 2, 64)
    want3 = extend_each([refs[1], refs[2]], [1, 1], x3)
    out = np.zeros((2, 64), np.float32)
    assert layer.step(cache, [seqs[1], seqs[2]], [1, 1], x3, out=out, workspace=ws) is out
    np.testing.assert_allclose(out, want3, rtol=1e-4, atol=1e-4)
    assert [cache.length(s) for s in seqs] == [10, 4, 8]


def test_bad_steps_raise_and_change_no_length():
    rng = np.random.default_rng(10)
    cfg, layer, cache = serving_layer()
    a, b = cache.create(), cache.create()
    layer.extend(cache, a, rand(rng, 4, 64))
    x = rand(rng, 3, 64)
    out = np.full((3, 64), 7.0, np.float32)
    free = cache.free_blocks
    with pytest.raises(gpt2attn.InvalidArgument, match="tokens=0"):
        layer.step(cache, [a, b], [3, 0], x, out=out)
    with pytest.raises(gpt2attn.InvalidArgument, match="twice"):
        layer.step(cache, [a, a], [1, 2], x, out=out)
    with pytest.raises(gpt2attn.InvalidArgument, match="987654"):
        layer.step(cache, [987654], [3], x, out=out)
    with pytest.raises(gpt2attn.InvalidArgument, match="context"):  # a holds 4 of the 128
        layer.step(cache, [a], [125], rand(rng, 125, 64))
    with pytest.raises(ValueError, match="seqs has 2 entries and tokens 1"):
        layer.step(cache, [a, b], [3], x)
    with pytest.raises(ValueError, match=r"expected \(3, 64\).*sum\(tokens\) = 3"):
        layer.step(cache, [a, b], [2, 1], x[:2])
    with pytest.raises(ValueError, match=r"out: shape \(2, 64\)"):
        layer.step(cache, [a, b], [2, 1], x, out=out[:2])
    with pytest.raises(gpt2attn.InvalidArgument, match=r"n \(entries\) must be >= 1"):
        layer.step(cache, [], [], x[:0])
    with pytest.raises(gpt2attn.InvalidArgument, match="float64"):
        layer.step(cache, [a, b], [2, 1], x.astype(np.float64))
    with pytest.raises(TypeError):
        layer.step(cache, [a, b], [2.0, 1.0], x)  # counts are ints, as seqs are
    np.testing.assert_array_equal(out, 7.0)
    assert (cache.length(a), cache.length(b), cache.free_blocks) == (4, 0, free)
    for bad in (lambda: layer.reserve_step(2, 3), lambda: layer.step_workspace_bytes(2, 3)):
        with pytest.raises(gpt2attn.InvalidArgument, match="max_entries"):
            bad()
    # The refused calls left the layer and cache serving.
    y = layer.step(cache, [a, b], [2, 1], x)
    assert y.shape == (3, 64) and (cache.length(a), cache.length(b)) == (6, 1)


def test_pool_exhaustion_raises_and_leaves_the_cache_unchanged():
    rng = np.random.default_rng(7)
    cfg, layer, cache = serving_layer(capacity_tokens=192)  # 3 blocks of 64
    s = cache.create()
    layer.extend(cache, s, rand(rng, 100, 64))  # 2 blocks
    free, length = cache.free_blocks, cache.length(s)
    key_before = cache.read_key(s, 0, 99)
    other = cache.create()
    with pytest.raises(gpt2attn.OutOfMemory) as e:
        layer.extend(cache, other, rand(rng, 120, 64))  # needs 2 blocks, 1 is free
    assert isinstance(e.value, MemoryError) and isinstance(e.value, gpt2attn.Error)
    assert "pool" in str(e.value).lower() or "block" in str(e.value).lower()
    assert (cache.free_blocks, cache.length(s), cache.length(other)) == (free, length, 0)
    np.testing.assert_array_equal(cache.read_key(s, 0, 99), key_before)


@pytest.mark.parametrize("dtype,name,ratio", [("bf16", "bf16", 2), ("int8", "i8", 3), ("fp8", "fp8", 3)])
def test_smaller_caches_hold_more_tokens(dtype, name, ratio):
    cfg = gpt2attn.Config(64, 4, context_length=128)
    f32 = gpt2attn.KvCache(cfg, capacity_bytes=1 << 20)
    small = gpt2attn.KvCache(cfg, capacity_bytes=1 << 20, dtype=dtype)
    assert small.dtype == name
    assert small.total_blocks >= ratio * f32.total_blocks


# ---------------------------------------------------------------------------------------------------------
# The GIL is released while the library computes: Python threads with their own workspaces decode together.

def test_threads_with_own_workspaces_match_sequential():
    rng = np.random.default_rng(8)
    cfg = gpt2attn.Config(256, 4, context_length=512)
    layer = gpt2attn.CausalSelfAttention(cfg, gpt2attn.Weights.random(cfg, 12), threads=1)
    prompts = [rand(rng, 384, 256) for _ in range(4)]
    sequential = [layer.forward(p[np.newaxis])[0] for p in prompts]
    results = [None] * 4

    def work(i):
        ws = gpt2attn.Workspace()
        for _ in range(3):
            results[i] = layer.forward(prompts[i][np.newaxis], workspace=ws)[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, sequential):
        np.testing.assert_array_equal(got, want)


def _gil_test_call(name):
    """The call `name` on layers and a cache built here, each taking milliseconds (decode repeats its short step)."""
    cfg = gpt2attn.Config(256, 4, context_length=2048)
    w = gpt2attn.Weights.random(cfg, 14)
    x = rand(np.random.default_rng(10), 1, 1024, 256)
    causal = gpt2attn.CausalSelfAttention(cfg, w, threads=1)
    if name == "CausalSelfAttention.forward":
        return lambda: causal.forward(x)
    if name == "MultiHeadAttention.forward":
        mha = gpt2attn.MultiHeadAttention(cfg, w, threads=1)
        return lambda: mha.forward(x)
    if name == "reference_forward":
        return lambda: gpt2attn.reference_forward(cfg, w, x[:, :128])
    if name == "reserve_serving":
        return lambda: causal.reserve_serving(1024, 16, threads=1)
    if name == "reserve_step":
        return lambda: causal.reserve_step(1024, 16, threads=1)
    cache = gpt2attn.KvCache(cfg, capacity_tokens=2048)
    seq = cache.create()
    if name == "extend":
        return lambda: causal.extend(cache, seq, x[0])
    causal.extend(cache, seq, x[0])
    if name == "step":
        other = cache.create()

        def ragged_steps():  # a decode token and a 4-token chunk a step; truncated back, so it can repeat
            cache.truncate(seq, 1024)
            cache.truncate(other, 0)
            for i in range(32):
                causal.step(cache, [seq, other], [1, 4], x[0, 5 * i:5 * i + 5])
        return ragged_steps
    assert name == "decode"

    def steps():
        for i in range(32):
            causal.decode(cache, [seq], x[0, i:i + 1])
    return steps


@pytest.mark.parametrize("name", ["CausalSelfAttention.forward", "MultiHeadAttention.forward", "extend", "decode",
                                  "step", "reserve_serving", "reserve_step", "reference_forward"])
def test_compute_releases_the_gil(name):
    """With a switch interval far longer than the test, Python hands the GIL over only where a thread blocks or
    releases it. A counting thread that yields the GIL every step can then advance during the calls only if they
    release it; were it held, the count read after them would equal the one read before."""
    call = _gil_test_call(name)
    count, go, stop = [0], threading.Event(), threading.Event()

    def counter():
        go.wait()
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)  # gives the GIL back at once, so the caller regains it when its call returns

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        c = threading.Thread(target=counter)
        c.start()
        go.set()
        # A busy machine may not wake the counter during one short call; a call that holds the GIL never lets it
        # run, however often it is repeated.
        before, deadline = count[0], time.monotonic() + 10.0
        call()
        while count[0] == before and time.monotonic() < deadline:
            call()
        during = count[0] - before
        stop.set()
        c.join()
    finally:
        sys.setswitchinterval(old)
    assert during > 0, f"a Python thread made no progress during {name}(): the GIL was held"


def test_layer_config_is_a_copy():
    """layer.config returned the layer's own Config by reference, so `layer.config.num_heads = 8` changed the shape
    a built layer trusts: forward then indexed projections it never made, and read past the input's rows."""
    cfg = gpt2attn.Config(64, 4, context_length=16)
    w = gpt2attn.Weights.random(cfg, 15)
    x = rand(np.random.default_rng(16), 1, 4, 64)
    for layer in (gpt2attn.MultiHeadAttention(cfg, w), gpt2attn.CausalSelfAttention(cfg, w)):
        want = layer.forward(x)
        c = layer.config
        before = (c.num_heads, c.d_in, c.causal)
        c.num_heads, c.d_in, c.causal = 8, 8, not c.causal
        assert (layer.config.num_heads, layer.config.d_in, layer.config.causal) == before
        np.testing.assert_array_equal(layer.forward(x), want)
        with pytest.raises(gpt2attn.InvalidArgument):
            layer.forward(x[:, :, :8])


# ---------------------------------------------------------------------------------------------------------
# Bad input: a Python exception naming the problem, never a crash.

def test_misaligned_arrays_are_refused():
    """A float32 array at an odd byte address (np.frombuffer with an offset) was read through a misaligned float*."""
    cfg = gpt2attn.Config(16, 2, context_length=8)
    mha = gpt2attn.MultiHeadAttention(cfg, gpt2attn.Weights.random(cfg, 18))
    causal = gpt2attn.CausalSelfAttention(cfg, gpt2attn.Weights.random(cfg, 18))
    raw = bytearray(4 * 2 * 3 * 16 + 1)
    x = np.frombuffer(raw, np.float32, count=2 * 3 * 16, offset=1).reshape(2, 3, 16)
    assert x.ctypes.data % 4 != 0
    with pytest.raises(gpt2attn.InvalidArgument, match="query: the data is not aligned"):
        mha.forward(x)
    with pytest.raises(gpt2attn.InvalidArgument, match="x: the data is not aligned"):
        causal.forward(x)
    good = np.zeros((2, 3, 16), np.float32)
    out = np.frombuffer(bytearray(4 * 2 * 3 * 16 + 1), np.float32, count=2 * 3 * 16, offset=1).reshape(2, 3, 16)
    with pytest.raises(gpt2attn.InvalidArgument, match="out: the data is not aligned"):
        causal.forward(good, out=out)
    mask = np.frombuffer(bytearray(4 * 9 + 1), np.float32, count=9, offset=1).reshape(3, 3)
    with pytest.raises(gpt2attn.InvalidArgument, match="attn_mask: the data is not aligned"):
        mha.forward(good, attn_mask=mask)


def test_bad_input_raises_library_errors():
    cfg = gpt2attn.Config(32, 4, context_length=16)
    layer = gpt2attn.CausalSelfAttention(cfg, gpt2attn.Weights.random(cfg, 1))
    with pytest.raises(gpt2attn.InvalidArgument, match="float64"):
        layer.forward(np.zeros((1, 4, 32)))
    with pytest.raises(ValueError, match="shape"):
        layer.forward(np.zeros((1, 4, 31), dtype=np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        layer.forward(np.zeros((4, 2, 32), dtype=np.float32).transpose(1, 0, 2))
    with pytest.raises(ValueError, match="context"):
        layer.forward(np.zeros((1, 17, 32), dtype=np.float32))
    ro = np.zeros((1, 4, 32), dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        layer.forward(np.zeros((1, 4, 32), dtype=np.float32), out=ro)
    with pytest.raises(gpt2attn.InvalidArgument, match="num_heads|divide"):
        gpt2attn.CausalSelfAttention(gpt2attn.Config(30, 4), gpt2attn.Weights.random(gpt2attn.Config(32, 4), 1))
    with pytest.raises(gpt2attn.InvalidArgument, match="supported"):
        gpt2attn.KvCache(cfg, capacity_tokens=16, dtype="f16")
    with pytest.raises(gpt2attn.InvalidArgument, match="gpt2-small"):
        gpt2attn.preset("gpt2-tiny")
    with pytest.raises(gpt2attn.InvalidArgument, match="NaN"):
        x = np.zeros((1, 4, 32), dtype=np.float32)
        x[0, 2, 5] = np.nan
        layer.forward(x)
    with pytest.raises(gpt2attn.BadFile):
        gpt2attn.load_safetensors("/nonexistent.safetensors", "", cfg)


def test_weights_shapes_are_checked_against_the_config():
    """A (kdim, E) matrix where (E, kdim) belongs has the right size; before, it was taken and every output was
    wrong. Also a NaN weight refuses the layer."""
    rng = np.random.default_rng(3)
    cfg = gpt2attn.Config(16, 4, kdim=8, vdim=8, qkv_bias=False, out_bias=False)
    wq, wk, wv, wo = rand(rng, 16, 16), rand(rng, 16, 8), rand(rng, 16, 8), rand(rng, 16, 16)
    gpt2attn.MultiHeadAttention(cfg, gpt2attn.Weights(wq, wk, wv, wo), threads=1)  # the right layout
    transposed = gpt2attn.Weights(wq, np.ascontiguousarray(wk.T), np.ascontiguousarray(wv.T), wo)
    with pytest.raises(gpt2attn.InvalidArgument, match=r"w_k has shape \(8, 16\), expected \(out, in\) = \(16, 8\)"):
        gpt2attn.MultiHeadAttention(cfg, transposed, threads=1)
    with pytest.raises(gpt2attn.InvalidArgument, match=r"w_q has shape \(4, 64\)"):
        gpt2attn.MultiHeadAttention(cfg, gpt2attn.Weights(wq.reshape(4, 64), wk, wv, wo), threads=1)
    with pytest.raises(gpt2attn.InvalidArgument, match="w_k"):
        x = rand(rng, 1, 3, 16)
        gpt2attn.reference_forward(cfg, transposed, x, rand(rng, 1, 5, 8), rand(rng, 1, 5, 8))
    wo[2, 3] = np.nan
    with pytest.raises(gpt2attn.InvalidArgument, match=r"w_o contains NaN at \(2, 3\)"):
        gpt2attn.MultiHeadAttention(cfg, gpt2attn.Weights(wq, wk, wv, wo), threads=1)


def test_dtypes_compare_by_value_not_identity():
    """A float32 array whose dtype is another object (from pickle, with metadata, a native byte order spelled out)
    is float32; before, the check compared dtype objects and refused it as 'dtype float32, expected float32'."""
    import pickle
    cfg = gpt2attn.Config(32, 4, context_length=16)
    layer = gpt2attn.CausalSelfAttention(cfg, gpt2attn.Weights.random(cfg, 1), threads=1)
    x = np.random.default_rng(4).standard_normal((1, 4, 32)).astype(np.float32)
    want = layer.forward(x)
    for y in (pickle.loads(pickle.dumps(x)), x.view(np.dtype(np.float32, metadata={"k": 1})),
              x.view(np.dtype("=f4"))):
        np.testing.assert_array_equal(layer.forward(y), want)
    mha = gpt2attn.MultiHeadAttention(cfg, gpt2attn.Weights.random(cfg, 2), threads=1)
    mask = pickle.loads(pickle.dumps(np.triu(np.ones((4, 4), dtype=np.bool_), 1)))
    plain = np.triu(np.ones((4, 4), np.bool_), 1)
    np.testing.assert_array_equal(mha.forward(x, attn_mask=mask), mha.forward(x, attn_mask=plain))


def test_reference_forward_agrees_with_the_layer():
    rng = np.random.default_rng(9)
    cfg = gpt2attn.Config(48, 6, causal=True)
    w = gpt2attn.Weights.random(cfg, 13)
    x = rand(rng, 2, 11, 48)
    got = gpt2attn.MultiHeadAttention(cfg, w).forward(x)
    pc.compare(got, gpt2attn.reference_forward(cfg, w, x), pc.reduction_length(48, 11))


def test_resizing_an_input_during_a_call_is_documented_as_the_callers_contract():
    """A call holds a reference to its arrays, which stops a checked arr.resize() but not
    arr.resize(..., refcheck=False): that frees the buffer being read, a use-after-free no reference can prevent.
    It can only be the caller's contract, so it must be written where callers read: the package docstring and
    docs/python.md."""
    a = np.zeros((2, 3), dtype=np.float32)
    held = [a]  # what a running call holds
    with pytest.raises(ValueError):
        a.resize((4, 3))  # the checked resize is stopped by the reference
    del held
    doc_path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "python.md")
    with open(doc_path, encoding="utf-8") as f:
        docs = f.read()
    for where, text in (("gpt2attn.__doc__", gpt2attn.__doc__), ("docs/python.md", docs)):
        assert "refcheck=False" in text and "use-after-free" in text, where
