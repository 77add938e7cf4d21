# tests/python/test_cli_isa.py: the CLI's --isa caps the whole layer, oneDNN's GEMMs as well as gpt2attn's kernels
# (dnnl::set_max_cpu_isa, before any layer exists), so `bench --isa avx2` times an AVX2 layer; `best` caps nothing, and
# a cap the caller put in the environment (ONEDNN_MAX_CPU_ISA) is kept. The AMX case means something only on a CPU
# with AMX.
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402


def bench_row(r, isa, dtype="f32", env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    env.update(env_extra or {})
    cmd = [r.cli, "bench", "--preset", "gpt2-small", "--seq", "16", "--repeats", "1", "--threads", "1", "--json",
           "--isa", isa, "--dtype", dtype]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    check(p.returncode == 0, "%s exited %d: %s" % (" ".join(cmd), p.returncode, p.stderr.strip()))
    row = json.loads(p.stdout.strip().splitlines()[-1])
    gemm = re.search(r"onednn-matmul/([^;)]+)", row["implementation"])
    check(gemm is not None, "the implementation names oneDNN's kernel: %r" % row["implementation"])
    return row["isa"], gemm.group(1)


def best_level(r, dtype="f32"):
    return bench_row(r, "best", dtype)[0]


def avx2_caps_onednn(r):
    if best_level(r) == "scalar":
        return "skipped: no AVX2 here"
    isa, gemm = bench_row(r, "avx2")
    check(isa == "avx2", "the kernels run avx2, got %s" % isa)
    check("avx512" not in gemm and "amx" not in gemm, "oneDNN stays at or below AVX2, got %s" % gemm)
    return "oneDNN: " + gemm


def best_caps_nothing(r):
    best = best_level(r)
    if not best.startswith("avx512"):
        return "skipped: no AVX-512 here"
    isa, gemm = bench_row(r, "best")
    check("avx512" in gemm, "without a cap oneDNN takes AVX-512 on this CPU, got %s" % gemm)
    return "oneDNN: " + gemm


def bf16_level_keeps_amx_off(r):
    if best_level(r, "bf16") != "avx512_bf16":
        return "skipped: no AVX512-BF16 here"
    isa, gemm = bench_row(r, "avx512_bf16", dtype="bf16")
    check(isa == "avx512_bf16", "the kernels run avx512_bf16, got %s" % isa)
    check("amx" not in gemm, "oneDNN stays off AMX, got %s" % gemm)
    return "oneDNN: " + gemm


def avx512_caps_below_its_bf16_kernels(r):
    if best_level(r, "bf16") != "avx512_bf16":
        return "skipped: no AVX512-BF16 here"
    isa, gemm = bench_row(r, "avx512")
    check(isa == "avx512" and "avx512_core" in gemm, "f32 at --isa avx512 runs oneDNN's avx512_core, got %s" % gemm)
    isa, gemm = bench_row(r, "avx512", dtype="bf16")
    check("avx512_core_bf16" not in gemm and "amx" not in gemm,
          "--isa avx512 keeps oneDNN below its AVX512-BF16 kernels, got %s" % gemm)
    return "bf16 oneDNN: " + gemm


def callers_cap_is_kept(r):
    if not best_level(r).startswith("avx512"):
        return "skipped: no AVX-512 here"
    isa, gemm = bench_row(r, "avx512", env_extra={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    check(isa == "avx512", "the kernels run avx512, got %s" % isa)
    check("avx512" not in gemm, "the caller's ONEDNN_MAX_CPU_ISA=AVX2 holds, got %s" % gemm)
    return "oneDNN: " + gemm


def main():
    r = pc.Runner("gpt2attn --isa and oneDNN's cap")
    r.case("avx2_caps_onednn", lambda: avx2_caps_onednn(r))
    r.case("best_caps_nothing", lambda: best_caps_nothing(r))
    r.case("bf16_level_keeps_amx_off", lambda: bf16_level_keeps_amx_off(r))
    r.case("avx512_caps_below_its_bf16_kernels", lambda: avx512_caps_below_its_bf16_kernels(r))
    r.case("callers_cap_is_kept", lambda: callers_cap_is_kept(r))
    r.finish()


if __name__ == "__main__":
    main()
