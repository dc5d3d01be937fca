#!/usr/bin/env bash
# --moe-routing-trace-path: the demo recipe (mock data, 3 iterations, --log-interval 1) writes Megatron's router
# traces, which an independent reader (check_routing_trace.py, Python's standard library only) checks against
# Megatron's format and the run's text log: one JSONL file per rank, Megatron's fields in Megatron's order as
# json.dumps writes them, steps 0..2 (Megatron's step = iteration - 1), each token's top-k experts ascending and in
# range, per step and layer the experts chosen over ranks and micro-batches equal to the log's "[MoE] layer L tokens
# per expert" (the second line sums iterations 1 and 2: Megatron's first line does not reset the interval), the bf16
# sidecars' offsets / sizes / shapes, and the logits sidecar agreeing with the chosen experts (softmax top-k without
# expert bias). One process and two (expert parallelism, each rank its own file); --moe-routing-trace-max-training-iters
# 2 into the first run's folder gives steps 0..1 only (the files emptied first); each flag error is one line and a
# non-zero exit. The checker rejects tampered copies of a trace and of a log (it can fail). `moecore report` reads the
# EP2 traces back: its heatmaps hold the two ranks' records summed.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
demo_without_split demo
demo+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --lr-warmup-iters 1 --log-interval 1
  --eval-iters 0 --train-iters 3)
checker="$src/tests/e2e/check_routing_trace.py"
capture=(--moe-routing-trace-capture-logits --moe-routing-trace-capture-hidden-states)

# value FLAG: the demo recipe's value of FLAG.
value() {
  local i
  for ((i = 0; i < ${#demo[@]} - 1; i++)); do
    if [ "${demo[i]}" = "$1" ]; then echo "${demo[i + 1]}"; return; fi
  done
  echo "no $1 in the demo recipe" >&2
}
shape=(--layers "$(value --num-layers)" --experts "$(value --num-experts)" --topk "$(value --moe-router-topk)"
  --hidden "$(value --hidden-size)"
  --tokens-per-step $(($(value --global-batch-size) * $(value --seq-length))))

# check TRACE_DIR LOG RANKS STEPS [--sidecars]: the independent reader.
check() {
  /usr/bin/python3 "$checker" "$1" "$2" --ranks "$3" --steps "$4" "${shape[@]}" "${@:5}"
}

# One process, both sidecars.
if timeout 300 "$bin" train "${demo[@]}" --moe-routing-trace-path "$work/trace" "${capture[@]}" \
  >"$work/run.log" 2>&1; then
  check "$work/trace" "$work/run.log" 1 3 --sidecars || fail "one process: the trace does not check"
else
  fail "one process: moecore train failed: $(tail -3 "$work/run.log")"
fi

# The checker can fail: each tampered copy of the trace (or of the log) is rejected.
# tamper NAME PYTHON: copies the trace and the log to $work/tampered, runs PYTHON there (`lines`: rank 0's JSONL
# lines; `dump(lines)` writes them back), expects the checker to reject the copy.
tamper() {
  rm -rf "$work/tampered" && cp -r "$work/trace" "$work/tampered" && cp "$work/run.log" "$work/tampered.log"
  (cd "$work/tampered" && /usr/bin/python3 -c "
import json
lines = open('router_trace_rank0.jsonl').read().splitlines()
def dump(lines):
    open('router_trace_rank0.jsonl', 'w').write(''.join(l + '\n' for l in lines))
$2") || { fail "tamper $1: the tampering itself failed"; return; }
  if check "$work/tampered" "$work/tampered.log" 1 3 --sidecars >"$work/tampered.out" 2>&1; then
    fail "tamper $1: the checker accepted it"
  else
    echo "ok: tamper $1 rejected: $(tail -1 "$work/tampered.out")"
  fi
}
if [ -f "$work/trace/router_trace_rank0.jsonl" ]; then
  # Another valid pair of experts for a token (its logits then disagree, and the log's counts).
  tamper expert 'r = json.loads(lines[5]); r["top_indices"][0] = [0, 1] if r["top_indices"][0] != [0, 1] else [2, 3]
lines[5] = json.dumps(r); dump(lines)'
  tamper key-order 'r = json.loads(lines[0]); r = {"stage": r.pop("stage"), **r}; lines[0] = json.dumps(r); dump(lines)'
  tamper separators 'lines[0] = json.dumps(json.loads(lines[0]), separators=(",", ":")); dump(lines)'
  tamper step 'r = json.loads(lines[-1]); r["step"] = 3; lines[-1] = json.dumps(r); dump(lines)'
  tamper lost-record 'dump(lines[:3] + lines[4:])'
  tamper logits-truncated 'f = open("logits_rank0.bin", "r+b"); f.truncate(f.seek(0, 2) - 2)'
  # The first token's chosen experts' logits lowered to -inf (bf16 0xff80).
  tamper logits-lowered 'f = open("logits_rank0.bin", "r+b")
for e in json.loads(lines[0])["top_indices"][0]: f.seek(2 * e); f.write(bytes([0x80, 0xff]))'
  tamper log-count 'import re; t = open("../tampered.log").read(); t = re.sub(r"(layer 2 tokens per expert: \[)(\d+)",
    lambda m: m.group(1) + str(int(m.group(2)) + 1), t, count=1); open("../tampered.log", "w").write(t)'
  tamper extra-file 'open("notes.txt", "w").write("x")'
fi

# --moe-routing-trace-max-training-iters 2 into a copy of that folder (without the sidecars' flags given again there
# would be old sidecars beside new records): steps 0..1, every file emptied first.
if [ -d "$work/trace" ]; then cp -r "$work/trace" "$work/trace_max2"; fi
if timeout 300 "$bin" train "${demo[@]}" --moe-routing-trace-path "$work/trace_max2" "${capture[@]}" \
  --moe-routing-trace-max-training-iters 2 >"$work/max2.log" 2>&1; then
  check "$work/trace_max2" "$work/max2.log" 1 2 --sidecars || fail "max 2 iterations: the trace does not check"
else
  fail "max 2 iterations: moecore train failed: $(tail -3 "$work/max2.log")"
fi

# Two processes, expert parallelism: each rank writes its own routing (its data-parallel share of the batch).
if command -v mpirun >/dev/null; then
  if timeout 300 mpirun --allow-run-as-root --oversubscribe -np 2 "$bin" train "${demo[@]}" \
    --expert-model-parallel-size 2 --moe-routing-trace-path "$work/trace_ep2" "${capture[@]}" \
    >"$work/ep2.log" 2>&1; then
    check "$work/trace_ep2" "$work/ep2.log" 2 3 --sidecars || fail "EP2: the trace does not check"
    # Read back by moecore report: each layer's heatmap holds the two ranks' records summed.
    "$bin" report "$work/trace_ep2" -o "$work/trace_ep2.html" >"$work/report.out" 2>&1 ||
      fail "EP2: moecore report of the traces failed: $(cat "$work/report.out")"
    /usr/bin/python3 - "$work/trace_ep2" "$work/trace_ep2.html" <<'PY' || fail "EP2: the report's heatmaps differ from the records"
import glob, json, re, sys
trace_dir, page = sys.argv[1], open(sys.argv[2]).read()
data = json.loads(re.search(r'<script type="application/json" id="moecore-report-data">(.*?)</script>', page, re.S).group(1))
want = {}
for path in sorted(glob.glob(trace_dir + "/router_trace_rank*.jsonl")):
    for r in map(json.loads, open(path)):
        column = want.setdefault(f'trace-layer-{r["layer"]}', {}).setdefault(r["step"] + 1, {})
        for token in r["top_indices"]:
            for e in token:
                column[e] = column.get(e, 0) + 1
got = {h["id"]: dict(zip(h["x"], h["values"])) for h in data["heatmaps"]}
if set(got) != set(want):
    sys.exit(f"heatmaps {sorted(got)} vs layers {sorted(want)}")
for layer, columns in want.items():
    for it, counts in columns.items():
        if got[layer].get(it) != [counts.get(e, 0) for e in range(len(got[layer].get(it, [])))]:
            sys.exit(f"{layer} iteration {it}: report {got[layer].get(it)}, records {counts}")
print(f"ok: moecore report reads the two ranks' traces: {len(want)} layers x {len(next(iter(want.values())))} iterations")
PY
  else
    fail "EP2: moecore train failed: $(tail -3 "$work/ep2.log")"
  fi
else
  echo "skip: no mpirun for the two-process part"
fi

# --moe-routing-trace-dump-weights: router_state_rank0.pt, read by PyTorch's own torch.load: one entry per MoE
# layer keyed as Megatron's (block, mtp_idx, layer), the gate weight as of the first traced forward; that weight applied
# to the hidden-states sidecar of step 0 gives the logits sidecar (both sidecars are bf16: within their rounding).
if timeout 300 "$bin" train "${demo[@]}" --train-iters 2 --moe-routing-trace-path "$work/trace_weights" "${capture[@]}" \
  --moe-routing-trace-dump-weights >"$work/weights.log" 2>&1; then
  /usr/bin/python3 - "$work/trace_weights" "$(value --num-layers)" "$(value --num-experts)" "$(value --hidden-size)" <<'PY' || fail "the router weights file does not check"
import json, sys, torch
trace, layers, experts, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
state = torch.load(trace + "/router_state_rank0.pt")
if sorted(state) != [("decoder", None, l) for l in range(layers)]:
    sys.exit(f"keys {sorted(state)}")
def bf16(path, offset, nbytes, shape):
    raw = open(path, "rb").read()[offset:offset + nbytes]
    words = torch.frombuffer(bytearray(raw), dtype=torch.int16)
    return words.view(torch.bfloat16).float().reshape(shape)
records = [json.loads(l) for l in open(trace + "/router_trace_rank0.jsonl")]
for l in range(layers):
    s = state[("decoder", None, l)]
    w = s["weight"]
    if w.dtype != torch.float32 or tuple(w.shape) != (experts, hidden) or s["expert_bias"] is not None:
        sys.exit(f"layer {l}: weight {w.dtype} {tuple(w.shape)}, expert_bias {s['expert_bias']}")
    if s["score_function"] != "softmax" or s["topk"] != 2:
        sys.exit(f"layer {l}: {s['score_function']} top-{s['topk']}")
    r = next(r for r in records if r["layer"] == l and r["step"] == 0)
    hs = bf16(trace + "/hidden_states_rank0.bin", r["hs_offset"], r["hs_bytes"], r["hs_shape"])
    logits = bf16(trace + "/logits_rank0.bin", r["logit_offset"], r["logit_bytes"], r["logit_shape"])
    error = (hs @ w.t() - logits).abs().max().item() / logits.abs().max().item()
    if error > 1e-2:  # each sidecar rounds to bf16 (2^-9 relative): about 3e-3 here
        sys.exit(f"layer {l}: weight x hidden states differ from the logits by {error:.3g} of their largest")
print(f"ok: torch.load reads {layers} routers; weight x hidden states = logits (bf16 rounding)")
PY
else
  fail "dump weights: moecore train failed: $(tail -3 "$work/weights.log")"
fi

# Flag errors: one line, a non-zero exit, before the model is built.
for flag in --moe-routing-trace-capture-logits --moe-routing-trace-capture-hidden-states \
  --moe-routing-trace-dump-weights "--moe-routing-trace-max-training-iters 2"; do
  # shellcheck disable=SC2086  # the flag and its value as two words
  expect_early_error "${flag%% *} requires --moe-routing-trace-path" "$bin" train "${demo[@]}" $flag
done
expect_early_error "--moe-routing-trace-max-training-iters must be positive (got 0)" "$bin" train "${demo[@]}" \
  --moe-routing-trace-path "$work/trace_zero" --moe-routing-trace-max-training-iters 0
expect_early_error "--moe-routing-trace-path requires --num-experts" "$bin" train "${quick_dense[@]}" --mock-data \
  --moe-routing-trace-path "$work/trace_dense"
[ ! -e "$work/trace_dense" ] || fail "a dense model's refused run created its trace folder"
echo x >"$work/plain_file"
expect_early_error "--moe-routing-trace-path: $work/plain_file/trace cannot be created" "$bin" train "${demo[@]}" \
  --moe-routing-trace-path "$work/plain_file/trace"

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "e2e ok"
