"""Multi-latent attention (MLA) and YaRN rotary embeddings for the PyTorch twin (twin.py), written from Megatron-LM's
specification (megatron/core/transformer/multi_latent_attention.py, models/common/embeddings/
yarn_rotary_pos_embedding.py, rotary_pos_embedding.py, rope_utils.py, models/gpt/gpt_model.py), not from the C++ code.

Config (twin.py's JSON, the C++ ModelConfig names):
  "mla": null, or {q_lora_rank (0: none, linear_q_proj), kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim,
                   rope_type "yarn" | "rope"}                                        (MLA_DEFAULTS)
  "yarn": {rotary_scaling_factor, mscale, mscale_all_dim, original_max_position_embeddings, beta_fast, beta_slow,
           correction_range_round_to_int}                                           (YARN_DEFAULTS)
  "position_embedding_type": "yarn" (standard attention only).

YaRN frequencies (YarnRotaryEmbedding.get_emb; float32 throughout, as Megatron builds them):
  inv_extra = 1 / base^(arange(0, dim, 2) / dim);  inv_inter = 1 / (s * base^(arange(0, dim, 2) / dim))
  corr(r) = dim ln(L_orig / (2 pi r)) / (2 ln base);  low = max(floor(corr(beta_fast)), 0),
  high = min(ceil(corr(beta_slow)), dim - 1) (floor / ceil only with correction_range_round_to_int); low == high:
  high += 0.001;  ramp = clamp((arange(dim / 2) - low) / (high - low), 0, 1);  mask = 1 - ramp
  inv_freq = inv_inter (1 - mask) + inv_extra mask;  angles = position * inv_freq;  emb = cat(angles, angles)
  concentration factor c = get_mscale(s, mscale) / get_mscale(s, mscale_all_dim), get_mscale(s, m) = 1 if s <= 1
  else 0.1 m ln(s) + 1.
Where YaRN is used:
  * MLA with rope_type "yarn": dim = qk_pos_emb_head_dim, rotary_percent ignored, cos / sin multiplied by c.
    correction_range_round_to_int is always True there (MultiLatentAttention does not pass the config's value).
  * standard attention with position_embedding_type "yarn" (GPTModel's yarn branch): dim = kv_channels (rotary_percent
    ignored: YarnRotaryEmbedding's dim is kv_channels); the config's correction_range_round_to_int is used. GPTModel
    discards the factor YarnRotaryEmbedding returns (`rotary_pos_emb, _ = self.rotary_pos_emb(..)`), but Attention
    multiplies cos / sin by the same c itself (attention.py: apply_rotary_pos_emb(..., mscale=
    self._yarn_concentration_factor), from the config's yarn_* fields that argument_utils sets for yarn), so c applies.
  * MLA with rope_type "rope": RotaryEmbedding(qk_pos_emb_head_dim, rotary_percent, rotary_base), c = 1.

MLA attention per layer, h = input_layernorm(x) [S, B, H], N heads, dq = qk_head_dim, dr = qk_pos_emb_head_dim,
dv = v_head_dim (no biases on the q / kv projections; linear_proj's bias per add_bias_linear):
  q = linear_q_up_proj(q_layernorm(linear_q_down_proj(h)))   (q_layernorm only with qk_layernorm)
      or linear_q_proj(h) when q_lora_rank is 0;  q -> [S, B, N, dq + dr], per head [q_nope | q_rope]
  [latent | k_rope] = linear_kv_down_proj(h);  kv = linear_kv_up_proj(kv_layernorm(latent)) (kv_layernorm only with
      qk_layernorm) -> [S, B, N, dq + dv], per head [k_nope | v]
  RoPE on q_rope and on k_rope (ONE rope key per token, then broadcast to every head), MLA layout: the rotated part
      t (the first rot_dim channels) becomes cat(t[..., 0::2], t[..., 1::2]) and then t cos + rotate_half(t) sin
  query = [q_nope | rope(q_rope)], key = [k_nope | rope(k_rope)], causal (block-diagonal with documents) softmax
      attention with scale get_mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(dq + dr) (also for rope_type
      "rope"), context [S, B, N * dv] -> linear_proj.
q_layernorm / kv_layernorm use the model's normalization (RMSNorm, or LayerNorm with a bias) and norm_epsilon.
Positions: 0..S-1, or the packed-sequence position_ids (twin.py's docstring), angles = position * inv_freq in float32.
"""
import math

import torch

MLA_DEFAULTS = {"q_lora_rank": 0, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
                "v_head_dim": 128, "rope_type": "yarn"}
YARN_DEFAULTS = {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                 "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                 "correction_range_round_to_int": True}


def _with_defaults(given, defaults, what):
    unknown = set(given) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {what} config fields {sorted(unknown)}")
    return {**defaults, **given}


def full_mla_config(mla):
    """None stays None; otherwise MLA_DEFAULTS updated by `mla` (unknown fields rejected)."""
    if mla is None:
        return None
    out = _with_defaults(mla, MLA_DEFAULTS, "mla")
    if out["rope_type"] not in ("yarn", "rope"):
        raise ValueError(f"mla.rope_type must be yarn or rope, got {out['rope_type']}")
    if out["qk_pos_emb_head_dim"] % 2:
        raise ValueError("mla.qk_pos_emb_head_dim must be even")
    return out


def full_yarn_config(yarn):
    return _with_defaults(yarn or {}, YARN_DEFAULTS, "yarn")


# ----------------------------------------------------------------------------------------------- YaRN


def get_mscale(scale, mscale):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def concentration_factor(yarn):
    s = yarn["rotary_scaling_factor"]
    return get_mscale(s, yarn["mscale"]) / get_mscale(s, yarn["mscale_all_dim"])


def correction_range(dim, base, yarn, round_to_int):
    """(low, high) of YaRN's ramp, as _yarn_find_correction_range computes them (Python floats / ints)."""
    def corr(rotations):
        return dim * math.log(yarn["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / \
            (2 * math.log(base))
    low, high = corr(yarn["beta_fast"]), corr(yarn["beta_slow"])
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim, base, yarn, round_to_int):
    """float32 [dim / 2]: YaRN's blended inverse frequencies, in Megatron's float32 operation order."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_extra = 1.0 / (base ** exponents)
    inv_inter = 1.0 / (yarn["rotary_scaling_factor"] * base ** exponents)
    low, high = correction_range(dim, base, yarn, round_to_int)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    mask = 1.0 - ramp
    return inv_inter * (1 - mask) + inv_extra * mask


def rope_inv_freq(dim, rotary_percent, base):
    """float32: RotaryEmbedding's inverse frequencies over int(dim * rotary_percent) channels."""
    rot = int(dim * rotary_percent) if rotary_percent < 1.0 else dim
    return 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))


def cos_sin(inv_freq, S, dtype, positions_SB=None, scale=1.0):
    """cos / sin [S, rot] (positions 0..S-1) or [S, B, rot] (given positions), angles in float32, times scale."""
    if positions_SB is None:
        angles = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
    else:
        angles = positions_SB.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1).to(dtype)
    return emb.cos() * scale, emb.sin() * scale


def standard_yarn_cos_sin(c, S, dtype, positions_SB=None):
    """position_embedding_type yarn (standard attention): dim = kv_channels, cos / sin times the concentration factor.
    Returns (cos, sin, rot_dim) for twin._apply_rope."""
    yarn = c["yarn"]
    inv_freq = yarn_inv_freq(c["kv_channels"], c["rotary_base"], yarn, yarn["correction_range_round_to_int"])
    cos, sin = cos_sin(inv_freq, S, dtype, positions_SB, concentration_factor(yarn))
    return cos, sin, 2 * inv_freq.numel()


def mla_cos_sin(c, S, dtype, positions_SB=None):
    """The rotary table of MLA's rope sub-vector: (cos, sin) with the concentration factor (yarn) or plain (rope)."""
    m, yarn = c["mla"], c["yarn"]
    dr = m["qk_pos_emb_head_dim"]
    if m["rope_type"] == "yarn":
        inv_freq = yarn_inv_freq(dr, c["rotary_base"], yarn, True)
        return cos_sin(inv_freq, S, dtype, positions_SB, concentration_factor(yarn))
    return cos_sin(rope_inv_freq(dr, c["rotary_percent"], c["rotary_base"]), S, dtype, positions_SB)


def mla_softmax_scale(c):
    m, yarn = c["mla"], c["yarn"]
    return get_mscale(yarn["rotary_scaling_factor"], yarn["mscale_all_dim"]) ** 2 / \
        math.sqrt(m["qk_head_dim"] + m["qk_pos_emb_head_dim"])


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_mla_rope(t, cos, sin):
    """MLA-interleaved RoPE on t [S, B, heads, dr]; cos / sin [S, rot] or [S, B, rot] (rot <= dr: the first rot
    channels are de-interleaved and rotated, the rest pass through)."""
    rot = cos.shape[-1]
    cs = cos[:, None, None, :] if cos.dim() == 2 else cos[:, :, None, :]
    sn = sin[:, None, None, :] if sin.dim() == 2 else sin[:, :, None, :]
    part, rest = t[..., :rot], t[..., rot:]
    part = torch.cat((part[..., 0::2], part[..., 1::2]), dim=-1)
    return torch.cat((part * cs + _rotate_half(part) * sn, rest), dim=-1)


# ----------------------------------------------------------------------------------------------- MLA


def mla_param_specs(prefix, c, linear, norm):
    """Appends the MLA attention parameters of one layer via twin.param_specs' helpers linear(name, out, in, bias)
    and norm(name, size)."""
    m = c["mla"]
    H, N = c["hidden_size"], c["num_attention_heads"]
    dq, dr, dv = m["qk_head_dim"], m["qk_pos_emb_head_dim"], m["v_head_dim"]
    a = prefix + "self_attention."
    if m["q_lora_rank"] > 0:
        linear(a + "linear_q_down_proj", m["q_lora_rank"], H, False)
        if c["qk_layernorm"]:
            norm(a + "q_layernorm", m["q_lora_rank"])
        linear(a + "linear_q_up_proj", N * (dq + dr), m["q_lora_rank"], False)
    else:
        linear(a + "linear_q_proj", N * (dq + dr), H, False)
    linear(a + "linear_kv_down_proj", m["kv_lora_rank"] + dr, H, False)
    if c["qk_layernorm"]:
        norm(a + "kv_layernorm", m["kv_lora_rank"])
    linear(a + "linear_kv_up_proj", N * (dq + dv), m["kv_lora_rank"], False)
    linear(a + "linear_proj", H, N * dv, c["add_bias_linear"])


def mla_qkv(h, params, prefix, c, cos, sin, norm_fn):
    """query, key [S, B, N, dq + dr] (RoPE applied) and value [S, B, N, dv] of one MLA layer. norm_fn(x, params,
    name, c) is the twin's normalization."""
    m = c["mla"]
    S, B = h.shape[:2]
    N = c["num_attention_heads"]
    dq, dr, dv, kv_lora = m["qk_head_dim"], m["qk_pos_emb_head_dim"], m["v_head_dim"], m["kv_lora_rank"]
    a = prefix + "self_attention."
    if m["q_lora_rank"] > 0:
        cq = h @ params[a + "linear_q_down_proj.weight"].t()
        if c["qk_layernorm"]:
            cq = norm_fn(cq, params, a + "q_layernorm", c)
        q = cq @ params[a + "linear_q_up_proj.weight"].t()
    else:
        q = h @ params[a + "linear_q_proj.weight"].t()
    q = q.view(S, B, N, dq + dr)
    ckv = h @ params[a + "linear_kv_down_proj.weight"].t()
    latent, k_rope = ckv[..., :kv_lora], ckv[..., kv_lora:]
    if c["qk_layernorm"]:
        latent = norm_fn(latent, params, a + "kv_layernorm", c)
    kv = (latent @ params[a + "linear_kv_up_proj.weight"].t()).view(S, B, N, dq + dv)
    q_rope = apply_mla_rope(q[..., dq:], cos, sin)
    k_rope = apply_mla_rope(k_rope[:, :, None, :], cos, sin)  # one rope key per token
    query = torch.cat((q[..., :dq], q_rope), dim=-1)
    key = torch.cat((kv[..., :dq], k_rope.expand(S, B, N, dr)), dim=-1)
    return query, key, kv[..., dq:]


def mla_attention(h, params, prefix, c, cos, sin, allowed, norm_fn):
    """linear_proj(attention) of one MLA layer: h [S, B, H] (input_layernorm applied) -> [S, B, H]. allowed: the
    twin's mask, [S, S] or [B, 1, S, S] (True where query q may read key k)."""
    S, B = h.shape[:2]
    N, dv = c["num_attention_heads"], c["mla"]["v_head_dim"]
    query, key, value = mla_qkv(h, params, prefix, c, cos, sin, norm_fn)
    q_BNSd, k_BNSd, v_BNSd = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    scores = (q_BNSd @ k_BNSd.transpose(-1, -2)) * mla_softmax_scale(c)
    scores = scores.masked_fill(~allowed, float("-inf"))
    context = (torch.softmax(scores, dim=-1) @ v_BNSd).permute(2, 0, 1, 3).reshape(S, B, N * dv)
    a = prefix + "self_attention.linear_proj"
    return torch.nn.functional.linear(context, params[a + ".weight"], params.get(a + ".bias"))
