#!/usr/bin/env bash
# --log-progress writes <--save>/progress.txt as Megatron's append_to_progress_log: a job that stops at
# --exit-interval and its resumption with async saves give, tab-separated after the time, the job id and the number of
# processes, "Starting job", one "Saved checkpoint" line per save (iteration, job and cumulative throughput, the
# FLOPs so far, which grow by the model's FLOPs per iteration, and the tokens), then "Starting job" again,
# "Saving async checkpoint" and "Saved async checkpoint"; without --save the flag is refused.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
demo_without_split demo
demo+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --lr-warmup-iters 2 --eval-iters 0
  --log-interval 2 --train-iters 6 --save "$work/ckpt" --save-interval 2 --log-progress)

timeout 300 "$bin" train "${demo[@]}" --exit-interval 4 >"$work/first.log" 2>&1 || fail "first job failed: $(tail -2 "$work/first.log")"
SLURM_JOB_ID=77 timeout 300 "$bin" train "${demo[@]}" --load "$work/ckpt" --async-save >"$work/second.log" 2>&1 ||
  fail "second job failed: $(tail -2 "$work/second.log")"
/usr/bin/python3 - "$work/ckpt/progress.txt" <<'PY' || fail "progress.txt is not Megatron's"
import re, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
events = [r[3] for r in rows]
want = ["Starting job", "Saved checkpoint", "Saved checkpoint", "Starting job", "Saving async checkpoint",
        "Saved async checkpoint"]
assert events == want, f"events {events}, expected {want}"
for r in rows:
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", r[0]), r
    assert r[2] == "# GPUs: 1", r
assert [r[1] for r in rows] == ["Job ID: "] * 3 + ["Job ID: 77"] * 3, [r[1] for r in rows]
saves = [r for r in rows if r[3] in ("Saved checkpoint", "Saving async checkpoint")]
iterations = [int(r[4].removeprefix("Iteration: ")) for r in saves]
assert iterations == [2, 4, 6], iterations
for r in saves:
    assert re.fullmatch(r"Job throughput: \d+\.\d TFLOP/s/GPU", r[5]) and re.fullmatch(r"Cumulative throughput: \d+\.\d TFLOP/s/GPU", r[6]), r
    assert re.fullmatch(r"Tokens \(in billions\): \d+\.\d\d", r[8]), r
flops = [float(r[7].removeprefix("Floating-point operations: ")) for r in saves]
per_iteration = flops[0] / 2
for it, f in zip(iterations, flops):
    assert abs(f - it * per_iteration) <= 0.01 * f, (iterations, flops)
assert rows[5][4] == "Iteration: 6", rows[5]
print(f"ok: {len(rows)} lines, FLOPs {flops}")
PY

expect_error "--log-progress writes progress.txt into --save: it requires --save" \
  "$bin" train "${demo[@]:0:${#demo[@]}-5}" --log-progress

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "e2e ok"
