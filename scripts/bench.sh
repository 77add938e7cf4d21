#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs `gpt2attn bench` over the GPT-2 presets
# (and gpt3-175b at a small T), with each case checked against the naive reference.
# Extra arguments go to `gpt2attn bench` (e.g. --seq 512 --threads 1 --json).
#
# scripts/bench.sh --plot [--peer] [--threads N] [--quick] [--no-build] [--out DIR]: the pictures instead. Measures
# prefill over the GPT-2 presets at T = 256 and 1024, decode of gpt2-small at T = 1024 (--cache cold) for B = 1, 4,
# 16, 64, each in f32 and bf16 compute and decode with the f32, bf16 and int8 caches, the FMA and bf16 peaks and the
# triad, in one run (with --peer also PyTorch, bench/peer_torch.py, several minutes), keeps the JSON lines in DIR
# (default build/plots/) and draws them there with scripts/plot.py. --quick runs the same commands on cases small
# enough for a test (tests/python/test_plot.py) and --no-build takes the binaries already built.
#
# scripts/bench.sh --peers [--quick] [--threads N] [--rounds R] [--decode-rounds R] [--mode prefill|decode]
# [--no-build]: ours against PyTorch 2, ONNX Runtime, OpenVINO and llama.cpp at their best (bench/peers/run.py),
# interleaved in one run. Needs PyPI: makes the venv build/peers-venv (python3 -m venv) with the pinned
# bench/peers/requirements.txt (pip install --no-deps, see that file for why), builds our CLI and the roof probes,
# runs the driver, keeps its JSON lines and table in build/peers/ and draws the speedups and the roofline there
# (scripts/plot.py --peers). The full run takes about 40 minutes on 2 cores, --quick a minute; making the venv about
# half an hour (pip builds llama-cpp-python from source).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${GPT2ATTN_BUILD_DIR:-$root/build}
if [ "${1:-}" = --peers ]; then
  shift
  build_first=1
  args=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --quick) args+=(--quick) ;;
      --threads|--rounds|--decode-rounds|--mode) args+=("$1" "$2"); shift ;;
      --no-build) build_first=0 ;;
      *) echo "bench.sh --peers: unknown argument '$1' (expected --quick, --threads N, --rounds R," \
              "--decode-rounds R, --mode prefill|decode, --no-build)" >&2
         exit 2 ;;
    esac
    shift
  done
  venv=$build/peers-venv
  req=$root/bench/peers/requirements.txt
  # The venv is made once and remade only when the pins change (a copy of the installed file is kept in it).
  if ! cmp -s "$req" "$venv/requirements.installed"; then
    rm -rf "$venv"
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --no-deps -r "$req"
    cp "$req" "$venv/requirements.installed"
  fi
  if [ "$build_first" = 1 ]; then
    bash "$root/scripts/build.sh" gpt2attn_cli stream_triad_cli fma_peak_cli
  fi
  out=$build/peers
  /usr/bin/python3 "$root/bench/peers/run.py" --cli "$build/gpt2attn" --python "$venv/bin/python" --out "$out" \
    "${args[@]}"
  "$root/scripts/plot.py" --out "$out" --peers "$out/peers.jsonl"
  exit
fi
if [ "${1:-}" != --plot ]; then
  bash "$root/scripts/build.sh" gpt2attn_cli
  "$build/gpt2attn" bench "$@"
  exit
fi
shift
peer=0
threads=2
build_first=1
out=$build/plots
seqs=(--seq 256 --seq 1024)
decode_seq=1024
batches=(1 4 16 64)
repeats=()
peer_size=()
while [ $# -gt 0 ]; do
  case "$1" in
    --peer) peer=1 ;;
    --threads) threads=$2; shift ;;
    --quick) seqs=(--seq 32 --seq 64); decode_seq=64; batches=(1 4); repeats=(--repeats 2)
             peer_size=(--preset gpt2-small --seq 64 --repeats 2 --allocator default) ;;
    --no-build) build_first=0 ;;
    --out) out=$2; shift ;;
    *) echo "bench.sh --plot: unknown argument '$1' (expected --peer, --threads N, --quick, --no-build, --out DIR)" >&2
       exit 2 ;;
  esac
  shift
done
if [ "$build_first" = 1 ]; then
  bash "$root/scripts/build.sh" gpt2attn_cli fma_peak_cli stream_triad_cli
fi
mkdir -p "$out"
"$build/bench/fma_peak_cli" --threads "$threads" >"$out/peak.jsonl"
"$build/bench/fma_peak_cli" --threads "$threads" --op bf16dot >>"$out/peak.jsonl" 2>/dev/null || true
"$build/bench/stream_triad_cli" --threads "$threads" >"$out/triad.jsonl"
"$build/gpt2attn" bench --preset gpt2-small --preset gpt2-medium --preset gpt2-large --preset gpt2-xl "${seqs[@]}" \
  --dtype f32 --dtype bf16 --threads "$threads" "${repeats[@]}" --json >"$out/bench.jsonl"
for b in "${batches[@]}"; do
  "$build/gpt2attn" bench --preset gpt2-small --mode decode --cache cold --seq "$decode_seq" --batch "$b" \
    --dtype f32 --dtype bf16 --kv-dtype f32 --kv-dtype bf16 --kv-dtype int8 --threads "$threads" "${repeats[@]}" \
    --json >>"$out/bench.jsonl"
done
peer_args=()
if [ "$peer" = 1 ]; then
  /usr/bin/python3 "$root/bench/peer_torch.py" --cli "$build/gpt2attn" --peak-cli "$build/bench/fma_peak_cli" \
    --threads "$threads" "${peer_size[@]}" --json >"$out/peer.jsonl"
  peer_args=(--peer "$out/peer.jsonl")
fi
"$root/scripts/plot.py" --out "$out" --bench "$out/bench.jsonl" --peak "$out/peak.jsonl" --triad "$out/triad.jsonl" \
  "${peer_args[@]}"
