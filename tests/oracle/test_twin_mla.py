"""Self-tests of the twin's multi-latent attention and YaRN (twin_mla.py), no C++ involved.

  * YaRN for DeepSeek-V3's numbers (dr 64, base 1e4, original length 4096, s 40, mscale = mscale_all_dim = 1):
    ramp bounds 10 / 23, concentration factor 1, softmax scale 0.135234..., and the blended frequencies, all from
    plain math written here; also the low == high (+0.001) and the unrounded (fractional) ramp bounds.
  * position_embedding_type yarn for standard attention: dim = kv_channels whatever rotary_percent, cos / sin times
    the concentration factor (Megatron's Attention applies it; GPTModel only discards YarnRotaryEmbedding's copy),
    against plain math.
  * The MLA attention of the twin against an independent float64 numpy formulation with explicit loops over
    samples, tokens and heads, RoPE as complex rotations of the (even, odd) channel pairs in the weights' own layout,
    for q-lora / no q-lora, qk_layernorm (RMSNorm and LayerNorm), yarn and rope rope types (with rotary_percent),
    packed positions and documents.
  * The MLA de-interleave RoPE equals transformers' DeepSeek-V3 apply_rotary_pos_emb_interleave formulation
    (view(d/2, 2).transpose + rotate_half) and its yarn frequencies / attention factor / softmax scale
    (modeling_rope_utils._compute_yarn_parameters, DeepseekV3Attention.scaling).
  * Gradients of the twin's MLA against torch.autograd.gradcheck (float64 finite differences).
  * The parameter names and shapes of an MLA model.

Usage: /usr/bin/python3 test_twin_mla.py [-v]   (unittest; a few seconds)
"""
import math
import os
import sys
import unittest

import numpy as np
import torch

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import twin  # noqa: E402
import twin_mla  # noqa: E402

DSV3_YARN = {"rotary_scaling_factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
             "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def plain_mscale(s, m):
    return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0


def plain_yarn_inv_freq(dim, base, s, L, beta_fast, beta_slow, round_to_int):
    """YaRN's blended inverse frequencies in float64, from the formula."""
    def corr(r):
        return dim * math.log(L / (2 * math.pi * r)) / (2 * math.log(base))
    low, high = corr(beta_fast), corr(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        extra = base ** (-2.0 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: original frequency, 1: interpolated (/ s)
        out.append(extra * (1 - ramp) + extra / s * ramp)
    return np.array(out)


def plain_rope_inv_freq(dim, rotary_percent, base):
    rot = int(dim * rotary_percent) if rotary_percent < 1 else dim
    return np.array([base ** (-2.0 * i / rot) for i in range(rot // 2)])


# ----------------------------------------------------------------------------------------------- loop reference


def ref_norm(x, w, b, eps):
    """RMSNorm (b None) or LayerNorm of a vector, float64."""
    if b is None:
        return x / math.sqrt(np.mean(x * x) + eps) * w
    mu = np.mean(x)
    return (x - mu) / math.sqrt(np.mean((x - mu) ** 2) + eps) * w + b


def rotate_pairs(r, angles, factor):
    """RoPE in the weights' own layout: channel pair (2i, 2i + 1) is the complex number r[2i] + i r[2i + 1] turned
    by angles[i]; channels past 2 len(angles) pass through. The pairs come out as [all first | all second]
    (the permutation is shared by queries and keys, so dot products do not see it)."""
    first, second = [], []
    for i, a in enumerate(angles):
        x, y = r[2 * i], r[2 * i + 1]
        first.append(factor * (x * math.cos(a) - y * math.sin(a)))
        second.append(factor * (x * math.sin(a) + y * math.cos(a)))
    return np.array(first + second + list(r[2 * len(angles):]))


def ref_mla(h, w, prefix, cfg, positions, documents):
    """Independent MLA attention output [S, B, H] in float64 numpy: explicit loops over samples, tokens, heads."""
    c = twin.full_config(cfg)
    m, yarn = c["mla"], c["yarn"]
    S, B, H = h.shape
    N, dq, dr, dv = c["num_attention_heads"], m["qk_head_dim"], m["qk_pos_emb_head_dim"], m["v_head_dim"]
    eps, layer_norm = c["norm_epsilon"], c["normalization"] == "LayerNorm"
    a = prefix + "self_attention."
    s = yarn["rotary_scaling_factor"]
    if m["rope_type"] == "yarn":
        inv_freq = plain_yarn_inv_freq(dr, c["rotary_base"], s, yarn["original_max_position_embeddings"],
                                       yarn["beta_fast"], yarn["beta_slow"], True)
        factor = plain_mscale(s, yarn["mscale"]) / plain_mscale(s, yarn["mscale_all_dim"])
    else:
        inv_freq, factor = plain_rope_inv_freq(dr, c["rotary_percent"], c["rotary_base"]), 1.0
    scale = plain_mscale(s, yarn["mscale_all_dim"]) ** 2 / math.sqrt(dq + dr)

    def norm(x, name):
        return ref_norm(x, w[a + name + ".weight"], w[a + name + ".bias"] if layer_norm else None, eps)

    out = np.zeros((S, B, H))
    for b in range(B):
        q = np.zeros((S, N, dq + dr))
        k = np.zeros((S, N, dq + dr))
        v = np.zeros((S, N, dv))
        for t in range(S):
            x = h[t, b]
            if m["q_lora_rank"] > 0:
                cq = w[a + "linear_q_down_proj.weight"] @ x
                if c["qk_layernorm"]:
                    cq = norm(cq, "q_layernorm")
                q_all = w[a + "linear_q_up_proj.weight"] @ cq
            else:
                q_all = w[a + "linear_q_proj.weight"] @ x
            ckv = w[a + "linear_kv_down_proj.weight"] @ x
            latent, k_rope = ckv[:m["kv_lora_rank"]], ckv[m["kv_lora_rank"]:]
            if c["qk_layernorm"]:
                latent = norm(latent, "kv_layernorm")
            kv_all = w[a + "linear_kv_up_proj.weight"] @ latent
            angles = positions[b, t] * inv_freq
            k_rot = rotate_pairs(k_rope, angles, factor)
            for n in range(N):
                qn = q_all[n * (dq + dr):(n + 1) * (dq + dr)]
                q[t, n] = np.concatenate([qn[:dq], rotate_pairs(qn[dq:], angles, factor)])
                kvn = kv_all[n * (dq + dv):(n + 1) * (dq + dv)]
                k[t, n] = np.concatenate([kvn[:dq], k_rot])
                v[t, n] = kvn[dq:]
        for t in range(S):
            context = []
            for n in range(N):
                keys = [j for j in range(t + 1) if documents[b, j] == documents[b, t]]
                scores = np.array([q[t, n] @ k[j, n] * scale for j in keys])
                p = np.exp(scores - scores.max())
                p /= p.sum()
                context.append(sum(pj * v[j, n] for pj, j in zip(p, keys)))
            y = w[a + "linear_proj.weight"] @ np.concatenate(context)
            if a + "linear_proj.bias" in w:
                y = y + w[a + "linear_proj.bias"]
            out[t, b] = y
    return out


# ----------------------------------------------------------------------------------------------- configurations

BASE = {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 24, "num_attention_heads": 3, "num_query_groups": 0,
        "kv_channels": 0, "seq_length": 7, "max_position_embeddings": 16, "vocab_size": 32,
        "normalization": "RMSNorm", "norm_epsilon": 1e-6, "activation": "swiglu", "add_bias_linear": False,
        "position_embedding_type": "none"}
MLA = {"q_lora_rank": 6, "kv_lora_rank": 5, "qk_head_dim": 4, "qk_pos_emb_head_dim": 8, "v_head_dim": 3}
CONFIGS = {
    "q_lora_qk_layernorm_yarn_dsv3": {"qk_layernorm": True, "mla": MLA, "yarn": DSV3_YARN},
    # s 4 with mscale 1 / mscale_all_dim 0.5: concentration factor != 1, softmax scale != 1 / sqrt(dq + dr); a short
    # original length so that the ramp sits inside the 4 frequencies.
    "no_q_lora_yarn_concentration": {"mla": {**MLA, "q_lora_rank": 0},
                                     "yarn": {"rotary_scaling_factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                                              "original_max_position_embeddings": 64, "beta_fast": 4.0,
                                              "beta_slow": 1.0}},
    "layernorm_bias_qk_layernorm": {"normalization": "LayerNorm", "add_bias_linear": True, "qk_layernorm": True,
                                    "mla": MLA, "yarn": {"rotary_scaling_factor": 8.0, "mscale_all_dim": 1.0}},
    "rope_type_rope_half": {"rotary_percent": 0.5, "rotary_base": 100.0, "mla": {**MLA, "rope_type": "rope"},
                            "yarn": {"rotary_scaling_factor": 40.0, "mscale_all_dim": 1.0}},
    "no_q_lora_qk_layernorm_rope": {"qk_layernorm": True, "mla": {**MLA, "q_lora_rank": 0, "rope_type": "rope"}},
}


def cfg_of(name):
    return {**BASE, **CONFIGS[name]}


def packed_ids(S, B):
    positions = np.stack([np.arange(S), np.concatenate([np.arange(3), np.arange(S - 3)])][:B]).astype(np.int64)
    documents = np.stack([np.zeros(S), np.concatenate([np.zeros(3), np.ones(S - 3)])][:B]).astype(np.int64)
    return positions, documents


def twin_mla_output(cfg, weights, h, positions=None, documents=None, dtype=torch.float64):
    c = twin.full_config(cfg)
    S, B = h.shape[:2]
    params = {k: torch.tensor(v, dtype=dtype) for k, v in weights.items()}
    pos_SB = None if positions is None else torch.tensor(positions).t()
    cos, sin = twin_mla.mla_cos_sin(c, S, dtype, pos_SB)
    allowed = twin.attention_mask(S, None if documents is None else torch.tensor(documents))
    allowed = allowed if allowed.dim() == 2 else allowed[:, None]
    return twin_mla.mla_attention(torch.tensor(h, dtype=dtype), params, "decoder.layers.0.", c, cos, sin, allowed,
                                  twin._norm)


class YarnTest(unittest.TestCase):
    def test_deepseek_v3_numbers(self):
        c = twin.full_config({**BASE, "mla": {"qk_head_dim": 128, "qk_pos_emb_head_dim": 64}, "yarn": DSV3_YARN})
        corr_fast = 64 * math.log(4096 / (2 * math.pi * 32)) / (2 * math.log(1e4))  # 10.4...
        corr_slow = 64 * math.log(4096 / (2 * math.pi * 1)) / (2 * math.log(1e4))  # 22.5...
        self.assertEqual((math.floor(corr_fast), math.ceil(corr_slow)), (10, 23))
        self.assertEqual(twin_mla.correction_range(64, 1e4, c["yarn"], True), (10, 23))
        self.assertEqual(twin_mla.concentration_factor(c["yarn"]), 1.0)
        self.assertAlmostEqual(twin_mla.mla_softmax_scale(c), (0.1 * math.log(40) + 1) ** 2 / math.sqrt(192), 14)
        self.assertAlmostEqual(twin_mla.mla_softmax_scale(c), 0.135234, 6)
        expected = plain_yarn_inv_freq(64, 1e4, 40.0, 4096, 32.0, 1.0, True)
        got = twin_mla.yarn_inv_freq(64, 1e4, c["yarn"], True)
        self.assertEqual(got.dtype, torch.float32)
        np.testing.assert_allclose(got.numpy(), expected, rtol=2e-6)
        np.testing.assert_allclose(got.numpy()[:11], [1e4 ** (-i / 32) for i in range(11)], rtol=2e-6)
        np.testing.assert_allclose(got.numpy()[23:], [1e4 ** (-i / 32) / 40 for i in range(23, 32)], rtol=2e-6)
        # cos / sin of the MLA table carry the concentration factor: 1 here, 1.1386 / 1.0693 with mscale_all_dim 0.5
        yarn = {**DSV3_YARN, "mscale_all_dim": 0.5}
        c2 = twin.full_config({**BASE, "mla": {"qk_pos_emb_head_dim": 64}, "yarn": yarn})
        cos, sin = twin_mla.mla_cos_sin(c2, 5, torch.float64)
        factor = plain_mscale(40, 1.0) / plain_mscale(40, 0.5)
        self.assertAlmostEqual(float(cos[0, 0]), factor, 12)
        angles = np.outer(np.arange(5), expected)
        np.testing.assert_allclose(sin.numpy()[:, :32], factor * np.sin(angles), atol=1e-6)

    def test_mla_always_rounds(self):
        """MultiLatentAttention builds YarnRotaryEmbedding without correction_range_round_to_int: always rounded."""
        cfg = {**BASE, "mla": MLA, "yarn": {**DSV3_YARN, "correction_range_round_to_int": False}}
        unrounded, _ = twin_mla.mla_cos_sin(twin.full_config(cfg), 7, torch.float64)
        rounded, _ = twin_mla.mla_cos_sin(twin.full_config({**cfg, "yarn": DSV3_YARN}), 7, torch.float64)
        self.assertTrue(torch.equal(unrounded, rounded))
        yarn = twin_mla.full_yarn_config(DSV3_YARN)
        self.assertNotEqual(twin_mla.correction_range(8, 1e4, yarn, False),
                            twin_mla.correction_range(8, 1e4, yarn, True))

    def test_low_equals_high_and_fractional_bounds(self):
        # original length 4, dim 8: both bounds clamp to 0, so high becomes 0.001 and ramp = [0, 1, 1, 1]
        yarn = twin_mla.full_yarn_config({"rotary_scaling_factor": 5.0, "original_max_position_embeddings": 4})
        self.assertEqual(twin_mla.correction_range(8, 1e4, yarn, True), (0, 0))
        got = twin_mla.yarn_inv_freq(8, 1e4, yarn, True).numpy()
        extra = np.array([1e4 ** (-i / 4) for i in range(4)])
        np.testing.assert_allclose(got, [extra[0], extra[1] / 5, extra[2] / 5, extra[3] / 5], rtol=2e-6)
        # without rounding the bounds stay fractional
        yarn = twin_mla.full_yarn_config({"rotary_scaling_factor": 5.0, "original_max_position_embeddings": 256,
                                          "beta_fast": 8.0, "beta_slow": 0.5})
        low, high = twin_mla.correction_range(16, 1e4, yarn, False)
        self.assertNotEqual(low, math.floor(low))
        got = twin_mla.yarn_inv_freq(16, 1e4, yarn, False).numpy()
        np.testing.assert_allclose(got, plain_yarn_inv_freq(16, 1e4, 5.0, 256, 8.0, 0.5, False), rtol=2e-6)
        self.assertFalse(np.allclose(got, plain_yarn_inv_freq(16, 1e4, 5.0, 256, 8.0, 0.5, True), rtol=1e-4))

    def test_standard_attention_yarn(self):
        """Standard attention's yarn: kv_channels wide whatever rotary_percent, concentration factor, config's
        rounding."""
        yarn = {"rotary_scaling_factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.0,  # concentration 1.1386
                "original_max_position_embeddings": 64, "beta_fast": 8.0, "beta_slow": 1.0,
                "correction_range_round_to_int": False}
        c = twin.full_config({**BASE, "kv_channels": 12, "num_query_groups": 3, "rotary_percent": 0.5,
                              "position_embedding_type": "yarn", "yarn": yarn})
        positions = torch.tensor([[0, 1, 2, 5, 9], [3, 0, 1, 2, 3]]).t()  # [S, B]
        cos, sin, rot_dim = twin_mla.standard_yarn_cos_sin(c, 5, torch.float64, positions)
        self.assertEqual(rot_dim, 12)
        inv = plain_yarn_inv_freq(12, 1e4, 4.0, 64, 8.0, 1.0, False)
        angles = positions.numpy()[..., None] * inv
        factor = plain_mscale(4.0, 1.0) / plain_mscale(4.0, 0.0)
        self.assertGreater(factor, 1.1)
        np.testing.assert_allclose(cos.numpy(), factor * np.cos(np.concatenate([angles, angles], -1)), atol=1e-6)
        np.testing.assert_allclose(sin.numpy(), factor * np.sin(np.concatenate([angles, angles], -1)), atol=1e-6)

    def test_model_runs_yarn_standard_attention(self):
        cfg = {**BASE, "num_layers": 2, "kv_channels": 4, "num_query_groups": 3, "position_embedding_type": "yarn",
               "yarn": {"rotary_scaling_factor": 4.0, "original_max_position_embeddings": 8}}
        out = twin.run_megatron(cfg, twin.random_params(cfg, 5), {"tokens": np.arange(14).reshape(2, 7),
                                                                  "labels": np.arange(14).reshape(2, 7)}, 1)
        self.assertTrue(np.all(np.isfinite(out["losses"])))
        with self.assertRaisesRegex(ValueError, "position_embedding_type yarn"):
            twin.full_config({**cfg, "mla": MLA})


class MlaForwardTest(unittest.TestCase):
    def test_against_loops(self):
        for index, name in enumerate(CONFIGS):
            for packed in (False, True):
                with self.subTest(config=name, packed=packed):
                    cfg = cfg_of(name)
                    weights = {k: v.astype(np.float64) for k, v in twin.random_params(cfg, 10 + index).items()}
                    S, B, H = cfg["seq_length"], 2, cfg["hidden_size"]
                    h = np.random.default_rng(index).standard_normal((S, B, H))
                    if packed:
                        positions, documents = packed_ids(S, B)
                        got = twin_mla_output(cfg, weights, h, positions, documents)
                    else:
                        positions, documents = np.tile(np.arange(S), (B, 1)), np.zeros((B, S), dtype=np.int64)
                        got = twin_mla_output(cfg, weights, h)
                    expected = ref_mla(h, weights, "decoder.layers.0.", cfg, positions, documents)
                    scale = np.max(np.abs(expected))
                    self.assertLess(np.max(np.abs(got.numpy() - expected)) / scale, 1e-6)

    def test_rope_really_acts(self):
        """The loop reference is not blind to RoPE: rotating the pairs by zero angles changes the output."""
        cfg = cfg_of("no_q_lora_yarn_concentration")
        weights = {k: v.astype(np.float64) for k, v in twin.random_params(cfg, 3).items()}
        h = np.random.default_rng(1).standard_normal((7, 1, 16))
        positions = np.arange(7)[None]
        moved = ref_mla(h, weights, "decoder.layers.0.", cfg, positions + 3, np.zeros((1, 7), dtype=np.int64))
        base = ref_mla(h, weights, "decoder.layers.0.", cfg, positions, np.zeros((1, 7), dtype=np.int64))
        still = ref_mla(h, weights, "decoder.layers.0.", cfg, positions * 0, np.zeros((1, 7), dtype=np.int64))
        np.testing.assert_allclose(moved, base, atol=1e-10)  # relative positions only
        self.assertGreater(np.max(np.abs(still - base)), 1e-3)

    def test_param_names_and_shapes(self):
        cfg = {**cfg_of("layernorm_bias_qk_layernorm"), "num_layers": 2}
        a = "decoder.layers.1.self_attention."
        N, dq, dr, dv = 3, 4, 8, 3
        expected = {
            a + "linear_q_down_proj.weight": (6, 16), a + "q_layernorm.weight": (6,), a + "q_layernorm.bias": (6,),
            a + "linear_q_up_proj.weight": (N * (dq + dr), 6), a + "linear_kv_down_proj.weight": (5 + dr, 16),
            a + "kv_layernorm.weight": (5,), a + "kv_layernorm.bias": (5,),
            a + "linear_kv_up_proj.weight": (N * (dq + dv), 5), a + "linear_proj.weight": (16, N * dv),
            a + "linear_proj.bias": (16,)}
        specs = {n: s for n, s, _ in twin.param_specs(cfg) if n.startswith(a)}
        self.assertEqual(specs, expected)
        no_q_lora = {n: s for n, s, _ in twin.param_specs(cfg_of("no_q_lora_yarn_concentration"))}
        self.assertEqual(no_q_lora["decoder.layers.0.self_attention.linear_q_proj.weight"], (N * (dq + dr), 16))
        self.assertFalse(any("layernorm" in n and "self_attention" in n for n in no_q_lora))
        self.assertFalse(any(n.endswith("_proj.bias") for n in no_q_lora))

    def test_model_forward_and_steps(self):
        for name in ("q_lora_qk_layernorm_yarn_dsv3", "rope_type_rope_half"):
            cfg = {**cfg_of(name), "num_layers": 2,
                   "moe": {"num_experts": 4, "topk": 2, "ffn_hidden_size": 8, "moe_layer_pattern": [0, 1]}}
            rng = np.random.default_rng(2)
            batch = {"tokens": rng.integers(0, 32, (2, 7)), "labels": rng.integers(0, 32, (2, 7))}
            out = twin.run_megatron(cfg, twin.random_params(cfg, 4), batch, 2)
            self.assertTrue(np.all(np.isfinite(out["losses"])))
            self.assertLess(out["losses"][-1], out["losses"][0])


def hf_apply_rotary_pos_emb_interleave(q, k, cos, sin):
    """transformers' DeepSeek-V3 formulation: q, k [B, heads, S, d], cos / sin [B, S, d]."""
    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_yarn_parameters(dim, base, rope_scaling, max_position_embeddings):
    """transformers' _compute_yarn_parameters (inv_freq, attention_factor) for DeepSeek-V3 (head_dim = rope dim)."""
    factor = rope_scaling["factor"]
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    original = rope_scaling.get("original_max_position_embeddings") or max_position_embeddings
    if mscale and mscale_all_dim:
        attention_factor = float(plain_mscale(factor, mscale) / plain_mscale(factor, mscale_all_dim))
    else:
        attention_factor = plain_mscale(factor, 1)
    beta_fast, beta_slow = rope_scaling.get("beta_fast") or 32, rope_scaling.get("beta_slow") or 1

    def corr(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention_factor


class HfAgreementTest(unittest.TestCase):
    def test_interleave_rope_equals_hf(self):
        torch.manual_seed(0)
        S, B, N, dr = 6, 2, 3, 8
        q, k = torch.randn(S, B, N, dr, dtype=torch.float64), torch.randn(S, B, 1, dr, dtype=torch.float64)
        positions = torch.tensor([[0, 1, 2, 3, 4, 5], [4, 0, 1, 2, 7, 3]]).t()
        c = twin.full_config({**BASE, "mla": MLA, "yarn": DSV3_YARN})
        cos, sin = twin_mla.mla_cos_sin(c, S, torch.float64, positions)  # [S, B, dr]
        ours_q, ours_k = twin_mla.apply_mla_rope(q, cos, sin), twin_mla.apply_mla_rope(k, cos, sin)
        hf_q, hf_k = hf_apply_rotary_pos_emb_interleave(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                                        cos.permute(1, 0, 2), sin.permute(1, 0, 2))
        torch.testing.assert_close(ours_q, hf_q.permute(2, 0, 1, 3), rtol=0, atol=1e-15)
        torch.testing.assert_close(ours_k, hf_k.permute(2, 0, 1, 3), rtol=0, atol=1e-15)

    def test_yarn_parameters_equal_hf(self):
        for yarn in (DSV3_YARN, {**DSV3_YARN, "rotary_scaling_factor": 4.0, "mscale": 0.7, "mscale_all_dim": 0.7},
                     {**DSV3_YARN, "original_max_position_embeddings": 64, "beta_fast": 4.0}):
            with self.subTest(yarn=yarn):
                rope_scaling = {"type": "yarn", "factor": yarn["rotary_scaling_factor"], "mscale": yarn["mscale"],
                                "mscale_all_dim": yarn["mscale_all_dim"],
                                "original_max_position_embeddings": yarn["original_max_position_embeddings"],
                                "beta_fast": yarn["beta_fast"], "beta_slow": yarn["beta_slow"]}
                inv_freq, attention_factor = hf_yarn_parameters(64, 1e4, rope_scaling, 163840)
                full = twin_mla.full_yarn_config(yarn)
                self.assertTrue(torch.equal(twin_mla.yarn_inv_freq(64, 1e4, full, True), inv_freq))
                self.assertAlmostEqual(twin_mla.concentration_factor(full), attention_factor, 14)
                c = twin.full_config({**BASE, "mla": {"qk_head_dim": 128, "qk_pos_emb_head_dim": 64}, "yarn": yarn})
                hf_scaling = (128 + 64) ** -0.5 * plain_mscale(yarn["rotary_scaling_factor"],
                                                              yarn["mscale_all_dim"]) ** 2
                self.assertAlmostEqual(twin_mla.mla_softmax_scale(c), hf_scaling, 14)


class GradcheckTest(unittest.TestCase):
    def test_mla_gradcheck(self):
        for name in ("q_lora_qk_layernorm_yarn_dsv3", "layernorm_bias_qk_layernorm", "no_q_lora_qk_layernorm_rope"):
            with self.subTest(config=name):
                cfg = {**cfg_of(name), "hidden_size": 6, "seq_length": 4}
                cfg["mla"] = {**cfg["mla"], "kv_lora_rank": 3, "qk_head_dim": 2, "qk_pos_emb_head_dim": 4,
                              "v_head_dim": 2, "q_lora_rank": min(cfg["mla"]["q_lora_rank"], 3)}
                c = twin.full_config(cfg)
                names = [n for n, _, _ in twin.param_specs(cfg) if ".self_attention." in n and ".layers.0." in n]
                weights = twin.random_params(cfg, 7)
                inputs = [torch.tensor(weights[n], dtype=torch.float64, requires_grad=True) for n in names]
                h = torch.randn(4, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3),
                                requires_grad=True)
                positions = torch.tensor([[0, 1, 0, 1], [2, 3, 4, 5]]).t()
                cos, sin = twin_mla.mla_cos_sin(c, 4, torch.float64, positions)
                allowed = twin.attention_mask(4, torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]]))[:, None]

                def f(h, *tensors):
                    return twin_mla.mla_attention(h, dict(zip(names, tensors)), "decoder.layers.0.", c, cos, sin,
                                                  allowed, twin._norm)
                self.assertTrue(torch.autograd.gradcheck(f, [h] + inputs, eps=1e-6, atol=1e-7, rtol=1e-5))


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main()
