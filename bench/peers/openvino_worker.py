# bench/peers/openvino_worker.py: OpenVINO's CPU plugin on the attention layer, as a worker of bench/peers/run.py
# (protocol: worker_common.py). Run by the peers venv's python; not by hand.
#
# The layer is built with OpenVINO's Python opset API (opset13), the weights as constants:
#   x -> MatMul [W_q; W_k; W_v]^T -> Add bias -> VariadicSplit (q, k, v) -> heads (Reshape, Transpose)
#     -> ScaledDotProductAttention (causal=True for prefill) -> Transpose, Reshape -> MatMul W_out^T -> Add -> y
# Decode, variant sdpa: parameters past_k, past_v (B, KVH, T, D) concatenated with the step's key and value, then SDPA
# of the 1-token query without a mask (the stateless form: every step builds the (T + 1)-token K/V anew).
# Decode, variant stateful: the K/V cache is the model's state (ReadValue -> Concat with the step's key and value ->
# Assign, the form OpenVINO's LLM exports take), which the CPU plugin keeps in its own cache and appends to in place
# (its runtime graph shows the fused node); after each timed step the state is set back to the T cached tokens,
# untimed (worker_common's after()), so every step sees T keys as every other engine's does. Grouped K/V
# heads (KVH < H): the query viewed as (B, KVH, H/KVH, S, D) against keys and values unsqueezed to
# (B, KVH, 1, S, D), which SDPA broadcasts (query head h uses K/V head h // (H/KVH), as torch's enable_gqa does).
# Variant (--variant): sdpa (prefill and decode) or stateful (decode). --dtype fp32 or bf16 sets
# INFERENCE_PRECISION_HINT (f32, bf16); the plugin may
# not honour bf16 on a CPU without bf16 instructions, so info reports the precision the compiled model took and
# the runtime graph's layer types and precisions (whether SDPA ran as one fused ScaledAttn node).
# Threads: INFERENCE_NUM_THREADS, one stream, the latency hint.
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_common import serve  # noqa: E402


def build(a, inp):
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    if a.variant not in ("sdpa", "stateful"):
        raise ValueError("openvino worker: unknown variant %s" % a.variant)
    hint = {"fp32": "f32", "bf16": "bf16"}.get(a.dtype)
    if hint is None:
        raise ValueError("openvino worker: dtype %s not driven (fp32, bf16)" % a.dtype)
    H, KVH = a.heads, a.kv_heads
    G = H // KVH
    x_np = inp["x"]
    B, S, E = x_np.shape
    D = E // H
    KW = KVH * D
    decode = a.mode == "decode"
    stateful = a.variant == "stateful"
    if stateful and not decode:
        raise ValueError("openvino worker: the stateful variant is a decode step (prefill runs variant sdpa)")

    def const(arr):
        return ops.constant(np.ascontiguousarray(arr, dtype=np.float32))

    def shape(*dims):
        return ops.constant(np.array(dims, dtype=np.int64))

    x = ops.parameter([B, S, E], np.float32, name="x")
    params = [x]
    qkv = ops.add(ops.matmul(x, const(inp["w_in"].T), False, False), const(inp["b_in"]))
    q, k, v = ops.variadic_split(qkv, ops.constant(np.int64(2)), shape(E, KW, KW)).outputs()

    def heads(y, n):  # (B, S, n*D) -> (B, n, S, D)
        return ops.transpose(ops.reshape(y, shape(B, S, n, D), False), shape(0, 2, 1, 3))

    q, k, v = heads(q, H), heads(k, KVH), heads(v, KVH)
    sinks = []
    if decode and stateful:
        T = inp["past_k"].shape[2]
        caches = []
        for name, new in (("past_k", k), ("past_v", v)):
            vi = ov.op.util.VariableInfo()
            vi.data_shape = ov.PartialShape([B, KVH, -1, D])
            vi.data_type = ov.Type.f32
            vi.variable_id = name
            var = ov.op.util.Variable(vi)
            past = ops.read_value(ops.constant(np.zeros((B, KVH, 0, D), np.float32)), var)
            whole = ops.concat([past, new], 2)
            sinks.append(ops.assign(whole, var))
            caches.append(whole)
        k, v = caches
    elif decode:
        T = inp["past_k"].shape[2]
        past_k = ops.parameter([B, KVH, T, D], np.float32, name="past_k")
        past_v = ops.parameter([B, KVH, T, D], np.float32, name="past_v")
        params += [past_k, past_v]
        k = ops.concat([past_k, k], 2)
        v = ops.concat([past_v, v], 2)
    L = T + 1 if decode else S
    if G > 1:  # grouped K/V heads: broadcast each K/V head over its G query heads
        q = ops.reshape(q, shape(B, KVH, G, S, D), False)
        k = ops.unsqueeze(k, ops.constant(np.int64(2)))
        v = ops.unsqueeze(v, ops.constant(np.int64(2)))
    o = ops.scaled_dot_product_attention(q, k, v, causal=not decode)
    o = ops.reshape(o, shape(B, H, S, D), False)
    o = ops.reshape(ops.transpose(o, shape(0, 2, 1, 3)), shape(B, S, E), False)
    y = ops.add(ops.matmul(o, const(inp["w_out"].T), False, False), const(inp["b_out"]))
    if sinks:
        model = ov.Model([y.output(0)], sinks, params, "attention_layer")
    else:
        model = ov.Model([y], params, "attention_layer")

    core = ov.Core()
    # KV_CACHE_PRECISION: the plugin's K/V cache type where it fuses one (it may default to u8 or f16), held to
    # the compute type so that fp32 is compared with fp32.
    compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": str(a.threads), "NUM_STREAMS": "1",
                                                 "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": hint,
                                                 "KV_CACHE_PRECISION": hint})
    request = compiled.create_infer_request()
    feeds = [x_np] + ([inp["past_k"], inp["past_v"]] if decode and not stateful else [])
    keep = [np.ascontiguousarray(f, dtype=np.float32) for f in feeds]  # shared with the request: keep alive
    for i, arr in enumerate(keep):
        request.set_input_tensor(i, ov.Tensor(arr, shared_memory=True))

    layers = []
    for node in compiled.get_runtime_model().get_ordered_ops():
        rt = node.get_rt_info()
        lt = rt["layerType"].astype(str) if "layerType" in rt else node.get_type_name()
        if lt in ("Input", "Output", "Const", "Parameter", "Result", "Constant"):
            continue
        prim = rt["primitiveType"].astype(str) if "primitiveType" in rt else ""
        prec = rt["runtimePrecision"].astype(str) if "runtimePrecision" in rt else ""
        layers.append("%s(%s,%s)" % (lt, prim, prec))
    info = {"openvino": ov.get_version(), "threads": int(compiled.get_property("INFERENCE_NUM_THREADS")),
            "inference_precision": compiled.get_property("INFERENCE_PRECISION_HINT").to_string(),
            "runtime_layers": layers,
            "kv_tokens": L}

    def call():
        # The request reads `keep`'s memory (shared, not copied): naming it here keeps the arrays alive as long as
        # the call is (a freed input is garbage in, or a crash).
        request.infer()
        return keep

    def output():
        return np.array(request.get_output_tensor(0).data, dtype=np.float32)

    if not stateful:
        return call, output, info
    pasts = {"past_k": np.ascontiguousarray(inp["past_k"], dtype=np.float32),
             "past_v": np.ascontiguousarray(inp["past_v"], dtype=np.float32)}

    def reset():  # the state back to the T cached tokens (untimed)
        for st in request.query_state():
            st.state = ov.Tensor(pasts[st.name])

    reset()
    info["kv_cache"] = "model state (ReadValue/Assign), set back to T tokens after each step, untimed"
    return call, output, info, reset


if __name__ == "__main__":
    serve(build)
