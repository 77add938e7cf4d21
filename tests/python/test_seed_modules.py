# tests/python/test_seed_modules.py: `gpt2attn forward` against the users' own formulations: seed 002's
# MultiHeadAttention(d_model, num_heads) with its keep-style mask, seed 004's causal
# MultiHeadAttention(d_in, d_out, context_length, ...) and a Hugging Face GPT-2 layer file.
# The seed classes are copied verbatim; only the weight export and the comparison are ours.
import os
import re
import sys
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402


# ---------------------------------------------------------------------------------------------------------
# Seed 002's reference implementation, verbatim.

class MultiHeadAttention002(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"

        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads  # dimension per head

        # Linear projections (can be done with single matrix per Q/K/V)
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)

        # Output projection
        self.W_o = nn.Linear(d_model, d_model)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, d_model = x.size()
        # Reshape to (batch, seq_len, num_heads, d_k)
        x = x.view(batch_size, seq_len, self.num_heads, self.d_k)
        # Transpose to (batch, num_heads, seq_len, d_k)
        return x.transpose(1, 2)

    def combine_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, num_heads, seq_len, d_k = x.size()
        # Transpose to (batch, seq_len, num_heads, d_k)
        x = x.transpose(1, 2)
        # Reshape to (batch, seq_len, d_model)
        return x.contiguous().view(batch_size, seq_len, self.d_model)

    def forward(
        self,
        Q: torch.Tensor,
        K: torch.Tensor,
        V: torch.Tensor,
        mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        # Linear projections
        Q = self.W_q(Q)  # (batch, seq_len, d_model)
        K = self.W_k(K)
        V = self.W_v(V)

        # Split into heads
        Q = self.split_heads(Q)  # (batch, num_heads, seq_len, d_k)
        K = self.split_heads(K)
        V = self.split_heads(V)

        # Scaled dot-product attention for all heads in parallel
        scores = torch.matmul(Q, K.transpose(-2, -1))  # (batch, num_heads, seq_len, seq_len)
        scores = scores / torch.sqrt(torch.tensor(self.d_k, dtype=scores.dtype))

        if mask is not None:
            # Expand mask for heads dimension
            scores = scores.masked_fill(mask == 0, float('-inf'))

        attention_weights = F.softmax(scores, dim=-1)
        attention_weights = attention_weights.masked_fill(torch.isnan(attention_weights), 0.0)

        # Apply attention to values
        output = torch.matmul(attention_weights, V)  # (batch, num_heads, seq_len, d_k)

        # Combine heads
        output = self.combine_heads(output)  # (batch, seq_len, d_model)

        # Final linear projection
        output = self.W_o(output)

        return output


# ---------------------------------------------------------------------------------------------------------
# Seed 004's module (PART 2 template), verbatim.

class MultiHeadAttention004(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()

        # ===== STEP 0: Save configuration =====
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"

        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads  # 768 // 12 = 64

        # ===== STEP 1: Create weight matrices =====
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)

        # ===== STEP 2: Create dropout and causal mask =====
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "mask",
            torch.triu(torch.ones(context_length, context_length), diagonal=1)
        )

    def forward(self, x):
        # ===== Get input dimensions =====
        b, num_tokens, d_in = x.shape

        # ===== STEP 3: Project to Q, K, V =====
        Q = self.W_query(x)
        K = self.W_key(x)
        V = self.W_value(x)

        # ===== STEP 4: Split into heads =====
        Q = Q.view(b, num_tokens, self.num_heads, self.head_dim)
        K = K.view(b, num_tokens, self.num_heads, self.head_dim)
        V = V.view(b, num_tokens, self.num_heads, self.head_dim)

        Q = Q.transpose(1, 2)
        K = K.transpose(1, 2)
        V = V.transpose(1, 2)

        # ===== STEP 5: Compute attention scores =====
        attn_scores = Q @ K.transpose(2, 3)

        # ===== STEP 6: Apply causal mask =====
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)

        # ===== STEP 7: Scale and softmax =====
        attn_scores = attn_scores / (self.head_dim ** 0.5)
        attn_weights = torch.softmax(attn_scores, dim=-1)
        attn_weights = self.dropout(attn_weights)

        # ===== STEP 8: Apply attention to values =====
        context = attn_weights @ V

        # ===== STEP 9: Concat heads =====
        context = context.transpose(1, 2)
        context = context.contiguous().view(b, num_tokens, self.d_out)

        # ===== STEP 10: Output projection =====
        output = self.out_proj(context)

        return output


# ---------------------------------------------------------------------------------------------------------
# Weight export.

def export_002(m, naming):
    """Seed 002's W_q/W_k/W_v/W_o as torch MHA state-dict names: fused in_proj_weight or q/k/v_proj_weight."""
    W = {n: getattr(m, n).weight.detach() for n in ("W_q", "W_k", "W_v", "W_o")}
    b = {n: getattr(m, n).bias.detach() for n in ("W_q", "W_k", "W_v", "W_o")}
    out = {"in_proj_bias": torch.cat([b["W_q"], b["W_k"], b["W_v"]]),
           "out_proj.weight": W["W_o"], "out_proj.bias": b["W_o"]}
    if naming == "fused":
        out["in_proj_weight"] = torch.cat([W["W_q"], W["W_k"], W["W_v"]])
    else:
        out.update(q_proj_weight=W["W_q"], k_proj_weight=W["W_k"], v_proj_weight=W["W_v"])
    return out


def export_004(m, naming="torch"):
    """Seed 004's W_query/W_key/W_value (d_out, d_in) and out_proj: torch q/k/v_proj_weight names, or
    Hugging Face GPT-2 Conv1D (c_attn.weight (d_in, 3 d_out) = [Wq; Wk; Wv]^T)."""
    Wq, Wk, Wv = (getattr(m, n).weight.detach() for n in ("W_query", "W_key", "W_value"))
    has_qkv_bias = m.W_query.bias is not None
    if naming == "torch":
        out = {"q_proj_weight": Wq, "k_proj_weight": Wk, "v_proj_weight": Wv,
               "out_proj.weight": m.out_proj.weight.detach(), "out_proj.bias": m.out_proj.bias.detach()}
        if has_qkv_bias:
            out["in_proj_bias"] = torch.cat([m.W_query.bias, m.W_key.bias, m.W_value.bias]).detach()
        return out
    out = {"c_attn.weight": torch.cat([Wq, Wk, Wv]).t().contiguous(),
           "c_proj.weight": m.out_proj.weight.detach().t().contiguous(), "c_proj.bias": m.out_proj.bias.detach()}
    if has_qkv_bias:
        out["c_attn.bias"] = torch.cat([m.W_query.bias, m.W_key.bias, m.W_value.bias]).detach()
    return out


def randomize_biases(m):
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return m


# ---------------------------------------------------------------------------------------------------------
# Seed 002 cases.

def seed002_case(r, seed, B, T, E, H, Tk=None, cross=False, naming="fused", mask=None, torch_mask=None,
                 causal=False):
    """mask: what the CLI gets as --mask-kind keep; torch_mask: what seed 002's forward gets (default: mask)."""
    wd = r.workdir()
    torch.manual_seed(seed)
    m = MultiHeadAttention002(E, H).double()
    g = np.random.default_rng(seed)
    x = g.standard_normal((B, T, E))
    if cross:
        Tk = Tk or T
        k, v = g.standard_normal((B, Tk, E)), g.standard_normal((B, Tk, E))
    else:
        Tk, k, v = T, x, x
    tm = None
    if torch_mask is not None:
        tm = torch.as_tensor(torch_mask)
    elif mask is not None:
        tm = torch.from_numpy(np.asarray(mask))
    ref = m(*(torch.from_numpy(a) for a in (x, k, v)), tm).detach().numpy()
    check(np.all(np.isfinite(ref)), "test bug: seed 002 reference not finite")
    w = pc.write_safetensors(os.path.join(wd, "w.safetensors"), export_002(m, naming))
    y = pc.forward(r.cli, wd, w, H, x, key=k if cross else None, value=v if cross else None,
                   mask=mask, mask_kind="keep" if mask is not None else None, causal=causal)
    return pc.compare(y, ref, pc.reduction_length(E, Tk))


# ---------------------------------------------------------------------------------------------------------
# Seed 004 cases.

def make_004(seed, d_in, d_out, context_length, num_heads, qkv_bias):
    torch.manual_seed(seed)
    m = MultiHeadAttention004(d_in, d_out, context_length, 0.1, num_heads, qkv_bias=qkv_bias).double()
    return randomize_biases(m).eval()


def seed004_case(r, seed, B, T, d_in, d_out, H, context_length, qkv_bias=False, naming="torch"):
    wd = r.workdir()
    m = make_004(seed, d_in, d_out, context_length, H, qkv_bias)
    x = np.random.default_rng(seed).standard_normal((B, T, d_in))
    with torch.no_grad():
        ref = m(torch.from_numpy(x)).numpy()
    prefix = "h.0.attn." if naming == "hf" else None
    tensors = {(prefix or "") + k: v for k, v in export_004(m, naming).items()}
    w = pc.write_safetensors(os.path.join(wd, "w.safetensors"), tensors)
    y = pc.forward(r.cli, wd, w, H, x, causal=True, context_length=context_length, prefix=prefix)
    return pc.compare(y, ref, pc.reduction_length(max(d_in, d_out), T))


def seed004_too_long(r):
    """T = context_length + 1: the seed module cannot run it either; the CLI must refuse with exit 2."""
    wd = r.workdir()
    cl = 16
    m = make_004(5, 12, 8, cl, 2, False)
    x = np.random.default_rng(5).standard_normal((2, cl + 1, 12))
    try:
        with torch.no_grad():
            m(torch.from_numpy(x))
        torch_refuses = False
    except RuntimeError:
        torch_refuses = True
    check(torch_refuses, "test bug: seed 004 module accepted T > context_length")
    w = pc.write_safetensors(os.path.join(wd, "w.safetensors"), export_004(m))
    out = os.path.join(wd, "y.npy")
    args = ["forward", "--weights", w, "--heads", 2, "--query", pc.save_npy(os.path.join(wd, "x.npy"), x),
            "--causal", "--context-length", cl, "--output", out]
    p = pc.run_cli(r.cli, args)
    cmd = pc.fmt_cmd(r.cli, args)
    check(p.returncode == 2, "exit %d, expected 2: %s; stderr: %r" % (p.returncode, cmd, p.stderr[-300:]))
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    check(len(lines) == 1, "expected one stderr line, got %d: %r" % (len(lines), p.stderr[-300:]))
    check(re.search(r"context[_ -]length", lines[0], re.I), "stderr does not name context_length: %r" % lines[0])
    check(not os.path.exists(out), "output file exists after failure: %s" % cmd)
    return "stderr: %s" % lines[0]


# ---------------------------------------------------------------------------------------------------------
# A Hugging Face GPT-2 layer file (Conv1D layout, prefix h.3.attn., the usual neighbours present).

def hf_gpt2_file(r, weight_dtype="F32"):
    wd = r.workdir()
    E, H, B, T = 16, 4, 2, 7
    torch.manual_seed(300)
    m = randomize_biases(nn.MultiheadAttention(E, H, batch_first=True).double())
    sd = pc.state_dict_of(m)
    if weight_dtype != "F32":
        tdt = {"F16": torch.float16, "BF16": torch.bfloat16}[weight_dtype]
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(p.to(tdt).to(torch.float64))
        sd = pc.state_dict_of(m)
    tensors = {"wte.weight": torch.randn(50, E), "wpe.weight": torch.randn(32, E),
               # a different layer's attention with the same names: the prefix must pick h.3
               "h.2.attn.c_attn.weight": torch.randn(E, 3 * E), "h.2.attn.c_attn.bias": torch.randn(3 * E),
               "h.2.attn.c_proj.weight": torch.randn(E, E), "h.2.attn.c_proj.bias": torch.randn(E),
               "h.3.ln_1.weight": torch.ones(E), "h.3.ln_1.bias": torch.zeros(E),
               "h.3.attn.bias": torch.tril(torch.ones(1024, 1024)).view(1, 1, 1024, 1024)}
    tensors.update(pc.hf_gpt2_layout(sd, "h.3.attn."))
    dtypes = {k: (weight_dtype if k.startswith("h.3.attn.c_") else "F32") for k in tensors}
    w = pc.write_safetensors(os.path.join(wd, "gpt2.safetensors"), tensors, dtype=dtypes,
                             metadata={"format": "pt"})
    x = np.random.default_rng(300).standard_normal((B, T, E))
    ref = pc.torch_mha(m, x, x, x, attn_mask=pc.causal_block_mask(T, T))
    y = pc.forward(r.cli, wd, w, H, x, causal=True, prefix="h.3.attn.")
    return pc.compare(y, ref, pc.reduction_length(E, T))


def main():
    r = pc.Runner("parity with the seed modules")
    T = 6
    causal_mask = torch.tril(torch.ones(T, T))  # seed 002's test: a float tril, 1 = may attend
    r.case("seed002_self_nomask_fused", seed002_case, r, seed=1, B=2, T=T, E=16, H=4)
    r.case("seed002_self_tril_keep_fused", seed002_case, r, seed=2, B=2, T=T, E=16, H=4,
           mask=causal_mask.numpy().astype(np.float32))
    r.case("seed002_self_tril_keep_qkv_names", seed002_case, r, seed=3, B=2, T=T, E=16, H=4, naming="separate",
           mask=causal_mask.numpy().astype(np.float32))
    r.case("seed002_self_tril_as_causal_flag", seed002_case, r, seed=4, B=2, T=T, E=16, H=4,
           torch_mask=causal_mask, causal=True)
    r.case("seed002_cross_nomask_qkv_names_Tk9", seed002_case, r, seed=5, B=2, T=T, Tk=9, E=8, H=2,
           cross=True, naming="separate")
    r.case("seed002_cross_tril_keep_bool", seed002_case, r, seed=6, B=3, T=5, E=8, H=2, cross=True,
           mask=np.tril(np.ones((5, 5), dtype=bool)))
    # a (B, H, T, Tk) keep mask with a whole row masked for every head, and one masked for one head only:
    # seed 002 zeroes those attention weights, so the layer gives W_o's bias / that head's zero share
    keep4 = np.tril(np.ones((2, 2, 5, 5), dtype=np.uint8))
    keep4[1, :, 3, :] = 0
    keep4[0, 1, 2, :] = 0
    r.case("seed002_keep_rank4_dead_rows", seed002_case, r, seed=7, B=2, T=5, E=8, H=2, mask=keep4)
    r.case("seed002_testing_block_B2_T10_E512_H8_tril", seed002_case, r, seed=8, B=2, T=10, E=512, H=8,
           mask=torch.tril(torch.ones(10, 10)).numpy().astype(np.float32))

    # seed 004: d_in 12 -> d_out 8, 2 heads, context_length 16, eval mode; self-attention with --causal
    r.case("seed004_d12_to_8_T5", seed004_case, r, seed=10, B=2, T=5, d_in=12, d_out=8, H=2, context_length=16)
    r.case("seed004_d12_to_8_qkv_bias_T9", seed004_case, r, seed=11, B=3, T=9, d_in=12, d_out=8, H=2,
           context_length=16, qkv_bias=True)
    r.case("seed004_T_equals_context_length", seed004_case, r, seed=12, B=2, T=16, d_in=12, d_out=8, H=2,
           context_length=16)
    r.case("seed004_T_context_length_plus_1_refused", seed004_too_long, r)
    r.case("seed004_hf_conv1d_d12_to_8", seed004_case, r, seed=13, B=2, T=7, d_in=12, d_out=8, H=2,
           context_length=16, qkv_bias=True, naming="hf")
    r.case("seed004_usage_gpt2_small_B4_T100_E768", seed004_case, r, seed=14, B=4, T=100, d_in=768, d_out=768,
           H=12, context_length=1024)

    r.case("hf_gpt2_h3_attn_f32", hf_gpt2_file, r)
    r.case("hf_gpt2_h3_attn_bf16", hf_gpt2_file, r, weight_dtype="BF16")
    r.finish()


if __name__ == "__main__":
    main()
