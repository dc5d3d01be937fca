"""HF-style forward of MixtralForCausalLM ("mixtral") and Qwen3MoeForCausalLM ("qwen3_moe"), built only from an export
folder's config.json and tensors under HF's checkpoint names, written from HF transformers' modeling semantics (not
from moecore's C++ or its Megatron-named twin):

  attention: as Llama (Mixtral) / Qwen3 (q_norm, k_norm: RMSNorm over head_dim before RoPE), no biases;
  sparse block: router_logits = h W_gate^T; p = softmax(router_logits) over all experts in fp32;
                top-k of p (k = num_experts_per_tok); Mixtral always renormalises the k values to sum 1,
                Qwen3-MoE only with norm_topk_prob; out = sum_k p_k * down(silu(gate(h)) * up(h)) over the chosen
                experts (Mixtral names gate/up/down w1/w3/w2 under block_sparse_moe.);
  Qwen3-MoE layer i is sparse iff i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0,
  else a dense MLP of width intermediate_size.
Usage: import twin_hf_moe; twin_hf_moe.hf_moe_forward(config, tensors, tokens_BS) -> logits [B, S, V].
"""
import torch
import torch.nn.functional as F

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")


def _rms_norm(x, weight, eps):
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _swiglu_mlp(h, w, gate, up, down):
    return F.linear(F.silu(F.linear(h, w[gate])) * F.linear(h, w[up]), w[down])


def is_sparse_layer(config, layer):
    if config["model_type"] == "mixtral":
        return True
    step = config.get("decoder_sparse_step", 1)
    return (layer not in (config.get("mlp_only_layers") or []) and config.get("num_experts", 0) > 0
            and (layer + 1) % step == 0)


def sparse_moe_block(config, w, prefix, h_TH):
    """One Mixtral / Qwen3-MoE sparse block on h_TH [T, H] -> [T, H]."""
    mixtral = config["model_type"] == "mixtral"
    base = prefix + ("block_sparse_moe." if mixtral else "mlp.")
    E = config["num_local_experts"] if mixtral else config["num_experts"]
    k = config["num_experts_per_tok"]
    renormalise = True if mixtral else bool(config.get("norm_topk_prob", False))
    probs_TE = torch.softmax(F.linear(h_TH, w[base + "gate.weight"]), dim=-1, dtype=torch.float32)
    top_p_Tk, top_i_Tk = torch.topk(probs_TE, k, dim=-1)
    if renormalise:
        top_p_Tk = top_p_Tk / top_p_Tk.sum(dim=-1, keepdim=True)
    top_p_Tk = top_p_Tk.to(h_TH.dtype)
    out_TH = torch.zeros_like(h_TH)
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for e in range(E):
        token_idx, slot = torch.where(top_i_Tk == e)
        if token_idx.numel() == 0:
            continue
        x = base + f"experts.{e}."
        y = _swiglu_mlp(h_TH[token_idx], w, *(x + n + ".weight" for n in names))
        out_TH.index_add_(0, token_idx, y * top_p_Tk[token_idx, slot, None])
    return out_TH


def hf_moe_forward(config, tensors, tokens_BS):
    """Logits [B, S, V] of a MixtralForCausalLM / Qwen3MoeForCausalLM as HF's modeling code computes them."""
    model_type = config["model_type"]
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type}")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError("hidden_act must be silu")
    if config.get("attention_bias", False):
        raise ValueError("attention_bias is not supported here")
    w = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}
    H = config["hidden_size"]
    N = config["num_attention_heads"]
    G = config.get("num_key_value_heads") or N
    d = config.get("head_dim") or H // N
    eps = config["rms_norm_eps"]
    theta = config.get("rope_theta", 1e6 if model_type == "mixtral" else 10000.0)
    B, S = tokens_BS.shape

    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)  # [S, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, S, d]
    mask = torch.full((S, S), float("-inf")).triu(1)

    x = w["model.embed_tokens.weight"][tokens_BS]  # [B, S, H]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        residual = x
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(B, S, N, d)
        k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(B, S, G, d)
        v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(B, S, G, d).transpose(1, 2)
        if model_type == "qwen3_moe":
            q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k[:, :, None].expand(B, G, N // G, S, d).reshape(B, N, S, d)
        v = v[:, :, None].expand(B, G, N // G, S, d).reshape(B, N, S, d)
        probs = torch.softmax((q @ k.transpose(2, 3)) * d ** -0.5 + mask, dim=-1, dtype=torch.float32)
        attn = (probs @ v).transpose(1, 2).reshape(B, S, N * d)
        x = residual + F.linear(attn, w[p + "self_attn.o_proj.weight"])
        residual = x
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if is_sparse_layer(config, i):
            mlp = sparse_moe_block(config, w, p, h.reshape(B * S, H)).view(B, S, H)
        else:
            mlp = _swiglu_mlp(h, w, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight")
        x = residual + mlp
    x = _rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if config.get("tie_word_embeddings", False) else w["lm_head.weight"]
    return x @ head.t()
