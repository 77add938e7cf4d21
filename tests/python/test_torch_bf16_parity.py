# tests/python/test_torch_bf16_parity.py: `gpt2attn forward --dtype bf16` against torch.nn.MultiheadAttention in
# bfloat16 (torch 1.13). On the same inputs and the same float32 weights file, our error against a float64 torch is
# at most 1.5x the error of torch's bf16 module (max abs over the whole output), over random shapes: the five
# GPT-2/GPT-3 widths, T = 1 and odd T, cross-attention with Tk != T, bias on and off, key padding, bool and additive
# masks, and the widening kernels (--isa avx512, avx2, scalar). Float32 parity is test_torch_mha_parity.py's.
import copy
import json
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402

RATIO = 1.5          # ours may be at most this many times torch bf16's max abs error against float64
BIG_CLI_TIMEOUT_S = 300  # the 12288-wide layer: a 2.4 GB float32 file to load and convert


def make_mha(seed, E, H, bias=True):
    """A float32 batch_first MHA, torch's own init, with random (nonzero) biases: torch initialises them to zero."""
    torch.manual_seed(seed)
    m = nn.MultiheadAttention(E, H, bias=bias, batch_first=True)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return m


def judge(y, tb, ref):
    """ours (y) and torch bf16 (tb) against float64 (ref): max abs error over the whole output, ours <= 1.5x."""
    check(y.shape == ref.shape, "output shape %s, expected %s" % (y.shape, ref.shape))
    check(np.all(np.isfinite(ref)), "test bug: the float64 reference is not finite (a fully masked row?)")
    check(np.all(np.isfinite(tb)), "test bug: torch bf16 output is not finite")
    check(np.all(np.isfinite(y)), "%d non-finite elements in our output" % int(np.sum(~np.isfinite(y))))
    scale = float(np.max(np.abs(ref)))
    e_ours = np.abs(y.astype(np.float64) - ref)
    ours = float(np.max(e_ours))
    theirs = float(np.max(np.abs(tb.astype(np.float64) - ref)))
    check(theirs > 0, "test bug: torch bf16 equals float64 exactly")
    note = ("ours %.3g (%.2g of max|ref| %.3g), torch bf16 %.3g (%.2g), ratio %.2f"
            % (ours, ours / scale, scale, theirs, theirs / scale, ours / theirs))
    worst = np.unravel_index(int(np.argmax(e_ours)), e_ours.shape)
    check(ours <= RATIO * theirs, "error above %.1fx torch bf16's: %s; worst at [%s]: ref %.6g ours %.6g torch %.6g"
          % (RATIO, note, ",".join(map(str, worst)), ref[worst], y[worst], tb[worst]))
    return note


def bf16_case(r, seed, B, T, E, H, Tk=None, cross=False, bias=True, causal=False, mask=None, key_padding=None,
              isa=None, threads=None):
    """One CLI run with --dtype bf16 on the float32 weights file vs torch's module in float64 and in bf16.
    mask is torch's reading: bool (True = may not attend, --mask-kind block) or float (added, --mask-kind
    additive), shaped (T, Tk) or (B, T, Tk). Returns (note, ours, float64 reference)."""
    wd = r.workdir()
    Tk = T if Tk is None else Tk
    m = make_mha(seed, E, H, bias=bias)
    w = pc.write_safetensors(os.path.join(wd, "w.safetensors"), pc.state_dict_of(m))
    g = np.random.default_rng(seed)
    q = g.standard_normal((B, T, E)).astype(np.float32)
    k, v = ((g.standard_normal((B, Tk, E)).astype(np.float32) for _ in range(2)) if cross else (q, q))
    t_mask, kind = None, None
    if mask is not None:
        kind = "block" if mask.dtype == bool else "additive"
        t_mask = torch.from_numpy(mask if mask.ndim == 2 else np.repeat(mask, H, axis=0))  # torch: (B*H, T, Tk)
    if causal:
        t_mask = pc.with_causal(t_mask, pc.causal_block_mask(T, Tk))
    t_kpm = None if key_padding is None else torch.from_numpy(key_padding)
    ref = pc.torch_mha(copy.deepcopy(m).double(), *(a.astype(np.float64) for a in (q, k, v)),
                       attn_mask=t_mask, key_padding_mask=t_kpm)
    tb = pc.torch_mha(copy.deepcopy(m).to(torch.bfloat16), q, k, v, attn_mask=t_mask, key_padding_mask=t_kpm)
    y = pc.forward(r.cli, wd, w, H, q, key=k if cross else None, value=v if cross else None, mask=mask,
                   mask_kind=kind, key_padding=key_padding, causal=causal, threads=threads,
                   extra=["--dtype", "bf16"] + ([] if isa is None else ["--isa", isa]))
    return judge(y, tb, ref), y, ref


def first(fn):
    """Adapts bf16_case (note, y, ref) to the runner (note only)."""
    return lambda *a, **kw: fn(*a, **kw)[0]


def rand_block(g, shape, keep_col, p=0.35):
    """Random bool block mask (True = may not attend), column keep_col of every row always allowed."""
    mk = g.random(shape) < p
    mk[..., keep_col] = False
    return mk


def rand_additive(g, shape, keep_col, p=0.25):
    """Random float32 additive mask of multiples of 0.25 in [-2, 2] (exact in bf16, so torch's bf16 module adds
    the same mask) with -inf at random places, column keep_col of every row finite."""
    a = (g.integers(-8, 9, shape) * 0.25).astype(np.float32)
    a[rand_block(g, shape, keep_col, p)] = -np.inf
    return a


# ---------------------------------------------------------------------------------------------------------
# The 12288-wide layer (GPT-3 175B: 96 heads of 128): its float32 weights are 2.4 GB, so they are drawn straight
# into the safetensors file (a memory map), the float64 reference converts them a block of rows at a time, and the
# file is removed after the run.

REF_ROWS = 256  # rows of a weight converted to float64 at a time


def proj64(x64, W, b):
    """x64 @ W.T + b in float64, W (float32) converted REF_ROWS rows at a time."""
    out = torch.empty(x64.shape[:-1] + (W.shape[0],), dtype=torch.float64)
    buf = torch.empty((REF_ROWS, W.shape[1]), dtype=torch.float64)
    for i in range(0, W.shape[0], REF_ROWS):
        n = min(REF_ROWS, W.shape[0] - i)
        buf[:n].copy_(W[i:i + n])
        out[..., i:i + n] = x64 @ buf[:n].t()
    return out if b is None else out + b.double()


def mha64_self(sd, H, x, causal):
    """float64 self-attention of a batch_first nn.MultiheadAttention (no dropout) from its float32 state dict."""
    B, T, E = x.shape
    D = E // H
    with torch.no_grad():
        qkv = proj64(torch.from_numpy(x).double(), sd["in_proj_weight"], sd.get("in_proj_bias"))
        q, k, v = (t.reshape(B, T, H, D).transpose(1, 2) for t in qkv.split(E, dim=-1))
        s = (q / D ** 0.5) @ k.transpose(-1, -2)
        if causal:
            s = s.masked_fill(pc.causal_block_mask(T, T), float("-inf"))
        o = (s.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, E)
        return proj64(o, sd["out_proj.weight"], sd.get("out_proj.bias")).numpy()


def chunked_reference_matches_module(r):
    """The guard for mha64_self: it equals torch's own module in float64 (a GPT-2 small layer, causal)."""
    B, T, E, H = 2, 9, 768, 12
    m = make_mha(5, E, H)
    x = np.random.default_rng(5).standard_normal((B, T, E)).astype(np.float32)
    x64 = x.astype(np.float64)
    want = pc.torch_mha(copy.deepcopy(m).double(), x64, x64, x64, attn_mask=pc.causal_block_mask(T, T))
    got = mha64_self(pc.state_dict_of(m), H, x, causal=True)
    diff = float(np.max(np.abs(got - want)))
    check(diff <= 1e-12 * float(np.max(np.abs(want))), "chunked float64 reference differs from torch's: %.3g" % diff)
    return "max diff %.2g" % diff


def widest_case(r, seed, B, T, E, H):
    """Causal self-attention at d_model 12288, 96 heads: weights drawn as torch's init draws them (xavier-uniform
    in_proj, kaiming-uniform out_proj) with U(-0.5, 0.5) biases; torch bf16 is nn.MultiheadAttention in bfloat16
    holding them; float64 is mha64_self (guarded by chunked_reference_matches_module)."""
    wd = r.workdir()
    path = os.path.join(wd, "w.safetensors")
    shapes = {"in_proj_weight": (3 * E, E), "in_proj_bias": (3 * E,), "out_proj.weight": (E, E),
              "out_proj.bias": (E,)}
    bounds = {"in_proj_weight": (6.0 / (4 * E)) ** 0.5, "out_proj.weight": (1.0 / E) ** 0.5,
              "in_proj_bias": 0.5, "out_proj.bias": 0.5}
    header, off = {}, 0
    for name, shape in shapes.items():  # the layout of export_safetensors.safetensors_bytes
        n = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h)
            f.truncate(8 + len(h) + off)
        data = np.memmap(path, dtype="<f4", mode="r+", offset=8 + len(h), shape=(off // 4,))
        g = np.random.default_rng(seed)
        sd = {}
        for name, shape in shapes.items():
            lo, hi = (o // 4 for o in header[name]["data_offsets"])
            a = data[lo:hi]
            g.random(out=a, dtype=np.float32)
            a -= np.float32(0.5)
            a *= np.float32(2 * bounds[name])
            sd[name] = torch.from_numpy(a.reshape(shape))
        x = g.standard_normal((B, T, E)).astype(np.float32)
        causal = pc.causal_block_mask(T, T)
        ref = mha64_self(sd, H, x, causal=True)
        mb = torch.nn.utils.skip_init(nn.MultiheadAttention, E, H, batch_first=True, dtype=torch.bfloat16)
        with torch.no_grad():
            for name, p in mb.named_parameters():
                p.copy_(sd[name])
        tb = pc.torch_mha(mb, x, x, x, attn_mask=causal)
        del mb, sd, a
        data.flush()
        del data
        t0 = time.monotonic()
        y = pc.forward(r.cli, wd, path, H, x, causal=True, extra=["--dtype", "bf16"], timeout=BIG_CLI_TIMEOUT_S)
        cli_s = time.monotonic() - t0
    finally:
        if os.path.exists(path):
            os.remove(path)
    return "%s, cli %.0f s" % (judge(y, tb, ref), cli_s)


# ---------------------------------------------------------------------------------------------------------
# Forced instruction sets and the bf16 compute type itself.

# CPU features each forced --isa needs (CMakeLists.txt's GPT2ATTN_ISA_FEATURES_<isa>, as /proc/cpuinfo spells them);
# the CLI refuses an --isa this CPU cannot run.
ISA_CPU_FLAGS = {"avx512": ("avx512f", "avx512vl", "avx512bw", "avx512dq", "avx2", "fma", "bmi2"),
                 "avx2": ("avx2", "fma", "bmi2"), "scalar": ()}


def cpu_lacks(isa):
    """The CPU flags for isa that /proc/cpuinfo does not list (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), []))
    except OSError:
        return []
    return [x for x in ISA_CPU_FLAGS[isa] if flags and x not in flags]


# The oneDNN level the CLI's --isa X caps the GEMMs at (engine/linear.hpp, cap_onednn).
ONEDNN_LEVEL = {"avx512": "AVX512_CORE", "avx2": "AVX2", "scalar": "SSE41"}


def isa_case(r, isa, **kw):
    """--isa X against torch as any case, and its distance to --isa best (reported, not checked: the widening
    kernels multiply the bf16 Q, K, V in f32 and do not round P, so they differ from AVX512-BF16 within the bound;
    below AVX-512 oneDNN has no bf16 matmul, and the projections multiply the bf16 values in f32).
    GPT2ATTN_ISA=X with oneDNN's own cap in the environment must run the same layer as --isa X, which sets both:
    the outputs are compared bitwise."""
    if cpu_lacks(isa):
        return "skipped: this CPU lacks %s" % " ".join(cpu_lacks(isa))
    note, y, ref = bf16_case(r, isa=isa, **kw)
    _, y_best, _ = bf16_case(r, isa=None, **kw)
    saved = {k: os.environ.get(k) for k in ("GPT2ATTN_ISA", "ONEDNN_MAX_CPU_ISA")}
    os.environ["GPT2ATTN_ISA"] = isa
    if not (saved["ONEDNN_MAX_CPU_ISA"] or os.environ.get("DNNL_MAX_CPU_ISA")):  # a caller's cap holds for both
        os.environ["ONEDNN_MAX_CPU_ISA"] = ONEDNN_LEVEL[isa]
    try:
        _, y_env, _ = bf16_case(r, isa=None, **kw)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    check(np.array_equal(y_env, y), "GPT2ATTN_ISA=%s ONEDNN_MAX_CPU_ISA=%s and --isa %s differ by up to %.3g"
          % (isa, ONEDNN_LEVEL[isa], isa, float(np.max(np.abs(y_env.astype(np.float64) - y)))))
    return "%s; max |%s - best| %.2g; GPT2ATTN_ISA=%s bitwise equal" % (
        note, isa, float(np.max(np.abs(y.astype(np.float64) - y_best))), isa)


def bf16_not_f32(r):
    """--dtype bf16 really computes in bf16: its output is farther from float64 than float32's tolerance."""
    B, T, E, H = 2, 16, 768, 12
    note, y, ref = bf16_case(r, seed=6, B=B, T=T, E=E, H=H, causal=True)
    rtol, atol = pc.tolerance(E, float(np.max(np.abs(ref))))
    err = float(np.max(np.abs(y - ref)))
    check(err > atol, "--dtype bf16 error %.3g is within float32's tolerance %.3g: is it bf16 at all?" % (err, atol))
    return "%s; f32 atol %.2g" % (note, atol)


def main():
    r = pc.Runner(__doc__)
    case = lambda name, **kw: r.case(name, first(bf16_case), r, **kw)  # noqa: E731
    g = np.random.default_rng(2024)

    # the five widths, causal self-attention as GPT-2 and GPT-3 run it
    case("gpt2_small_E768_H12_causal_B2_T33", seed=1, B=2, T=33, E=768, H=12, causal=True)
    case("gpt2_medium_E1024_H16_causal_B2_T16", seed=2, B=2, T=16, E=1024, H=16, causal=True)
    case("gpt2_large_E1280_H20_causal_B1_T113", seed=3, B=1, T=113, E=1280, H=20, causal=True)
    case("gpt2_xl_E1600_H25_causal_B1_T7", seed=4, B=1, T=7, E=1600, H=25, causal=True)
    r.case("reference64_chunked_matches_module", chunked_reference_matches_module, r)
    r.case("gpt3_E12288_H96_causal_B1_T4", widest_case, r, seed=7, B=1, T=4, E=12288, H=96)

    # T = 1, odd T, no causality, no bias
    case("self_T1_E768_H12_B3", seed=10, B=3, T=1, E=768, H=12)
    case("self_T1_causal_E1600_H25", seed=11, B=2, T=1, E=1600, H=25, causal=True)
    case("self_T7_E256_H4", seed=12, B=2, T=7, E=256, H=4)
    case("self_T113_E128_H2_causal", seed=13, B=1, T=113, E=128, H=2, causal=True)
    case("self_nobias_E1024_H16_causal_T13", seed=14, B=2, T=13, E=1024, H=16, causal=True, bias=False)

    # cross-attention, Tk != T
    case("cross_E768_H12_T7_Tk20", seed=20, B=2, T=7, Tk=20, E=768, H=12, cross=True)
    case("cross_E1024_H16_T33_Tk5", seed=21, B=1, T=33, Tk=5, E=1024, H=16, cross=True)
    case("cross_T1_Tk9_E1280_H20", seed=22, B=2, T=1, Tk=9, E=1280, H=20, cross=True)
    case("cross_nobias_E96_H3_T9_Tk16", seed=23, B=3, T=9, Tk=16, E=96, H=3, cross=True, bias=False)
    case("cross_causal_bottom_right_E768_H12_T5_Tk12", seed=24, B=2, T=5, Tk=12, E=768, H=12, cross=True,
         causal=True)

    # key padding, bool and additive masks (every row keeps a key: torch would give NaN rows)
    kp = np.zeros((3, 16), dtype=bool)
    kp[0, 11:], kp[1, 3:6], kp[2, 1::2] = True, True, True
    case("key_padding_self_E768_H12_B3_T16", seed=30, B=3, T=16, E=768, H=12, key_padding=kp)
    kp_cross = g.random((2, 12)) < 0.4
    kp_cross[:, 0] = False
    case("key_padding_cross_E1024_H16_T7_Tk12", seed=31, B=2, T=7, Tk=12, E=1024, H=16, cross=True,
         key_padding=kp_cross)
    kp_causal = g.random((2, 21)) < 0.3
    kp_causal[:, 0] = False  # row 0 sees key 0 only
    case("key_padding_causal_E768_H12_T21", seed=32, B=2, T=21, E=768, H=12, causal=True, key_padding=kp_causal)
    case("bool_mask_T_Tk_E768_H12_T33", seed=33, B=2, T=33, E=768, H=12, mask=rand_block(g, (33, 33), -1))
    case("bool_mask_B_T_Tk_cross_E512_H8_T7_Tk13", seed=34, B=2, T=7, Tk=13, E=512, H=8, cross=True,
         mask=rand_block(g, (2, 7, 13), 0))
    case("additive_mask_T_Tk_cross_E768_H12_T9_Tk17", seed=35, B=2, T=9, Tk=17, E=768, H=12, cross=True,
         mask=rand_additive(g, (9, 17), 3))
    case("additive_mask_B_T_Tk_causal_E1024_H16_T16", seed=36, B=2, T=16, E=1024, H=16, causal=True,
         mask=rand_additive(g, (2, 16, 16), 0))

    # the widening kernels (no AVX512-BF16 instructions) and the scalar one, and bf16 really being bf16
    r.case("isa_avx2_E768_H12_causal_T33", isa_case, r, "avx2", seed=40, B=2, T=33, E=768, H=12, causal=True)
    r.case("isa_avx512_E1024_H16_cross_T7_Tk11", isa_case, r, "avx512", seed=41, B=2, T=7, Tk=11, E=1024, H=16,
           cross=True)
    r.case("isa_scalar_E16_H2_T5", isa_case, r, "scalar", seed=42, B=2, T=5, E=16, H=2, causal=True)
    case("threads_1_E768_H12_T9", seed=43, B=2, T=9, E=768, H=12, causal=True, threads=1)
    r.case("bf16_differs_from_f32", bf16_not_f32, r)

    r.finish()


if __name__ == "__main__":
    main()
