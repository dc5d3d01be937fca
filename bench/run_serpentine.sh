#!/usr/bin/env bash
# The attention-cost (serpentine) micro-batch order on a skewed length distribution (moecore's --rl-microbatch-order
# serpentine; the Megatron-Core MoE report's RL chapter: "orders micro-batches in a small-to-large-to-small serpentine
# pattern to reduce synchronization bubbles across parallelism dimensions; the metric is the mini-batch sum of squared
# sequence lengths"). 256 samples whose lengths are skewed as RL rollouts are (most short, a few near the 1024-token
# maximum; the samples are made below), trained with the demo model's layers on 1024-token
# sequences in two pipeline stages (2 processes, one core each), 32 samples per step, each sample its own micro-batch
# in the order the samples come (without packing, where the per-micro-batch attention cost varies most) and packed
# (Megatron-RL's packer, whose next-fit-decreasing bins already come largest first). "packing" is the order the
# samples or bins come in, "serpentine" the attention-cost order. Reported
# per order: the step time and the [comm] line's pipeline-wait (time a stage waits for its neighbour's activation or
# gradient, max over ranks) averaged over iterations 3-8, and the same for context parallelism 2 (both ranks of a CP
# group run the same micro-batch, so the order cannot change their waiting: a control).
# usage: bench/run_serpentine.sh BUILD [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
rounds=${2:-1}
mpirun=$(command -v mpirun)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1 /proc/loadavg)"
/usr/bin/python3 - "$work/samples.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as out:
    for _ in range(256):
        u = rng.random()
        n = rng.randint(16, 128) if u < 0.7 else rng.randint(128, 512) if u < 0.93 else rng.randint(512, 1024)
        out.write(json.dumps({"tokens": [rng.randrange(1000) for _ in range(n)]}) + "\n")
PY
args=()
while read -r flag value; do
  case "$flag" in --train-iters | --log-interval | --eval-interval | --eval-iters | --split | --seq-length | \
    --max-position-embeddings | --micro-batch-size | --global-batch-size | --moe-aux-loss-coeff | \
    --moe-router-load-balancing-type) continue ;; esac
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
args+=(--seq-length 1024 --max-position-embeddings 1024 --tokenizer-type NullTokenizer --vocab-size 1000
  --sample-data-path "$work/samples.jsonl" --micro-batch-size 1 --global-batch-size 32 --calculate-per-token-loss
  --eval-iters 0 --train-iters 8 --log-interval 1 --lr-warmup-iters 1 --moe-router-load-balancing-type none
  --moe-aux-loss-coeff 0)
# summary LOG: mean step ms and mean pipeline-wait / context-parallel ms over iterations 3-8.
summary() {
  /usr/bin/python3 - "$1" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
steps = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)][2:]
def kind(name):
    return [float(x) for x in re.findall(name + r" ([0-9.]+) /", text)][2:]
wait, cp = kind("pipeline-wait"), kind("context-parallel")
mean = lambda v: sum(v) / len(v) if v else 0.0
print(f"{mean(steps):10.1f} {mean(wait):12.1f} {mean(cp):12.1f}")
PY
}
printf "%-10s %-8s %-11s %10s %12s %12s\n" layout packing order "step (ms)" "p-wait (ms)" "cp (ms)"
for ((r = 0; r < rounds; ++r)); do
  for layout in pp2 cp2; do
    lflags=(--pipeline-model-parallel-size 2)
    [ "$layout" = cp2 ] && lflags=(--context-parallel-size 2)
    for packing in off on; do
      pflags=()
      [ "$packing" = on ] && pflags=(--rl-use-sequence-packing)
      for order in packing serpentine; do
        name="${layout}_${packing}_${order}"
        OMP_NUM_THREADS=1 "$mpirun" --allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1 -np 2 \
          "$build/moecore" train "${args[@]}" --threads 1 "${lflags[@]}" "${pflags[@]}" --rl-microbatch-order "$order" \
          >"$work/$name.log" 2>&1 || { tail -5 "$work/$name.log"; exit 1; }
        printf "%-10s %-8s %-11s %s\n" "$layout" "$packing" "$order" "$(summary "$work/$name.log")"
      done
    done
  done
done
