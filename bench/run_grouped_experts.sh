#!/usr/bin/env bash
# Time in the routed experts (GroupedMLP forward and backward) of a 16-expert model with GEMM-sized experts: 4
# layers, hidden 512, 8 heads, seq 512, micro-batch 4 (2048 tokens), top-2, expert ffn 512 (SwiGLU), vocab 32000,
# alltoall dispatcher, --moe-grouped-gemm, mock data, 2 threads. Each run profiles iterations 5-6 (--profile) and
# prints the ms per iteration of "experts forward" and "experts backward" summed over the 4 layers, and the step
# time; the builds alternate (order swapped every round), ROUNDS rounds, medians.
# The experts' FLOPs per iteration: forward 2 * 4096 rows * 512 * 3 * 512 * 4 layers = 25.8 GFLOP, backward twice that.
# usage: bench/run_grouped_experts.sh BUILD [BUILD2] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
builds=()
rounds=3
for arg in "$@"; do
  if [[ "$arg" =~ ^[0-9]+$ ]]; then rounds=$arg; else builds+=("$arg"); fi
done
if [ ${#builds[@]} -lt 1 ] || [ ${#builds[@]} -gt 2 ]; then
  echo "usage: bench/run_grouped_experts.sh BUILD [BUILD2] [ROUNDS]" >&2
  exit 2
fi
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
args=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512
  --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope --attention-dropout 0
  --hidden-dropout 0 --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 512
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm --micro-batch-size 4 --global-batch-size 4 --lr 1e-4
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --log-interval 6 --eval-iters 0 --threads 2
  --train-iters 6 --profile --profile-step-start 4 --profile-step-end 6)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
declare -A fwd bwd step
for ((r = 0; r < rounds; ++r)); do
  order=("${builds[@]}")
  if ((r % 2 == 1)) && [ ${#builds[@]} -eq 2 ]; then order=("${builds[1]}" "${builds[0]}"); fi
  for build in "${order[@]}"; do
    "$build/moecore" train "${args[@]}" --profile-dir "$dir/p" >"$dir/log" 2>&1
    read -r f b < <(/usr/bin/python3 - "$dir/p/trace_rank0.json" <<'EOF'
import json, sys
events = json.load(open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
total = {"experts forward": 0.0, "experts backward": 0.0}
for ev in events:
    if ev.get("ph") == "X" and ev["name"] in total:
        total[ev["name"]] += ev["dur"] / 1000.0 / 2  # two iterations
print(f"{total['experts forward']:.1f} {total['experts backward']:.1f}")
EOF
    )
    s=$(sed -n 's/.*iteration *6\/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p' "$dir/log")
    rm -rf "$dir/p"
    echo "round $r $build: experts forward $f ms, backward $b ms per iteration; step $s ms (mean of iterations 2-6)"
    fwd[$build]+="$f "
    bwd[$build]+="$b "
    step[$build]+="$s "
  done
done
median() { echo "$1" | tr ' ' '\n' | grep -v '^$' | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
for build in "${builds[@]}"; do
  f=$(median "${fwd[$build]}")
  b=$(median "${bwd[$build]}")
  echo "$build median: experts forward $f ms ($(awk -v t="$f" 'BEGIN {printf "%.0f", 25.77e3 / t}') GFLOP/s)," \
    "backward $b ms ($(awk -v t="$b" 'BEGIN {printf "%.0f", 51.54e3 / t}') GFLOP/s), step $(median "${step[$build]}") ms"
done
