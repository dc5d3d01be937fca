#!/usr/bin/env bash
# Checkpoint safety of the `moecore` command:
#   - kill -9 during a save (at each fault-injection stage, and at wall-clock moments) leaves the previous checkpoint
#     loadable and named by the tracker;
#   - a corrupted or truncated file, a missing file, a wrong model shape: one-line errors naming the file / tensor / flag
#     and a non-zero exit, in one process and on every rank under mpirun;
#   - --exit-signal-handler: SIGTERM during training saves and exits 0, and the resumed run continues exactly;
#   - --async-save gives the same checkpoint bytes as a synchronous save; --no-save-optim / --finetune /
#     --no-load-optim behave as Megatron's; `moecore checkpoint` prints and verifies.
set -euo pipefail
source "$(dirname "$0")/lib/setup.sh" "$@"
mapfile -t model < <(recipe "$src" tiny-dense)
model+=(--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-warmup-iters 2 --log-interval 1 --eval-iters 0
  --mock-data --tokenizer-type NullTokenizer --vocab-size 300 --seed 3 --num-experts 4 --moe-router-topk 2
  --moe-router-enable-expert-bias --moe-router-score-function sigmoid)
fail() { echo "FAIL: $*"; exit 1; }
lines() { grep -E "iteration +$2/" "$1" | sed -E 's/^ *\[[^]]*\] //; s/elapsed time per iteration \(ms\): [0-9.]+ \| //; s/ time left \(estimate\): [^|]+ \|//'; }
expect_error() {  # NAME REGEX COMMAND...: non-zero exit, one "error:" line matching REGEX
  local name=$1 regex=$2
  shift 2
  set +e
  "$@" >"$work/out.txt" 2>"$work/err.txt"
  local rc=$?
  set -e
  [ $rc -ne 0 ] || fail "$name: exit status 0"
  grep -E "error: .*$regex" "$work/err.txt" >/dev/null || { cat "$work/err.txt"; fail "$name: no error matching '$regex'"; }
  echo "ok: $name"
}

# A good checkpoint at iteration 2, then saves killed at each stage of the save of iteration 4.
"$bin" train "${model[@]}" --train-iters 4 --save "$work/run" --save-interval 2 --exit-interval 2 >"$work/a.log" 2>&1
for stage in shard_written metadata_written renamed; do
  rm -rf "$work/k_$stage" && cp -r "$work/run" "$work/k_$stage"
  set +e
  MOECORE_CKPT_KILL_AT=$stage "$bin" train "${model[@]}" --train-iters 4 --load "$work/k_$stage" \
    --save "$work/k_$stage" --save-interval 4 >"$work/k.log" 2>&1
  rc=$?
  set -e
  [ $rc -eq 137 ] || { cat "$work/k.log"; fail "kill at $stage: status $rc, expected 137 (SIGKILL)"; }
  [ "$(cat "$work/k_$stage/latest_checkpointed_iteration.txt")" = 2 ] || fail "kill at $stage: tracker moved"
  "$bin" checkpoint "$work/k_$stage" >"$work/v.txt" || fail "kill at $stage: previous checkpoint damaged"
  grep -q "iteration 2" "$work/v.txt"
  "$bin" train "${model[@]}" --train-iters 4 --load "$work/k_$stage" >"$work/k2.log" 2>&1 ||
    fail "kill at $stage: cannot resume"
  grep -q "successfully loaded checkpoint from $work/k_$stage .* at iteration 2" "$work/k2.log"
  echo "ok: killed at $stage, iteration 2 still loads"
done
# The same at wall-clock moments of a run that saves after every iteration.
for delay in 0.05 0.2 0.5; do
  rm -rf "$work/w"
  "$bin" train "${model[@]}" --train-iters 400 --save "$work/w" --save-interval 1 >"$work/w.log" 2>&1 &
  pid=$!
  # After a few saves (slow machines included), then at DELAY into whatever the run is doing.
  for _ in $(seq 1200); do grep -q "successfully saved checkpoint from iteration       3" "$work/w.log" 2>/dev/null && break; sleep 0.05; done
  sleep "$delay"
  kill -9 $pid 2>/dev/null || true
  wait $pid 2>/dev/null || true
  "$bin" checkpoint "$work/w" >/dev/null || fail "kill -9 after ${delay}s: the tracker names a damaged checkpoint"
  "$bin" train "${model[@]}" --train-iters 400 --exit-interval 1 --load "$work/w" >"$work/w2.log" 2>&1 ||
    fail "kill -9 after ${delay}s: cannot resume"
  echo "ok: kill -9 at a moment (${delay}s) leaves a loadable checkpoint ($(cat "$work/w/latest_checkpointed_iteration.txt"))"
done

# Damaged checkpoints.
ck="$work/run/iter_0000002"
cp -r "$work/run" "$work/bad1"
/usr/bin/python3 - "$work/bad1/iter_0000002/rank_00000.safetensors" <<'PY'
import sys
p = sys.argv[1]
data = bytearray(open(p, "rb").read())
data[-5] ^= 0xFF  # the last tensor's bytes
open(p, "wb").write(data)
PY
expect_error "corrupted byte" "rank_00000.safetensors: checksum mismatch in tensor .*corrupted" \
  "$bin" train "${model[@]}" --train-iters 4 --load "$work/bad1"
expect_error "corrupted byte (checkpoint command)" "rank_00000.safetensors: checksum mismatch" "$bin" checkpoint "$work/bad1"
cp -r "$work/run" "$work/bad2"
truncate -s 1000 "$work/bad2/iter_0000002/rank_00000.safetensors"
expect_error "truncated file" "rank_00000.safetensors: truncated" "$bin" train "${model[@]}" --train-iters 4 --load "$work/bad2"
cp -r "$work/run" "$work/bad3"
rm "$work/bad3/iter_0000002/metadata.json"
expect_error "missing metadata" "metadata.json: missing" "$bin" train "${model[@]}" --train-iters 4 --load "$work/bad3"
expect_error "model shape" "saved with --hidden-size 64, this run has 128" \
  "$bin" train "${model[@]/--hidden-size 64/}" --hidden-size 128 --train-iters 4 --load "$work/run"
cp -r "$work/run" "$work/bad4"
echo "banana" >"$work/bad4/latest_checkpointed_iteration.txt"
expect_error "bad tracker" "latest_checkpointed_iteration.txt: expected an iteration number" \
  "$bin" train "${model[@]}" --train-iters 4 --load "$work/bad4"
expect_error "missing checkpoint" "no checkpoint was found" \
  "$bin" train "${model[@]}" --train-iters 4 --load "$work/nothing" --exit-on-missing-checkpoint
expect_error "save without interval" "--save requires --save-interval" "$bin" train "${model[@]}" --train-iters 4 --save "$work/x"
mpirun=$(command -v mpirun || true)
if [ -n "$mpirun" ]; then  # every rank reports the damage and the job ends (no hang)
  expect_error "corrupted byte under mpirun -np 2" "checksum mismatch" timeout 120 "$mpirun" --allow-run-as-root \
    --oversubscribe -np 2 "$bin" train "${model[@]}" --train-iters 4 --load "$work/bad1"
  # Every rank stops with the same error (the ranks agree on it), rank 0 reports it once, no rank aborts the job.
  [ "$(grep -c "error: .*checksum mismatch" "$work/err.txt")" = 1 ] && ! grep -q "MPI_ABORT" "$work/err.txt" ||
    { cat "$work/err.txt"; fail "the ranks did not fail together"; }
  # One rank dies in the middle of a collective save: the job ends (no rank waits forever) and the previous
  # checkpoint stays the loadable one.
  rm -rf "$work/mk" && "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" train "${model[@]}" --train-iters 4 \
    --expert-model-parallel-size 2 --save "$work/mk" --save-interval 2 --exit-interval 2 >/dev/null 2>&1
  set +e
  timeout 120 "$mpirun" --allow-run-as-root --oversubscribe -np 2 -x MOECORE_CKPT_KILL_AT=shard_written:1 "$bin" train \
    "${model[@]}" --train-iters 4 --expert-model-parallel-size 2 --load "$work/mk" --save "$work/mk" --save-interval 4 \
    >"$work/mk.log" 2>&1
  rc=$?
  set -e
  [ $rc -ne 0 ] && [ $rc -ne 124 ] || { cat "$work/mk.log"; fail "rank 1 killed during a save: status $rc (124: a hang)"; }
  [ "$(cat "$work/mk/latest_checkpointed_iteration.txt")" = 2 ] || fail "rank killed: tracker moved"
  "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" train "${model[@]}" --train-iters 4 \
    --expert-model-parallel-size 2 --load "$work/mk" >"$work/mk2.log" 2>&1 || fail "rank killed: cannot resume"
  echo "ok: a rank killed during a collective save ends the job (status $rc); iteration 2 still loads"
fi

# SIGTERM: finish the iteration, save, exit 0; the resume continues exactly.
"$bin" train "${model[@]}" --train-iters 40 >"$work/full.log" 2>&1
"$bin" train "${model[@]}" --train-iters 40 --save "$work/sig" --save-interval 1000 --exit-signal-handler \
  >"$work/sig.log" 2>&1 &
pid=$!
for _ in $(seq 1200); do grep -q "iteration  *3/" "$work/sig.log" 2>/dev/null && break; sleep 0.05; done
kill -TERM $pid
wait $pid || fail "SIGTERM: exit status $?"
grep -q "exiting program after receiving SIGTERM" "$work/sig.log" || fail "SIGTERM: no exit line"
k=$(cat "$work/sig/latest_checkpointed_iteration.txt")
[ "$k" -lt 40 ] || fail "SIGTERM: saved at the end, not on the signal"
"$bin" train "${model[@]}" --train-iters 40 --load "$work/sig" >"$work/sig2.log" 2>&1
for i in $(seq $((k + 1)) 40); do
  [ "$(lines "$work/full.log" "$i")" = "$(lines "$work/sig2.log" "$i")" ] || fail "SIGTERM resume: iteration $i differs"
done
echo "ok: SIGTERM at iteration $k saved, exited 0, resumed exactly"
# The RNG state is the seed: a resume with another --seed still draws the checkpoint's dropout masks, unless
# --no-load-rng (then --seed's).
next=$((k + 1))
"$bin" train "${model[@]/--seed 3/}" --seed 99 --train-iters 40 --load "$work/sig" --exit-interval $next >"$work/s99.log" 2>&1
"$bin" train "${model[@]/--seed 3/}" --seed 99 --train-iters 40 --load "$work/sig" --exit-interval $next --no-load-rng \
  >"$work/s99n.log" 2>&1
[ "$(lines "$work/full.log" $next)" = "$(lines "$work/s99.log" $next)" ] || fail "the checkpoint's RNG seed was not used"
[ "$(lines "$work/full.log" $next)" != "$(lines "$work/s99n.log" $next)" ] || fail "--no-load-rng kept the checkpoint's seed"
echo "ok: the RNG seed is restored, --no-load-rng uses --seed"

# Async saves write the same bytes; --no-save-optim / --finetune / --no-load-optim.
"$bin" train "${model[@]}" --train-iters 4 --save "$work/async" --save-interval 2 --async-save >"$work/async.log" 2>&1
grep -q "scheduled an async checkpoint save at iteration       2" "$work/async.log"
"$bin" train "${model[@]}" --train-iters 4 --save "$work/sync" --save-interval 2 >/dev/null 2>&1
cmp "$work/async/iter_0000004/rank_00000.safetensors" "$work/sync/iter_0000004/rank_00000.safetensors" ||
  fail "async and sync saves differ"
echo "ok: async save == sync save"
"$bin" train "${model[@]}" --train-iters 4 --save "$work/noopt" --save-interval 2 --exit-interval 2 --no-save-optim >/dev/null 2>&1
! "$bin" checkpoint "$work/noopt" | grep -q "^optimizer\." || fail "--no-save-optim saved optimizer state"
expect_error "load optimizer missing" "no optimizer state .*--no-load-optim" \
  "$bin" train "${model[@]}" --train-iters 4 --load "$work/noopt"
"$bin" train "${model[@]}" --train-iters 4 --load "$work/noopt" --no-load-optim >"$work/nlo.log" 2>&1
grep -q "iteration  *3/" "$work/nlo.log" && ! grep -q "iteration  *2/" "$work/nlo.log" || fail "--no-load-optim: not at iteration 2"
"$bin" train "${model[@]}" --train-iters 4 --load "$work/run" --finetune >"$work/ft.log" 2>&1
grep -q "iteration  *1/" "$work/ft.log" || fail "--finetune did not start at iteration 0"
# Non-persistent saves (1, 2, 4, 5) remove all but the newest before each save (Megatron's
# cleanup_old_non_persistent_checkpoint), so 4 and 5 remain; --exit-duration-in-mins saves and exits.
"$bin" train "${model[@]}" --train-iters 5 --save "$work/np" --save-interval 3 --non-persistent-save-interval 1 \
  --non-persistent-ckpt-type global >"$work/np.log" 2>&1
[ "$(ls "$work/np/non_persistent" | grep -c '^iter_')" = 2 ] && [ -d "$work/np/non_persistent/iter_0000005" ] &&
  [ -d "$work/np/non_persistent/iter_0000004" ] || { ls -R "$work/np"; fail "non-persistent: not the newest two kept"; }
[ -d "$work/np/iter_0000003" ] && [ -d "$work/np/iter_0000005" ] && [ "$(cat "$work/np/latest_checkpointed_iteration.txt")" = 5 ] ||
  fail "non-persistent: persistent saves at 3 and 5 (the final one) expected"
"$bin" train "${model[@]}" --train-iters 5 --save "$work/dur" --save-interval 100 --exit-duration-in-mins 0 \
  >"$work/dur.log" 2>&1
grep -q "exiting program after" "$work/dur.log" && [ "$(cat "$work/dur/latest_checkpointed_iteration.txt")" = 1 ] ||
  fail "--exit-duration-in-mins 0: expected a save at iteration 1 and an exit"
echo "ok: non-persistent saves, --exit-duration-in-mins"
echo "checkpoint safety: all passed"
