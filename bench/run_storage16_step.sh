#!/usr/bin/env bash
# Training-step time of the demo model (configs/demo.args on mock data, as bench/run_demo_step.sh) under --bf16 with
# activations in fp32 tensors holding 16-bit values (the storage before ops/staging.h) and in bf16 tensors, side by
# side in one process (tests/parallel/storage16_main.cpp trains both ways and checks they agree bit for bit); ROUNDS
# rounds. Prints iteration 16's ms per iteration, the run's CPU seconds (less sensitive to other load on the machine)
# and the activation peak of each.
# usage: bench/run_storage16_step.sh BUILD [ROUNDS] [PRECISION-FLAG]
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
rounds=${2:-2}
precision=${3:---bf16}
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
source bench/demo_step_args.sh
for ((r = 0; r < rounds; ++r)); do
  "$build/tests/parallel/dist_storage16_test" -- "${args[@]}" "$precision" |
    sed -n -e 's/^\(.*storage\):.*elapsed time per iteration (ms): \([0-9.]*\).*/\1: \2 ms\/iteration/p' \
      -e 's/^\(.*storage\):.*activations: [0-9.]* (peak \([0-9.]*\)).*/\1: activation peak \2 MiB/p' \
      -e 's/^\(.*storage\): cpu seconds \([0-9.]*\)/\1: \2 cpu seconds (the whole run, all threads)/p' \
      -e 's/^\([0-9]* iterations.*\)/\1/p'
done
