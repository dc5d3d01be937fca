#!/usr/bin/env bash
# Bad command lines end with exit code != 0 and one clear line naming the problem; never a crash.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
model=("${quick_dense[@]}")
base=("${model[@]}" --mock-data)


expect_error "unknown command 'trian'" "$bin" trian
expect_error "unknown flag --num-layer (did you mean --num-layers?)" "$bin" train "${base[@]}" --num-layer 3
expect_error "--moe-permute-fusion is a Megatron flag that moecore does not implement yet" "$bin" train "${base[@]}" --num-experts 4 --moe-permute-fusion
expect_error "--moe-latent-size requires --num-experts (a positive number of experts)" "$bin" train "${base[@]}" --moe-latent-size 8
expect_error "--distributed-timeout-minutes must be positive (got 0)" "$bin" train "${base[@]}" \
  --distributed-timeout-minutes 0
expect_error "invalid value 'soon' for --distributed-timeout-minutes: expected a finite number" "$bin" train \
  "${base[@]}" --distributed-timeout-minutes soon
expect_error "--moe-router-topk requires --num-experts" "$bin" train "${base[@]}" --moe-router-topk 2
expect_error "--moe-router-topk" "$bin" train "${base[@]}" --num-experts 4 --moe-router-topk 5
expect_error "--num-query-groups" "$bin" train "${base[@]}" --group-query-attention --num-query-groups 3
expect_error "--hidden-size" "$bin" train "${base[@]}" --hidden-size 66
expect_error "--global-batch-size" "$bin" train "${base[@]}" --global-batch-size 5
expect_error "--num-layers" "$bin" train "${base[@]}" --num-layers abc
expect_error "world size 1 is not divisible by tensor-model-parallel-size (2)" "$bin" train "${base[@]}" --tensor-model-parallel-size 2
expect_error "world size 1 is not divisible by tensor-model-parallel-size (1) x pipeline-model-parallel-size (2)" \
  "$bin" train "${base[@]}" --pipeline-model-parallel-size 2
expect_error "Number of layers should be divisible by the pipeline-model-parallel size" "$bin" train "${base[@]}" \
  --pipeline-model-parallel-size 4
expect_error "Number of decoder layers 3 must match --num-layers 2" "$bin" layout --world-size 2 \
  --pipeline-model-parallel-size 2 --num-layers 2 --pipeline-model-parallel-layout "Et|ttL"
expect_error "the flex dispatcher (mpiep) requires TPxEP > 1" "$bin" train "${base[@]}" --num-experts 4 \
  --moe-token-dispatcher-type flex
expect_error "overlap_moe_expert_parallel_comm is only supported with expert model parallelism" "$bin" train \
  "${base[@]}" --num-experts 4 --moe-token-dispatcher-type alltoall --bf16 --overlap-moe-expert-parallel-comm
# The precision-aware optimizer: Megatron's dtype choices and its distributed-optimizer requirement.
expect_error "--exp-avg-dtype can only be fp32 when not using precision-aware optimizer" "$bin" train "${base[@]}" \
  --use-distributed-optimizer --exp-avg-dtype bf16
expect_error "--use-precision-aware-optimizer only supported with distributed optimizer" "$bin" train "${base[@]}" \
  --use-precision-aware-optimizer --exp-avg-dtype bf16
expect_error "invalid value 'fp8' for --main-params-dtype (choose from fp32, fp16)" "$bin" train "${base[@]}" \
  --use-distributed-optimizer --use-precision-aware-optimizer --bf16 --main-params-dtype fp8
# Under mpirun the same errors come once (from rank 0) and every rank exits non-zero.
if command -v mpirun >/dev/null; then
  mpi=(env OMP_NUM_THREADS=1 mpirun -q --allow-run-as-root --oversubscribe -np 2 "$bin" train "${base[@]}")
  expect_error "world size 2 is not divisible by tensor-model-parallel-size (4)" "${mpi[@]}" --tensor-model-parallel-size 4
  expect_error "--num-attention-heads (4) and --num-query-groups (1) must be divisible" "${mpi[@]}" \
    --group-query-attention --num-query-groups 1 --tensor-model-parallel-size 2
  expect_error "--num-experts (3) must be divisible by --expert-model-parallel-size (2)" "${mpi[@]}" \
    --num-experts 3 --expert-model-parallel-size 2
  expect_error "--overlap-param-gather requires --use-distributed-optimizer" "${mpi[@]}" --overlap-param-gather
  # Context parallelism: the sequence must split into 2 x CP chunks; a2a splits heads; only Megatron's types.
  expect_error "--seq-length (30) must be divisible by 2 x --context-parallel-size (2)" "${mpi[@]}" \
    --context-parallel-size 2 --seq-length 30 --max-position-embeddings 30
  expect_error "--cp-comm-type a2a needs --num-attention-heads (4) and --num-query-groups (1)" "${mpi[@]}" \
    --context-parallel-size 2 --cp-comm-type a2a --group-query-attention --num-query-groups 1
  expect_error "invalid value 'ring' for --cp-comm-type" "${mpi[@]}" --context-parallel-size 2 --cp-comm-type ring
  # Bad pipeline layouts, on both ranks of a PP 2 launch: one line, non-zero exit.
  expect_error "Number of layers should be divisible by the pipeline-model-parallel size" "${mpi[@]}" \
    --num-layers 3 --pipeline-model-parallel-size 2
  expect_error "Number of decoder layers 3 must match --num-layers 2" "${mpi[@]}" --pipeline-model-parallel-size 2 \
    --pipeline-model-parallel-layout "Et|ttL"
  expect_error "--pipeline-model-parallel-layout" "${mpi[@]}" --pipeline-model-parallel-size 2 \
    --pipeline-model-parallel-layout "Et|t(L"
  expect_error "should range in [PP=2 , M=1]" "${mpi[@]}" --num-layers 4 --pipeline-model-parallel-size 2 \
    --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 2
fi
expect_error "unknown flag --promt" "$bin" generate --load "$work" --promt hi

# Every command parses through one flag parser (util/flag_parser.h): the same problem, the same words.
for command in train preprocess generate layout checkpoint quantize plan; do
  expect_error "unknown flag --zzzzzzzz" "$bin" $command --zzzzzzzz
done
expect_error "--swiglu takes no value (got '--swiglu=1')" "$bin" train "${base[@]}" --swiglu=1
expect_error "--append-eod takes no value (got '--append-eod=1')" "$bin" preprocess --append-eod=1
expect_error "--no-kv-cache takes no value (got '--no-kv-cache=1')" "$bin" generate --no-kv-cache=1
expect_error "--use-tp-pp-dp-mapping takes no value (got '--use-tp-pp-dp-mapping=1')" "$bin" layout \
  --use-tp-pp-dp-mapping=1
expect_error "--json takes no value (got '--json=1')" "$bin" plan --json=1
expect_error "--world-size expects a value (N)" "$bin" layout --world-size
expect_error "--input expects a value (IN.safetensors)" "$bin" quantize --input
expect_error "--top-k expects a value (K)" "$bin" generate --top-k --seed 1
expect_error "invalid value 'x' for --top: expected an integer" "$bin" plan --top x
expect_error "invalid value 'x' for --workers: expected an integer" "$bin" preprocess --workers x

# Corrupt data: an index with a bad magic, and a .bin cut short.
printf 'NOTANIDX\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0' > "$work/bad.idx"
: > "$work/bad.bin"
expect_error "bad.idx" "$bin" train "${model[@]}" --data-path "$work/bad"
expect_error "corpus.jsonl" "$bin" preprocess --input "$work/corpus.jsonl" --output-prefix "$work/x" \
  --tokenizer-type NullTokenizer --vocab-size 100 --workers 1

echo "$failures failed"
[ $failures -eq 0 ]
