#!/usr/bin/env bash
# Long sequences under context parallelism: a tiny MoE model (2 layers, hidden 128, 4 heads, 8 experts top-2, ffn
# 256, vocab 1024, RoPE, no dropout, mock data, micro-batch 1) at the given sequence lengths under CP 1, 2 and 4
# (ring attention, OMP_NUM_THREADS=1 per process). Per run: the step time of iteration 2, the activation peak per
# rank (the log's memory line, max over ranks).
# usage: bench/run_long_context.sh BUILD [SEQ...]   (default 4096 16384 32768)
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
shift
seqs=("${@:-4096 16384 32768}")
read -r -a seqs <<<"${seqs[*]}"
mpirun=$(command -v mpirun)
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1 /proc/loadavg)"
printf "%-7s %-3s %12s %22s\n" seq CP "step (ms)" "activation peak (MB)"
for s in "${seqs[@]}"; do
  for cp in 1 2 4; do
    log=$(mktemp)
    OMP_NUM_THREADS=1 "$mpirun" --allow-run-as-root --oversubscribe -np "$cp" "$build/moecore" train \
      --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length "$s" --max-position-embeddings "$s" \
      --micro-batch-size 1 --global-batch-size 1 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 \
      --ffn-hidden-size 256 --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear \
      --attention-dropout 0 --hidden-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 \
      --train-iters 2 --lr 1e-4 --lr-warmup-iters 1 --log-interval 1 --eval-iters 0 --threads 1 \
      --context-parallel-size "$cp" --cp-comm-type p2p >"$log" 2>&1 || { tail -3 "$log"; exit 1; }
    step=$(sed -n 's/.*iteration *2\/.*elapsed time per iteration (ms): \([0-9.]*\).*/\1/p' "$log")
    peak=$(grep -m1 "memory (MB" "$log" | sed -n 's/.*activations: [0-9.]* (peak \([0-9.]*\)).*/\1/p')
    printf "%-7s %-3s %12s %22s\n" "$s" "$cp" "$step" "$peak"
    rm -f "$log"
  done
done
