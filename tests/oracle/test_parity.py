"""Model-level parity: the C++ GPT model (moecore_parity) against the PyTorch twin (twin.py), both in float32, on the
same random weights and batch. Compared: logits [S, B, V], loss, every parameter's gradient after the first backward,
every parameter after each of 3 AdamW steps (lr 1e-3, weight decay 0.1, clip-grad 1.0, betas 0.9/0.999, eps 1e-6),
the loss of every step and the pre-clip gradient norms.

Why eps 1e-6 and not torch's 1e-8: Adam's first update is lr * g / (|g| + eps), whose sensitivity to rounding in g is
lr / eps near g = 0. Among ~10^5 gradient elements some are ~1e-8 by chance, and float32 rounding (~1e-9 here) then
moves the update by ~1e-4 of the parameter scale even between two correct float32 implementations (measured: up to
8e-4 between the twin in float32 and float64 with eps 1e-8; 2e-5 with eps 1e-6). eps 1e-6 keeps the step comparison
about the optimizer, not about rounding luck, and still exercises eps (it is ~1e-3 of a typical |g|).

Error metric, per tensor:  rel = max_i |cpp_i - twin_i| / max(max_i |twin_i|, 1e-30)
(the worst absolute difference relative to the tensor's largest magnitude; a tensor of exact zeros in the twin must be
exact zeros in C++ too). Tolerance: rel < 1e-4.

Structurally zero gradients: a key bias that RoPE does not rotate (every key channel without RoPE, channels past
rotary_dim with rotary_percent < 1; for qk_layernorm, k_layernorm.bias instead) adds q.b to every score of a row, which
softmax ignores, so its gradient is exactly zero mathematically and pure rounding noise (~1e-9) in practice. AdamW's
first steps turn noise into updates of about lr * noise / (|noise| + eps), so those elements' values after a step
depend on rounding, not on the model. They are left out of the step{k} comparisons (their gradients are still
compared, inside their tensors, and must be tiny: checked against the float64 twin).

Usage: /usr/bin/python3 test_parity.py --parity PATH/TO/moecore_parity [--only NAME] [--keep DIR]
Exits non-zero, with one line per failing tensor, when any comparison fails.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
import twin  # noqa: E402

TOLERANCE = 1e-4
STEPS = 3
LR, WEIGHT_DECAY, CLIP_GRAD, ADAM_EPS = 1e-3, 0.1, 1.0, 1e-6

BASE = {
    "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 4,
    "kv_channels": 16, "seq_length": 16, "max_position_embeddings": 16, "vocab_size": 384,
    "attention_dropout": 0.0, "hidden_dropout": 0.0,
}
GQA = {"num_query_groups": 2}
LLAMA = {"normalization": "RMSNorm", "norm_epsilon": 1e-6, "activation": "swiglu", "position_embedding_type": "rope",
         "add_bias_linear": False}

CONFIGS = {
    "layernorm_gelu_learned_abs_bias_tied": {
        "normalization": "LayerNorm", "activation": "gelu", "position_embedding_type": "learned_absolute",
        "add_bias_linear": True, "max_position_embeddings": 24},
    "rmsnorm_swiglu_rope_gqa_nobias_untied": {**LLAMA, **GQA, "untie_embeddings_and_output_weights": True},
    "qk_layernorm_rmsnorm_rope_gqa": {**LLAMA, **GQA, "qk_layernorm": True},
    "qk_layernorm_layernorm_bias": {"normalization": "LayerNorm", "activation": "gelu", "position_embedding_type": "rope",
                                    "qk_layernorm": True, "add_bias_linear": True},
    "squared_relu_bias_gqa": {**GQA, "activation": "squared_relu", "add_bias_linear": True,
                              "position_embedding_type": "rope", "rotary_base": 500.0},
    "rotary_percent_half_swiglu_bias": {**LLAMA, "rotary_percent": 0.5, "add_bias_linear": True},
    "loss_mask_zeros_no_position": {"position_embedding_type": "none", "activation": "swiglu", "mask": "zeros"},
    # The batch file's optional packed-sequence fields at their defaults (positions 0..S-1, one document per sample).
    "default_packed_ids_learned_abs": {"position_embedding_type": "learned_absolute", "ids": "default"},
    # Packed sequences (--reset-attention-mask, --reset-position-ids): documents of random lengths per sample, rotary
    # positions restarting in each, against the twin's dense block-diagonal causal mask.
    "packed_documents_rope_gqa": {**LLAMA, **GQA, "ids": "packed"},
}


def make_batch(cfg, seed, mask_kind, batch_size=3):
    rng = np.random.default_rng(seed)
    B, S, V = batch_size, cfg["seq_length"], cfg["vocab_size"]
    batch = {
        "tokens": rng.integers(0, V, size=(B, S), dtype=np.int32),
        "labels": rng.integers(0, V, size=(B, S), dtype=np.int32),
    }
    if mask_kind == "zeros":
        mask = (rng.random((B, S)) < 0.6).astype(np.float32)  # ~40% of the tokens masked out
        mask[0, :5] = 0.0
        mask[2, -1] = 1.0
    else:
        mask = np.ones((B, S), dtype=np.float32)
    batch["loss_mask"] = mask
    return batch


def rel_error(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def structurally_zero_grad(cfg):
    """{param name: flat indices} of elements whose gradient is zero mathematically (see the module docstring)."""
    c = twin.full_config(cfg)
    N, G, d = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
    rot_dim = int(d * c["rotary_percent"]) if c["position_embedding_type"] == "rope" else 0
    free = np.arange(rot_dim, d)  # key channels RoPE leaves alone
    if free.size == 0 or not c["add_bias_linear"] and not (c["qk_layernorm"] and c["normalization"] == "LayerNorm"):
        return {}
    out = {}
    for i in range(c["num_layers"]):
        p = f"decoder.layers.{i}.self_attention."
        if c["qk_layernorm"]:
            if c["normalization"] == "LayerNorm":
                out[p + "k_layernorm.bias"] = free
        else:
            per_group = N // G
            out[p + "linear_qkv.bias"] = np.concatenate(
                [g * (per_group + 2) * d + per_group * d + free for g in range(G)])
    return out


def compare(cpp, ref, label, failures, worst, skip=None):
    """Compares every tensor the twin produced; records per-group worst errors. `skip` maps parameter names to flat
    indices left out of the step{k}.<name> comparisons."""
    skip = skip or {}
    for name, expected in ref.items():
        if name not in cpp:
            failures.append(f"{label}: C++ output lacks '{name}'")
            continue
        actual = cpp[name]
        param = name.split(".", 1)[1] if name.startswith("step") else None
        if param in skip and np.shape(actual) == np.shape(expected):
            keep = np.ones(np.size(expected), dtype=bool)
            keep[skip[param]] = False
            actual, expected = np.ravel(actual)[keep], np.ravel(expected)[keep]
        err = rel_error(actual, expected)
        group = name.split(".")[0] if "." in name else name
        worst[group] = max(worst.get(group, 0.0), err)
        if not err < TOLERANCE:
            failures.append(f"{label}: {name}: rel error {err:.3e} >= {TOLERANCE:g} "
                            f"(shape {np.shape(expected)}, max|twin| {np.max(np.abs(expected)):.3e})")
    extra = [n for n in cpp if n not in ref]
    if extra:
        failures.append(f"{label}: C++ output has tensors the twin lacks: {extra[:5]}")


def run_harness(parity_exe, label, cfg, weights, batch, workdir, steps=STEPS, microbatches=1):
    """Runs moecore_parity on (cfg, weights, batch) with the protocol's optimizer settings (`steps` steps of
    `microbatches` micro-batches each). Returns (outputs, None) or (None, a one-line failure)."""
    paths = {k: os.path.join(workdir, f"{label}.{k}") for k in ("config.json", "weights.safetensors",
                                                                "batch.safetensors", "out.safetensors")}
    with open(paths["config.json"], "w") as f:
        json.dump(cfg, f)
    st.save(paths["weights.safetensors"], weights)
    st.save(paths["batch.safetensors"], batch)
    command = [parity_exe, "--config", paths["config.json"], "--weights", paths["weights.safetensors"],
               "--batch", paths["batch.safetensors"], "--out", paths["out.safetensors"], "--steps", str(steps),
               "--lr", str(LR), "--weight-decay", str(WEIGHT_DECAY), "--clip-grad", str(CLIP_GRAD),
               "--eps", str(ADAM_EPS), "--microbatches", str(microbatches)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return None, f"{label}: moecore_parity failed (exit {result.returncode}): {result.stderr.strip()}"
    cpp, _ = st.load(paths["out.safetensors"])
    return cpp, None


def run_config(parity_exe, label, overrides, workdir, seed):
    overrides = dict(overrides)
    mask_kind = overrides.pop("mask", "ones")
    ids = overrides.pop("ids", None)
    cfg = {**BASE, **overrides}
    weights = twin.random_params(cfg, seed)
    batch = make_batch(cfg, seed + 1, mask_kind)
    if ids == "default":
        B, S = batch["tokens"].shape
        batch["position_ids"] = np.tile(np.arange(S, dtype=np.int64), (B, 1))
        batch["document_ids"] = np.zeros((B, S), dtype=np.int32)
    elif ids == "packed":
        B, S = batch["tokens"].shape
        rng = np.random.default_rng(seed + 2)
        documents = np.zeros((B, S), dtype=np.int32)
        positions = np.zeros((B, S), dtype=np.int64)
        for b in range(B):  # 1-3 cuts per sample, at least one token per document
            cuts = np.sort(rng.choice(np.arange(1, S), size=rng.integers(1, 4), replace=False))
            documents[b] = np.searchsorted(cuts, np.arange(S), side="right")
            starts = np.concatenate([[0], cuts])
            positions[b] = np.arange(S) - starts[documents[b]]
        batch["position_ids"] = positions
        batch["document_ids"] = documents
    cpp, error = run_harness(parity_exe, label, cfg, weights, batch, workdir)
    if error:
        return [error], {}
    ref = twin.run_megatron(cfg, weights, batch, STEPS, LR, WEIGHT_DECAY, CLIP_GRAD, eps=ADAM_EPS,
                            dtype=torch.float32)
    failures, worst = [], {}
    skip = structurally_zero_grad(cfg)
    if skip:  # confirm the premise on the float64 twin: these gradients vanish
        ref64 = twin.run_megatron(cfg, weights, batch, 1, LR, WEIGHT_DECAY, CLIP_GRAD, eps=ADAM_EPS,
                                  dtype=torch.float64)
        for name, indices in skip.items():
            grad = ref64["grad." + name].ravel()[indices]
            scale = max(np.max(np.abs(ref64["grad." + n])) for n in skip)
            if not np.max(np.abs(grad)) < 1e-10 * max(scale, 1e-30) + 1e-15:
                failures.append(f"{label}: twin float64 grad of {name} at unrotated key channels is not ~0 "
                                f"({np.max(np.abs(grad)):.3e})")
    compare(cpp, ref, label, failures, worst, skip)
    return failures, worst


def run_matrix(configs, run_one, seed_base, keep, summary_prefix=""):
    """Runs run_one(label, overrides, workdir, seed) over `configs`, prints one line per config, then every failure;
    exits 1 when any comparison failed."""
    all_failures = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = keep or tmp
        os.makedirs(workdir, exist_ok=True)
        for index, (label, overrides) in enumerate(configs.items()):
            failures, worst = run_one(label, overrides, workdir, seed_base + 17 * index)
            status = "FAIL" if failures else "ok"
            summary = " ".join(f"{k}={v:.1e}" for k, v in sorted(worst.items()))
            print(f"[{status}] {label}: {summary_prefix}{summary}", flush=True)
            all_failures += failures
    for line in all_failures[:200]:
        print("  " + line)
    if all_failures:
        print(f"{len(all_failures)} comparison(s) failed")
        sys.exit(1)


def matrix_main(configs, run_config, seed_base, passed_text, twin_only_text=None, summary_prefix=""):
    """The command line of a parity matrix: --parity PATH (or, when twin_only_text is given, --twin-only: the twin
    side and premise checks only, run_config then gets None as the executable), --only NAME, --keep DIR; runs
    run_config(parity, label, overrides, workdir, seed) over the configs."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--parity", required=twin_only_text is None, help="path to the moecore_parity executable")
    if twin_only_text is not None:
        parser.add_argument("--twin-only", action="store_true", help="run only the twin and the premise checks")
    parser.add_argument("--only", help="run only this config")
    parser.add_argument("--keep", help="write the files here and keep them")
    args = parser.parse_args()
    twin_only = getattr(args, "twin_only", False)
    if not args.parity and not twin_only:
        sys.exit("give --parity PATH or --twin-only")
    torch.set_num_threads(1)
    selected = {k: v for k, v in configs.items() if args.only in (None, k)}
    if not selected:
        sys.exit(f"unknown config {args.only}; known: {', '.join(configs)}")
    parity = None if twin_only else args.parity
    run_matrix(selected, lambda label, overrides, workdir, seed: run_config(parity, label, overrides, workdir, seed),
               seed_base=seed_base, keep=args.keep, summary_prefix=summary_prefix)
    print(passed_text if parity else twin_only_text)


def main():
    matrix_main(CONFIGS, run_config, seed_base=1000, passed_text="all parity comparisons passed",
                summary_prefix="max rel error per group: ")


if __name__ == "__main__":
    main()
