#!/usr/bin/env bash
# Sizes, counts and values beyond what a user could mean end before any training step with one line naming the flag
# and the limit (or, for a configuration too large for the machine, the memory it would need); never a crash, a
# hang, a wrapped number or a silently wrong run. A model that diverges stops with the iteration.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
model=("${quick_dense[@]}")
base=("${model[@]}" --mock-data)


# Shapes whose element counts overflowed 64-bit integers (heap corruption, misleading errors).
expect_early_error "--max-position-embeddings 288230376151711744 is above the limit of 16777216" \
  "$bin" train "${base[@]}" --max-position-embeddings 288230376151711744 --seq-length 2048
expect_early_error "--ffn-hidden-size 4611686018427387904 is above the limit" \
  "$bin" train "${base[@]}" --ffn-hidden-size 4611686018427387904
expect_early_error "--make-vocab-size-divisible-by 288230376151711744 is above the limit" \
  "$bin" train "${base[@]}" --make-vocab-size-divisible-by 288230376151711744
expect_early_error "exceeds 2^31 - 1 token ids" "$bin" train "${base[@]}" --vocab-size 2147483600
# Thread counts: beyond the machine (OpenMP crashed), beyond int (silently truncated).
expect_early_error "--threads 100000 is above the limit" "$bin" train "${base[@]}" --threads 100000
expect_early_error "--threads 2147483648 is above the limit" "$bin" train "${base[@]}" --threads 2147483648
# Iterations: train_iters x global batch overflowed and the dataset build spun forever; within the limit, the
# sample indices alone would not fit.
expect_early_error "--train-iters 4611686018427387904 is above the limit of 1099511627776" \
  "$bin" train "${base[@]}" --train-iters 4611686018427387904
expect_early_error "x --global-batch-size (2147483648) is more tokens than 64-bit integers count" \
  "$bin" train "${base[@]}" --train-iters 1099511627776 --global-batch-size 2147483648 --micro-batch-size 1
expect_early_error "of memory is available to it" "$bin" train "${base[@]}" --train-iters 1099511627776
# Memory: a model too large for the machine is refused with the numbers, not std::bad_alloc.
expect_early_error "this configuration needs about" "$bin" train "${base[@]}" --hidden-size 1048576 \
  --num-attention-heads 1
# Values no run could mean, accepted silently or misreported before.
expect_early_error "--moe-router-topk-scaling-factor 1e38 is above the limit of 100" \
  "$bin" train "${base[@]}" --num-experts 4 --moe-router-topk-scaling-factor 1e38
expect_early_error "--seed -1 is negative" "$bin" train "${base[@]}" --seed -1
expect_early_error "--adam-eps must be positive (got 0)" "$bin" train "${base[@]}" --adam-eps 0
expect_early_error "--lr 1e4 is above the limit of 1" "$bin" train "${base[@]}" --lr 1e4
# A delayed-scaling margin beyond E4M3's 17.8 binades quantizes everything to 0 or saturates it; a constant loss scale
# below 2^-24 turns every gradient into 0 (and 1 / scale into Inf: every iteration skipped, exit 0).
expect_early_error "--fp8-margin must be between -17 and 17 (got 60)" "$bin" train "${base[@]}" --fp8-format e4m3 \
  --fp8-margin 60
expect_early_error "--fp8-margin must be between -17 and 17 (got -60)" "$bin" train "${base[@]}" --fp8-format hybrid \
  --fp8-margin -60
expect_early_error "--loss-scale 1e-45 is below 2^-24" "$bin" train "${base[@]}" --bf16 --loss-scale 1e-45
expect_early_error "--tensor-model-parallel-size 4294967298 is above the limit of 1048576" \
  "$bin" train "${base[@]}" --tensor-model-parallel-size 4294967298
expect_early_error "--world-size 100000000 is above the limit of 1048576 ranks" "$bin" layout --world-size 100000000 \
  --num-layers 4

# A run whose values overflow still stops with the iteration: under --fp16 (constant loss scale, so no iteration is
# skipped) a HF checkpoint whose MLP weights are 1e6, finite but beyond fp16's 65504, makes the first loss NaN.
if /usr/bin/python3 -c "import numpy" 2>/dev/null; then
  llama=("${quick_dense[@]}" --lr-warmup-iters 1 --eval-iters 0 --mock-data --swiglu --normalization RMSNorm
         --position-embedding-type rope --disable-bias-linear)
  "$bin" train "${llama[@]}" --train-iters 2 --export-hf "$work/hf" >"$work/export.log" 2>&1 ||
    { echo "FAIL: export run"; cat "$work/export.log"; failures=$((failures + 1)); }
  # generate reads the NullTokenizer's ids as `train` does, and bounds the tokens it is asked for.
  if "$bin" generate --load "$work/hf" --prompt "1 2 3" --max-new-tokens 4 --tokenizer-type NullTokenizer \
    --vocab-size 128 >"$work/generate.txt" 2>&1; then
    echo "ok: generate with the NullTokenizer: $(tr '\n' ' ' <"$work/generate.txt")"
  else
    echo "FAIL: generate with the NullTokenizer: $(cat "$work/generate.txt")"; failures=$((failures + 1))
  fi
  # The key / value cache gives the re-run's tokens, also once prompt + new tokens outgrow the 32-token context and
  # the window slides (the cache starts over at every step then). Sampled: this barely trained model's greedy
  # continuation is one token over and over.
  for cache in "" --no-kv-cache; do
    "$bin" generate --load "$work/hf" --prompt "1 2 3" --max-new-tokens 40 --temperature 1 --seed 7 \
      --tokenizer-type NullTokenizer --vocab-size 128 $cache >"$work/generate_window${cache}.txt" 2>&1 ||
      fail "generate $cache: $(cat "$work/generate_window${cache}.txt")"
  done
  if cmp -s "$work/generate_window.txt" "$work/generate_window--no-kv-cache.txt" &&
    [ "$(wc -w <"$work/generate_window.txt")" -eq 43 ]; then
    echo "ok: generate with and without the kv cache: $(cat "$work/generate_window.txt")"
  else
    fail "generate with / without the kv cache differ: $(cat "$work/generate_window.txt") vs \
$(cat "$work/generate_window--no-kv-cache.txt")"
  fi
  expect_early_error "--max-new-tokens 4611686018427387904 is above the limit" "$bin" generate --load "$work/hf" \
    --prompt "1 2 3" --max-new-tokens 4611686018427387904 --tokenizer-type NullTokenizer --vocab-size 128
  # The model's context is 32 positions and its embedding 256 rows (128 ids + EOD, padded to a multiple of 128): a
  # longer prompt was cut without a word, a larger NullTokenizer's ids read zero rows.
  null=(--tokenizer-type NullTokenizer --vocab-size 128)
  expect_early_error "the prompt is 40 tokens, longer than the model's context of 32 tokens" "$bin" generate \
    --load "$work/hf" --prompt "$(seq -s ' ' 1 40)" "${null[@]}"
  expect_early_error "--vocab-size 300 gives a NullTokenizer of 301 tokens (the ids and end-of-document), more than \
the model's 256 embedding rows" "$bin" generate --load "$work/hf" --prompt "1 2 3" --tokenizer-type NullTokenizer \
    --vocab-size 300
  seq -s ' ' 1 8 >"$work/prompt.txt"
  if "$bin" generate --load "$work/hf" --prompt-file "$work/prompt.txt" --max-new-tokens 2 "${null[@]}" \
    >"$work/generate_file.txt" 2>&1 && grep -q "^1 2 3 4 5 6 7 8 [0-9]* [0-9]*$" "$work/generate_file.txt"; then
    echo "ok: generate --prompt-file: $(cat "$work/generate_file.txt")"
  else
    fail "generate --prompt-file: $(cat "$work/generate_file.txt")"
  fi
  expect_early_error "--prompt-file $work/none.txt: no such file" "$bin" generate --load "$work/hf" \
    --prompt-file "$work/none.txt" "${null[@]}"
  expect_early_error "--sample-prompt is 40 tokens, longer than --seq-length 32" "$bin" train "${llama[@]}" \
    --train-iters 2 --sample-prompt "$(seq -s ' ' 1 40)"
  PYTHONPATH="$src/tests/oracle" /usr/bin/python3 - "$work/hf/model.safetensors" <<'PY'
import sys
import numpy as np
import st
tensors, metadata = st.load(sys.argv[1])
name = "model.layers.0.mlp.down_proj.weight"
tensors[name] = np.full_like(tensors[name], 1e6)
st.save(sys.argv[1], tensors, metadata)
PY
  "$bin" train "${llama[@]}" --train-iters 4 --load "$work/hf" --fp16 --loss-scale 1 >"$work/diverge.log" 2>"$work/diverge.err"
  rc=$?
  if [ $rc -eq 0 ] || [ $rc -ge 124 ] || ! grep -q "at iteration 1 .*they come from --load" "$work/diverge.err"; then
    echo "FAIL: diverging run: exit $rc, $(cat "$work/diverge.err")"; failures=$((failures + 1))
  else
    echo "ok: diverging run stops: $(cat "$work/diverge.err")"
  fi
fi

echo "$failures failed"
[ $failures -eq 0 ]
