#!/usr/bin/env bash
# The training step of two moecore builds side by side in one run: a change's "before" and "after" binaries on the
# MoE models of bench/run_moe_step.sh (e16: 4 layers, hidden 512, 16 experts top-2, seq 512, batch 4, alltoall,
# grouped GEMM; demo: configs/demo.args on mock data). Per round, each model runs once per binary, the binaries'
# order alternating between rounds; each process times STEPS steps after 1 warm-up step (`elapsed time per
# iteration` at --log-interval 1). Reported: the median and the minimum over all timed steps of all rounds (the
# machine is shared: load from elsewhere hits single steps), and after / before of each.
# Flags after STEPS go to every run (e.g. --bf16).
# usage: bench/run_step_ab.sh BEFORE_BINARY AFTER_BINARY [ROUNDS] [STEPS] [FLAGS...]   (defaults: 3 rounds x 3 steps)
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:?usage: bench/run_step_ab.sh BEFORE_BINARY AFTER_BINARY [ROUNDS] [STEPS]}
after=${2:?usage: bench/run_step_ab.sh BEFORE_BINARY AFTER_BINARY [ROUNDS] [STEPS]}
rounds=${3:-3}
steps=${4:-3}
extra=("${@:5}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# shellcheck source=bench/machine_info.sh
source bench/machine_info.sh
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $cpu, ISA:${isa:- no avx2}, 2 threads, $rounds rounds x $steps steps"
echo "# before: $before"
echo "# after:  $after"
[ ${#extra[@]} -eq 0 ] || echo "# flags:  ${extra[*]}"

run_flags=(--mock-data --tokenizer-type NullTokenizer --eval-iters 0 --lr-warmup-iters 1 --threads 2 "${extra[@]}")
# shellcheck source=bench/moe_step_models.sh
source bench/moe_step_models.sh
# shellcheck source=bench/step_stats.sh
source bench/step_stats.sh

run() {  # SIDE BINARY MODEL FLAGS...: appends "MODEL SIDE ms" lines
  local side=$1 binary=$2 model=$3 log=$work/run.log
  shift 3
  OMP_NUM_THREADS=2 "$binary" train "$@" --train-iters $((steps + 1)) --log-interval 1 >"$log" 2>&1 || {
    echo "run_step_ab: $side failed on $model" >&2
    tail -20 "$log" >&2
    exit 1
  }
  grep 'iteration *[0-9]*/' "$log" | tail -n +2 |
    sed -n "s/.*elapsed time per iteration (ms): \([0-9.]*\).*/$model $side \1/p" >>"$work/ms"
}

for round in $(seq 1 "$rounds"); do
  for model in e16 demo; do
    declare -n flags=$model
    if [ $((round % 2)) -eq 1 ]; then
      run before "$before" "$model" "${flags[@]}"
      run after "$after" "$model" "${flags[@]}"
    else
      run after "$after" "$model" "${flags[@]}"
      run before "$before" "$model" "${flags[@]}"
    fi
    unset -n flags
  done
done

echo
echo "| model | before median (ms) | after median (ms) | after / before | before min | after min |"
echo "| --- | --- | --- | --- | --- | --- |"
for model in e16 demo; do
  read -r b_med b_min <<<"$(step_stats "$work/ms" "$model" before)"
  read -r a_med a_min <<<"$(step_stats "$work/ms" "$model" after)"
  echo "| $model | $b_med | $a_med | $(awk -v a="$a_med" -v b="$b_med" 'BEGIN {printf "%.3f", a / b}') | $b_min | $a_min |"
done
