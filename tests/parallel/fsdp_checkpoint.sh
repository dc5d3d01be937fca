#!/usr/bin/env bash
# Megatron-FSDP checkpoints in moecore's sharded format (global keys; a ZeRO-3 parameter shard is saved as the flat
# range of its tensor it covers, as the distributed optimizer's moments): the tiny MoE GPT of checkpoint_layouts.sh
# trained 6 iterations in one process (the reference), then
#   FSDP DP2 (optim_grads_params) saved at 3 -> loaded under TP2 x EP2 without FSDP;
#   TP2 x EP2 saved at 3 -> loaded under FSDP DP2 x EP2 (4 ranks, experts sharded over expert-DP 2);
#   FSDP DP2 resumed from its own checkpoint, fp32 and bf16: iterations 4-6 print exactly the uninterrupted FSDP run's
#   lines;
# iterations 4-6 within 1e-5 relative of the one-process losses, and each FSDP checkpoint passes `moecore checkpoint`.
set -euo pipefail
bin=$1
mpirun=$2
work=$3
rm -rf "$work" && mkdir -p "$work"
export OMP_NUM_THREADS=1
model=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2
  --seq-length 16 --max-position-embeddings 16 --normalization RMSNorm --swiglu --disable-bias-linear
  --position-embedding-type rope --attention-dropout 0.1 --hidden-dropout 0.1 --ffn-hidden-size 64
  --micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 1e-3 --lr-warmup-iters 2 --clip-grad 1.0
  --log-interval 1 --eval-iters 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 200 --seed 7
  --num-experts 8 --moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-layer-freq [0,1] --moe-grouped-gemm
  --moe-shared-expert-intermediate-size 32 --moe-shared-expert-gate --moe-input-jitter-eps 0.01
  --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01
  --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01 0.01 --moe-z-loss-coeff 0.001
  --moe-token-dispatcher-type alltoall)
tp2ep2=(--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2)
fsdp=(--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params)

source "$(dirname "$0")/lib/layout_runs.sh"
lines() { grep -E "iteration +[4-6]/" "$1" | sed -E 's/^ *\[[^]]*\] //; s/elapsed time per iteration \(ms\): [0-9.]+ \| //; s/ time left \(estimate\): [^|]+ \|//'; }

run 1 "$work/ref.log"

# FSDP -> TP2 x EP2.
run 2 "$work/fsdp.log" "${fsdp[@]}" --save "$work/fsdp" --save-interval 3
close_losses "FSDP DP2 against one process" "$work/ref.log" "$work/fsdp.log"
run 4 "$work/r1.log" "${tp2ep2[@]}" --load "$work/fsdp" --ckpt-step 3
grep -q "successfully loaded checkpoint from $work/fsdp .* at iteration 3" "$work/r1.log"
close_losses "FSDP DP2 -> TP2xEP2" "$work/ref.log" "$work/r1.log"

# TP2 x EP2 -> FSDP DP2 x EP2.
run 4 "$work/tp2ep2.log" "${tp2ep2[@]}" --save "$work/tp2ep2" --save-interval 100 --exit-interval 3
run 4 "$work/r2.log" "${fsdp[@]}" --expert-model-parallel-size 2 --load "$work/tp2ep2"
grep -q "successfully loaded checkpoint from $work/tp2ep2 .* at iteration 3" "$work/r2.log"
close_losses "TP2xEP2 -> FSDP DP2xEP2" "$work/ref.log" "$work/r2.log"

# FSDP resumed in its own layout, bit for bit.
run 2 "$work/resume.log" "${fsdp[@]}" --load "$work/fsdp" --ckpt-step 3
if ! diff <(lines "$work/fsdp.log") <(lines "$work/resume.log") >/dev/null || [ "$(lines "$work/resume.log" | wc -l)" != 3 ]; then
  diff <(lines "$work/fsdp.log") <(lines "$work/resume.log") || true
  echo "FAIL: the resumed FSDP run's lines differ"
  exit 1
fi
echo "ok: FSDP DP2 resumes bit for bit"

# bf16 weights (fp32 main parameters on the shards, saved under optimizer.state.fp32_param.*), resumed bit for bit.
run 2 "$work/bf16.log" "${fsdp[@]}" --bf16 --save "$work/bf16" --save-interval 3
run 2 "$work/bf16_resume.log" "${fsdp[@]}" --bf16 --load "$work/bf16" --ckpt-step 3
if ! diff <(lines "$work/bf16.log") <(lines "$work/bf16_resume.log") >/dev/null ||
  [ "$(lines "$work/bf16_resume.log" | wc -l)" != 3 ]; then
  diff <(lines "$work/bf16.log") <(lines "$work/bf16_resume.log") || true
  echo "FAIL: the resumed bf16 FSDP run's lines differ"
  exit 1
fi
echo "ok: bf16 FSDP DP2 resumes bit for bit"

for dir in "$work"/fsdp/iter_* "$work"/bf16/iter_*; do
  "$bin" checkpoint "$dir" >"$work/verify.log" 2>&1 || { cat "$work/verify.log"; echo "FAIL: $dir does not verify"; exit 1; }
done
echo "ok: the FSDP checkpoints verify"
echo "fsdp checkpoint: all passed"
