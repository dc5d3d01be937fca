#!/usr/bin/env bash
# Multi-Token Prediction (--mtp-num-layers) end to end, on the mixtral-tiny-mtp recipe (smaller):
#   - the training log prints Megatron's "mtp_1 loss" and "mtp_2 loss" after the lm loss, and they fall;
#   - a run saved at iteration 4 and resumed prints iterations 5-8 as the uninterrupted run (mtp.layers.* saved and
#     loaded with their optimizer states), and `moecore checkpoint` verifies it against its recorded flags;
#   - the checkpoint resharded under mpirun TP2 x EP2 prints the one-process run's losses (to 1e-4);
#   - loading it without MTP, or with another depth count, is refused in one line naming --mtp-num-layers;
#   - Megatron's position-embedding check.
set -euo pipefail
source "$(dirname "$0")/lib/setup.sh" "$@"
stop() { fail "$@"; exit 1; }
mapfile -t mtp < <(recipe "$src" mixtral-tiny-mtp)
# --vocab-size 1023: with the NullTokenizer's EOD, 1024 rows padded alike under TP 1 and 2.
mtp+=(--num-layers 2 --seq-length 32 --max-position-embeddings 32 --train-iters 8 --log-interval 1 --eval-iters 0
  --lr-decay-style linear --vocab-size 1023)
lines() { grep -E "iteration +$2/" "$1" | sed -E 's/^ *\[[^]]*\] //; s/elapsed time per iteration \(ms\): [0-9.]+ \| //; s/ time left \(estimate\): [^|]+ \|//'; }
value() { lines "$1" "$2" | grep -oE "$3: [0-9.E+-]+" | grep -oE '[0-9.]+E[+-][0-9]+'; }

"$bin" train "${mtp[@]}" >"$work/full.log" 2>&1 || { tail "$work/full.log"; stop "MTP run"; }
lines "$work/full.log" 1 | grep -qE '\| lm loss: [0-9.E+-]+ \| load_balancing_loss: [0-9.E+-]+ \| mtp_1 loss: [0-9.E+-]+ \| mtp_2 loss: [0-9.E+-]+ \|' ||
  stop "no 'mtp_1 loss | mtp_2 loss' after the lm loss: $(lines "$work/full.log" 1)"
for k in 1 2; do
  first=$(value "$work/full.log" 1 "mtp_$k loss")
  last=$(value "$work/full.log" 8 "mtp_$k loss")
  /usr/bin/python3 -c "import sys; sys.exit(0 if $last < $first else 1)" || stop "mtp_$k loss did not fall: $first -> $last"
done
echo "ok: the log prints mtp_1 / mtp_2 loss after the lm loss, and they fall"

"$bin" train "${mtp[@]}" --save "$work/ckpt" --save-interval 4 --exit-interval 4 >"$work/a.log" 2>&1 || stop "save run"
"$bin" train "${mtp[@]}" --load "$work/ckpt" >"$work/b.log" 2>&1 || { tail "$work/b.log"; stop "resume"; }
for i in 5 6 7 8; do
  [ "$(lines "$work/full.log" $i)" = "$(lines "$work/b.log" $i)" ] ||
    { echo "full:    $(lines "$work/full.log" $i)"; echo "resumed: $(lines "$work/b.log" $i)"; stop "iteration $i differs"; }
done
echo "ok: resumed at 4, iterations 5-8 equal the uninterrupted run's"
"$bin" checkpoint "$work/ckpt" >"$work/verify.log" 2>&1 || { tail -3 "$work/verify.log"; stop "moecore checkpoint"; }
grep -q "^mtp.layers.1.mtp_model_layer.mlp.router.weight " "$work/verify.log" || stop "no MTP tensors in the checkpoint"
echo "ok: the checkpoint holds mtp.layers.* and passes moecore checkpoint (the state its recorded flags imply)"

if command -v mpirun >/dev/null; then
  mpirun --allow-run-as-root --oversubscribe -np 4 -x OMP_NUM_THREADS=1 "$bin" train "${mtp[@]}" --load "$work/ckpt" \
    --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 >"$work/c.log" 2>&1 ||
    { tail "$work/c.log"; stop "TP2 x EP2 resume"; }
  for i in 5 8; do
    for key in "lm loss" "mtp_1 loss" "mtp_2 loss"; do
      a=$(value "$work/full.log" $i "$key")
      b=$(value "$work/c.log" $i "$key")
      /usr/bin/python3 -c "import sys; sys.exit(0 if abs($a - $b) <= 1e-4 * abs($a) else 1)" ||
        stop "TP2 x EP2 resume: iteration $i $key $b, one process $a"
    done
  done
  echo "ok: the checkpoint resharded to TP2 x EP2 gives the one-process lm and MTP losses"
fi

no_mtp=()
for ((i = 0; i < ${#mtp[@]}; i++)); do
  case "${mtp[$i]}" in --mtp-num-layers | --mtp-loss-scaling-factor) i=$((i + 1)) ;; *) no_mtp+=("${mtp[$i]}") ;; esac
done
expect_error "was saved with --mtp-num-layers 2, this run has none" \
  "$bin" train "${no_mtp[@]}" --load "$work/ckpt"
expect_error "was saved with --mtp-num-layers 2, this run has 1" "$bin" train "${mtp[@]}" --mtp-num-layers 1 \
  --load "$work/ckpt"
expect_early_error "error: Multi-Token Prediction (MTP) is not supported with learned_absolute position embedding type." \
  "$bin" train "${mtp[@]}" --position-embedding-type learned_absolute
echo "$failures failed"
[ "$failures" -eq 0 ]
