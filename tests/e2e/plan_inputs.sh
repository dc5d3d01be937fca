#!/usr/bin/env bash
# `moecore plan` on inputs at the edges: a HuggingFace model folder and config.json files with bad fields (one line
# naming the file and the field), and sizes near 2^31 (a search over 2^20 GPUs with a global batch of 2^31 sequences
# answers, under a generous time bound, instead of walking every micro-batch).
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
configs="$src/tests/unit/data/hf_configs"
run=(--seq-length 4096 --micro-batch-size 1 --global-batch-size 64 --num-gpus 8 --gpu H100)

# A model folder: its config.json.
mkdir -p "$work/mixtral" "$work/empty" "$work/negative"
cp "$configs/mixtral_8x7b.json" "$work/mixtral/config.json"
if "$bin" plan --hf-config "$work/mixtral" "${run[@]}" --expert-model-parallel-size 8 >"$work/folder.out" 2>&1 &&
  grep -q "model: 46.70 B parameters" "$work/folder.out"; then
  echo "ok: a model folder reads its config.json"
else
  fail "plan --hf-config FOLDER: $(head -c 300 "$work/folder.out")"
fi
expect_error "error: $work/empty: a folder without config.json" "$bin" plan --hf-config "$work/empty" "${run[@]}"
# Megatron-FSDP is planned, and what train refuses with it plan refuses with train's line.
if "$bin" plan --hf-config "$work/mixtral" "${run[@]}" --bf16 --use-megatron-fsdp >"$work/fsdp.out" 2>&1; then
  echo "ok: --use-megatron-fsdp is planned"
else
  fail "plan --use-megatron-fsdp: $(head -c 300 "$work/fsdp.out")"
fi
expect_error "error: --use-megatron-fsdp with --fp8-param-gather / --fp4-param-gather" \
  "$bin" plan --hf-config "$work/mixtral" "${run[@]}" --bf16 --fp8-format e4m3 --fp8-param-gather --use-megatron-fsdp

# Bad fields: the file and the field, never the train flag the field becomes.
python3 - "$configs/mixtral_8x7b.json" "$work/negative/config.json" <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))
config["num_hidden_layers"] = -3
json.dump(config, open(sys.argv[2], "w"))
EOF
expect_error "error: $work/negative/config.json: field 'num_hidden_layers' must be a positive integer (got -3)" \
  "$bin" plan --hf-config "$work/negative" "${run[@]}"
printf '{"model_type": "mixtral",' >"$work/broken.json"
expect_error "error: $work/broken.json: not valid JSON (parse error at line 1, column" \
  "$bin" plan --hf-config "$work/broken.json" "${run[@]}"
if grep -q "json.exception" "$work/expect.stderr"; then fail "library text in: $(cat "$work/expect.stderr")"; fi

# 2^20 GPUs, 2^31 sequences per step: 2^31 / DP micro-batches per rank, each rank's schedule in closed form.
big=(--seq-length 4096 --bf16 --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 2147483648
     --gpu H100)
if timeout 300 "$bin" plan --hf-config "$configs/deepseek_v3.json" "${big[@]}" --num-gpus 1048576 --search --top 3 \
  >"$work/search.out" 2>"$work/search.err" && grep -q "fastest that fits" "$work/search.out"; then
  echo "ok: --search on 2^20 GPUs with a global batch of 2^31"
else
  fail "plan --search on 2^20 GPUs, GBS 2^31: $(head -c 300 "$work/search.err")"
fi
# One interleaved layout at DP 1: 2^31 micro-batches per rank in groups of 3 (2^31 mod 3 = 2, a valid last group
# for PP 2; 2^31 - 1 would leave 1).
if timeout 300 "$bin" plan --hf-config "$configs/mixtral_8x7b.json" "${big[@]}" --num-gpus 2 \
  --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 \
  --microbatch-group-size-per-virtual-pipeline-stage 3 >"$work/vpp.out" 2>"$work/vpp.err" &&
  grep -q "2147483648 micro-batches" "$work/vpp.out"; then
  echo "ok: one interleaved layout with 2^31 micro-batches per rank"
else
  fail "plan PP2 VPP2 N3, GBS 2^31: $(head -c 300 "$work/vpp.err") $(grep micro-batches "$work/vpp.out")"
fi

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
