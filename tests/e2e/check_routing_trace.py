#!/usr/bin/env python3
"""Checks a --moe-routing-trace-path folder against Megatron's format and the run's text log (standard library only).

    check_routing_trace.py TRACE_DIR LOG --ranks R --steps S --layers L --experts E --topk K --hidden H
                           --tokens-per-step T [--sidecars]

Read as Megatron's router_trace.py writes them (json.dumps of its dicts, load_*_for_record for the sidecars):
  - the folder holds exactly router_trace_rank<r>.jsonl for r < R (and with --sidecars hidden_states_rank<r>.bin and
    logits_rank<r>.bin), nothing else;
  - every line is the json.dumps text of its record, with Megatron's keys in Megatron's order; stage "pre_dispatch",
    block "decoder", rank the file's, topk K, layer < L; steps 0..S-1, in file order;
  - top_indices: num_tokens rows of K experts each, in [0, E), ascending and distinct (the routing map's nonzeros);
  - per step and layer the tokens summed over ranks and micro-batch records are T, and the experts chosen summed the
    same way equal the log's "[MoE] layer L tokens per expert" of that iteration (Megatron's step = iteration - 1; the
    first log line does not reset the interval, so the line of the iteration after it sums both);
  - sidecars: offsets contiguous from 0 in file order, bytes = num_tokens x width x 2, shapes [num_tokens, H] and
    [num_tokens, E], file sizes the sums; the hidden states finite; from the bf16 logits, each token's chosen experts'
    logits >= every other expert's (softmax top-k without expert bias; bf16 rounding is monotonic), strictly for most;
  - the log's "> routing trace: N records of rank 0 in DIR" names rank 0's record count.
"""
import argparse
import array
import json
import math
import os
import re
import sys

KEYS_HEAD = ["step", "stage", "block", "layer", "rank", "num_tokens", "topk"]
HS_KEYS = ["hs_offset", "hs_bytes", "hs_shape"]
LOGIT_KEYS = ["logit_offset", "logit_bytes", "logit_shape"]


class Failure(Exception):
    pass


def require(condition, message):
    if not condition:
        raise Failure(message)


def bf16_words(path, offset, nbytes):
    """The bf16 values of bytes [offset, offset + nbytes) of `path` as floats (the 16 bits shifted up)."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(nbytes)
    require(len(data) == nbytes, f"{path}: {len(data)} bytes at offset {offset}, the record names {nbytes}")
    words = array.array("H")
    words.frombytes(data)
    if sys.byteorder != "little":
        words.byteswap()
    wide = array.array("I", (w << 16 for w in words))
    return array.array("f", wide.tobytes())


def logged_counts(log_text):
    """{iteration: {layer: [counts]}} of the log's lines, in log order."""
    out = {}
    iteration = None
    for line in log_text.splitlines():
        m = re.search(r"iteration +(\d+)/ *\d+ \|", line)
        if m:
            iteration = int(m.group(1))
            out[iteration] = {}
            continue
        m = re.match(r" \[MoE\] layer (\d+) tokens per expert: \[([0-9 ]*)\]", line)
        if m:
            require(iteration is not None, f"an [MoE] line before any iteration line: {line}")
            out[iteration][int(m.group(1))] = [int(v) for v in m.group(2).split()]
    return out


def check(args):
    names = sorted(os.listdir(args.trace_dir))
    expected_names = sorted(
        [f"router_trace_rank{r}.jsonl" for r in range(args.ranks)]
        + ([f"hidden_states_rank{r}.bin" for r in range(args.ranks)] if args.sidecars else [])
        + ([f"logits_rank{r}.bin" for r in range(args.ranks)] if args.sidecars else []))
    require(names == expected_names, f"trace folder holds {names}, expected {expected_names}")

    L, E, K, H = args.layers, args.experts, args.topk, args.hidden
    counts = {}  # (step, layer) -> [E] experts chosen, over ranks and records
    tokens = {}  # (step, layer) -> tokens over ranks and records
    records_per_rank = []
    strict_tokens = total_tokens = 0
    for rank in range(args.ranks):
        path = os.path.join(args.trace_dir, f"router_trace_rank{rank}.jsonl")
        hs_path = os.path.join(args.trace_dir, f"hidden_states_rank{rank}.bin")
        logits_path = os.path.join(args.trace_dir, f"logits_rank{rank}.bin")
        with open(path) as f:
            text = f.read()
        require(text.endswith("\n") or text == "", f"{path}: the last line is not whole")
        lines = text.splitlines()
        records_per_rank.append(len(lines))
        hs_next = logit_next = 0
        previous_step = 0
        for n, line in enumerate(lines, 1):
            where = f"{path}:{n}"
            try:
                record = json.loads(line, object_pairs_hook=lambda pairs: pairs)
            except json.JSONDecodeError as error:
                raise Failure(f"{where}: not JSON: {error}")
            keys = [k for k, _ in record]
            record = dict(record)
            require(len(keys) == len(record), f"{where}: repeated keys {keys}")
            want = list(KEYS_HEAD)
            if record.get("block") == "mtp":
                want.append("mtp_idx")
            if args.sidecars:
                want += HS_KEYS + LOGIT_KEYS
            want.append("top_indices")
            require(keys == want, f"{where}: keys {keys}, Megatron's order is {want}")
            require(line == json.dumps(record), f"{where}: not the json.dumps text of its record")
            step, layer, T = record["step"], record["layer"], record["num_tokens"]
            require(record["stage"] == "pre_dispatch", f"{where}: stage {record['stage']!r}")
            require(record["block"] == "decoder", f"{where}: block {record['block']!r} (the demo has no MTP)")
            require(record["rank"] == rank, f"{where}: rank {record['rank']} in rank {rank}'s file")
            require(record["topk"] == K, f"{where}: topk {record['topk']}, expected {K}")
            require(isinstance(step, int) and 0 <= step < args.steps, f"{where}: step {step} not in 0..{args.steps - 1}")
            require(step >= previous_step, f"{where}: step {step} after step {previous_step}")
            previous_step = step
            require(isinstance(layer, int) and 0 <= layer < L, f"{where}: layer {layer} not in 0..{L - 1}")
            top = record["top_indices"]
            require(isinstance(T, int) and T > 0 and len(top) == T, f"{where}: {len(top)} rows for num_tokens {T}")
            per_expert = counts.setdefault((step, layer), [0] * E)
            tokens[(step, layer)] = tokens.get((step, layer), 0) + T
            for t, row in enumerate(top):
                require(len(row) == K, f"{where}: token {t} has {len(row)} experts, topk {K}")
                require(all(isinstance(e, int) and 0 <= e < E for e in row), f"{where}: token {t}: experts {row}")
                require(all(a < b for a, b in zip(row, row[1:])), f"{where}: token {t}: {row} not ascending/distinct")
                for e in row:
                    per_expert[e] += 1
            if not args.sidecars:
                continue
            require(record["hs_offset"] == hs_next, f"{where}: hs_offset {record['hs_offset']}, expected {hs_next}")
            require(record["hs_shape"] == [T, H], f"{where}: hs_shape {record['hs_shape']}, expected {[T, H]}")
            require(record["hs_bytes"] == T * H * 2, f"{where}: hs_bytes {record['hs_bytes']} for [{T}, {H}] bf16")
            hs_next += record["hs_bytes"]
            require(record["logit_offset"] == logit_next,
                    f"{where}: logit_offset {record['logit_offset']}, expected {logit_next}")
            require(record["logit_shape"] == [T, E], f"{where}: logit_shape {record['logit_shape']}, expected {[T, E]}")
            require(record["logit_bytes"] == T * E * 2,
                    f"{where}: logit_bytes {record['logit_bytes']} for [{T}, {E}] bf16")
            logit_next += record["logit_bytes"]
            hidden = bf16_words(hs_path, record["hs_offset"], record["hs_bytes"])
            require(all(math.isfinite(v) for v in hidden), f"{where}: non-finite hidden states")
            require(max(hidden) > min(hidden), f"{where}: constant hidden states")
            logits = bf16_words(logits_path, record["logit_offset"], record["logit_bytes"])
            for t, row in enumerate(top):
                values = logits[t * E:(t + 1) * E]
                chosen = min(values[e] for e in row)
                others = max(values[e] for e in range(E) if e not in row)
                require(chosen >= others,
                        f"{where}: token {t}: chosen experts {row} have logit {chosen} < {others} of another expert "
                        f"(logits {list(values)})")
                strict_tokens += chosen > others
                total_tokens += 1
        if args.sidecars:
            for p, size in ((hs_path, hs_next), (logits_path, logit_next)):
                require(os.path.getsize(p) == size, f"{p}: {os.path.getsize(p)} bytes, the records name {size}")
    if args.sidecars:
        # Ties in bf16 are possible but rare: all-equal logits would pass the test above without meaning anything.
        require(strict_tokens >= 0.9 * total_tokens,
                f"only {strict_tokens} of {total_tokens} tokens have chosen logits above the others")

    traced_steps = sorted({s for s, _ in counts})
    require(traced_steps == list(range(args.steps)), f"steps {traced_steps}, expected 0..{args.steps - 1}")
    for step in range(args.steps):
        for layer in range(L):
            require(tokens.get((step, layer)) == args.tokens_per_step,
                    f"step {step} layer {layer}: {tokens.get((step, layer))} tokens over the ranks' records, "
                    f"expected {args.tokens_per_step}")

    with open(args.log) as f:
        log_text = f.read()
    logged = logged_counts(log_text)
    require(logged, f"{args.log}: no iteration lines")
    # The steps each line covers: from the last line that reset the interval (the first line does not).
    covered_steps = set()
    compared = 0
    start = None
    for index, (iteration, layers) in enumerate(logged.items()):
        if start is None:
            start = iteration - 1  # the run's first iteration (resumed runs start later)
        steps = list(range(start, iteration))
        if index > 0:
            start = iteration
        if not all(s in traced_steps for s in steps):
            continue  # past --moe-routing-trace-max-training-iters
        require(sorted(layers) == list(range(L)), f"iteration {iteration}: [MoE] lines for layers {sorted(layers)}")
        for layer in range(L):
            want = layers[layer]
            got = [sum(counts[(s, layer)][e] for s in steps) for e in range(E)]
            require(got == want, f"iteration {iteration} layer {layer}: the trace's steps {steps} give {got}, "
                                 f"the log {want}")
        covered_steps.update(steps)
        compared += 1
    require(covered_steps == set(traced_steps), f"the log's lines cover steps {sorted(covered_steps)} only")

    m = re.search(r"^> routing trace: (\d+) records of rank 0 in (.*)$", log_text, re.M)
    require(m is not None, f"{args.log}: no '> routing trace: N records of rank 0 in DIR' line")
    require(int(m.group(1)) == records_per_rank[0],
            f"the log names {m.group(1)} records of rank 0, its file holds {records_per_rank[0]}")
    require(os.path.realpath(m.group(2)) == os.path.realpath(args.trace_dir),
            f"the log names the folder {m.group(2)}, not {args.trace_dir}")
    print(f"ok: {sum(records_per_rank)} records of {args.ranks} rank(s), steps 0..{args.steps - 1}, "
          f"{compared} log line(s) of tokens per expert equal"
          + (f", {total_tokens} tokens' logits agree with their experts ({strict_tokens} strictly)"
             if args.sidecars else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir")
    parser.add_argument("log")
    for name in ("ranks", "steps", "layers", "experts", "topk", "hidden", "tokens-per-step"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--sidecars", action="store_true")
    args = parser.parse_args()
    try:
        check(args)
    except (Failure, OSError, KeyError, TypeError) as error:
        sys.exit(f"routing trace check failed: {error}")


if __name__ == "__main__":
    main()
