# Sourced by the MoE step benchmarks (run_moe_step.sh, run_step_ab.sh): the two models as `moecore train` flags,
# given run_flags (the flags that only steer the run) beforehand.
#   e16:   4 layers, hidden 512, 8 heads (no GQA), seq 512, batch 4, 16 experts (ffn 512) top-2, vocab 32000,
#          RMSNorm, SwiGLU, RoPE, no biases, dropout 0, alltoall dispatcher, grouped GEMM;
#   demo:  configs/demo.args as it trains (mock data, vocab 50256; micro-batch 4, global batch 8).
e16=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512
  --micro-batch-size 4 --global-batch-size 4 --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 512
  --vocab-size 32000 --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0 --moe-token-dispatcher-type alltoall --moe-grouped-gemm
  --clip-grad 1.0 --lr 1e-4 --log-throughput "${run_flags[@]}")
demo=()
while read -r flag value; do
  case "$flag" in --train-iters | --log-interval | --eval-interval | --eval-iters | --split | --lr-warmup-iters) continue ;; esac
  demo+=("$flag")
  if [ -n "$value" ]; then demo+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
demo+=(--vocab-size 50256 "${run_flags[@]}")
