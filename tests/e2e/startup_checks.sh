#!/usr/bin/env bash
# What would fail only after training (or at its first step) fails at start-up instead: one clear line, exit code
# != 0 and < 128, and nothing of training printed before it (no model built: no "number of parameters" line, no
# "training ..." or iteration line). Also the input errors of preprocess, datasets and HF config.json.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
expect_train_error() { local pattern=$1; shift; expect_early_error "$pattern" "$bin" train "$@"; }
mapfile -t model < <(recipe "$src" tiny-one-layer)
model+=(--hidden-size 32 --micro-batch-size 2 --global-batch-size 2 --train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer
       --vocab-size 100 --eval-iters 1 --log-interval 1 --threads 1)
llama=(--normalization RMSNorm --swiglu --ffn-hidden-size 64 --position-embedding-type rope --disable-bias-linear)
mock=("${model[@]}" --mock-data)




# --export-hf: a folder the export can write, and a model HF can hold.
expect_train_error "HF export supports llama/qwen3-style models (RMSNorm, SwiGLU, RoPE); this model has --normalization LayerNorm" \
  "${mock[@]}" --export-hf "$work/hf_layernorm"
[ -e "$work/hf_layernorm" ] && fail "a refused export left $work/hf_layernorm"
expect_train_error "--export-hf: cannot create a file in /proc" "${mock[@]}" "${llama[@]}" --export-hf /proc/moecore_hf
: > "$work/a_file"
expect_train_error "--export-hf: $work/a_file exists and is not a folder" "${mock[@]}" "${llama[@]}" --export-hf "$work/a_file"
mkdir -p "$work/notes" && echo keep > "$work/notes/notes.txt"
expect_train_error "--export-hf: refusing to replace $work/notes: it holds 'notes.txt', which an export does not write" \
  "${mock[@]}" "${llama[@]}" --export-hf "$work/notes"
expect_train_error "--save $work/run/ckpt lies in the --export-hf folder $work/run, which an export replaces whole" \
  "${mock[@]}" "${llama[@]}" --export-hf "$work/run" --save-interval 10 --save "$work/run/ckpt"
# An earlier export is replaced whole, as a second save_pretrained into the same folder would overwrite it.
for attempt in 1 2; do
  if ! "$bin" train "${mock[@]}" "${llama[@]}" --export-hf "$work/hf" >"$work/export.log" 2>&1; then
    fail "export $attempt into $work/hf: $(tail -1 "$work/export.log")"
  fi
done
[ -f "$work/hf/config.json" ] && [ ! -e "$work/hf.tmp" ] && echo "ok: a second export replaces the first"

# --save and --load.
expect_train_error "--save: $work/a_file exists and is not a folder" "${mock[@]}" --save-interval 10 --save "$work/a_file"
expect_train_error "--save: $work/a_file/ckpt cannot be created: $work/a_file is not a folder" "${mock[@]}" \
  --save-interval 10 --save "$work/a_file/ckpt"
expect_train_error "--save: /proc/moecore_ckpt cannot be created: cannot create a file in /proc" "${mock[@]}" \
  --save-interval 10 --save /proc/moecore_ckpt
expect_train_error "--tensorboard-dir: $work/a_file/tb cannot be created: $work/a_file is not a folder" "${mock[@]}" \
  --tensorboard-dir "$work/a_file/tb"
expect_train_error "--load $work/a_file is a file, not a checkpoint folder" "${mock[@]}" --load "$work/a_file"
# --save into a folder whose newest checkpoint is another model's: refused before training (the folder untouched),
# unless --save-overwrite-other-model; the same model restarted without --load is warned that the tracker goes back.
"$bin" train "${mock[@]}" --train-iters 4 --save-interval 2 --save "$work/shared" >/dev/null 2>&1 ||
  fail "a first run saving into $work/shared"
expect_train_error "--save $work/shared holds another model's checkpoint: iteration 4 was saved with --hidden-size 32, this run has 48 (pass --save-overwrite-other-model" \
  "${model[@]}" --mock-data --hidden-size 48 --train-iters 4 --save-interval 2 --save "$work/shared"
[ "$(cat "$work/shared/latest_checkpointed_iteration.txt")" = 4 ] || fail "a refused --save moved the tracker"
"$bin" train "${mock[@]}" --train-iters 3 --save-interval 2 --save "$work/shared" >"$work/back.log" 2>&1 ||
  fail "the same model restarted without --load: $(tail -1 "$work/back.log")"
if [ "$(grep -c "^WARNING: --save $work/shared: .* names iteration 4, this run starts at iteration 0 and its first save (iteration 2) moves it back" "$work/back.log")" = 1 ]; then
  echo "ok: the tracker going back is warned of"
else
  fail "no warning that the tracker goes back: $(grep WARNING "$work/back.log")"
fi
"$bin" train "${model[@]}" --mock-data --hidden-size 48 --train-iters 4 --save-interval 2 --save "$work/shared" \
  --save-overwrite-other-model >"$work/over.log" 2>&1 && [ "$(cat "$work/shared/latest_checkpointed_iteration.txt")" = 4 ] &&
  echo "ok: --save-overwrite-other-model saves over another model" || fail "--save-overwrite-other-model: $(tail -1 "$work/over.log")"

# Under mpirun: the export folder is checked on rank 0 (the rank that writes it), and every rank stops at once.
if command -v mpirun >/dev/null; then
  mpi=(env OMP_NUM_THREADS=1 mpirun -q --allow-run-as-root --oversubscribe -np 2 "$bin" train)
  check_one_line_error "--export-hf: $work/a_file exists and is not a folder" "${mpi[@]}" "${mock[@]}" "${llama[@]}" \
    --global-batch-size 4 --export-hf "$work/a_file" && echo "ok: mpirun -np 2: --export-hf checked on rank 0"
  check_one_line_error "--save: $work/a_file exists and is not a folder" "${mpi[@]}" "${mock[@]}" --global-batch-size 4 \
    --save-interval 10 --save "$work/a_file" && echo "ok: mpirun -np 2: --save"
fi

# --sample-prompt with the NullTokenizer: ids, not words.
expect_train_error "--sample-prompt: NullTokenizer: 'hello' is not an integer" "${mock[@]}" --sample-prompt hello

# Data: the splits the run reads, the vocabulary of the data (ids up to 919 and EOD 1000 against a vocabulary of
# 100 + EOD), folders in place of files.
printf '{"text": "%s"}\n' "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20" "21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40" \
  "41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60" "61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80" \
  "900 901 902 903 904 905 906 907 908 909 910 911 912 913 914 915 916 917 918 919" > "$work/ids.jsonl"
"$bin" preprocess --input "$work/ids.jsonl" --output-prefix "$work/ids" --tokenizer-type NullTokenizer \
  --vocab-size 1000 --append-eod --workers 1 >/dev/null 2>&1 || fail "preprocess of $work/ids.jsonl"
data=("${model[@]}" --data-cache-path "$work/cache")
expect_train_error "--split does not apply to --mock-data (mock data is always split 1,1,1, as in Megatron); drop --split" \
  "${mock[@]}" --split 0,1,0
expect_train_error "--split '0,1,0': the train split has weight 0, so there is nothing to train on" \
  "${data[@]}" --data-path "$work/ids_text_document" --split 0,1,0 --vocab-size 1000
expect_train_error "--split '100,0,0': the valid split has weight 0, so --eval-interval 1 would evaluate nothing" \
  "${data[@]}" --data-path "$work/ids_text_document" --split 100,0,0 --eval-interval 1 --vocab-size 1000
expect_train_error "--split '-1,1,1': weight '-1' is negative (split weights must be non-negative)" \
  "${data[@]}" --data-path "$work/ids_text_document" --split -1,1,1
expect_train_error "--data-path $work/ids_text_document: token id 1000 in sequence 0 is outside the tokenizer's vocabulary [0, 101)" \
  "${data[@]}" --data-path "$work/ids_text_document" --split 1,1,0
# 5 documents split 98,2,0: the valid split gets documents [round(4.9), round(5)) = [5, 5), none.
expect_train_error "the valid split has no documents (sequences [5, 5) of 5); use more data or change --split" \
  "${data[@]}" --data-path "$work/ids_text_document" --split 98,2,0 --vocab-size 1000
# An unweighted blend holds one epoch of each dataset: 2 documents of 21 tokens, (42 - 1) // 16 = 2 samples each.
expect_train_error "--split '1,1,0': the train split holds 4 samples of 16 tokens, the run reads 6" \
  "${data[@]}" --data-path "$work/ids_text_document" "$work/ids_text_document" --split 1,1,0 --vocab-size 1000 \
  --train-iters 3
mkdir -p "$work/folder_data.bin" && cp "$work/ids_text_document.idx" "$work/folder_data.idx"
expect_train_error "$work/folder_data.bin is a folder, not the dataset's token file" \
  "${data[@]}" --data-path "$work/folder_data" --vocab-size 1000

# preprocess: an input without documents is an error, not an empty dataset.
: > "$work/empty.jsonl"
null_pre=(--tokenizer-type NullTokenizer --vocab-size 100 --workers 1)
expect_error "no documents in --input $work/empty.jsonl" "$bin" preprocess --input "$work/empty.jsonl" \
  --output-prefix "$work/empty" "${null_pre[@]}" && echo "ok: no documents in an empty input"
[ -e "$work/empty_text_document.bin" ] && fail "preprocess of an empty input wrote a dataset"
printf '{"body": "1 2"}\n{"body": "3"}\n' > "$work/nokey.jsonl"
expect_error "line 1: no key 'text'" "$bin" preprocess --input "$work/nokey.jsonl" --output-prefix "$work/nokey" \
  "${null_pre[@]}" && echo "ok: lines without the --json-keys key"

# HF config.json: integer fields are integers in range.
"$bin" train "${mock[@]}" "${llama[@]}" --export-hf "$work/hf" >/dev/null 2>&1 || fail "export into $work/hf"
for case in 'num_hidden_layers|2.5|must be an integer (got 2.5)' \
            'hidden_size|1180591620717411303424|is out of range (got 1.1805916207174113e+21)'; do
  IFS='|' read -r field value message <<<"$case"
  rm -rf "$work/hf_bad" && cp -r "$work/hf" "$work/hf_bad"
  /usr/bin/python3 - "$work/hf_bad/config.json" "$field" "$value" <<'PY'
import json, sys
path, field, value = sys.argv[1:]
text = open(path).read()
config = json.loads(text)
old = f'"{field}": {config[field]}'
assert old in text, old
open(path, "w").write(text.replace(old, f'"{field}": {value}'))
PY
  expect_error "$work/hf_bad/config.json: field '$field' $message" "$bin" generate --load "$work/hf_bad" \
    --prompt "1 2" && echo "ok: $field $value"
done

echo "$failures failed"
[ $failures -eq 0 ]
