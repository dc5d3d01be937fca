#!/usr/bin/env bash
# MoE training step, moecore against its PyTorch twin, side by side in one run on this machine. Both sides build the
# model from one list of `moecore train` flags (bench/torch_train_step.py --megatron reads the same flags into the
# oracle twin, tests/oracle/twin.py + twin_moe.py: plain eager PyTorch, a Python loop over the experts) and run the
# same step: forward and backward of each micro-batch, global-norm clip 1.0, AdamW. Two models:
#   issue: 4 layers, hidden 512, 8 heads (no GQA), seq 512, batch 4, 16 experts (ffn 512) top-2, vocab 32000,
#          RMSNorm, SwiGLU, RoPE, no biases, dropout 0, alltoall dispatcher, grouped GEMM;
#   demo:  configs/demo.args as it trains (mock data, vocab 50256; micro-batch 4, global batch 8).
# Per round (sides alternating which goes first): the fp32 GEMM peak (build/bench/bench_gemm 2 --peak, best of
# OpenBLAS and oneDNN at 2048^3) and torch.matmul at 2048^3; then per model moecore (elapsed time per iteration of
# iterations 5-8) and PyTorch (median of 3 steps after 1 warm-up). Peak memory: the process's max resident set size
# (getrusage of the child, the same wrapper for both). FLOPs per step: Megatron's formula as moecore logs it
# (throughput x time, checked against the formula evaluated on the twin's config), applied to both sides' times.
# Prints a markdown table of the medians over the rounds.
# usage: bench/run_moe_step.sh [BUILD_DIR] [ROUNDS]   (defaults: build 2; about 3-5 minutes per round on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
rounds=${2:-2}
threads=2
py=/usr/bin/python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cpu=$(lscpu | sed -n 's/^Model name: *//p')
isa=$(for f in avx2 avx512f avx512_bf16 amx_tile; do grep -qw "$f" /proc/cpuinfo && printf ' %s' "$f"; done || true)
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $cpu, ISA:${isa:- no avx2}, $threads threads, $rounds rounds"

# The models as moecore flags (the twin reads the same list; it ignores the flags that only steer the run).
run_flags=(--mock-data --tokenizer-type NullTokenizer --eval-iters 0 --lr-warmup-iters 2 --threads "$threads")
issue=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512
  --micro-batch-size 4 --global-batch-size 4 --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 512
  --vocab-size 32000 --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0 --moe-token-dispatcher-type alltoall --moe-grouped-gemm
  --clip-grad 1.0 --lr 1e-4 --log-throughput "${run_flags[@]}")
demo=()
while read -r flag value; do
  case "$flag" in --train-iters | --log-interval | --eval-interval | --eval-iters | --split | --lr-warmup-iters) continue ;; esac
  demo+=("$flag")
  if [ -n "$value" ]; then demo+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
demo+=(--vocab-size 50256 "${run_flags[@]}")

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
# model side round ms rss_mib params, then moecore: its logged TFLOP/s; PyTorch: FLOPs per step (the formula), tokens
results=$work/results.tsv

run_moecore() {  # NAME FLAGS...
  local name=$1 log=$work/$1.moecore.log
  shift
  measured "$work/rss" "$build/moecore" train "$@" --train-iters 8 --log-interval 4 >"$log" 2>&1 ||
    fail "moecore train failed ($name)" "$log"
  local line ms tflops params
  line=$(grep 'iteration *8/' "$log") || fail "no iteration 8 line ($name)" "$log"
  ms=$(sed -n 's/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p' <<<"$line")
  tflops=$(sed -n 's/.*(TFLOP\/s\/GPU): \([0-9.]*\).*/\1/p' <<<"$line")
  params=$(sed -n 's/^> number of parameters: \([0-9]*\).*/\1/p' "$log")
  printf '%s\tmoecore\t%s\t%s\t%s\t%s\t%s\n' "$name" "$round" "$ms" "$(cat "$work/rss")" "$params" \
    "$tflops" >>"$results"
  echo "  $name moecore: $ms ms/step ($tflops TFLOP/s logged), peak RSS $(cat "$work/rss") MiB, $params parameters"
}

run_torch() {  # NAME FLAGS...
  local name=$1 out=$work/$1.torch.json
  shift
  measured "$work/rss" "$py" bench/torch_train_step.py --steps 3 --warmup 1 --megatron "$@" >"$out" 2>"$out.err" ||
    fail "torch_train_step.py failed ($name)" "$out.err"
  "$py" -c 'import json, sys
r = json.load(open(sys.argv[1]))
print("\t".join(map(str, [sys.argv[2], "pytorch", sys.argv[3], r["step_ms"], sys.argv[4], r["params"],
                          r["flops_per_step"], r["tokens_per_step"]])))
print("  %s pytorch: %s ms/step (steps %s), peak RSS %s MiB, %d parameters, loss %.3f -> %.3f" % (
    sys.argv[2], r["step_ms"], r["steps_ms"], sys.argv[4], r["params"], r["first_loss"], r["loss"]), file=sys.stderr)
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
  for model in issue demo; do
    if [ "$model" = issue ]; then flags=("${issue[@]}"); else flags=("${demo[@]}"); fi
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

"$py" - "$results" "$peaks" "$cpu" "$rounds" <<'EOF'
import csv, statistics, sys

rows = list(csv.reader(open(sys.argv[1]), delimiter="\t"))
peaks = list(csv.reader(open(sys.argv[2]), delimiter="\t"))
cpu, rounds = sys.argv[3], int(sys.argv[4])
peak = max(float(p[1]) for p in peaks)
best = max(peaks, key=lambda p: float(p[1]))
matmul = max(float(p[4]) for p in peaks)
print(f"\nfp32 GEMM peak, 2048^3, 2 threads, best of the libraries and of {rounds} rounds: {peak:.1f} GFLOP/s "
      f"(that round: OpenBLAS {best[2]}, oneDNN {best[3]}); per round: {', '.join(p[1] for p in peaks)}; "
      f"torch.matmul (information): {matmul:.1f} GFLOP/s (per round: {', '.join(p[4] for p in peaks)})")

table = ["| model | parameters | tokens/step | GFLOP/step | implementation | ms/step | tokens/s | model GFLOP/s "
         "| of GEMM peak | peak RSS (MiB) | tokens/s vs PyTorch |",
         "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
ok = True
for model in ("issue", "demo"):
    side = {s: [r for r in rows if r[0] == model and r[1] == s] for s in ("moecore", "pytorch")}
    params = {s: {int(r[5]) for r in side[s]} for s in side}
    print(f"{model}: parameters moecore {sorted(params['moecore'])}, PyTorch twin {sorted(params['pytorch'])}")
    if len(params["moecore"] | params["pytorch"]) != 1:
        print(f"run_moe_step: {model}: the parameter counts differ, the two sides do not build the same model",
              file=sys.stderr)
        ok = False
        continue
    # FLOPs per step: Megatron's formula evaluated on the twin's config must give moecore's logged throughput
    # (printed to 3 decimals) at moecore's step time, so both sides are timed against the FLOPs moecore counts.
    flops = float(side["pytorch"][0][6])
    for r in side["moecore"]:
        if abs(flops / (float(r[3]) * 1e9) - float(r[6])) > (0.0005 if float(r[6]) < 1 else 0.05) + 1e-6:
            print(f"run_moe_step: {model}: moecore logs {r[6]} TFLOP/s at {r[3]} ms, the formula's {flops:.4g} FLOPs "
                  f"per step give {flops / (float(r[3]) * 1e9):.4f}", file=sys.stderr)
            ok = False
    tokens = int(side["pytorch"][0][7])
    ms = {s: statistics.median(float(r[3]) for r in side[s]) for s in side}
    rss = {s: statistics.median(int(r[4]) for r in side[s]) for s in side}
    print(f"{model}: ms/step moecore {[r[3] for r in side['moecore']]}, PyTorch {[r[3] for r in side['pytorch']]}; "
          f"FLOPs/step {flops / 1e9:.2f} G (from moecore's log: "
          f"{', '.join('%.1f' % (float(r[6]) * float(r[3])) for r in side['moecore'])} G)")
    for s, name in (("moecore", "moecore"), ("pytorch", "PyTorch 1.13 eager")):
        gflops = flops / ms[s] / 1e6
        ratio = ms["pytorch"] / ms[s]
        table.append(f"| {model} | {params[s].pop() / 1e6:.2f}M | {tokens} | {flops / 1e9:.1f} | {name} | {ms[s]:.0f} "
                     f"| {tokens / ms[s] * 1e3:.0f} | {gflops:.1f} | {gflops / peak:.1%} | {rss[s]:.0f} | {ratio:.2f}x |")
print()
print("\n".join(table))
print(f"\nMedians of {rounds} rounds; GEMM peak {peak:.1f} GFLOP/s (fp32 2048^3, 2 threads); {cpu}.")
sys.exit(0 if ok else 1)
EOF
