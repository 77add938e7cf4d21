# bench/peers/llamacpp_worker.py: llama.cpp (through llama-cpp-python's C API bindings) on the attention layer, as a
# worker of bench/peers/run.py (protocol: worker_common.py). Run by the peers venv's python; not by hand.
#
# llama.cpp runs whole models from GGUF files and has no attention-layer API, so the worker writes a one-block GPT-2
# (arch "gpt2") around our layer and feeds it embeddings instead of tokens:
#   - attn_qkv / attn_output: the case's weights and biases (attn_qkv holds [W_q; W_k; W_v], as ours; head_count_kv
#     gives grouped K/V heads);
#   - attn_norm (weight 1, bias 0, eps 1e-12): the identity on the driver's inputs, whose rows run.py draws with mean
#     0 and variance 1;
#   - the feed-forward block with zero weights and biases (width 32): it adds nothing to the residual;
#   - position embeddings zero; a 4-entry dummy vocabulary ("none" tokenizer) for the unused output head.
# What it returns is then output_norm(x + layer(x)) (weight 1, bias 0, eps 1e-12), which info declares
# ("output": "layernorm(x + y)") so that the driver checks it against the same transform of the float64 reference.
# The extra work beside the layer (two layer norms over the rows, a 32-wide zero FFN, a 4-row output head) is under
# 1% of a GPT-2 layer's FLOPs.
# Prefill: one llama_decode of the T tokens of sequence 0 after clearing its cache, every output row requested.
# Decode: B sequences, each prefilled with its T history tokens at set-up; a step decodes one token per sequence
# at position T, then removes it (llama_memory_seq_rm) so that every step sees exactly T cached tokens.
# --dtype fp32: F32 weights and K/V cache, flash attention off (see build); bf16: BF16 weights and K/V cache, flash
# attention "auto".
# Threads: n_threads and n_threads_batch.
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from worker_common import serve  # noqa: E402

NORM_EPS = 1e-12  # layer norms that leave unit-variance rows as they are
FFN = 32
VOCAB = 4


def write_gguf(path, inp, H, KVH, n_ctx, dtype):
    import gguf
    import numpy as np

    w_in, b_in, w_out, b_out = inp["w_in"], inp["b_in"], inp["w_out"], inp["b_out"]
    E = w_out.shape[0]
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_context_length(n_ctx)
    w.add_embedding_length(E)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_layer_norm_eps(NORM_EPS)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("none")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bf16" else gguf.LlamaFileType.ALL_F32)

    def matrix(name, a):  # 2-D weights in the run's type; vectors stay f32, as llama.cpp's converters keep them
        a = np.ascontiguousarray(a, dtype=np.float32)
        if dtype == "bf16" and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            w.add_tensor(name, a)

    ones, zeros = np.ones(E, np.float32), np.zeros(E, np.float32)
    matrix("token_embd.weight", np.zeros((VOCAB, E)))
    matrix("position_embd.weight", np.zeros((n_ctx, E)))
    matrix("output_norm.weight", ones)
    matrix("output_norm.bias", zeros)
    matrix("blk.0.attn_norm.weight", ones)
    matrix("blk.0.attn_norm.bias", zeros)
    matrix("blk.0.attn_qkv.weight", w_in)  # (E + 2KW, E): ggml's {E, E + 2KW}
    matrix("blk.0.attn_qkv.bias", b_in)
    matrix("blk.0.attn_output.weight", w_out)
    matrix("blk.0.attn_output.bias", b_out)
    matrix("blk.0.ffn_norm.weight", ones)
    matrix("blk.0.ffn_norm.bias", zeros)
    matrix("blk.0.ffn_up.weight", np.zeros((FFN, E)))
    matrix("blk.0.ffn_up.bias", np.zeros(FFN))
    matrix("blk.0.ffn_down.weight", np.zeros((E, FFN)))
    matrix("blk.0.ffn_down.bias", zeros)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build(a, inp):
    import llama_cpp as L
    import numpy as np

    if a.variant != "gguf":
        raise ValueError("llama.cpp worker: unknown variant %s" % a.variant)
    kv_type = {"fp32": 0, "bf16": 30}.get(a.dtype)  # GGML_TYPE_F32, GGML_TYPE_BF16
    if kv_type is None:
        raise ValueError("llama.cpp worker: dtype %s not driven (fp32, bf16)" % a.dtype)
    H, KVH = a.heads, a.kv_heads
    hist = np.load(os.path.join(a.dir, "history.npy"))  # (B, T or T + 1, E): prefill's x, decode's whole history
    decode = a.mode == "decode"
    B, n, E = hist.shape
    T = n - 1 if decode else n
    seq_ctx = -(-(T + 16) // 256) * 256  # cells per sequence, with room for the step's token
    path = os.path.join(a.dir, "layer_%s.gguf" % a.dtype)
    write_gguf(path, inp, H, KVH, seq_ctx, a.dtype)

    L.llama_backend_init()
    quiet = L.llama_log_callback(lambda level, text, data: None)  # kept alive below: llama.cpp calls it later
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mp)
    if not model:
        raise RuntimeError("llama.cpp could not load the one-block GGUF %s" % path)
    cp = L.llama_context_default_params()
    n_seq = B if decode else 1
    cp.n_ctx = seq_ctx * n_seq
    cp.n_batch = cp.n_ubatch = max(T, B)
    cp.n_seq_max = n_seq
    cp.n_threads = cp.n_threads_batch = a.threads
    cp.embeddings = True
    cp.pooling_type = L.LLAMA_POOLING_TYPE_NONE
    cp.type_k = cp.type_v = kv_type
    # Flash attention: llama.cpp's "auto" (on, on this CPU) rounds inside the attention to f16 and missed the fp32
    # bound (1.3e-4 > 1e-4 of max |ref| on gpt2-small, T=64), so fp32 runs without it (1.6e-7); bf16 keeps auto.
    cp.flash_attn_type = 0 if a.dtype == "fp32" else -1  # LLAMA_FLASH_ATTN_TYPE_DISABLED, _AUTO
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a context (n_ctx %d, %d sequences)" % (cp.n_ctx, n_seq))
    mem = L.llama_get_memory(ctx)

    def make_batch(rows, positions, seqs):
        """A batch of embeddings rows (k, E) at the given positions and sequences, every row an output."""
        k = rows.shape[0]
        b = L.llama_batch_init(k, E, 1)
        b.n_tokens = k
        ctypes.memmove(b.embd, np.ascontiguousarray(rows, dtype=np.float32).ctypes.data, rows.nbytes)
        for i in range(k):
            b.pos[i] = positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seqs[i]
            b.logits[i] = 1
        return b

    def run(b):
        rc = L.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError("llama_decode returned %d" % rc)

    state = {}
    if decode:
        for s in range(B):  # the T cached tokens of each sequence
            pre = make_batch(hist[s, :T].astype(np.float32), list(range(T)), [s] * T)
            run(pre)
            L.llama_batch_free(pre)
        step = make_batch(hist[:, T].astype(np.float32), [T] * B, list(range(B)))

        def call():
            run(step)
            for s in range(B):  # back to T cached tokens
                L.llama_memory_seq_rm(mem, s, T, -1)
        rows = B
    else:
        whole = make_batch(hist[0].astype(np.float32), list(range(T)), [0] * T)

        def call():
            L.llama_memory_seq_rm(mem, 0, -1, -1)
            run(whole)
        rows = T

    def output():
        # Read after call(): the embeddings of the last decode's output rows, in batch order.
        ptr = L.llama_get_embeddings(ctx)
        out = np.ctypeslib.as_array(ptr, shape=(rows * E,)).reshape(rows, E).copy()
        return out.reshape(B, 1, E) if decode else out.reshape(1, T, E)

    state["keep"] = (model, ctx, quiet)
    info = {"llama_cpp_python": L.__version__, "threads": a.threads, "kv_cache": a.dtype,
            "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
            "flash_attn": "disabled" if a.dtype == "fp32" else "auto", "output": "layernorm(x + y)",
            "norm_eps": NORM_EPS}
    return call, output, info


if __name__ == "__main__":
    serve(build)
