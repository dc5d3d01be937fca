#!/usr/bin/env bash
# Hostile checkpoint inputs: a metadata.json with a value of the wrong JSON type, pieces that do not cover their
# tensor exactly once, tensors that the recorded model flags contradict, a wrong file checksum. `train --load` and
# `moecore checkpoint` each end with one `error:` line naming the file and the field or tensor (never a raw JSON
# exception), and `moecore checkpoint` reports "verified" only for a checkpoint that such a load accepts.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
mapfile -t config < <(recipe "$src" mixtral-tiny)
model=("${config[@]}" --train-iters 2 --lr-warmup-iters 1 --eval-iters 0 --log-interval 1)
"$bin" train "${model[@]}" --save "$work/run" --save-interval 2 >"$work/save.log" 2>&1 ||
  { tail -3 "$work/save.log"; echo "FAIL: the first save"; exit 1; }
"$bin" checkpoint "$work/run" >/dev/null || { echo "FAIL: the saved checkpoint does not verify"; exit 1; }
"$bin" train "${model[@]}" --load "$work/run" >"$work/load.log" 2>&1 || { tail -3 "$work/load.log"; echo "FAIL: reload"; exit 1; }

# damaged NAME PYTHON: a copy of the checkpoint as $work/NAME whose metadata.json (`m`) PYTHON edits.
damaged() {
  rm -rf "$work/$1" && cp -r "$work/run" "$work/$1"
  python3 - "$work/$1/iter_0000002/metadata.json" "$2" <<'PY'
import json, sys
path, edit = sys.argv[1], sys.argv[2]
m = json.load(open(path))
exec(edit)
json.dump(m, open(path, "w"), indent=1)
PY
}
load() { "$bin" train "${model[@]}" --load "$work/$1"; }  # the saved run's flags: a good copy loads
meta="iter_0000002/metadata.json"

# A value of the wrong type where metadata.json holds an object: the field's JSON path, not
# "[json.exception.type_error.304]" (after a load had advised --no-load-rng for a "tensors" that was null).
damaged model_null 'm["args"]["model"] = None'
expect_error "$meta: \"args.model\" must be an object, got null" load model_null
expect_error "$meta: \"args.model\" must be an object, got null" "$bin" checkpoint "$work/model_null"
damaged args_number 'm["args"] = 3'
expect_error "$meta: \"args\" must be an object, got 3" load args_number
damaged tensors_null 'm["tensors"] = None'
expect_error "$meta: \"tensors\" must be an object, got null" load tensors_null
damaged seed_null 'm["tensors"]["rng.seed"] = None'
expect_error "$meta: \"tensors.rng.seed\" must be an object, got null" load seed_null
damaged piece_string 'm["tensors"]["iteration"]["pieces"][0] = "x"'
expect_error "$meta: \"tensors.iteration.pieces[0]\" must be an object, got \"x\"" "$bin" checkpoint "$work/piece_string"
damaged layout_array 'm["layout"] = []'
expect_error "$meta: \"layout\" must be an object, got an array" "$bin" checkpoint "$work/layout_array"

# Contents a load rejects are not "verified".
damaged empty 'm["files"] = {}; m["tensors"] = {}'
expect_error "$meta: its model flags (4 layers, 8 experts) imply more tensors than the 0 it holds" \
  "$bin" checkpoint "$work/empty"
key=decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight
damaged renamed "m['tensors']['${key/7/9}'] = m['tensors'].pop('$key')"
expect_error "$meta: no tensor $key (a load of this checkpoint reads it)" "$bin" checkpoint "$work/renamed"
expect_error "no tensor of $key" load renamed
damaged hidden 'm["args"]["model"]["--hidden-size"] = 256'
expect_error "$meta: tensor embedding.word_embeddings.weight has shape [1152, 128], its model flags (args.model) imply [1152, 256]" \
  "$bin" checkpoint "$work/hidden"
damaged layers_string 'm["args"]["model"]["--num-layers"] = "4"'
expect_error "$meta: \"args.model.--num-layers\" must be an integer in [0, 2^30], got \"4\"" \
  "$bin" checkpoint "$work/layers_string"
# Pieces that leave elements out, or hold some twice.
damaged gap 'm["tensors"]["decoder.final_layernorm.weight"]["shape"] = [256]'
expect_error "$meta: the pieces of decoder.final_layernorm.weight leave element 128 out of its [256] elements" \
  "$bin" checkpoint "$work/gap"
expect_error "$meta: the pieces of decoder.final_layernorm.weight leave element 128 out" load gap

# The file checksum metadata.json records is checked by a load too (from the header and the pieces' checksums).
damaged file_crc 'f = m["files"]["rank_00000.safetensors"]; f["crc32"] = ("0" if f["crc32"][0] != "0" else "1") + f["crc32"][1:]'
expect_error "rank_00000.safetensors: checksum mismatch" load file_crc
expect_error "rank_00000.safetensors: checksum mismatch" "$bin" checkpoint "$work/file_crc"

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "checkpoint inputs: all passed"
