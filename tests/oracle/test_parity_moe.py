"""Model-level MoE parity: the C++ MoE GPT model (moecore_parity) against the PyTorch twin (twin.py +
twin_moe.py), both in float32, over a matrix of router configurations. Same metric and tolerance as test_parity.py
(rel = max |cpp - twin| / max |twin| < 1e-4 per tensor; 3 AdamW steps, eps 1e-6), but every step is a global batch
of MICROBATCHES = 2 micro-batches (batch of 4 sequences, 2 each), so the 1 / num_microbatches scaling of the lm and
aux / z-loss gradients, the global aux loss accumulated over micro-batches, the expert-bias counts of both
micro-batches and the per-micro-batch capacity are all compared. Compared: logits, lm loss, every gradient (which
includes the aux / z-loss gradients), every parameter after each step, losses, grad norms; plus what the twin returns
for MoE models:
  load_balancing_loss [(steps + 1) * 2, n_moe_layers, n_types]  aux / coeff per configured type and forward,
  z_loss              [(steps + 1) * 2, n_moe_layers]           z / cz (0 when off),
  step{k}.decoder.layers.{i}.mlp.router.expert_bias [E]   after global batch k's sign-rule update (expert bias only).

Aux-only gradients: the aux / z-loss gradients are a small part of the full gradient, which the per-tensor metric
(normalised by the tensor's largest element) would hide. For every configuration with an aux or z loss, both sides
also run one step whose gradient is the aux / z-loss contribution alone (C++: a zero loss mask, so the lm loss adds
no gradient; twin: the lm loss weighted 0 in backward) and every aux-only gradient tensor is compared with the same
metric on its own scale ("aux-only grad.<name>").
With expert bias the weights file also holds each MoE layer's initial mlp.router.expert_bias (random, so that biased
selection is exercised from step 0); moecore_parity must load it as the router's buffer (not a parameter).

Premise check (no C++ needed): at step 0 the twin's routing maps of every micro-batch in float32 equal those in
float64, i.e. no token sits within rounding distance of a top-k / capacity decision, so a float32 comparison is
meaningful.

Usage: /usr/bin/python3 test_parity_moe.py --parity PATH/TO/moecore_parity [--only NAME] [--keep DIR]
       /usr/bin/python3 test_parity_moe.py --twin-only      (runs the twin side and the premise check only)
Registered in CTest as oracle_parity_moe (label oracle).
"""
import os
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_parity  # noqa: E402
import twin  # noqa: E402

STEPS, LR, WEIGHT_DECAY, CLIP_GRAD, ADAM_EPS = (test_parity.STEPS, test_parity.LR, test_parity.WEIGHT_DECAY,
                                                test_parity.CLIP_GRAD, test_parity.ADAM_EPS)
MICROBATCHES, BATCH_SIZE = 2, 4

BASE = {**test_parity.BASE, "num_layers": 2}
LLAMA = test_parity.LLAMA
MOE = {"num_experts": 8, "ffn_hidden_size": 32, "moe_layer_pattern": [1, 1], "topk": 2,
       "load_balancing_types": ["aux_loss"], "aux_loss_coeffs": [1e-2]}


def moe(**overrides):
    return {**MOE, **overrides}


CONFIGS = {
    # score functions, pre/post softmax, scaling, groups, expert bias
    "softmax_post_aux_gelu_bias": {"activation": "gelu", "add_bias_linear": True, "moe": moe()},
    "softmax_pre_aux_z_llama": {**LLAMA, "moe": moe(pre_softmax=True, z_loss_coeff=1e-3)},
    "softmax_pre_top1_probs_on_input": {**LLAMA, "moe": moe(topk=1, pre_softmax=True, apply_probs_on_input=True)},
    "sigmoid_groups_seq_aux": {**LLAMA, "moe": moe(score_function="sigmoid", topk=4, num_groups=4, group_topk=2,
                                                   load_balancing_types=["seq_aux_loss"], aux_loss_coeffs=[1e-2])},
    "sigmoid_expert_bias_scaling": {**LLAMA, "moe": moe(score_function="sigmoid", enable_expert_bias=True,
                                                        bias_update_rate=1e-2, topk_scaling_factor=2.5,
                                                        load_balancing_types=["none"], aux_loss_coeffs=[0.0])},
    "sqrtsoftplus_bias_groups_seq_aux": {**LLAMA, "moe": moe(score_function="sqrtsoftplus", enable_expert_bias=True,
                                                             topk=4, num_groups=2, group_topk=1,
                                                             topk_scaling_factor=1.5,
                                                             load_balancing_types=["seq_aux_loss"],
                                                             aux_loss_coeffs=[1e-3])},
    "sigmoid_top1_fp64_router": {**LLAMA, "moe": moe(score_function="sigmoid", topk=1, router_dtype="fp64")},
    "sigmoid_pre_softmax_groups_topk3": {**LLAMA, "moe": moe(score_function="sigmoid", pre_softmax=True, topk=3,
                                                             num_groups=4, group_topk=2, router_dtype="fp64",
                                                             z_loss_coeff=1e-3)},
    # balancing types
    "global_aux_loss": {**LLAMA, "moe": moe(load_balancing_types=["global_aux_loss"], aux_loss_coeffs=[1e-2])},
    "aux_and_seq_aux_and_z": {**LLAMA, "moe": moe(load_balancing_types=["aux_loss", "seq_aux_loss"],
                                                  aux_loss_coeffs=[1e-2, 5e-3], z_loss_coeff=1e-3)},
    "sinkhorn_top2": {**LLAMA, "moe": moe(load_balancing_types=["sinkhorn"], aux_loss_coeffs=[0.0])},
    "sinkhorn_top1": {**LLAMA, "moe": moe(topk=1, load_balancing_types=["sinkhorn"], aux_loss_coeffs=[0.0])},
    "no_balancing": {**LLAMA, "moe": moe(load_balancing_types=["none"], aux_loss_coeffs=[0.0])},
    # capacity
    "capacity_probs_drop": {**LLAMA, "moe": moe(capacity_factor=0.75, drop_policy="probs")},
    "capacity_position_drop": {**LLAMA, "moe": moe(capacity_factor=0.75, drop_policy="position")},
    "capacity_probs_pad": {**LLAMA, "moe": moe(capacity_factor=0.75, drop_policy="probs",
                                               pad_expert_input_to_capacity=True)},
    "capacity_position_pad_bias": {"activation": "squared_relu", "add_bias_linear": True, "position_embedding_type":
                                   "rope", "moe": moe(capacity_factor=1.0, drop_policy="position",
                                                      pad_expert_input_to_capacity=True)},
    # padding rows are real tokens with prob 0: with probs on the input and biases they add fc2(act(b1)) + b2
    "capacity_pad_probs_on_input_bias": {"activation": "gelu", "add_bias_linear": True,
                                         "moe": moe(topk=1, pre_softmax=True, apply_probs_on_input=True,
                                                    capacity_factor=1.0, pad_expert_input_to_capacity=True)},
    # shared experts, layer patterns
    "shared_expert_gate": {**LLAMA, "moe": moe(shared_expert_intermediate_size=48, shared_expert_gate=True)},
    "shared_expert_no_gate_gelu": {"activation": "gelu", "add_bias_linear": False,
                                   "moe": moe(shared_expert_intermediate_size=32)},
    # LatentMoE: experts in a latent width of 8 or 16 (hidden 64), with biases and shared experts beside them
    "latent_bias_gelu": {"activation": "gelu", "add_bias_linear": True, "moe": moe(latent_size=8)},
    "latent_shared_gate_llama": {**LLAMA, "moe": moe(latent_size=16, shared_expert_intermediate_size=48,
                                                      shared_expert_gate=True)},
    "mixed_dense_moe_first_dense": {**LLAMA, "num_layers": 3, "moe": moe(moe_layer_pattern=[0, 1, 1])},
    "mixed_moe_dense_alternating_loss_mask": {**LLAMA, "num_layers": 3, "mask": "zeros",
                                              "moe": moe(moe_layer_pattern=[1, 0, 1], z_loss_coeff=1e-3)},
}


def prepare(label, overrides, seed):
    overrides = dict(overrides)
    mask_kind = overrides.pop("mask", "ones")
    cfg = {**BASE, **overrides}
    weights = {**twin.random_params(cfg, seed), **twin.random_buffers(cfg, seed + 2)}
    batch = test_parity.make_batch(cfg, seed + 1, mask_kind, BATCH_SIZE)
    return cfg, weights, batch


def routing_premise(cfg, weights, batch):
    """Step-0 routing maps of every MoE layer and micro-batch agree between the float32 and the float64 twin."""
    rows = BATCH_SIZE // MICROBATCHES
    failures = []
    for m in range(MICROBATCHES):
        part = slice(m * rows, (m + 1) * rows)
        maps = []
        for dtype in (torch.float32, torch.float64):
            buffers = set(twin.buffer_names(cfg))
            params = {n: torch.tensor(np.asarray(v), dtype=dtype) for n, v in weights.items() if n not in buffers}
            state = twin.new_moe_state(cfg, {n: weights[n] for n in buffers})
            tokens = torch.tensor(np.asarray(batch["tokens"])[part], dtype=torch.long)
            labels = torch.tensor(np.asarray(batch["labels"])[part]).long()
            with torch.no_grad():
                _, _, info = twin.megatron_forward(params, cfg, tokens, labels,
                                                   torch.tensor(batch["loss_mask"][part], dtype=dtype),
                                                   moe_state=state, training=True, return_moe_info=True)
            maps.append({i: layer["routing_map"].numpy() for i, layer in info["layers"].items()})
        failures += [f"micro-batch {m}, layer {i}: float32 and float64 twins route "
                     f"{int(np.sum(maps[0][i] != maps[1][i]))} token-expert pairs differently (near-tie; pick another "
                     f"seed)" for i in maps[0] if not np.array_equal(maps[0][i], maps[1][i])]
    return failures


def has_aux_or_z(cfg):
    m = cfg["moe"]
    return bool(m.get("z_loss_coeff")) or any(c for t, c in zip(m["load_balancing_types"], m["aux_loss_coeffs"])
                                               if t in ("aux_loss", "seq_aux_loss", "global_aux_loss"))


def compare_aux_only(parity_exe, label, cfg, weights, batch, workdir, failures, worst):
    """The gradient of the aux / z losses alone (one step), C++ against the twin, each tensor on its own scale."""
    ref = twin.run_megatron(cfg, weights, batch, 1, LR, WEIGHT_DECAY, CLIP_GRAD, eps=ADAM_EPS, dtype=torch.float32,
                            microbatches=MICROBATCHES, lm_weight=0.0)
    router = [n for n in ref if n.startswith("grad.") and n.endswith("mlp.router.weight")]
    if not router or not all(np.max(np.abs(ref[n])) > 0 for n in router):
        failures.append(f"{label}: aux-only: the twin's router weights get no aux / z-loss gradient")
    zero_mask = {**batch, "loss_mask": np.zeros_like(batch["loss_mask"])}
    cpp, error = test_parity.run_harness(parity_exe, label + ".aux_only", cfg, weights, zero_mask, workdir, steps=1,
                                         microbatches=MICROBATCHES)
    if error:
        failures.append(error)
        return
    grads = {n: v for n, v in ref.items() if n.startswith("grad.")}
    aux_failures, aux_worst = [], {}
    test_parity.compare({n: cpp[n] for n in grads if n in cpp}, grads, label, aux_failures, aux_worst)
    failures += [line.replace(f"{label}: ", f"{label}: aux-only ", 1) for line in aux_failures]
    worst["aux_only_grad"] = aux_worst.get("grad", 0.0)


def run_config(parity_exe, label, overrides, workdir, seed):
    cfg, weights, batch = prepare(label, overrides, seed)
    failures = [f"{label}: {line}" for line in routing_premise(cfg, weights, batch)]
    ref = twin.run_megatron(cfg, weights, batch, STEPS, LR, WEIGHT_DECAY, CLIP_GRAD, eps=ADAM_EPS, dtype=torch.float32,
                            microbatches=MICROBATCHES)
    if not np.all(np.isfinite(ref["losses"])):
        failures.append(f"{label}: twin losses not finite")
    if parity_exe is None:
        return failures, {"twin_loss": float(ref["loss"]), "lb": float(np.max(ref["load_balancing_loss"]))}
    cpp, error = test_parity.run_harness(parity_exe, label, cfg, weights, batch, workdir, microbatches=MICROBATCHES)
    if error:
        return failures + [error], {}
    worst = {}
    test_parity.compare(cpp, ref, label, failures, worst, test_parity.structurally_zero_grad(cfg))
    if has_aux_or_z(cfg):
        compare_aux_only(parity_exe, label, cfg, weights, batch, workdir, failures, worst)
    return failures, worst


def main():
    test_parity.matrix_main(CONFIGS, run_config, seed_base=3000, passed_text="all MoE parity comparisons passed", twin_only_text="twin side of the MoE parity matrix ok")


if __name__ == "__main__":
    main()
