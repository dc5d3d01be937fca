#!/usr/bin/env bash
# `moecore plan`'s memory model against moecore's own measurements: for several layouts of the tiny MoE configs, a
# short `moecore train` run prints the MemoryTracker's peak per category (the "memory (MB...)" log line, MiB, each
# the maximum over the ranks), and `moecore plan` with the same model and layout flags (--json, the CPU engine) must
# give memory_mib.{params,grads,optimizer,activations} within 10% of those peaks, memory_mib.total within 10% of
# the "total peak", and memory_mib.activations_by_module within 10% of the log's activations at the peak by model part
# for each part holding a tenth of the activation peak or more (unless the planner's two candidate moments for the
# peak are within 3% of each other). Skips (77) only when mpirun is missing.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
mpirun=$(command -v mpirun || true)
[ -n "$mpirun" ] || { echo "skipped: no mpirun"; exit 77; }
tolerance=10  # percent

source "$src/tests/e2e/lib/plan_runs.sh"

# check NAME NP CONFIG LAYOUT-FLAGS...: train 2 iterations on NP ranks, then compare `plan`'s memory_mib.
check() {
  local name=$1 np=$2 config=$3
  shift 3
  local -a train_flags plan_args
  mapfile -t train_flags < <(config_flags "$config")
  mapfile -t plan_args < <(plan_flags "$config")
  local log="$work/$name.train.log"
  if ! train_on "$np" "$log" "${train_flags[@]}" --train-iters 2 --lr-warmup-iters 1 --log-interval 1 \
    --eval-interval 1000 --eval-iters 0 "$@"; then
    tail -5 "$log"
    fail "$name: moecore train failed ($log)"
    return
  fi
  local measured
  if ! measured=$(grep -A1 'memory (MB' "$log" | tail -2 | tr '\n' ' ' | python3 -c '
import json, re, sys
line = sys.stdin.read()
peaks = {k: float(v) for k, v in re.findall(r"(params|grads|optimizer|activations): [0-9.]+ \(peak ([0-9.]+)\)", line)}
peaks["total"] = float(re.search(r"total peak: ([0-9.]+)", line).group(1))
assert len(peaks) == 5, line
parts = re.search(r"by model part \(MB\): (.*)", line).group(1)
peaks["by_module"] = {k.strip(): float(v) for k, v in re.findall(r"([a-z +]+): ([0-9.]+)", parts)}
print(json.dumps(peaks))'); then
    fail "$name: no memory line in $log"
    return
  fi
  echo "measured $name (np $np, $config $*): $measured"
  local plan_json="$work/$name.plan.json"
  if ! timeout 120 "$bin" plan "${plan_args[@]}" "$@" --num-gpus "$np" --gpu cpu --json >"$plan_json" \
    2>"$work/$name.plan.err"; then
    fail "$name: moecore plan failed: $(head -c 300 "$work/$name.plan.err")"
    return
  fi
  local verdict
  verdict=$(python3 - "$measured" "$plan_json" "$tolerance" <<'PY'
import json, sys
measured = json.loads(sys.argv[1])
tolerance = float(sys.argv[3])
try:
    with open(sys.argv[2]) as f:
        planned = json.load(f)["memory_mib"]
except (OSError, ValueError, KeyError, TypeError) as e:
    print(f"FAIL plan --json has no memory_mib object ({e})")
    sys.exit()
bad = []
parts = []
for key in ("params", "grads", "optimizer", "activations", "total"):
    m = measured[key]
    p = planned.get(key) if isinstance(planned, dict) else None
    if not isinstance(p, (int, float)):
        bad.append(f"{key}: no number in memory_mib")
        continue
    err = 100.0 * (p - m) / m if m else (0.0 if p == 0 else float("inf"))
    parts.append(f"{key} {m:.1f}/{p:.1f} MiB ({err:+.1f}%)")
    if abs(err) > tolerance:
        bad.append(f"{key} planned {p:.2f} MiB, measured {m:.1f} MiB ({err:+.1f}%)")
# Per model part (the log's "activations at their peak by model part", each the maximum over the ranks), for every
# part holding at least a tenth of the activation peak; smaller parts print. Where the planner's other candidate
# moment for the peak (the loss's forward or the first backward) is within 3% of the peak (about the planner's error
# on the activations), which moment holds it is not determined by the model, and the parts are not compared.
planned_parts = planned.get("activations_by_module") or {}
other = planned.get("activations_other_moment", 0.0)
ambiguous = other >= 0.97 * planned.get("activations", 0.0)
if ambiguous:
    parts.append(f"parts not compared: the peak's moment is ambiguous ({other:.1f} vs {planned['activations']:.1f} MiB)")
for part, m in ([] if ambiguous else measured["by_module"].items()):
    p = planned_parts.get(part, 0.0)
    if m < 0.1 * measured["activations"] and p < 0.1 * measured["activations"]:
        continue
    err = 100.0 * (p - m) / m if m else float("inf")
    parts.append(f"{part} {m:.1f}/{p:.1f} MiB ({err:+.1f}%)")
    if abs(err) > tolerance:
        bad.append(f"activations of {part} planned {p:.2f} MiB, measured {m:.1f} MiB ({err:+.1f}%)")
print(("FAIL " + "; ".join(bad)) if bad else ("ok " + ", ".join(parts)))
PY
)
  case $verdict in
    ok*) echo "ok: $name: ${verdict#ok }" ;;
    *) fail "$name: ${verdict#FAIL }" ;;
  esac
}

check one-process 1 qwen3-moe-tiny
check tp2-sp 2 qwen3-moe-tiny --tensor-model-parallel-size 2 --sequence-parallel
check ep2 2 deepseek-v3-tiny --expert-model-parallel-size 2
check pp2-vpp2 2 qwen3-moe-tiny --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 \
  --micro-batch-size 2
check dp2-distopt-bf16 2 deepseek-v3-tiny --use-distributed-optimizer --bf16
# 16-bit activation storage (ops/precision.h): one process, and with full recomputation.
check one-process-bf16 1 qwen3-moe-tiny --bf16
check tp2-sp-bf16 2 qwen3-moe-tiny --tensor-model-parallel-size 2 --sequence-parallel --bf16
check recompute-full-bf16 1 deepseek-v3-tiny --bf16 --recompute-granularity full --recompute-method uniform \
  --recompute-num-layers 1
check cp2 2 qwen3-moe-tiny --context-parallel-size 2
# The probabilities applied to the experts' output (the report's memory-efficient permutation off).
check no-memory-efficient-permutation 1 qwen3-moe-tiny --no-moe-memory-efficient-permutation
# Activation recomputation: selective modules (what each drops) and full recomputation with both methods.
check recompute-selective 1 qwen3-moe-tiny --recompute-granularity selective --recompute-modules core_attn layernorm \
  moe_act
check recompute-moe 1 deepseek-v3-tiny --recompute-granularity selective --recompute-modules moe mlp mla_up_proj
check recompute-shared 1 deepseek-v3-tiny --recompute-granularity selective --recompute-modules shared_experts \
  layernorm
check recompute-full-pp2 2 qwen3-moe-tiny --pipeline-model-parallel-size 2 --recompute-granularity full \
  --recompute-method uniform --recompute-num-layers 1
check recompute-full-block 1 deepseek-v3-tiny --recompute-granularity full --recompute-method block \
  --recompute-num-layers 2
# Megatron-FSDP (optim/fsdp.h), every sharding strategy: the units' shards (dense over dp-cp, routed experts over
# expert-DP), the unsharded model at build time, and the gathered units and unit gradient buffers in the total.
for strategy in no_shard optim optim_grads optim_grads_params; do
  fsdp=(--use-megatron-fsdp --data-parallel-sharding-strategy "$strategy")
  check "fsdp-$strategy-dp2" 2 qwen3-moe-tiny "${fsdp[@]}"
  check "fsdp-$strategy-tp2-dp2" 4 qwen3-moe-tiny --tensor-model-parallel-size 2 --sequence-parallel "${fsdp[@]}"
  check "fsdp-$strategy-dp2-mla" 2 deepseek-v3-tiny "${fsdp[@]}"
  check "fsdp-$strategy-ep2-edp2-mla" 4 deepseek-v3-tiny --expert-model-parallel-size 2 --micro-batch-size 2 \
    "${fsdp[@]}"
  check "fsdp-$strategy-tp2-dp2-mla" 4 deepseek-v3-tiny --tensor-model-parallel-size 2 --sequence-parallel \
    "${fsdp[@]}"
done
check fsdp-zero3-bf16 2 deepseek-v3-tiny --bf16 --use-megatron-fsdp
check fsdp-optim_grads-bf16 2 deepseek-v3-tiny --bf16 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads
check fsdp-zero3-pp2 4 qwen3-moe-tiny --pipeline-model-parallel-size 2 --use-megatron-fsdp
check fsdp-optim_grads-precision-aware 2 deepseek-v3-tiny --use-megatron-fsdp --data-parallel-sharding-strategy \
  optim_grads --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype bf16
check fsdp-zero3-cp2 4 qwen3-moe-tiny --context-parallel-size 2 --use-megatron-fsdp
# Under full recomputation a unit is gathered for its recomputed forward and stays so through its backward.
check fsdp-zero3-recompute-full 2 qwen3-moe-tiny --use-megatron-fsdp --recompute-granularity full \
  --recompute-method uniform --recompute-num-layers 1
# FP8 / FP4: the linear layers keep their inputs quantized for the weight gradient (ops/linear.h); Megatron's MTP
# depths do not run under FP8 / FP4 yet, so the recipe without its depth.
check fp8-hybrid-bf16 1 deepseek-v3-tiny --bf16 --fp8-format hybrid --mtp-num-layers 0
check fp8-tensorwise-bf16 1 deepseek-v3-tiny --bf16 --fp8-format hybrid --fp8-recipe tensorwise --mtp-num-layers 0
check fp4-nvfp4-bf16 1 deepseek-v3-tiny --bf16 --fp4-format e2m1 --fp4-recipe nvfp4 --mtp-num-layers 0
check fp8-delayed-gqa 1 qwen3-moe-tiny --fp8-format hybrid --fp8-recipe delayed
check fp8-hybrid-bf16-gqa 1 qwen3-moe-tiny --bf16 --fp8-format hybrid
check fp8-hybrid-bf16-tp2-sp 2 deepseek-v3-tiny --tensor-model-parallel-size 2 --sequence-parallel --bf16 \
  --fp8-format hybrid --mtp-num-layers 0
check fp8-recompute-moe-act 1 deepseek-v3-tiny --bf16 --fp8-format hybrid --fp8-recipe tensorwise --mtp-num-layers 0 \
  --recompute-granularity selective --recompute-modules moe_act layernorm mla_up_proj

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "e2e ok"
