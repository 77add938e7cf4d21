"""scripts/make_gpt2_checkpoint.py (random-weight Hugging Face GPT-2 checkpoints) and tests/python/gpt2_reference.py
(a plain float64 PyTorch GPT-2): the files have GPT-2's names, shapes, dtypes and sharding; a tensor is the same
whatever the shards and the prefix; the weights have GPT-2's initialization scale; and, where transformers is
installed (ctest python.hf_transformers), GPT2LMHeadModel.from_pretrained reads every variant and its float64
logits equal the reference's."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
import gpt2_reference as ref  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "make_gpt2_checkpoint.py")
TINY = ["--layers", "2", "--n-embd", "64", "--n-head", "4", "--vocab", "101", "--n-positions", "32"]


def make(tmp_path, name, *args):
    out = str(tmp_path / name)
    subprocess.run([sys.executable, SCRIPT, out, *TINY, *args], check=True, capture_output=True)
    return out


def test_layout_names_and_sharding(tmp_path):
    one = make(tmp_path, "one")
    three = make(tmp_path, "three", "--shards", "3", "--no-prefix")
    assert sorted(os.listdir(one)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(three)) == ["config.json", "model-00001-of-00003.safetensors",
                                         "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                                         "model.safetensors.index.json"]
    with open(os.path.join(three, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = {os.path.join(three, f) for f in index["weight_map"].values()}
    assert index["metadata"]["total_size"] == sum(os.path.getsize(f) for f in files) - sum(
        8 + int.from_bytes(open(f, "rb").read(8), "little") for f in files)
    raw_one = ref.read_safetensors(os.path.join(one, "model.safetensors"))
    assert all(k.startswith("transformer.") for k in raw_one)
    assert "lm_head.weight" not in raw_one and "transformer.wte.weight" in raw_one  # tied, as GPT-2's own files
    c1, w1 = ref.load_checkpoint(one)
    c3, w3 = ref.load_checkpoint(three)
    assert c1 == c3 and c1["n_layer"] == 2 and c1["n_embd"] == 64 and c1["vocab_size"] == 101
    assert sorted(w1) == sorted(w3) and len(w1) == 2 + 12 * 2 + 2
    for k in w1:
        assert torch.equal(w1[k], w3[k]), k  # a tensor does not depend on the shards or the prefix
    assert w1["h.1.attn.c_attn.weight"].shape == (64, 192) and w1["h.0.mlp.c_proj.weight"].shape == (256, 64)


def test_initialization_scale(tmp_path):
    out = str(tmp_path / "scale")
    subprocess.run([sys.executable, SCRIPT, out, "--layers", "8", "--n-embd", "256", "--n-head", "4", "--vocab",
                    "1000", "--n-positions", "64"], check=True, capture_output=True)
    _, w = ref.load_checkpoint(out)
    assert abs(w["wte.weight"].std().item() - 0.02) < 0.001
    assert abs(w["h.3.attn.c_attn.weight"].std().item() - 0.02) < 0.001
    resid = 0.02 / math.sqrt(2 * 8)
    assert abs(w["h.3.mlp.c_proj.weight"].std().item() - resid) < 0.1 * resid
    assert torch.all(w["h.0.ln_1.weight"] == 1) and torch.all(w["h.0.attn.c_attn.bias"] == 0)
    # The seed changes the weights, and only the seed does.
    other = out + "-seed"
    subprocess.run([sys.executable, SCRIPT, other, "--layers", "8", "--n-embd", "256", "--n-head", "4", "--vocab",
                    "1000", "--n-positions", "64", "--seed", "1"], check=True, capture_output=True)
    assert not torch.equal(ref.load_checkpoint(other)[1]["wte.weight"], w["wte.weight"])


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_dtypes_round_the_f32_weights(tmp_path, dtype):
    f32 = ref.load_checkpoint(make(tmp_path, "f32"))[1]
    low = ref.load_checkpoint(make(tmp_path, dtype, "--dtype", dtype))[1]
    torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    for k in f32:
        assert torch.equal(low[k], f32[k].to(torch.float32).to(torch_dtype).to(torch.float64)), k


def test_reference_is_causal_and_deterministic(tmp_path):
    ck = ref.load_checkpoint(make(tmp_path, "c"))
    ids = [3, 17, 99, 0, 42, 7, 7, 64]
    full = ref.logits(ck, ids)
    assert full.shape == (8, 101) and full.dtype == torch.float64
    prefix = ref.logits(ck, ids[:5])
    assert torch.allclose(full[:5], prefix, rtol=0, atol=1e-12)  # position i sees only 0..i
    changed = ref.logits(ck, ids[:5] + [1, 2, 3])
    assert torch.allclose(changed[:5], full[:5], rtol=0, atol=1e-12) and not torch.allclose(changed[5:], full[5:])


@pytest.mark.parametrize("variant", [(), ("--shards", "3"), ("--no-prefix",), ("--dtype", "BF16"), ("--dtype", "F16")])
def test_transformers_reads_it_and_agrees_with_the_reference(tmp_path, variant):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (ctest "
                                       "python.hf_transformers installs it in a venv under build/)")
    out = make(tmp_path, "hf", *variant)
    model = transformers.GPT2LMHeadModel.from_pretrained(out, torch_dtype=torch.float64).eval()
    ids = [5, 77, 12, 100, 0, 31, 31, 8, 64, 2, 99]
    with torch.no_grad():
        got = model(torch.tensor([ids]), use_cache=False).logits[0]
    want = ref.logits(out, ids)
    assert (got - want).abs().max().item() < 1e-10
