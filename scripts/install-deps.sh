#!/usr/bin/env bash
# Installs the Debian 12 packages gpt2attn builds and tests with; idempotent, installs only what is missing.
set -euo pipefail
# ocl-icd-opencl-dev/opencl-c-headers: Debian's dnnl-config.cmake find_package()s OpenCL (its GPU runtime).
# libjemalloc2: bench/peer_torch.py preloads it to run PyTorch as a tuned user does (page-keeping allocator).
# clang-14, libclang-rt-14-dev (its sanitizer and libFuzzer runtimes, which apt only recommends),
# libfuzzer-14-dev: the `fuzz` preset (scripts/fuzz.sh).
# libopenmpi-dev, openmpi-bin: the tensor-parallel module (gpt2attn_mpi), `mpirun -np N gpt2attn` and its tests.
# pkgconf: pkg-config, with which the consumer.pkg_config test builds programs against the installed gpt2attn.pc.
# libcpp-httplib-dev: `gpt2attn serve`'s HTTP server; python3-aiohttp: its test's concurrent clients
# (tests/python/test_serve.py) and bench/load_gen.py.
# python3-venv: the venvs of the pip install . test and the Hugging Face transformers test (pip fetches into them);
# ninja-build: the generator scikit-build-core builds that wheel with (without it, pip fetches ninja).
pkgs=(g++ cmake make libdnnl-dev libxsimd-dev libgtest-dev libbenchmark-dev nlohmann-json3-dev
      ocl-icd-opencl-dev opencl-c-headers
      python3 python3-numpy python3-torch libopenblas0-pthread
      python3-dev python3-pybind11 python3-pytest python3-matplotlib
      libjemalloc2
      clang-14 libclang-rt-14-dev libfuzzer-14-dev
      pkgconf python3-venv ninja-build
      libopenmpi-dev openmpi-bin
      libcpp-httplib-dev python3-aiohttp)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
