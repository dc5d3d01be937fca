#!/usr/bin/env bash
# One bf16 gradient buffer for both Megatron spellings (DP2, distributed optimizer, the precision-aware optimizer):
# configs/mixtral-tiny.args with two micro-batches per rank trained 2 iterations with --grad-reduce-in-bf16 and with
# --main-grads-dtype bf16 saves bit-identical rank files (parameters, moments, main-parameter remainders): in Megatron
# both set grad_reduce_in_fp32=False, one bf16 buffer that accumulates the micro-batches, is scaled by 1/DP and
# reduce-scattered in bf16. (Without --use-precision-aware-optimizer, --grad-reduce-in-bf16 reduces the same bf16
# gradients, but the optimizer differs as Megatron's does: its fp32 main parameters start from the fp32
# gradients, where TE reads the bf16 buffer in place: with clipping off and no loss scale the two give the same
# parameters after a step, checked last.)
set -euo pipefail
bin=$1
mpirun=$2
src=$3
work=$4
rm -rf "$work" && mkdir -p "$work"
export OMP_NUM_THREADS=1
source "$src/tests/recipe.sh"
mapfile -t model < <(recipe "$src" mixtral-tiny)
common=(--global-batch-size 16 --train-iters 2 --lr-warmup-iters 1 --log-interval 1 --eval-iters 0 --bf16 --use-distributed-optimizer
  --use-precision-aware-optimizer --save-interval 2)

run() {  # run NAME FLAGS...
  local name=$1
  shift
  if ! "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" train "${model[@]}" "${common[@]}" \
      --save "$work/$name" "$@" > "$work/$name.log" 2>&1; then
    echo "FAIL: $name did not train:"; tail -5 "$work/$name.log"; exit 1
  fi
}
run grad_reduce_bf16 --grad-reduce-in-bf16
run main_grads_bf16 --main-grads-dtype bf16
failures=0
for rank in rank_00000 rank_00001; do
  a="$work/grad_reduce_bf16/iter_0000002/$rank.safetensors"
  b="$work/main_grads_bf16/iter_0000002/$rank.safetensors"
  if cmp -s "$a" "$b"; then
    echo "ok: $rank: --grad-reduce-in-bf16 and --main-grads-dtype bf16 saved the same state after 2 steps"
  else
    echo "FAIL: $rank: the states after 2 steps differ"; failures=$((failures + 1))
  fi
done
# --grad-reduce-in-bf16 alone against --use-precision-aware-optimizer --main-grads-dtype bf16: the same parameters
# after a step (clipping off: Megatron clips fp32 copies on one path and the bf16 buffer on the other).
plain=()
for f in "${common[@]}"; do [ "$f" = --use-precision-aware-optimizer ] || plain+=("$f"); done
run_with() {  # run_with NAME FLAGS...: common flags without the precision-aware optimizer
  local name=$1
  shift
  if ! "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" train "${model[@]}" "${plain[@]}" \
      --save "$work/$name" --clip-grad 0 --train-iters 2 --exit-interval 1 --save-interval 1 "$@" >"$work/$name.log" 2>&1; then
    echo "FAIL: $name did not train:"; tail -5 "$work/$name.log"; exit 1
  fi
}
run_with plain_grad_reduce_bf16 --grad-reduce-in-bf16
run_with pao_main_grads_bf16 --use-precision-aware-optimizer --main-grads-dtype bf16
if /usr/bin/python3 - "$work/plain_grad_reduce_bf16/iter_0000001" "$work/pao_main_grads_bf16/iter_0000001" <<'PY'
import json, sys
def params(folder):
    meta = json.load(open(folder + "/metadata.json"))
    out = {}
    for key, t in meta["tensors"].items():
        if key.startswith("optimizer.") or key.startswith("lr_scheduler.") or not t["shape"]:
            continue
        for piece in t["pieces"]:
            raw = open(folder + "/" + piece["file"], "rb").read()
            n = int.from_bytes(raw[:8], "little")
            header = json.loads(raw[8:8 + n])
            begin, end = header[piece["name"]]["data_offsets"]
            out[(key, tuple(piece["offsets"]))] = raw[8 + n + begin:8 + n + end]
    return out
a, b = params(sys.argv[1]), params(sys.argv[2])
bad = [k for k in a if a[k] != b.get(k)]
if bad or len(a) != len(b) or not a:
    print("differ:", bad[:5], len(a), len(b))
    sys.exit(1)
print(len(a), "parameter pieces identical")
PY
then
  echo "ok: --grad-reduce-in-bf16 and --use-precision-aware-optimizer --main-grads-dtype bf16: the same parameters after a step"
else
  echo "FAIL: --grad-reduce-in-bf16 and --use-precision-aware-optimizer --main-grads-dtype bf16 differ after a step"
  failures=$((failures + 1))
fi
[ $failures -eq 0 ]
