#!/usr/bin/env bash
# Write faults during `moecore train`: a full disk (a small tmpfs), a folder that becomes read-only while the run
# saves, and an fsync that reports EIO (MOECORE_CKPT_FAIL_AT=fsync). A failed save stops the run with one line naming
# the file and the OS error and a non-zero exit, in one process, with --async-save and on every rank under mpirun;
# the tracker keeps naming the previous checkpoint, which loads and resumes; no ITER.tmp is left behind. With
# --ckpt-save-failure continue the run warns once per failed save and trains on. The HF export, the --profile trace
# and the training log fail the same way on a full disk, leaving no partial file under its final name.
# Needs root (mount -t tmpfs): exits 77 (skipped) where mounting is not permitted.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"

mnt="$work/mnt"
mkdir -p "$mnt"
if ! mount -t tmpfs -o size=2m tmpfs "$mnt" 2>/dev/null; then
  echo "skipped: cannot mount a tmpfs here (needs root)"
  exit 77
fi
rw="$work/rw"  # room for several saves: it turns read-only, never full
mkdir -p "$rw"
mount -t tmpfs -o size=64m tmpfs "$rw" || { umount -l "$mnt"; echo "FAIL: mount of a second tmpfs"; exit 1; }
trap 'umount -l "$mnt" 2>/dev/null; umount -l "$rw" 2>/dev/null' EXIT

mapfile -t model < <(recipe "$src" tiny-moe)
model+=(--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-iters 0 --mock-data
  --tokenizer-type NullTokenizer --vocab-size 100 --seed 3 --threads 1)
llama=(--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear)
mpi=(timeout 300 mpirun -q --allow-run-as-root --oversubscribe -np 2)
has_mpi() { command -v mpirun >/dev/null; }

fill_disk() { dd if=/dev/zero of="$mnt/filler" bs=64k >/dev/null 2>&1; sync; }
free_disk() { rm -f "$mnt/filler"; }
reset_disk() { rm -rf "${mnt:?}"/*; }
# A checkpoint at iteration 2 in $mnt/run (COMMAND PREFIX... for mpirun, then extra flags after --).
first_checkpoint() {
  reset_disk
  "$@" --train-iters 6 --save "$mnt/run" --save-interval 2 --exit-interval 2 >"$work/first.log" 2>&1 ||
    fail "first checkpoint: $(tail -2 "$work/first.log")"
}
# The tracker still names iteration 2, no unfinished save is left, iteration 2 verifies and resumes.
previous_checkpoint_resumes() {  # NAME RUNNER...
  local name=$1
  shift
  [ "$(cat "$mnt/run/latest_checkpointed_iteration.txt")" = 2 ] || fail "$name: the tracker moved"
  ls -d "$mnt"/run/iter_*.tmp >/dev/null 2>&1 && fail "$name: an unfinished save was left: $(ls "$mnt/run")"
  [ -e "$mnt/run/iter_0000004" ] && fail "$name: iter_0000004 exists after a failed save"
  "$bin" checkpoint "$mnt/run" >/dev/null 2>&1 || fail "$name: iteration 2 does not verify"
  if "$@" --train-iters 6 --exit-interval 4 --load "$mnt/run" >"$work/resume.log" 2>&1 &&
    grep -q "successfully loaded checkpoint from $mnt/run .* at iteration 2" "$work/resume.log" &&
    grep -qE "iteration +4/" "$work/resume.log"; then
    echo "ok: $name: iteration 2 still loads and resumes"
  else
    fail "$name: cannot resume from iteration 2: $(tail -2 "$work/resume.log")"
  fi
}
full_disk_stops() {  # NAME PATTERN RUNNER... (-- the run's extra flags follow the runner)
  local name=$1 pattern=$2
  shift 2
  fill_disk
  expect_error "$pattern" "$@" --train-iters 6 --load "$mnt/run" --save "$mnt/run" --save-interval 2 &&
    echo "ok: $name"
  free_disk
}

one=("$bin" train "${model[@]}")
# A full disk: the save of iteration 4 fails writing this rank's file; one line, the run stops.
nospace="iter_0000004.tmp/rank_00000.safetensors: write failed: No space left on device"
first_checkpoint "${one[@]}"
full_disk_stops "full disk stops the run" "error: saving checkpoint at iteration 4 failed: $mnt/run/$nospace" "${one[@]}"
grep -qF "latest_checkpointed_iteration.txt still names iteration 2" "$work/expect.stderr" ||
  fail "the error does not name the checkpoint that stays: $(cat "$work/expect.stderr")"
previous_checkpoint_resumes "full disk" "${one[@]}"
full_disk_stops "full disk stops an --async-save run" "error: saving checkpoint at iteration 4 failed: $mnt/run/$nospace" \
  "${one[@]}" --async-save
previous_checkpoint_resumes "full disk, --async-save" "${one[@]}"

# --ckpt-save-failure continue: one warning per failed save, training goes on, the tracker stays.
for async in "" --async-save; do
  fill_disk
  if "${one[@]}" --train-iters 6 --load "$mnt/run" --save "$mnt/run" --save-interval 2 --ckpt-save-failure continue \
    $async >"$work/continue.log" 2>&1; then
    [ "$(grep -c "^WARNING: saving checkpoint at iteration [46] failed: .*No space left on device; training goes on" \
      "$work/continue.log")" = 2 ] || fail "continue $async: expected two warnings: $(grep WARNING "$work/continue.log")"
    grep -q "^WARNING: 2 checkpoint saves failed during this run" "$work/continue.log" || fail "continue $async: no summary"
    grep -qE "iteration +6/" "$work/continue.log" || fail "continue $async: training did not reach iteration 6"
    echo "ok: --ckpt-save-failure continue $async trains on with one warning per failed save"
  else
    fail "continue $async: exit status $?: $(tail -2 "$work/continue.log")"
  fi
  free_disk
  previous_checkpoint_resumes "continue $async" "${one[@]}"
done

# An fsync that reports EIO (no full disk needed).
MOECORE_CKPT_FAIL_AT=fsync expect_error \
  "error: saving checkpoint at iteration 4 failed: $mnt/run/iter_0000004.tmp/rank_00000.safetensors: fsync failed: Input/output error" \
  "${one[@]}" --train-iters 6 --load "$mnt/run" --save "$mnt/run" --save-interval 2 && echo "ok: a failing fsync stops the run"
previous_checkpoint_resumes "fsync EIO" "${one[@]}"

# The folder turns read-only while the run saves every 2 iterations: the next save fails and the run stops.
"${one[@]}" --train-iters 100000 --save "$rw/run" --save-interval 2 >"$work/ro.log" 2>"$work/ro.err" &
pid=$!
for _ in $(seq 1200); do grep -q "successfully saved checkpoint from iteration       2" "$work/ro.log" && break; sleep 0.05; done
remounted=0
for _ in $(seq 400); do  # busy while a file is open for writing
  mount -o remount,ro "$rw" 2>/dev/null && { remounted=1; break; }
  sleep 0.01
done
for _ in $(seq 2400); do kill -0 $pid 2>/dev/null || break; sleep 0.05; done
kill -9 $pid 2>/dev/null  # still training after 2 minutes: the failure went unnoticed (status 137)
wait $pid
rc=$?
if [ $remounted = 0 ]; then
  fail "read-only: could not remount"
elif [ $rc -eq 0 ] || [ $rc -ge 124 ] || [ "$(grep -c . "$work/ro.err")" != 1 ] ||
  ! grep -qE "^error: saving checkpoint at iteration [0-9]+ failed: $rw/run/.*Read-only file system" "$work/ro.err"; then
  fail "read-only folder: status $rc, stderr: $(cat "$work/ro.err")"
else
  k=$(cat "$rw/run/latest_checkpointed_iteration.txt")
  "$bin" checkpoint "$rw/run" >/dev/null 2>&1 || fail "read-only: the tracker's iteration $k does not verify"
  "${one[@]}" --train-iters 100000 --exit-interval $((k + 1)) --load "$rw/run" >"$work/ro2.log" 2>&1 &&
    grep -q "successfully loaded checkpoint from $rw/run .* at iteration $k" "$work/ro2.log" ||
    fail "read-only: cannot resume from iteration $k"
  echo "ok: a folder turned read-only during the run stops it at the next save; iteration $k resumes"
fi

# Under mpirun: every rank stops with the one line rank 0 prints (no abort, no hang), and the previous checkpoint
# resumes; an fsync failing on rank 1 alone names rank 1's file.
if has_mpi; then
  two=("${mpi[@]}" "$bin" train "${model[@]}" --expert-model-parallel-size 2)
  first_checkpoint "${two[@]}"
  full_disk_stops "mpirun -np 2: full disk stops every rank" \
    "error: saving checkpoint at iteration 4 failed: $mnt/run/$nospace" "${two[@]}"
  previous_checkpoint_resumes "mpirun -np 2, full disk" "${two[@]}"
  full_disk_stops "mpirun -np 2: full disk stops every rank of an --async-save run" \
    "error: saving checkpoint at iteration 4 failed: $mnt/run/$nospace" "${two[@]}" --async-save
  previous_checkpoint_resumes "mpirun -np 2, full disk, --async-save" "${two[@]}"
  expect_error "rank_00001.safetensors: fsync failed: Input/output error" "${mpi[@]}" -x MOECORE_CKPT_FAIL_AT=fsync:1 \
    "$bin" train "${model[@]}" --expert-model-parallel-size 2 --train-iters 6 --load "$mnt/run" --save "$mnt/run" \
    --save-interval 2 && echo "ok: mpirun -np 2: an fsync failing on rank 1"
  previous_checkpoint_resumes "mpirun -np 2, fsync on rank 1" "${two[@]}"
fi

# The HF export after training, into a full disk: one line, nothing under the export's name, no DIR.tmp left.
reset_disk
fill_disk
expect_error "error: HF export to $mnt/hf failed: " "${one[@]}" "${llama[@]}" --train-iters 2 --export-hf "$mnt/hf" &&
  grep -q "No space left on device" "$work/expect.stderr" && echo "ok: an export into a full disk"
[ -e "$mnt/hf" ] || [ -e "$mnt/hf.tmp" ] && fail "a failed export left $(ls "$mnt")"
if has_mpi; then
  expect_error "error: HF export to $mnt/hf failed: " "${mpi[@]}" "$bin" train "${model[@]}" "${llama[@]}" \
    --expert-model-parallel-size 2 --train-iters 2 --export-hf "$mnt/hf" && echo "ok: mpirun -np 2: an export into a full disk"
fi
# The --profile trace into a full disk.
expect_error "trace_rank0.json: cannot write the trace (write failed: No space left on device)" "${one[@]}" \
  --train-iters 3 --profile --profile-step-start 1 --profile-step-end 2 --profile-dir "$mnt/trace" &&
  echo "ok: a trace into a full disk"
[ -n "$(ls -A "$mnt/trace" 2>/dev/null)" ] && fail "a failed trace left $(ls "$mnt/trace")"
# The training log (standard output) redirected into a full disk.
if "${one[@]}" --train-iters 200 >"$mnt/train.log" 2>"$work/log.err"; then
  fail "a log into a full disk: exit status 0"
else
  [ "$(grep -c . "$work/log.err")" = 1 ] && grep -q "^error: writing the training log.*No space left on device" "$work/log.err" &&
    echo "ok: a training log into a full disk" || fail "a log into a full disk: $(cat "$work/log.err")"
fi
free_disk

echo "$failures failed"
[ $failures -eq 0 ]
