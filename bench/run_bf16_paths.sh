#!/usr/bin/env bash
# The --bf16 step against the fp32 step on this CPU, and on the path a CPU without bf16 dot products takes: the MoE
# models of bench/run_moe_step.sh (e16, demo) in three variants per round, their order rotating between rounds:
#   fp32;
#   bf16: --bf16 on this CPU's own path (the log's second line names it: oneDNN's bf16 matmul and bf16 attention
#         products with AMX or a fast AVX512-BF16 dot product, else the convert path);
#   bf16-convert: --bf16 with MOECORE_LOWP_GEMM=convert MOECORE_ATTENTION_PRODUCTS=fp32, the path of a CPU whose
#         bf16 dot product does not outpace its fp32 FMAs (Intel without AMX, AVX2-only CPUs), emulated here.
# Each process times STEPS steps after 1 warm-up step; reported: median and minimum over all timed steps of all
# rounds, and each variant's median over fp32's.
# usage: bench/run_bf16_paths.sh BUILD [ROUNDS] [STEPS]   (defaults: 3 rounds x 3 steps)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: bench/run_bf16_paths.sh BUILD [ROUNDS] [STEPS]}
rounds=${2:-3}
steps=${3:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# shellcheck source=bench/machine_info.sh
source bench/machine_info.sh
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $cpu, ISA:${isa:- no avx2}, 2 threads, $rounds rounds x $steps steps"
echo "# $build/moecore"

run_flags=(--mock-data --tokenizer-type NullTokenizer --eval-iters 0 --lr-warmup-iters 1 --threads 2)
# shellcheck source=bench/moe_step_models.sh
source bench/moe_step_models.sh
# shellcheck source=bench/step_stats.sh
source bench/step_stats.sh

run() {  # VARIANT MODEL FLAGS...: appends "MODEL VARIANT ms" lines
  local variant=$1 model=$2 log=$work/run.log
  shift 2
  local env=(OMP_NUM_THREADS=2)
  case $variant in
    bf16) set -- "$@" --bf16 ;;
    bf16-convert)
      set -- "$@" --bf16
      env+=(MOECORE_LOWP_GEMM=convert MOECORE_ATTENTION_PRODUCTS=fp32)
      ;;
  esac
  env "${env[@]}" "$build/moecore" train "$@" --train-iters $((steps + 1)) --log-interval 1 >"$log" 2>&1 || {
    echo "run_bf16_paths: $variant failed on $model" >&2
    tail -20 "$log" >&2
    exit 1
  }
  if [ "$variant" = bf16 ] && [ ! -e "$work/path.$model" ]; then sed -n '2p' "$log" >"$work/path.$model"; fi
  grep 'iteration *[0-9]*/' "$log" | tail -n +2 |
    sed -n "s/.*elapsed time per iteration (ms): \([0-9.]*\).*/$model $variant \1/p" >>"$work/ms"
}

variants=(fp32 bf16 bf16-convert)
for round in $(seq 1 "$rounds"); do
  for model in e16 demo; do
    declare -n flags=$model
    for i in 0 1 2; do run "${variants[$(((i + round - 1) % 3))]}" "$model" "${flags[@]}"; done
    unset -n flags
  done
done

echo "# bf16 on this CPU:$(cut -c2- "$work/path.e16")"
echo
echo "| model | fp32 median (ms) | bf16 median (ms) | bf16-convert median (ms) | bf16 / fp32 | bf16-convert / fp32 | minima (fp32, bf16, bf16-convert) |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for model in e16 demo; do
  read -r f_med f_min <<<"$(step_stats "$work/ms" "$model" fp32)"
  read -r b_med b_min <<<"$(step_stats "$work/ms" "$model" bf16)"
  read -r c_med c_min <<<"$(step_stats "$work/ms" "$model" bf16-convert)"
  ratio() { awk -v a="$1" -v b="$f_med" 'BEGIN {printf "%.3f", a / b}'; }
  echo "| $model | $f_med | $b_med | $c_med | $(ratio "$b_med") | $(ratio "$c_med") | $f_min, $b_min, $c_min |"
done
