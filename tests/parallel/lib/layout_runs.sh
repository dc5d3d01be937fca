# Sourced by the checkpoint layout tests. The caller sets bin, mpirun and model (the model's flags).
# run NP LOG ARGS...: `moecore train "${model[@]}" ARGS...` in one process or under mpirun -np NP, its log in LOG.
# losses LOG: the lm losses of iterations 4-6; close_losses NAME REF OTHER: both logs' within 1e-5 relative.
run() {
  local np=$1 log=$2
  shift 2
  if [ "$np" = 1 ]; then
    "$bin" train "${model[@]}" "$@" >"$log" 2>&1 || { cat "$log"; echo "FAIL: run failed ($log)"; exit 1; }
  else
    "$mpirun" --allow-run-as-root --oversubscribe -np "$np" "$bin" train "${model[@]}" "$@" >"$log" 2>&1 ||
      { cat "$log"; echo "FAIL: run failed ($log)"; exit 1; }
  fi
}
losses() { grep -E "iteration +[4-6]/" "$1" | sed -E 's/.*lm loss: ([0-9.E+-]+).*/\1/'; }
close_losses() {
  paste <(losses "$2") <(losses "$3") | awk -v name="$1" '
    { n++; d = $1 - $2; if (d < 0) d = -d; r = d / ($1 < 0 ? -$1 : $1); if (r > worst) worst = r }
    END { if (n != 3 || worst > 1e-5) { printf "FAIL: %s: %d losses, worst relative difference %.3g\n", name, n, worst; exit 1 }
          printf "ok: %s: losses within %.3g relative\n", name, worst }'
}
