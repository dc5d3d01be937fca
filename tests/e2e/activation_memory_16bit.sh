#!/usr/bin/env bash
# Under --bf16 / --fp16 activations are stored in 16 bits (ops/precision.h, Megatron's Float16Module): the demo model
# (configs/demo.args; two iterations on mock data, two layers and 128-token sequences to keep it short) trained in fp32
# and in bf16 / fp16, and the training log's memory line ("activations: X (peak Y)", MiB) read for each. The peak is
# at the fused output layer + loss, whose per-micro-batch output weight gradient [V, H] is an fp32 weight gradient in
# every precision (Megatron's main_grad; moecore's log counts it among the activations until backward adds it to the
# main gradient): with it set aside (V the padded vocabulary the log prints, H 192), the 16-bit runs' activation peak
# must be at most 0.55 of the fp32 run's. What else stays fp32 (norm statistics, log-sum-exps, the router and its
# probabilities, losses) is in both.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
demo=()
while read -r flag; do  # the recipe without its data split (mock data has its own)
  if [ "$flag" = --split ]; then read -r _; continue; fi
  demo+=("$flag")
done < <(recipe "$src" demo)
demo+=(--train-iters 2 --lr-warmup-iters 1 --log-interval 1 --eval-interval 1000 --eval-iters 0 --mock-data
  --tokenizer-type NullTokenizer --vocab-size 50256 --num-layers 2 --seq-length 128 --max-position-embeddings 128)

# activation_peak NAME FLAGS...: trains; prints the activation peak (MiB) of the last memory line and the padded
# vocabulary size.
activation_peak() {
  local name=$1
  shift
  local log="$work/$name.log"
  if ! timeout 300 "$bin" train "${demo[@]}" "$@" >"$log" 2>&1; then
    tail -5 "$log" >&2
    return 1
  fi
  echo "$(grep 'memory (MB' "$log" | tail -1 | sed -n 's/.*activations: [0-9.]* (peak \([0-9.]*\)).*/\1/p')" \
    "$(sed -n 's/.*padded vocab .*new size: \([0-9]*\)).*/\1/p' "$log" | head -1)"
}

read -r fp32 vocab < <(activation_peak fp32) || fail "fp32: moecore train failed"
for precision in bf16 fp16; do
  read -r peak _ < <(activation_peak "$precision" "--$precision") || {
    fail "$precision: moecore train failed"
    continue
  }
  if [ -z "${fp32:-}" ] || [ -z "${peak:-}" ] || [ -z "${vocab:-}" ]; then
    fail "$precision: no activation peak or padded vocabulary in the log (fp32 '${fp32:-}', $precision '${peak:-}')"
    continue
  fi
  verdict=$(python3 -c "
fp32, low, dweight = float('$fp32'), float('$peak'), 4 * $vocab * 192 / 2**20
ratio = (low - dweight) / (fp32 - dweight)
print(('ok' if ratio <= 0.55 else 'FAIL') + f' activation peak fp32 {fp32:.1f} MiB, $precision {low:.1f} MiB '
      f'({low / fp32:.3f} x); without the fp32 output weight gradient ({dweight:.1f} MiB) {ratio:.3f} x')")
  case $verdict in
    ok*) echo "$verdict" ;;
    *) fail "${verdict#FAIL }" ;;
  esac
done

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "e2e ok"
