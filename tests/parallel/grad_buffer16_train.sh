#!/usr/bin/env bash
# One bf16 gradient buffer for both Megatron spellings (DP2, distributed optimizer, the precision-aware optimizer):
# configs/mixtral-tiny.args with two micro-batches per rank trained 2 iterations with --grad-reduce-in-bf16 and with
# --main-grads-dtype bf16 saves bit-identical rank files (parameters, moments, main-parameter remainders): in Megatron
# both set grad_reduce_in_fp32=False, one bf16 buffer that accumulates the micro-batches, is scaled by 1/DP and
# reduce-scattered in bf16. (Without --use-precision-aware-optimizer, --grad-reduce-in-bf16 reduces the same bf16
# gradients, but the optimizer differs as Megatron's does: its fp32 main parameters start from the fp32
# initialisation, where TE's remainders start from the bf16 weights, and it clips and unscales fp32 copies of the
# gradients, where TE reads the bf16 buffer in place.)
set -euo pipefail
bin=$1
mpirun=$2
src=$3
work=$4
rm -rf "$work" && mkdir -p "$work"
export OMP_NUM_THREADS=1
recipe=()
while read -r flag value; do
  recipe+=("$flag")
  if [ -n "$value" ]; then recipe+=("$value"); fi
done < <(grep -v '^#' "$src/configs/mixtral-tiny.args" | grep -v '^\s*$')
common=(--global-batch-size 16 --train-iters 2 --lr-warmup-iters 1 --log-interval 1 --eval-iters 0 --bf16 --use-distributed-optimizer
  --use-precision-aware-optimizer --save-interval 2)

run() {  # run NAME FLAGS...
  local name=$1
  shift
  if ! "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" train "${recipe[@]}" "${common[@]}" \
      --save "$work/$name" "$@" > "$work/$name.log" 2>&1; then
    echo "FAIL: $name did not train:"; tail -5 "$work/$name.log"; exit 1
  fi
}
run grad_reduce_bf16 --grad-reduce-in-bf16
run main_grads_bf16 --main-grads-dtype bf16
failures=0
for rank in rank_00000 rank_00001; do
  a="$work/grad_reduce_bf16/iter_0000002/$rank.safetensors"
  b="$work/main_grads_bf16/iter_0000002/$rank.safetensors"
  if cmp -s "$a" "$b"; then
    echo "ok: $rank: --grad-reduce-in-bf16 and --main-grads-dtype bf16 saved the same state after 2 steps"
  else
    echo "FAIL: $rank: the states after 2 steps differ"; failures=$((failures + 1))
  fi
done
[ $failures -eq 0 ]
