#!/usr/bin/env bash
# Step time at fixed active parameters while the number of experts grows: the demo model (configs/demo.args, top-2,
# expert ffn 256, mock data, 2 threads) with E = 8, 64 and 256 experts, one process; ms per iteration averaged over
# iterations 6-10 (after warm-up), each (E, build) run ROUNDS times, the builds alternating (their order swapped every
# round), medians. With --profile, one more run per (E, build) with --profile over iterations 4-5 prints where the
# time goes (ms per iteration: router, experts, dispatch + combine, optimizer step + gradient clipping).
# usage: bench/run_expert_scaling.sh [--profile] BUILD [BUILD2] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
profile=0
if [ "${1:-}" = "--profile" ]; then
  profile=1
  shift
fi
builds=()
rounds=2
for arg in "$@"; do
  if [[ "$arg" =~ ^[0-9]+$ ]]; then rounds=$arg; else builds+=("$arg"); fi
done
if [ ${#builds[@]} -lt 1 ] || [ ${#builds[@]} -gt 2 ]; then
  echo "usage: bench/run_expert_scaling.sh [--profile] BUILD [BUILD2] [ROUNDS]" >&2
  exit 2
fi
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
args=()
while read -r flag value; do
  case "$flag" in --train-iters | --log-interval | --eval-interval | --eval-iters | --split | --num-experts) continue ;; esac
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
args+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --lr-warmup-iters 1 --eval-iters 0 --threads 2)
declare -A times
for ((r = 0; r < rounds; ++r)); do
  order=("${builds[@]}")
  if ((r % 2 == 1)) && [ ${#builds[@]} -eq 2 ]; then order=("${builds[1]}" "${builds[0]}"); fi
  for e in 8 64 256; do
    for build in "${order[@]}"; do
      t=$("$build/moecore" train "${args[@]}" --train-iters 10 --log-interval 5 --num-experts $e 2>&1 |
        sed -n 's/.*iteration *10\/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p')
      echo "round $r E=$e $build: $t ms/iteration"
      times[$e $build]+="$t "
    done
  done
done
for e in 8 64 256; do
  for build in "${builds[@]}"; do
    values=${times[$e $build]}
    median=$(echo "$values" | tr ' ' '\n' | grep -v '^$' | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}')
    echo "E=$e $build median: $median ms/iteration (rounds: $values)"
  done
done
if ((profile)); then
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
  for e in 8 64 256; do
    for build in "${builds[@]}"; do
      "$build/moecore" train "${args[@]}" --train-iters 6 --log-interval 6 --num-experts $e --profile \
        --profile-step-start 3 --profile-step-end 5 --profile-dir "$dir/p" >/dev/null 2>&1
      echo "E=$e $build profile (ms per iteration, iterations 4-5): $(/usr/bin/python3 - "$dir/p/trace_rank0.json" <<'EOF'
import collections, json, sys
events = json.load(open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
total = collections.defaultdict(float)
for ev in events:
    if ev.get("ph") == "X":
        total[ev["name"]] += ev["dur"] / 1000.0 / 2  # two iterations
parts = {"router": ["router forward", "router backward"], "experts": ["experts forward", "experts backward"],
         "dispatch+combine": ["dispatch", "combine", "combine backward", "dispatch backward"],
         "optimizer+clip": ["optimizer step", "clip grad norm"]}
print(", ".join(f"{name} {sum(total[n] for n in names):.1f}" for name, names in parts.items()))
EOF
)"
      rm -rf "$dir/p"
    done
  done
fi
