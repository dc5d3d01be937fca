#!/usr/bin/env bash
# FP8 and FP4 training (--fp8-format / --fp8-recipe, --fp4-format / --fp4-recipe): a small MoE model trains 30
# iterations under every implemented recipe with a falling validation loss, --first-last-layers-bf16 runs, and an
# nvfp4 run repeats bit for bit. Delayed scaling (Megatron's default recipe, also with --fp8-amax-history-len /
# --fp8-amax-compute-algo max / --fp8-margin) trains, and a run saved at iteration 15 and resumed prints exactly the
# uninterrupted run's iterations 16-30 (the amax histories and scales are in the checkpoint). The routing-map padding
# (--moe-router-padding-for-quantization and its alias) trains; its and delayed scaling's invalid pairings are
# one-line errors.
# Widths are multiples of 32 so MXFP8's 1x32 and NVFP4's 16x16 blocks cover them.
set -euo pipefail
bin=$1
work=$3
rm -rf "$work" && mkdir -p "$work"
model=(--num-layers 3 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention
       --num-query-groups 2 --seq-length 64 --max-position-embeddings 64 --normalization RMSNorm --swiglu
       --disable-bias-linear --position-embedding-type rope --attention-dropout 0.0 --hidden-dropout 0.0
       --num-experts 4 --moe-ffn-hidden-size 64 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
       --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall --micro-batch-size 2
       --global-batch-size 4 --train-iters 30 --lr 3e-3 --lr-warmup-iters 3 --lr-decay-style cosine
       --log-interval 10 --eval-interval 30 --eval-iters 2 --mock-data --tokenizer-type NullTokenizer
       --vocab-size 256 --bf16)
failures=0
run() {
  local name=$1
  shift
  if ! "$bin" train "${model[@]}" "$@" > "$work/$name.log" 2>&1; then
    echo "FAIL: $name did not train:"; tail -3 "$work/$name.log"; failures=$((failures + 1)); return
  fi
  losses=$(grep -oE 'validation loss at iteration [0-9]+( on validation set)? \| lm loss value: [0-9.E+-]+' \
           "$work/$name.log" | grep -oE '[0-9.]+E[+-][0-9]+')
  first=$(head -1 <<<"$losses")
  last=$(tail -1 <<<"$losses")
  if /usr/bin/python3 -c "import sys; sys.exit(0 if float('$last') < float('$first') - 0.5 else 1)"; then
    echo "ok: $name validation loss $first -> $last"
  else
    echo "FAIL: $name validation loss did not fall: $first -> $last"; failures=$((failures + 1))
  fi
}
for recipe in tensorwise blockwise mxfp8; do run "fp8-$recipe" --fp8-format hybrid --fp8-recipe "$recipe"; done
run fp4-nvfp4 --fp4-format e2m1 --fp4-recipe nvfp4
run fp8-first-last-bf16 --fp8-format e4m3 --fp8-recipe mxfp8 --first-last-layers-bf16
# NVFP4's stochastic rounding is seeded from --seed and the gradients, not from call order: one thread repeats the
# run bit for bit.
OMP_NUM_THREADS=1 run fp4-nvfp4-one-thread --fp4-format e2m1 --fp4-recipe nvfp4
losses_of() { grep -oE 'lm loss: [0-9.E+-]+|grad norm: [0-9.]+' "$work/$1.log"; }
if [ "$(losses_of fp4-nvfp4)" != "$(losses_of fp4-nvfp4-one-thread)" ]; then
  echo "FAIL: the nvfp4 run did not repeat with one thread"; failures=$((failures + 1))
fi
# Delayed scaling: --fp8-format alone means Megatron's default recipe, delayed.
run fp8-delayed-default --fp8-format hybrid
delayed=(--fp8-format e4m3 --fp8-recipe delayed --fp8-amax-history-len 4 --fp8-amax-compute-algo max --fp8-margin 1
         --log-interval 1)
run fp8-delayed-history "${delayed[@]}"
# Resume: save at 15 and stop, resume to 30; the iteration lines 16-30 (without wall-clock fields) must match the
# uninterrupted run's.
lines() { grep -E "iteration +(1[6-9]|2[0-9]|30)/|validation loss at iteration 30" "$1" |
  sed -E 's/^ *\[[^]]*\] //; s/elapsed time per iteration \(ms\): [0-9.]+ \| //; s/ time left \(estimate\): [^|]+ \|//'; }
if "$bin" train "${model[@]}" "${delayed[@]}" --save "$work/delayed-ckpt" --save-interval 15 --exit-interval 15 \
     > "$work/delayed-part1.log" 2>&1 &&
   "$bin" train "${model[@]}" "${delayed[@]}" --load "$work/delayed-ckpt" > "$work/delayed-part2.log" 2>&1; then
  if [ "$(lines "$work/fp8-delayed-history.log" | wc -l)" -lt 16 ] ||
     [ "$(lines "$work/fp8-delayed-history.log")" != "$(lines "$work/delayed-part2.log")" ]; then
    diff <(lines "$work/fp8-delayed-history.log") <(lines "$work/delayed-part2.log") | head -5
    echo "FAIL: the resumed delayed-scaling run differs from the uninterrupted one"; failures=$((failures + 1))
  else
    echo "ok: the delayed-scaling run resumed at iteration 15 repeats iterations 16-30 bit for bit"
  fi
else
  echo "FAIL: the delayed-scaling save / resume runs failed"; tail -3 "$work"/delayed-*.log; failures=$((failures + 1))
fi
# Routing-map padding to the recipe's alignment (32 for mxfp8, 16 for delayed).
run fp8-mxfp8-router-padding --fp8-format hybrid --fp8-recipe mxfp8 --moe-router-padding-for-quantization
run fp8-delayed-router-padding --fp8-format hybrid --moe-router-padding-for-fp8
expect_error() {  # NAME REGEX ARGS...
  local name=$1 regex=$2
  shift 2
  if "$bin" train "${model[@]}" "$@" > "$work/$name.log" 2>&1; then
    echo "FAIL: $name was accepted"; failures=$((failures + 1))
  elif ! grep -qE -- "$regex" "$work/$name.log"; then
    echo "FAIL: $name: unexpected error"; tail -2 "$work/$name.log"; failures=$((failures + 1))
  else
    echo "ok: $name is refused"
  fi
}
expect_error delayed-first-last "delayed scaling does not support first / last layer in BF16" --fp8-format hybrid \
  --first-last-layers-bf16
expect_error margin-without-delayed "--fp8-margin sets delayed scaling" --fp8-format hybrid --fp8-recipe mxfp8 \
  --fp8-margin 1
expect_error padding-without-fp8 "--moe-router-padding-for-quantization needs --fp8-format or --fp4-format" \
  --moe-router-padding-for-quantization
expect_error padding-allgather "allgather dispatcher does not support --moe-router-padding-for-quantization" \
  --fp8-format hybrid --moe-router-padding-for-quantization --moe-token-dispatcher-type allgather
echo "$failures failed"
[ $failures -eq 0 ]
