"""Self-tests of the MoE twin (twin_moe.py and its use in twin.py), in float64, against independent naive
formulas, exact known values (uniform routing gives aux 1) and torch.autograd.gradcheck.

Usage: /usr/bin/python3 test_twin_moe.py [-v]   (unittest; a few seconds)
"""
import math
import os
import sys
import unittest

import numpy as np
import torch
import torch.nn.functional as F

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import twin  # noqa: E402
import twin_moe  # noqa: E402

D = torch.float64


def moe_cfg(**overrides):
    base = {"num_experts": 4, "ffn_hidden_size": 6, "moe_layer_pattern": [1], "topk": 2}
    base.update(overrides)
    return twin_moe.full_moe_config(base, 1)


def make_params(m, H, activation="gelu", add_bias=True, seed=0, router_scale=1.0):
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape, kind in twin_moe.moe_param_specs("", m, H, activation, add_bias):
        if kind == "weight":
            value = rng.standard_normal(shape) / math.sqrt(shape[1])
            if "router" in name:
                value *= router_scale
        else:
            value = 0.1 * rng.standard_normal(shape)
        params[name] = torch.tensor(value, dtype=D, requires_grad=True)
    return params


def act_fn(name):
    return lambda t: twin._activation(t, {"activation": name})


def random_x(S, B, H, seed=1):
    return torch.tensor(np.random.default_rng(seed).standard_normal((S, B, H)), dtype=D)


def naive_aux(scores_TE, k, coeff):
    """coeff * E * sum_i f_i P_i with f_i = (# tokens whose top-k of scores holds i) / (k T), P_i = mean_t S_ti."""
    s = np.asarray(scores_TE, dtype=np.float64)
    T, E = s.shape
    f = np.zeros(E)
    for t in range(T):
        for i in np.argsort(-s[t], kind="stable")[:k]:
            f[i] += 1.0 / (k * T)
    P = s.mean(axis=0)
    return coeff * E * float(np.sum(f * P))


def norm_scores(logits, fn):
    if fn == "softmax":
        return torch.softmax(logits, -1)
    s = torch.sigmoid(logits) if fn == "sigmoid" else torch.sqrt(F.softplus(logits))
    return s / s.sum(-1, keepdim=True)


class AuxLossTest(unittest.TestCase):
    def test_uniform_routing_gives_exactly_one(self):
        for fn in ("softmax", "sigmoid", "sqrtsoftplus"):
            for k in (1, 2, 3):
                m = moe_cfg(num_experts=6, topk=k, score_function=fn, load_balancing_types=["aux_loss"],
                            aux_loss_coeffs=[0.25], pre_softmax=(k == 1))
                params = make_params(m, 5, add_bias=False)
                with torch.no_grad():
                    params["mlp.router.weight"].zero_()
                _, _, info = twin_moe.router_forward(random_x(4, 3, 5), params, "", m, twin_moe.RouterState(6))
                self.assertAlmostEqual(info["load_balancing_loss"][0], 1.0, places=13, msg=f"{fn} k={k}")
                self.assertAlmostEqual(info["aux_losses"][0].item(), 0.25, places=13)

    def test_aux_matches_naive_formula(self):
        for fn in ("softmax", "sigmoid", "sqrtsoftplus"):
            m = moe_cfg(num_experts=5, topk=2, score_function=fn, aux_loss_coeffs=[0.1])
            params = make_params(m, 6, seed=3, router_scale=3.0)
            _, _, info = twin_moe.router_forward(random_x(5, 2, 6, seed=4), params, "", m, twin_moe.RouterState(5))
            expected = naive_aux(norm_scores(info["logits"].detach(), fn), 2, 1.0)
            self.assertAlmostEqual(info["load_balancing_loss"][0], expected, places=12, msg=fn)

    def test_seq_aux_is_mean_over_sequences_and_equals_aux_for_batch_one(self):
        S, B, H = 6, 3, 5
        m = moe_cfg(num_experts=4, topk=2, score_function="sigmoid", load_balancing_types=["aux_loss", "seq_aux_loss"],
                    aux_loss_coeffs=[1.0, 1.0])
        params = make_params(m, H, seed=5, router_scale=3.0)
        _, _, info = twin_moe.router_forward(random_x(S, B, H, seed=6), params, "", m, twin_moe.RouterState(4))
        scores = norm_scores(info["logits"].detach(), "sigmoid").numpy().reshape(S, B, 4)
        expected = np.mean([naive_aux(scores[:, b], 2, 1.0) for b in range(B)])
        self.assertAlmostEqual(info["load_balancing_loss"][1], expected, places=12)
        _, _, info1 = twin_moe.router_forward(random_x(S, 1, H, seed=7), params, "", m, twin_moe.RouterState(4))
        self.assertAlmostEqual(info1["load_balancing_loss"][0], info1["load_balancing_loss"][1], places=13)
        self.assertNotAlmostEqual(info["load_balancing_loss"][0], info["load_balancing_loss"][1], places=6)

    def test_global_aux_accumulates_and_resets(self):
        H, E, k = 5, 4, 2
        m = moe_cfg(num_experts=E, topk=k, load_balancing_types=["global_aux_loss"], aux_loss_coeffs=[1.0])
        params = make_params(m, H, seed=8, router_scale=3.0)
        state = twin_moe.RouterState(E)
        xs = [random_x(4, 2, H, seed=10 + i) for i in range(3)]

        def scores_and_counts(x):
            logits = F.linear(x.reshape(-1, H), params["mlp.router.weight"], params["mlp.router.bias"]).detach()
            s = torch.softmax(logits, -1).numpy()
            counts = np.zeros(E)
            for row in s:
                counts[np.argsort(-row, kind="stable")[:k]] += 1
            return s, counts

        seen = []
        for x in xs:
            _, _, info = twin_moe.router_forward(x, params, "", m, state)
            s, counts = scores_and_counts(x)
            seen.append(counts)
            T = s.shape[0]
            expected = E / (k * T * T) * float(np.sum(s.sum(0) * np.mean(seen, axis=0)))
            self.assertAlmostEqual(info["load_balancing_loss"][0], expected, places=12)
        self.assertEqual(state.ga_steps, 3)
        state.finish_global_batch(m)
        self.assertEqual(state.ga_steps, 0)
        _, _, info = twin_moe.router_forward(xs[1], params, "", m, state)
        self.assertAlmostEqual(info["load_balancing_loss"][0], naive_aux(scores_and_counts(xs[1])[0], k, 1.0),
                               places=12)

    def test_z_loss(self):
        m = moe_cfg(z_loss_coeff=0.01)
        params = make_params(m, 5, seed=9)
        _, _, info = twin_moe.router_forward(random_x(3, 2, 5), params, "", m, twin_moe.RouterState(4))
        logits = info["logits"].detach().numpy()
        lse = np.log(np.exp(logits).sum(-1))
        self.assertAlmostEqual(info["z_loss"], float(np.mean(lse ** 2)), places=12)


class RoutingTest(unittest.TestCase):
    def test_softmax_pre_post_sigmoid_probs(self):
        H = 6
        x = random_x(4, 2, H, seed=20)
        for fn, pre, k, scale in (("softmax", False, 2, None), ("softmax", True, 2, 2.5), ("sigmoid", False, 3, 2.5),
                                  ("sqrtsoftplus", False, 1, None), ("sigmoid", False, 1, None)):
            m = moe_cfg(num_experts=6, topk=k, score_function=fn, pre_softmax=pre, topk_scaling_factor=scale)
            params = make_params(m, H, seed=21, router_scale=2.0)
            probs, rmap, info = twin_moe.router_forward(x, params, "", m, twin_moe.RouterState(6))
            logits = info["logits"].detach().numpy()
            for t in range(logits.shape[0]):
                top = np.argsort(-logits[t], kind="stable")[:k]  # every score function is monotone in the logit
                self.assertEqual(sorted(top), sorted(np.nonzero(rmap[t].numpy())[0]))
                z = logits[t]
                if fn == "softmax" and not pre:
                    expected = np.exp(z[top]) / np.exp(z[top]).sum()
                elif fn == "softmax":
                    expected = np.exp(z[top]) / np.exp(z).sum()
                else:
                    s = 1 / (1 + np.exp(-z)) if fn == "sigmoid" else np.sqrt(np.log1p(np.exp(z)))
                    expected = s[top] / (s[top].sum() + 1e-20) if k > 1 else s[top]
                expected = expected * (scale or 1.0)
                np.testing.assert_allclose(probs[t].detach().numpy()[top], expected, rtol=1e-12)
                self.assertEqual(np.count_nonzero(probs[t].detach().numpy()), k)

    def test_group_limited_hits_at_most_group_topk_groups(self):
        E, G, g, k = 8, 4, 2, 4
        m = moe_cfg(num_experts=E, topk=k, score_function="sigmoid", num_groups=G, group_topk=g)
        params = make_params(m, 6, seed=22, router_scale=3.0)
        _, rmap, info = twin_moe.router_forward(random_x(8, 3, 6, seed=23), params, "", m, twin_moe.RouterState(E))
        scores = torch.sigmoid(info["logits"].detach()).numpy()
        plain_differs = 0
        for t in range(scores.shape[0]):
            chosen = np.nonzero(rmap[t].numpy())[0]
            self.assertEqual(len(chosen), k)
            self.assertLessEqual(len(set(chosen // (E // G))), g)
            # naive: best g groups by the sum of their top-(k/g) scores, then top-k inside them
            group_score = [np.sort(scores[t, j * 2:(j + 1) * 2])[::-1][:k // g].sum() for j in range(G)]
            groups = np.argsort(-np.array(group_score), kind="stable")[:g]
            allowed = [e for e in range(E) if e // (E // G) in groups]
            expected = sorted(sorted(allowed, key=lambda e: -scores[t, e])[:k])
            self.assertEqual(sorted(chosen), expected)
            plain_differs += sorted(np.argsort(-scores[t])[:k]) != expected
        self.assertGreater(plain_differs, 0)  # the group limit actually changed some routing

    def test_expert_bias_selects_but_does_not_weigh(self):
        E = 4
        m = moe_cfg(num_experts=E, topk=2, score_function="sigmoid", enable_expert_bias=True)
        params = make_params(m, 5, seed=24)
        state = twin_moe.RouterState(E, np.array([10.0, 0.0, 0.0, 0.0]))
        probs, rmap, info = twin_moe.router_forward(random_x(4, 2, 5), params, "", m, state)
        self.assertTrue(bool(rmap[:, 0].all()))
        s = torch.sigmoid(info["logits"].detach())
        for t in range(s.shape[0]):
            chosen = np.nonzero(rmap[t].numpy())[0]
            np.testing.assert_allclose(probs[t, chosen].detach().numpy(), (s[t, chosen] / s[t, chosen].sum()).numpy(),
                                       rtol=1e-12)
        np.testing.assert_array_equal(state.local_tokens_per_expert.numpy(), rmap.sum(0).numpy())

    def test_expert_bias_sign_rule(self):
        m = moe_cfg(num_experts=4, score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01)
        state = twin_moe.RouterState(4, np.array([0.1, -0.2, 0.0, 0.3], dtype=np.float32))
        state.local_tokens_per_expert = torch.tensor([10.0, 2.0, 6.0, 6.0], dtype=torch.float64)  # mean 6
        state.finish_global_batch(m)
        expected = np.array([0.1, -0.2, 0.0, 0.3], dtype=np.float32) + np.float32(0.01) * np.array(
            [-1, 1, 0, 0], dtype=np.float32)
        np.testing.assert_array_equal(state.expert_bias.numpy(), expected)
        self.assertEqual(float(state.local_tokens_per_expert.abs().sum()), 0.0)

    def test_sinkhorn_routing(self):
        m = moe_cfg(num_experts=4, topk=2, load_balancing_types=["sinkhorn"], aux_loss_coeffs=[0.0])
        params = make_params(m, 5, seed=25, router_scale=3.0)
        probs, rmap, info = twin_moe.router_forward(random_x(6, 2, 5), params, "", m, twin_moe.RouterState(4))
        logits = info["logits"].detach()
        balanced = twin_moe.sinkhorn(logits.float()).double()
        # a sinkhorn-balanced matrix has (nearly) equal column sums
        col = balanced.sum(0)
        self.assertLess(float((col.max() - col.min()) / col.mean()), 1e-2)
        soft = torch.softmax(logits, -1)
        for t in range(logits.shape[0]):
            chosen = np.nonzero(rmap[t].numpy())[0]
            self.assertEqual(sorted(chosen), sorted(np.argsort(-balanced[t].numpy())[:2]))
            np.testing.assert_allclose(probs[t, chosen].detach().numpy(), soft[t, chosen].numpy(), rtol=1e-12)


class CapacityTest(unittest.TestCase):
    def setUp(self):
        self.S, self.B, self.H, self.E, self.k = 6, 4, 5, 4, 2
        self.x = random_x(self.S, self.B, self.H, seed=30)

    def route(self, **kw):
        m = moe_cfg(num_experts=self.E, topk=self.k, **kw)
        params = make_params(m, self.H, seed=31, router_scale=3.0)
        return twin_moe.router_forward(self.x, params, "", m, twin_moe.RouterState(self.E)), m, params

    def test_capacity_counts(self):
        T = self.S * self.B
        (_, dropless, _), _, _ = self.route()
        self.assertEqual(int(dropless.sum()), T * self.k)
        for policy in ("probs", "position"):
            (probs, rmap, info), _, _ = self.route(capacity_factor=0.5, drop_policy=policy,
                                                   pad_expert_input_to_capacity=True)
            C = math.ceil(T * self.k / self.E * 0.5)
            self.assertEqual(info["capacity"], C)
            self.assertEqual(int(rmap.sum()), T * self.k * 0.5)
            self.assertTrue(bool((rmap.sum(0) == C).all()))
            (probs_nopad, rmap_nopad, _), _, _ = self.route(capacity_factor=0.5, drop_policy=policy)
            self.assertLessEqual(int(rmap_nopad.sum()), T * self.k * 0.5)
            self.assertTrue(bool((rmap_nopad.sum(0) <= C).all()))
            self.assertTrue(bool((rmap_nopad <= rmap).all()))
            np.testing.assert_array_equal(probs.detach().numpy(), probs_nopad.detach().numpy())

    def test_drop_policies_keep_the_right_tokens(self):
        C = math.ceil(self.S * self.B * self.k / self.E * 0.5)
        (probs_dropless, map_dropless, _), _, _ = self.route()
        p = probs_dropless.detach().numpy()
        for policy in ("probs", "position"):
            (_, rmap, _), _, _ = self.route(capacity_factor=0.5, drop_policy=policy)
            for e in range(self.E):
                routed = np.nonzero(map_dropless[:, e].numpy())[0]
                if policy == "probs":
                    keep = routed[np.argsort(-p[routed, e], kind="stable")[:C]]
                else:
                    keep = routed[:C]
                self.assertEqual(sorted(np.nonzero(rmap[:, e].numpy())[0]), sorted(keep), f"{policy} expert {e}")

    def test_drop_and_pad_gives_same_output_as_drop(self):
        outs = []
        for pad in (False, True):
            m = moe_cfg(num_experts=self.E, topk=self.k, capacity_factor=0.5, pad_expert_input_to_capacity=pad)
            params = make_params(m, self.H, seed=31, router_scale=3.0)
            y, _ = twin_moe.moe_layer_forward(self.x, params, "", m, act_fn("gelu"), twin_moe.RouterState(self.E))
            outs.append(y.detach().numpy())
        np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-14)

    def test_capacity_above_tokens_drops_nothing(self):
        (_, rmap, info), _, _ = self.route(capacity_factor=10.0)
        self.assertGreater(info["capacity"], self.S * self.B)
        self.assertEqual(int(rmap.sum()), self.S * self.B * self.k)


class LayerTest(unittest.TestCase):
    def test_dense_equivalent(self):
        """E = 1, top-1, softmax: prob exactly 1, output == the dense MLP with the same weights."""
        H = 6
        for activation in ("gelu", "swiglu", "squared_relu"):
            m = moe_cfg(num_experts=1, topk=1, ffn_hidden_size=7)
            params = make_params(m, H, activation=activation, seed=40)
            x = random_x(5, 2, H, seed=41)
            y, info = twin_moe.moe_layer_forward(x, params, "", m, act_fn(activation), twin_moe.RouterState(1))
            self.assertTrue(bool((info["probs"] == 1.0).all()))
            e = "mlp.experts.local_experts.0."
            h = act_fn(activation)(F.linear(x, params[e + "linear_fc1.weight"], params[e + "linear_fc1.bias"]))
            dense = F.linear(h, params[e + "linear_fc2.weight"], params[e + "linear_fc2.bias"])
            np.testing.assert_allclose(y.detach().numpy(), dense.detach().numpy(), rtol=0, atol=1e-13)

    def test_layer_matches_naive_loop(self):
        """Per token: sum over its experts of p * (fc2(act(fc1 x))) + shared * sigmoid(gate)."""
        H = 5
        m = moe_cfg(num_experts=4, topk=2, shared_expert_intermediate_size=3, shared_expert_gate=True)
        params = make_params(m, H, activation="swiglu", seed=42)
        x = random_x(3, 2, H, seed=43)
        y, info = twin_moe.moe_layer_forward(x, params, "", m, act_fn("swiglu"), twin_moe.RouterState(4))
        P = {k: v.detach().numpy() for k, v in params.items()}
        silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
        swiglu = lambda v: silu(v[:len(v) // 2]) * v[len(v) // 2:]  # noqa: E731
        xt = x.numpy().reshape(-1, H)
        probs = info["probs"].detach().numpy()
        for t in range(xt.shape[0]):
            expected = np.zeros(H)
            for e in np.nonzero(probs[t])[0]:
                q = f"mlp.experts.local_experts.{e}."
                h = swiglu(P[q + "linear_fc1.weight"] @ xt[t] + P[q + "linear_fc1.bias"])
                expected += probs[t, e] * (P[q + "linear_fc2.weight"] @ h + P[q + "linear_fc2.bias"])
            s = "mlp.shared_experts."
            gate = 1 / (1 + np.exp(-(P[s + "gate_weight"] @ xt[t])[0]))
            expected += gate * (P[s + "linear_fc2.weight"] @ swiglu(P[s + "linear_fc1.weight"] @ xt[t]))
            np.testing.assert_allclose(y.detach().numpy().reshape(-1, H)[t], expected, rtol=1e-12, atol=1e-13)

    def test_no_aux_means_no_router_grad_from_aux(self):
        """coeff 0: the router weight's gradient is only the probs path; a pure aux objective gives zero grad."""
        m = moe_cfg(num_experts=4, topk=2, aux_loss_coeffs=[0.0])
        params = make_params(m, 5, seed=44)
        y, _ = twin_moe.moe_layer_forward(random_x(3, 2, 5), params, "", m, act_fn("gelu"), twin_moe.RouterState(4))
        (y * 0.0).sum().backward()
        self.assertEqual(float(params["mlp.router.weight"].grad.abs().sum()), 0.0)
        m = moe_cfg(num_experts=4, topk=2, aux_loss_coeffs=[0.1])
        params = make_params(m, 5, seed=44)
        y, _ = twin_moe.moe_layer_forward(random_x(3, 2, 5), params, "", m, act_fn("gelu"), twin_moe.RouterState(4))
        (y * 0.0).sum().backward()
        self.assertGreater(float(params["mlp.router.weight"].grad.abs().sum()), 0.0)


GRADCHECK_CONFIGS = {
    "softmax_post_aux_z": (dict(topk=2, aux_loss_coeffs=[0.3], z_loss_coeff=0.05), "gelu", True, 1.0),
    "softmax_pre_seqaux_capacity_probs_pad": (
        dict(topk=2, pre_softmax=True, load_balancing_types=["seq_aux_loss"], aux_loss_coeffs=[0.2],
             capacity_factor=0.75, pad_expert_input_to_capacity=True), "swiglu", True, 0.5),
    "sigmoid_groups_bias_scaling_globalaux_aux": (
        dict(num_experts=8, topk=4, score_function="sigmoid", num_groups=4, group_topk=2, enable_expert_bias=True,
             topk_scaling_factor=2.0, load_balancing_types=["global_aux_loss", "aux_loss"],
             aux_loss_coeffs=[0.2, 0.1], z_loss_coeff=0.01), "squared_relu", False, 1.0),
    "sqrtsoftplus_top1_probs_on_input_position": (
        dict(topk=1, score_function="sqrtsoftplus", apply_probs_on_input=True, capacity_factor=1.0,
             drop_policy="position", aux_loss_coeffs=[0.5]), "gelu", True, 1.0),
    "sinkhorn_shared_gate": (
        dict(topk=2, load_balancing_types=["sinkhorn"], aux_loss_coeffs=[0.0], shared_expert_intermediate_size=4,
             shared_expert_gate=True, z_loss_coeff=0.02), "swiglu", False, 1.0),
}


class GradcheckTest(unittest.TestCase):
    def test_layer_output_plus_aux_objective(self):
        """(1) torch.autograd.gradcheck of J = sum(y * R) + s * (sum of the aux/z losses), the losses added
        explicitly (scaler scale 0), over the input and every parameter; (2) the gradient of sum(y * R) with the
        losses attached by AuxLossAutoScaler (scale s, Megatron's way) equals J's analytic gradient. gradcheck cannot
        check (2) directly: the scaler's gradient is by design not proportional to the output's grad_output."""
        S, B, H = 3, 2, 4
        for label, (overrides, activation, add_bias, scale) in GRADCHECK_CONFIGS.items():
            m = moe_cfg(**overrides)
            E = m["num_experts"]
            params = make_params(m, H, activation=activation, add_bias=add_bias, seed=50, router_scale=2.0)
            names = sorted(params)
            x = random_x(S, B, H, seed=51).requires_grad_(True)
            R = random_x(S, B, H, seed=52)
            bias0 = np.random.default_rng(53).standard_normal(E) * 0.05
            inputs = (x, *[params[n] for n in names])

            def run(values, scaler_scale):
                p = dict(zip(names, values[1:]))
                state = twin_moe.RouterState(E, bias0)  # fresh: global aux / counts must not leak between calls
                return twin_moe.moe_layer_forward(values[0], p, "", m, act_fn(activation), state,
                                                  aux_grad_scale=scaler_scale)

            def explicit(*values):
                y, info = run(values, 0.0)
                return (y * R).sum() + scale * sum(info["aux_losses"])

            with self.subTest(config=label):
                # full Jacobian for the first config, random projections (fast_mode) for the others: a few seconds
                self.assertTrue(torch.autograd.gradcheck(explicit, inputs, eps=1e-6, atol=1e-7, rtol=1e-6,
                                                         fast_mode=label != "softmax_post_aux_z"))
                g_explicit = torch.autograd.grad(explicit(*inputs), inputs, allow_unused=True)
                y, info = run(inputs, scale)
                self.assertGreater(len(info["aux_losses"]), 0)
                g_scaler = torch.autograd.grad((y * R).sum(), inputs, allow_unused=True)
                for name, a, b in zip(["x"] + names, g_scaler, g_explicit):
                    a = torch.zeros_like(x) if a is None else a
                    b = torch.zeros_like(x) if b is None else b
                    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-13, err_msg=name)


class ModelTest(unittest.TestCase):
    CFG = {"num_layers": 3, "hidden_size": 8, "ffn_hidden_size": 12, "num_attention_heads": 2,
           "num_query_groups": 2, "kv_channels": 4, "seq_length": 5, "max_position_embeddings": 5,
           "vocab_size": 20, "normalization": "RMSNorm", "activation": "swiglu", "position_embedding_type": "rope",
           "add_bias_linear": False,
           "moe": {"num_experts": 4, "ffn_hidden_size": 6, "moe_layer_pattern": [0, 1, 1], "topk": 2,
                   "score_function": "sigmoid", "enable_expert_bias": True, "load_balancing_types": ["seq_aux_loss"],
                   "aux_loss_coeffs": [0.1], "z_loss_coeff": 0.01, "shared_expert_intermediate_size": 4}}

    def batch(self):
        rng = np.random.default_rng(60)
        return {"tokens": rng.integers(0, 20, (2, 5)), "labels": rng.integers(0, 20, (2, 5))}

    def test_param_names(self):
        names = [n for n, _, _ in twin.param_specs(self.CFG)]
        self.assertIn("decoder.layers.0.mlp.linear_fc1.weight", names)
        self.assertNotIn("decoder.layers.1.mlp.linear_fc1.weight", names)
        self.assertIn("decoder.layers.2.mlp.router.weight", names)
        self.assertIn("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight", names)
        self.assertIn("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", names)
        shapes = {n: s for n, s, _ in twin.param_specs(self.CFG)}
        self.assertEqual(shapes["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"], (12, 8))
        self.assertEqual(shapes["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"], (8, 6))
        self.assertEqual(shapes["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"], (8, 8))
        self.assertEqual(twin.buffer_names(self.CFG), ["decoder.layers.1.mlp.router.expert_bias",
                                                       "decoder.layers.2.mlp.router.expert_bias"])

    def test_model_gradient_is_lm_plus_aux(self):
        """Directional derivative of lm + aux + z (float64 central differences) == <autograd grad of the reported lm
        loss (with the attached aux gradients), direction>; and the reported loss is the lm loss alone."""
        weights = twin.random_params(self.CFG, 61)
        buffers = twin.random_buffers(self.CFG, 62)
        b = self.batch()
        tokens, labels = torch.tensor(b["tokens"]), torch.tensor(b["labels"])
        mask = torch.ones(tokens.shape, dtype=D)
        params = {n: torch.tensor(v, dtype=D, requires_grad=True) for n, v in weights.items()}
        state = twin.new_moe_state(self.CFG, buffers)
        _, loss, info = twin.megatron_forward(params, self.CFG, tokens, labels, mask, moe_state=state,
                                              return_moe_info=True)
        # the lm loss alone, through a model with no aux losses attached (training=False skips them)
        _, lm_only = twin.megatron_forward(params, self.CFG, tokens, labels, mask, moe_state=state, training=False)
        self.assertEqual(loss.item(), lm_only.item())
        self.assertGreater(float(info["aux_total"]), 0.0)
        loss.backward()
        rng = np.random.default_rng(63)
        direction = {n: torch.tensor(rng.standard_normal(v.shape), dtype=D) for n, v in weights.items()}
        unused = [n for n in params if params[n].grad is None]
        self.assertTrue(all(".local_experts." in n for n in unused), unused)  # only experts without tokens
        analytic = sum(float((params[n].grad * direction[n]).sum()) for n in params if n not in unused)

        def total(sign, eps=1e-6):
            shifted = {n: (params[n].detach() + sign * eps * direction[n]) for n in params}
            _, lm, inf = twin.megatron_forward(shifted, self.CFG, tokens, labels, mask,
                                               moe_state=twin.new_moe_state(self.CFG, buffers), return_moe_info=True)
            return lm.item() + float(inf["aux_total"])

        numeric = (total(1) - total(-1)) / 2e-6
        self.assertAlmostEqual(analytic, numeric, delta=1e-6 * max(1.0, abs(numeric)))

    def test_run_megatron_outputs(self):
        cfg = self.CFG
        weights = {**twin.random_params(cfg, 64), **twin.random_buffers(cfg, 65)}
        out = twin.run_megatron(cfg, weights, self.batch(), steps=2)
        self.assertEqual(out["load_balancing_loss"].shape, (3, 2, 1))
        self.assertEqual(out["z_loss"].shape, (3, 2))
        b0 = weights["decoder.layers.1.mlp.router.expert_bias"]
        b1 = out["step1.decoder.layers.1.mlp.router.expert_bias"]
        steps = np.round((b1 - b0) / np.float32(1e-3)).astype(int)
        self.assertTrue(set(steps.tolist()) <= {-1, 0, 1} and np.any(steps != 0))
        self.assertNotIn("grad.decoder.layers.1.mlp.router.expert_bias", out)

    def test_dense_model_unchanged(self):
        cfg = {k: v for k, v in self.CFG.items() if k != "moe"}
        weights = twin.random_params(cfg, 66)
        out = twin.run_megatron(cfg, weights, self.batch(), steps=1)
        self.assertNotIn("load_balancing_loss", out)

    def test_bad_configs(self):
        bad = [dict(topk=5), dict(num_groups=3), dict(num_groups=2, group_topk=3),
               dict(enable_expert_bias=True), dict(load_balancing_types=["sinkhorn"], aux_loss_coeffs=[0.1]),
               dict(pad_expert_input_to_capacity=True), dict(aux_loss_coeffs=[0.1, 0.2]),
               dict(apply_probs_on_input=True), dict(score_function="tanh"), dict(moe_layer_pattern=[1, 1])]
        for overrides in bad:
            with self.subTest(overrides=overrides), self.assertRaises(ValueError):
                moe_cfg(**overrides)


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main()
