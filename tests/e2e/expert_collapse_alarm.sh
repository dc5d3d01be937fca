#!/usr/bin/env bash
# The expert-collapse alarm (train/expert_collapse.h) on real runs of the demo recipe (mock data): with 64 experts the
# routing of layers 1-3 collapses onto a few experts within a few iterations, and every warning must be the one an
# independent reading of the log's [MoE] lines gives (an expert under 0.1 of its layer's mean tokens for 3
# consecutive log intervals, the first line's interval not counted, named once, since the first iteration of the
# first of them); a balanced run (the recipe's 8 experts routed on random logits, --moe-router-force-load-balancing)
# raises none.
set -u
source "$(dirname "$0")/lib/setup.sh" "$@"
demo_without_split demo
demo+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --lr-warmup-iters 2 --eval-iters 0
  --log-interval 2 --train-iters 10)

# check LOG: the warnings of LOG against the rule applied to its [MoE] lines; prints how many there were.
check() {
  /usr/bin/python3 - "$1" <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
intervals = []  # (first iteration, last iteration, {layer: counts}, [warnings])
previous = 0
for line in lines:
    m = re.search(r"iteration +(\d+)/", line)
    if m:
        it = int(m.group(1))
        intervals.append([previous + 1 if intervals else 1, it, {}, []])
        if len(intervals) > 1:
            previous = it
        continue
    m = re.match(r" \[MoE\] layer (\d+) tokens per expert: \[([0-9 ]+)\]", line)
    if m:
        intervals[-1][2][int(m.group(1))] = [int(x) for x in m.group(2).split()]
    if line.startswith("WARNING: [MoE]"):
        intervals[-1][3].append(line)
expected, streak, warned = [], {}, set()
for first, last, layers, warnings in intervals[1:]:  # the first line does not end an interval
    for layer, counts in sorted(layers.items()):
        mean = sum(counts) / len(counts)
        named = []
        for e, c in enumerate(counts):
            key = (layer, e)
            if mean > 0 and c / mean < 0.1:
                n, since = streak.get(key, (0, first))
                streak[key] = (n + 1, since)
                if n + 1 >= 3 and key not in warned:
                    warned.add(key)
                    named.append((e, c / mean, since))
            else:
                streak.pop(key, None)
                warned.discard(key)
        if named:
            expected.append((last, layer, named))
got = [(last, w) for first, last, layers, warnings in intervals for w in warnings]
if len(got) != len(expected):
    sys.exit(f"{len(got)} warnings, the [MoE] lines give {len(expected)}: {got[:2]} / {expected[:2]}")
for (last, warning), (want_last, layer, named) in zip(got, expected):
    head = f"WARNING: [MoE] layer {layer}: expert"
    if last != want_last or not warning.startswith(head):
        sys.exit(f"at iteration {last}: '{warning[:80]}', expected layer {layer} at iteration {want_last}")
    listed = [(int(e), float(r)) for e, r in re.findall(r"(\d+) \(load ratio ([0-9.]+)\)", warning)]
    more = re.search(r"and (\d+) more", warning)
    if [e for e, _ in listed] != [e for e, _, _ in named[:16]] or (int(more.group(1)) if more else 0) != max(0, len(named) - 16):
        sys.exit(f"layer {layer} at iteration {last}: named {listed}, expected {[e for e, _, _ in named]}")
    if any(abs(r - round(want, 3)) > 1e-9 for (_, r), (_, want, _) in zip(listed, named)):
        sys.exit(f"layer {layer} at iteration {last}: ratios {listed} differ from the [MoE] line's")
    since = min(s for _, _, s in named)
    if f"since iteration {since} " not in warning:
        sys.exit(f"layer {layer} at iteration {last}: expected 'since iteration {since}' in '{warning}'")
print(len(got))
PY
}

if timeout 300 "$bin" train "${demo[@]}" --num-experts 64 >"$work/collapse.log" 2>&1; then
  if n=$(check "$work/collapse.log"); then
    if [ "$n" -gt 0 ]; then echo "ok: 64 experts: $n warnings, each as the [MoE] lines give"; else
      fail "64 experts: no warning, though the routing collapses: $(grep 'load ratio' "$work/collapse.log" | tail -2)"
    fi
  else
    fail "64 experts: $n"
  fi
else
  fail "64 experts: moecore train failed: $(tail -3 "$work/collapse.log")"
fi

if timeout 300 "$bin" train "${demo[@]}" --moe-router-force-load-balancing >"$work/balanced.log" 2>&1; then
  if grep -q "WARNING: \[MoE\]" "$work/balanced.log"; then
    fail "8 experts, balanced: $(grep 'WARNING: \[MoE\]' "$work/balanced.log" | head -1)"
  else
    echo "ok: 8 experts, balanced: no warning ($(grep -o 'min/max load ratio: [0-9.]* / [0-9.]*' "$work/balanced.log" | tail -1))"
  fi
else
  fail "8 experts: moecore train failed: $(tail -3 "$work/balanced.log")"
fi

[ $failures -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "e2e ok"
