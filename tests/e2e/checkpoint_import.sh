#!/usr/bin/env bash
# Starting from other checkpoints with `moecore train --load`:
#   - a HuggingFace folder (llama-style dense, and a Mixtral-style MoE exported by moecore) loads under another layout
#     (TP2, EP2, Megatron-FSDP DP2) and gives the exporting run's validation loss exactly (same padded vocabulary);
#   - a model flag that disagrees with config.json is a one-line error naming the field;
#   - --moe-use-upcycling from a dense moecore checkpoint and from a dense HF folder: the upcycled MoE model's
#     validation loss before training equals the dense model's, it saves iteration 1 and trains on.
set -euo pipefail
source "$(dirname "$0")/lib/setup.sh" "$@"
mapfile -t dense < <(recipe "$src" tiny-dense)
dense+=(--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-warmup-iters 2 --log-interval 1 --eval-iters 2
  --mock-data --tokenizer-type NullTokenizer --vocab-size 300 --seed 3 --swiglu --normalization RMSNorm
  --attention-dropout 0 --hidden-dropout 0 --position-embedding-type rope --disable-bias-linear
  --make-vocab-size-divisible-by 256)
moe=(--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01)
fail() { echo "FAIL: $*"; exit 1; }
final_valid() { grep "validation loss at iteration .* on validation set" "$1" | tail -1 | sed -E 's/.*lm loss value: ([0-9.E+-]+).*/\1/'; }
before_valid() { grep -A2 "validation before training" "$1" | grep "lm loss value" | sed -E 's/.*lm loss value: ([0-9.E+-]+).*/\1/'; }
mpirun=$(command -v mpirun || true)
run_np() {  # NP LOG ARGS...
  local np=$1 log=$2
  shift 2
  if [ "$np" = 1 ] || [ -z "$mpirun" ]; then
    "$bin" train "$@" >"$log" 2>&1 || { cat "$log"; fail "run failed: $log"; }
  else
    "$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" train "$@" >"$log" 2>&1 || { cat "$log"; fail "run failed: $log"; }
  fi
}

# HF dense (llama) in, one process and TP2.
run_np 1 "$work/dense.log" "${dense[@]}" --train-iters 6 --export-hf "$work/hf_dense" --save "$work/dense" --save-interval 6
grep -q '"model_type": "llama"' "$work/hf_dense/config.json" || fail "not a llama export"
want=$(final_valid "$work/dense.log")
for np in 1 2; do
  tp=(); [ "$np" = 2 ] && tp=(--tensor-model-parallel-size 2 --make-vocab-size-divisible-by 128)
  run_np $np "$work/hf_in_$np.log" "${dense[@]}" --train-iters 6 --load "$work/hf_dense" --exit-interval 1 "${tp[@]}"
  got=$(before_valid "$work/hf_in_$np.log")
  [ "$got" = "$want" ] || fail "HF llama into np $np: validation loss $got, the exporting run's $want"
  grep -q "successfully loaded checkpoint from $work/hf_dense" "$work/hf_in_$np.log"
done
echo "ok: HF llama loads under 1 process and TP2 with the exporting run's loss ($want)"

# HF MoE (mixtral) in, under EP2.
run_np 1 "$work/moe.log" "${dense[@]}" "${moe[@]}" --train-iters 6 --export-hf "$work/hf_moe"
grep -q '"model_type": "mixtral"' "$work/hf_moe/config.json" || fail "not a mixtral export"
want=$(final_valid "$work/moe.log")
run_np 2 "$work/hf_moe_in.log" "${dense[@]}" "${moe[@]}" --train-iters 6 --load "$work/hf_moe" --exit-interval 1 \
  --expert-model-parallel-size 2
got=$(before_valid "$work/hf_moe_in.log")
[ "$got" = "$want" ] || fail "HF mixtral into EP2: validation loss $got, the exporting run's $want"
echo "ok: HF mixtral loads under EP2 with the exporting run's loss ($want)"
# ... and under Megatron-FSDP DP2 (optim_grads_params: the decoder layers' weights written into each rank's shards).
run_np 2 "$work/hf_moe_fsdp.log" "${dense[@]}" "${moe[@]}" --train-iters 6 --load "$work/hf_moe" --exit-interval 1 \
  --use-megatron-fsdp
got=$(before_valid "$work/hf_moe_fsdp.log")
[ "$got" = "$want" ] || fail "HF mixtral into Megatron-FSDP DP2: validation loss $got, the exporting run's $want"
echo "ok: HF mixtral loads under Megatron-FSDP DP2 with the exporting run's loss ($want)"

# A model flag that disagrees with config.json.
set +e
"$bin" train "${dense[@]}" --train-iters 6 --load "$work/hf_dense" --num-layers 3 >/dev/null 2>"$work/err.txt"
rc=$?
set -e
[ $rc -ne 0 ] && grep -q "error: HF config.json num_hidden_layers 2 does not match --num-layers 3" "$work/err.txt" ||
  { cat "$work/err.txt"; fail "config mismatch error"; }
echo "ok: config.json mismatch is a one-line error"

# Upcycling from moecore's checkpoint and from the HF folder.
dense_loss=$(final_valid "$work/dense.log")
for from in dense hf_dense; do
  run_np 1 "$work/up_$from.log" "${dense[@]}" "${moe[@]}" --train-iters 10 --load "$work/$from" --moe-use-upcycling \
    --save "$work/up_$from" --save-interval 100
  got=$(before_valid "$work/up_$from.log")
  [ "$got" = "$dense_loss" ] || fail "upcycled from $from: validation loss $got, the dense model's $dense_loss"
  grep -q "successfully saved checkpoint from iteration       1" "$work/up_$from.log" || fail "no iteration-1 save"
  grep -q "iteration       10/" "$work/up_$from.log" || fail "upcycled model did not train"
  echo "ok: upcycled from $from: validation loss $got equals the dense model's, saved iteration 1, trained to 10"
done
set +e
"$bin" train "${dense[@]}" "${moe[@]}" --train-iters 10 --load "$work/dense" --moe-use-upcycling --save "$work/up_dense" \
  --save-interval 100 >/dev/null 2>"$work/err.txt"
rc=$?
set -e
[ $rc -ne 0 ] && grep -q "already holds a checkpoint" "$work/err.txt" || { cat "$work/err.txt"; fail "upcycling twice"; }
echo "checkpoint import: all passed"
