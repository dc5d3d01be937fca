#!/usr/bin/env bash
# Communication overlap on the TP2 x EP2 demo (4 processes; the demo model with shared experts, alltoall dispatcher):
# the same run without overlap, with --moe-shared-expert-overlap, with --overlap-grad-reduce and with both, ROUNDS
# times in turn. Per run, from the log's [comm] line (iterations 5-8, max over ranks) the step time and the
# all-to-all and gradient-reduce shares; from rank 0's --profile trace of iterations 7-8: how long the gradient
# buckets were in flight, how much of it the training thread spent waiting for them (exposed), and the overlapped
# rest.
# usage: bench/run_overlap.sh BUILD [ROUNDS] [BUCKET_ELEMENTS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
rounds=${2:-2}
bucket=${3:-1000000}
mpirun=$(command -v mpirun)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1 /proc/loadavg)"
args=()
while read -r flag value; do
  case "$flag" in --train-iters | --log-interval | --eval-interval | --eval-iters | --split | --threads) continue ;; esac
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
args+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --train-iters 8 --log-interval 4
  --lr-warmup-iters 1 --eval-iters 0 --tensor-model-parallel-size 2 --sequence-parallel
  --expert-model-parallel-size 2 --moe-shared-expert-intermediate-size 256
  --ddp-bucket-size "$bucket" --profile --profile-step-start 6 --profile-step-end 8)
declare -A variants=(
  [none]=""
  [shared]="--moe-shared-expert-overlap"
  [grad]="--overlap-grad-reduce"
  [both]="--moe-shared-expert-overlap --overlap-grad-reduce"
)
summary() {
  /usr/bin/python3 - "$1" "$2" <<'PY'
import json, re, sys
log, trace = open(sys.argv[1]).read(), json.load(open(sys.argv[2]))["traceEvents"]
line = [l for l in log.splitlines() if "[comm]" in l][-1]
step = float(re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", [l for l in log.splitlines() if "iteration        8/" in l][-1]).group(1))
def share(kind):
    m = re.search(kind + r" ([0-9.]+) / ([0-9.]+)%", line)
    return f"{m.group(1)} ms ({m.group(2)}%)" if m else "-"
tracks = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
X = [e for e in trace if e["ph"] == "X"]
flight = [e for e in X if tracks[e["tid"]].startswith("comm in flight") and "grad reduce" in e["name"]]
exposed = [e for e in X if tracks[e["tid"]] == "training" and e["name"] == "grad-reduce"]
# the union of the buckets' in-flight intervals, and its part covered by the waits
def union(iv):
    out = []
    for b, e in sorted(iv):
        if out and b <= out[-1][1]: out[-1][1] = max(out[-1][1], e)
        else: out.append([b, e])
    return out
fl = union([(e["ts"], e["ts"] + e["dur"]) for e in flight])
wt = union([(e["ts"], e["ts"] + e["dur"]) for e in exposed])
inter = sum(max(0, min(a[1], b[1]) - max(a[0], b[0])) for a in fl for b in wt)
total = sum(e - b for b, e in fl)
print(f"step {step:.1f} ms | all-to-all {share('all-to-all')} | grad-reduce {share('grad-reduce')} | "
      f"buckets in flight {total / 2e3:.1f} ms/iter, waited {inter / 2e3:.1f}, overlapped {(total - inter) / 2e3:.1f}")
PY
}
for ((r = 0; r < rounds; ++r)); do
  for v in none shared grad both; do
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 "$mpirun" --allow-run-as-root --oversubscribe -np 4 "$build/moecore" train "${args[@]}" \
      ${variants[$v]} --threads 1 --profile-dir "$work/$v" >"$work/$v.log" 2>&1 || { tail -5 "$work/$v.log"; exit 1; }
    echo "round $r $v: $(summary "$work/$v.log" "$work/$v/trace_rank0.json")"
  done
done
