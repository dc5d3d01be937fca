#!/usr/bin/env bash
# Step time at fixed active parameters while the number of experts grows: the demo model (configs/demo.args, top-2,
# expert ffn 256, mock data, 2 threads) with E = 8, 64 and 256 experts, one process. Each (E, build) runs ROUNDS
# times, the builds alternating (their order swapped every round); every run profiles iterations 6-10 (--profile), so
# one run gives both the step time (the log's mean over iterations 6-10) and, from its trace over the same iterations,
# the optimizer step and the gradient clipping (its norm pass). Printed per E and build (medians over the rounds):
#   step            ms per iteration
#   fwd+bwd         step minus "optimizer step" minus "clip grad norm": forward, backward, gradient-buffer zeroing,
#                   gradient sync and the step's bookkeeping; and its ratio to E = 8 of the same build
#   parts           router, experts, dispatch + combine (each forward + backward) and "zero grads" (builds that trace it)
#   optimizer       ms, and bytes per second: the bytes AdamW must read and write per parameter (fp32: grad, param,
#                   exp_avg, exp_avg_sq read, param and both moments written, 28 B; --bf16: the fp32 main parameter
#                   instead of the param and the 16-bit model copy written too, 32 B) over the optimizer step's time
#                   (a build whose update also zeroes the gradients it consumed, as this tree's training step, writes
#                   4 B more per parameter: its own bytes per second are 32/28, or 36/32, of the printed figure); the
#                   clipping's norm pass reads every gradient once (4 B)
# against the copy bandwidth the planner probes (plan/cpu_probe.h: memcpy of 64 MiB, one thread) and the same copy on
# the run's 2 threads, both measured in this invocation by `bench_moe bandwidth` (bytes read + written per second).
# Each run waits (up to 3 minutes) for an idle second first: the machine may be shared.
# usage: bench/run_expert_scaling.sh [--bf16] BUILD [BUILD2] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
bf16=0
if [ "${1:-}" = "--bf16" ]; then
  bf16=1
  shift
fi
builds=()
rounds=2
for arg in "$@"; do
  if [[ "$arg" =~ ^[0-9]+$ ]]; then rounds=$arg; else builds+=("$arg"); fi
done
if [ ${#builds[@]} -lt 1 ] || [ ${#builds[@]} -gt 2 ]; then
  echo "usage: bench/run_expert_scaling.sh [--bf16] BUILD [BUILD2] [ROUNDS]" >&2
  exit 2
fi
for build in "${builds[@]}"; do
  if [ ! -x "$build/moecore" ]; then
    echo "run_expert_scaling.sh: no $build/moecore" >&2
    exit 2
  fi
done
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')," \
  "$(grep -o -w -E 'avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
args=()
while read -r flag value; do
  case "$flag" in --train-iters | --log-interval | --eval-interval | --eval-iters | --split | --num-experts) continue ;; esac
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
args+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --lr-warmup-iters 1 --eval-iters 0 --threads 2)
if ((bf16)); then args+=(--bf16); fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
bandwidth() {  # the first build with the probe's bench prints it
  for build in "${builds[@]}"; do
    if OMP_NUM_THREADS=2 "$build/bench/bench_moe" bandwidth 2>/dev/null; then return; fi
  done
  echo "copy bandwidth: no build has bench_moe bandwidth"
}
# On a shared machine: before each run, wait (up to 3 minutes) for a second in which the CPUs were at least 90% idle.
wait_idle() {
  for ((t = 0; t < 180; ++t)); do
    read -r _ u1 n1 s1 i1 w1 q1 r1 _ </proc/stat
    sleep 1
    read -r _ u2 n2 s2 i2 w2 q2 r2 _ </proc/stat
    busy=$(((u2 + n2 + s2 + q2 + r2) - (u1 + n1 + s1 + q1 + r1)))
    idle=$(((i2 + w2) - (i1 + w1)))
    if ((busy * 10 <= idle + busy)); then return; fi
  done
  echo "(the machine stayed busy for 3 minutes: this run shares it)"
}
bandwidth | tee "$dir/bandwidth_before"
for ((r = 0; r < rounds; ++r)); do
  order=("${builds[@]}")
  if ((r % 2 == 1)) && [ ${#builds[@]} -eq 2 ]; then order=("${builds[1]}" "${builds[0]}"); fi
  for e in 8 64 256; do
    for i in "${!order[@]}"; do
      build=${order[$i]}
      index=0
      if [ "$build" != "${builds[0]}" ]; then index=1; fi
      log="$dir/log_${r}_${e}_$index"
      wait_idle
      "$build/moecore" train "${args[@]}" --train-iters 10 --log-interval 5 --num-experts "$e" --profile \
        --profile-step-start 5 --profile-step-end 10 --profile-dir "$dir/p" >"$log" 2>&1
      mv "$dir/p/trace_rank0.json" "$dir/trace_${r}_${e}_$index.json"
      rm -rf "$dir/p"
      echo "round $r E=$e $build: $(sed -n 's/.*iteration *10\/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p' \
        "$log") ms/iteration"
    done
  done
done
bandwidth | tee "$dir/bandwidth_after"
/usr/bin/python3 - "$dir" "$rounds" "$bf16" "${builds[@]}" <<'EOF'
import collections, json, re, statistics, sys
folder, rounds, bf16, builds = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4:]
bytes_per_param = 32 if bf16 else 28
parts = {"router": ["router forward", "router backward"], "experts": ["experts forward", "experts backward"],
         "dispatch+combine": ["dispatch", "combine", "combine backward", "dispatch backward"],
         "zero grads": ["zero grads"]}
rows = collections.defaultdict(lambda: collections.defaultdict(list))
params = {}
traced = {}  # builds whose traces have the "zero grads" scope
for r in range(rounds):
    for e in (8, 64, 256):
        for index, build in enumerate(builds):
            log = open(f"{folder}/log_{r}_{e}_{index}").read()
            step = float(re.search(r"iteration +10/.*?elapsed time per iteration \(ms\): ([0-9.]+)", log).group(1))
            params[e] = int(re.search(r"number of parameters: (\d+)", log).group(1))
            events = json.load(open(f"{folder}/trace_{r}_{e}_{index}.json"))
            events = events["traceEvents"] if isinstance(events, dict) else events
            total = collections.defaultdict(float)
            for ev in events:
                if ev.get("ph") == "X":
                    total[ev["name"]] += ev["dur"] / 1000.0 / 5  # iterations 6-10
            traced[build] = traced.get(build, False) or "zero grads" in total
            row = rows[(e, build)]
            row["step"].append(step)
            row["optimizer"].append(total["optimizer step"])
            row["clip"].append(total["clip grad norm"])
            row["fwd+bwd"].append(step - total["optimizer step"] - total["clip grad norm"])
            for name, names in parts.items():
                row[name].append(sum(total[n] for n in names))
med = lambda values: statistics.median(values)
print(f"\nmedians over {rounds} rounds, ms per iteration (iterations 6-10); optimizer bytes/s at "
      f"{bytes_per_param} B per parameter{' (--bf16)' if bf16 else ''} (an update that also zeroes the gradients "
      f"writes 4 B more), the norm pass at 4 B")
print("| experts | build | parameters | step | fwd+bwd | vs E=8 | router | experts | dispatch+combine | zero grads | "
      "optimizer step | GB/s | clip (norm) | GB/s |")
print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for e in (8, 64, 256):
    for build in builds:
        row, base = rows[(e, build)], rows[(8, build)]
        n = params[e]
        opt, clip = med(row["optimizer"]), med(row["clip"])
        zero = f"{med(row['zero grads']):.1f}" if traced[build] else "-"
        print(f"| {e} | {build} | {n / 1e6:.1f}M | {med(row['step']):.1f} | {med(row['fwd+bwd']):.1f} | "
              f"{med(row['fwd+bwd']) / med(base['fwd+bwd']):.3f} | {med(row['router']):.1f} | {med(row['experts']):.1f} | "
              f"{med(row['dispatch+combine']):.1f} | {zero} | {opt:.1f} | "
              f"{n * bytes_per_param / opt / 1e6:.1f} | {clip:.1f} | {n * 4 / clip / 1e6:.1f} |")
for e in (8, 64, 256):
    for build in builds:
        print(f"E={e} {build} fwd+bwd per round: {' '.join(f'{v:.1f}' for v in rows[(e, build)]['fwd+bwd'])}")
EOF
