#!/usr/bin/env bash
# `make fuzz`: the long fuzz run. Every harness of tests/fuzz, built by the sanitize preset (gcc, ASan + UBSan), runs
# FUZZ_RUNS mutated inputs (default 200000) from seed FUZZ_SEED (default 2; the CTest runs use seed 1) after
# replaying its corpus and regression inputs. A crash, sanitizer report, hang (> 20 s) or leak stops the run; the
# input is saved as BUILD/fuzz-artifacts/fuzz_NAME-crash (or -hang). Copy it into tests/fuzz/regressions/NAME/.
set -euo pipefail
BUILD=${1:-build-sanitize}
RUNS=${FUZZ_RUNS:-200000}
SEED=${FUZZ_SEED:-2}
HARNESSES=${FUZZ_HARNESSES:-"flags indexed_dataset preprocess safetensors hf_config npy sharded_checkpoint run_report"}
cd "$(dirname "$0")/.."
mkdir -p "$BUILD/fuzz-artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-check_initialization_order=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
for name in $HARNESSES; do
  dict=()
  [[ -f tests/fuzz/dict/$name.dict ]] && dict=(--dict "tests/fuzz/dict/$name.dict")
  case $name in preprocess | safetensors | hf_config | sharded_checkpoint | run_report) dict+=(--dict tests/fuzz/dict/json.dict) ;; esac
  "$BUILD/tests/fuzz/fuzz_$name" --runs "$RUNS" --seed "$SEED" --max-len 4096 --timeout 20 "${dict[@]}" \
    --artifacts "$BUILD/fuzz-artifacts" "tests/fuzz/corpus/$name" "tests/fuzz/regressions/$name"
done
