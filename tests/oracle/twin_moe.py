"""PyTorch twin of Megatron-Core's MoE layer (router -> experts -> combine, shared experts), written from the
specification (Megatron-Core's router.py, moe_utils.py, experts.py and token_dispatcher.py for the
formulas), not from moecore's C++. Run with /usr/bin/python3 (Debian's torch 1.13 + numpy).

Tokens are [S, B, H] sequence-major: token t = s * B + b.

Router (TopKRouter.routing):
  logits = x W^T (+ b) in the router dtype (fp32, or fp64 with router_dtype "fp64"; a float64 model always routes
  in float64 so that gradcheck sees one precision); every score function (and the aux losses' scores, and sinkhorn's
  top-k > 1 softmax) runs in fp32 on the logits cast to fp32, whatever the router dtype, as Megatron's
  topk_routing_with_score_function (in float64 for a float64 model); the probs are cast back to the router dtype;
  z-loss  z = cz * mean_t (logsumexp_e logits)^2, attached to the logits;
  softmax post (default): top-k of the raw logits, softmax over the k selected; pre_softmax: softmax over all E, top-k,
  no renormalisation; sigmoid / sqrtsoftplus: s = score(logits), top-k of s (+ expert_bias if enabled, selection only),
  p = s_sel / (sum s_sel + 1e-20) when k > 1; then p *= topk_scaling_factor;
  group-limited (num_groups G, group_topk g): group score = sum of its top-(k // g) routing scores, keep the g best
  groups, the others -inf, top-k over the rest;
  sinkhorn: indices = top-k of sinkhorn(exp(logits)) (no grad); probs = sigmoid(logits) (k = 1) or softmax(logits),
  masked, not renormalised, no scaling factor;
  capacity (capacity_factor cf): C = ceil(T * k / E * cf); if C > T nothing is dropped (and with padding every expert
  gets all T tokens, as in Megatron); drop policy "probs" keeps per expert the C tokens with the largest prob,
  "position" the C earliest routed tokens; ties (only among prob-0 / unrouted tokens, i.e. padding) go to the earliest
  token; with pad_expert_input_to_capacity the map is the capacity mask itself (exactly C rows per expert, padded rows
  have prob 0); probs *= final map.
  Aux losses (each with its own coefficient), on scores S = softmax(logits) or sigmoid/sqrtsoftplus normalised to sum 1
  per token, and a fresh plain top-k map of S (no groups, no expert bias, no capacity):
    aux_loss        = coeff * E / (k * T^2) * sum_e (sum_t S_te) * c_e,   c_e = tokens per expert of that map
    seq_aux_loss    = the same per sequence b (T -> S, counts per (b, e)), averaged over the B sequences
    global_aux_loss = the same with c_e replaced by (counts accumulated over the micro-batches of the global batch) /
                      (number of micro-batches so far), T = this micro-batch's tokens; reset by finish_global_batch().
  Each loss is attached to the routing probs with AuxLossAutoScaler (z-loss to the logits): the forward value of
  everything is unchanged, and in backward the loss contributes d(loss)/d(inputs) * aux_grad_scale.

Gradient scale (what we implement, Megatron's MoEAuxLossAutoScaler): Megatron multiplies the aux-loss gradient by
main_loss_backward_scale = loss_scale / num_microbatches (times cp_size; here 1). Our objective for a global batch of
m micro-batches is (1/m) sum_mb lm_loss_mb (loss averaging, no loss scaling), so each micro-batch's aux/z gradient
is scaled by aux_grad_scale = 1/m. The effective training objective is therefore
    (1/m) * sum_mb [ lm_loss_mb + sum_layers ( sum_types aux_mb + z_mb ) ]
while the reported loss stays the lm loss. With one micro-batch (the parity protocol): lm + sum of aux + z.

Experts (SequentialMLP semantics, Megatron's MLP with per_token_scale): rows of expert e = tokens routed to e in
ascending token order; y = fc2_W(act(fc1(x)) * p) + fc2_b * p; with apply_probs_on_input (top-1 only):
y = fc2(act(fc1(x * p))) (p reset to 1, bias unscaled); outputs scatter-added back to their tokens.
Shared experts: fc2(act(fc1(x))) (no bias), times sigmoid(x . gate_weight) with shared_expert_gate; added.

Expert bias: buffer [E] fp32; every training forward adds the final routing map's column sums to the local counts;
finish_global_batch(): b_e += u * sign(mean_e c - c_e), counts reset (Megatron does it in finalize_model_grads, i.e.
after the backward of the last micro-batch and before the optimizer step; either way between two global batches).
Input jitter and force-load-balancing are random and left out (parity runs keep them off).
"""
import math

import torch
import torch.nn.functional as F

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
AUX_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")

MOE_DEFAULTS = {
    "num_experts": 0, "ffn_hidden_size": 0, "moe_layer_pattern": [], "topk": 2, "score_function": "softmax",
    "pre_softmax": False, "topk_scaling_factor": None, "num_groups": 0, "group_topk": 0, "router_dtype": "fp32",
    "enable_expert_bias": False, "bias_update_rate": 1e-3, "load_balancing_types": ["aux_loss"],
    "aux_loss_coeffs": [0.0], "z_loss_coeff": 0.0, "capacity_factor": None, "drop_policy": "probs",
    "pad_expert_input_to_capacity": False, "apply_probs_on_input": False, "shared_expert_intermediate_size": 0,
    "shared_expert_gate": False, "latent_size": 0,
    # accepted for compatibility with the C++ MoEConfig; must stay off / do not change the math here
    "input_jitter_eps": 0.0, "force_load_balancing": False, "grouped_gemm": False, "per_layer_logging": False,
}


def full_moe_config(moe, num_layers=None, dense_ffn_hidden_size=None):
    """Fills defaults and validates (raises ValueError with one line naming the problem)."""
    unknown = set(moe) - set(MOE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown moe config fields {sorted(unknown)}")
    m = dict(MOE_DEFAULTS)
    m.update(moe)
    m["moe_layer_pattern"] = [int(bool(v)) for v in m["moe_layer_pattern"]]
    m["load_balancing_types"] = list(m["load_balancing_types"])
    m["aux_loss_coeffs"] = [float(v) for v in m["aux_loss_coeffs"]]
    if not m["ffn_hidden_size"] and dense_ffn_hidden_size:
        m["ffn_hidden_size"] = dense_ffn_hidden_size
    if m["num_experts"] > 0:
        validate_moe(m, num_layers)
    return m


def validate_moe(m, num_layers=None):
    E, k = m["num_experts"], m["topk"]

    def bad(message):
        raise ValueError(f"moe config: {message}")

    if k < 1 or k > E:
        bad(f"topk {k} must be in [1, num_experts={E}]")
    if m["score_function"] not in SCORE_FUNCTIONS:
        bad(f"score_function '{m['score_function']}' is not one of {SCORE_FUNCTIONS}")
    if m["router_dtype"] not in ("fp32", "fp64"):
        bad(f"router_dtype '{m['router_dtype']}' must be fp32 or fp64")
    if m["num_groups"] or m["group_topk"]:
        G, g = m["num_groups"], m["group_topk"]
        if G <= 0 or g <= 0:
            bad(f"num_groups {G} and group_topk {g} must both be positive")
        if E % G:
            bad(f"num_groups {G} does not divide num_experts {E}")
        if g > G:
            bad(f"group_topk {g} > num_groups {G}")
        if k // g < 1 or k // g > E // G:
            bad(f"topk {k} // group_topk {g} must be in [1, experts per group {E // G}]")
    if m["enable_expert_bias"] and m["score_function"] == "softmax":
        bad("enable_expert_bias needs score_function sigmoid or sqrtsoftplus")
    types, coeffs = m["load_balancing_types"], m["aux_loss_coeffs"]
    if len(types) != len(coeffs):
        bad(f"{len(types)} load_balancing_types but {len(coeffs)} aux_loss_coeffs")
    for t in types:
        if t not in LOAD_BALANCING_TYPES:
            bad(f"load balancing type '{t}' is not one of {LOAD_BALANCING_TYPES}")
    if "sinkhorn" in types and any(c != 0 for c in coeffs):
        bad("sinkhorn routing needs every aux_loss_coeff to be 0")
    if m["pad_expert_input_to_capacity"] and m["capacity_factor"] is None:
        bad("pad_expert_input_to_capacity needs capacity_factor")
    if m["capacity_factor"] is not None and m["capacity_factor"] <= 0:
        bad(f"capacity_factor {m['capacity_factor']} must be positive (or null)")
    if m["drop_policy"] not in ("probs", "position"):
        bad(f"drop_policy '{m['drop_policy']}' must be probs or position")
    if m["apply_probs_on_input"] and k != 1:
        bad("apply_probs_on_input needs topk 1")
    if m["input_jitter_eps"] or m["force_load_balancing"]:
        bad("input_jitter_eps and force_load_balancing are random; the twin does not implement them")
    if m["latent_size"] < 0:
        bad(f"latent_size {m['latent_size']} must be positive (or 0: none)")
    if m["ffn_hidden_size"] <= 0:
        bad(f"ffn_hidden_size {m['ffn_hidden_size']} must be positive")
    if num_layers is not None and len(m["moe_layer_pattern"]) != num_layers:
        bad(f"moe_layer_pattern has {len(m['moe_layer_pattern'])} entries for {num_layers} layers")


def aux_coeff(m, name):
    types = m["load_balancing_types"]
    return m["aux_loss_coeffs"][types.index(name)] if name in types else 0.0


# ----------------------------------------------------------------------------------------------- parameters


def moe_param_specs(prefix, m, hidden, activation, add_bias):
    """[(name, shape, kind)] of one MoE layer's MLP parameters (prefix e.g. 'decoder.layers.3.')."""
    E, Fm, S, L = m["num_experts"], m["ffn_hidden_size"], m["shared_expert_intermediate_size"], m["latent_size"]
    glu = 2 if activation == "swiglu" else 1
    X = L if L > 0 else hidden  # the routed experts' width
    specs = [(prefix + "mlp.router.weight", (E, hidden), "weight")]
    if add_bias:
        specs.append((prefix + "mlp.router.bias", (E,), "bias"))
    for e in range(E):
        p = f"{prefix}mlp.experts.local_experts.{e}."
        specs.append((p + "linear_fc1.weight", (glu * Fm, X), "weight"))
        if add_bias:
            specs.append((p + "linear_fc1.bias", (glu * Fm,), "bias"))
        specs.append((p + "linear_fc2.weight", (X, Fm), "weight"))
        if add_bias:
            specs.append((p + "linear_fc2.bias", (X,), "bias"))
    if S > 0:
        specs.append((prefix + "mlp.shared_experts.linear_fc1.weight", (glu * S, hidden), "weight"))
        specs.append((prefix + "mlp.shared_experts.linear_fc2.weight", (hidden, S), "weight"))
        if m["shared_expert_gate"]:
            specs.append((prefix + "mlp.shared_experts.gate_weight", (1, hidden), "weight"))
    if L > 0:  # LatentMoE (Megatron's MoELayer.fc1_latent_proj / fc2_latent_proj)
        specs.append((prefix + "mlp.fc1_latent_proj.weight", (L, hidden), "weight"))
        if add_bias:
            specs.append((prefix + "mlp.fc1_latent_proj.bias", (L,), "bias"))
        specs.append((prefix + "mlp.fc2_latent_proj.weight", (hidden, L), "weight"))
        if add_bias:
            specs.append((prefix + "mlp.fc2_latent_proj.bias", (hidden,), "bias"))
    return specs


def expert_bias_name(prefix):
    return prefix + "mlp.router.expert_bias"


# ----------------------------------------------------------------------------------------------- state


class RouterState:
    """Per-layer router state that outlives a forward: the expert-bias buffer and its token counts, and the
    global_aux_loss accumulation."""

    def __init__(self, num_experts, expert_bias=None):
        self.expert_bias = torch.zeros(num_experts, dtype=torch.float32) if expert_bias is None else \
            torch.as_tensor(expert_bias, dtype=torch.float32).clone()
        self.local_tokens_per_expert = torch.zeros(num_experts, dtype=torch.float64)
        self.global_tokens_per_expert = torch.zeros(num_experts, dtype=torch.float64)
        self.ga_steps = 0

    def finish_global_batch(self, m):
        """Once per global batch: the expert-bias sign rule (when enabled), then counts and the global aux
        accumulation reset."""
        if m["enable_expert_bias"]:
            c = self.local_tokens_per_expert
            offset = c.mean() - c
            self.expert_bias = (self.expert_bias + torch.sign(offset).to(torch.float32) *
                                torch.tensor(m["bias_update_rate"], dtype=torch.float32))
        self.local_tokens_per_expert.zero_()
        self.global_tokens_per_expert.zero_()
        self.ga_steps = 0


class AuxLossAutoScaler(torch.autograd.Function):
    """Returns `output` unchanged; in backward passes its gradient through and gives `aux_loss` the gradient
    `scale` (Megatron's MoEAuxLossAutoScaler with main_loss_backward_scale = scale)."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * ctx.scale, None


# ----------------------------------------------------------------------------------------------- router


def router_dtype(m, model_dtype):
    return torch.float64 if m["router_dtype"] == "fp64" or model_dtype == torch.float64 else torch.float32


def score_fn(logits, name):
    if name == "softmax":
        return torch.softmax(logits, dim=-1)
    if name == "sigmoid":
        return torch.sigmoid(logits)
    if name == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    raise ValueError(f"unknown score function {name}")


def _topk_indices(values, k):
    """Indices of the k largest per row; ties broken towards the lower index (stable)."""
    return torch.sort(values, dim=-1, descending=True, stable=True)[1][..., :k]


def group_limited_topk(scores_TE, k, num_groups, group_topk):
    """Top-k restricted to the group_topk best groups (group score = sum of its top-(k // group_topk) scores).
    Returns (selected values [T, k], indices [T, k])."""
    T, E = scores_TE.shape
    grouped = scores_TE.view(T, num_groups, E // num_groups)
    group_scores = grouped.topk(k // group_topk, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = _topk_indices(group_scores, group_topk)
    group_mask = torch.zeros(T, num_groups, dtype=torch.bool).scatter(1, group_idx, True)
    expert_mask = group_mask[:, :, None].expand(T, num_groups, E // num_groups).reshape(T, E)
    masked = scores_TE.masked_fill(~expert_mask, float("-inf"))
    idx = _topk_indices(masked, k)
    return scores_TE.gather(1, idx), idx


def _compute_topk(scores_TE, m):
    if m["group_topk"]:
        return group_limited_topk(scores_TE, m["topk"], m["num_groups"], m["group_topk"])
    idx = _topk_indices(scores_TE, m["topk"])
    return scores_TE.gather(1, idx), idx


def topk_routing(logits_TE, m, expert_bias=None, sd=torch.float32):
    """Megatron's topk_routing_with_score_function, scores in dtype sd. Returns (probs [T, E] dense, routing_map [T, E]
    bool)."""
    k, fn = m["topk"], m["score_function"]
    if fn == "softmax":
        if m["pre_softmax"]:
            probs, idx = _compute_topk(torch.softmax(logits_TE.to(sd), dim=-1), m)
        else:
            selected, idx = _compute_topk(logits_TE, m)
            probs = torch.softmax(selected.to(sd), dim=-1)
    else:
        scores = score_fn(logits_TE.to(sd), fn)
        if expert_bias is not None:
            _, idx = _compute_topk(scores + expert_bias.to(scores.dtype), m)
            selected = scores.gather(1, idx)
        else:
            selected, idx = _compute_topk(scores, m)
        probs = selected / (selected.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else selected
    if m["topk_scaling_factor"]:
        probs = probs * m["topk_scaling_factor"]
    probs = probs.to(logits_TE.dtype)
    routing_probs = torch.zeros_like(logits_TE).scatter(1, idx, probs)
    routing_map = torch.zeros(logits_TE.shape, dtype=torch.bool).scatter(1, idx, True)
    return routing_probs, routing_map


def sinkhorn(cost, tol=1e-4):
    """Megatron's sinkhorn normalisation of exp(cost)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.shape[0], dtype=cost.dtype)
    d1 = torch.ones(cost.shape[1], dtype=cost.dtype)
    eps = 1e-8
    error = 1e9
    d1_old = d1
    while error > tol:
        d0 = (1.0 / d0.shape[0]) / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1.0 / d1.shape[0]) / (torch.sum(d0[:, None] * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0[:, None]


def sinkhorn_routing(logits_TE, k, sd=torch.float32):
    with torch.no_grad():
        idx = _topk_indices(sinkhorn(logits_TE.detach().to(torch.float32)), k)
    act = torch.sigmoid(logits_TE) if k == 1 else \
        torch.softmax(logits_TE.to(sd), dim=-1).to(logits_TE.dtype)
    routing_map = torch.zeros(logits_TE.shape, dtype=torch.bool).scatter(1, idx, True)
    return act * routing_map, routing_map


def expert_capacity(num_tokens, m):
    return math.ceil(num_tokens * m["topk"] / m["num_experts"] * m["capacity_factor"])


def apply_capacity(probs_TE, map_TE, m):
    """Megatron's apply_router_token_dropping. Returns (probs, map, C)."""
    T = probs_TE.shape[0]
    C = expert_capacity(T, m)
    if C > T:
        capacity_mask = torch.ones(map_TE.shape, dtype=torch.bool)
    else:
        key = probs_TE.detach() if m["drop_policy"] == "probs" else map_TE.to(torch.int64)
        # per expert (column) the C largest; stable descending sort: equal keys keep ascending token order
        order = torch.sort(key, dim=0, descending=True, stable=True)[1][:C]
        capacity_mask = torch.zeros(map_TE.shape, dtype=torch.bool).scatter(0, order, True)
    final_map = capacity_mask if m["pad_expert_input_to_capacity"] else map_TE & capacity_mask
    return probs_TE * final_map, final_map, C


def aux_loss_scores(logits_TE, m, sd=torch.float32):
    """Scores over all experts for the aux losses, and a plain top-k map of them."""
    scores = score_fn(logits_TE.to(sd), m["score_function"])
    if m["score_function"] != "softmax":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    idx = _topk_indices(scores.detach(), m["topk"])
    return scores, torch.zeros(scores.shape, dtype=torch.bool).scatter(1, idx, True)


def switch_load_balancing_loss(scores, tokens_per_expert, total_tokens, k, E, coeff):
    """coeff * E / (k * T^2) * sum_e (sum_t scores_te) * c_e  (columns may be (sequence, expert) pairs)."""
    return torch.sum(scores.sum(dim=0) * tokens_per_expert.to(scores.dtype)) * (
        E * coeff / (k * total_tokens * total_tokens))


def router_forward(x_SBH, params, prefix, m, state, training=True, aux_grad_scale=1.0):
    """Returns (probs [T, E] in router dtype, routing_map [T, E] bool, info) with info = {'load_balancing_loss':
    [aux / coeff per configured type (0 when off)], 'z_loss': z / cz (0 when off), 'capacity': C or -1,
    'aux_losses': [the attached loss tensors, with coefficients], 'logits': [T, E]}."""
    S, B, H = x_SBH.shape
    T, E, k = S * B, m["num_experts"], m["topk"]
    rd = router_dtype(m, x_SBH.dtype)
    sd = torch.float64 if x_SBH.dtype == torch.float64 else torch.float32  # score functions: fp32 (Megatron)
    weight = params[prefix + "mlp.router.weight"].to(rd)
    bias = params.get(prefix + "mlp.router.bias")
    logits = F.linear(x_SBH.reshape(T, H).to(rd), weight, None if bias is None else bias.to(rd))
    info = {"load_balancing_loss": [0.0] * len(m["load_balancing_types"]), "z_loss": 0.0, "capacity": -1,
            "aux_losses": [], "logits": logits}
    track = training and torch.is_grad_enabled()

    cz = m["z_loss_coeff"]
    if track and cz:
        z = torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * cz
        logits = AuxLossAutoScaler.apply(logits, z, aux_grad_scale)
        info["z_loss"] = z.item() / cz
        info["aux_losses"].append(z)

    if "sinkhorn" in m["load_balancing_types"]:
        probs, routing_map = sinkhorn_routing(logits, k, sd)
    else:
        probs, routing_map = topk_routing(logits, m, state.expert_bias if m["enable_expert_bias"] else None, sd)
    if m["capacity_factor"] is not None:
        probs, routing_map, info["capacity"] = apply_capacity(probs, routing_map, m)

    if track and any(aux_coeff(m, t) for t in AUX_TYPES):
        scores, aux_map = aux_loss_scores(logits, m, sd)
        counts = aux_map.sum(dim=0).to(torch.float64)
        losses = {}
        coeff = aux_coeff(m, "aux_loss")
        if coeff:
            losses["aux_loss"] = switch_load_balancing_loss(scores, counts, T, k, E, coeff)
        coeff = aux_coeff(m, "seq_aux_loss")
        if coeff:  # columns (b, e): token t = s * B + b, so [T, E] -> [S, B * E]
            seq_counts = aux_map.reshape(S, B * E).sum(dim=0).to(torch.float64)
            losses["seq_aux_loss"] = switch_load_balancing_loss(scores.reshape(S, B * E), seq_counts, S, k, E,
                                                                coeff) / B
        coeff = aux_coeff(m, "global_aux_loss")
        if coeff:
            state.global_tokens_per_expert += counts
            state.ga_steps += 1
            averaged = state.global_tokens_per_expert / state.ga_steps
            losses["global_aux_loss"] = switch_load_balancing_loss(scores, averaged, T, k, E, coeff)
        for i, t in enumerate(m["load_balancing_types"]):
            if t in losses:
                probs = AuxLossAutoScaler.apply(probs, losses[t], aux_grad_scale)
                info["load_balancing_loss"][i] = losses[t].item() / m["aux_loss_coeffs"][i]
                info["aux_losses"].append(losses[t])

    if track and m["enable_expert_bias"]:
        state.local_tokens_per_expert += routing_map.sum(dim=0).to(torch.float64)
    return probs, routing_map, info


# ----------------------------------------------------------------------------------------------- experts


def expert_forward(x_RH, probs_R, params, p, activation_fn, apply_probs_on_input):
    """One expert on its rows: fc2_W(act(fc1(x)) * p) + fc2_b * p (Megatron's MLP with per_token_scale)."""
    dtype = x_RH.dtype
    if apply_probs_on_input:
        x_RH = (probs_R[:, None] * x_RH).to(dtype)
        probs_R = torch.ones_like(probs_R)
    h = activation_fn(F.linear(x_RH, params[p + "linear_fc1.weight"], params.get(p + "linear_fc1.bias")))
    h = (h * probs_R[:, None]).to(dtype)
    y = F.linear(h, params[p + "linear_fc2.weight"])
    b2 = params.get(p + "linear_fc2.bias")
    if b2 is not None:
        y = y + (b2[None, :] * probs_R[:, None]).to(dtype)
    return y


def shared_experts_forward(x_TH, params, prefix, m, activation_fn):
    p = prefix + "mlp.shared_experts."
    y = F.linear(activation_fn(F.linear(x_TH, params[p + "linear_fc1.weight"])), params[p + "linear_fc2.weight"])
    if m["shared_expert_gate"]:
        y = y * torch.sigmoid(F.linear(x_TH, params[p + "gate_weight"]))
    return y


def moe_layer_forward(x_SBH, params, prefix, m, activation_fn, state, training=True, aux_grad_scale=1.0):
    """The MoE MLP of one layer: [S, B, H] -> [S, B, H] (to be added to the residual), and the router info
    (see router_forward) plus 'routing_map', 'probs' and 'tokens_per_expert'."""
    S, B, H = x_SBH.shape
    T = S * B
    x_TH = x_SBH.reshape(T, H)
    probs, routing_map, info = router_forward(x_SBH, params, prefix, m, state, training, aux_grad_scale)
    latent = m["latent_size"] > 0
    # LatentMoE: the routed experts see z = fc1_latent_proj(x) and their combined output goes through fc2_latent_proj.
    z_TX = F.linear(x_TH, params[prefix + "mlp.fc1_latent_proj.weight"],
                    params.get(prefix + "mlp.fc1_latent_proj.bias")) if latent else x_TH
    out = torch.zeros_like(z_TX)
    for e in range(m["num_experts"]):
        rows = torch.nonzero(routing_map[:, e], as_tuple=False).flatten()  # ascending token order
        if rows.numel() == 0:
            continue
        y = expert_forward(z_TX[rows], probs[rows, e], params, f"{prefix}mlp.experts.local_experts.{e}.",
                           activation_fn, m["apply_probs_on_input"])
        out = out.index_add(0, rows, y.to(out.dtype))  # y is bf16 under torch.autocast; a no-op otherwise
    if latent:
        out = F.linear(out, params[prefix + "mlp.fc2_latent_proj.weight"], params.get(prefix + "mlp.fc2_latent_proj.bias"))
    if m["shared_expert_intermediate_size"] > 0:
        out = out + shared_experts_forward(x_TH, params, prefix, m, activation_fn)
    info["routing_map"] = routing_map
    info["probs"] = probs
    info["tokens_per_expert"] = routing_map.sum(dim=0)
    return out.view(S, B, H), info
