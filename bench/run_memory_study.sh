#!/usr/bin/env bash
# The memory techniques of the report's memory chapter on moecore itself: a config trains a few iterations in one
# process (one rank per core, as `moecore plan --gpu cpu` models) without them and with each option, and the table
# gives the activation and total peak of the training log's memory line, `moecore plan --gpu cpu`'s prediction of
# both, what a rank keeps between steps, and the step time next to the baseline's (the recompute cost); then the
# same over two data-parallel ranks for Megatron-FSDP's strategies and the whole stack. Usage:
#   bench/run_memory_study.sh [BUILD_DIR] [CONFIG] [ITERS]   (defaults: build, deepseek-v3-tiny, 6)
# Prints a markdown table; run it alone (other load skews the step times).
set -u
cd "$(dirname "$0")/.."
src=$PWD
bin=${1:-build}/moecore
config=${2:-deepseek-v3-tiny}
iters=${3:-6}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpirun=$(command -v mpirun || true)
source "$src/tests/e2e/lib/plan_runs.sh"

mapfile -t train_flags < <(config_flags_without "$config" --train-iters --log-interval --eval-interval --eval-iters \
  --lr-warmup-iters --split)
mapfile -t model_flags < <(plan_flags "$config")
# Mock data; a config trained on a corpus (the demo) gets GPT-2's vocabulary size with the null tokenizer.
train_flags+=(--mock-data)
if ! grep -q -- '--tokenizer-type' "$src/configs/$config.args"; then
  train_flags+=(--tokenizer-type NullTokenizer --vocab-size 50256)
  model_flags+=(--tokenizer-type NullTokenizer --vocab-size 50256)
fi
moe=$(grep -c -- '--num-experts' "$src/configs/$config.args")
mla=$(grep -c -- '--multi-latent-attention' "$src/configs/$config.args")
shared=$(grep -c -- '--moe-shared-expert-intermediate-size' "$src/configs/$config.args")

sel() { echo "--recompute-granularity selective --recompute-modules $*"; }
options=("baseline|" "core_attn|$(sel core_attn)" "layernorm|$(sel layernorm)" "mlp|$(sel mlp)")
[ "$moe" -gt 0 ] && options+=("no memory-efficient permutation|--no-moe-memory-efficient-permutation"
  "moe_act|$(sel moe_act)" "moe|$(sel moe)")
[ "$shared" -gt 0 ] && options+=("shared_experts|$(sel shared_experts)")
[ "$mla" -gt 0 ] && options+=("mla_up_proj|$(sel mla_up_proj)")
# moecore's MTP depths do not run under FP8 / FP4: those rows train the config without them.
no_mtp=$(grep -q -- '--mtp-num-layers' "$src/configs/$config.args" && echo "--mtp-num-layers 0")
fine="core_attn layernorm mlp"
[ "$moe" -gt 0 ] && fine+=" moe_act"
[ "$mla" -gt 0 ] && fine+=" mla_up_proj"
options+=("bf16 (16-bit activations)|--bf16")
[ -n "$no_mtp" ] && options+=("bf16 without MTP (the FP8 / FP4 rows' reference)|--bf16 $no_mtp")
options+=(
  "bf16 + FP8 hybrid, delayed scaling|--bf16 --fp8-format hybrid --fp8-recipe delayed $no_mtp"
  "bf16 + FP8 hybrid, tensorwise|--bf16 --fp8-format hybrid --fp8-recipe tensorwise $no_mtp"
  "bf16 + NVFP4|--bf16 --fp4-format e2m1 --fp4-recipe nvfp4 $no_mtp" "selective: $fine|$(sel $fine)"
  "full, uniform 1|--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
  "full, block 1|--recompute-granularity full --recompute-method block --recompute-num-layers 1")

# study NP: one table row per entry of `options` on NP ranks (the planned columns for options the planner models).
study() {
  local np=$1 entry name log act total state ms p_act p_total ratio base_ms=""
  for entry in "${options[@]}"; do
    name=${entry%%|*}
    read -r -a extra <<<"${entry#*|}"
    log="$work/run.log"
    if ! train_on "$np" "$log" "${train_flags[@]}" --train-iters "$iters" --log-interval "$iters" --lr-warmup-iters 1 \
      --eval-interval 100000 --eval-iters 0 "${extra[@]}"; then
      echo "| $name | train failed: $(grep -m1 error "$log") | | | |"
      continue
    fi
    read -r act total state < <(grep 'memory (MB' "$log" | tail -1 | python3 -c '
import re, sys
line = sys.stdin.read()
act = re.search(r"activations: [0-9.]+ \(peak ([0-9.]+)\)", line).group(1)
total = re.search(r"total peak: ([0-9.]+)", line).group(1)
kept = sum(float(re.search(k + r": ([0-9.]+)", line).group(1)) for k in ("params", "grads", "optimizer"))
print(act, total, round(kept, 1))')
    ms=$(grep 'elapsed time per iteration' "$log" | tail -1 | sed 's/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/')
    if read -r p_act p_total < <(timeout 120 "$bin" plan "${model_flags[@]}" "${extra[@]}" --num-gpus "$np" --gpu cpu \
      --json 2>/dev/null | python3 -c '
import json, sys
m = json.load(sys.stdin)["memory_mib"]
print(round(m["activations"], 1), round(m["total"], 1))' 2>/dev/null); then :; else p_act="-" p_total="-"; fi
    [ -z "$base_ms" ] && base_ms=$ms
    ratio=$(python3 -c "print(f'{$ms / $base_ms:.2f}')")
    echo "| $name | $act ($p_act) | $total ($p_total) | $state | $ms (x$ratio) |"
  done
}

echo "One process ($config, $iters iterations; planned: moecore plan --gpu cpu):"
echo
echo "| option | activations peak, MiB (planned) | total peak, MiB (planned) | params + grads + optimizer, MiB | ms / iteration (vs baseline) |"
echo "| --- | --- | --- | --- | --- |"
study 1
[ -n "$mpirun" ] || exit 0
# Data parallelism over 2 ranks: Megatron-FSDP's strategies, and the whole stack (ZeRO-3 + recomputation).
options=("DP2, replicated optimizer|" "DP2, distributed optimizer|--use-distributed-optimizer"
  "DP2, FSDP optim|--use-megatron-fsdp --data-parallel-sharding-strategy optim"
  "DP2, FSDP optim_grads|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads"
  "DP2, FSDP optim_grads_params|--use-megatron-fsdp"
  "DP2, FSDP optim_grads_params + selective $fine|--use-megatron-fsdp $(sel $fine)"
  "DP2, FSDP optim_grads_params + full recompute|--use-megatron-fsdp --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
  "DP2, the stack: FSDP optim_grads_params + selective $fine + bf16|--use-megatron-fsdp $(sel $fine) --bf16")
echo
echo "Two ranks (params + grads + optimizer: what a rank keeps between steps):"
echo
echo "| option | activations peak, MiB (planned) | total peak, MiB (planned) | params + grads + optimizer, MiB | ms / iteration (vs baseline) |"
echo "| --- | --- | --- | --- | --- |"
study 2
