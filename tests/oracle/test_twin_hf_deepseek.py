"""Self-tests of the HF-style DeepSeek-V3 forward (twin_hf_deepseek.py), no C++ involved: the twin's Megatron-named
MLA + MoE model and the HF DeepseekV3ForCausalLM forward agree on the same weights, converted to HF names by this
file from the two layouts' definitions (Megatron-Bridge's DeepSeek-V3 mapping: q_a_proj = linear_q_down_proj, ...,
mlp.gate.e_score_correction_bias = mlp.router.expert_bias, experts' gate / up = the halves of linear_fc1), written to an
export folder (config.json + model.safetensors) and read back by twin.load_hf_dir.

Cases: DeepSeek-V3-like (q-lora, YaRN s 40 with mscale = mscale_all_dim = 1, a dense first layer, sigmoid router with
expert bias and 4 groups keeping 2, shared expert, routed scaling 2.5, an MTP layer's tensors in the folder that
must be ignored); no q-lora with YaRN's get_mscale(factor) attention factor (mscale_all_dim 0), tied embeddings; plain
RoPE (rope_type rope, HF rope_scaling null). rope_interleave false: HF rotates the rope channels as stored, so it equals
the Megatron model only after the rope rows of q_b_proj / kv_a_proj_with_mqa are permuted to [evens | odds]; without
the permutation the logits differ (the flag acts).

Usage: /usr/bin/python3 test_twin_hf_deepseek.py [-v]   (unittest; a few seconds)
"""
import json
import os
import sys
import tempfile
import unittest

import numpy as np
import torch

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
import twin  # noqa: E402
import twin_hf_deepseek  # noqa: E402

D = torch.float64
TOLERANCE = 1e-5  # HF's cos / sin are float32 (cast to float64), the Megatron twin's are float64 of float32 angles

BASE = {"num_layers": 3, "hidden_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 4, "num_query_groups": 0,
        "kv_channels": 0, "seq_length": 12, "max_position_embeddings": 12, "vocab_size": 64,
        "normalization": "RMSNorm", "norm_epsilon": 1e-6, "activation": "swiglu", "add_bias_linear": False,
        "position_embedding_type": "rope", "qk_layernorm": True, "untie_embeddings_and_output_weights": True}
MLA = {"q_lora_rank": 16, "kv_lora_rank": 12, "qk_head_dim": 8, "qk_pos_emb_head_dim": 8, "v_head_dim": 6}
MOE = {"num_experts": 8, "ffn_hidden_size": 16, "moe_layer_pattern": [0, 1, 1], "topk": 4,
       "score_function": "sigmoid", "enable_expert_bias": True, "num_groups": 4, "group_topk": 2,
       "topk_scaling_factor": 2.5, "shared_expert_intermediate_size": 16, "aux_loss_coeffs": [0.0]}
CONFIGS = {
    "dsv3_like": {"mla": MLA, "moe": MOE, "yarn": {"rotary_scaling_factor": 40.0, "mscale": 1.0,
                                                    "mscale_all_dim": 1.0}},
    "no_q_lora_yarn_mscale_all_dim_0_tied": {
        "untie_embeddings_and_output_weights": False, "mla": {**MLA, "q_lora_rank": 0},
        "moe": {**MOE, "num_groups": 2, "group_topk": 1, "topk": 2, "shared_expert_intermediate_size": 32},
        "yarn": {"rotary_scaling_factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                 "original_max_position_embeddings": 64, "beta_fast": 4.0}},
    "rope_type_rope_dense_first_two": {"mla": {**MLA, "rope_type": "rope"}, "rotary_base": 500.0,
                                       "moe": {**MOE, "moe_layer_pattern": [0, 0, 1]}},
}


def rope_permutation(dr):
    """Row order that stores a rope sub-vector as [evens | odds] (Megatron's de-interleaved order)."""
    return np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])


def to_hf(cfg, weights, deinterleave_rope_rows=False):
    """(config.json dict, tensors) of the HF DeepSeek-V3 export of a Megatron-named MLA + MoE model."""
    c = twin.full_config(cfg)
    m, moe, yarn = c["mla"], c["moe"], c["yarn"]
    N, dq, dr, dv = c["num_attention_heads"], m["qk_head_dim"], m["qk_pos_emb_head_dim"], m["v_head_dim"]
    pattern = moe["moe_layer_pattern"]
    first_dense = pattern.index(1)
    if pattern != [0] * first_dense + [1] * (len(pattern) - first_dense):
        raise ValueError("DeepSeek-V3 layouts have dense layers first, then MoE layers")
    E, Fm, F_ = moe["num_experts"], moe["ffn_hidden_size"], c["ffn_hidden_size"]
    yarn_scaling = m["rope_type"] == "yarn"
    config = {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"], "intermediate_size": F_, "moe_intermediate_size": Fm,
        "num_hidden_layers": c["num_layers"], "num_attention_heads": N, "num_key_value_heads": N,
        "n_shared_experts": moe["shared_expert_intermediate_size"] // Fm, "n_routed_experts": E,
        "routed_scaling_factor": moe["topk_scaling_factor"] or 1.0, "kv_lora_rank": m["kv_lora_rank"],
        "q_lora_rank": m["q_lora_rank"] or None, "qk_rope_head_dim": dr, "v_head_dim": dv, "qk_nope_head_dim": dq,
        "n_group": moe["num_groups"], "topk_group": moe["group_topk"], "num_experts_per_tok": moe["topk"],
        "first_k_dense_replace": first_dense, "norm_topk_prob": True, "hidden_act": "silu",
        # transformers replaces rope_scaling.factor by max_position_embeddings / original_max_position_embeddings
        "max_position_embeddings": int(yarn["rotary_scaling_factor"] * yarn["original_max_position_embeddings"])
        if yarn_scaling else c["max_position_embeddings"],
        "rms_norm_eps": c["norm_epsilon"], "tie_word_embeddings": not c["untie_embeddings_and_output_weights"],
        "rope_theta": c["rotary_base"], "rope_interleave": not deinterleave_rope_rows, "attention_bias": False,
        "num_nextn_predict_layers": 1,
        "rope_scaling": {"type": "yarn", "factor": yarn["rotary_scaling_factor"],
                         "original_max_position_embeddings": yarn["original_max_position_embeddings"],
                         "beta_fast": yarn["beta_fast"], "beta_slow": yarn["beta_slow"], "mscale": yarn["mscale"],
                         "mscale_all_dim": yarn["mscale_all_dim"]} if yarn_scaling else None,
    }
    perm_q = np.arange(dq + dr)
    perm_kv = np.arange(m["kv_lora_rank"] + dr)
    if deinterleave_rope_rows:
        perm_q[dq:] = dq + rope_permutation(dr)
        perm_kv[m["kv_lora_rank"]:] = m["kv_lora_rank"] + rope_permutation(dr)
    out = {"model.embed_tokens.weight": weights["embedding.word_embeddings.weight"],
           "model.norm.weight": weights["decoder.final_layernorm.weight"]}
    if c["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = weights["output_layer.weight"]
    for i in range(c["num_layers"]):
        g, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        a, h = g + "self_attention.", p + "self_attn."
        out[p + "input_layernorm.weight"] = weights[g + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = weights[g + "pre_mlp_layernorm.weight"]
        q_up = "linear_q_up_proj" if m["q_lora_rank"] else "linear_q_proj"
        q_rows = weights[a + q_up + ".weight"].reshape(N, dq + dr, -1)[:, perm_q].reshape(N * (dq + dr), -1)
        out[h + ("q_b_proj" if m["q_lora_rank"] else "q_proj") + ".weight"] = q_rows
        if m["q_lora_rank"]:
            out[h + "q_a_proj.weight"] = weights[a + "linear_q_down_proj.weight"]
            out[h + "q_a_layernorm.weight"] = weights[a + "q_layernorm.weight"]
        out[h + "kv_a_proj_with_mqa.weight"] = weights[a + "linear_kv_down_proj.weight"][perm_kv]
        out[h + "kv_a_layernorm.weight"] = weights[a + "kv_layernorm.weight"]
        out[h + "kv_b_proj.weight"] = weights[a + "linear_kv_up_proj.weight"]
        out[h + "o_proj.weight"] = weights[a + "linear_proj.weight"]
        if not pattern[i]:
            fc1 = weights[g + "mlp.linear_fc1.weight"]
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = fc1[:F_], fc1[F_:]
            out[p + "mlp.down_proj.weight"] = weights[g + "mlp.linear_fc2.weight"]
            continue
        out[p + "mlp.gate.weight"] = weights[g + "mlp.router.weight"]
        out[p + "mlp.gate.e_score_correction_bias"] = weights[g + "mlp.router.expert_bias"]
        for e in range(E):
            x = f"{g}mlp.experts.local_experts.{e}."
            fc1 = weights[x + "linear_fc1.weight"]
            out[p + f"mlp.experts.{e}.gate_proj.weight"], out[p + f"mlp.experts.{e}.up_proj.weight"] = \
                fc1[:Fm], fc1[Fm:]
            out[p + f"mlp.experts.{e}.down_proj.weight"] = weights[x + "linear_fc2.weight"]
        shared = moe["shared_expert_intermediate_size"]
        fc1 = weights[g + "mlp.shared_experts.linear_fc1.weight"]
        out[p + "mlp.shared_experts.gate_proj.weight"], out[p + "mlp.shared_experts.up_proj.weight"] = \
            fc1[:shared], fc1[shared:]
        out[p + "mlp.shared_experts.down_proj.weight"] = weights[g + "mlp.shared_experts.linear_fc2.weight"]
    # a multi-token-prediction layer (index num_hidden_layers) that transformers does not load
    rng = np.random.default_rng(0)
    mtp = f"model.layers.{c['num_layers']}."
    for name, shape in (("enorm.weight", (c["hidden_size"],)), ("eh_proj.weight", (c["hidden_size"],) * 2),
                        ("self_attn.kv_a_proj_with_mqa.weight", (m["kv_lora_rank"] + dr, c["hidden_size"]))):
        out[mtp + name] = rng.standard_normal(shape).astype(np.float32)
    return config, {k: np.ascontiguousarray(v) for k, v in out.items()}


def megatron_logits(cfg, weights, tokens):
    params = {k: torch.tensor(v, dtype=D) for k, v in weights.items()}
    with torch.no_grad():
        logits, _ = twin.megatron_forward(params, cfg, tokens, tokens, torch.ones(tokens.shape, dtype=D),
                                          training=False)
    return logits.transpose(0, 1)  # [B, S, V]


def hf_logits_via_folder(config, tensors, tokens):
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        st.save(os.path.join(folder, "model.safetensors"), tensors)
        loaded_config, loaded, _ = twin.load_hf_dir(folder)
    with torch.no_grad():
        return twin_hf_deepseek.hf_deepseek_forward(loaded_config, loaded, tokens, dtype=D)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


class HfDeepseekTest(unittest.TestCase):
    def setUp(self):
        self.tokens = torch.tensor(np.random.default_rng(5).integers(0, 64, (2, 12)), dtype=torch.long)

    def model(self, name, seed):
        cfg = {**BASE, **CONFIGS[name]}
        return cfg, {**twin.random_params(cfg, seed), **twin.random_buffers(cfg, seed + 1)}

    def test_megatron_twin_equals_hf_forward(self):
        for index, name in enumerate(CONFIGS):
            with self.subTest(config=name):
                cfg, weights = self.model(name, 40 + index)
                expected = megatron_logits(cfg, weights, self.tokens)
                got = hf_logits_via_folder(*to_hf(cfg, weights), self.tokens)
                self.assertLess(rel(got, expected), TOLERANCE)

    def test_rope_interleave_false(self):
        cfg, weights = self.model("dsv3_like", 7)
        expected = megatron_logits(cfg, weights, self.tokens)
        config, tensors = to_hf(cfg, weights, deinterleave_rope_rows=True)
        self.assertLess(rel(hf_logits_via_folder(config, tensors, self.tokens), expected), TOLERANCE)
        config_interleaved = {**config, "rope_interleave": True}
        self.assertGreater(rel(hf_logits_via_folder(config_interleaved, tensors, self.tokens), expected), 1e-3)

    def test_rope_parameters_form(self):
        """The newer config.json form (rope_parameters holding rope_theta) reads the same."""
        cfg, weights = self.model("dsv3_like", 9)
        config, tensors = to_hf(cfg, weights)
        newer = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_theta")}
        newer["rope_parameters"] = {**config["rope_scaling"], "rope_type": "yarn", "rope_theta": config["rope_theta"]}
        del newer["rope_parameters"]["type"]
        torch.testing.assert_close(hf_logits_via_folder(newer, tensors, self.tokens),
                                   hf_logits_via_folder(config, tensors, self.tokens), rtol=0, atol=0)

    def test_expert_bias_acts(self):
        """e_score_correction_bias steers the choice of experts: a large bias on one expert changes the logits."""
        cfg, weights = self.model("dsv3_like", 11)
        config, tensors = to_hf(cfg, weights)
        base = hf_logits_via_folder(config, tensors, self.tokens)
        biased = dict(tensors)
        bias = np.zeros(8, dtype=np.float32)
        bias[3] = 5.0
        biased["model.layers.1.mlp.gate.e_score_correction_bias"] = bias
        self.assertGreater(rel(hf_logits_via_folder(config, biased, self.tokens), base), 1e-3)


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main()
