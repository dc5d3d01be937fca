#!/usr/bin/env bash
# Step time at fixed active parameters while the number of experts grows: the demo model (configs/demo.args, top-2,
# expert ffn 256, mock data, 2 threads) with E = 8, 64 and 256 experts, one process; ms per iteration averaged over
# iterations 5-10 (after warm-up), each E run ROUNDS times alternating, medians.
# usage: bench/run_expert_scaling.sh BUILD [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
rounds=${2:-2}
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
args=()
while read -r flag value; do
  case "$flag" in --train-iters | --log-interval | --eval-interval | --eval-iters | --split | --num-experts) continue ;; esac
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
args+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --train-iters 10 --log-interval 5
  --lr-warmup-iters 1 --eval-iters 0 --threads 2)
declare -A times
for ((r = 0; r < rounds; ++r)); do
  for e in 8 64 256; do
    t=$("$build/moecore" train "${args[@]}" --num-experts $e 2>&1 |
      sed -n 's/.*iteration *10\/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p')
    echo "round $r E=$e: $t ms/iteration"
    times[$e]+="$t "
  done
done
for e in 8 64 256; do
  echo "E=$e median: $(echo "${times[$e]}" | tr ' ' '\n' | grep -v '^$' | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}') ms/iteration"
done
