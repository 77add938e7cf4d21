"""tests/consumers/consumer.py PREFIX: the installed Python package as a user imports it (PYTHONPATH=<prefix>/lib/
python3.X/dist-packages): it must come from PREFIX and load PREFIX's libgpt2attn.so, found through the module's own
RUNPATH, and compute."""
import sys

import numpy as np

import gpt2attn

prefix = sys.argv[1].rstrip("/") + "/"
with open("/proc/self/maps") as maps:
    libs = sorted({line.split()[-1] for line in maps if "libgpt2attn.so" in line})
assert gpt2attn.__file__.startswith(prefix), f"gpt2attn imported from {gpt2attn.__file__}, not {prefix}"
assert len(libs) == 1 and libs[0].startswith(prefix), f"loaded {libs}, not {prefix}'s library"
cfg = gpt2attn.Config(d_model=32, num_heads=4, context_length=8, causal=True)
layer = gpt2attn.CausalSelfAttention(cfg, gpt2attn.Weights.random(cfg, seed=1), threads=1)
y = layer.forward(np.full((1, 3, 32), 0.25, dtype=np.float32))
assert y.shape == (1, 3, 32) and np.isfinite(y).all()
print(f"consumer.py: gpt2attn {gpt2attn.version()} from {gpt2attn.__file__} with {libs[0]}")
