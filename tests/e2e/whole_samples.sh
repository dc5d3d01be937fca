#!/usr/bin/env bash
# Whole variable-length samples end to end: 24 samples of 3-16 ids with their prompts masked, as JSONL and as the
# indexed pair `moecore preprocess --json-keys tokens loss_mask` writes from it. Training the tiny MoE recipe on either
# form, packed (Megatron-RL's packer) or not, gives the same losses (one epoch: 3 steps of 8 samples); the log's real
# tokens over the epoch are every sample's tokens once, its bins and padding tokens add up to the bins' tokens; a
# sample longer than --seq-length and a malformed line are one-line errors.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"

/usr/bin/python3 - "$work/samples.jsonl" "$work/expected" <<'PY'
import json, random, sys
rng = random.Random(4)
total = 0
with open(sys.argv[1], "w") as out:
    for _ in range(24):
        n = rng.randint(3, 16)
        prompt = rng.randint(1, n - 1)
        total += n
        out.write(json.dumps({"tokens": [rng.randrange(100) for _ in range(n)],
                              "loss_mask": [0] * prompt + [1] * (n - prompt)}) + "\n")
open(sys.argv[2], "w").write(str(total))
PY
"$bin" preprocess --input "$work/samples.jsonl" --json-keys tokens loss_mask --output-prefix "$work/samples" \
  --tokenizer-type NullTokenizer --vocab-size 100 --workers 1 >/dev/null 2>"$work/preprocess.err" ||
  fail "preprocess: $(cat "$work/preprocess.err")"

mapfile -t model < <(recipe "$src" tiny-moe)
model+=(--tokenizer-type NullTokenizer --vocab-size 100 --micro-batch-size 1 --global-batch-size 8 --train-iters 3
  --lr 1e-3 --log-interval 1 --eval-iters 0 --calculate-per-token-loss --attention-dropout 0 --hidden-dropout 0
  --position-embedding-type rope)
source "$src/tests/e2e/lib/train_runs.sh"
run jsonl --sample-data-path "$work/samples.jsonl"
run jsonl_packed --sample-data-path "$work/samples.jsonl" --rl-use-sequence-packing
run indexed_packed --sample-data-path "$work/samples" --rl-use-sequence-packing
[ "$(wc -l <"$work/jsonl.losses")" -eq 3 ] || fail "expected 3 iterations"
same_file "packed samples train as each sample alone" "$work/jsonl.losses" "$work/jsonl_packed.losses"
same_file "the indexed form trains as the JSONL form" "$work/jsonl_packed.losses" "$work/indexed_packed.losses"
# One step of the whole epoch (24 samples) on 2 data-parallel ranks.
if timeout 300 mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" train "${model[@]}" \
  --sample-data-path "$work/samples.jsonl" --rl-use-sequence-packing --global-batch-size 24 --train-iters 1 \
  >"$work/epoch.log" 2>&1; then
  /usr/bin/python3 - "$work/epoch.log" "$(cat "$work/expected")" <<'PY' || fail "the log's packing figures"
import re, sys
text, total = open(sys.argv[1]).read(), int(sys.argv[2])
line = next(l for l in text.splitlines() if re.search(r"iteration +1/", l))
real = int(re.search(r"real tokens per iteration: (\d+)", line).group(1))
bins, padding_bins = map(int, re.search(r"bins per iteration: (\d+) \(\+(\d+) padding\)", line).groups())
pad = int(re.search(r"padding tokens per iteration: (\d+)", line).group(1))
assert real == total, (real, total)
assert (bins + padding_bins) * 16 == real + pad, (bins, padding_bins, real, pad)
assert -(-total // 16) <= bins < 24 and (bins + padding_bins) % 2 == 0, (bins, padding_bins)
print(f"ok: one epoch trains {real} tokens in {bins} bins (+{padding_bins} padding), {pad} padding tokens")
PY
else
  fail "the epoch run: $(tail -2 "$work/epoch.log")"
fi
/usr/bin/python3 -c 'import json; print(json.dumps({"tokens": list(range(17))}))' >"$work/long.jsonl"
expect_error "sample 0 has 17 tokens, more than --seq-length 16 (a sample is never cut)" "$bin" train "${model[@]}" \
  --sample-data-path "$work/long.jsonl"
printf '{"tokens": [1, 2]}\n{"tokens": [1, 2}\n' >"$work/malformed.jsonl"
expect_error "$work/malformed.jsonl:2: malformed JSON" "$bin" train "${model[@]}" --sample-data-path "$work/malformed.jsonl"
expect_error "--sample-data-path restarts the positions in every sample: it needs --position-embedding-type rope" \
  "$bin" train "${model[@]}" --sample-data-path "$work/samples.jsonl" --position-embedding-type learned_absolute
expect_error "--sample-data-path trains one bin per micro-batch: it needs --micro-batch-size 1" "$bin" train \
  "${model[@]}" --sample-data-path "$work/samples.jsonl" --micro-batch-size 2 --global-batch-size 8

echo "$failures failed"
[ "$failures" -eq 0 ]
