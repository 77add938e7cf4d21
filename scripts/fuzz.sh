#!/usr/bin/env bash
# Runs the libFuzzer targets of the file parsers (tests/fuzz: safetensors, npy, config, layer, quantized) for SECONDS
# each (default 60): installs what is missing, configures and builds build-fuzz/ with the `fuzz` preset (clang-14,
# ASan + UBSan), then fuzzes each target from a temporary copy of its seed corpus (tests/fuzz/corpus/<target>/ stays
# as it is) with its dictionary, inputs up to 64 KiB. Prints executions per second and total runs per target; exits
# non-zero when any target finds a crash, leak, timeout or sanitizer report, printing the end of its log and the path
# of the input that did it (build-fuzz/fuzz-artifacts/<target>/). Keep such an input under
# tests/fuzz/regressions/<target>/ once it is fixed: the normal suite runs every file there.
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
seconds=${1:-60}
shift $(($# > 0 ? 1 : 0))
targets=("$@")
((${#targets[@]})) || targets=(safetensors npy config layer quantized)
[[ $seconds =~ ^[0-9]+$ ]] && ((seconds > 0)) || { echo "fuzz.sh: SECONDS must be a positive integer" >&2; exit 2; }

bash scripts/install-deps.sh
cmake --preset fuzz -DGPT2ATTN_WERROR="${GPT2ATTN_WERROR:-OFF}" >/dev/null  # CI sets it: no new warnings
cmake --build --preset fuzz -j"$(nproc)"

build=$root/build-fuzz
work=$(mktemp -d "${TMPDIR:-/tmp}/gpt2attn-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
failed=()
summary=()
for t in "${targets[@]}"; do
  bin=$build/tests/fuzz/fuzz_$t
  [ -x "$bin" ] || { echo "fuzz.sh: no target '$t' (known: safetensors npy config layer quantized)" >&2; exit 2; }
  dict=tests/fuzz/$t.dict
  [ "$t" = layer ] && dict=tests/fuzz/safetensors.dict  # the layer target reads safetensors files too
  corpus=$work/$t
  artifacts=$build/fuzz-artifacts/$t
  log=$build/fuzz-logs/$t.log
  rm -rf "$artifacts"  # only this run's findings
  mkdir -p "$corpus" "$artifacts" "$(dirname "$log")"
  cp tests/fuzz/corpus/"$t"/* "$corpus"/
  echo "fuzz.sh: $t for ${seconds}s (log: $log)"
  # -timeout: one input running 10 s is a hang. -rss_limit_mb (and with it the single-malloc limit): an input of
  # 64 KiB that makes a parser allocate 2 GB is a finding, not a machine to bring down.
  rc=0
  "$bin" -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -dict="$dict" -artifact_prefix="$artifacts/" "$corpus" >"$log" 2>&1 || rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  line=$(printf '%-12s %10s runs %8s exec/s  corpus %d -> %d files' "$t" "${runs:-?}" "${rate:-?}" \
    "$(ls tests/fuzz/corpus/"$t" | wc -l)" "$(ls "$corpus" | wc -l)")
  if ((rc != 0)); then
    tail -n 60 "$log"
    crash=$(grep -o 'Test unit written to .*' "$log" | sed 's/^Test unit written to //' | tail -1)
    echo "fuzz.sh: $t FAILED (exit $rc); input: ${crash:-see $log}" >&2
    failed+=("$t")
    line+="  FAILED: ${crash:-see $log}"
  fi
  summary+=("$line")
done
echo "fuzz.sh: ${seconds}s per target"
printf '  %s\n' "${summary[@]}"
if ((${#failed[@]})); then
  echo "fuzz.sh: findings in: ${failed[*]}" >&2
  exit 1
fi
