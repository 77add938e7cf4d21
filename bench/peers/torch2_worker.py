# bench/peers/torch2_worker.py: PyTorch 2.x's CPU attention layer, as a worker of bench/peers/run.py (protocol:
# worker_common.py). Run by the peers venv's python; not by hand.
#
# Variants (--variant):
#   sdpa  the layer written as a PyTorch 2 user would: F.linear (QKV) -> F.scaled_dot_product_attention(q, k, v,
#         is_causal=True) -> F.linear (output). Grouped K/V heads through SDPA's enable_gqa=True. Decode: a static
#         K/V cache (B, KVH, T + 1, D) holding the T cached tokens, the step's k and v written into slot T in place
#         (no reallocation, no concatenation: HF's StaticCache layout), SDPA of the 1-token query over all T + 1
#         slots without a mask (the new token sees every cached one).
#   mha   nn.MultiheadAttention(E, H, batch_first=True) with the same weights, eval and no_grad, need_weights=False,
#         a causal mask with is_causal=True (its fast path, torch._native_multi_head_attention, where torch takes
#         it). It has neither grouped K/V heads nor a K/V cache: those cases get the error row.
# --dtype fp32 or bf16 (weights and activations; torch's CPU kernels accumulate bf16 in f32).
# info names the SDPA kernel that ran, from the profiler's op names (aten::_scaled_dot_product_flash_attention_for_cpu
# is the fused flash kernel, aten::_scaled_dot_product_attention_math the unfused reference), and torch's own
# choice (torch._fused_sdp_choice).
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_common import serve  # noqa: E402


def build(a, inp):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(a.dtype)
    if dt is None:
        raise ValueError("torch worker: dtype %s not driven (fp32, bf16)" % a.dtype)
    H, KVH = a.heads, a.kv_heads
    t = {k: torch.from_numpy(v).to(dt) for k, v in inp.items()}
    w_in, b_in, w_out, b_out, x = t["w_in"], t["b_in"], t["w_out"], t["b_out"], t["x"]
    B, S, E = x.shape
    D = E // H
    KW = KVH * D
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "mkldnn_bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    state = {}

    if a.variant == "sdpa":
        gqa = KVH != H

        def heads(y, n):  # (B, S, n*D) -> (B, n, S, D)
            return y.view(B, S, n, D).transpose(1, 2)

        if a.mode == "prefill":
            def call():
                q, k, v = F.linear(x, w_in, b_in).split([E, KW, KW], dim=-1)
                o = F.scaled_dot_product_attention(heads(q, H), heads(k, KVH), heads(v, KVH), is_causal=True,
                                                   enable_gqa=gqa)
                state["y"] = F.linear(o.transpose(1, 2).reshape(B, S, E), w_out, b_out)
                return state["y"]
        else:
            T = t["past_k"].shape[2]
            cache_k = torch.empty(B, KVH, T + 1, D, dtype=dt)
            cache_v = torch.empty(B, KVH, T + 1, D, dtype=dt)
            cache_k[:, :, :T] = t["past_k"]
            cache_v[:, :, :T] = t["past_v"]

            def call():
                q, k, v = F.linear(x, w_in, b_in).split([E, KW, KW], dim=-1)
                cache_k[:, :, T:] = heads(k, KVH)  # the step's key and value into slot T, in place
                cache_v[:, :, T:] = heads(v, KVH)
                o = F.scaled_dot_product_attention(heads(q, H), cache_k, cache_v, enable_gqa=gqa)
                state["y"] = F.linear(o.transpose(1, 2).reshape(B, 1, E), w_out, b_out)
                return state["y"]
    elif a.variant == "mha":
        if KVH != H:
            raise ValueError("nn.MultiheadAttention has no grouped K/V heads (kdim/vdim change the input width, "
                             "not the number of K/V heads)")
        if a.mode == "decode":
            raise ValueError("nn.MultiheadAttention keeps no K/V cache: a decode step would re-project every "
                             "cached token")
        mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval().to(dt)
        with torch.no_grad():
            mha.in_proj_weight.copy_(w_in)
            mha.in_proj_bias.copy_(b_in)
            mha.out_proj.weight.copy_(w_out)
            mha.out_proj.bias.copy_(b_out)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(S, dtype=dt)

        def call():
            state["y"] = mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
            return state["y"]
    else:
        raise ValueError("torch worker: unknown variant %s" % a.variant)

    def no_grad_call():
        with torch.inference_mode():
            return call()

    # Which attention kernels ran, by the profiler's op names for one call.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        no_grad_call()
    ops = sorted({e.key for e in prof.key_averages()
                  if "attention" in e.key or "scaled_dot_product" in e.key or e.key.startswith("aten::_native_multi")})
    info["attention_ops"] = ops
    if a.variant == "sdpa":
        from torch.nn.attention import SDPBackend
        with torch.inference_mode():
            q = torch.zeros(B, H, S, D, dtype=dt)
            kv = torch.zeros(B, H, S if a.mode == "prefill" else t["past_k"].shape[2] + 1, D, dtype=dt)
            choice = torch._fused_sdp_choice(q, kv, kv, None, 0.0, a.mode == "prefill")
        info["sdp_choice"] = SDPBackend(choice).name
    return no_grad_call, lambda: state["y"].float().numpy(), info


if __name__ == "__main__":
    serve(build)
