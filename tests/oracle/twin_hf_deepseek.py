"""HF-style forward of DeepseekV3ForCausalLM ("deepseek_v3"), built only from an export folder's config.json and
tensors under HF's checkpoint names, written from HF transformers' modeling semantics (models/deepseek_v3/
modeling_deepseek_v3.py, modeling_rope_utils._compute_yarn_parameters), not from moecore's C++ or its Megatron-named
twin:

  attention (DeepseekV3Attention, eager): q = q_b_proj(q_a_layernorm(q_a_proj(h))), or q_proj(h) when q_lora_rank is
    null; [k_latent | k_rot] = kv_a_proj_with_mqa(h); [k_nope | v] per head = kv_b_proj(kv_a_layernorm(k_latent));
    q_a_layernorm / kv_a_layernorm are RMSNorms with HF's default eps 1e-6 (not rms_norm_eps); q_a_proj,
    kv_a_proj_with_mqa and o_proj carry biases with attention_bias. RoPE on q_rot and on the single k_rot (one per
    token, broadcast to every head): with rope_interleave (default true) q / k are first permuted
    view(d/2, 2).transpose -> [evens | odds] (apply_rotary_pos_emb_interleave), then rotate-half. Scale
    qk_head_dim^-0.5 (qk_head_dim = qk_nope + qk_rope), times get_mscale(factor, mscale_all_dim)^2 when rope scaling is
    set and mscale_all_dim is truthy (factor: the rope_scaling's own value). Softmax in fp32.
  rotary table (DeepseekV3RotaryEmbedding): dim = qk_rope_head_dim (config.head_dim); default rope: inv_freq =
    1 / theta^(arange(0, dim, 2) / dim); yarn: _compute_yarn_parameters, where a rope_scaling holding
    original_max_position_embeddings REPLACES factor by max_position_embeddings / original_max_position_embeddings
    (for the frequencies and the attention factor, not for the softmax scale), beta_fast / beta_slow default 32 / 1,
    ramp bounds floored / ceiled unless truncate is false, attention_factor = get_mscale(f, mscale) /
    get_mscale(f, mscale_all_dim) when both are truthy, else get_mscale(f) (unless attention_factor is given);
    cos / sin = cos / sin(emb) * attention_factor, in fp32.
  MoE (DeepseekV3MoE) on layers i >= first_k_dense_replace, dense DeepseekV3MLP (intermediate_size) before:
    router (DeepseekV3TopkRouter, noaux_tc): s = sigmoid(h W_gate^T) in fp32; choice = s + e_score_correction_bias;
    group score = sum of the top-2 choice values of each of n_group groups; keep topk_group groups (others -> 0.0);
    top num_experts_per_tok of choice; weights = s (unbiased) at those experts, / (sum + 1e-20) with norm_topk_prob,
    * routed_scaling_factor; out = sum_k w_k expert_k(h) + shared_experts(h) (width moe_intermediate_size *
    n_shared_experts), experts as silu(gate(h)) * up(h) -> down.
  Layers model.layers.{num_hidden_layers + k} (multi-token prediction) are ignored, as transformers ignores them.
Both config.json forms are read: rope_scaling {type | rope_type, factor, ...} with rope_theta, or rope_parameters
{rope_type, rope_theta, factor, ...}.
Usage: import twin_hf_deepseek; twin_hf_deepseek.hf_deepseek_forward(config, tensors, tokens_BS) -> logits [B, S, V].
"""
import math

import torch
import torch.nn.functional as F

HF_RMS_NORM_DEFAULT_EPS = 1e-6  # DeepseekV3RMSNorm's default, used by q_a_layernorm / kv_a_layernorm


def _rms_norm(x, weight, eps):
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _mlp(h, w, prefix):
    return F.linear(F.silu(F.linear(h, w[prefix + "gate_proj.weight"])) * F.linear(h, w[prefix + "up_proj.weight"]),
                    w[prefix + "down_proj.weight"])


def _get_mscale(scale, mscale=1):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_settings(config):
    """(rope_type, theta, scaling dict or None) from either config.json form."""
    params = config.get("rope_parameters")
    if params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        return rope_type, params.get("rope_theta", config.get("rope_theta", 10000.0)), \
            (params if rope_type != "default" else None)
    scaling = config.get("rope_scaling")
    if scaling:
        return scaling.get("rope_type", scaling.get("type")), config.get("rope_theta", 10000.0), scaling
    return "default", config.get("rope_theta", 10000.0), None


def rotary_inv_freq(config):
    """(inv_freq float32 [dim / 2], attention_factor) as DeepseekV3RotaryEmbedding's rope_init_fn computes them."""
    rope_type, base, scaling = rope_settings(config)
    dim = int(config["qk_rope_head_dim"] * config.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if rope_type != "yarn":
        raise ValueError(f"rope type {rope_type} is not supported here")
    factor = scaling["factor"]
    if "original_max_position_embeddings" in scaling:
        original = scaling["original_max_position_embeddings"]
        factor = config["max_position_embeddings"] / original
    else:
        original = config["max_position_embeddings"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _get_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


def softmax_scale(config):
    scale = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    _, _, scaling = rope_settings(config)
    if scaling is not None:
        mscale_all_dim = scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:
            scale = scale * _get_mscale(scaling["factor"], mscale_all_dim) ** 2
    return scale


def topk_router(config, w, prefix, h_TH):
    """(topk_indices [T, k], topk_weights [T, k]) of DeepseekV3TopkRouter."""
    E, k = config["n_routed_experts"], config["num_experts_per_tok"]
    n_group, topk_group = config.get("n_group", 1), config.get("topk_group", 1)
    scores = F.linear(h_TH.to(torch.float32), w[prefix + "mlp.gate.weight"].to(torch.float32)).sigmoid()
    bias = w.get(prefix + "mlp.gate.e_score_correction_bias")
    choice = scores + (bias.to(torch.float32)[None] if bias is not None else 0.0)
    group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    choice = choice.masked_fill(~score_mask.bool(), 0.0)
    topk_indices = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if config.get("norm_topk_prob", True):
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_indices, topk_weights * config.get("routed_scaling_factor", 1.0)


def moe_block(config, w, prefix, h_TH):
    indices, weights = topk_router(config, w, prefix, h_TH)
    # HF accumulates in the router weights' fp32 (the expert outputs of a 16-bit model are promoted); float64 here
    # when the model runs in float64
    out = torch.zeros_like(h_TH, dtype=torch.promote_types(h_TH.dtype, weights.dtype))
    for e in range(config["n_routed_experts"]):
        token_idx, slot = torch.where(indices == e)
        if token_idx.numel() == 0:
            continue
        y = _mlp(h_TH[token_idx], w, prefix + f"mlp.experts.{e}.")
        out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
    out = out.to(h_TH.dtype)
    if config.get("n_shared_experts"):
        out = out + _mlp(h_TH, w, prefix + "mlp.shared_experts.")
    return out


def hf_deepseek_forward(config, tensors, tokens_BS, dtype=torch.float32):
    """Logits [B, S, V] of a DeepseekV3ForCausalLM as HF's modeling code computes them (eager attention)."""
    if config["model_type"] != "deepseek_v3":
        raise ValueError(f"unsupported model_type {config['model_type']}")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError("hidden_act must be silu")
    w = {k: torch.as_tensor(v).to(dtype) for k, v in tensors.items()}
    N = config["num_attention_heads"]
    dn, dr, dv = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    kv_lora, q_lora = config["kv_lora_rank"], config.get("q_lora_rank")
    eps = config.get("rms_norm_eps", 1e-6)
    bias = config.get("attention_bias", False)
    B, S = tokens_BS.shape

    def lin(x, name, has_bias=False):
        return F.linear(x, w[name + ".weight"], w[name + ".bias"] if has_bias else None)

    inv_freq, attention_factor = rotary_inv_freq(config)
    freqs = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = (emb.cos() * attention_factor).to(dtype)[None, None]  # [1, 1, S, dr]
    sin = (emb.sin() * attention_factor).to(dtype)[None, None]
    interleave = config.get("rope_interleave", True)
    scale = softmax_scale(config)
    mask = torch.full((S, S), float("-inf"), dtype=dtype).triu(1)

    def rope(t):  # [B, heads, S, dr]
        if interleave:
            b, h, s, d = t.shape
            t = t.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
        return t * cos + _rotate_half(t) * sin

    x = w["model.embed_tokens.weight"][tokens_BS]  # [B, S, H]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        residual = x
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        if q_lora is None:
            q = lin(h, a + "q_proj")
        else:
            q = lin(_rms_norm(lin(h, a + "q_a_proj", bias), w[a + "q_a_layernorm.weight"], HF_RMS_NORM_DEFAULT_EPS),
                    a + "q_b_proj")
        q = q.view(B, S, N, dn + dr).transpose(1, 2)
        q_pass, q_rot = q[..., :dn], q[..., dn:]
        compressed = lin(h, a + "kv_a_proj_with_mqa", bias)
        k_pass, k_rot = compressed[..., :kv_lora], compressed[..., kv_lora:]
        kv = lin(_rms_norm(k_pass, w[a + "kv_a_layernorm.weight"], HF_RMS_NORM_DEFAULT_EPS), a + "kv_b_proj")
        kv = kv.view(B, S, N, dn + dv).transpose(1, 2)
        k_pass, v = kv[..., :dn], kv[..., dn:]
        k_rot = rope(k_rot.reshape(B, 1, S, dr)).expand(B, N, S, dr)
        query = torch.cat((q_pass, rope(q_rot)), dim=-1)
        key = torch.cat((k_pass, k_rot), dim=-1)
        probs = torch.softmax(query @ key.transpose(2, 3) * scale + mask, dim=-1, dtype=torch.float32).to(dtype)
        attn = (probs @ v).transpose(1, 2).reshape(B, S, N * dv)
        x = residual + lin(attn, a + "o_proj", bias)
        residual = x
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if i >= config.get("first_k_dense_replace", 0):
            mlp = moe_block(config, w, p, h.reshape(B * S, -1)).view(B, S, -1)
        else:
            mlp = _mlp(h, w, p + "mlp.")
        x = residual + mlp
    x = _rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if config.get("tie_word_embeddings", False) else w["lm_head.weight"]
    return x @ head.t()
