"""PyTorch twin of moecore's dense GPT model (Megatron-LM's architecture and parameter names), written from the
specification, not from the C++ code. Run with /usr/bin/python3 (Debian's torch + numpy).

Two independent forwards live here:
  * `megatron_forward`: the Megatron-named model ([S, B, H] activations, fused grouped qkv, fc1 = [gate | up]);
  * `hf_forward`: a Llama / Qwen3 forward built only from an HF export folder (config.json + model.safetensors),
    computed the way HF transformers' modeling code does ([B, S, H], separate q/k/v, repeat_kv, RMSNorm in fp32).

Model (pre-norm):  x = emb(tokens) [+ pos_emb];  per layer  x += proj(attn(qkv(norm1(x))));  x += fc2(act(fc1(norm2(x))))
then final norm, logits = x @ W_out^T (W_out = word embeddings unless untied), loss = sum(CE * mask) / sum(mask).
Dropout is 0 here (the parity runs use dropout 0).
Packed sequences (optional, megatron_forward / run_megatron / the batch file): position_ids [B, S] (int) replace the
positions 0..S-1 wherever the model reads positions: the learned position table (Megatron's LanguageModelEmbedding
reads position_ids) and RoPE's angles (position_ids[b, s] * inv_freq). Megatron's bshd RoPE ignores position_ids and
its THD RoPE restarts at 0 in every packed sequence, i.e. uses --reset-position-ids' positions; to reproduce the bshd
behaviour pass no position_ids to a RoPE model. document_ids [B, S] (int, Megatron's --reset-attention-mask as one id
per token: moecore's data/packed_sequences.h) turn the causal mask into a causal block-diagonal one: query q attends
to key k iff k <= q and document_ids[b, k] == document_ids[b, q] (a dense [B, S, S] mask: the reference).
Without them: positions 0..S-1 and one document per sample, exactly as before.
MoE (config "moe", see twin_moe.py): on layers with moe_layer_pattern[i] = 1 the MLP is twin_moe.moe_layer_forward
(router, experts, shared experts) with Megatron's aux / z losses attached to the graph (the reported loss stays the lm
loss); per-layer router state (expert bias, global aux counts) lives in new_moe_state(cfg) and is advanced once per
global batch by finish_global_batch(cfg, state).
Multi-latent attention (config "mla") and YaRN rotary embeddings (config "yarn", position_embedding_type "yarn"):
twin_mla.py.

Command line:
  twin.py megatron --config C.json --weights W.safetensors --batch B.safetensors --out O.safetensors
                   [--steps N --lr 1e-3 --weight-decay 0.1 --clip-grad 1.0 --dtype float32|float64]
  twin.py hf --dir EXPORT --batch B.safetensors --out O.safetensors
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
import twin_mla  # noqa: E402
import twin_moe  # noqa: E402
import twin_mtp  # noqa: E402

CONFIG_DEFAULTS = {
    "num_layers": 0, "hidden_size": 0, "ffn_hidden_size": 0, "num_attention_heads": 0, "num_query_groups": 0,
    "kv_channels": 0, "seq_length": 0, "max_position_embeddings": 0, "vocab_size": 0,
    "normalization": "LayerNorm", "norm_epsilon": 1e-5, "activation": "gelu", "add_bias_linear": True,
    "qk_layernorm": False, "position_embedding_type": "learned_absolute", "rotary_base": 10000.0,
    "rotary_percent": 1.0, "init_method_std": 0.02, "attention_dropout": 0.0, "hidden_dropout": 0.0,
    "untie_embeddings_and_output_weights": False,
    "moe": None,  # MoE settings (twin_moe.MOE_DEFAULTS names, as the C++ MoEConfig); None or num_experts 0: dense
    "mla": None,  # multi-latent attention (twin_mla.MLA_DEFAULTS names, as the C++ MlaConfig); None: standard
    "yarn": None,  # YaRN settings (twin_mla.YARN_DEFAULTS names, as the C++ YarnConfig); None: the defaults
    "mtp_num_layers": 0, "mtp_loss_scaling_factor": 0.1,  # Multi-Token Prediction (twin_mtp.py)
}


def full_config(config):
    unknown = set(config) - set(CONFIG_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown config fields {sorted(unknown)}")
    out = dict(CONFIG_DEFAULTS)
    out.update(config)
    if out["moe"] is not None:
        out["moe"] = twin_moe.full_moe_config(out["moe"], out["num_layers"], out["ffn_hidden_size"])
        if out["moe"]["num_experts"] <= 0:
            out["moe"] = None
    out["mla"] = twin_mla.full_mla_config(out["mla"])
    out["yarn"] = twin_mla.full_yarn_config(out["yarn"])
    if out["mla"] is not None and out["position_embedding_type"] == "yarn":
        # MLA builds its own rotary embedding (mla.rope_type) and rejects GPTModel's yarn table.
        raise ValueError("position_embedding_type yarn is for standard attention; MLA uses mla.rope_type")
    return out


def is_moe_layer(c, layer):
    """c: a full_config."""
    return c["moe"] is not None and bool(c["moe"]["moe_layer_pattern"][layer])


# ----------------------------------------------------------------------------------------------- parameters


def param_specs(cfg):
    """[(name, shape, kind)] with kind in weight / embedding / bias / norm_weight / norm_bias."""
    c = full_config(cfg)
    H, N, G, d, F_ = c["hidden_size"], c["num_attention_heads"], c["num_query_groups"], c["kv_channels"], \
        c["ffn_hidden_size"]
    V, L = c["vocab_size"], c["num_layers"]
    layer_norm = c["normalization"] == "LayerNorm"
    bias = c["add_bias_linear"]
    fc1_out = 2 * F_ if c["activation"] == "swiglu" else F_
    specs = [("embedding.word_embeddings.weight", (V, H), "embedding")]
    if c["position_embedding_type"] == "learned_absolute":
        specs.append(("embedding.position_embeddings.weight", (c["max_position_embeddings"], H), "embedding"))

    def norm(prefix, size):
        specs.append((prefix + ".weight", (size,), "norm_weight"))
        if layer_norm:
            specs.append((prefix + ".bias", (size,), "norm_bias"))

    def linear(prefix, out_features, in_features, has_bias=None):
        specs.append((prefix + ".weight", (out_features, in_features), "weight"))
        if bias if has_bias is None else has_bias:
            specs.append((prefix + ".bias", (out_features,), "bias"))

    for i in range(L):
        p = f"decoder.layers.{i}."
        norm(p + "input_layernorm", H)
        if c["mla"] is not None:
            twin_mla.mla_param_specs(p, c, linear, norm)
        else:
            linear(p + "self_attention.linear_qkv", (N + 2 * G) * d, H)
            if c["qk_layernorm"]:
                norm(p + "self_attention.q_layernorm", d)
                norm(p + "self_attention.k_layernorm", d)
            linear(p + "self_attention.linear_proj", H, N * d)
        norm(p + "pre_mlp_layernorm", H)
        if is_moe_layer(c, i):
            specs.extend(twin_moe.moe_param_specs(p, c["moe"], H, c["activation"], bias))
        else:
            linear(p + "mlp.linear_fc1", fc1_out, H)
            linear(p + "mlp.linear_fc2", H, F_)
    norm("decoder.final_layernorm", H)
    if c["untie_embeddings_and_output_weights"]:
        specs.append(("output_layer.weight", (V, H), "weight"))
    return specs + twin_mtp.param_specs(c, specs)


def random_params(cfg, seed):
    """Random weights with non-trivial scales (norm weights ~ 1 + 0.1 N(0,1), biases 0.1 N(0,1))."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape, kind in param_specs(cfg):
        if kind == "weight":
            value = rng.standard_normal(shape) / math.sqrt(shape[1])
        elif kind == "embedding":
            value = 0.2 * rng.standard_normal(shape)
        elif kind == "norm_weight":
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = 0.1 * rng.standard_normal(shape)
        params[name] = value.astype(np.float32)
    return params


def buffer_names(cfg):
    """Non-trainable state saved with the model: the expert-bias buffers of MoE layers with expert bias."""
    c = full_config(cfg)
    if c["moe"] is None or not c["moe"]["enable_expert_bias"]:
        return []
    return [twin_moe.expert_bias_name(f"decoder.layers.{i}.") for i in range(c["num_layers"]) if is_moe_layer(c, i)]


def random_buffers(cfg, seed, scale=0.05):
    """Random initial expert biases (Megatron starts from 0; a non-zero start exercises biased selection at step 0)."""
    rng = np.random.default_rng(seed)
    E = full_config(cfg)["moe"]["num_experts"] if buffer_names(cfg) else 0
    return {name: (scale * rng.standard_normal(E)).astype(np.float32) for name in buffer_names(cfg)}


def new_moe_state(cfg, buffers=None):
    """{layer index: twin_moe.RouterState} for the MoE layers; expert biases from `buffers` (name -> array) if given."""
    c = full_config(cfg)
    buffers = buffers or {}
    state = {}
    for i in range(c["num_layers"]):
        if is_moe_layer(c, i):
            bias = buffers.get(twin_moe.expert_bias_name(f"decoder.layers.{i}."))
            state[i] = twin_moe.RouterState(c["moe"]["num_experts"], None if bias is None else np.asarray(bias))
    return state


def finish_global_batch(cfg, moe_state):
    """Once per global batch (after the last micro-batch's backward): expert-bias sign rule, counts and the
    global_aux_loss accumulation reset."""
    c = full_config(cfg)
    for router_state in moe_state.values():
        router_state.finish_global_batch(c["moe"])


# ----------------------------------------------------------------------------------------------- Megatron model


def _norm(x, params, prefix, c):
    w = params[prefix + ".weight"]
    if c["normalization"] == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), w, params[prefix + ".bias"], c["norm_epsilon"])
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["norm_epsilon"]) * w


def _linear(x, params, prefix):
    return F.linear(x, params[prefix + ".weight"], params.get(prefix + ".bias"))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_cos_sin(S, rot_dim, base, dtype, positions_SB=None):
    """Megatron's rotary table: inv_freq and angles in float32, cos/sin of the float32 angles. [S, rot_dim] for the
    positions 0..S-1, or [S, B, rot_dim] for given positions [S, B] (the same float32 products)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    if positions_SB is None:
        angles = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
    else:
        angles = positions_SB.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.to(dtype).cos(), emb.to(dtype).sin()


def _apply_rope(x_SBND, cos, sin, rot_dim):
    """Rotate-half RoPE on the first rot_dim channels of each head; the rest pass through. cos/sin: [S, rot_dim] or
    [S, B, rot_dim]."""
    c = cos[:, None, None, :] if cos.dim() == 2 else cos[:, :, None, :]
    s = sin[:, None, None, :] if sin.dim() == 2 else sin[:, :, None, :]
    rot, rest = x_SBND[..., :rot_dim], x_SBND[..., rot_dim:]
    return torch.cat((rot * c + _rotate_half(rot) * s, rest), dim=-1)


def _activation(h, c):
    if c["activation"] == "swiglu":
        gate, up = torch.chunk(h, 2, dim=-1)
        return F.silu(gate) * up
    if c["activation"] == "gelu":
        return F.gelu(h)  # exact (erf) form
    if c["activation"] == "squared_relu":
        return F.relu(h).pow(2)
    raise ValueError(f"unknown activation {c['activation']}")


def attention_mask(S, document_ids_BS=None):
    """True where query q may attend to key k: [S, S] causal, or [B, S, S] causal block-diagonal by document."""
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    if document_ids_BS is None:
        return causal
    same_document = document_ids_BS[:, :, None] == document_ids_BS[:, None, :]
    return causal[None] & same_document


def _standard_attention(h, params, p, c, cos, sin, rot_dim, allowed):
    """linear_proj(attention(linear_qkv(h))) of one layer with grouped-query attention; cos / sin None: no RoPE."""
    N, G, d = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]
    heads_per_group = N // G
    S, B = h.shape[:2]
    qkv = _linear(h, params, p + "self_attention.linear_qkv").view(S, B, G, (heads_per_group + 2) * d)
    q = qkv[..., : heads_per_group * d].reshape(S, B, N, d)  # head n = g * heads_per_group + j
    k = qkv[..., heads_per_group * d: (heads_per_group + 1) * d]  # [S, B, G, d]
    v = qkv[..., (heads_per_group + 1) * d:]
    if c["qk_layernorm"]:
        q = _norm(q, params, p + "self_attention.q_layernorm", c)
        k = _norm(k, params, p + "self_attention.k_layernorm", c)
    if cos is not None:
        q = _apply_rope(q, cos, sin, rot_dim)
        k = _apply_rope(k, cos, sin, rot_dim)
    k = k.repeat_interleave(heads_per_group, dim=2)  # query head n reads group n // heads_per_group
    v = v.repeat_interleave(heads_per_group, dim=2)
    q_BNSd, k_BNSd, v_BNSd = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = q_BNSd @ k_BNSd.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(~allowed, float("-inf"))
    context = torch.softmax(scores, dim=-1) @ v_BNSd  # [B, N, S, d]
    context = context.permute(2, 0, 1, 3).reshape(S, B, N * d)
    return _linear(context, params, p + "self_attention.linear_proj")


def megatron_forward(params, cfg, tokens_BS, labels_BS, loss_mask_BS, moe_state=None, aux_grad_scale=1.0,
                     training=True, return_moe_info=False, position_ids_BS=None, document_ids_BS=None):
    """Returns (logits [S, B, V], loss) or, with return_moe_info, (logits, loss, moe_info). `params` maps Megatron
    names to torch tensors (one dtype). position_ids_BS / document_ids_BS: optional packed-sequence inputs (module
    docstring); None gives positions 0..S-1 and the plain causal mask. loss is the lm loss only; on MoE layers the
    aux and z losses are attached to the graph with twin_moe.AuxLossAutoScaler (gradient scale aux_grad_scale =
    1 / num_microbatches), so
    loss.backward() gives the gradient of lm + aux_grad_scale-weighted aux/z losses while loss's value is the lm loss.
    moe_state: new_moe_state(cfg) (created fresh when None; expert biases are then read from params if present).
    moe_info = {"aux_total": sum of the attached aux/z loss tensors (coefficients included; 0.0 if none),
                "layers": {i: router info of layer i (see twin_moe.router_forward)}}."""
    c = full_config(cfg)
    if c["moe"] is not None and moe_state is None:
        moe_state = new_moe_state(cfg, {k: v.detach() for k, v in params.items() if k.endswith("expert_bias")})
    moe_info = {"aux_total": 0.0, "layers": {}}
    d = c["kv_channels"]
    B, S = tokens_BS.shape
    dtype = params["embedding.word_embeddings.weight"].dtype
    tokens_SB = tokens_BS.t()

    positions_SB = None if position_ids_BS is None else torch.as_tensor(position_ids_BS, dtype=torch.long).t()
    if positions_SB is not None and positions_SB.shape != (S, B):
        raise ValueError(f"position_ids must be [B, S] = [{B}, {S}], got {list(positions_SB.t().shape)}")
    if document_ids_BS is not None:
        document_ids_BS = torch.as_tensor(document_ids_BS, dtype=torch.long)
        if document_ids_BS.shape != (B, S):
            raise ValueError(f"document_ids must be [B, S] = [{B}, {S}], got {list(document_ids_BS.shape)}")

    x = params["embedding.word_embeddings.weight"][tokens_SB]  # [S, B, H]
    if c["position_embedding_type"] == "learned_absolute":
        if positions_SB is None:
            x = x + params["embedding.position_embeddings.weight"][torch.arange(S)][:, None, :]
        else:
            x = x + params["embedding.position_embeddings.weight"][positions_SB]
    rope = c["position_embedding_type"] in ("rope", "yarn") and c["mla"] is None
    if rope and c["position_embedding_type"] == "yarn":
        cos, sin, rot_dim = twin_mla.standard_yarn_cos_sin(c, S, dtype, positions_SB)
    elif rope:
        rot_dim = int(d * c["rotary_percent"])
        cos, sin = _rope_cos_sin(S, rot_dim, c["rotary_base"], dtype, positions_SB)
    if c["mla"] is not None:
        mla_cos, mla_sin = twin_mla.mla_cos_sin(c, S, dtype, positions_SB)
    allowed = attention_mask(S, document_ids_BS)  # [S, S] or [B, S, S]
    allowed = allowed if allowed.dim() == 2 else allowed[:, None]  # [B, 1, S, S] against scores [B, N, S, S]

    for i in range(c["num_layers"]):
        p = f"decoder.layers.{i}."
        h = _norm(x, params, p + "input_layernorm", c)
        if c["mla"] is not None:
            x = x + twin_mla.mla_attention(h, params, p, c, mla_cos, mla_sin, allowed, _norm)
        else:
            x = x + _standard_attention(h, params, p, c, cos if rope else None, sin if rope else None,
                                        rot_dim if rope else 0, allowed)
        h = _norm(x, params, p + "pre_mlp_layernorm", c)
        if is_moe_layer(c, i):
            y, info = twin_moe.moe_layer_forward(h, params, p, c["moe"], lambda t: _activation(t, c), moe_state[i],
                                                 training, aux_grad_scale)
            moe_info["layers"][i] = info
            for aux in info["aux_losses"]:
                moe_info["aux_total"] = moe_info["aux_total"] + aux
            x = x + y
        else:
            h = _activation(_linear(h, params, p + "mlp.linear_fc1"), c)
            x = x + _linear(h, params, p + "mlp.linear_fc2")

    x = _norm(x, params, "decoder.final_layernorm", c)
    if c["mtp_num_layers"]:
        x, moe_info["mtp_losses"] = twin_mtp.attach(
            x, params, c, tokens_SB, labels_BS.t(), loss_mask_BS.t(),
            {"rope": (cos, sin, rot_dim) if rope else None, "allowed": allowed, "moe_state": moe_state,
             "mla_rope": (mla_cos, mla_sin) if c["mla"] is not None else None, "moe_info": moe_info,
             "training": training, "aux_grad_scale": aux_grad_scale})
    w_out = params["output_layer.weight" if c["untie_embeddings_and_output_weights"] else
                   "embedding.word_embeddings.weight"]
    logits = x @ w_out.t()  # [S, B, V]
    loss = masked_mean_ce(logits, labels_BS.t(), loss_mask_BS.t())
    if return_moe_info:
        return logits, loss, moe_info
    return logits, loss


def masked_mean_ce(logits_SBV, labels_SB, mask_SB):
    per_token = F.cross_entropy(logits_SBV.reshape(-1, logits_SBV.shape[-1]), labels_SB.reshape(-1).long(),
                                reduction="none")
    mask = mask_SB.reshape(-1).to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum()


def run_megatron(cfg, weights, batch, steps=0, lr=1e-3, weight_decay=0.1, clip_grad=1.0, betas=(0.9, 0.999),
                 eps=1e-8, dtype=torch.float32, microbatches=1, lm_weight=1.0):
    """Forward/backward and `steps` AdamW steps, exactly the parity harness's protocol (one micro-batch per global
    batch). Returns {name: ndarray}: logits [S, B, V], loss (the lm loss), grad.<name> (after step 0's backward),
    step{k}.<name>, losses [steps + 1] (lm losses), grad_norms [steps] (before clipping).
    MoE models also return, per forward k = 0..steps, the logged router losses of the MoE layers (in layer order):
    load_balancing_loss [steps + 1, n_moe_layers, n_types] (aux / coeff per configured type, 0 for types without
    an aux loss) and z_loss [steps + 1, n_moe_layers] (z / cz, 0 when off); and with expert bias
    step{k}.decoder.layers.{i}.mlp.router.expert_bias [E] (after global batch k's sign-rule update).
    `batch` holds tokens, labels [B, S] and optionally loss_mask, position_ids and document_ids [B, S] (packed
    sequences, see megatron_forward).
    `weights` may hold the expert-bias buffers (buffer_names(cfg)); they are state, not parameters: no gradient,
    no optimizer. Order per step: forward, backward (lm + aux/z gradients, aux scale 1), finish_global_batch
    (expert-bias update, counts and global aux reset), clip, AdamW.
    microbatches M (dividing B): each step is a global batch of M micro-batches of B / M consecutive batch rows, each
    with forward and backward of lm_loss / M (aux / z gradients scaled by aux_grad_scale = 1 / M, Megatron's
    1 / num_microbatches); losses are the mean over the micro-batches, logits the micro-batches' concatenated along
    B, and load_balancing_loss / z_loss have (steps + 1) * M rows (one per forward). lm_weight multiplies the lm loss
    in backward only (0: the gradients are the aux / z-loss contributions alone)."""
    buffers = set(buffer_names(cfg))
    params = {name: torch.tensor(np.asarray(value), dtype=dtype, requires_grad=True)
              for name, value in weights.items() if name not in buffers}
    moe_state = new_moe_state(cfg, {n: weights[n] for n in buffers if n in weights})
    tokens = torch.tensor(np.asarray(batch["tokens"]), dtype=torch.long)
    labels = torch.tensor(np.asarray(batch["labels"]), dtype=torch.long)
    mask = torch.tensor(np.asarray(batch["loss_mask"]), dtype=dtype) if "loss_mask" in batch else \
        torch.ones(tokens.shape, dtype=dtype)
    positions = torch.tensor(np.asarray(batch["position_ids"]), dtype=torch.long) if "position_ids" in batch else None
    documents = torch.tensor(np.asarray(batch["document_ids"]), dtype=torch.long) if "document_ids" in batch else None
    names = list(params)
    decay = [params[n] for n in names if params[n].dim() >= 2]
    no_decay = [params[n] for n in names if params[n].dim() < 2]  # biases and norm weights
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)
    out = {}
    losses, grad_norms, lb_logs, z_logs, mtp_logs = [], [], [], [], []
    if tokens.shape[0] % microbatches:
        raise ValueError(f"microbatches {microbatches} does not divide the batch size {tokens.shape[0]}")
    rows = tokens.shape[0] // microbatches
    for step in range(steps + 1):
        optimizer.zero_grad(set_to_none=False)
        loss_sum, logits_parts = 0.0, []
        for m in range(microbatches):
            part = slice(m * rows, (m + 1) * rows)
            logits, loss, moe_info = megatron_forward(
                params, cfg, tokens[part], labels[part], mask[part], moe_state=moe_state,
                aux_grad_scale=1.0 / microbatches, training=True, return_moe_info=True,
                position_ids_BS=None if positions is None else positions[part],
                document_ids_BS=None if documents is None else documents[part])
            loss_sum += loss.item()
            logits_parts.append(logits.detach())
            layers = [moe_info["layers"][i] for i in sorted(moe_info["layers"])]
            lb_logs.append([info["load_balancing_loss"] for info in layers])
            z_logs.append([info["z_loss"] for info in layers])
            mtp_logs.append(moe_info.get("mtp_losses", []))
            if step < steps:
                (loss * (lm_weight / microbatches)).backward()
        losses.append(loss_sum / microbatches)
        if step == 0:
            out["logits"] = torch.cat(logits_parts, dim=1).numpy().copy()
            out["loss"] = np.array(loss_sum / microbatches, dtype=np.float64)
        if step == steps:
            break
        for n in names:  # a parameter outside the graph (an expert that got no token) has a zero gradient
            if params[n].grad is None:
                params[n].grad = torch.zeros_like(params[n])
        if step == 0:
            for n in names:
                out["grad." + n] = params[n].grad.detach().numpy().copy()
        finish_global_batch(cfg, moe_state)
        norm = torch.nn.utils.clip_grad_norm_([params[n] for n in names], clip_grad if clip_grad > 0 else float("inf"))
        grad_norms.append(float(norm))
        optimizer.step()
        for n in names:
            out[f"step{step + 1}.{n}"] = params[n].detach().numpy().copy()
        for n in buffers:
            layer = int(n.split(".")[2])
            out[f"step{step + 1}.{n}"] = moe_state[layer].expert_bias.numpy().copy()
    out["losses"] = np.array(losses, dtype=np.float64)
    out["grad_norms"] = np.array(grad_norms, dtype=np.float64)
    if full_config(cfg)["mtp_num_layers"]:
        out["mtp_losses"] = np.array(mtp_logs, dtype=np.float64)
    if moe_state:
        out["load_balancing_loss"] = np.array(lb_logs, dtype=np.float64)
        out["z_loss"] = np.array(z_logs, dtype=np.float64)
    return out


# ----------------------------------------------------------------------------------------------- HF-style model


def _hf_rms_norm(x, weight, eps):
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _repeat_kv(x_BGSd, n_rep):
    B, G, S, d = x_BGSd.shape
    return x_BGSd[:, :, None].expand(B, G, n_rep, S, d).reshape(B, G * n_rep, S, d)


def load_hf_dir(path):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    tensors, metadata = st.load(os.path.join(path, "model.safetensors"))
    return config, tensors, metadata


def hf_forward(config, tensors, tokens_BS):
    """Logits [B, S, V] of a LlamaForCausalLM / Qwen3ForCausalLM as HF's modeling code computes them."""
    model_type = config["model_type"]
    if model_type not in ("llama", "qwen3"):
        raise ValueError(f"unsupported model_type {model_type}")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError("hidden_act must be silu")
    w = {k: torch.tensor(v, dtype=torch.float32) for k, v in tensors.items()}
    H = config["hidden_size"]
    N = config["num_attention_heads"]
    G = config.get("num_key_value_heads", N)
    d = config.get("head_dim") or H // N
    eps = config["rms_norm_eps"]
    theta = config.get("rope_theta", 10000.0)
    attention_bias = config.get("attention_bias", False)
    mlp_bias = config.get("mlp_bias", False) if model_type == "llama" else False
    B, S = tokens_BS.shape

    def lin(x, name, has_bias):
        return F.linear(x, w[name + ".weight"], w[name + ".bias"] if has_bias else None)

    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    positions = torch.arange(S, dtype=torch.float32)
    freqs = (inv_freq[:, None] @ positions[None, :]).t()  # [S, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, S, d]
    mask = torch.full((S, S), float("-inf")).triu(1)

    x = w["model.embed_tokens.weight"][tokens_BS]  # [B, S, H]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        residual = x
        h = _hf_rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = lin(h, p + "self_attn.q_proj", attention_bias).view(B, S, N, d)
        k = lin(h, p + "self_attn.k_proj", attention_bias).view(B, S, G, d)
        v = lin(h, p + "self_attn.v_proj", attention_bias).view(B, S, G, d).transpose(1, 2)
        if model_type == "qwen3":
            q = _hf_rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = _hf_rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = _repeat_kv(k, N // G), _repeat_kv(v, N // G)
        scores = (q @ k.transpose(2, 3)) * d ** -0.5 + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        attn = (probs @ v).transpose(1, 2).reshape(B, S, N * d)
        x = residual + lin(attn, p + "self_attn.o_proj", attention_bias)
        residual = x
        h = _hf_rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        h = F.silu(lin(h, p + "mlp.gate_proj", mlp_bias)) * lin(h, p + "mlp.up_proj", mlp_bias)
        x = residual + lin(h, p + "mlp.down_proj", mlp_bias)
    x = _hf_rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if config.get("tie_word_embeddings", False) else w["lm_head.weight"]
    return x @ head.t()


# ----------------------------------------------------------------------------------------------- command line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("megatron")
    m.add_argument("--config", required=True)
    m.add_argument("--weights", required=True)
    m.add_argument("--batch", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--steps", type=int, default=0)
    m.add_argument("--lr", type=float, default=1e-3)
    m.add_argument("--weight-decay", type=float, default=0.1)
    m.add_argument("--clip-grad", type=float, default=1.0)
    m.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    h = sub.add_parser("hf")
    h.add_argument("--dir", required=True)
    h.add_argument("--batch", required=True)
    h.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    batch, _ = st.load(args.batch)
    if args.mode == "megatron":
        with open(args.config) as f:
            cfg = json.load(f)
        weights, _ = st.load(args.weights)
        dtype = torch.float64 if args.dtype == "float64" else torch.float32
        out = run_megatron(cfg, weights, batch, args.steps, args.lr, args.weight_decay, args.clip_grad, dtype=dtype)
    else:
        config, tensors, _ = load_hf_dir(args.dir)
        logits = hf_forward(config, tensors, torch.tensor(batch["tokens"], dtype=torch.long))
        out = {"logits_BSV": logits.numpy()}
    st.save(args.out, out)


if __name__ == "__main__":
    main()
