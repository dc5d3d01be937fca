"""PyTorch peer of moecore's training step: the oracle twin's Megatron forward (tests/oracle/twin.py, and twin_moe.py
for MoE layers; eager mode, autograd, no torch.compile) and the same step (forward and backward of each micro-batch,
global-norm clip, AdamW) on random tokens; prints one JSON line. Run with /usr/bin/python3 (Debian's torch).

Two ways to give the model:
  * the dense llama-style model of bench_train_step (--layers --hidden --heads --groups --ffn --seq --batch --vocab,
    vocab already padded), as bench/run_train_step.sh does;
  * --megatron FLAGS...: the `moecore train` / Megatron flags themselves (bench/run_moe_step.sh passes the very flags
    it gives moecore), so both sides build the model from one flag list. Flags that change the model or the step and
    are not understood here are an error; flags that only steer the run (iterations, logging, data) are ignored.
    The learning-rate schedule is not modelled (a constant rate costs the same per step); dropout must be 0.

--bf16 (or --bf16 among the --megatron flags, as `moecore train --bf16` takes it): PyTorch's mixed precision on CPU,
torch.autocast("cpu", dtype=torch.bfloat16) around the forward and the loss (the linear layers and matmuls run in
bf16, the ops autocast keeps in fp32 stay fp32); the weights, their gradients and AdamW stay fp32, and backward runs
outside autocast, as PyTorch's automatic mixed precision documentation prescribes. The JSON says whether autocast
was on during the forward and the dtype of the logits it produced (bf16 when the matmuls ran in bf16).
Without it the step is the twin's fp32 step, unchanged. The JSON also names the OpenBLAS core this process runs
(PyTorch's fp32 matmuls go to Debian's OpenBLAS, whose kernels depend on OPENBLAS_CORETYPE or its CPU detection).
"""
import ctypes
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "oracle"))
import twin  # noqa: E402

# Megatron flags that do not change the model or the cost of a step (with a value, or switches).
IGNORED_WITH_VALUE = {"--train-iters", "--log-interval", "--eval-interval", "--eval-iters", "--split", "--seed",
                      "--lr-warmup-iters", "--lr-decay-style", "--min-lr", "--lr-decay-iters", "--tokenizer-type",
                      "--moe-token-dispatcher-type", "--data-path", "--save", "--load", "--save-interval"}
IGNORED_SWITCHES = {"--mock-data", "--log-throughput", "--moe-grouped-gemm"}


def openblas_core():
    """The kernel family of the OpenBLAS this process loaded (openblas_get_corename), or "none" without one."""
    with open("/proc/self/maps") as maps:
        libs = sorted({line.split()[-1] for line in maps if "blas" in line.rsplit("/", 1)[-1]})
    for lib in libs:
        try:
            get = ctypes.CDLL(lib).openblas_get_corename
        except (OSError, AttributeError):
            continue
        get.restype = ctypes.c_char_p
        return get().decode()
    return "none"


def dense_setup(a):
    cfg = twin.full_config({
        "num_layers": a.layers, "hidden_size": a.hidden, "ffn_hidden_size": a.ffn, "num_attention_heads": a.heads,
        "num_query_groups": a.groups, "kv_channels": a.hidden // a.heads, "seq_length": a.seq,
        "max_position_embeddings": a.seq, "vocab_size": a.vocab, "normalization": "RMSNorm", "activation": "swiglu",
        "add_bias_linear": False, "position_embedding_type": "rope"})
    params = twin.random_params(cfg, 0)
    step = {"global_batch": a.batch, "micro_batch": a.batch, "vocab": a.vocab, "lr": 1e-4, "weight_decay": 0.01,
            "betas": (0.9, 0.999), "eps": 1e-8, "clip_grad": 1.0}
    return cfg, params, step, a.threads


def parse_megatron(flags):
    """Megatron flags -> (twin config, step settings, threads). Defaults are Megatron's."""
    p = argparse.ArgumentParser(prog="--megatron", add_help=False, allow_abbrev=False)
    for name in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size"):
        p.add_argument(name, type=int, required=True)
    for name, default in [("--ffn-hidden-size", None), ("--num-query-groups", 1), ("--kv-channels", None),
                          ("--max-position-embeddings", None), ("--make-vocab-size-divisible-by", 128),
                          ("--micro-batch-size", 1), ("--global-batch-size", None), ("--num-experts", 0),
                          ("--moe-ffn-hidden-size", None), ("--moe-router-topk", 2), ("--moe-layer-freq", 1),
                          ("--threads", 1)]:
        p.add_argument(name, type=int, default=default)
    for name, default in [("--init-method-std", 0.02), ("--attention-dropout", 0.1), ("--hidden-dropout", 0.1),
                          ("--lr", 1e-4), ("--weight-decay", 0.01), ("--adam-beta1", 0.9), ("--adam-beta2", 0.999),
                          ("--adam-eps", 1e-8), ("--clip-grad", 1.0), ("--moe-aux-loss-coeff", 0.0),
                          ("--norm-epsilon", 1e-5), ("--rotary-base", 10000.0)]:
        p.add_argument(name, type=float, default=default)
    p.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    p.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    p.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "none"],
                   default="aux_loss")
    for name in ("--swiglu", "--disable-bias-linear", "--group-query-attention",
                 "--untie-embeddings-and-output-weights", "--bf16"):
        p.add_argument(name, action="store_true")
    m, rest = p.parse_known_args(flags)
    unknown = []
    i = 0
    while i < len(rest):
        if rest[i] in IGNORED_WITH_VALUE:
            i += 2
            continue
        if rest[i] not in IGNORED_SWITCHES:
            unknown.append(rest[i])
        i += 1
    if unknown:
        sys.exit(f"torch_train_step.py --megatron: flags not modelled by the PyTorch twin: {' '.join(unknown)}")
    if m.attention_dropout != 0 or m.hidden_dropout != 0:
        sys.exit("torch_train_step.py --megatron: the twin has no dropout; give --attention-dropout 0 --hidden-dropout 0")
    H, L = m.hidden_size, m.num_layers
    ffn = m.ffn_hidden_size or (int(4 * H * 2 / 3 / 64) * 64 if m.swiglu else 4 * H)  # Megatron's defaults
    # NullTokenizer's vocabulary is --vocab-size plus its end-of-document token; then padding as Megatron.
    vocab = m.vocab_size + 1
    padded = -(-vocab // m.make_vocab_size_divisible_by) * m.make_vocab_size_divisible_by
    config = {
        "num_layers": L, "hidden_size": H, "ffn_hidden_size": ffn, "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_query_groups if m.group_query_attention else m.num_attention_heads,
        "kv_channels": m.kv_channels or H // m.num_attention_heads, "seq_length": m.seq_length,
        "max_position_embeddings": m.max_position_embeddings or m.seq_length, "vocab_size": padded,
        "normalization": m.normalization, "norm_epsilon": m.norm_epsilon,
        "activation": "swiglu" if m.swiglu else "gelu", "add_bias_linear": not m.disable_bias_linear,
        "position_embedding_type": m.position_embedding_type, "rotary_base": m.rotary_base,
        "init_method_std": m.init_method_std, "untie_embeddings_and_output_weights": m.untie_embeddings_and_output_weights}
    if m.num_experts > 0:
        pattern = [1 if layer % m.moe_layer_freq == 0 else 0 for layer in range(L)]
        coeff = m.moe_aux_loss_coeff if m.moe_router_load_balancing_type != "none" else 0.0
        config["moe"] = {"num_experts": m.num_experts, "ffn_hidden_size": m.moe_ffn_hidden_size or ffn,
                         "moe_layer_pattern": pattern, "topk": m.moe_router_topk,
                         "load_balancing_types": [m.moe_router_load_balancing_type], "aux_loss_coeffs": [coeff]}
    global_batch = m.global_batch_size or m.micro_batch_size
    if global_batch % m.micro_batch_size:
        sys.exit(f"torch_train_step.py --megatron: --global-batch-size {global_batch} is not a multiple of "
                 f"--micro-batch-size {m.micro_batch_size}")
    step = {"global_batch": global_batch, "micro_batch": m.micro_batch_size, "vocab": vocab, "lr": m.lr,
            "weight_decay": m.weight_decay, "betas": (m.adam_beta1, m.adam_beta2), "eps": m.adam_eps,
            "clip_grad": m.clip_grad, "bf16": m.bf16}
    return twin.full_config(config), step, m.threads


def megatron_flops(cfg, batch):
    """FLOPs of one training step by Megatron's num_floating_point_operations (megatron/training/training.py), as
    moecore logs them: 3 (forward, two backward GEMMs) x 2 (multiply-add) x the GEMMs' multiply-adds per token
    (qkv, causal QK^T and PV counted half, output projection, MLP or top-k experts (+ shared), logits)."""
    H, S, L, V = cfg["hidden_size"], cfg["seq_length"], cfg["num_layers"], cfg["vocab_size"]
    q = cfg["kv_channels"] * cfg["num_attention_heads"]
    kv = cfg["kv_channels"] * cfg["num_query_groups"]
    mlp_gemms = 3 if cfg["activation"] == "swiglu" else 2
    attention = H * (q + 2 * kv) + q * S / 2 * 2 + q * H
    moe_layers = sum(twin.is_moe_layer(cfg, layer) for layer in range(L))
    moe_width = cfg["moe"]["ffn_hidden_size"] * cfg["moe"]["topk"] + cfg["moe"]["shared_expert_intermediate_size"] \
        if moe_layers else 0
    mlp = H * mlp_gemms * (cfg["ffn_hidden_size"] * (L - moe_layers) + moe_width * moe_layers)
    return 3 * 2 * batch * S * (attention * L + mlp + H * V)


def megatron_init(cfg, seed):
    """Megatron's initialisation: weights and embeddings N(0, std), the layers' output projections (linear_proj,
    fc2) N(0, std / sqrt(2 L)), norm weights 1, biases 0."""
    gen = torch.Generator().manual_seed(seed)
    std, layers = cfg["init_method_std"], cfg["num_layers"]
    params = {}
    for name, shape, kind in twin.param_specs(cfg):
        if kind in ("weight", "embedding"):
            scaled = name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight")
            params[name] = torch.randn(shape, generator=gen) * (std / math.sqrt(2 * layers) if scaled else std)
        elif kind == "norm_weight":
            params[name] = torch.ones(shape)
        else:
            params[name] = torch.zeros(shape)
    return params


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 4), ("hidden", 192), ("heads", 4), ("groups", 2), ("ffn", 512), ("seq", 256),
                          ("batch", 8), ("vocab", 50304), ("steps", 5), ("warmup", 1), ("threads", 2)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast around forward + loss (module docstring)")
    p.add_argument("--megatron", nargs=argparse.REMAINDER, help="Megatron flags (the rest of the command line)")
    a = p.parse_args()
    if a.megatron is not None:
        cfg, step, threads = parse_megatron(a.megatron)
        params = megatron_init(cfg, 0)
    else:
        cfg, params, step, threads = dense_setup(a)
    bf16 = a.bf16 or step.get("bf16", False)
    torch.set_num_threads(threads)
    params = {n: torch.as_tensor(v).clone().requires_grad_(True) for n, v in params.items()}
    B, M, S = step["global_batch"], step["global_batch"] // step["micro_batch"], cfg["seq_length"]
    rng = np.random.default_rng(7)
    tokens = torch.tensor(rng.integers(0, step["vocab"] - 1, (B, S)), dtype=torch.long)
    labels = torch.tensor(rng.integers(0, step["vocab"] - 1, (B, S)), dtype=torch.long)
    mask = torch.ones(tokens.shape)
    decay = [v for v in params.values() if v.dim() >= 2]
    no_decay = [v for v in params.values() if v.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": step["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=step["lr"], betas=step["betas"],
                            eps=step["eps"])
    moe_state = twin.new_moe_state(cfg) if cfg["moe"] is not None else None
    rows = step["micro_batch"]
    times, losses = [], []
    autocast_seen, logits_dtype = None, None
    for it in range(a.warmup + a.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss_sum = 0.0
        for mb in range(M):  # gradient accumulation: lm loss / M, aux-loss gradients scaled 1 / M (Megatron)
            part = slice(mb * rows, (mb + 1) * rows)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits, loss = twin.megatron_forward(params, cfg, tokens[part], labels[part], mask[part],
                                                     moe_state=moe_state, aux_grad_scale=1.0 / M)
                if autocast_seen is None:
                    autocast_seen, logits_dtype = torch.is_autocast_cpu_enabled(), str(logits.dtype)
            del logits
            (loss / M).backward()
            loss_sum += loss.item() / M
        if moe_state is not None:
            twin.finish_global_batch(cfg, moe_state)
        torch.nn.utils.clip_grad_norm_(list(params.values()), step["clip_grad"])
        opt.step()
        losses.append(loss_sum)
        if it >= a.warmup:
            times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    n_params = sum(v.numel() for v in params.values())
    print(json.dumps({"impl": f"pytorch {torch.__version__}", "threads": torch.get_num_threads(), "params": n_params,
                      "precision": "bf16 autocast" if bf16 else "fp32", "autocast": autocast_seen,
                      "logits_dtype": logits_dtype, "openblas_core": openblas_core(),
                      "tokens_per_step": B * S,
                      "flops_per_step": megatron_flops(cfg, B), "step_ms": round(median * 1e3, 1),
                      "steps_ms": [round(t * 1e3, 1) for t in times], "tokens_per_s": round(B * S / median, 1),
                      "loss": round(losses[-1], 4), "first_loss": round(losses[0], 4)}))


if __name__ == "__main__":
    main()
