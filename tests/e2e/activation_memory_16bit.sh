#!/usr/bin/env bash
# Under --bf16 / --fp16 activations are stored in 16 bits (ops/precision.h, Megatron's Float16Module): the demo model
# (configs/demo.args; two iterations on mock data) trained in fp32 and in bf16 / fp16, and the training log's memory
# lines read for each. The activation peak (the log's activations peak, every activation of the step) must be at most
# 0.55 of the fp32 run's. It falls in the fused output layer + loss, whose fp32 logits chunk is half as big under 16-bit
# activations (model/vocab_parallel.h); what the embedding and the layers keep for backward at that moment (the log's
# "activations at their peak by model part" line, less the output layer + loss) prints next to it.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
demo_without_split demo
demo+=(--train-iters 2 --lr-warmup-iters 1 --log-interval 1 --eval-interval 1000 --eval-iters 0 --mock-data
  --tokenizer-type NullTokenizer --vocab-size 50256)

# activation_peaks NAME FLAGS...: trains; prints the activation peak (MiB) and, at that peak, the activations outside
# the output layer + loss.
activation_peaks() {
  local name=$1
  shift
  local log="$work/$name.log"
  if ! timeout 300 "$bin" train "${demo[@]}" "$@" >"$log" 2>&1; then
    tail -5 "$log" >&2
    return 1
  fi
  python3 - "$log" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
peak = re.findall(r"memory \(MB\).*activations: [0-9.]+ \(peak ([0-9.]+)\)", text)[-1]
parts = dict(re.findall(r"([a-z +]+): ([0-9.]+)", re.findall(r"activations at their peak by model part \(MB\): (.*)", text)[-1]))
parts = {k.strip(): float(v) for k, v in parts.items()}
print(peak, sum(v for k, v in parts.items() if k != "output layer + loss"))
PY
}

read -r fp32_peak fp32_layers < <(activation_peaks fp32) || fail "fp32: moecore train failed"
for precision in bf16 fp16; do
  read -r peak layers < <(activation_peaks "$precision" "--$precision") || {
    fail "$precision: moecore train failed"
    continue
  }
  if [ -z "${fp32_layers:-}" ] || [ -z "${layers:-}" ]; then
    fail "$precision: no memory lines in the logs"
    continue
  fi
  verdict=$(python3 -c "
fp32_peak, fp32_layers, peak, layers = $fp32_peak, $fp32_layers, $peak, $layers
ratio = peak / fp32_peak
print(('ok' if ratio <= 0.55 else 'FAIL') + f' $precision: activation peak {peak:.1f} MiB vs fp32 {fp32_peak:.1f} MiB '
      f'({ratio:.3f} x); outside the output layer + loss {layers:.1f} vs {fp32_layers:.1f} MiB ({layers / fp32_layers:.3f} x)')")
  case $verdict in
    ok*) echo "$verdict" ;;
    *) fail "${verdict#FAIL }" ;;
  esac
done

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "e2e ok"
