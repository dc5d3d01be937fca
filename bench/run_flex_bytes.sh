#!/usr/bin/env bash
# Inter-host bytes of the flex dispatcher (mpiep: each token once per destination host) against the alltoall
# dispatcher (one row per (token, expert)), at top-2, top-4 and top-8: the demo model (8 experts) with routing forced
# uniform (--moe-router-force-load-balancing: random logits), EP4 over 4 processes split into 2 pretend hosts
# (MOECORE_PRETEND_HOSTS=2: experts 0-3 on host 0, 4-7 on host 1), 4 micro-batches of 256 tokens per rank. From the
# last log line's [comm] entry: the token-row megabytes each rank sent to the other host per iteration towards the
# experts (dispatch + combine's backward: 4 layers x 2 x 1024 tokens) and back (combine + dispatch's backward), the
# maximum over the ranks; with the expected values of uniform routing: towards the experts alltoall sends a token's
# remote experts, k/2 rows on average, flex one row when any of its k experts is remote, 1 - C(4,k)/C(8,k).
# usage: bench/run_flex_bytes.sh BUILD
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1
mpirun=$(command -v mpirun)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
# shellcheck source=bench/demo_args.sh
source bench/demo_args.sh
demo_args --train-iters --log-interval --eval-interval --eval-iters --split --micro-batch-size --global-batch-size --moe-router-topk \
  --moe-token-dispatcher-type
args+=(--train-iters 2 --log-interval 2 --eval-iters 0
  --lr-warmup-iters 1 --micro-batch-size 1 --global-batch-size 16 --expert-model-parallel-size 4 --threads 1
  --moe-router-force-load-balancing)
for k in 2 4 8; do
  for dispatcher in alltoall flex; do
    log="$work/$dispatcher-$k.log"
    OMP_NUM_THREADS=1 MOECORE_PRETEND_HOSTS=2 "$mpirun" --allow-run-as-root --oversubscribe -np 4 \
      -x OMP_NUM_THREADS -x MOECORE_PRETEND_HOSTS "$build/moecore" train "${args[@]}" --moe-router-topk "$k" \
      --moe-token-dispatcher-type "$dispatcher" >"$log" 2>&1 || { tail -5 "$log"; exit 1; }
    /usr/bin/python3 - "$log" "$k" "$dispatcher" <<'PY'
import math, re, sys
log, k, dispatcher = open(sys.argv[1]).read(), int(sys.argv[2]), sys.argv[3]
comm = [l for l in log.splitlines() if "[comm]" in l][-1]
m = re.search(r"inter-host MB to experts ([0-9.e+-]+) / back ([0-9.e+-]+)", comm)
rows = 4 * 2 * 1024  # layers x (dispatch, combine's backward) x tokens per rank and iteration
row_mb = 192 * 4 / 1e6
per_token = k / 2 if dispatcher == "alltoall" else 1 - (math.comb(4, k) / math.comb(8, k) if k <= 4 else 0)
print(f"top-{k} {dispatcher:8s}: to experts {float(m.group(1)):7.3f} MB (expected {rows * per_token * row_mb:7.3f}), "
      f"back {float(m.group(2)):7.3f} MB")
PY
  done
done
