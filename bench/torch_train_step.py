"""PyTorch peer of bench_train_step: the same llama-style model (the oracle twin's Megatron forward, eager
mode, autograd) and the same step (forward, backward, clip, AdamW) on random tokens; prints one JSON line.
Run with /usr/bin/python3 (Debian's torch)."""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "oracle"))
import twin  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 4), ("hidden", 192), ("heads", 4), ("groups", 2), ("ffn", 512), ("seq", 256),
                          ("batch", 8), ("vocab", 50304), ("steps", 5), ("warmup", 1), ("threads", 2)]:
        p.add_argument("--" + name, type=int, default=default)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = twin.full_config({
        "num_layers": a.layers, "hidden_size": a.hidden, "ffn_hidden_size": a.ffn, "num_attention_heads": a.heads,
        "num_query_groups": a.groups, "kv_channels": a.hidden // a.heads, "seq_length": a.seq,
        "max_position_embeddings": a.seq, "vocab_size": a.vocab, "normalization": "RMSNorm", "activation": "swiglu",
        "add_bias_linear": False, "position_embedding_type": "rope"})
    params = {n: torch.tensor(v, requires_grad=True) for n, v in twin.random_params(cfg, 0).items()}
    rng = np.random.default_rng(7)
    tokens = torch.tensor(rng.integers(0, a.vocab - 1, (a.batch, a.seq)), dtype=torch.long)
    labels = torch.tensor(rng.integers(0, a.vocab - 1, (a.batch, a.seq)), dtype=torch.long)
    mask = torch.ones(tokens.shape)
    decay = [v for v in params.values() if v.dim() >= 2]
    no_decay = [v for v in params.values() if v.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4)
    times = []
    for step in range(a.warmup + a.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        _, loss = twin.megatron_forward(params, cfg, tokens, labels, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    n_params = sum(v.numel() for v in params.values())
    print(json.dumps({"impl": f"pytorch {torch.__version__}", "threads": torch.get_num_threads(), "params": n_params,
                      "tokens_per_step": a.batch * a.seq, "step_ms": round(median * 1e3, 1),
                      "tokens_per_s": round(a.batch * a.seq / median, 1), "loss": round(loss.item(), 4)}))


if __name__ == "__main__":
    main()
