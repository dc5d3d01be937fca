"""Model-level parity of multi-latent attention (MLA) and YaRN: the C++ model (moecore_parity) against the PyTorch
twin (twin.py + twin_mla.py), both in float32. Same protocol, metric and tolerance as test_parity.py (rel = max |cpp -
twin| / max |twin| < 1e-4 per tensor; logits, loss, every gradient, every parameter after each of 3 AdamW steps,
losses, grad norms). Dense cases run one micro-batch per step; MoE cases run test_parity_moe.py's protocol (2
micro-batches of 2 sequences, the float32 / float64 routing premise, the aux-only gradient comparison).

Cases: MLA with and without q-lora (v_head_dim != qk_head_dim + qk_pos_emb_head_dim throughout), with qk_layernorm
(RMSNorm; LayerNorm with biases), MLA + YaRN with DeepSeek-V3's scaling (s 40, mscale = mscale_all_dim = 1), with a
concentration factor != 1 and with correction_range_round_to_int false (which MLA ignores), MLA rope_type rope (also
with rotary_percent 0.5), MLA on packed sequences (position ids + documents), standard attention with
position_embedding_type yarn (rounded and fractional ramp bounds, rotary_percent ignored, a concentration factor != 1,
which Megatron's Attention applies), and MLA with MoE layers (DeepSeek-V3-like sigmoid router with expert bias and
groups, shared expert, a dense first layer).

No gradient element is structurally zero here (MLA has no query / key biases; yarn rotates every key channel of
standard attention), so nothing is left out of the step comparisons.

Usage: /usr/bin/python3 test_parity_mla.py --parity PATH/TO/moecore_parity [--only NAME] [--keep DIR]
       /usr/bin/python3 test_parity_mla.py --twin-only      (runs the twin side and the premise checks only)
Registered in CTest as oracle_parity_mla (label oracle).
"""
import os
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_parity  # noqa: E402
import test_parity_moe  # noqa: E402
import twin  # noqa: E402

STEPS, LR, WEIGHT_DECAY, CLIP_GRAD, ADAM_EPS = (test_parity.STEPS, test_parity.LR, test_parity.WEIGHT_DECAY,
                                                test_parity.CLIP_GRAD, test_parity.ADAM_EPS)

BASE = test_parity.BASE  # hidden 64, 4 heads, S 16, vocab 384, 2 layers
LLAMA = {**test_parity.LLAMA, "position_embedding_type": "none"}  # MLA brings its own rotary embedding
MLA = {"q_lora_rank": 32, "kv_lora_rank": 24, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 12}
DSV3_YARN = {"rotary_scaling_factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}
MOE = {**test_parity_moe.MOE, "score_function": "sigmoid", "enable_expert_bias": True, "bias_update_rate": 1e-2,
       "topk": 4, "num_groups": 4, "group_topk": 2, "topk_scaling_factor": 2.5, "shared_expert_intermediate_size": 32,
       "load_balancing_types": ["seq_aux_loss"], "aux_loss_coeffs": [1e-3], "moe_layer_pattern": [0, 1]}

CONFIGS = {
    "mla_q_lora_yarn_default": {**LLAMA, "mla": MLA},
    "mla_no_q_lora": {**LLAMA, "mla": {**MLA, "q_lora_rank": 0}},
    # MLA's YarnRotaryEmbedding always rounds the ramp bounds (MultiLatentAttention does not pass the flag; bounds
    # 1.31 / 2.81 -> 1 / 3 here), so correction_range_round_to_int false changes nothing for MLA
    "mla_yarn_ignores_unrounded_flag": {**LLAMA, "mla": MLA,
                                        "yarn": {**DSV3_YARN, "correction_range_round_to_int": False}},
    "mla_qk_layernorm_dsv3_yarn": {**LLAMA, "qk_layernorm": True, "mla": MLA, "yarn": DSV3_YARN},
    "mla_no_q_lora_qk_layernorm": {**LLAMA, "qk_layernorm": True, "mla": {**MLA, "q_lora_rank": 0},
                                   "yarn": DSV3_YARN},
    "mla_layernorm_bias_gelu_qk_layernorm_learned_abs": {
        "normalization": "LayerNorm", "activation": "gelu", "add_bias_linear": True, "qk_layernorm": True,
        "position_embedding_type": "learned_absolute", "mla": MLA, "yarn": {"rotary_scaling_factor": 8.0}},
    # concentration factor get_mscale(4, 1) / get_mscale(4, 0.5) != 1; original length 64 puts the ramp inside dr / 2
    "mla_yarn_concentration": {**LLAMA, "mla": {**MLA, "qk_pos_emb_head_dim": 16},
                               "yarn": {"rotary_scaling_factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                                        "original_max_position_embeddings": 64, "beta_fast": 4.0}},
    "mla_rope_type_rope": {**LLAMA, "rotary_base": 500.0, "mla": {**MLA, "rope_type": "rope"},
                           "yarn": DSV3_YARN},  # softmax scale still get_mscale(40, 1)^2 / sqrt(dq + dr)
    "mla_rope_type_rope_half": {**LLAMA, "rotary_percent": 0.5, "mla": {**MLA, "rope_type": "rope"}},
    "mla_packed_documents": {**LLAMA, "qk_layernorm": True, "mla": MLA, "yarn": DSV3_YARN, "ids": "packed"},
    "yarn_standard_attention_gqa": {**test_parity.LLAMA, "num_query_groups": 2, "position_embedding_type": "yarn",
                                    "rotary_percent": 0.5,
                                    "yarn": {"rotary_scaling_factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                                             "original_max_position_embeddings": 64, "beta_fast": 8.0}},
    "yarn_standard_attention_fractional_bias": {
        "normalization": "LayerNorm", "activation": "gelu", "add_bias_linear": True, "position_embedding_type": "yarn",
        "yarn": {"rotary_scaling_factor": 16.0, "original_max_position_embeddings": 128, "beta_fast": 16.0,
                 "correction_range_round_to_int": False}},
    # the DeepSeek-V3 launch's --position-embedding-type rope: GPTModel builds no table for MLA
    "moe_mla_dsv3_like": {**LLAMA, "position_embedding_type": "rope", "qk_layernorm": True, "mla": MLA,
                          "yarn": DSV3_YARN, "moe": MOE},
    "moe_mla_no_q_lora_rope_type_rope": {**LLAMA, "mla": {**MLA, "q_lora_rank": 0, "rope_type": "rope"},
                                         "moe": {**test_parity_moe.MOE, "moe_layer_pattern": [1, 1]}},
    "moe_yarn_standard_attention": {**test_parity.LLAMA, "position_embedding_type": "yarn",
                                    "yarn": {"rotary_scaling_factor": 4.0, "original_max_position_embeddings": 64},
                                    "moe": test_parity_moe.MOE},
}


def packed_ids(B, S, seed):
    """position_ids and document_ids [B, S]: 1-3 documents of random lengths per sample, positions restarting."""
    rng = np.random.default_rng(seed)
    documents = np.zeros((B, S), dtype=np.int32)
    positions = np.zeros((B, S), dtype=np.int64)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, S), size=rng.integers(1, 4), replace=False))
        documents[b] = np.searchsorted(cuts, np.arange(S), side="right")
        positions[b] = np.arange(S) - np.concatenate([[0], cuts])[documents[b]]
    return positions, documents


def prepare(overrides, seed):
    overrides = dict(overrides)
    ids = overrides.pop("ids", None)
    cfg = {**BASE, **overrides}
    moe = cfg.get("moe") is not None
    weights = {**twin.random_params(cfg, seed), **(twin.random_buffers(cfg, seed + 2) if moe else {})}
    batch = test_parity.make_batch(cfg, seed + 1, "ones", test_parity_moe.BATCH_SIZE if moe else 3)
    if ids == "packed":
        batch["position_ids"], batch["document_ids"] = packed_ids(*batch["tokens"].shape, seed + 3)
    return cfg, weights, batch, test_parity_moe.MICROBATCHES if moe else 1


def run_config(parity_exe, label, overrides, workdir, seed):
    cfg, weights, batch, microbatches = prepare(overrides, seed)
    moe = microbatches > 1
    failures = [f"{label}: {line}" for line in test_parity_moe.routing_premise(cfg, weights, batch)] if moe else []
    ref = twin.run_megatron(cfg, weights, batch, STEPS, LR, WEIGHT_DECAY, CLIP_GRAD, eps=ADAM_EPS, dtype=torch.float32,
                            microbatches=microbatches)
    if not np.all(np.isfinite(ref["losses"])) or not ref["losses"][-1] < ref["losses"][0]:
        failures.append(f"{label}: twin losses not finite or not decreasing: {ref['losses']}")
    if parity_exe is None:
        return failures, {"twin_loss": float(ref["loss"])}
    cpp, error = test_parity.run_harness(parity_exe, label, cfg, weights, batch, workdir, microbatches=microbatches)
    if error:
        return failures + [error], {}
    worst = {}
    test_parity.compare(cpp, ref, label, failures, worst)
    if moe and test_parity_moe.has_aux_or_z(cfg):
        test_parity_moe.compare_aux_only(parity_exe, label, cfg, weights, batch, workdir, failures, worst)
    return failures, worst


def main():
    test_parity.matrix_main(CONFIGS, run_config, seed_base=5000, passed_text="all MLA / YaRN parity comparisons passed", twin_only_text="twin side of the MLA / YaRN parity matrix ok")


if __name__ == "__main__":
    main()
