#!/usr/bin/env bash
# Training-step time of the default demo model (configs/demo.args: the MoE model `make demo` trains) for two builds
# side by side in one run: `moecore train` on mock data (same model, same step as the demo), the binaries
# alternating, ROUNDS times each. Prints each run's ms per iteration of the last log interval (iterations 9-16, after
# warm-up) and the median per build.
# usage: bench/run_demo_step.sh BUILD_A BUILD_B [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
a=$1
b=$2
rounds=${3:-3}
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
source bench/demo_step_args.sh
run() {
  "$1/moecore" train "${args[@]}" 2>&1 | sed -n 's/.*iteration *16\/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p'
}
declare -A times
for ((r = 0; r < rounds; ++r)); do
  for build in "$a" "$b"; do
    t=$(run "$build")
    echo "$build round $r: $t ms/iteration"
    times[$build]+="$t "
  done
done
for build in "$a" "$b"; do
  median=$(echo "${times[$build]}" | tr ' ' '\n' | grep -v '^$' | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}')
  echo "$build median: $median ms/iteration ($(awk -v m="$median" 'BEGIN {printf "%.0f", 2048000 / m}') tokens/s)"
done
