#!/usr/bin/env bash
# MoE training step, moecore against its PyTorch twin in fp32 and bf16, side by side in one run on this machine.
# All sides build the model from one list of `moecore train` flags (bench/torch_train_step.py --megatron reads the
# same flags into the oracle twin, tests/oracle/twin.py + twin_moe.py: plain eager PyTorch, a Python loop over the
# experts) and run the same step: forward and backward of each micro-batch, global-norm clip 1.0, AdamW. Models
# (bench/moe_step_models.sh):
#   e16:   4 layers, hidden 512, 8 heads (no GQA), seq 512, batch 4, 16 experts (ffn 512) top-2, vocab 32000,
#          RMSNorm, SwiGLU, RoPE, no biases, dropout 0, alltoall dispatcher, grouped GEMM;
#   demo:  configs/demo.args as it trains (mock data, vocab 50256; micro-batch 4, global batch 8).
# Five sides per model:
#   moecore fp32              `moecore train FLAGS`;
#   moecore bf16              `moecore train FLAGS --bf16` (Megatron's bf16 mixed precision);
#   PyTorch fp32, installed   OPENBLAS_CORETYPE unset: Debian's OpenBLAS picks its kernels by CPU model (generic ones
#                             on models it does not know); the header and the table name the core it ran;
#   PyTorch fp32, best BLAS   OPENBLAS_CORETYPE=SkylakeX with avx512f, Haswell with avx2 only (or the caller's
#                             OPENBLAS_CORETYPE); moecore and the bf16 PyTorch side run with it too;
#   PyTorch bf16              torch.autocast("cpu", dtype=torch.bfloat16) around forward + loss, fp32 master weights
#                             and AdamW, backward outside autocast (torch_train_step.py --bf16, which reports that
#                             autocast was on and the logits came out bf16; the script stops otherwise).
# Per round: the GEMM peaks at 2048^3, 2 threads: fp32 (build/bench/bench_gemm 2 --peak, best of OpenBLAS and
# oneDNN), bf16 (build/bench/bench_gemm_lowp 2 --peak: oneDNN's native bf16 matmul and the convert path), and
# torch.matmul in fp32 (both OpenBLAS settings) and bf16; then per model one process per side, the sides' order
# reversed every other round, each running STEPS timed steps after 1 warm-up step (moecore: `elapsed time per
# iteration` at --log-interval 1). Exception: PyTorch fp32 as installed on e16 times INSTALLED_STEPS steps (default 1)
# per round, since with generic OpenBLAS kernels one e16 step takes several times longer than the others.
# Step time: the median over all timed steps of all rounds (the machine may be shared: bursts of load from elsewhere
# hit single steps). Peak memory: the process's max resident set size (getrusage of the child, the same wrapper for
# all), the largest over the rounds. FLOPs per step: Megatron's formula as moecore logs it (its logged throughput x
# time must match the formula evaluated on the twin's config, in fp32 and bf16), applied to all sides' times; the
# parameter counts of all five sides must agree. Share of peak: fp32 rows against the fp32 GEMM peak, bf16 rows
# against the bf16 GEMM peak (the better of moecore's bf16 GEMM and torch.matmul in bf16), each the best over the
# rounds. Prints a markdown table of the sides and one of the ratios (tokens/s).
#
# usage: bench/run_moe_step.sh [BUILD_DIR] [ROUNDS] [STEPS]
#   BUILD_DIR  moecore build with moecore, bench/bench_gemm and bench/bench_gemm_lowp (default build, or $BUILD)
#   ROUNDS     rounds (default 3, or $ROUNDS)        STEPS  timed steps per process (default 4, or $STEPS)
# environment: MODELS="e16 demo" (which models, in that order), INSTALLED_STEPS=1 (see above).
# e.g. a quick e16-only run: MODELS=e16 bench/run_moe_step.sh build 1 2   (a few minutes on an idle 2-core VM)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-${BUILD:-build}}
rounds=${2:-${ROUNDS:-3}}
steps=${3:-${STEPS:-4}}
installed_steps=${INSTALLED_STEPS:-1}
read -r -a models <<<"${MODELS:-e16 demo}"
threads=2
py=/usr/bin/python3
usage="usage: bench/run_moe_step.sh [BUILD_DIR] [ROUNDS] [STEPS]  (env: MODELS=\"e16 demo\", INSTALLED_STEPS=1)"
[ $# -le 3 ] || { echo "run_moe_step: too many arguments; $usage" >&2; exit 2; }
for n in "$rounds" "$steps" "$installed_steps"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "run_moe_step: '$n' is not a positive count; $usage" >&2; exit 2; }
done
[ ${#models[@]} -gt 0 ] || { echo "run_moe_step: MODELS is empty; $usage" >&2; exit 2; }
for model in "${models[@]}"; do
  case "$model" in
    e16 | demo) ;;
    *) echo "run_moe_step: unknown model '$model' in MODELS (e16, demo)" >&2; exit 2 ;;
  esac
done
for binary in moecore bench/bench_gemm bench/bench_gemm_lowp; do
  [ -x "$build/$binary" ] || { echo "run_moe_step: $build/$binary not built; $usage" >&2; exit 2; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# shellcheck source=bench/machine_info.sh
source bench/machine_info.sh
best_core=${OPENBLAS_CORETYPE:-$openblas_best}
# The OpenBLAS core a process picks (Debian's PyTorch links this OpenBLAS), as installed and with best_core.
core_py='import ctypes.util, ctypes
get = ctypes.CDLL(ctypes.util.find_library("openblas")).openblas_get_corename
get.restype = ctypes.c_char_p
print(get().decode())'
installed_core=$(env -u OPENBLAS_CORETYPE "$py" -c "$core_py")
if [ -n "$best_core" ]; then export OPENBLAS_CORETYPE=$best_core; fi
tuned_core=$("$py" -c "$core_py")
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $cpu, ISA:${isa:- no avx2}, $threads threads," \
  "$rounds rounds x $steps steps (PyTorch fp32 as installed on e16: $installed_steps), models: ${models[*]}"
echo "# OpenBLAS core: as installed $installed_core; with OPENBLAS_CORETYPE=${best_core:-(unset)} $tuned_core" \
  "(moecore, the GEMM peaks, PyTorch fp32 best BLAS and PyTorch bf16)"

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
# One line per process, tab-separated: model side round ms_per_step,... rss_mib params logged_tflops,... (moecore)
# flops_per_step tokens_per_step torch_version (PyTorch) first_loss last_loss openblas_core; "-" where not known.
results=$work/results.tsv

run_moecore() {  # SIDE NAME FLAGS...   (SIDE moecore-fp32 or moecore-bf16)
  local side=$1 name=$2 log=$work/$2.$1.log
  shift 2
  measured "$work/rss" "$build/moecore" train "$@" --train-iters $((steps + 1)) --log-interval 1 >"$log" 2>&1 ||
    fail "moecore train failed ($name, $side)" "$log"
  local all lines ms tflops params losses
  all=$(grep 'iteration *[0-9]*/' "$log")
  lines=$(tail -n +2 <<<"$all") # iteration 1 is the warm-up
  [ "$(wc -l <<<"$lines")" -eq "$steps" ] ||
    fail "expected $steps iteration lines after the first ($name, $side)" "$log"
  ms=$(sed -n 's/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p' <<<"$lines" | paste -sd,)
  tflops=$(sed -n 's/.*(TFLOP\/s\/GPU): \([0-9.]*\).*/\1/p' <<<"$lines" | paste -sd,)
  losses=$(sed -n 's/.* lm loss: \([0-9.E+-]*\) .*/\1/p' <<<"$all")
  params=$(sed -n 's/^> number of parameters: \([0-9]*\).*/\1/p' "$log")
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t-\t-\t-\t%s\t%s\t-\n' "$name" "$side" "$round" "$ms" "$(cat "$work/rss")" \
    "$params" "$tflops" "$(head -1 <<<"$losses")" "$(tail -1 <<<"$losses")" >>"$results"
  echo "  $name $side: steps $ms ms (TFLOP/s logged $tflops), peak RSS $(cat "$work/rss") MiB, $params parameters," \
    "lm loss $(head -1 <<<"$losses") -> $(tail -1 <<<"$losses")"
}

run_torch() {  # SIDE NAME FLAGS...   (SIDE torch-fp32-installed, torch-fp32 or torch-bf16)
  local side=$1 name=$2 out=$work/$2.$1.json n=$steps
  shift 2
  local env_cmd=(env) bf16=()
  [ "$side" = torch-fp32-installed ] && env_cmd=(env -u OPENBLAS_CORETYPE)
  [ "$side" = torch-fp32-installed ] && [ "$name" = e16 ] && ((installed_steps < steps)) && n=$installed_steps
  [ "$side" = torch-bf16 ] && bf16=(--bf16)
  measured "$work/rss" "${env_cmd[@]}" "$py" bench/torch_train_step.py --steps "$n" --warmup 1 --megatron "$@" \
    "${bf16[@]}" >"$out" 2>"$out.err" || fail "torch_train_step.py failed ($name, $side)" "$out.err"
  "$py" -c 'import json, sys
r = json.load(open(sys.argv[1]))
name, side = sys.argv[2], sys.argv[3]
want = ("bf16 autocast", True, "torch.bfloat16") if side == "torch-bf16" else ("fp32", False, "torch.float32")
got = (r["precision"], r["autocast"], r["logits_dtype"])
if got != want:
    sys.exit(f"run_moe_step: {name} {side}: precision {got[0]}, autocast on during the forward: {got[1]}, logits "
             f"{got[2]}; expected {want}")
ms = ",".join(map(str, r["steps_ms"]))
print("\t".join(map(str, [name, side, sys.argv[4], ms, sys.argv[5], r["params"], "-", r["flops_per_step"],
                          r["tokens_per_step"], r["impl"].split()[-1], r["first_loss"], r["loss"],
                          r["openblas_core"]])))
print("  %s %s: steps %s ms, peak RSS %s MiB, %d parameters, loss %.3f -> %.3f, OpenBLAS %s%s" % (
    name, side, ms, sys.argv[5], r["params"], r["first_loss"], r["loss"], r["openblas_core"],
    ", autocast on, logits bf16" if r["autocast"] else ""), file=sys.stderr)
' "$out" "$name" "$side" "$round" "$(cat "$work/rss")" >>"$results" || exit 1
}

same_params() {  # NAME: all sides built a model with the same number of parameters, or stop here
  local counts
  counts=$(awk -F'\t' -v m="$1" '$1 == m {print $6}' "$results" | sort -u)
  [ "$(wc -l <<<"$counts")" -eq 1 ] ||
    fail "$1: moecore and the PyTorch twin have different parameter counts ($(tr "\n" " " <<<"$counts")): not the same model"
}

# torch.matmul GFLOP/s at 2048^3 per dtype argument (float32, bfloat16), on one line.
matmul_py='import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
for name in sys.argv[2:]:
    a, b = (torch.randn(2048, 2048).to(getattr(torch, name)) for _ in range(2))
    a @ b
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 1.0:
        a @ b
        reps += 1
    print("%.1f" % (2 * 2048**3 * reps / (time.perf_counter() - start) / 1e9), end=" ")'

sides=(moecore-fp32 torch-fp32 torch-fp32-installed moecore-bf16 torch-bf16)
# round fp32_peak openblas onednn bf16_moecore_best bf16_native bf16_convert bf16_default torch_fp32_installed
# torch_fp32 torch_bf16
peaks=$work/peaks.tsv
for ((round = 0; round < rounds; ++round)); do
  echo "round $round"
  gemm=$("$build/bench/bench_gemm" "$threads" --peak)
  lowp=$("$build/bench/bench_gemm_lowp" "$threads" --peak)
  read -r matmul_installed <<<"$(env -u OPENBLAS_CORETYPE "$py" -c "$matmul_py" "$threads" float32)"
  read -r matmul_fp32 matmul_bf16 <<<"$("$py" -c "$matmul_py" "$threads" float32 bfloat16)"
  echo "  fp32 GEMM 2048^3: $gemm; torch.matmul $matmul_fp32 (as installed $matmul_installed) GFLOP/s"
  echo "  bf16 GEMM 2048^3: $lowp; torch.matmul $matmul_bf16 GFLOP/s"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$(awk '{print $2}' <<<"$gemm")" \
    "$(awk '{print $4}' <<<"$gemm")" "$(awk '{print $6}' <<<"$gemm")" "$(awk '{print $2}' <<<"$lowp")" \
    "$(awk '{print $4}' <<<"$lowp")" "$(awk '{print $6}' <<<"$lowp")" "$(awk '{print $8}' <<<"$lowp")" \
    "$matmul_installed" "$matmul_fp32" "$matmul_bf16" >>"$peaks"
  for model in "${models[@]}"; do
    declare -n flags=$model
    order=("${sides[@]}")
    if ((round % 2 == 1)); then
      order=()
      for ((i = ${#sides[@]} - 1; i >= 0; --i)); do order+=("${sides[i]}"); done
    fi
    for side in "${order[@]}"; do
      case "$side" in
        moecore-fp32) run_moecore "$side" "$model" "${flags[@]}" ;;
        moecore-bf16) run_moecore "$side" "$model" "${flags[@]}" --bf16 ;;
        *) run_torch "$side" "$model" "${flags[@]}" ;;
      esac
    done
    unset -n flags
    same_params "$model"
  done
done

"$py" - "$results" "$peaks" "$cpu" "$rounds" "$steps" "$installed_steps" "${isa# }" "${best_core:-unset}" \
  "${models[@]}" <<'EOF'
import csv, statistics, sys

rows = list(csv.reader(open(sys.argv[1]), delimiter="\t"))
peaks = list(csv.reader(open(sys.argv[2]), delimiter="\t"))
cpu, rounds, steps, installed_steps, isa, best_core = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), \
    int(sys.argv[6]), sys.argv[7] or "no avx2", sys.argv[8]
models = sys.argv[9:]


def num(text):
    return float(text) if text not in ("n/a", "") else 0.0


def floats(text):
    return [float(v) for v in text.split(",")]


def per_round(col):
    return ", ".join(p[col] for p in peaks)


fp32_peak = max(num(p[1]) for p in peaks)
best32 = max(peaks, key=lambda p: num(p[1]))
moecore_bf16 = max(num(p[4]) for p in peaks)
torch_bf16 = max(num(p[10]) for p in peaks)
bf16_peak = max(moecore_bf16, torch_bf16)
print(f"\nfp32 GEMM peak, 2048^3, 2 threads, best of the libraries and of {rounds} rounds: {fp32_peak:.1f} GFLOP/s "
      f"(that round: OpenBLAS {best32[2]}, oneDNN {best32[3]}; per round: {per_round(1)}); torch.matmul fp32 "
      f"(information): {max(num(p[9]) for p in peaks):.1f} with OPENBLAS_CORETYPE={best_core} (per round: "
      f"{per_round(9)}), {max(num(p[8]) for p in peaks):.1f} as installed (per round: {per_round(8)})")
print(f"bf16 GEMM peak, 2048^3, 2 threads, best of {rounds} rounds: {bf16_peak:.1f} GFLOP/s = the better of "
      f"moecore's bf16 GEMM {moecore_bf16:.1f} (per round: oneDNN native bf16 matmul {per_round(5)}, convert path "
      f"{per_round(6)}; moecore's default path: {peaks[0][7]}) and torch.matmul bf16 {torch_bf16:.1f} "
      f"(per round: {per_round(10)})")

names = {"moecore-fp32": ("moecore", "fp32"), "moecore-bf16": ("moecore", "bf16"),
         "torch-fp32-installed": ("PyTorch {v} eager, OpenBLAS as installed (core {core})", "fp32"),
         "torch-fp32": ("PyTorch {v} eager, " + (f"OPENBLAS_CORETYPE={best_core}" if best_core != "unset" else
                                                 "OPENBLAS_CORETYPE unset (no AVX2)") + " (core {core})", "fp32"),
         "torch-bf16": ("PyTorch {v} eager, autocast", "bf16 autocast")}
table = ["| model | parameters | tokens/step | GFLOP/step | implementation | precision | ms/step | tokens/s "
         "| model GFLOP/s | of GEMM peak | peak RSS (MiB) |",
         "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
ratios = ["| model | moecore bf16 / fp32 | moecore bf16 / PyTorch bf16 | moecore fp32 / PyTorch fp32 best BLAS "
          "| moecore fp32 / PyTorch fp32 as installed | PyTorch bf16 / PyTorch fp32 best BLAS |",
          "| --- | ---: | ---: | ---: | ---: | ---: |"]
ok = True
for model in models:
    runs = {s: [r for r in rows if r[0] == model and r[1] == s] for s in names}
    params = {int(r[5]) for s in runs for r in runs[s]}
    print(f"{model}: parameters " + ", ".join(f"{s} {sorted({int(r[5]) for r in runs[s]})}" for s in runs))
    if len(params) != 1:
        print(f"run_moe_step: {model}: the parameter counts differ: not the same model", file=sys.stderr)
        ok = False
        continue
    # FLOPs per step: Megatron's formula evaluated on the twin's config must give the throughput moecore logs at
    # moecore's step times (both printed rounded: TFLOP/s to 3 decimals below 1, ms to 0.1), so all sides are
    # timed against the FLOPs moecore counts.
    flops, tokens = float(runs["torch-fp32"][0][7]), int(runs["torch-fp32"][0][8])
    for r in runs["moecore-fp32"] + runs["moecore-bf16"]:
        for ms, logged in zip(floats(r[3]), floats(r[6])):
            half_unit = 0.0005 if logged < 1 else 0.05
            if not flops / ((ms + 0.05) * 1e9) - half_unit <= logged <= flops / ((ms - 0.05) * 1e9) + half_unit:
                print(f"run_moe_step: {model} {r[1]}: moecore logs {logged} TFLOP/s at {ms} ms; the formula's "
                      f"{flops:.4g} FLOPs per step give {flops / (ms * 1e9):.4f}", file=sys.stderr)
                ok = False
    ms = {s: statistics.median(t for r in runs[s] for t in floats(r[3])) for s in runs}
    rss = {s: max(int(r[4]) for r in runs[s]) for s in runs}
    print(f"{model}: {flops / 1e9:.2f} GFLOP/step; median ms/step per round: " + "; ".join(
        f"{s} {', '.join('%.0f' % statistics.median(floats(r[3])) for r in runs[s])}" for s in runs))
    print(f"{model}: loss first -> last step: " + "; ".join(
        f"{s} {', '.join('%.3f -> %.3f' % (float(r[10]), float(r[11])) for r in runs[s])}" for s in runs))
    for s, (name, precision) in names.items():
        gflops = flops / ms[s] / 1e6
        peak = bf16_peak if precision.startswith("bf16") else fp32_peak
        name = name.format(v=runs[s][0][9], core=runs[s][0][12])
        table.append(f"| {model} | {params.copy().pop() / 1e6:.2f}M | {tokens} | {flops / 1e9:.1f} | {name} "
                     f"| {precision} | {ms[s]:.0f} | {tokens / ms[s] * 1e3:.0f} | {gflops:.1f} | {gflops / peak:.1%} "
                     f"| {rss[s]} |")

    def speedup(a, b):  # tokens/s of side a over tokens/s of side b
        return f"{ms[b] / ms[a]:.2f}x"

    ratios.append(f"| {model} | {speedup('moecore-bf16', 'moecore-fp32')} | {speedup('moecore-bf16', 'torch-bf16')} "
                  f"| {speedup('moecore-fp32', 'torch-fp32')} | {speedup('moecore-fp32', 'torch-fp32-installed')} "
                  f"| {speedup('torch-bf16', 'torch-fp32')} |")
print()
print("\n".join(table))
print()
print("\n".join(ratios))
installed = f"; PyTorch fp32 as installed on e16: {rounds} x {min(steps, installed_steps)}" \
    if "e16" in models and installed_steps < steps else ""
print(f"\nms/step: median of {rounds} rounds x {steps} steps after a warm-up step{installed}. Of GEMM peak: fp32 rows "
      f"against the fp32 GEMM peak {fp32_peak:.1f} GFLOP/s (2048^3, 2 threads, best of OpenBLAS and oneDNN), bf16 rows "
      f"against the bf16 GEMM peak {bf16_peak:.1f} GFLOP/s (2048^3, 2 threads, the better of moecore's bf16 GEMM "
      f"{moecore_bf16:.1f} and torch.matmul bf16 {torch_bf16:.1f}). Ratios: tokens/s over tokens/s. {cpu}; {isa}.")
sys.exit(0 if ok else 1)
EOF
