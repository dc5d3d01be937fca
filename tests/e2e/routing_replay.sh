#!/usr/bin/env bash
# Router replay end to end. A tiny Mixtral-style model (configs/mixtral-tiny.args, shrunk) trains on 12 documents of
# exactly --seq-length NullTokenizer ids, so every training sample is one whole document; two exports, A and B, differ
# by their seed. `moecore generate --record-routing` feeds each document to A (one new token) and appends its routing
# to rec.bin. Then:
#   same weights   training from A with the replay is bit-identical to training from A without it: one step at
#                  lr 1e-2 exports the same safetensors bytes, and at lr 0 (A's weights throughout) the router traces
#                  (--moe-routing-trace-path) hold the same experts for every layer, token and micro-batch;
#   other weights  training from B with the replay chooses A's recorded experts (its traces equal A's, while B without
#                  the replay chooses others), and under full and --recompute-modules moe recomputation exports the
#                  same bytes as without (the recompute routes by the recording too; a recompute that routed by the
#                  scores changes them);
#   EP2            under mpirun -np 2 with expert parallelism (data-parallel ranks) the ranks' traces hold the same
#                  expert choices as the one-process run, and the losses agree within 1e-5;
#   bad input      a corrupt, truncated or other-model recording, a sample without a record, and the flags' misuse are
#                  each one line and a non-zero exit.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
mpirun=${MPIRUN:-mpirun}

/usr/bin/python3 - "$work/docs.jsonl" <<'PY'
import json, random, sys
rng = random.Random(5)
with open(sys.argv[1], "w") as out:
    for _ in range(12):
        out.write(json.dumps({"text": " ".join(str(rng.randrange(200)) for _ in range(16))}) + "\n")
PY
"$bin" preprocess --input "$work/docs.jsonl" --output-prefix "$work/docs" --tokenizer-type NullTokenizer \
  --vocab-size 200 --workers 1 >/dev/null || fail "preprocess"

# The recipe without its mock data and schedule, shrunk to 2 layers of hidden 32 over 16-token sequences.
model=()
skip=0
while read -r word; do
  if [ $skip = 1 ]; then skip=0; continue; fi
  case "$word" in
    --mock-data) continue ;;
    --eval-interval | --eval-iters | --lr-warmup-iters | --train-iters | --log-interval) skip=1; continue ;;
  esac
  model+=("$word")
done < <(recipe "$src" mixtral-tiny)
model+=(--num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --seq-length 16 --max-position-embeddings 16
  --vocab-size 200 --micro-batch-size 2 --global-batch-size 4 --log-interval 1 --train-iters 2
  --data-path "$work/docs_text_document" --split 100,0,0 --data-cache-path "$work/cache")
replay=(--moe-enable-routing-replay --moe-routing-replay-file "$work/rec.bin")

# run NAME ARGS...: a training run's log in $work/NAME.log, its "lm loss ... grad norm" per iteration in NAME.losses.
run() {
  local name=$1
  shift
  if ! timeout 300 "$bin" train "${model[@]}" "$@" >"$work/$name.log" 2>&1; then
    fail "$name did not train: $(tail -2 "$work/$name.log")"
  fi
  grep -E '^ .*iteration +[0-9]+/' "$work/$name.log" | sed -E 's/.*(lm loss: [^|]*).*(grad norm: [^|]*).*/\1 \2/' \
    >"$work/$name.losses"
}
same_file() {  # same_file WHAT A B
  if cmp -s "$2" "$3"; then echo "ok: $1"; else fail "$1: $2 and $3 differ"; fi
}
# experts TRACE_DIR...: every record's top_indices, one JSON line each, rank files concatenated.
experts() {
  cat "$@" | /usr/bin/python3 -c 'import json, sys; [print(json.loads(l)["top_indices"]) for l in sys.stdin]'
}

run train_a --export-hf "$work/hf_a"
run train_b --export-hf "$work/hf_b" --seed 11
while read -r line; do
  prompt=$(/usr/bin/python3 -c 'import json, sys; print(json.loads(sys.argv[1])["text"])' "$line")
  "$bin" generate --load "$work/hf_a" --tokenizer-type NullTokenizer --vocab-size 200 --prompt "$prompt" \
    --max-new-tokens 1 --record-routing "$work/rec.bin" >/dev/null 2>"$work/generate.err" ||
    fail "generate --record-routing: $(cat "$work/generate.err")"
done <"$work/docs.jsonl"

# Same weights.
run a_one --load "$work/hf_a" --lr 1e-2 --train-iters 1 --export-hf "$work/a_one"
run a_one_replay --load "$work/hf_a" --lr 1e-2 --train-iters 1 --export-hf "$work/a_one_replay" "${replay[@]}"
same_file "same weights: one step with the replay updates bit for bit as without" \
  "$work/a_one/model.safetensors" "$work/a_one_replay/model.safetensors"
grep -q "router replay: 12 recorded sequences" "$work/a_one_replay.log" || fail "the replay run does not log its records"
run a_frozen --load "$work/hf_a" --lr 0 --moe-routing-trace-path "$work/trace_a"
run a_frozen_replay --load "$work/hf_a" --lr 0 --moe-routing-trace-path "$work/trace_a_replay" "${replay[@]}"
same_file "same weights: the same losses" "$work/a_frozen.losses" "$work/a_frozen_replay.losses"
experts "$work/trace_a/router_trace_rank0.jsonl" >"$work/experts_a"
experts "$work/trace_a_replay/router_trace_rank0.jsonl" >"$work/experts_a_replay"
[ "$(wc -l <"$work/experts_a")" -eq 8 ] || fail "expected 8 trace records (2 steps x 2 micro-batches x 2 layers)"
same_file "same weights: the same experts in every layer, token and micro-batch" "$work/experts_a" \
  "$work/experts_a_replay"

# Other weights.
run b --load "$work/hf_b" --lr 1e-2 --moe-routing-trace-path "$work/trace_b"
run b_replay --load "$work/hf_b" --lr 1e-2 --moe-routing-trace-path "$work/trace_b_replay" --export-hf "$work/b_replay" \
  "${replay[@]}"
experts "$work/trace_b/router_trace_rank0.jsonl" >"$work/experts_b"
experts "$work/trace_b_replay/router_trace_rank0.jsonl" >"$work/experts_b_replay"
same_file "other weights: the recorded experts in every layer and token" "$work/experts_a" "$work/experts_b_replay"
if cmp -s "$work/experts_a" "$work/experts_b"; then fail "B routes as A without the replay: the check shows nothing"; fi
run b_replay_full --load "$work/hf_b" --lr 1e-2 --export-hf "$work/b_replay_full" --recompute-granularity full \
  --recompute-method uniform --recompute-num-layers 1 "${replay[@]}"
same_file "other weights: full recomputation replays in backward" "$work/b_replay/model.safetensors" \
  "$work/b_replay_full/model.safetensors"
run b_replay_moe --load "$work/hf_b" --lr 1e-2 --export-hf "$work/b_replay_moe" --recompute-granularity selective \
  --recompute-modules moe "${replay[@]}"
same_file "other weights: --recompute-modules moe replays in backward" "$work/b_replay/model.safetensors" \
  "$work/b_replay_moe/model.safetensors"

# EP2 (two data-parallel ranks, each its own micro-batch).
if timeout 300 "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" train "${model[@]}" --load "$work/hf_b" \
  --lr 1e-2 --expert-model-parallel-size 2 --moe-routing-trace-path "$work/trace_ep2" "${replay[@]}" \
  >"$work/ep2.log" 2>&1; then
  experts "$work"/trace_ep2/router_trace_rank*.jsonl | sort >"$work/experts_ep2"
  sort "$work/experts_a" >"$work/experts_a_sorted"
  same_file "EP2: the ranks choose the recorded experts" "$work/experts_a_sorted" "$work/experts_ep2"
  /usr/bin/python3 - "$work/b_replay.log" "$work/ep2.log" <<'PY' || fail "EP2 losses"
import re, sys
one, two = ([float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", open(p).read())] for p in sys.argv[1:])
assert len(one) == len(two) == 2 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, two)), (one, two)
print("ok: EP2: losses", two, "within 1e-5 of one process", one)
PY
else
  fail "EP2 replay run: $(tail -2 "$work/ep2.log")"
fi

# Bad input.
/usr/bin/python3 - "$work/rec.bin" "$work" <<'PY'
import sys
data = open(sys.argv[1], "rb").read()
flipped = bytearray(data)
flipped[len(data) // 2] ^= 0x01
open(sys.argv[2] + "/flipped.bin", "wb").write(bytes(flipped))
open(sys.argv[2] + "/truncated.bin", "wb").write(data[: len(data) - 7])
open(sys.argv[2] + "/not_a_recording.bin", "wb").write(b"NOTROUTE" + data[8:])
PY
for doc in 0 1 2; do
  prompt=$(sed -n "$((doc + 1))p" "$work/docs.jsonl" | /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["text"])')
  "$bin" generate --load "$work/hf_a" --tokenizer-type NullTokenizer --vocab-size 200 --prompt "$prompt" \
    --max-new-tokens 1 --record-routing "$work/three.bin" >/dev/null 2>&1 || fail "generate into three.bin"
done
with() {  # with FILE: the replay flags for FILE
  echo --moe-enable-routing-replay --moe-routing-replay-file "$1"
}
expect_error "CRC-32 does not match its bytes" "$bin" train "${model[@]}" --load "$work/hf_b" $(with "$work/flipped.bin")
expect_error "truncated in" "$bin" train "${model[@]}" --load "$work/hf_b" $(with "$work/truncated.bin")
expect_error "not a routing recording" "$bin" train "${model[@]}" $(with "$work/not_a_recording.bin")
expect_error "routing recording $work/missing.bin: no such file" "$bin" train "${model[@]}" $(with "$work/missing.bin")
expect_error "recorded with top-2 routing, this model has --moe-router-topk 3" "$bin" train "${model[@]}" \
  --moe-router-topk 3 $(with "$work/rec.bin")
expect_error "recorded for MoE layers [0, 1], this model's are [0, 1, 2]" "$bin" train "${model[@]}" --num-layers 3 \
  $(with "$work/rec.bin")
expect_error "has no record of training sample" "$bin" train "${model[@]}" $(with "$work/three.bin")
expect_error "--moe-routing-replay-file requires --moe-enable-routing-replay" "$bin" train "${model[@]}" \
  --moe-routing-replay-file "$work/rec.bin"
expect_error "--moe-enable-routing-replay needs --moe-routing-replay-file FILE" "$bin" train "${model[@]}" \
  --moe-enable-routing-replay
expect_error "does not apply to --moe-router-load-balancing-type sinkhorn" "$bin" train "${model[@]}" \
  --moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0 $(with "$work/rec.bin")
expect_error "routing recording $work/flipped.bin: " "$bin" generate --load "$work/hf_a" --tokenizer-type NullTokenizer \
  --vocab-size 200 --prompt "1 2 3" --max-new-tokens 1 --record-routing "$work/flipped.bin"
expect_error "the window would slide" "$bin" generate --load "$work/hf_a" --tokenizer-type NullTokenizer \
  --vocab-size 200 --prompt "1 2 3" --max-new-tokens 15 --record-routing "$work/slide.bin"

echo "$failures failed"
[ "$failures" -eq 0 ]
