#!/usr/bin/env bash
# `moecore plan`'s time model against moecore's own steps (a benchmark: it times runs). The demo model
# (configs/demo.args, mock data) trains a few iterations under six layouts of one or two single-core ranks, and
# `moecore plan --gpu cpu` (this machine's probed GEMM rate and copy bandwidth, probed once and passed to every
# layout) must order the layouts as measured. Layouts whose measured times are within 25% of each other count as
# tied: a shared 2-core VM varies by about 10% from run to run. Run it alone (other load skews the timings).
# Usage: bench/run_plan_time.sh [BUILD_DIR]; exits 1 when a clearly ordered pair is planned the other way.
set -u
cd "$(dirname "$0")/.."
src=$PWD
bin=${1:-build}/moecore
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpirun=$(command -v mpirun) || { echo "needs mpirun"; exit 2; }
failures=0
source "$src/tests/e2e/lib/expect.sh"
source "$src/tests/e2e/lib/plan_runs.sh"
tie=1.25

mapfile -t train_flags < <(config_flags_without demo --split --lr-warmup-iters --train-iters --log-interval \
  --eval-interval --eval-iters)
mapfile -t model_flags < <(plan_flags demo)
vocab=(--tokenizer-type NullTokenizer --vocab-size 50256)
cluster=()
results="$work/results.txt"
: >"$results"

# measure NAME NP LAYOUT-FLAGS...: ms per iteration (the second logging interval) and the planned step time.
measure() {
  local name=$1 np=$2
  shift 2
  local log="$work/$name.train.log"
  if ! train_on "$np" "$log" "${train_flags[@]}" --mock-data "${vocab[@]}" --train-iters 4 --log-interval 2 \
    --lr-warmup-iters 1 --eval-interval 1000 --eval-iters 0 "$@"; then
    tail -5 "$log"
    fail "$name: moecore train failed ($log)"
    return
  fi
  local ms
  ms=$(grep 'elapsed time per iteration' "$log" | tail -1 | sed 's/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/')
  local plan_json="$work/$name.plan.json"
  if ! timeout 120 "$bin" plan "${model_flags[@]}" "${vocab[@]}" "$@" --num-gpus "$np" --gpu cpu "${cluster[@]}" \
    --json >"$plan_json" 2>"$work/$name.plan.err"; then
    fail "$name: moecore plan failed: $(head -c 300 "$work/$name.plan.err")"
    return
  fi
  if [ ${#cluster[@]} -eq 0 ]; then  # the first layout's probe serves every layout
    mapfile -t cluster < <(python3 -c '
import json, sys
c = json.load(open(sys.argv[1]))["cluster"]
for flag, key in [("--peak-tflops-bf16", "peak_tflops_bf16"), ("--peak-tflops-fp8", "peak_tflops_fp8"),
                  ("--peak-tflops-fp4", "peak_tflops_fp4"), ("--hbm-tbps", "hbm_tbps"),
                  ("--intra-domain-gbps", "intra_domain_gbps"), ("--inter-domain-gbps", "inter_domain_gbps")]:
    print(flag); print(repr(c[key]))' "$plan_json")
  fi
  local planned
  planned=$(python3 -c 'import json, sys; print(round(json.load(open(sys.argv[1]))["step_time_s"] * 1000))' "$plan_json")
  echo "$name $ms $planned" >>"$results"
  echo "$name (np $np $*): measured $ms ms, planned $planned ms"
}

measure one-process 1
measure dp2 2
measure tp2-sp 2 --tensor-model-parallel-size 2 --sequence-parallel
measure ep2 2 --expert-model-parallel-size 2
measure pp2 2 --pipeline-model-parallel-size 2
measure cp2 2 --context-parallel-size 2

verdict=$(python3 - "$results" "$tie" <<'PY'
import sys
rows = [line.split() for line in open(sys.argv[1])]
tie = float(sys.argv[2])
runs = {name: (float(ms), float(planned)) for name, ms, planned in rows}
bad, checked = [], 0
for a, (ma, pa) in runs.items():
    for b, (mb, pb) in runs.items():
        if ma * tie < mb:  # a is clearly faster than b
            checked += 1
            if not pa < pb:
                bad.append(f"{a} ({ma:.0f} ms) is faster than {b} ({mb:.0f} ms) but planned {pa:.0f} vs {pb:.0f} ms")
if checked == 0:
    bad.append("no two layouts differ by more than the tie margin: nothing to rank")
print(("FAIL " + "; ".join(bad)) if bad else f"ok {checked} ordered pairs agree")
PY
)
case $verdict in
  ok*) echo "${verdict#ok }" ;;
  *) fail "${verdict#FAIL }" ;;
esac
[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "the planned order agrees with the measured one"
