#!/usr/bin/env bash
# Training-step throughput, moecore vs PyTorch (eager, same model and step), side by side in one run.
# usage: bench/run_train_step.sh [BUILD_DIR] [extra flags for both, e.g. --hidden 256 --threads 2]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
"$build/bench/bench_train_step" --threads 2 "$@"
/usr/bin/python3 bench/torch_train_step.py --threads 2 "$@"
