"""gpt2attn.torch.replace_attention on a Hugging Face GPT-2 (transformers' GPT2LMHeadModel, random weights, no
download): the logits before and after, which calls gpt2attn computes and which it leaves to the original forward.
Skipped without transformers; ctest python.hf_transformers runs it in a venv that has it
(tests/python/module/with_transformers.py)."""
import os
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (ctest python.hf_transformers "
                                   "installs it in a venv under build/)")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import parity_common as pc  # noqa: E402

import gpt2attn.torch as gt  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention  # noqa: E402


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=96, n_head=4, n_layer=3, n_positions=64, vocab_size=211)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_replaced_gpt2_gives_the_same_logits():
    model = tiny_gpt2()
    ids = torch.randint(0, 211, (2, 29))
    with torch.no_grad():
        want = model.double()(ids, use_cache=False).logits
    model.float()
    keys = list(model.state_dict())
    assert gt.replace_attention(model, threads=2) == [f"transformer.h.{i}.attn" for i in range(3)]
    assert list(model.state_dict()) == keys
    attn = [model.transformer.h[i].attn for i in range(3)]
    assert all(isinstance(a, GPT2Attention) for a in attn)
    assert gt.replace_attention(model) == []  # already gpt2attn's
    with torch.inference_mode():
        got = model(ids, use_cache=False).logits
    assert [a.last_path for a in attn] == ["gpt2attn"] * 3
    pc.compare(got.numpy(), want.numpy(), pc.reduction_length(4 * 96, 29))


def test_what_gpt2attn_does_not_compute_is_the_original_forward_with_a_warning():
    model = tiny_gpt2(1)
    ids = torch.randint(0, 211, (2, 13))
    with torch.no_grad():
        plain = model(ids).logits  # use_cache=True: the KV cache is Hugging Face's
        padded = model(ids, attention_mask=torch.ones(2, 13, dtype=torch.long)).logits
    gt.replace_attention(model)
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="use_cache"):
            got = model(ids).logits
        assert attn.last_path.startswith("torch: use_cache")
        assert torch.equal(got, plain)
        with pytest.warns(RuntimeWarning, match="attention_mask"):
            got = model(ids, attention_mask=torch.ones(2, 13, dtype=torch.long)).logits
        assert torch.equal(got, padded)
    with pytest.warns(RuntimeWarning, match="a gradient is asked for"):
        model(ids, use_cache=False).logits.sum().backward()  # training still works: torch's math, its gradients
    assert model.transformer.h[0].attn.c_attn.weight.grad is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(ids, use_cache=False)
    assert attn.last_path == "gpt2attn"
