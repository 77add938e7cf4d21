# tests/python/test_torch_mha_parity.py: `gpt2attn forward` against torch.nn.MultiheadAttention (torch 1.13),
# seed 001's exact check plus random shapes, masks, weight dtypes and thread counts against a float64 torch.
# It does not test the C++ API directly (the GoogleTest suite does) nor bad input (test_cli_errors.py).
import os
import sys

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402


# ---------------------------------------------------------------------------------------------------------
# (a) seed 001, verbatim: float32 torch, torch.allclose(atol=1e-8, rtol=1e-5).

def seed_001(r):
    wd = r.workdir()
    torch.manual_seed(42)
    batch_size, seq_len, d_model, num_heads = 3, 4, 8, 2
    q = torch.rand(batch_size, seq_len, d_model)
    k = torch.rand(batch_size, seq_len, d_model)
    v = torch.rand(batch_size, seq_len, d_model)
    multihead_attn = torch.nn.MultiheadAttention(embed_dim=d_model, num_heads=num_heads, bias=False,
                                                 batch_first=True)
    output, _ = multihead_attn(q, k, v)
    w = pc.write_safetensors(os.path.join(wd, "w.safetensors"), pc.state_dict_of(multihead_attn))
    ours = pc.forward(r.cli, wd, w, num_heads, q.numpy(), key=k.numpy(), value=v.numpy())
    ours = torch.from_numpy(ours)
    check(ours.shape == output.shape, "shape %s, expected %s" % (tuple(ours.shape), tuple(output.shape)))
    ok = torch.allclose(ours, output.detach(), atol=1e-08, rtol=1e-05)
    err = (ours - output.detach()).abs().max().item()
    check(ok, "torch.allclose(atol=1e-8, rtol=1e-5) is False; max abs err %.3g" % err)
    return "max err %.2g" % err


# ---------------------------------------------------------------------------------------------------------
# (b) random cases against float64 torch.

def make_mha(seed, E, H, bias=True, kdim=None, vdim=None):
    """A float64 batch_first MHA with random (nonzero) biases: torch initialises them to zero."""
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(E, H, bias=bias, batch_first=True, kdim=kdim, vdim=vdim).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return m


def rows_dead(allowed):
    """(B, T) bool: rows (b, t) with nothing to attend to, from allowed (B, H, T, Tk).
    The cases below never mask one head's row while another head of it attends (torch would NaN the row)."""
    dead_bh = ~allowed.any(axis=-1)  # (B, H, T)
    check(np.all(dead_bh == dead_bh[:, :1]), "test bug: a row is dead for some heads only")
    return dead_bh[:, 0]


def mha_case(r, seed, B, T, E, H, Tk=None, kdim=None, vdim=None, bias=True, cross=False,
             mask=None, mask_kind=None, key_padding=None, causal=False, weight_dtype="F32",
             drop=(), input_dtype=np.float64, threads=None, prefix=None, extra_tensors=None, cli_kind="same"):
    """One CLI run vs torch MHA in float64. mask is ours (rank 2/3/4, kind keep|block|additive); cli_kind None
    leaves --mask-kind out, so the CLI reads the mask by its dtype."""
    wd = r.workdir()
    Tk = T if Tk is None else Tk
    m = make_mha(seed, E, H, bias=bias, kdim=kdim, vdim=vdim)
    sd = pc.state_dict_of(m)
    for name in drop:  # a bias left out of the file means a zero bias
        with torch.no_grad():
            dict(m.named_parameters())[name].zero_()
        del sd[name]
    if weight_dtype != "F32":  # torch then runs with the rounded weights, up-cast back to float64
        tdt = {"F16": torch.float16, "BF16": torch.bfloat16}[weight_dtype]
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(p.to(tdt).to(torch.float64))
        sd = pc.state_dict_of(m)
        for name in drop:
            del sd[name]
    tensors = {(prefix or "") + k: v for k, v in sd.items()}
    if extra_tensors:
        tensors.update(extra_tensors)
    w = pc.write_safetensors(os.path.join(wd, "w.safetensors"), tensors, dtype=weight_dtype)

    g = np.random.default_rng(seed)
    q = g.standard_normal((B, T, E))
    if cross or kdim or vdim:
        k = g.standard_normal((B, Tk, kdim or E))
        v = g.standard_normal((B, Tk, vdim or E))
    else:
        k = v = q
    q_in = q.astype(input_dtype)
    k_in, v_in = (None, None) if k is q else (k.astype(input_dtype), v.astype(input_dtype))
    if input_dtype == np.float32:  # the reference sees exactly what the CLI read
        q = q_in.astype(np.float64)
        if k_in is not None:
            k, v = k_in.astype(np.float64), v_in.astype(np.float64)
        else:
            k = v = q

    # torch's masks: bool (B*H, T, Tk) or (T, Tk), True = may not attend; float additive likewise
    allowed = np.ones((B, H, T, Tk), dtype=bool)
    t_mask = None
    if mask is not None:
        m4 = np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape) if mask.ndim != 3
                             else mask[:, None], (B, H, T, Tk))
        if mask_kind == "keep":
            t4 = torch.from_numpy(np.ascontiguousarray(m4 == 0))
            allowed &= (m4 != 0)
        elif mask_kind == "block":
            t4 = torch.from_numpy(np.ascontiguousarray(m4 != 0))
            allowed &= (m4 == 0)
        else:
            t4 = torch.from_numpy(np.ascontiguousarray(m4.astype(np.float64)))
            allowed &= np.isfinite(m4)
        # rank 2 stays (T, Tk); ranks 3 and 4 become torch's (B*H, T, Tk)
        t_mask = t4[0, 0] if mask.ndim == 2 else t4.reshape(B * H, T, Tk)
    if causal:
        cm = pc.causal_block_mask(T, Tk)
        allowed &= ~cm.numpy()
        t_mask = pc.with_causal(t_mask, cm)
    t_kpm = None
    if key_padding is not None:
        t_kpm = torch.from_numpy(key_padding != 0)
        allowed &= (key_padding == 0)[:, None, None, :]
    ref = pc.torch_mha(m, q, k, v, attn_mask=t_mask, key_padding_mask=t_kpm)

    y = pc.forward(r.cli, wd, w, H, q_in, key=k_in, value=v_in, mask=mask,
                   mask_kind=mask_kind if cli_kind == "same" else cli_kind,
                   key_padding=key_padding, causal=causal, threads=threads, prefix=prefix)
    dead = rows_dead(allowed)
    red = pc.reduction_length(max(E, kdim or 0, vdim or 0), Tk)
    if dead.any():
        ob = sd.get("out_proj.bias")
        return pc.compare_with_dead_rows(y, ref, dead, None if ob is None else ob.numpy(), red), y, ref
    return pc.compare(y, ref, red), y, ref


def first(fn):
    """Adapts mha_case (note, y, ref) to the runner (note only)."""
    return lambda *a, **kw: fn(*a, **kw)[0]


def rand_block(g, shape, p=0.35):
    """Random bool block mask (True = may not attend) with the last key of each row always allowed."""
    mk = g.random(shape) < p
    mk[..., -1] = False
    return mk


def extreme_additive(r, seed, causal):
    """Additive masks at float32's extremes, against torch.nn.MultiheadAttention in float32 (what Hugging Face
    runs: its masked positions hold finfo(float32).min) and in float64. torch adds the mask to the scores,
    s + x: finfo.min absorbs s, so a row of it is uniform attention, not a dead row; +3e38 and finfo.max rows
    likewise; -inf still blocks."""
    wd = r.workdir()
    B, T, E, H = 2, 7, 16, 2
    Tk = T if causal else 11
    fmin, fmax = np.finfo(np.float32).min, np.finfo(np.float32).max
    g = np.random.default_rng(seed)
    mask = g.standard_normal((B, T, Tk)).astype(np.float32)
    # rows 4-6 see at least 5 keys when causal (row i sees keys 0..i), so none of them is dead
    mask[0, 0, :] = fmin                                      # a row of finfo.min: uniform
    mask[0, 1, ::2], mask[0, 1, 1::2] = fmin, 0.0             # mixed: finfo.min and 0
    mask[0, 2, :] = 3e38                                      # +3e38: uniform, finite
    mask[0, 3, :] = fmax
    mask[1, 4, :], mask[1, 4, :3] = fmin, -np.inf             # -inf blocks, finfo.min attends
    mask[1, 5, 4:] = fmin                                     # padding at the end, as Hugging Face writes it
    mask[1, 6, :], mask[1, 6, 6] = fmin, 3e38                 # one key outweighs the rest
    m64 = make_mha(seed, E, H)
    m32 = nn.MultiheadAttention(E, H, batch_first=True)
    m32.load_state_dict({k: v.float() for k, v in m64.state_dict().items()})
    x = g.standard_normal((B, T, E)).astype(np.float32)
    kv = x if causal else g.standard_normal((B, Tk, E)).astype(np.float32)
    t_mask = torch.from_numpy(np.repeat(mask, H, axis=0))     # torch's (B*H, T, Tk), batch-major
    if causal:
        t_mask = t_mask.masked_fill(pc.causal_block_mask(T, Tk), float("-inf"))
    ref64 = pc.torch_mha(m64, x, kv, kv, attn_mask=t_mask)
    ref32 = pc.torch_mha(m32, x, kv, kv, attn_mask=t_mask)
    w = pc.write_safetensors(os.path.join(wd, "w.safetensors"), pc.state_dict_of(m64))
    y = pc.forward(r.cli, wd, w, H, x, key=None if causal else kv, value=None if causal else kv, mask=mask,
                   mask_kind="additive", causal=causal)
    red = pc.reduction_length(E, Tk)
    check(np.all(np.isfinite(ref32)), "test bug: torch float32 is not finite")
    pc.compare(ref32, ref64, red, "torch float32 vs float64")  # the premise: fp32 torch gives the same rows
    pc.compare(y, ref32, red, "ours vs torch float32")
    return pc.compare(y, ref64, red, "ours vs torch float64")


def torch_mask_layouts(r):
    """The CLI reads torch's (B * H, T, Tk) mask and numpy's size-1 B or H axes as the (B, H, T, Tk) mask they
    stand for: bit-identical outputs (the 4-D mask itself is checked against torch by the cases above)."""
    wd = r.workdir()
    B, T, E, H = 2, 5, 8, 2
    m = make_mha(40, E, H)
    w = pc.write_safetensors(os.path.join(wd, "w.safetensors"), pc.state_dict_of(m))
    g = np.random.default_rng(40)
    x = g.standard_normal((B, T, E)).astype(np.float32)
    full = rand_block(g, (B, H, T, T))
    full[..., 0] = False  # every row attends somewhere
    want = pc.forward(r.cli, wd, w, H, x, mask=full, tag="full")
    got = pc.forward(r.cli, wd, w, H, x, mask=full.reshape(B * H, T, T), tag="bh")
    check(np.array_equal(got, want), "(B*H, T, Tk) mask differs from (B, H, T, Tk)")
    one = pc.forward(r.cli, wd, w, H, x, mask=full[:1], tag="one")
    spelled = pc.forward(r.cli, wd, w, H, x, mask=np.ascontiguousarray(np.broadcast_to(full[:1], full.shape)),
                         tag="spelled")
    check(np.array_equal(one, spelled), "(1, H, T, Tk) mask differs from its broadcast (B, H, T, Tk)")
    return "3 layouts"


def unbatched(r, cross):
    """A (T, E) query, as torch takes it unbatched: a (T, E) output equal to torch's, with (Tk, E) key and value
    and a (Tk,) key padding mask when cross."""
    wd = r.workdir()
    T, Tk, E, H = 6, 9, 16, 4
    m = make_mha(50 + cross, E, H)
    w = pc.write_safetensors(os.path.join(wd, "w.safetensors"), pc.state_dict_of(m))
    g = np.random.default_rng(50 + cross)
    q = g.standard_normal((T, E)).astype(np.float32)
    kv = g.standard_normal((Tk, E)).astype(np.float32) if cross else q
    pad = (g.random(Tk) < 0.3) if cross else None
    if cross:
        pad[0] = False
    y = pc.forward(r.cli, wd, w, H, q, key=kv if cross else None, value=kv if cross else None, key_padding=pad)
    check(y.shape == (T, E), "output shape %s, expected %s" % (y.shape, (T, E)))
    with torch.no_grad():
        tq, tkv = torch.from_numpy(q).double(), torch.from_numpy(kv).double()
        want, _ = m(tq, tkv, tkv, key_padding_mask=None if pad is None else torch.from_numpy(pad), need_weights=False)
    return pc.compare(y, want.numpy(), pc.reduction_length(E, Tk if cross else T))


def main():
    r = pc.Runner(__doc__)
    case = lambda name, **kw: r.case(name, first(mha_case), r, **kw)  # noqa: E731
    g = np.random.default_rng(1234)

    r.case("seed001_allclose_f32", seed_001, r)

    # projections and shapes
    case("self_fused_bias_B2_T5_E8_H2", seed=1, B=2, T=5, E=8, H=2)
    case("self_fused_nobias_B3_T7_E16_H4", seed=2, B=3, T=7, E=16, H=4, bias=False)
    case("self_T1_E24_H3", seed=3, B=2, T=1, E=24, H=3)
    case("self_odd_B1_T13_E20_H5", seed=4, B=1, T=13, E=20, H=5)
    case("self_qkv_bias_only", seed=5, B=2, T=6, E=8, H=2, drop=("out_proj.bias",))
    case("self_out_bias_only", seed=6, B=2, T=6, E=8, H=2, drop=("in_proj_bias",))
    case("self_E64_H4_T33_causal", seed=7, B=2, T=33, E=64, H=4, causal=True)
    case("self_E32_H2_T113", seed=8, B=1, T=113, E=32, H=2)
    case("cross_fused_T5_Tk9", seed=9, B=2, T=5, Tk=9, E=8, H=2, cross=True)
    case("cross_kdim6_vdim10_T4_Tk7", seed=10, B=2, T=4, Tk=7, E=8, H=2, kdim=6, vdim=10)
    case("cross_kdim12_vdim12_nobias", seed=11, B=3, T=3, Tk=5, E=16, H=4, kdim=12, vdim=12, bias=False)
    case("cross_T9_Tk2", seed=12, B=2, T=9, Tk=2, E=12, H=3, cross=True)

    # boolean masks as --mask-kind block (torch's bool attn_mask) and keep (seed 002's mask == 0 -> -inf)
    case("block_rank2_bool", seed=20, B=2, T=6, E=8, H=2, mask=rand_block(g, (6, 6)), mask_kind="block")
    case("block_rank2_uint8_cross", seed=21, B=2, T=4, Tk=7, E=8, H=2, cross=True,
         mask=rand_block(g, (4, 7)).astype(np.uint8), mask_kind="block")
    case("block_rank3_bool", seed=22, B=3, T=5, E=12, H=3, mask=rand_block(g, (3, 5, 5)), mask_kind="block")
    case("block_rank4_bool_cross", seed=23, B=2, T=5, Tk=6, E=8, H=2, cross=True,
         mask=rand_block(g, (2, 2, 5, 6)), mask_kind="block")
    case("keep_rank2_bool", seed=24, B=2, T=6, E=8, H=2, mask=~rand_block(g, (6, 6)), mask_kind="keep")
    case("keep_rank3_uint8", seed=25, B=2, T=5, E=8, H=2,
         mask=(~rand_block(g, (2, 5, 5))).astype(np.uint8), mask_kind="keep")
    case("keep_rank4_float32", seed=26, B=2, T=4, E=8, H=2,
         mask=(~rand_block(g, (2, 2, 4, 4))).astype(np.float32), mask_kind="keep")

    # no --mask-kind: the CLI reads a mask as torch does, bool and uint8 block, float adds
    case("default_kind_bool_blocks", seed=27, B=2, T=6, E=8, H=2, mask=rand_block(g, (6, 6)), mask_kind="block",
         cli_kind=None)
    case("default_kind_uint8_blocks", seed=28, B=2, T=5, E=8, H=2, mask=rand_block(g, (2, 5, 5)).astype(np.uint8),
         mask_kind="block", cli_kind=None)
    add_default = g.standard_normal((5, 5)).astype(np.float32)
    add_default[rand_block(g, (5, 5))] = -np.inf
    case("default_kind_float_adds", seed=29, B=2, T=5, E=8, H=2, mask=add_default, mask_kind="additive",
         cli_kind=None)

    r.case("torch_mask_layouts", torch_mask_layouts, r)
    r.case("unbatched_self", unbatched, r, cross=False)
    r.case("unbatched_cross_key_padding", unbatched, r, cross=True)

    # float masks as additive (torch's float attn_mask, added to the scaled scores)
    add2 = g.standard_normal((6, 6)).astype(np.float32)
    add2[rand_block(g, (6, 6))] = -np.inf
    case("additive_rank2_f32_with_inf", seed=30, B=2, T=6, E=8, H=2, mask=add2, mask_kind="additive")
    case("additive_rank3_f64", seed=31, B=2, T=5, Tk=7, E=8, H=2, cross=True,
         mask=3 * g.standard_normal((2, 5, 7)), mask_kind="additive")
    case("additive_rank4_f32", seed=32, B=2, T=4, E=12, H=3,
         mask=g.standard_normal((2, 3, 4, 4)).astype(np.float32), mask_kind="additive")

    # additive masks at float32's extremes (finfo.min rows, finfo.min mixed with 0, +3e38, finfo.max)
    r.case("additive_extremes_cross_f32_and_f64_torch", extreme_additive, r, seed=33, causal=False)
    r.case("additive_extremes_causal_self_f32_and_f64_torch", extreme_additive, r, seed=34, causal=True)

    # key padding
    kp = np.zeros((3, 6), dtype=bool)
    kp[0, 4:] = True
    kp[1, :2] = True
    case("key_padding_bool", seed=40, B=3, T=6, E=8, H=2, key_padding=kp)
    case("key_padding_uint8_with_block_rank3", seed=41, B=3, T=4, Tk=6, E=8, H=2, cross=True,
         key_padding=kp.astype(np.uint8), mask=rand_block(g, (3, 4, 6)), mask_kind="block")

    # causal (bottom-right aligned) vs torch.triu(ones(T, Tk), diagonal=Tk-T+1)
    case("causal_self_T9", seed=50, B=2, T=9, E=8, H=2, causal=True)
    case("causal_cross_T4_Tk11", seed=51, B=2, T=4, Tk=11, E=8, H=2, cross=True, causal=True)
    case("causal_cross_T7_Tk3_dead_rows", seed=52, B=2, T=7, Tk=3, E=8, H=2, cross=True, causal=True)
    case("causal_with_key_padding", seed=53, B=3, T=6, E=8, H=2, causal=True, key_padding=kp)
    case("causal_with_additive_rank2", seed=54, B=2, T=5, E=8, H=2, causal=True,
         mask=g.standard_normal((5, 5)).astype(np.float32), mask_kind="additive")

    # rows that can attend to nothing: ours = out_proj.bias (zeros without bias), torch = NaN
    dead = rand_block(g, (5, 5))
    dead[2, :] = True
    case("dead_row_block_rank2_bias", seed=60, B=2, T=5, E=8, H=2, mask=dead, mask_kind="block")
    kp_dead = np.zeros((2, 5), dtype=bool)
    kp_dead[1, :] = True
    case("dead_batch_key_padding_nobias", seed=61, B=2, T=5, E=8, H=2, bias=False, key_padding=kp_dead)
    add_dead = g.standard_normal((2, 4, 4)).astype(np.float32)
    add_dead[0, 3, :] = -np.inf
    case("dead_row_additive_inf", seed=62, B=2, T=4, E=8, H=2, mask=add_dead, mask_kind="additive")
    keep_dead = np.ones((2, 2, 4, 4), dtype=np.uint8)
    keep_dead[1, :, 0, :] = 0
    case("dead_row_keep_rank4", seed=63, B=2, T=4, E=8, H=2, mask=keep_dead, mask_kind="keep")

    # weight dtypes
    case("weights_f16", seed=70, B=2, T=6, E=16, H=4, weight_dtype="F16")
    case("weights_bf16", seed=71, B=2, T=6, E=16, H=4, weight_dtype="BF16", causal=True)
    case("weights_bf16_kdim_vdim", seed=72, B=2, T=3, Tk=5, E=8, H=2, kdim=4, vdim=6, weight_dtype="BF16")
    case("weights_f16_nobias_cross", seed=73, B=1, T=5, Tk=4, E=8, H=2, cross=True, bias=False,
         weight_dtype="F16")

    # naming: a prefix and unrelated tensors in the file
    case("torch_names_with_prefix", seed=80, B=2, T=4, E=8, H=2, prefix="encoder.layers.0.self_attn.",
         extra_tensors={"encoder.layers.0.linear1.weight": torch.randn(16, 8),
                        "encoder.layers.1.self_attn.in_proj_weight": torch.randn(24, 8)})

    # --threads 1 vs 2, float32 vs float64 input files
    def threads_agree():
        n1, y1, ref = mha_case(r, seed=90, B=2, T=37, E=32, H=4, causal=True, threads=1)
        n2, y2, _ = mha_case(r, seed=90, B=2, T=37, E=32, H=4, causal=True, threads=2)
        pc.compare(y1, y2.astype(np.float64), pc.reduction_length(32, 37), "threads 1 vs 2")
        return "%s / %s, bitwise equal: %s" % (n1, n2, np.array_equal(y1, y2))
    r.case("threads_1_vs_2", threads_agree)

    def f32_vs_f64_inputs():
        n1, y1, _ = mha_case(r, seed=91, B=2, T=5, Tk=6, E=8, H=2, cross=True, input_dtype=np.float32)
        n2, y2, _ = mha_case(r, seed=91, B=2, T=5, Tk=6, E=8, H=2, cross=True, input_dtype=np.float64)
        # the same seed gives the same float64 draws; the f32 file holds them rounded
        pc.compare(y1, y2.astype(np.float64), pc.reduction_length(8, 6), "f32 vs f64 input files")
        return "%s / %s" % (n1, n2)
    r.case("inputs_f32_vs_f64", f32_vs_f64_inputs)

    def f32_inputs_exact_in_f64():
        # values exactly representable in float32, stored once as <f4 and once as <f8: same bits out
        wd = r.workdir()
        m = make_mha(92, 8, 2)
        w = pc.write_safetensors(os.path.join(wd, "w.safetensors"), pc.state_dict_of(m))
        x = np.random.default_rng(92).standard_normal((2, 5, 8)).astype(np.float32)
        y32 = pc.forward(r.cli, wd, w, 2, x, tag="a")
        y64 = pc.forward(r.cli, wd, w, 2, x.astype(np.float64), tag="b")
        ref = pc.torch_mha(m, x.astype(np.float64), x.astype(np.float64), x.astype(np.float64))
        pc.compare(y32, ref, 8)
        check(np.array_equal(y32, y64), "same float32 values as <f4 and <f8 files differ: max diff %.3g"
              % np.max(np.abs(y32 - y64)))
        return "bitwise equal"
    r.case("inputs_f32_exact_as_f64_bitwise", f32_inputs_exact_in_f64)

    r.finish()


if __name__ == "__main__":
    main()
