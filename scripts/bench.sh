#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs `gpt2attn bench` over the GPT-2 presets
# (and gpt3-175b at a small T), with each case checked against the naive reference.
# Extra arguments go to `gpt2attn bench` (e.g. --seq 512 --threads 1 --json).
#
# scripts/bench.sh --plot [--peer] [--threads N]: the pictures instead. Measures prefill over the GPT-2 presets at
# T = 256 and 1024, decode of gpt2-small at T = 1024 (--cache cold) for B = 1, 4, 16, 64 and the f32, bf16 and int8
# caches, the FMA and bf16 peaks and the triad, in one run (with --peer also PyTorch, bench/peer_torch.py, several
# minutes), keeps the JSON lines under build/plots/ and draws them there with scripts/plot.py.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${GPT2ATTN_BUILD_DIR:-$root/build}
if [ "${1:-}" != --plot ]; then
  bash "$root/scripts/build.sh" gpt2attn_cli
  "$build/gpt2attn" bench "$@"
  exit
fi
shift
peer=0
threads=2
while [ $# -gt 0 ]; do
  case "$1" in
    --peer) peer=1 ;;
    --threads) threads=$2; shift ;;
    *) echo "bench.sh --plot: unknown argument '$1' (expected --peer, --threads N)" >&2; exit 2 ;;
  esac
  shift
done
bash "$root/scripts/build.sh" gpt2attn_cli fma_peak_cli stream_triad_cli
out=$build/plots
mkdir -p "$out"
"$build/bench/fma_peak_cli" --threads "$threads" >"$out/peak.jsonl"
"$build/bench/fma_peak_cli" --threads "$threads" --op bf16dot >>"$out/peak.jsonl" 2>/dev/null || true
"$build/bench/stream_triad_cli" --threads "$threads" >"$out/triad.jsonl"
presets=(--preset gpt2-small --preset gpt2-medium --preset gpt2-large --preset gpt2-xl)
: >"$out/bench.jsonl"
for t in 256 1024; do
  "$build/gpt2attn" bench "${presets[@]}" --seq "$t" --threads "$threads" --json >>"$out/bench.jsonl"
done
for kv in f32 bf16 int8; do
  for b in 1 4 16 64; do
    "$build/gpt2attn" bench --preset gpt2-small --mode decode --cache cold --seq 1024 --batch "$b" --kv-dtype "$kv" \
      --threads "$threads" --json >>"$out/bench.jsonl"
  done
done
peer_args=()
if [ "$peer" = 1 ]; then
  /usr/bin/python3 "$root/bench/peer_torch.py" --threads "$threads" --json >"$out/peer.jsonl"
  peer_args=(--peer "$out/peer.jsonl")
fi
"$root/scripts/plot.py" --out "$out" --bench "$out/bench.jsonl" --peak "$out/peak.jsonl" --triad "$out/triad.jsonl" \
  "${peer_args[@]}"
