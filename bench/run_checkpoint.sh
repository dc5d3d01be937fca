#!/usr/bin/env bash
# Checkpoint cost on the default demo model (configs/demo.args, mock data, 2 threads): save and load time (Megatron's
# "(min, max) time across ranks" lines), bytes written, and the wall time of a 16-iteration run with no save, a
# synchronous save after every iteration and --async-save after every iteration, side by side in one run (ROUNDS
# rounds; medians). (sync - none) / 16 is the cost of one save; (async - none) / 16 what async leaves of it.
# usage: bench/run_checkpoint.sh BUILD [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
rounds=${2:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
args=()
while read -r flag value; do
  case "$flag" in --train-iters | --log-interval | --eval-interval | --eval-iters | --split) continue ;; esac
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
args+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --train-iters 16 --log-interval 16
  --lr-warmup-iters 2 --eval-iters 0 --threads 2)
median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
declare -A step save load
for ((r = 0; r < rounds; ++r)); do
  for mode in none sync async; do
    rm -rf "$work/ck"
    extra=()
    case $mode in
      sync) extra=(--save "$work/ck" --save-interval 1) ;;
      async) extra=(--save "$work/ck" --save-interval 1 --async-save) ;;
    esac
    start=$(date +%s.%N)
    "$build/moecore" train "${args[@]}" "${extra[@]}" >"$work/log" 2>&1
    t=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.0f", (b - a) * 1000}')
    step[$mode]+="$t "
    if [ "$mode" = async ]; then
      save[async]+="$(grep 'save-checkpoint \.' "$work/log" | tail -1 | sed 's/.*(\([0-9.]*\), .*/\1/') "
    fi
    if [ "$mode" = sync ]; then
      save[sync]+="$(grep -A0 'save-checkpoint \.' "$work/log" | tail -1 | sed 's/.*(\([0-9.]*\), .*/\1/') "
      bytes=$(du -sb "$work/ck/iter_0000016" | cut -f1)
      "$build/moecore" train "${args[@]}" --load "$work/ck" --ckpt-step 15 --exit-interval 16 >"$work/load.log" 2>&1
      load[sync]+="$(grep 'load-checkpoint \.' "$work/load.log" | sed 's/.*(\([0-9.]*\), .*/\1/') "
    fi
    echo "round $r $mode: $t ms for the whole run"
  done
done
echo "checkpoint of iteration 16: $bytes bytes"
echo "save (sync, ms, median of the last save of each round): $(echo "${save[sync]}" | median)"
echo "save (async: the part the training loop waits for, ms, median): $(echo "${save[async]}" | median)"
echo "load (ms, median): $(echo "${load[sync]}" | median)"
for mode in none sync async; do
  echo "whole run (setup + 16 iterations) with $mode saves after every iteration (ms, median): $(echo "${step[$mode]}" | median)"
done
