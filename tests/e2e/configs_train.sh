#!/usr/bin/env bash
# Every config in configs/ that trains on mock data trains a few steps with a falling loss (the others: the demo, which
# needs its corpus, and the tests' model-only recipes, tiny-dense and tiny-moe, which name no data).
set -euo pipefail
bin=$1
src=$2
work=$3
rm -rf "$work" && mkdir -p "$work"
failures=0
for config in "$src"/configs/*.args; do
  name=$(basename "$config" .args)
  grep -qx -- '--mock-data' "$config" || continue
  args=()
  while read -r flag value; do
    args+=("$flag")
    if [ -n "$value" ]; then args+=("$value"); fi
  done < <(grep -v '^#' "$config" | grep -v '^\s*$')
  if ! "$bin" train "${args[@]}" --train-iters 30 --log-interval 10 --eval-interval 30 --eval-iters 2 \
      > "$work/$name.log" 2>&1; then
    echo "FAIL: $name did not train:"; tail -3 "$work/$name.log"; failures=$((failures + 1)); continue
  fi
  losses=$(grep -oE 'validation loss at iteration [0-9]+( on validation set)? \| lm loss value: [0-9.E+-]+' "$work/$name.log" |
           grep -oE '[0-9.]+E[+-][0-9]+')
  first=$(head -1 <<<"$losses")
  last=$(tail -1 <<<"$losses")
  if /usr/bin/python3 -c "import sys; sys.exit(0 if float('$last') < float('$first') - 0.5 else 1)"; then
    echo "ok: $name validation loss $first -> $last"
  else
    echo "FAIL: $name validation loss did not fall: $first -> $last"; failures=$((failures + 1))
  fi
done
echo "$failures failed"
[ $failures -eq 0 ]
