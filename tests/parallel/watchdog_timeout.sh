#!/usr/bin/env bash
# --distributed-timeout-minutes: a 2-rank MoE run (configs/mixtral-tiny.args, DP2) whose rank 1 is stopped with
# SIGSTOP once training has logged an iteration must end within the timeout + 30 s: rank 0's wait passes the
# timeout, it prints one line naming the collective, its group and rank 1 (it did not arrive, or, stopped inside the
# collective, arrived but made no progress), and the job is
# aborted (non-zero exit). Without the watchdog rank 0 would wait forever. Exits 77 (skipped) without mpirun.
set -uo pipefail
bin=$1
src=$2
work=$3
mpirun=${4:-mpirun}
rm -rf "$work" && mkdir -p "$work"
command -v "$mpirun" >/dev/null || { echo "skipped: no mpirun"; exit 77; }
export OMP_NUM_THREADS=1
timeout_minutes=0.1
bound=$((6 + 30))  # the timeout in seconds + 30 s

source "$src/tests/recipe.sh"
mapfile -t args < <(recipe "$src" mixtral-tiny)

# `timeout` guards against a hang of the whole job; the bound checked below is much shorter.
timeout -s KILL 300 "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" train "${args[@]}" \
  --train-iters 100000 --log-interval 1 --eval-iters 0 --distributed-timeout-minutes "$timeout_minutes" \
  >"$work/log" 2>&1 &
guard=$!

# The processes: mpirun is the child of `timeout`, the ranks are mpirun's children (rank 1 by Open MPI's
# environment). Recorded while the job runs, so the cleanup finds them even once their parents are gone.
launchers=""
ranks=""
rank1=""
find_processes() {
  launchers=$(pgrep -P "$guard")
  ranks=$(for launcher in $launchers; do pgrep -P "$launcher"; done)
}
cleanup() {
  # shellcheck disable=SC2086
  kill -KILL $ranks $launchers "$guard" 2>/dev/null
}
trap cleanup EXIT
fail() { echo "FAIL: $1"; tail -20 "$work/log"; exit 1; }

for _ in $(seq 240); do
  find_processes
  grep -qE ' iteration +[0-9]+/ +[0-9]+ \|' "$work/log" && break
  kill -0 "$guard" 2>/dev/null || fail "training ended before logging an iteration"
  sleep 0.5
done
grep -qE ' iteration +[0-9]+/ +[0-9]+ \|' "$work/log" || fail "no iteration logged within 120 s"
# Under load the process list read above may predate a rank's start: look again for a few seconds.
for _ in $(seq 20); do
  for child in $ranks; do
    if tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1'; then rank1=$child; fi
  done
  [ -n "$rank1" ] && break
  sleep 0.5
  find_processes
done
[ -n "$rank1" ] || fail "could not find rank 1's process"
kill -STOP "$rank1"
stopped=$SECONDS
echo "stopped rank 1 (pid $rank1)"

while kill -0 "$guard" 2>/dev/null && [ $((SECONDS - stopped)) -le $bound ]; do sleep 0.5; done
kill -0 "$guard" 2>/dev/null && fail "the job still ran $bound s after rank 1 was stopped (a hang)"
wait "$guard"
status=$?
echo "the job ended $((SECONDS - stopped)) s after rank 1 was stopped, exit status $status"
[ "$status" -ne 0 ] || fail "the job exited with status 0"
lines=$(grep -c '^error: collective' "$work/log")
[ "$lines" -eq 1 ] || fail "expected one watchdog line from rank 0, found $lines"
pattern="^error: collective [a-z_0-9]+ on process group [a-z_0-9/]+ \(ranks 0,1\) did not complete within "
pattern+="$timeout_minutes minutes: ranks 1 (did not arrive|arrived but made no progress \\(stopped, or busy outside MPI\\)) "
pattern+="\\(last collectives: .+\\)$"
grep -E '^error: collective' "$work/log"
grep -qE "$pattern" "$work/log" || fail "the watchdog line does not name the collective, group and missing rank"
echo "ok"
