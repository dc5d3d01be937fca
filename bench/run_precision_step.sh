#!/usr/bin/env bash
# Training-step time of the default demo model (configs/demo.args on mock data, as bench/run_demo_step.sh) in fp32
# and under --bf16 / --fp16 with each path of the 16-bit GEMMs (kernels/cpu/gemm_lowp.h, forced with
# MOECORE_LOWP_GEMM): "convert" (the fp32 GEMM on the 16-bit values) and "native" (oneDNN's bf16 / fp16 matmul on
# the CPU's dot-product instructions; skipped where this oneDNN has none). The variants alternate, ROUNDS times
# each; prints ms per iteration of iterations 9-16 and the median per variant.
# usage: bench/run_precision_step.sh BUILD [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
rounds=${2:-3}
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
source bench/demo_step_args.sh
# label|MOECORE_LOWP_GEMM|flags
variants=("fp32|convert|" "bf16 convert|convert|--bf16" "bf16 native|native|--bf16" "fp16 convert|convert|--fp16"
  "fp16 native|native|--fp16")
run() {
  local path=$1
  shift
  MOECORE_LOWP_GEMM=$path "$build/moecore" train "${args[@]}" "$@" 2>&1 |
    sed -n 's/.*iteration *16\/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p'
}
declare -A times
for ((r = 0; r < rounds; ++r)); do
  for v in "${variants[@]}"; do
    IFS='|' read -r label path flags <<<"$v"
    # shellcheck disable=SC2086
    t=$(run "$path" $flags || true)
    if [ -z "$t" ]; then
      echo "$label: not available here"
      continue
    fi
    echo "$label round $r: $t ms/iteration"
    times[$label]+="$t "
  done
done
for v in "${variants[@]}"; do
  label=${v%%|*}
  [ -n "${times[$label]:-}" ] || continue
  median=$(echo "${times[$label]}" | tr ' ' '\n' | grep -v '^$' | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}')
  echo "$label median: $median ms/iteration ($(awk -v m="$median" 'BEGIN {printf "%.0f", 2048000 / m}') tokens/s)"
done
