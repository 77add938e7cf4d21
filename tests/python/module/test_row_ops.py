"""gpt2attn.layer_norm and gpt2attn.gelu_tanh (gpt2attn/ops.hpp) against torch in float64, numpy and torch inputs,
out= and in place, and the arguments refused."""
import numpy as np
import pytest
import torch

import gpt2attn


@pytest.mark.parametrize("shape", [(1,), (3, 5), (2, 7, 768), (4, 1600)])
def test_layer_norm_matches_torch(shape):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 2 + 10).astype(np.float32)
    g = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
    b = rng.uniform(-0.5, 0.5, shape[-1]).astype(np.float32)
    want = torch.nn.functional.layer_norm(torch.from_numpy(x).double(), (shape[-1],), torch.from_numpy(g).double(),
                                          torch.from_numpy(b).double(), eps=1e-5).numpy()
    for isa in _runnable():
        got = gpt2attn.layer_norm(x, g, b, eps=1e-5, threads=2, isa=isa)
        assert got.shape == x.shape and got.dtype == np.float32
        assert np.max(np.abs(got - want)) < 1e-4, isa
    t = gpt2attn.layer_norm(torch.from_numpy(x), torch.from_numpy(g), torch.from_numpy(b))
    assert isinstance(t, torch.Tensor)
    y = x.copy()
    assert gpt2attn.layer_norm(y, g, b, out=y) is y  # in place
    np.testing.assert_array_equal(y, gpt2attn.layer_norm(x, g, b))


def _runnable():
    """The compiled levels this CPU runs (asking for another is refused)."""
    def runs(isa):
        try:
            gpt2attn.gelu_tanh(np.zeros(1, np.float32), isa=isa)
            return True
        except gpt2attn.InvalidArgument:
            return False
    return [i for i in gpt2attn.compiled_isas() if runs(i)]


def test_gelu_matches_torch():
    x = np.concatenate([np.linspace(-12, 12, 4001), [1e-30, -1e-30, 30, -30, 1e10, -1e10]]).astype(np.float32)
    want = torch.nn.functional.gelu(torch.from_numpy(x).double(), approximate="tanh").numpy()
    for isa in _runnable():
        got = gpt2attn.gelu_tanh(x, isa=isa)
        assert np.allclose(got, want, rtol=2e-6, atol=2e-6), isa
    y = x.copy()
    assert gpt2attn.gelu_tanh(y, out=y) is y
    np.testing.assert_array_equal(y, gpt2attn.gelu_tanh(x))
    assert np.isnan(gpt2attn.gelu_tanh(np.array([np.nan], np.float32))[0])


def test_bad_arguments():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(gpt2attn.InvalidArgument, match="gamma"):
        gpt2attn.layer_norm(x, np.ones(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(gpt2attn.InvalidArgument, match="eps"):
        gpt2attn.layer_norm(x, np.ones(4, np.float32), np.zeros(4, np.float32), eps=0.0)
    with pytest.raises(gpt2attn.InvalidArgument, match="float32"):
        gpt2attn.gelu_tanh(np.ones(4))
    with pytest.raises(gpt2attn.InvalidArgument, match="C-contiguous"):
        gpt2attn.gelu_tanh(np.ones((4, 4), np.float32)[:, ::2])
