# Sourced first by the end-to-end scripts, with the script's arguments (BINARY SOURCE_DIR WORK_DIR, as
# tests/e2e/CMakeLists.txt passes them): sets $bin, $src and $work (emptied), one OpenMP thread per process,
# failures=0, the checks of expect.sh and `recipe` (tests/recipe.sh, the named model recipes of configs/).
bin=$1
src=$2
work=$3
rm -rf "$work" && mkdir -p "$work"
export OMP_NUM_THREADS=1
failures=0
source "$src/tests/e2e/lib/expect.sh"
source "$src/tests/recipe.sh"
# The tiny-dense recipe with two iterations of a small batch on the NullTokenizer's ids; no data flag (add --mock-data
# or --data-path).
mapfile -t quick_dense < <(recipe "$src" tiny-dense)
quick_dense+=(--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --tokenizer-type NullTokenizer
  --vocab-size 128 --eval-iters 1)
# demo_without_split ARRAY: the demo recipe's flags without its data split (mock data brings its own) into ARRAY.
demo_without_split() {
  local -n flags=$1
  flags=()
  local flag
  while read -r flag; do
    if [ "$flag" = --split ]; then read -r _; continue; fi
    flags+=("$flag")
  done < <(recipe "$src" demo)
}
