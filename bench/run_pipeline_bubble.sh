#!/usr/bin/env bash
# Pipeline bubble, measured against the analytic fraction: an 8-layer model (the demo model's layers, vocabulary 1024
# so that the loss stage is not much heavier than the others) trained with 1F1B and with the interleaved schedule
# (2 virtual stages per rank) on PP 2 (2 processes: one core each) and PP 4 (4 processes on this machine's cores),
# M = 4 and 8 micro-batches per step. From every rank's --profile trace of iterations 5-6: the share of the step a
# rank spends waiting for a neighbour's activation or gradient (`pipeline-wait` events), averaged over the ranks;
# beside it the analytic bubble (p-1)/(m+p-1) for 1F1B and (p-1)/(v m+p-1) interleaved (Narayanan et al. 2021,
# Megatron's schedules), which assumes equal stages and free communication.
# usage: bench/run_pipeline_bubble.sh BUILD [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
rounds=${2:-1}
mpirun=$(command -v mpirun)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1 /proc/loadavg)"
args=()
while read -r flag value; do
  case "$flag" in --train-iters | --log-interval | --eval-interval | --eval-iters | --split | --threads | \
    --micro-batch-size | --global-batch-size | --num-layers) continue ;; esac
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
args+=(--num-layers 8 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --train-iters 6 --log-interval 6
  --lr-warmup-iters 1 --eval-iters 0 --micro-batch-size 2 --profile --profile-step-start 4 --profile-step-end 6)
printf "%-4s %-12s %3s %14s %10s %14s\n" PP schedule M "step (ms)" analytic "measured wait"
for ((r = 0; r < rounds; ++r)); do
  for pp in 2 4; do
    for vpp in 1 2; do
      for m in 4 8; do
        name="pp${pp}_vpp${vpp}_m${m}"
        vflags=()
        if [ "$vpp" -gt 1 ]; then vflags=(--num-virtual-stages-per-pipeline-rank "$vpp"); fi
        ranks=$(seq -s ' ' 0 $((pp - 1)))
        # shellcheck disable=SC2086
        OMP_NUM_THREADS=1 "$mpirun" --allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1 -np "$pp" \
          "$build/moecore" train "${args[@]}" --threads 1 --global-batch-size $((2 * m)) \
          --pipeline-model-parallel-size "$pp" "${vflags[@]}" --profile-ranks $ranks \
          --profile-dir "$work/$name" >"$work/$name.log" 2>&1 || { tail -5 "$work/$name.log"; exit 1; }
        /usr/bin/python3 - "$work/$name" "$pp" "$vpp" "$m" "$work/$name.log" <<'PY'
import json, pathlib, re, sys
folder, p, v, m, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
step = float(re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", open(log).read()).group(1))
shares = []
for f in sorted(pathlib.Path(folder).glob("trace_rank*.json")):
    events = [e for e in json.loads(f.read_text())["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in events if e["name"] == "optimizer step"]
    begin = min(e["ts"] for e in events if e["name"].startswith("forward"))
    end = max(e["ts"] + e["dur"] for e in steps)
    waited = sum(e["dur"] for e in events if e["name"] == "pipeline-wait")
    shares.append(waited / (end - begin))
analytic = (p - 1) / (v * m + p - 1)
print(f"{p:<4} {'1F1B' if v == 1 else f'interleaved{v}':<12} {m:3} {step:14.1f} {analytic:10.3f} "
      f"{sum(shares) / len(shares):14.3f}   per rank: {' '.join(f'{s:.3f}' for s in shares)}")
PY
      done
    done
  done
done
