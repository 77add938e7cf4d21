# bench/peers/ort_worker.py: ONNX Runtime's CPU execution provider on the attention layer, as a worker of
# bench/peers/run.py (protocol: worker_common.py). Run by the peers venv's python; not by hand.
#
# The graph is built in memory with the onnx package's helper:
#   x -> MatMul [W_q; W_k; W_v]^T -> Add bias -> Split (q, k, v) -> com.microsoft.MultiHeadAttention
#     (num_heads H, unidirectional=1 for the causal prefill) -> MatMul W_out^T -> Add bias -> y
# Decode feeds the contrib op's past_key / past_value (B, H, T, D) inputs and takes its present_key /
# present_value (B, H, T + 1, D) outputs: ORT's own K/V cache form, in which every step writes a new present
# holding the past plus the new token.
# Variants (--variant):
#   mha  com.microsoft.MultiHeadAttention as above. It has no grouped K/V heads (its key and value carry all H
#        heads), so those cases get the error row.
#   gqa  com.microsoft.GroupQueryAttention (num_heads H, kv_num_heads KVH) in the same place: grouped K/V heads,
#        causal by construction, and a K/V cache that can live in one buffer: decode binds the same OrtValue
#        (B, KVH, T + 1, D) as past_key and present_key (likewise the values), ORT's shared-buffer form, so a step
#        writes its token into slot T instead of copying the past (seqlens_k = T, total_sequence_length T + 1).
# Inputs and outputs are bound once (IOBinding to preallocated OrtValues), so a timed call is session work only.
# --dtype fp32, fp16 or bf16: the whole graph in that type. Where the CPU provider has no kernel for it, session
# creation fails and its message is the row's error.
# info: the op types of the graph after ORT's optimizations (saved by the session), so the row says whether
# MultiHeadAttention ran as the fused contrib kernel.
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_common import serve  # noqa: E402


def build(a, inp):
    import ml_dtypes
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    if a.variant not in ("mha", "gqa"):
        raise ValueError("ort worker: unknown variant %s" % a.variant)
    gqa = a.variant == "gqa"
    H, KVH = a.heads, a.kv_heads
    if KVH != H and not gqa:
        raise ValueError("com.microsoft.MultiHeadAttention has no grouped K/V heads (its key and value carry all "
                         "H heads)")
    np_dt, onnx_dt = {"fp32": (np.float32, TensorProto.FLOAT), "fp16": (np.float16, TensorProto.FLOAT16),
                      "bf16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16)}[a.dtype]
    x = inp["x"]
    B, S, E = x.shape
    D = E // H
    KW = KVH * D
    decode = a.mode == "decode"

    def init(name, arr):
        return numpy_helper.from_array(np.ascontiguousarray(arr.astype(np_dt)), name)

    inits = [init("w_in_t", inp["w_in"].T), init("b_in", inp["b_in"]), init("w_out_t", inp["w_out"].T),
             init("b_out", inp["b_out"]), numpy_helper.from_array(np.array([E, KW, KW], dtype=np.int64), "split")]
    nodes = [helper.make_node("MatMul", ["x", "w_in_t"], ["qkv0"]),
             helper.make_node("Add", ["qkv0", "b_in"], ["qkv"]),
             helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=2)]
    if decode:
        T = inp["past_k"].shape[2]
    if gqa:
        # seqlens_k: each sequence's total length - 1; the new tokens sit at the end of it.
        total = T + 1 if decode else S
        inits += [numpy_helper.from_array(np.full([B], total - 1, dtype=np.int32), "seqlens_k"),
                  numpy_helper.from_array(np.array(total, dtype=np.int32), "total_sequence_length")]
        attn_in = ["q", "k", "v"] + (["past_key", "past_value"] if decode else ["", ""]) + \
            ["seqlens_k", "total_sequence_length"]
        attn_out = ["attn"] + (["present_key", "present_value"] if decode else [])
        nodes.append(helper.make_node("GroupQueryAttention", attn_in, attn_out, domain="com.microsoft",
                                      num_heads=H, kv_num_heads=KVH))
    else:
        attn_in = ["q", "k", "v"] + (["", "", "", "past_key", "past_value"] if decode else [])
        attn_out = ["attn"] + (["present_key", "present_value"] if decode else [])
        nodes.append(helper.make_node("MultiHeadAttention", attn_in, attn_out, domain="com.microsoft", num_heads=H,
                                      unidirectional=0 if decode else 1))
    nodes += [helper.make_node("MatMul", ["attn", "w_out_t"], ["y0"]),
              helper.make_node("Add", ["y0", "b_out"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", onnx_dt, [B, S, E])]
    outputs = [helper.make_tensor_value_info("y", onnx_dt, [B, S, E])]
    if decode:
        # GQA's past is the shared (T + 1)-slot buffer; MHA's past holds the T cached tokens.
        past_len = T + 1 if gqa else T
        inputs += [helper.make_tensor_value_info(n, onnx_dt, [B, KVH, past_len, D]) for n in ("past_key", "past_value")]
        outputs += [helper.make_tensor_value_info(n, onnx_dt, [B, KVH, T + 1, D])
                    for n in ("present_key", "present_value")]
    graph = helper.make_graph(nodes, "attention_layer", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9

    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3  # errors only: saving the optimized graph warns that it is machine-specific
    opt_dir = tempfile.mkdtemp(prefix="ort_opt_")
    so.optimized_model_filepath = os.path.join(opt_dir, "optimized.onnx")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    optimized = onnx.load(so.optimized_model_filepath)
    info = {"onnxruntime": ort.__version__, "threads": a.threads,
            "optimized_ops": [("%s.%s" % (n.domain, n.op_type)) if n.domain else n.op_type
                              for n in optimized.graph.node]}

    binding = sess.io_binding()
    feeds = {"x": x}
    if decode and gqa:  # the shared buffers: the T cached tokens, slot T for the step's token
        for name, past in (("past_key", inp["past_k"]), ("past_value", inp["past_v"])):
            buf = np.zeros((B, KVH, T + 1, D), dtype=np.float32)
            buf[:, :, :T] = past
            feeds[name] = buf
    elif decode:
        feeds.update(past_key=inp["past_k"], past_value=inp["past_v"])
    keep = []  # the OrtValues and their numpy arrays must outlive the binding
    vals = {}
    for name, arr in feeds.items():
        arr = np.ascontiguousarray(arr.astype(np_dt))
        vals[name] = ort.OrtValue.ortvalue_from_numpy(arr)
        keep += [arr, vals[name]]
        binding.bind_ortvalue_input(name, vals[name])
    outs = {"y": ort.OrtValue.ortvalue_from_shape_and_type([B, S, E], np_dt)}
    if decode:
        for name, past in (("present_key", "past_key"), ("present_value", "past_value")):
            # GQA: present is past's own buffer (shared); MHA: a (T + 1)-token tensor of its own, written anew.
            outs[name] = vals[past] if gqa else ort.OrtValue.ortvalue_from_shape_and_type([B, KVH, T + 1, D], np_dt)
    for name, v in outs.items():
        binding.bind_ortvalue_output(name, v)
    keep.append(outs)

    def call():
        # The binding reads the OrtValues' numpy memory without a copy: naming `keep` here keeps it alive.
        sess.run_with_iobinding(binding)
        return keep

    return call, lambda: outs["y"].numpy().astype(np.float32), info


if __name__ == "__main__":
    serve(build)
