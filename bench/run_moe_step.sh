#!/usr/bin/env bash
# MoE training step, moecore against its PyTorch twin, side by side in one run on this machine. Both sides build the
# model from one list of `moecore train` flags (bench/torch_train_step.py --megatron reads the same flags into the
# oracle twin, tests/oracle/twin.py + twin_moe.py: plain eager PyTorch, a Python loop over the experts) and run the
# same step: forward and backward of each micro-batch, global-norm clip 1.0, AdamW. Two models:
#   e16:   4 layers, hidden 512, 8 heads (no GQA), seq 512, batch 4, 16 experts (ffn 512) top-2, vocab 32000,
#          RMSNorm, SwiGLU, RoPE, no biases, dropout 0, alltoall dispatcher, grouped GEMM;
#   demo:  configs/demo.args as it trains (mock data, vocab 50256; micro-batch 4, global batch 8).
# Per round (sides alternating which goes first): the fp32 GEMM peak (build/bench/bench_gemm 2 --peak, best of
# OpenBLAS and oneDNN at 2048^3) and torch.matmul at 2048^3; then per model one process per side, each running
# STEPS steps after 1 warm-up step and timing each (moecore: `elapsed time per iteration` at --log-interval 1).
# Step time: the median over all timed steps of all rounds (the machine is shared: bursts of load from elsewhere
# hit single steps). Peak memory: the process's max resident set size (getrusage of the child, the same wrapper for
# both), the largest over the rounds. FLOPs per step: Megatron's formula as moecore logs it (its logged throughput x
# time must match the formula evaluated on the twin's config), applied to both sides' times.
# Prints a markdown table.
# usage: bench/run_moe_step.sh [BUILD_DIR] [ROUNDS] [STEPS]   (defaults: build 3 4; ~1 minute per round when idle)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-3}
steps=${3:-4}
threads=2
py=/usr/bin/python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cpu=$(lscpu | sed -n 's/^Model name: *//p')
isa=$(for f in avx2 avx512f avx512_bf16 amx_tile; do grep -qw "$f" /proc/cpuinfo && printf ' %s' "$f"; done || true)
# Debian's OpenBLAS (PyTorch's BLAS here) picks its kernels by CPU model and runs generic ones on CPUs it does not
# know, several times slower (bench/RESULTS.md); both sides run with the kernel family of this CPU's instruction set.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  case "$isa" in *avx512f*) export OPENBLAS_CORETYPE=SkylakeX ;; *avx2*) export OPENBLAS_CORETYPE=Haswell ;; esac
fi
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $cpu, ISA:${isa:- no avx2}, $threads threads, $rounds rounds x $steps steps," \
  "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-}"

# The models as moecore flags (the twin reads the same list; it ignores the flags that only steer the run).
run_flags=(--mock-data --tokenizer-type NullTokenizer --eval-iters 0 --lr-warmup-iters 1 --threads "$threads")
# shellcheck source=bench/moe_step_models.sh
source bench/moe_step_models.sh

# measured RSS_FILE CMD...: runs CMD, writes its peak resident set size (MiB) to RSS_FILE.
measured() {
  "$py" -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024))
sys.exit(rc)' "$@"
}
fail() {
  echo "run_moe_step: $1" >&2
  [ -n "${2:-}" ] && tail -20 "$2" >&2
  exit 1
}
# One line per process: model side round ms_per_step,... rss_mib params, then
# moecore: its logged TFLOP/s per step,...; PyTorch: FLOPs per step (the formula), tokens per step, torch version.
results=$work/results.tsv

run_moecore() {  # NAME FLAGS...
  local name=$1 log=$work/$1.moecore.log
  shift
  measured "$work/rss" "$build/moecore" train "$@" --train-iters $((steps + 1)) --log-interval 1 >"$log" 2>&1 ||
    fail "moecore train failed ($name)" "$log"
  local lines ms tflops params
  lines=$(grep 'iteration *[0-9]*/' "$log" | tail -n +2) # iteration 1 is the warm-up
  [ "$(wc -l <<<"$lines")" -eq "$steps" ] || fail "expected $steps iteration lines after the first ($name)" "$log"
  ms=$(sed -n 's/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p' <<<"$lines" | paste -sd,)
  tflops=$(sed -n 's/.*(TFLOP\/s\/GPU): \([0-9.]*\).*/\1/p' <<<"$lines" | paste -sd,)
  params=$(sed -n 's/^> number of parameters: \([0-9]*\).*/\1/p' "$log")
  printf '%s\tmoecore\t%s\t%s\t%s\t%s\t%s\n' "$name" "$round" "$ms" "$(cat "$work/rss")" "$params" \
    "$tflops" >>"$results"
  echo "  $name moecore: steps $ms ms (TFLOP/s logged $tflops), peak RSS $(cat "$work/rss") MiB, $params parameters"
}

run_torch() {  # NAME FLAGS...
  local name=$1 out=$work/$1.torch.json
  shift
  measured "$work/rss" "$py" bench/torch_train_step.py --steps "$steps" --warmup 1 --megatron "$@" >"$out" 2>"$out.err" ||
    fail "torch_train_step.py failed ($name)" "$out.err"
  "$py" -c 'import json, sys
r = json.load(open(sys.argv[1]))
ms = ",".join(map(str, r["steps_ms"]))
print("\t".join(map(str, [sys.argv[2], "pytorch", sys.argv[3], ms, sys.argv[4], r["params"], r["flops_per_step"],
                          r["tokens_per_step"], r["impl"].split()[-1]])))
print("  %s pytorch: steps %s ms, peak RSS %s MiB, %d parameters, loss %.3f -> %.3f" % (
    sys.argv[2], ms, sys.argv[4], r["params"], r["first_loss"], r["loss"]), file=sys.stderr)
' "$out" "$name" "$round" "$(cat "$work/rss")" >>"$results"
}

same_params() {  # NAME: both sides built a model with the same number of parameters, or stop here
  local counts
  counts=$(awk -F'\t' -v m="$1" '$1 == m {print $6}' "$results" | sort -u)
  [ "$(wc -l <<<"$counts")" -eq 1 ] ||
    fail "$1: moecore and the PyTorch twin have different parameter counts ($(tr "\n" " " <<<"$counts")): not the same model"
}

peaks=$work/peaks.tsv  # round peak_gflops openblas onednn torch_matmul
for ((round = 0; round < rounds; ++round)); do
  echo "round $round"
  gemm=$("$build/bench/bench_gemm" "$threads" --peak)
  matmul=$("$py" -c 'import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
a @ b
reps, start = 0, time.perf_counter()
while time.perf_counter() - start < 1.0:
    a @ b
    reps += 1
print("%.1f" % (2 * 2048**3 * reps / (time.perf_counter() - start) / 1e9))' "$threads")
  echo "  GEMM 2048^3: $gemm; torch.matmul $matmul GFLOP/s"
  printf '%s\t%s\t%s\t%s\t%s\n' "$round" "$(awk '{print $2}' <<<"$gemm")" "$(awk '{print $4}' <<<"$gemm")" \
    "$(awk '{print $6}' <<<"$gemm")" "$matmul" >>"$peaks"
  for model in e16 demo; do
    if [ "$model" = e16 ]; then flags=("${e16[@]}"); else flags=("${demo[@]}"); fi
    if ((round % 2 == 0)); then
      run_moecore "$model" "${flags[@]}"
      run_torch "$model" "${flags[@]}"
    else
      run_torch "$model" "${flags[@]}"
      run_moecore "$model" "${flags[@]}"
    fi
    same_params "$model"
  done
done

"$py" - "$results" "$peaks" "$cpu" "$rounds" "$steps" <<'EOF'
import csv, statistics, sys

rows = list(csv.reader(open(sys.argv[1]), delimiter="\t"))
peaks = list(csv.reader(open(sys.argv[2]), delimiter="\t"))
cpu, rounds, steps = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
peak = max(float(p[1]) for p in peaks)
best = max(peaks, key=lambda p: float(p[1]))
print(f"\nfp32 GEMM peak, 2048^3, 2 threads, best of the libraries and of {rounds} rounds: {peak:.1f} GFLOP/s "
      f"(that round: OpenBLAS {best[2]}, oneDNN {best[3]}; per round: {', '.join(p[1] for p in peaks)}); "
      f"torch.matmul (information): {max(float(p[4]) for p in peaks):.1f} GFLOP/s "
      f"(per round: {', '.join(p[4] for p in peaks)})")


def floats(text):
    return [float(v) for v in text.split(",")]


table = ["| model | parameters | tokens/step | GFLOP/step | implementation | ms/step | tokens/s | model GFLOP/s "
         "| of GEMM peak | peak RSS (MiB) | tokens/s vs PyTorch |",
         "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
ok = True
for model in ("e16", "demo"):
    runs = {s: [r for r in rows if r[0] == model and r[1] == s] for s in ("moecore", "pytorch")}
    params = {int(r[5]) for r in runs["moecore"] + runs["pytorch"]}
    print(f"{model}: parameters moecore {sorted({int(r[5]) for r in runs['moecore']})}, "
          f"PyTorch twin {sorted({int(r[5]) for r in runs['pytorch']})}")
    if len(params) != 1:
        print(f"run_moe_step: {model}: the parameter counts differ: not the same model", file=sys.stderr)
        ok = False
        continue
    # FLOPs per step: Megatron's formula evaluated on the twin's config must give the throughput moecore logs at
    # moecore's step times (both printed rounded: TFLOP/s to 3 decimals below 1, ms to 0.1), so both sides are
    # timed against the FLOPs moecore counts.
    flops, tokens = float(runs["pytorch"][0][6]), int(runs["pytorch"][0][7])
    for r in runs["moecore"]:
        for ms, logged in zip(floats(r[3]), floats(r[6])):
            half_unit = 0.0005 if logged < 1 else 0.05
            if not flops / ((ms + 0.05) * 1e9) - half_unit <= logged <= flops / ((ms - 0.05) * 1e9) + half_unit:
                print(f"run_moe_step: {model}: moecore logs {logged} TFLOP/s at {ms} ms; the formula's "
                      f"{flops:.4g} FLOPs per step give {flops / (ms * 1e9):.4f}", file=sys.stderr)
                ok = False
    ms = {s: statistics.median(t for r in runs[s] for t in floats(r[3])) for s in runs}
    rss = {s: max(int(r[4]) for r in runs[s]) for s in runs}
    print(f"{model}: {flops / 1e9:.2f} GFLOP/step; median ms/step per round: moecore "
          f"{', '.join('%.0f' % statistics.median(floats(r[3])) for r in runs['moecore'])}, PyTorch "
          f"{', '.join('%.0f' % statistics.median(floats(r[3])) for r in runs['pytorch'])}")
    for s, name in (("moecore", "moecore"), ("pytorch", f"PyTorch {runs['pytorch'][0][8]} eager")):
        gflops = flops / ms[s] / 1e6
        table.append(f"| {model} | {params.copy().pop() / 1e6:.2f}M | {tokens} | {flops / 1e9:.1f} | {name} "
                     f"| {ms[s]:.0f} | {tokens / ms[s] * 1e3:.0f} | {gflops:.1f} | {gflops / peak:.1%} | {rss[s]} "
                     f"| {ms['pytorch'] / ms[s]:.2f}x |")
print()
print("\n".join(table))
print(f"\nms/step: median of {rounds} rounds x {steps} steps after a warm-up step; GEMM peak {peak:.1f} GFLOP/s "
      f"(fp32 2048^3, 2 threads, best library); {cpu}.")
sys.exit(0 if ok else 1)
EOF
