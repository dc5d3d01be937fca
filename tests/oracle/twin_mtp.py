"""Multi-Token Prediction for the PyTorch twin (twin.py), written from Megatron's specification
(megatron/core/transformer/multi_token_prediction.py), not from the C++ code.

Config: "mtp_num_layers" D (0: none), "mtp_loss_scaling_factor" (0.1). Depth k (0-based) has the parameters
  mtp.layers.{k}.enorm / hnorm / final_layernorm (norms of config.normalization), mtp.layers.{k}.eh_proj.weight [H, 2H],
  mtp.layers.{k}.mtp_model_layer.* (the last decoder layer's parameters under this prefix: MoE if that layer is).
Forward, with h the decoder's output after decoder.final_layernorm and ids / labels / mask shifted left one more
place per depth (the last position gets 0):
  e = word_embeddings[ids];  h = final_layernorm(layer(eh_proj(cat(enorm(e), hnorm(h)))))
  loss_k = sum(CE(h @ W_out^T, labels) * mask) / max(sum(mask), 1)
The weighted sum (factor / D) * sum_k loss_k is attached to the main hidden states with an autoscaler whose backward
gives it the gradient aux_grad_scale (Megatron's MTPLossAutoScaler with the main loss's 1 / num_microbatches): the
reported loss stays the lm loss. The depth layers' MoE routers keep their state in moe_state[L + k] and report their
info under layer L + k (Megatron logs an MTP router after the decoder's layers).
"""
import torch
import torch.nn.functional as F

import twin_mla
import twin_moe


def param_specs(c, specs):
    """The depths' (name, shape, kind), given the decoder's `specs` (decoder layer L - 1 is copied)."""
    L, H = c["num_layers"], c["hidden_size"]
    last = f"decoder.layers.{L - 1}."
    layer = [(name[len(last):], shape, kind) for name, shape, kind in specs if name.startswith(last)]
    out = []

    def norm(prefix):
        out.append((prefix + ".weight", (H,), "norm_weight"))
        if c["normalization"] == "LayerNorm":
            out.append((prefix + ".bias", (H,), "norm_bias"))

    for k in range(c["mtp_num_layers"]):
        p = f"mtp.layers.{k}."
        norm(p + "enorm")
        norm(p + "hnorm")
        out.append((p + "eh_proj.weight", (H, 2 * H), "weight"))
        out.extend((p + "mtp_model_layer." + name, shape, kind) for name, shape, kind in layer)
        norm(p + "final_layernorm")
    return out


def roll_left(x_SB):
    """Megatron's roll_tensor(shifts=-1) along the sequence: [S, B] shifted one place earlier, the last row 0."""
    out = torch.roll(x_SB, shifts=-1, dims=0)
    out[-1] = 0
    return out


def _layer(x, params, p, c, layer_index, ctx):
    """One pre-norm transformer layer (standard or multi-latent attention, then MLP or MoE) under prefix p, as
    twin.megatron_forward's decoder layers."""
    import twin  # the twin's helpers (imported here: twin imports this module)

    h = twin._norm(x, params, p + "input_layernorm", c)
    if c["mla"] is not None:
        mla_cos, mla_sin = ctx["mla_rope"]
        x = x + twin_mla.mla_attention(h, params, p, c, mla_cos, mla_sin, ctx["allowed"], twin._norm)
    else:
        cos, sin, rot_dim = ctx["rope"] if ctx["rope"] is not None else (None, None, 0)
        x = x + twin._standard_attention(h, params, p, c, cos, sin, rot_dim, ctx["allowed"])
    h = twin._norm(x, params, p + "pre_mlp_layernorm", c)
    if twin.is_moe_layer(c, c["num_layers"] - 1):
        state = ctx["moe_state"].setdefault(layer_index, twin_moe.RouterState(c["moe"]["num_experts"]))
        y, info = twin_moe.moe_layer_forward(h, params, p, c["moe"], lambda t: twin._activation(t, c), state,
                                             ctx["training"], ctx["aux_grad_scale"])
        ctx["moe_info"]["layers"][layer_index] = info
        for aux in info["aux_losses"]:
            ctx["moe_info"]["aux_total"] = ctx["moe_info"]["aux_total"] + aux
        return x + y
    h = twin._activation(twin._linear(h, params, p + "mlp.linear_fc1"), c)
    return x + twin._linear(h, params, p + "mlp.linear_fc2")


def attach(x, params, c, tokens_SB, labels_SB, mask_SB, ctx):
    """x: the decoder's normed output [S, B, H]. Returns (x with the weighted MTP loss attached, [loss_k floats]).
    ctx: {"rope": (cos, sin, rot_dim) or None, "mla_rope": (cos, sin) of MLA or None, "allowed": attention mask,
    "moe_state": dict, "moe_info": dict, "training": bool, "aux_grad_scale": float}."""
    import twin

    D, L = c["mtp_num_layers"], c["num_layers"]
    w_emb = params["embedding.word_embeddings.weight"]
    w_out = params["output_layer.weight" if c["untie_embeddings_and_output_weights"] else
                   "embedding.word_embeddings.weight"]
    tokens, labels, mask = tokens_SB, labels_SB, mask_SB.to(x.dtype)
    h, total, losses = x, None, []
    for k in range(D):
        tokens, labels, mask = roll_left(tokens), roll_left(labels), roll_left(mask)
        p = f"mtp.layers.{k}."
        e = w_emb[tokens]
        z = F.linear(torch.cat((twin._norm(e, params, p + "enorm", c), twin._norm(h, params, p + "hnorm", c)), -1),
                     params[p + "eh_proj.weight"])
        h = twin._norm(_layer(z, params, p + "mtp_model_layer.", c, L + k, ctx), params, p + "final_layernorm", c)
        logits = h @ w_out.t()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(), reduction="none")
        loss_k = (ce * mask.reshape(-1)).sum() / mask.sum().clamp(min=1)
        losses.append(float(loss_k))
        total = loss_k if total is None else total + loss_k
    weighted = total * (c["mtp_loss_scaling_factor"] / D)
    return twin_moe.AuxLossAutoScaler.apply(x, weighted, ctx["aux_grad_scale"]), losses
