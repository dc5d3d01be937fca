#!/usr/bin/env bash
# The LatentMoE recipe (configs/latent-moe-tiny.args) saved under TP2 x EP2 (4 processes; the experts' latent width
# sharded over expert-TP 2) at iteration 3 and continued under EP2 (2 processes) and in one process: iterations 4-6
# give the uninterrupted one-process run's losses within 1e-5 relative, and the checkpoint passes `moecore checkpoint`.
set -euo pipefail
bin=$1
mpirun=$2
work=$3
src=$(cd "$(dirname "$0")/../.." && pwd)
source "$src/tests/recipe.sh"
rm -rf "$work" && mkdir -p "$work"
export OMP_NUM_THREADS=1
mapfile -t model < <(recipe "$src" latent-moe-tiny)
# 1023 tokens + EOD pad to the same 1024 rows on one rank and on TP2.
model+=(--train-iters 6 --lr-warmup-iters 1 --eval-iters 0 --eval-interval 100 --log-interval 1 --seq-length 32
  --max-position-embeddings 32 --vocab-size 1023 --seed 7)
source "$(dirname "$0")/lib/layout_runs.sh"
run 1 "$work/ref.log"
run 4 "$work/tp2ep2.log" --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 \
  --save "$work/tp2ep2" --save-interval 3 --exit-interval 3
"$bin" checkpoint "$work/tp2ep2" >"$work/inspect.log" 2>&1 || { cat "$work/inspect.log"; echo "FAIL: moecore checkpoint"; exit 1; }
grep -q "fc1_latent_proj" "$work/inspect.log" || { cat "$work/inspect.log"; echo "FAIL: no latent projection stored"; exit 1; }
run 2 "$work/ep2.log" --expert-model-parallel-size 2 --load "$work/tp2ep2"
close_losses "TP2 x EP2 -> EP2" "$work/ref.log" "$work/ep2.log"
run 1 "$work/one.log" --load "$work/tp2ep2"
close_losses "TP2 x EP2 -> 1" "$work/ref.log" "$work/one.log"
echo "PASS"
