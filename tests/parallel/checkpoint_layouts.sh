#!/usr/bin/env bash
# Checkpoints across layouts: a tiny MoE GPT (dropout, input jitter, sigmoid router with expert bias, aux + seq-aux +
# z losses, gated shared experts) trained 6 iterations in one process saving at 3 and 6 (the reference), then
#   resume in the same layout: iterations 4-6 print exactly the uninterrupted run's lines (one process, TP2 x EP2);
#   reshard: saved at 3 under layout A (--exit-interval 3), loaded under layout B, iterations 4-6 give the one-process
#   losses within 1e-5 relative: 1 -> TP2xEP2, TP2xEP2 -> EP4, EP4 + distributed optimizer -> DP2, ETP2xEP2 -> 1;
#   pipelines (the same model with 4 layers): PP2 x TP2 -> PP4, PP2 x TP2 -> EP2 (PP 1), and PP2 x TP2 resumed;
#   CP2 -> 1; and every checkpoint saved passes `moecore checkpoint`.
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
ep4=(--expert-model-parallel-size 4)
etp2ep2=(--tensor-model-parallel-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2)

source "$(dirname "$0")/lib/layout_runs.sh"
pp_layers=(--num-layers 4 --moe-layer-freq [0,1,0,1])
pp2tp2=("${pp_layers[@]}" --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
# The iteration lines of iterations 4-6 without the wall-clock fields.
lines() { grep -E "iteration +[4-6]/" "$1" | sed -E 's/^ *\[[^]]*\] //; s/elapsed time per iteration \(ms\): [0-9.]+ \| //; s/ time left \(estimate\): [^|]+ \|//'; }
same_lines() {  # NAME A B
  if ! diff <(lines "$2") <(lines "$3") >/dev/null || [ "$(lines "$2" | wc -l)" != 3 ]; then
    diff <(lines "$2") <(lines "$3") || true
    echo "FAIL: $1: the resumed run's lines differ"
    exit 1
  fi
  echo "ok: $1 resumes bit for bit"
}

# The one-process reference, saving at 3 and 6.
run 1 "$work/ref.log" --save "$work/ref" --save-interval 3
grep -q "successfully saved checkpoint from iteration       3" "$work/ref.log"
[ "$(cat "$work/ref/latest_checkpointed_iteration.txt")" = 6 ]

# Resume bit for bit, one process.
run 1 "$work/resume1.log" --load "$work/ref" --ckpt-step 3
grep -q "successfully loaded checkpoint from $work/ref .* at iteration 3" "$work/resume1.log"
same_lines "one process" "$work/ref.log" "$work/resume1.log"

# Resume bit for bit under TP2 x EP2 (4 processes).
run 4 "$work/tp2ep2_full.log" "${tp2ep2[@]}" --save "$work/tp2ep2" --save-interval 3
run 4 "$work/tp2ep2_resume.log" "${tp2ep2[@]}" --load "$work/tp2ep2" --ckpt-step 3
same_lines "TP2 x EP2" "$work/tp2ep2_full.log" "$work/tp2ep2_resume.log"

# Resharding.
run 4 "$work/r1.log" "${tp2ep2[@]}" --load "$work/ref" --ckpt-step 3
close_losses "1 -> TP2xEP2" "$work/ref.log" "$work/r1.log"
run 4 "$work/r2.log" "${ep4[@]}" --load "$work/tp2ep2" --ckpt-step 3
close_losses "TP2xEP2 -> EP4" "$work/ref.log" "$work/r2.log"
run 4 "$work/ep4_distopt.log" "${ep4[@]}" --use-distributed-optimizer --save "$work/ep4_distopt" --save-interval 100 \
  --exit-interval 3
grep -q "exiting program at iteration 3" "$work/ep4_distopt.log"
run 2 "$work/r3.log" --load "$work/ep4_distopt"
close_losses "EP4 + distributed optimizer -> DP2" "$work/ref.log" "$work/r3.log"
run 4 "$work/etp.log" "${etp2ep2[@]}" --save "$work/etp" --save-interval 3 --exit-interval 3
run 1 "$work/r4.log" --load "$work/etp"
close_losses "ETP2xEP2 -> 1" "$work/ref.log" "$work/r4.log"

# Pipelines: saved under PP2 x TP2, resumed there bit for bit, loaded under PP4 and under EP2 without a pipeline.
run 1 "$work/pp_ref.log" "${pp_layers[@]}" --save "$work/pp_ref" --save-interval 3
run 4 "$work/pp2tp2_full.log" "${pp2tp2[@]}" --save "$work/pp2tp2" --save-interval 3
close_losses "PP2 x TP2 against one process" "$work/pp_ref.log" "$work/pp2tp2_full.log"
run 4 "$work/pp2tp2_resume.log" "${pp2tp2[@]}" --load "$work/pp2tp2" --ckpt-step 3
same_lines "PP2 x TP2" "$work/pp2tp2_full.log" "$work/pp2tp2_resume.log"
run 4 "$work/r5.log" "${pp_layers[@]}" --pipeline-model-parallel-size 4 --load "$work/pp2tp2" --ckpt-step 3
close_losses "PP2xTP2 -> PP4" "$work/pp_ref.log" "$work/r5.log"
run 2 "$work/r6.log" "${pp_layers[@]}" --expert-model-parallel-size 2 --load "$work/pp2tp2" --ckpt-step 3
close_losses "PP2xTP2 -> EP2" "$work/pp_ref.log" "$work/r6.log"

# Context parallelism: saved under CP2, loaded in one process.
run 2 "$work/cp2.log" --context-parallel-size 2 --save "$work/cp2" --save-interval 3 --exit-interval 3
run 1 "$work/r7.log" --load "$work/cp2"
close_losses "CP2 -> 1" "$work/ref.log" "$work/r7.log"

# Every checkpoint saved above, in each layout (tensor-parallel boxes, distributed-optimizer flat ranges, pipeline
# stages, expert shards), passes `moecore checkpoint`: pieces tiling each tensor, file checksums, the state its model
# flags imply.
for dir in "$work"/*/iter_*; do
  "$bin" checkpoint "$dir" >"$work/verify.log" 2>&1 || { cat "$work/verify.log"; echo "FAIL: $dir does not verify"; exit 1; }
done
echo "ok: every saved layout verifies"
echo "checkpoint layouts: all passed"
