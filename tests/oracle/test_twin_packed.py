"""Self-tests of the twin's packed-sequence inputs (twin.py: position_ids and document_ids [B, S]), in float64.

The reference for a packed sample is the twin run on each of its documents alone (positions 0..len-1, plain causal
mask): with document ids (causal block-diagonal mask) and per-document positions the packed run must give the same
logits, and the gradient of the packed loss must be the token-weighted sum of the separate runs' gradients. Also
checked: explicit default ids change nothing, the mask and the positions really act (RoPE depends only on relative
positions; the learned table is indexed by the ids), and run_megatron / the command line read the optional fields.

Usage: /usr/bin/python3 test_twin_packed.py [-v]   (unittest; a few seconds)
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

D = torch.float64

BASE = {"num_layers": 2, "hidden_size": 16, "ffn_hidden_size": 24, "num_attention_heads": 4, "num_query_groups": 4,
        "kv_channels": 4, "seq_length": 12, "max_position_embeddings": 16, "vocab_size": 32}
CONFIGS = {
    "rope_rmsnorm_swiglu_gqa": {"normalization": "RMSNorm", "activation": "swiglu", "position_embedding_type": "rope",
                                "add_bias_linear": False, "num_query_groups": 2},
    "learned_absolute_layernorm_gelu_bias": {"position_embedding_type": "learned_absolute", "add_bias_linear": True},
    "rope_half_qk_layernorm": {"position_embedding_type": "rope", "rotary_percent": 0.5, "qk_layernorm": True},
    # Routing is per token (no capacity), so an MoE model is document-local too; aux losses span the whole batch and
    # are off here (they change gradients, never the logits).
    "moe_rope": {"position_embedding_type": "rope", "normalization": "RMSNorm", "activation": "swiglu",
                 "add_bias_linear": False,
                 "moe": {"num_experts": 4, "topk": 2, "ffn_hidden_size": 8, "moe_layer_pattern": [0, 1],
                         "aux_loss_coeffs": [0.0]}},
}

# Document lengths of each sample (sum = S = 12): a one-token document, several, and one spanning the sample.
DOCUMENT_LENGTHS = [[3, 1, 5, 3], [12], [1, 1, 10]]


def cfg_of(name):
    return {**BASE, **CONFIGS[name]}


def packed_ids(lengths_per_sample):
    """position_ids and document_ids [B, S] of samples cut into documents of the given lengths."""
    positions = [np.concatenate([np.arange(n) for n in lengths]) for lengths in lengths_per_sample]
    documents = [np.concatenate([np.full(n, i) for i, n in enumerate(lengths)]) for lengths in lengths_per_sample]
    return np.stack(positions).astype(np.int64), np.stack(documents).astype(np.int32)


def make_inputs(cfg, seed, B=len(DOCUMENT_LENGTHS)):
    rng = np.random.default_rng(seed)
    S, V = cfg["seq_length"], cfg["vocab_size"]
    tokens = torch.tensor(rng.integers(0, V, size=(B, S)), dtype=torch.long)
    labels = torch.tensor(rng.integers(0, V, size=(B, S)), dtype=torch.long)
    mask = torch.tensor((rng.random((B, S)) < 0.8).astype(np.float64), dtype=D)
    mask[:, 0] = 1.0  # every document below keeps at least one trained token
    return tokens, labels, mask


def params_of(cfg, seed):
    return {name: torch.tensor(value, dtype=D, requires_grad=True)
            for name, value in twin.random_params(cfg, seed).items()}


def grads(params):
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()}


def zero_grads(params):
    for p in params.values():
        p.grad = None


class PackedTwinTest(unittest.TestCase):
    def assert_close(self, actual, expected, msg, tol=1e-11):
        scale = max(float(expected.abs().max()), 1e-30)
        err = float((actual - expected).abs().max()) / scale
        self.assertLess(err, tol, msg=f"{msg}: rel error {err:.2e}")

    def test_default_ids_change_nothing(self):
        for name in CONFIGS:
            cfg = cfg_of(name)
            params = params_of(cfg, 1)
            tokens, labels, mask = make_inputs(cfg, 2)
            B, S = tokens.shape
            logits, loss = twin.megatron_forward(params, cfg, tokens, labels, mask)
            explicit, explicit_loss = twin.megatron_forward(
                params, cfg, tokens, labels, mask, position_ids_BS=torch.arange(S).repeat(B, 1),
                document_ids_BS=torch.zeros(B, S, dtype=torch.long))
            self.assertTrue(torch.equal(logits, explicit), msg=name)
            self.assertEqual(loss.item(), explicit_loss.item(), msg=name)

    def test_packed_run_equals_each_document_alone(self):
        positions, documents = packed_ids(DOCUMENT_LENGTHS)
        for name in CONFIGS:
            cfg = cfg_of(name)
            params = params_of(cfg, 3)
            tokens, labels, mask = make_inputs(cfg, 4)
            for b, lengths in enumerate(DOCUMENT_LENGTHS):
                mask[b, np.cumsum([0] + lengths[:-1])] = 1.0  # every document keeps a trained token
            logits, loss = twin.megatron_forward(params, cfg, tokens, labels, mask, position_ids_BS=positions,
                                                 document_ids_BS=documents)
            loss.backward()
            packed_grads = grads(params)
            zero_grads(params)

            # Each document alone; packed loss = sum over documents of (their loss * their tokens) / all tokens.
            total_tokens = mask.sum()
            weighted = 0.0
            for b, lengths in enumerate(DOCUMENT_LENGTHS):
                start = 0
                for n in lengths:
                    part = slice(start, start + n)
                    doc_logits, doc_loss = twin.megatron_forward(
                        params, cfg, tokens[b:b + 1, part], labels[b:b + 1, part], mask[b:b + 1, part])
                    self.assert_close(logits[part, b], doc_logits[:, 0], f"{name} sample {b} tokens {start}..")
                    weighted = weighted + doc_loss * mask[b, part].sum() / total_tokens
                    start += n
            self.assertAlmostEqual(loss.item(), weighted.item(), places=12, msg=name)
            weighted.backward()
            separate_grads = grads(params)
            zero_grads(params)
            for n, g in packed_grads.items():
                self.assert_close(g, separate_grads[n], f"{name} grad {n}", tol=1e-10)

    def test_document_mask_acts(self):
        """Without document ids a document's tokens see the earlier documents: different logits after the first."""
        positions, documents = packed_ids(DOCUMENT_LENGTHS)
        for name in ("rope_rmsnorm_swiglu_gqa", "learned_absolute_layernorm_gelu_bias"):
            cfg = cfg_of(name)
            params = params_of(cfg, 5)
            tokens, labels, mask = make_inputs(cfg, 6)
            packed, _ = twin.megatron_forward(params, cfg, tokens, labels, mask, position_ids_BS=positions,
                                              document_ids_BS=documents)
            positions_only, _ = twin.megatron_forward(params, cfg, tokens, labels, mask, position_ids_BS=positions)
            first = DOCUMENT_LENGTHS[0][0]
            self.assert_close(positions_only[:first, 0], packed[:first, 0], name)  # the first document: same
            self.assertGreater(float((positions_only[first:, 0] - packed[first:, 0]).abs().max()), 1e-3, msg=name)
            # A sample that is one document is unchanged by its (all-zero) document ids.
            self.assert_close(positions_only[:, 1], packed[:, 1], name)

    def test_rope_positions_are_relative_learned_positions_absolute(self):
        """RoPE depends on position differences only: shifting a sample's positions by a constant keeps its logits,
        a non-constant change does not. The learned table is indexed by the ids, so a shift changes the logits."""
        B, S = 3, BASE["seq_length"]
        shifted = torch.arange(S).repeat(B, 1) + torch.tensor([[0], [2], [3]])
        scrambled = torch.arange(S).repeat(B, 1)
        scrambled[:, S // 2:] += 2
        for name in ("rope_rmsnorm_swiglu_gqa", "rope_half_qk_layernorm", "learned_absolute_layernorm_gelu_bias"):
            cfg = cfg_of(name)
            params = params_of(cfg, 7)
            tokens, labels, mask = make_inputs(cfg, 8)
            plain, _ = twin.megatron_forward(params, cfg, tokens, labels, mask)
            moved, _ = twin.megatron_forward(params, cfg, tokens, labels, mask, position_ids_BS=shifted)
            other, _ = twin.megatron_forward(params, cfg, tokens, labels, mask, position_ids_BS=scrambled)
            self.assertGreater(float((other[S // 2:] - plain[S // 2:]).abs().max()), 1e-3, msg=name)
            if cfg["position_embedding_type"] == "rope":
                # Equal up to the rounding of the float32 angles (Megatron's table is float32): ~1e-7 of an angle.
                self.assert_close(moved, plain, name, tol=1e-6)
            else:
                self.assert_close(moved[:, 0], plain[:, 0], name)  # sample 0 is not shifted
                self.assertGreater(float((moved[:, 1] - plain[:, 1]).abs().max()), 1e-3, msg=name)

    def test_bad_shapes(self):
        cfg = cfg_of("rope_rmsnorm_swiglu_gqa")
        params = params_of(cfg, 9)
        tokens, labels, mask = make_inputs(cfg, 10)
        with self.assertRaises(ValueError):
            twin.megatron_forward(params, cfg, tokens, labels, mask, position_ids_BS=torch.zeros(3, 5))
        with self.assertRaises(ValueError):
            twin.megatron_forward(params, cfg, tokens, labels, mask, document_ids_BS=torch.zeros(2, 12))

    def test_run_megatron_and_command_line_read_the_optional_fields(self):
        positions, documents = packed_ids(DOCUMENT_LENGTHS)
        for name in ("rope_rmsnorm_swiglu_gqa", "moe_rope"):
            cfg = cfg_of(name)
            weights = twin.random_params(cfg, 11)
            tokens, labels, mask = make_inputs(cfg, 12)
            batch = {"tokens": tokens.numpy().astype(np.int32), "labels": labels.numpy().astype(np.int32),
                     "loss_mask": mask.numpy().astype(np.float32), "position_ids": positions,
                     "document_ids": documents}
            params = {n: torch.tensor(v, dtype=D) for n, v in weights.items()}
            expected, _ = twin.megatron_forward(params, cfg, tokens, labels, mask.to(D), position_ids_BS=positions,
                                                document_ids_BS=documents)
            out = twin.run_megatron(cfg, weights, batch, steps=0, dtype=D)
            self.assert_close(torch.tensor(out["logits"]), expected, name)
            # Three micro-batches of one sample each: the rows keep their own ids.
            if name == "rope_rmsnorm_swiglu_gqa":
                split = twin.run_megatron(cfg, weights, batch, steps=0, dtype=D, microbatches=3)
                self.assert_close(torch.tensor(split["logits"]), expected, name + " microbatches")
                without = twin.run_megatron(cfg, weights, {k: batch[k] for k in ("tokens", "labels", "loss_mask")},
                                            steps=0, dtype=D)
                self.assertGreater(float(np.abs(without["logits"] - out["logits"]).max()), 1e-3)
                with tempfile.TemporaryDirectory() as tmp:
                    paths = {k: os.path.join(tmp, k) for k in ("c.json", "w.st", "b.st", "o.st")}
                    with open(paths["c.json"], "w") as f:
                        json.dump(cfg, f)
                    st.save(paths["w.st"], weights)
                    st.save(paths["b.st"], batch)
                    twin.main(["megatron", "--config", paths["c.json"], "--weights", paths["w.st"], "--batch",
                               paths["b.st"], "--out", paths["o.st"], "--dtype", "float64"])
                    cli, _ = st.load(paths["o.st"])
                    self.assert_close(torch.tensor(cli["logits"]), expected, name + " command line")


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main()
