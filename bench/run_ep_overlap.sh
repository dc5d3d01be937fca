#!/usr/bin/env bash
# Megatron's EP all-to-all overlap (--overlap-moe-expert-parallel-comm, combined 1F1B) against a slower link: the demo
# model under --bf16 with EP2 (2 processes) and EP4 (4 processes), 8 micro-batches per rank (micro-batch size 1),
# every all-to-all of the alltoall dispatcher held until DELAY microseconds after its start (MOECORE_EP_A2A_DELAY_US),
# without and with the overlap (and --delay-wgrad-compute), ROUNDS times in turn. Per run, from the last log line
# (iterations 5-8): the step time and the exposed all-to-all time (the [comm] line: time spent waiting for the
# exchanges, max over ranks), and the exchanges' whole delay per iteration for scale.
# usage: bench/run_ep_overlap.sh BUILD [ROUNDS] [DELAY_US]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
rounds=${2:-1}
delay=${3:-1500}
mpirun=$(command -v mpirun)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1 /proc/loadavg)"
# shellcheck source=bench/demo_args.sh
source bench/demo_args.sh
demo_args --train-iters --log-interval --eval-interval --eval-iters --split --micro-batch-size --global-batch-size
args+=(--train-iters 8 --log-interval 4 --lr-warmup-iters 1 --eval-iters 0 --bf16 --micro-batch-size 1 --threads 1)
summary() {
  /usr/bin/python3 - "$1" <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
last = [l for l in lines if "iteration        8/" in l][-1]
comm = [l for l in lines if "[comm]" in l][-1]
step = float(re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", last).group(1))
a2a = re.search(r"all-to-all ([0-9.]+) / ([0-9.]+)%", comm)
print(f"{step:8.1f} ms/iter | all-to-all exposed {float(a2a.group(1)):7.1f} ms ({a2a.group(2)}%)")
PY
}
for ((r = 0; r < rounds; ++r)); do
  for ep in 2 4; do
    for d in 0 "$delay"; do
      for overlap in no yes; do
        extra=(--expert-model-parallel-size "$ep" --global-batch-size $((ep * 8)))
        if [ "$overlap" = yes ]; then extra+=(--overlap-moe-expert-parallel-comm --delay-wgrad-compute); fi
        log="$work/ep$ep-$d-$overlap.log"
        OMP_NUM_THREADS=1 MOECORE_EP_A2A_DELAY_US=$d "$mpirun" --allow-run-as-root --oversubscribe -np "$ep" \
          -x OMP_NUM_THREADS -x MOECORE_EP_A2A_DELAY_US "$build/moecore" train "${args[@]}" "${extra[@]}" \
          >"$log" 2>&1 || { tail -5 "$log"; exit 1; }
        # 4 MoE layers x 8 micro-batches x 4 exchanges waited for (dispatch, combine; their gradients)
        echo "round $r EP$ep delay ${d}us overlap $overlap: $(summary "$log") | delay per iteration $((128 * d / 1000)) ms"
      done
    done
  done
done
