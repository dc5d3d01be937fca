#!/usr/bin/env bash
# Ranks of one job started with different flags (mpirun's MPMD syntax gives each rank its own command line) stop at
# start-up with one line naming the first differing flag, on every rank, with a non-zero exit; no hang.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
command -v mpirun >/dev/null || { echo "skipped: no mpirun"; exit 0; }
base=("${quick_dense[@]}" --mock-data)
mpmd() {  # mpmd "rank 0 flags" "rank 1 flags": a 2-rank job
  # shellcheck disable=SC2086
  timeout 120 env OMP_NUM_THREADS=1 mpirun -q --allow-run-as-root --oversubscribe \
    -np 1 "$bin" train "${base[@]}" $1 : -np 1 "$bin" train "${base[@]}" $2
}

expect_error "ranks disagree on --seed: rank 0 has 1, rank 1 has 2" mpmd "--seed 1" "--seed 2"
expect_error "ranks disagree on --lr: rank 0 has 1e-3, rank 1 has 1e-2" mpmd "" "--lr 1e-2"
expect_error "ranks disagree on --bf16: rank 0 does not give it, rank 1 gives it" mpmd "" "--bf16"
# A differing per-rank flag is fine: both ranks train.
if ! mpmd "--threads 1" "--threads 2" >"$work/threads.log" 2>&1; then
  cat "$work/threads.log"; echo "FAIL: --threads may differ between ranks"; failures=$((failures + 1))
else
  echo "ok: --threads may differ"
fi
[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "e2e ok"
