"""gpt2attn.GPT2 (python/model_bindings.cpp), the model library from Python: logits against the float64 PyTorch GPT-2 of
tests/python/gpt2_reference.py reading the same checkpoint (scripts/make_gpt2_checkpoint.py), greedy generation
against the reference's argmax, the step API against logits(), batched generation against each prompt alone, and bad
input as gpt2attn exceptions carrying the library's message. Run by ctest python.module."""
import importlib.util
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gpt2attn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
_spec = importlib.util.spec_from_file_location("gpt2_reference", os.path.join(HERE, "..", "gpt2_reference.py"))
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

VOCAB, POSITIONS = 300, 96
TINY = ["--n-embd", "64", "--n-head", "4", "--layers", "2", "--vocab", str(VOCAB), "--n-positions", str(POSITIONS)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gpt2") / "tiny")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_gpt2_checkpoint.py"), out, *TINY],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def loaded(ckpt):
    return ref.load_checkpoint(ckpt)  # (config, float64 tensors): read once for every reference call


# One thread: these tests check numbers, not parallelism (the C++ tests do), and on a machine shared with other work
# every OpenMP barrier of a 2-thread team can wait a time slice for its second thread: seconds a generate() call.
@pytest.fixture(scope="module")
def model(ckpt):
    return gpt2attn.GPT2.from_pretrained(ckpt, threads=1)


def ids(seed, n):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def rel_error(got, want):
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


def test_config_and_random(model):
    c = model.config
    assert (c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head) == (VOCAB, POSITIONS, 64, 2, 4)
    assert c.to_dict()["n_embd"] == 64 and gpt2attn.gpt2_preset("gpt2-small").n_layer == 12
    tiny = {"vocab_size": 50, "n_positions": 16, "n_embd": 32, "n_layer": 1, "n_head": 2}
    a = gpt2attn.GPT2.random(tiny, seed=3, threads=1)
    b = gpt2attn.GPT2.random(gpt2attn.GPT2Config(**tiny), seed=3, threads=1)
    assert a.config == b.config and a.config.n_inner == 0
    np.testing.assert_array_equal(a.logits([1, 2, 3]), b.logits([1, 2, 3]))  # reproducible from the seed
    assert not np.array_equal(a.logits([1, 2, 3]), gpt2attn.GPT2.random(tiny, seed=4, threads=1).logits([1, 2, 3]))


def test_logits_match_the_float64_reference(model, loaded, ckpt):
    x = ids(1, 64)
    want = ref.logits(loaded, x).numpy()
    got = model.logits(x)
    assert got.dtype == np.float32 and got.shape == (64, VOCAB)
    # Observed max|error| / max|logit| on these ids (avx512_bf16): f32 2.8e-7, bf16 1.7e-3, int8 weights
    # 5.8e-3, int4 weights 4.9e-2 (groups of 32 of a 64-wide model: coarse, as int4 is).
    assert rel_error(got, want) <= 1e-4
    np.testing.assert_array_equal(model.logits(np.array(x, dtype=np.int64)), got)  # an int64 array reads the same
    bf16 = gpt2attn.GPT2.from_pretrained(ckpt, dtype="bf16", threads=1)
    assert rel_error(bf16.logits(x), want) <= 3e-2
    for fmt, bound in (("int8", 3e-2), ("int4", 1e-1)):  # quantized weights: coarser, but the same model
        q = gpt2attn.GPT2.from_pretrained(ckpt, weights_dtype=fmt, threads=1)
        assert rel_error(q.logits(x), want) <= bound, fmt


def test_greedy_generation_follows_the_reference_argmax(model, loaded):
    prompt = ids(2, 9)
    [g] = model.generate(prompt, max_new_tokens=20)  # a flat list is one prompt: a list of one back
    assert g["prompt_ids"] == prompt and len(g["new_ids"]) == 20 and g["finish_reason"] == "length"
    assert 0 < g["first_token_ms"] <= g["total_ms"] and "logprobs" not in g
    full = ref.logits(loaded, prompt + g["new_ids"]).numpy()
    scale = np.max(np.abs(full))
    for j, new in enumerate(g["new_ids"]):
        row = full[len(prompt) - 1 + j]
        assert row[new] >= row.max() - 1e-4 * scale, (j, new, int(row.argmax()))  # argmax, or a near tie


def test_logprobs_and_stop(model):
    prompt = ids(3, 5)
    [g] = model.generate([prompt], max_new_tokens=6, logprobs=True)
    logits = model.logits(prompt + g["new_ids"][:-1]).astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_softmax = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    want = [log_softmax[len(prompt) - 1 + j, t] for j, t in enumerate(g["new_ids"])]
    np.testing.assert_allclose(g["logprobs"], want, atol=1e-4)
    stop = g["new_ids"][2]
    first = g["new_ids"].index(stop)
    [s] = model.generate(prompt, max_new_tokens=6, stop=[stop])
    assert s["new_ids"] == g["new_ids"][:first + 1] and s["finish_reason"] == "stop"


def test_step_prefill_then_decode_equals_logits(model):
    x = ids(4, 40)
    full = model.logits(x)
    cache = model.make_cache(capacity_tokens=256, block_tokens=16)
    a, b = cache.create(), cache.create()
    assert cache.layers == 2 and cache.total_blocks == 16 and cache.free_blocks == 16
    # Two prompts in one ragged step: a's first 23 ids, b's first 7; every position's logits.
    step = model.step(cache, [a, b], [23, 7], x[:23] + x[:7], all_positions=True)
    assert step.shape == (30, VOCAB)
    np.testing.assert_allclose(step[:23], full[:23], atol=1e-4 * np.abs(full).max())
    np.testing.assert_allclose(step[23:], full[:7], atol=1e-4 * np.abs(full).max())
    assert cache.length(a) == 23 and cache.length(b) == 7
    # Decode: one id each per step, b one position behind... then b catches up with a 16-id chunk.
    for t in range(23, 30):
        last = model.step(cache, [a, b], [1, 1], [x[t], x[t - 16]])
        assert last.shape == (2, VOCAB)
        np.testing.assert_allclose(last[0], full[t], atol=1e-4 * np.abs(full).max())
        np.testing.assert_allclose(last[1], full[t - 16], atol=1e-4 * np.abs(full).max())
    last = model.step(cache, [b], [16], x[14:30])
    np.testing.assert_allclose(last[0], full[29], atol=1e-4 * np.abs(full).max())
    # fork, truncate, release
    c = cache.fork(a, prefix_tokens=20)
    assert cache.length(c) == 20 and c in cache
    np.testing.assert_allclose(model.step(cache, [c], [1], [x[20]])[0], full[20], atol=1e-4 * np.abs(full).max())
    cache.truncate(a, 10)
    np.testing.assert_allclose(model.step(cache, [a], [1], [x[10]])[0], full[10], atol=1e-4 * np.abs(full).max())
    for s in (a, b, c):
        cache.release(s)
    assert cache.num_sequences == 0 and cache.free_blocks == cache.total_blocks and a not in cache


def test_step_refusals_change_nothing(model):
    cache = model.make_cache(capacity_tokens=32, block_tokens=16)
    s = cache.create()
    model.step(cache, [s], [4], [1, 2, 3, 4])
    with pytest.raises(gpt2attn.InvalidArgument, match=r"GPT2::step: token id 300 at 1 is outside the vocabulary"):
        model.step(cache, [s], [2], [5, 300])
    with pytest.raises(gpt2attn.InvalidArgument, match=r"GPT2::step: 3 ids, expected sum\(tokens\) = 2"):
        model.step(cache, [s], [2], [5, 6, 7])
    with pytest.raises(gpt2attn.InvalidArgument, match="entry 0 has 0 tokens"):
        model.step(cache, [s], [0], [])
    with pytest.raises(gpt2attn.OutOfMemory, match="KV blocks"):
        model.step(cache, [s], [40], list(range(40)))
    assert cache.length(s) == 4  # every refusal left the sequence as it was


def test_batched_generation_equals_each_prompt_alone(model):
    prompts = [ids(10 + i, n) for i, n in enumerate((3, 17, 8, 30))]
    for kw in ({}, {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7}):
        together = model.generate(prompts, max_new_tokens=10, max_step_tokens=12, **kw)
        for i, p in enumerate(prompts):
            alone_kw = dict(kw, seed=kw["seed"] + i) if "seed" in kw else kw  # prompt i samples with seed + i
            [alone] = model.generate(p, max_new_tokens=10, **alone_kw)
            assert together[i]["prompt_ids"] == p and together[i]["new_ids"] == alone["new_ids"], (kw, i)
    # A 2-D integer array is several prompts of one length.
    grid = np.array([ids(20, 6), ids(21, 6)], dtype=np.int32)
    rows = model.generate(grid, max_new_tokens=4)
    assert [r["new_ids"] for r in rows] == [model.generate(list(g), max_new_tokens=4)[0]["new_ids"] for g in grid]


def test_errors_carry_the_library_message(model, ckpt, tmp_path):
    with pytest.raises(gpt2attn.InvalidArgument, match=r"GPT2::logits: token id 300 at 2 is outside the vocabulary "
                                                       r"\[0, 300\)"):
        model.logits([1, 2, 300])
    with pytest.raises(gpt2attn.InvalidArgument, match="token id -1 at 0"):
        model.logits(np.array([-1, 2]))
    with pytest.raises(gpt2attn.InvalidArgument, match="token id 1099511627776 at 1"):  # past int32: not wrapped
        model.logits(np.array([1, 2 ** 40]))
    with pytest.raises(gpt2attn.InvalidArgument, match="dtype float32; token ids are integers"):
        model.logits(np.array([1, 2], dtype=np.float32))
    with pytest.raises(gpt2attn.InvalidArgument, match="n_positions = 96, got T = 97"):
        model.logits(list(range(97)))
    with pytest.raises(gpt2attn.InvalidArgument, match=r"prompt 1 has 96 ids; expected 1 to n_positions - 1 = 95"):
        model.generate([[1, 2], list(range(96))])
    with pytest.raises(gpt2attn.InvalidArgument, match="GPT2::generate: prompt 0: token id 300"):
        model.generate([[300]])
    with pytest.raises(gpt2attn.InvalidArgument, match="stop token 300"):
        model.generate([1], stop=[300])
    with pytest.raises(gpt2attn.InvalidArgument, match="temperature"):
        model.generate([1], temperature=-1.0)
    with pytest.raises(gpt2attn.BadFile, match="no such checkpoint directory"):
        gpt2attn.GPT2.from_pretrained(str(tmp_path / "missing"))
    with pytest.raises(gpt2attn.InvalidArgument, match="dtype 'f16'"):
        gpt2attn.GPT2.from_pretrained(ckpt, dtype="f16")
    with pytest.raises(gpt2attn.InvalidArgument, match="weights_dtype 'i8'"):
        gpt2attn.GPT2.from_pretrained(ckpt, weights_dtype="i8")
    with pytest.raises(gpt2attn.InvalidArgument, match="unknown key 'layers'"):
        gpt2attn.GPT2.random({"layers": 2})
    with pytest.raises(gpt2attn.InvalidArgument, match="unknown GPT-2 preset 'gpt2-tiny'"):
        gpt2attn.GPT2.random("gpt2-tiny")
    with pytest.raises(gpt2attn.InvalidArgument, match="KvCache dtype 'f16'"):
        model.make_cache(capacity_tokens=64, dtype="f16")


@pytest.mark.parametrize("call", ["logits", "step", "generate"])
def test_compute_releases_the_gil(model, call):
    """As test_module.py's test of the same name: with a long switch interval, a counting thread advances during the
    calls only if they release the GIL."""
    x = ids(30, 90)
    cache = model.make_cache(capacity_tokens=96)
    seq = cache.create()

    def run():
        if call == "logits":
            model.logits(x)
        elif call == "step":
            cache.truncate(seq, 0)
            model.step(cache, [seq], [90], x)
        else:
            model.generate(x[:60], max_new_tokens=8)

    count, go, stop = [0], threading.Event(), threading.Event()

    def counter():
        go.wait()
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        c = threading.Thread(target=counter)
        c.start()
        go.set()
        before, deadline = count[0], time.monotonic() + 10.0
        run()
        while count[0] == before and time.monotonic() < deadline:
            run()
        during = count[0] - before
        stop.set()
        c.join()
    finally:
        sys.setswitchinterval(old)
    assert during > 0, f"a Python thread made no progress during GPT2.{call}(): the GIL was held"


def test_batch_invariant_generation_alone_equals_batched(model):
    """batch_invariant=True: each prompt's ids and log-probabilities the same bits alone as among the others."""
    m = model
    prompts = [[5, 9, 1], list(range(1, 41)), [7], list(range(3, 20))]
    together = m.generate(prompts, max_new_tokens=6, logprobs=True, max_step_tokens=16, batch_invariant=True)
    for p, t in zip(prompts, together):
        alone = m.generate([p], max_new_tokens=6, logprobs=True, max_step_tokens=16, batch_invariant=True)[0]
        assert alone["new_ids"] == t["new_ids"]
        assert alone["logprobs"] == t["logprobs"]

