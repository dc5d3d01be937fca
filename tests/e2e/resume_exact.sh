#!/usr/bin/env bash
# A resumed run prints what the uninterrupted run prints, as Megatron's resume does:
#   - --fp16 MoE (two dynamic loss scalers, Megatron's chained dense / expert optimizers): saved at iteration 10 and
#     resumed, iterations 11-20 equal the uninterrupted run's (loss scale, skipped count, lm loss, grad norm);
#   - --bf16 with the distributed optimizer under DP2 (mpirun), the same;
#   - a resume with a smaller global batch size follows Megatron's LR formula over the samples seen
#     (--use-checkpoint-opt_param-scheduler: the checkpoint's lengths; --override-opt_param-scheduler: the flags'
#     lengths from the consumed samples); without either, one line naming the scheduler field;
#   - --no-load-optim restarts the schedule at step 0 and keeps the iteration; --finetune keeps the FLOPs so far;
#   - a `release` tracker loads DIR/release (weights only, iteration 0);
#   - non-persistent checkpoints: looked for only with --non-persistent-ckpt-type, newer than --ckpt-step wins,
#     --non-persistent-global-ckpt-dir, the previous one kept while the next is written;
#   - --exit-signal chooses the signal --exit-signal-handler catches.
set -euo pipefail
source "$(dirname "$0")/lib/setup.sh" "$@"
stop() { fail "$@"; exit 1; }
mapfile -t moe < <(recipe "$src" mixtral-tiny)
# Smaller than the recipe so the test stays quick; every iteration logged, no evaluation.
moe+=(--num-layers 2 --seq-length 64 --max-position-embeddings 64 --train-iters 20 --log-interval 1 --eval-iters 0
  --lr-decay-style linear)
# The log line of iteration I without its timestamp and timing.
lines() { grep -E "iteration +$2/" "$1" | sed -E 's/^ *\[[^]]*\] //; s/elapsed time per iteration \(ms\): [0-9.]+ \| //; s/ time left \(estimate\): [^|]+ \|//'; }
same_from() {  # NAME FULL RESUMED FIRST LAST
  local i
  for i in $(seq "$4" "$5"); do
    [ -n "$(lines "$2" "$i")" ] || { cat "$3"; stop "$1: no line for iteration $i"; }
    [ "$(lines "$2" "$i")" = "$(lines "$3" "$i")" ] ||
      { echo "full:    $(lines "$2" "$i")"; echo "resumed: $(lines "$3" "$i")"; stop "$1: iteration $i differs"; }
  done
}

# fp16: the scalers start at 2^20 and grow after 3 finite iterations, so both skips and growth happen around the save.
fp16=(--fp16 --initial-loss-scale 1048576 --loss-scale-window 3)
"$bin" train "${moe[@]}" "${fp16[@]}" >"$work/fp16_full.log" 2>&1 || { tail "$work/fp16_full.log"; stop "fp16 run"; }
"$bin" train "${moe[@]}" "${fp16[@]}" --save "$work/fp16" --save-interval 10 --exit-interval 10 >"$work/fp16_a.log" 2>&1
"$bin" train "${moe[@]}" "${fp16[@]}" --load "$work/fp16" >"$work/fp16_b.log" 2>&1
same_from "fp16 resume" "$work/fp16_full.log" "$work/fp16_b.log" 11 20
grep -q "number of skipped iterations:   [1-9]" "$work/fp16_full.log" || stop "fp16: no iteration was skipped"
echo "ok: --fp16 MoE resumed at 10 prints iterations 11-20 as the uninterrupted run ($(lines "$work/fp16_b.log" 11 |
  grep -oE 'loss scale: [0-9.]+'))"

# The skipped-iteration counts of the first lines: at 2^32 the first iterations overflow. Megatron's training_log
# does not reset its counters after the run's first line (should_reset = not is_first_iteration), so the line of
# iteration 2 counts iterations 1 and 2, and the next lines one interval each.
"$bin" train "${moe[@]}" --fp16 --exit-interval 3 >"$work/fp16_first.log" 2>&1 || stop "fp16 first iterations"
for want in "1 1" "2 2" "3 1"; do
  set -- $want
  lines "$work/fp16_first.log" "$1" | grep -q "number of skipped iterations: *$2 |" ||
    stop "fp16: the line of iteration $1 does not count $2 skipped iterations: $(lines "$work/fp16_first.log" "$1")"
done
echo "ok: --fp16's first lines count skipped iterations as Megatron's training_log"

# The checkpoint holds both scalers under Megatron's chained-optimizer keys.
for key in optimizer.0.grad_scaler.scale optimizer.1.grad_scaler.growth_tracker optimizer.1.grad_scaler.hysteresis_tracker; do
  grep -q "$key" "$work/fp16/iter_0000010/metadata.json" || stop "fp16 checkpoint: no $key"
done
echo "ok: the fp16 checkpoint holds optimizer.{0,1}.grad_scaler.*"

mpirun=$(command -v mpirun || true)
if [ -n "$mpirun" ]; then
  run2() { "$mpirun" --allow-run-as-root --oversubscribe -np 2 "$bin" train "$@"; }
  bf16=(--bf16 --use-distributed-optimizer)
  run2 "${moe[@]}" "${bf16[@]}" >"$work/bf16_full.log" 2>&1 || { tail "$work/bf16_full.log"; stop "bf16 DP2 run"; }
  run2 "${moe[@]}" "${bf16[@]}" --save "$work/bf16" --save-interval 10 --exit-interval 10 >"$work/bf16_a.log" 2>&1
  run2 "${moe[@]}" "${bf16[@]}" --load "$work/bf16" >"$work/bf16_b.log" 2>&1
  same_from "bf16 DP2 distributed optimizer resume" "$work/bf16_full.log" "$work/bf16_b.log" 11 20
  echo "ok: --bf16 --use-distributed-optimizer DP2 resumed at 10 prints iterations 11-20 as the uninterrupted run"
else
  echo "skip: bf16 DP2 resume (no mpirun)"
fi

# A smaller global batch on resume. The checkpoint (batch 8, 10 iterations: 80 samples; warmup 4 x 8 = 32 and decay
# 20 x 8 = 160 samples, linear from 2e-3 to 0). Megatron's get_lr at num_steps samples:
#   warmup: lr * n / W;  decay: min + (max - min) (1 - (n - W) / (D - W)).
lr_at() {  # SAMPLES WARMUP DECAY
  awk -v n="$1" -v w="$2" -v d="$3" 'BEGIN { m = 2e-3; if (n <= w) v = m * n / w; else if (n > d) v = 0;
    else v = m * (1 - (n - w) / (d - w)); printf "%.6E\n", v }'
}
logged_lr() { lines "$1" "$2" | grep -oE 'learning rate: [0-9.E+-]+' | grep -oE '[0-9.]+E[+-][0-9]+'; }
"$bin" train "${moe[@]}" --save "$work/gbs" --save-interval 10 --exit-interval 10 >"$work/gbs_a.log" 2>&1 ||
  { tail -3 "$work/gbs_a.log"; stop "batch-8 run"; }
"$bin" train "${moe[@]}" --global-batch-size 4 --load "$work/gbs" --use-checkpoint-opt_param-scheduler \
  >"$work/gbs_b.log" 2>&1 || { tail "$work/gbs_b.log"; stop "resume with a smaller batch"; }
for i in 11 15 20; do
  want=$(lr_at $((80 + 4 * (i - 10))) 32 160)
  [ "$(logged_lr "$work/gbs_b.log" "$i")" = "$want" ] ||
    stop "smaller batch, checkpoint schedule: iteration $i logs lr $(logged_lr "$work/gbs_b.log" "$i"), Megatron's $want"
done
echo "ok: a resume with global batch 4 (--use-checkpoint-opt_param-scheduler) follows Megatron's lr over the samples"
# --override-opt_param-scheduler: the flags' lengths at batch 4 (warmup 16, decay 80 samples) from the 80 consumed
# samples: past the decay, min-lr.
"$bin" train "${moe[@]}" --global-batch-size 4 --train-iters 40 --load "$work/gbs" --override-opt_param-scheduler \
  >"$work/gbs_c.log" 2>&1 || { tail "$work/gbs_c.log"; stop "resume with --override-opt_param-scheduler"; }
for i in 11 30; do
  want=$(lr_at $((80 + 4 * (i - 10))) 16 160)
  [ "$(logged_lr "$work/gbs_c.log" "$i")" = "$want" ] ||
    stop "smaller batch, flags' schedule: iteration $i logs lr $(logged_lr "$work/gbs_c.log" "$i"), Megatron's $want"
done
echo "ok: --override-opt_param-scheduler takes the flags' lengths and the consumed samples"
expect_error "lr_warmup_steps 16 but the checkpoint has 32 (pass --override-opt_param-scheduler" \
  "$bin" train "${moe[@]}" --global-batch-size 4 --load "$work/gbs"

# --no-load-optim: the iteration goes on, the schedule starts again at step 0 (warmup from 0).
"$bin" train "${moe[@]}" --load "$work/gbs" --no-load-optim --exit-interval 11 >"$work/nlo.log" 2>&1 ||
  { tail -3 "$work/nlo.log"; stop "--no-load-optim run"; }
[ "$(logged_lr "$work/nlo.log" 11)" = "$(lr_at 8 32 160)" ] ||
  stop "--no-load-optim: iteration 11 logs lr $(logged_lr "$work/nlo.log" 11), a restarted schedule gives $(lr_at 8 32 160)"
echo "ok: --no-load-optim keeps the iteration and restarts the schedule"

# --finetune keeps the checkpoint's FLOPs so far (Megatron's load_checkpoint reads them in any case).
"$bin" train "${moe[@]}" --load "$work/gbs" --finetune --exit-interval 1 --save "$work/ft" --save-interval 1 \
  >"$work/ft.log" 2>&1 || { tail -3 "$work/ft.log"; stop "--finetune run"; }
flops() { /usr/bin/python3 - "$1" <<'PY'
import json, struct, sys
meta = json.load(open(sys.argv[1] + "/metadata.json"))
t = meta["tensors"]["num_floating_point_operations_so_far"]
piece = t["pieces"][0]
path = sys.argv[1] + "/" + piece["file"]
raw = open(path, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
begin, end = header[piece["name"]]["data_offsets"]
print(struct.unpack("<d", raw[8 + n + begin:8 + n + end])[0])
PY
}
before=$(flops "$work/gbs/iter_0000010")
after=$(flops "$work/ft/iter_0000001")
/usr/bin/python3 -c "import sys; sys.exit(0 if $after > $before > 0 else 1)" ||
  stop "--finetune: FLOPs so far $before -> $after (the saved count was dropped)"
echo "ok: --finetune keeps the saved FLOPs ($before -> $after)"

# A release checkpoint: the tracker says `release`, the weights are in DIR/release, training starts at iteration 0.
mkdir -p "$work/rel"
cp -r "$work/gbs/iter_0000010" "$work/rel/release"
echo release >"$work/rel/latest_checkpointed_iteration.txt"
"$bin" train "${moe[@]}" --load "$work/rel" --exit-interval 2 >"$work/rel.log" 2>&1 || { tail "$work/rel.log"; stop "release"; }
grep -q "successfully loaded checkpoint from $work/rel .* at iteration 0" "$work/rel.log" || { cat "$work/rel.log"; stop "release: not loaded at iteration 0"; }
grep -qE "iteration +1/ +20" "$work/rel.log" || stop "release: training did not start at iteration 1"
echo "ok: a release tracker loads DIR/release at iteration 0"

# Non-persistent checkpoints: persistent at 4 and 6 (the end), non-persistent at 1, 2, 3, 5 and 6. Before each
# non-persistent save every older one but the newest goes, so 5 and 6 remain.
"$bin" train "${moe[@]}" --train-iters 6 --save "$work/np" --save-interval 4 --non-persistent-save-interval 1 \
  --non-persistent-ckpt-type global >"$work/np.log" 2>&1 || { tail -3 "$work/np.log"; stop "non-persistent run"; }
[ "$(ls "$work/np/non_persistent" | grep -c '^iter_')" = 2 ] && [ -d "$work/np/non_persistent/iter_0000005" ] &&
  [ -d "$work/np/non_persistent/iter_0000006" ] ||
  stop "non-persistent cleanup kept $(ls "$work/np/non_persistent" | tr '\n' ' '), Megatron's keeps iterations 5 and 6"
# Without --non-persistent-ckpt-type only the persistent tracker counts.
rm -rf "$work/np/iter_0000006" "$work/np/non_persistent/iter_0000006"
echo 4 >"$work/np/latest_checkpointed_iteration.txt"
echo 5 >"$work/np/non_persistent/latest_checkpointed_iteration.txt"
"$bin" train "${moe[@]}" --train-iters 6 --load "$work/np" >"$work/np_a.log" 2>&1 || { tail -3 "$work/np_a.log"; stop "np load"; }
grep -q "successfully loaded checkpoint from $work/np .* at iteration 4" "$work/np_a.log" || stop "non-persistent: loaded without the type"
# --ckpt-step 4 with a newer non-persistent checkpoint (5): the non-persistent one wins.
"$bin" train "${moe[@]}" --train-iters 6 --load "$work/np" --ckpt-step 4 --non-persistent-ckpt-type global \
  >"$work/np_b.log" 2>&1 || { tail -3 "$work/np_b.log"; stop "np --ckpt-step load"; }
grep -q "at iteration 5" "$work/np_b.log" || { cat "$work/np_b.log"; stop "non-persistent: --ckpt-step 4 won over iteration 5"; }
# --non-persistent-global-ckpt-dir: saved there and loaded from there.
"$bin" train "${moe[@]}" --exit-interval 3 --save "$work/np2" --save-interval 10 --non-persistent-save-interval 1 \
  --non-persistent-ckpt-type global --non-persistent-global-ckpt-dir "$work/np2_fast" >"$work/np2.log" 2>&1 ||
  { tail -3 "$work/np2.log"; stop "--non-persistent-global-ckpt-dir run"; }
[ -f "$work/np2_fast/latest_checkpointed_iteration.txt" ] && [ ! -e "$work/np2/non_persistent" ] ||
  stop "--non-persistent-global-ckpt-dir: not saved there"
echo "ok: non-persistent checkpoints (type, --ckpt-step, global dir, cleanup)"

# --exit-signal SIGUSR1: the handler catches that signal.
"$bin" train "${moe[@]}" --train-iters 200 --save "$work/usr1" --save-interval 1000 --exit-signal-handler \
  --exit-signal SIGUSR1 >"$work/usr1.log" 2>&1 &
pid=$!
for _ in $(seq 1200); do grep -qE "iteration +2/" "$work/usr1.log" 2>/dev/null && break; sleep 0.05; done
kill -USR1 $pid
wait $pid || stop "--exit-signal SIGUSR1: exit status $?"
grep -q "exiting program after receiving SIGUSR1" "$work/usr1.log" || stop "--exit-signal SIGUSR1: no exit line"
[ -f "$work/usr1/latest_checkpointed_iteration.txt" ] || stop "--exit-signal SIGUSR1: no save"
echo "ok: --exit-signal SIGUSR1 saves and exits"
expect_error "--exit-signal requires --exit-signal-handler" \
  "$bin" train "${moe[@]}" --exit-signal SIGUSR1
expect_error "invalid value 'SIGKILL' for --exit-signal" \
  "$bin" train "${moe[@]}" --exit-signal-handler --exit-signal SIGKILL
echo "$failures failed"
[ "$failures" -eq 0 ]
