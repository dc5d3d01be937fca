# Sourced by the demo-step benchmarks (run_demo_step.sh, run_precision_step.sh): sets `args` to the demo model of
# configs/demo.args on mock data for 16 iterations, logged at 8 and 16 (the step time is iteration 16's interval).
args=()
while read -r flag value; do
  case "$flag" in --train-iters | --log-interval | --eval-interval | --eval-iters | --split) continue ;; esac
  args+=("$flag")
  if [ -n "$value" ]; then args+=("$value"); fi
done < <(grep -v '^#' configs/demo.args | grep -v '^\s*$')
args+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --train-iters 16 --log-interval 8 --lr-warmup-iters 2 --eval-iters 1 --threads 2)
