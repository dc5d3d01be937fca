#!/usr/bin/env bash
# --profile: a tiny MoE GPT under TP2 x EP2 on 4 processes writes one Chrome / Perfetto trace per rank; each is valid
# JSON in the Trace Event Format: metadata and complete events with name, ph, ts, dur, pid = the rank, tid; the
# events of one track nest (what Perfetto's importer requires of "X" events); the step's phases, the MoE layer's
# parts and the collectives are there, only for the profiled iterations. With --moe-shared-expert-overlap the shared
# experts' forward lies between the two halves of the dispatch all-to-all (started, then waited for) on the timeline.
# Non-blocking collectives are events on "comm in flight" tracks from start to completion: with
# --overlap-grad-reduce and small buckets, gradient buckets are in flight while earlier layers' backward computes.
set -euo pipefail
bin=$1
mpirun=$2
work=$3
rm -rf "$work" && mkdir -p "$work"
export OMP_NUM_THREADS=1
"$mpirun" --allow-run-as-root --oversubscribe -np 4 "$bin" train --num-layers 2 --hidden-size 32 \
  --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 \
  --train-iters 5 --lr 1e-3 --lr-warmup-iters 1 --log-interval 1 --eval-iters 0 --mock-data \
  --tokenizer-type NullTokenizer --vocab-size 200 --num-experts 4 --moe-router-topk 2 --disable-bias-linear \
  --moe-token-dispatcher-type alltoall --moe-shared-expert-intermediate-size 16 --moe-shared-expert-overlap \
  --tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce --ddp-bucket-size 2000 \
  --expert-model-parallel-size 2 --profile --profile-step-start 2 --profile-step-end 4 --profile-ranks 0 1 2 3 \
  --profile-dir "$work/traces" >"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
grep -q "wrote the trace of iterations 3-4 to $work/traces/trace_rank0.json" "$work/log"
/usr/bin/python3 - "$work/traces" <<'PY'
import json, sys, pathlib
for rank in range(4):
    path = pathlib.Path(sys.argv[1]) / f"trace_rank{rank}.json"
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e["ph"] == "M" and e["name"] == "process_name" and e["args"]["name"] == f"rank {rank}" for e in events)
    complete = [e for e in events if e["ph"] == "X"]
    for e in events:
        assert e["ph"] in ("X", "M") and e["pid"] == rank and isinstance(e["tid"], int), e
    for e in complete:
        assert isinstance(e["name"], str) and e["cat"] and isinstance(e["ts"], int) and e["dur"] >= 0, e
    names = {e["name"] for e in complete}
    for want in ["forward (micro-batch 0)", "backward (micro-batch 0)", "layer 0 forward", "layer 1 backward",
                 "attention forward", "router forward", "dispatch", "experts forward", "combine", "experts backward",
                 "embedding forward", "output layer + loss backward", "finish grad sync", "optimizer step",
                 "all-to-all", "tensor-parallel", "grad-reduce"]:
        assert want in names, (rank, want, sorted(names))
    dispatches = [e for e in complete if e["name"] == "dispatch"]
    shared = [e for e in complete if e["name"] == "shared experts forward"]
    a2a = [e for e in complete if e["name"] == "all-to-all"]
    assert shared and len(shared) == len(dispatches), (rank, len(shared), len(dispatches))
    for s in shared:
        outer = [d for d in dispatches if d["ts"] <= s["ts"] and s["ts"] + s["dur"] <= d["ts"] + d["dur"]]
        assert len(outer) == 1, (rank, "shared experts forward outside a dispatch", s)
        d = outer[0]
        inside = [a for a in a2a if d["ts"] <= a["ts"] and a["ts"] + a["dur"] <= d["ts"] + d["dur"]]
        assert any(a["ts"] + a["dur"] <= s["ts"] for a in inside), (rank, "no all-to-all started before", s)
        assert any(a["ts"] >= s["ts"] + s["dur"] for a in inside), (rank, "no all-to-all waited for after", s)
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    in_flight = [e for e in complete if tracks.get(e["tid"], "").startswith("comm in flight")]
    assert any(e["name"] == "all-to-all under the shared experts" for e in in_flight), (rank, "no overlapped a2a")
    buckets = [e for e in in_flight if "grad reduce, bucket" in e["name"]]
    backwards = [e for e in complete if e["name"].startswith("backward (micro-batch")]
    layer0 = [e for e in complete if e["name"] == "layer 0 backward"]
    overlapped = [b for b in buckets for B in backwards if B["ts"] <= b["ts"] < B["ts"] + B["dur"]
                  and any(b["ts"] <= l["ts"] < B["ts"] + B["dur"] for l in layer0)]
    assert overlapped, (rank, "no gradient bucket in flight during layer 0's backward", buckets)
    steps = [e for e in complete if e["name"] == "optimizer step"]
    assert len(steps) == 2, (rank, len(steps))  # iterations 3 and 4 only
    by_track = {}
    for e in complete:
        by_track.setdefault(e["tid"], []).append((e["ts"], -e["dur"], e["ts"] + e["dur"], e["name"]))
    for track in by_track.values():  # events on one track nest: a stack of open intervals
        stack = []
        for begin, _, end, name in sorted(track):
            while stack and stack[-1][0] <= begin:
                stack.pop()
            assert not stack or end <= stack[-1][0], (name, begin, end, stack[-1])
            stack.append((end, name))
print("trace structure ok:", sum(1 for _ in pathlib.Path(sys.argv[1]).iterdir()), "files")
PY
