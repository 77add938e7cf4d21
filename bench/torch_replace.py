#!/usr/bin/python3
"""A whole PyTorch model before and after gpt2attn.torch.replace_attention: its output and its time, in one run.

    PYTHONPATH=build/python bench/torch_replace.py [--model torch|hf] [--preset gpt2-small] [--layers 12]
        [--batch 1] [--seq 512] [--threads 2] [--repeats 7] [--json]

--model torch: a GPT-2-shaped stack of torch.nn.TransformerEncoderLayer (pre-norm, GELU, causal mask, (T, B, E)
layout), its attention torch.nn.MultiheadAttention. --model hf: a Hugging Face GPT2LMHeadModel with random weights
(needs transformers: ctest's build/venv-hf has it) called with use_cache=False. Both sides run under
torch.inference_mode() at --threads threads (torch.set_num_threads and OMP_NUM_THREADS, ours through the layer's
threads), interleaved, each timed --repeats times after a warm-up; prints min/median/max ms of each, the speedup of
the medians, and the largest difference between the two outputs relative to the output's largest magnitude (exit 1
above 1e-4)."""
import argparse
import copy
import json
import os
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("torch", "hf"), default="torch")
    ap.add_argument("--preset", default="gpt2-small")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # before torch and the library start their pools
    import torch

    import gpt2attn
    import gpt2attn.torch as gt

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = gpt2attn.preset(a.preset)
    E, H, B, T = cfg.d_model, cfg.num_heads, a.batch, a.seq
    if a.model == "torch":
        layer = torch.nn.TransformerEncoderLayer(E, H, 4 * E, dropout=0.0, activation="gelu", norm_first=True)
        model = torch.nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False).eval()
        x = torch.randn(T, B, E)
        mask = torch.triu(torch.full((T, T), float("-inf")), 1)

        def call(m):
            return m(x, mask=mask)
    else:
        import transformers
        hf = transformers.GPT2Config(n_embd=E, n_head=H, n_layer=a.layers, n_positions=max(1024, T))
        model = transformers.GPT2LMHeadModel(hf).eval()
        ids = torch.randint(0, hf.vocab_size, (B, T))

        def call(m):
            return m(ids, use_cache=False).logits

    def timed(m):
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = call(m)
        return (time.perf_counter() - t0) * 1e3, y

    # Before: torch's own modules, in a copy of the model; after: the model with its attention replaced in place.
    before = copy.deepcopy(model)
    replaced = gt.replace_attention(model, threads=a.threads)
    models = {"torch": before, "gpt2attn": model}
    outputs, times = {}, {k: [] for k in models}
    for r in range(a.repeats + 1):  # round 0 warms up (oneDNN primitives, the library's layers)
        for name, m in models.items():
            ms, outputs[name] = timed(m)
            if r:
                times[name].append(ms)
    ref = outputs["torch"].double()
    rel = float((outputs["gpt2attn"].double() - ref).abs().max() / ref.abs().max())
    paths = sorted({m.last_path for m in model.modules() if hasattr(m, "last_path")})
    row = {"model": a.model, "preset": a.preset, "layers": a.layers, "batch": B, "seq": T, "threads": a.threads,
           "replaced": len(replaced), "paths": paths, "max_rel_diff": rel, "repeats": a.repeats,
           "cpu": _cpu(), "isa": gpt2attn.best_isa(), "torch": torch.__version__, "version": gpt2attn.__version__}
    for name, ts in times.items():
        row[f"{name}_ms"] = {"min": min(ts), "median": statistics.median(ts), "max": max(ts)}
    row["speedup"] = row["torch_ms"]["median"] / row["gpt2attn_ms"]["median"]
    # A model that computes something else is not timed as a win: float32 rounding moves the output by ~1e-6.
    ok = rel <= 1e-4
    if not ok:
        print(f"torch_replace: the outputs differ by {rel:.3g} of their magnitude", file=sys.stderr)
    if a.json:
        print(json.dumps(row))
        return 0 if ok else 1
    print(f"{a.model} model, {a.preset} x {a.layers} layers, B={B} T={T}, {a.threads} threads, {row['cpu']}")
    print(f"replaced {len(replaced)} attention modules; computed by {paths}")
    for name in times:
        t = row[f"{name}_ms"]
        print(f"  {name:9s} median {t['median']:9.1f} ms  (min {t['min']:.1f}, max {t['max']:.1f}, {a.repeats} runs)")
    print(f"  speedup {row['speedup']:.2f}x; max |after - before| / max |before| = {rel:.2g}")
    return 0 if ok else 1


def _cpu():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
