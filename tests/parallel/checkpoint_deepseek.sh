#!/usr/bin/env bash
# The tiny DeepSeek-V3 recipe (configs/deepseek-v3-tiny.args: MLA + YaRN, DeepSeek-V3's routing) saved under
# TP2 x PP2 (4 processes) at iteration 3 and continued under EP2 (2 processes) and in one process: iterations 4-6
# give the uninterrupted one-process run's losses within 1e-5 relative, and the checkpoint passes `moecore checkpoint`.
set -euo pipefail
bin=$1
mpirun=$2
work=$3
src=$(cd "$(dirname "$0")/../.." && pwd)
source "$src/tests/recipe.sh"
rm -rf "$work" && mkdir -p "$work"
export OMP_NUM_THREADS=1
mapfile -t model < <(recipe "$src" deepseek-v3-tiny)
# 1023 tokens + EOD pad to the same 1024 rows on one rank and on TP2.
model+=(--train-iters 6 --lr-warmup-iters 1 --eval-iters 0 --eval-interval 100 --log-interval 1 --micro-batch-size 2
  --global-batch-size 8 --seq-length 64 --vocab-size 1023 --seed 7)
source "$(dirname "$0")/lib/layout_runs.sh"
run 1 "$work/ref.log"
run 4 "$work/tp2pp2.log" --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \
  --save "$work/tp2pp2" --save-interval 3 --exit-interval 3
"$bin" checkpoint "$work/tp2pp2" >"$work/inspect.log" 2>&1 || { cat "$work/inspect.log"; echo "FAIL: moecore checkpoint"; exit 1; }
run 2 "$work/ep2.log" --expert-model-parallel-size 2 --load "$work/tp2pp2"
close_losses "TP2 x PP2 -> EP2" "$work/ref.log" "$work/ep2.log"
run 1 "$work/one.log" --load "$work/tp2pp2"
close_losses "TP2 x PP2 -> 1" "$work/ref.log" "$work/one.log"
echo "PASS"
