"""Multi-Token Prediction parity: the C++ model with --mtp-num-layers (moecore_parity) against the PyTorch twin
(twin.py + twin_mtp.py), both in float32, on MoE models. The protocol of test_parity_moe.py (2 micro-batches of 2
sequences per step, 3 AdamW steps, rel = max |cpp - twin| / max |twin| < 1e-4 per tensor): logits, lm loss, every
gradient (the MTP depths', and what the MTP losses add to the decoder's, the shared embedding's and output layer's),
every parameter after each step, losses, grad norms, the MoE routers' logged losses (the MTP layers' after the
decoder's) and mtp_losses [(steps + 1) * 2, D] (each forward's unscaled depth losses, Megatron's "mtp_k loss").
Premise check as test_parity_moe.py: the float32 and float64 twins route every token alike (MTP routers included).

Usage: /usr/bin/python3 test_parity_mtp.py --parity PATH/TO/moecore_parity [--only NAME] [--keep DIR]
Registered in CTest as oracle_parity_mtp (label oracle).
"""
import os
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_parity  # noqa: E402
import test_parity_mla  # noqa: E402
import test_parity_moe  # noqa: E402
import twin  # noqa: E402

LLAMA, moe = test_parity.LLAMA, test_parity_moe.moe

CONFIGS = {
    "moe_mtp1_aux_z": {**LLAMA, "mtp_num_layers": 1, "moe": moe(z_loss_coeff=1e-3)},
    "moe_mtp2_untied_loss_mask_factor": {**LLAMA, "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.3,
                                         "untie_embeddings_and_output_weights": True, "mask": "zeros",
                                         "moe": moe(shared_expert_intermediate_size=32)},
    # the last decoder layer is dense, so are the MTP layers; LayerNorm norms with biases
    "mtp2_dense_last_layer_layernorm_bias": {"normalization": "LayerNorm", "activation": "gelu",
                                             "position_embedding_type": "rope", "add_bias_linear": True,
                                             "mtp_num_layers": 2, "moe": moe(moe_layer_pattern=[1, 0])},
    # packed documents (--reset-position-ids / --reset-attention-mask): the depths shift over the whole sequence, as
    # Megatron's roll_tensor without THD parameters, and attend within documents at the documents' positions
    "moe_mtp2_packed_documents": {**LLAMA, "mtp_num_layers": 2, "ids": "packed", "moe": moe()},
    # DeepSeek-V3-like: multi-latent attention (q latent, qk norms, YaRN) and a sigmoid MoE with expert bias; the depth
    # layer is built as the last decoder layer, MLA included
    "moe_mla_dsv3_like_mtp1": {**test_parity_mla.CONFIGS["moe_mla_dsv3_like"], "mtp_num_layers": 1},
    "moe_mtp2_no_position_seq_aux": {**LLAMA, "position_embedding_type": "none", "mtp_num_layers": 2,
                                     "mtp_loss_scaling_factor": 1.0,
                                     "moe": moe(load_balancing_types=["seq_aux_loss"], aux_loss_coeffs=[1e-2])},
}


def packed_ids(batch, seed):
    """Documents of random lengths per sample (1-3 cuts) and positions restarting in each, as test_parity.py's."""
    B, S = batch["tokens"].shape
    rng = np.random.default_rng(seed)
    documents = np.zeros((B, S), dtype=np.int32)
    positions = np.zeros((B, S), dtype=np.int64)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, S), size=rng.integers(1, 4), replace=False))
        documents[b] = np.searchsorted(cuts, np.arange(S), side="right")
        positions[b] = np.arange(S) - np.concatenate([[0], cuts])[documents[b]]
    return {**batch, "position_ids": positions, "document_ids": documents}


def run_config(parity_exe, label, overrides, workdir, seed):
    overrides = dict(overrides)
    ids = overrides.pop("ids", None)
    cfg, weights, batch = test_parity_moe.prepare(label, overrides, seed)
    if ids == "packed":
        batch = packed_ids(batch, seed + 2)
    failures = [f"{label}: {line}" for line in test_parity_moe.routing_premise(cfg, weights, batch)]
    ref = twin.run_megatron(cfg, weights, batch, test_parity.STEPS, test_parity.LR, test_parity.WEIGHT_DECAY,
                            test_parity.CLIP_GRAD, eps=test_parity.ADAM_EPS, dtype=torch.float32,
                            microbatches=test_parity_moe.MICROBATCHES)
    if not np.all(np.isfinite(ref["mtp_losses"])) or ref["mtp_losses"].shape[1] != cfg["mtp_num_layers"]:
        failures.append(f"{label}: twin MTP losses malformed: {ref['mtp_losses']}")
    cpp, error = test_parity.run_harness(parity_exe, label, cfg, weights, batch, workdir,
                                         microbatches=test_parity_moe.MICROBATCHES)
    if error:
        return failures + [error], {}
    worst = {}
    test_parity.compare(cpp, ref, label, failures, worst, test_parity.structurally_zero_grad(cfg))
    return failures, worst


def main():
    test_parity.matrix_main(CONFIGS, run_config, seed_base=5000, passed_text="all MTP parity comparisons passed")


if __name__ == "__main__":
    main()
