# bench/peers/ort_worker.py: ONNX Runtime's CPU execution provider on the attention layer, as a worker of
# bench/peers/run.py (protocol: worker_common.py). Run by the peers venv's python; not by hand.
#
# The graph is built in memory with the onnx package's helper:
#   x -> MatMul [W_q; W_k; W_v]^T -> Add bias -> Split (q, k, v) -> com.microsoft.MultiHeadAttention
#     (num_heads H, unidirectional=1 for the causal prefill) -> MatMul W_out^T -> Add bias -> y
# Decode feeds the contrib op's past_key / past_value (B, H, T, D) inputs and takes its present_key /
# present_value (B, H, T + 1, D) outputs: ORT's own K/V cache form, in which every step writes a new present
# holding the past plus the new token.
# Variant (--variant) mha only. MultiHeadAttention has no grouped K/V heads (the key and value must have H heads;
# GroupQueryAttention, which has them, is not driven here), so those cases get the error row.
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

    if a.variant != "mha":
        raise ValueError("ort worker: unknown variant %s" % a.variant)
    H, KVH = a.heads, a.kv_heads
    if KVH != H:
        raise ValueError("com.microsoft.MultiHeadAttention has no grouped K/V heads (its key and value carry all "
                         "H heads)")
    np_dt, onnx_dt = {"fp32": (np.float32, TensorProto.FLOAT), "fp16": (np.float16, TensorProto.FLOAT16),
                      "bf16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16)}[a.dtype]
    x = inp["x"]
    B, S, E = x.shape
    D = E // H
    decode = a.mode == "decode"

    def init(name, arr):
        return numpy_helper.from_array(np.ascontiguousarray(arr.astype(np_dt)), name)

    inits = [init("w_in_t", inp["w_in"].T), init("b_in", inp["b_in"]), init("w_out_t", inp["w_out"].T),
             init("b_out", inp["b_out"]), numpy_helper.from_array(np.array([E, E, E], dtype=np.int64), "split")]
    nodes = [helper.make_node("MatMul", ["x", "w_in_t"], ["qkv0"]),
             helper.make_node("Add", ["qkv0", "b_in"], ["qkv"]),
             helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=2)]
    mha_in = ["q", "k", "v"] + (["", "", "", "past_key", "past_value"] if decode else [])
    mha_out = ["attn"] + (["present_key", "present_value"] if decode else [])
    nodes += [helper.make_node("MultiHeadAttention", mha_in, mha_out, domain="com.microsoft", num_heads=H,
                               unidirectional=0 if decode else 1),
              helper.make_node("MatMul", ["attn", "w_out_t"], ["y0"]),
              helper.make_node("Add", ["y0", "b_out"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", onnx_dt, [B, S, E])]
    outputs = [helper.make_tensor_value_info("y", onnx_dt, [B, S, E])]
    if decode:
        T = inp["past_k"].shape[2]
        inputs += [helper.make_tensor_value_info(n, onnx_dt, [B, H, T, D]) for n in ("past_key", "past_value")]
        outputs += [helper.make_tensor_value_info(n, onnx_dt, [B, H, T + 1, D])
                    for n in ("present_key", "present_value")]
    graph = helper.make_graph(nodes, "attention_layer", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
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
    if decode:
        feeds.update(past_key=inp["past_k"], past_value=inp["past_v"])
    keep = []  # the OrtValues must outlive the binding
    for name, arr in feeds.items():
        v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr.astype(np_dt)))
        keep.append(v)
        binding.bind_ortvalue_input(name, v)
    out_shapes = {"y": (B, S, E)}
    if decode:
        out_shapes.update(present_key=(B, H, T + 1, D), present_value=(B, H, T + 1, D))
    outs = {}
    for name, shape in out_shapes.items():
        outs[name] = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np_dt)
        binding.bind_ortvalue_output(name, outs[name])

    def call():
        # The binding reads the OrtValues' numpy memory without a copy: naming `keep` here keeps it alive.
        sess.run_with_iobinding(binding)
        return keep

    return call, lambda: outs["y"].numpy().astype(np.float32), info


if __name__ == "__main__":
    serve(build)
