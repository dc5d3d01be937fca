#!/usr/bin/env bash
# LatentMoE's dispatch traffic: the demo model (hidden 192) under EP2 (2 processes, alltoall dispatcher, routing forced
# to balance so every run moves the same rows) with the routed experts on the hidden size and in latent widths of 96
# and 48 (--moe-latent-size). Reported from the [comm] line, iterations 4-6: the all-to-all MB each rank sends per
# iteration and its time, the step time, and the bytes' ratio to the run without LatentMoE (expected about
# latent / hidden: the rows shrink, the probabilities sent beside them do not).
# usage: bench/run_latent_bytes.sh BUILD
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
mpirun=$(command -v mpirun)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=bench/demo_args.sh
source bench/demo_args.sh
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1 /proc/loadavg)"
demo_args --train-iters --log-interval --eval-interval --eval-iters --split
args+=(--train-iters 6 --log-interval 3 --eval-iters 0 --lr-warmup-iters 1 --expert-model-parallel-size 2
  --moe-router-force-load-balancing)
printf "%-8s %12s %12s %12s %8s\n" latent "a2a MB/iter" "a2a ms" "step (ms)" ratio
base=""
for latent in 0 96 48; do
  lflags=()
  [ "$latent" -gt 0 ] && lflags=(--moe-latent-size "$latent")
  OMP_NUM_THREADS=1 "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$build/moecore" train "${args[@]}" \
    --threads 1 "${lflags[@]}" >"$work/$latent.log" 2>&1 || { tail -5 "$work/$latent.log"; exit 1; }
  read -r mb ms step < <(/usr/bin/python3 - "$work/$latent.log" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
comm = text[text.rfind("[comm]"):].splitlines()[0]
m = re.search(r"all-to-all ([0-9.]+) / [0-9.]+% / ([0-9.e+]+) MB", comm)
step = re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)[-1]
print(m.group(2), m.group(1), step)
PY
)
  [ -z "$base" ] && base=$mb
  printf "%-8s %12s %12s %12s %8.3f\n" "${latent/#0/none}" "$mb" "$ms" "$step" "$(echo "$mb / $base" | bc -l)"
done
