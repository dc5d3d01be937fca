"""HF export/import checks (no training):

1. Twin self-check: the twin's Megatron-named forward equals its HF-style Llama/Qwen3 forward on weights converted
   to HF names by this file (independent of the C++ mapping).
2. moecore_parity --export-hf: the exported tensors equal this file's conversion bit for bit; config.json carries
   the fields HF's LlamaConfig/Qwen3Config read, with the model's values; the twin's HF loader on the export gives
   the C++ logits (rel error < 1e-4, metric max|a-b| / max|b|).
3. moecore_parity --import-hf: loading the export back gives the same logits as the original model.
4. --export-hf-bf16 stores BF16 weights (round-to-nearest-even of the fp32 values) and torch_dtype bfloat16.
5. A LayerNorm/gelu model is refused with one clear line and no folder is created; a folder holding foreign files is
   not replaced; exporting over an earlier export replaces it.
6. MoE: the same checks 1-4 for Mixtral (model_type mixtral) and Qwen3-MoE (qwen3_moe, mixed dense/MoE layers, with
   and without norm_topk_prob) exports, the HF side computed by twin_hf_moe.py (HF's MoE routing: softmax over all
   experts, top-k, renormalised for Mixtral and for norm_topk_prob) and config.json checked against the field names
   of HF's MixtralConfig / Qwen3MoeConfig.

Usage: /usr/bin/python3 test_hf_export.py --parity PATH/TO/moecore_parity
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
import twin  # noqa: E402
import twin_hf_moe  # noqa: E402
from test_parity import BASE, make_batch, rel_error  # noqa: E402

TOLERANCE = 1e-4
LLAMA = {"normalization": "RMSNorm", "norm_epsilon": 1e-6, "activation": "swiglu", "position_embedding_type": "rope",
         "rotary_base": 10000.0, "num_query_groups": 2, "max_position_embeddings": 32}
CONFIGS = {
    "llama_tied_gqa_nobias": {**LLAMA, "add_bias_linear": False},
    "llama_untied_bias": {**LLAMA, "add_bias_linear": True, "untie_embeddings_and_output_weights": True,
                          "num_query_groups": 1, "rotary_base": 5e5},
    "qwen3_untied_gqa": {**LLAMA, "add_bias_linear": False, "qk_layernorm": True,
                         "untie_embeddings_and_output_weights": True},
}
MOE_CONFIGS = {
    "mixtral_top2": {**LLAMA, "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
                     "moe": {"num_experts": 4, "ffn_hidden_size": 48, "moe_layer_pattern": [1, 1], "topk": 2,
                             "aux_loss_coeffs": [0.01]}},
    "qwen3_moe_mixed_norm_topk": {**LLAMA, "add_bias_linear": False, "qk_layernorm": True, "num_layers": 3,
                                  "untie_embeddings_and_output_weights": True,
                                  "moe": {"num_experts": 8, "ffn_hidden_size": 32, "moe_layer_pattern": [0, 1, 1],
                                          "topk": 2}},
    "qwen3_moe_pre_softmax_tied": {**LLAMA, "add_bias_linear": False, "qk_layernorm": True,
                                   "moe": {"num_experts": 6, "ffn_hidden_size": 40, "moe_layer_pattern": [1, 1],
                                           "topk": 3, "pre_softmax": True}},
}


def to_hf(cfg, weights):
    """Megatron-named weights -> HF Llama/Qwen3 names, written from the layouts' definitions."""
    c = twin.full_config(cfg)
    N, G, d, F_ = c["num_attention_heads"], c["num_query_groups"], c["kv_channels"], c["ffn_hidden_size"]
    per_group = N // G
    out = {"model.embed_tokens.weight": weights["embedding.word_embeddings.weight"]}
    suffixes = ["weight", "bias"] if c["add_bias_linear"] else ["weight"]
    for i in range(c["num_layers"]):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = weights[m + "input_layernorm.weight"]
        for s in suffixes:
            qkv = weights[m + "self_attention.linear_qkv." + s]
            grouped = qkv.reshape(G, (per_group + 2) * d, *qkv.shape[1:])
            out[p + "self_attn.q_proj." + s] = grouped[:, :per_group * d].reshape(N * d, *qkv.shape[1:])
            k_rows = grouped[:, per_group * d:(per_group + 1) * d]
            out[p + "self_attn.k_proj." + s] = k_rows.reshape(G * d, *qkv.shape[1:])
            out[p + "self_attn.v_proj." + s] = grouped[:, (per_group + 1) * d:].reshape(G * d, *qkv.shape[1:])
            out[p + "self_attn.o_proj." + s] = weights[m + "self_attention.linear_proj." + s]
            if twin.is_moe_layer(c, i):
                continue
            fc1 = weights[m + "mlp.linear_fc1." + s]
            out[p + "mlp.gate_proj." + s] = fc1[:F_]
            out[p + "mlp.up_proj." + s] = fc1[F_:]
            out[p + "mlp.down_proj." + s] = weights[m + "mlp.linear_fc2." + s]
        if c["qk_layernorm"]:
            out[p + "self_attn.q_norm.weight"] = weights[m + "self_attention.q_layernorm.weight"]
            out[p + "self_attn.k_norm.weight"] = weights[m + "self_attention.k_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = weights[m + "pre_mlp_layernorm.weight"]
        if twin.is_moe_layer(c, i):
            out.update(moe_to_hf(c, weights, m, p))
    out["model.norm.weight"] = weights["decoder.final_layernorm.weight"]
    if c["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = weights["output_layer.weight"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def hf_model_type(c):
    if c["moe"] is not None:
        return "qwen3_moe" if c["qk_layernorm"] else "mixtral"
    return "qwen3" if c["qk_layernorm"] else "llama"


def moe_to_hf(c, weights, m, p):
    """One MoE layer: Megatron router/experts -> Mixtral (block_sparse_moe, w1 gate / w3 up / w2 down) or Qwen3-MoE
    (mlp.gate, experts.{e}.{gate,up,down}_proj) names; fc1 rows are [gate | up], Fe rows each."""
    mixtral = hf_model_type(c) == "mixtral"
    base = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    Fe = c["moe"]["ffn_hidden_size"]
    out = {base + "gate.weight": weights[m + "mlp.router.weight"]}
    for e in range(c["moe"]["num_experts"]):
        local = f"{m}mlp.experts.local_experts.{e}."
        fc1 = weights[local + "linear_fc1.weight"]
        x = f"{base}experts.{e}."
        out[x + names[0] + ".weight"] = fc1[:Fe]
        out[x + names[1] + ".weight"] = fc1[Fe:]
        out[x + names[2] + ".weight"] = weights[local + "linear_fc2.weight"]
    return out


def hf_forward(config, tensors, tokens):
    if config["model_type"] in twin_hf_moe.MOE_MODEL_TYPES:
        return twin_hf_moe.hf_moe_forward(config, tensors, tokens)
    return twin.hf_forward(config, tensors, tokens)


def expected_config(cfg):
    c = twin.full_config(cfg)
    model_type = hf_model_type(c)
    config = {
        "architectures": ["Qwen3ForCausalLM" if model_type == "qwen3" else "LlamaForCausalLM"],
        "model_type": model_type, "hidden_size": c["hidden_size"], "intermediate_size": c["ffn_hidden_size"],
        "num_hidden_layers": c["num_layers"], "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_query_groups"], "head_dim": c["kv_channels"],
        "max_position_embeddings": c["max_position_embeddings"], "rms_norm_eps": c["norm_epsilon"],
        "rope_theta": c["rotary_base"], "vocab_size": c["vocab_size"],
        "tie_word_embeddings": not c["untie_embeddings_and_output_weights"],
        "attention_bias": c["add_bias_linear"], "hidden_act": "silu", "bos_token_id": 50256, "eos_token_id": 50256,
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        config["mlp_bias"] = c["add_bias_linear"]
    m = c["moe"]
    if model_type == "mixtral":  # MixtralConfig
        config["architectures"] = ["MixtralForCausalLM"]
        del config["attention_bias"]
        config.update({"intermediate_size": m["ffn_hidden_size"], "num_local_experts": m["num_experts"],
                       "num_experts_per_tok": m["topk"], "router_aux_loss_coef": m["aux_loss_coeffs"][0]})
    if model_type == "qwen3_moe":  # Qwen3MoeConfig
        config["architectures"] = ["Qwen3MoeForCausalLM"]
        config.update({"moe_intermediate_size": m["ffn_hidden_size"], "num_experts": m["num_experts"],
                       "num_experts_per_tok": m["topk"], "norm_topk_prob": not m["pre_softmax"],
                       "decoder_sparse_step": 1, "router_aux_loss_coef": m["aux_loss_coeffs"][0],
                       "mlp_only_layers": [i for i in range(c["num_layers"]) if not m["moe_layer_pattern"][i]],
                       "use_sliding_window": False})
    return config


def bf16_round(values):
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


class Checker:
    def __init__(self):
        self.failures = []

    def check(self, ok, message):
        if not ok:
            self.failures.append(message)
        return ok

    def close(self, label, a, b):
        err = rel_error(a, b)
        self.check(err < TOLERANCE, f"{label}: rel error {err:.3e} >= {TOLERANCE:g}")
        return err


def run_parity(exe, *args):
    return subprocess.run([exe, *args], capture_output=True, text=True)


def check_config(chk, label, cfg, export_dir, torch_dtype="float32"):
    with open(os.path.join(export_dir, "config.json")) as f:
        config = json.load(f)
    expected = {**expected_config(cfg), "torch_dtype": torch_dtype}
    for key in expected:
        chk.check(key in config and config[key] == expected[key],
                  f"{label}: config.json {key} = {config.get(key)!r}, expected {expected[key]!r}")
    if expected["model_type"] == "llama":
        chk.check(config.get("mlp_bias") == cfg.get("add_bias_linear"), f"{label}: config.json mlp_bias")
    chk.check(config.get("rope_scaling") is None, f"{label}: config.json rope_scaling must be null")
    chk.check(os.path.exists(os.path.join(export_dir, "generation_config.json")), f"{label}: no generation_config")
    return config


def check_model(chk, exe, label, overrides, workdir, seed):
    cfg = {**BASE, **overrides}
    weights = twin.random_params(cfg, seed)
    batch = make_batch(cfg, seed + 1, "ones")
    files = {k: os.path.join(workdir, f"{label}.{k}") for k in ("config.json", "w.safetensors", "b.safetensors",
                                                                "out.safetensors", "import.safetensors")}
    with open(files["config.json"], "w") as f:
        json.dump(cfg, f)
    st.save(files["w.safetensors"], weights)
    st.save(files["b.safetensors"], batch)
    tokens = torch.tensor(batch["tokens"], dtype=torch.long)
    hf_expected = to_hf(cfg, weights)
    errors = {}

    # 1. Twin self-check, independent of the C++ code.
    megatron_logits, _ = twin.megatron_forward({k: torch.tensor(v) for k, v in weights.items()}, cfg, tokens,
                                               torch.tensor(batch["labels"]), torch.tensor(batch["loss_mask"]))
    hf_logits = hf_forward(expected_config(cfg), hf_expected, tokens)
    errors["twin_megatron_vs_hf"] = chk.close(f"{label}: twin megatron vs twin HF forward",
                                              megatron_logits.permute(1, 0, 2).numpy(), hf_logits.numpy())

    # 2. C++ export.
    export_dir = os.path.join(workdir, f"{label}.hf")
    result = run_parity(exe, "--config", files["config.json"], "--weights", files["w.safetensors"], "--batch",
                        files["b.safetensors"], "--out", files["out.safetensors"], "--export-hf", export_dir)
    if not chk.check(result.returncode == 0, f"{label}: moecore_parity --export-hf failed: {result.stderr.strip()}"):
        return errors
    config = check_config(chk, label, cfg, export_dir)
    exported, metadata = st.load(os.path.join(export_dir, "model.safetensors"))
    chk.check(metadata.get("format") == "pt", f"{label}: model.safetensors metadata format != pt")
    chk.check(set(exported) == set(hf_expected),
              f"{label}: exported names differ: extra {sorted(set(exported) - set(hf_expected))[:4]}, "
              f"missing {sorted(set(hf_expected) - set(exported))[:4]}")
    for name in sorted(set(exported) & set(hf_expected)):
        chk.check(exported[name].dtype == np.float32 and np.array_equal(exported[name], hf_expected[name]),
                  f"{label}: exported {name} differs from the Megatron weights it should hold")
    cpp, _ = st.load(files["out.safetensors"])
    cpp_logits_BSV = np.transpose(cpp["logits"], (1, 0, 2))
    twin_logits = hf_forward(config, exported, tokens).numpy()
    errors["cpp_vs_twin_hf_loader"] = chk.close(f"{label}: C++ logits vs twin HF loader on the export",
                                                cpp_logits_BSV, twin_logits)

    # 3. Import the export back into C++.
    result = run_parity(exe, "--import-hf", export_dir, "--batch", files["b.safetensors"], "--out",
                        files["import.safetensors"])
    if chk.check(result.returncode == 0, f"{label}: moecore_parity --import-hf failed: {result.stderr.strip()}"):
        imported, _ = st.load(files["import.safetensors"])
        errors["cpp_import_vs_cpp"] = chk.close(f"{label}: C++ logits after --import-hf", imported["logits"],
                                                cpp["logits"])

    # 4. Exporting again over the same folder, now in bf16.
    result = run_parity(exe, "--config", files["config.json"], "--weights", files["w.safetensors"], "--batch",
                        files["b.safetensors"], "--out", files["out.safetensors"], "--export-hf", export_dir,
                        "--export-hf-bf16")
    if chk.check(result.returncode == 0, f"{label}: bf16 export failed: {result.stderr.strip()}"):
        check_config(chk, label + " (bf16)", cfg, export_dir, "bfloat16")
        with open(os.path.join(export_dir, "model.safetensors"), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        chk.check(all(v["dtype"] == "BF16" for k, v in header.items() if k != "__metadata__"),
                  f"{label}: bf16 export holds non-BF16 tensors")
        exported_bf16, _ = st.load(os.path.join(export_dir, "model.safetensors"))
        for name, value in hf_expected.items():
            chk.check(np.array_equal(exported_bf16.get(name), bf16_round(value)), f"{label}: bf16 {name} rounding")
        chk.check(not os.path.exists(export_dir + ".tmp"), f"{label}: temporary export folder left behind")
    return errors


def check_refusals(chk, exe, workdir):
    cfg = {**BASE, "normalization": "LayerNorm", "activation": "gelu", "position_embedding_type": "learned_absolute"}
    weights = twin.random_params(cfg, 7)
    cfg_path, w_path, b_path = (os.path.join(workdir, n) for n in ("ln.json", "ln.safetensors", "ln.b.safetensors"))
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    st.save(w_path, weights)
    st.save(b_path, make_batch(cfg, 8, "ones"))
    target = os.path.join(workdir, "ln.hf")
    result = run_parity(exe, "--config", cfg_path, "--weights", w_path, "--batch", b_path, "--out",
                        os.path.join(workdir, "ln.out"), "--export-hf", target)
    chk.check(result.returncode != 0 and "HF export supports llama/qwen3-style models" in result.stderr
              and "LayerNorm" in result.stderr and len(result.stderr.strip().splitlines()) == 1,
              f"LayerNorm export: expected one clear error line, got exit {result.returncode}: {result.stderr!r}")
    chk.check(not os.path.exists(target) and not os.path.exists(target + ".tmp"), "refused export left a folder")

    # A folder with somebody else's files is never replaced.
    llama = {**BASE, **CONFIGS["llama_tied_gqa_nobias"]}
    weights = twin.random_params(llama, 9)
    cfg_path, w_path = os.path.join(workdir, "l.json"), os.path.join(workdir, "l.safetensors")
    with open(cfg_path, "w") as f:
        json.dump(llama, f)
    st.save(w_path, weights)
    st.save(b_path, make_batch(llama, 10, "ones"))
    foreign = os.path.join(workdir, "precious")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "notes.txt"), "w") as f:
        f.write("keep me")
    result = run_parity(exe, "--config", cfg_path, "--weights", w_path, "--batch", b_path, "--out",
                        os.path.join(workdir, "l.out"), "--export-hf", foreign)
    chk.check(result.returncode != 0 and "refusing to replace" in result.stderr,
              f"export over a foreign folder: exit {result.returncode}: {result.stderr!r}")
    chk.check(os.listdir(foreign) == ["notes.txt"], "foreign folder was modified")

    # Import errors: a config HF import cannot represent.
    bad = os.path.join(workdir, "bad.hf")
    os.makedirs(bad)
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump({"model_type": "gpt2", "num_hidden_layers": 1}, f)
    result = run_parity(exe, "--import-hf", bad, "--batch", b_path, "--out", os.path.join(workdir, "bad.out"))
    chk.check(result.returncode != 0 and "model_type" in result.stderr and "config.json" in result.stderr,
              f"import of a gpt2 config: exit {result.returncode}: {result.stderr!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parity", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chk = Checker()
    with tempfile.TemporaryDirectory() as workdir:
        for index, (label, overrides) in enumerate({**CONFIGS, **MOE_CONFIGS}.items()):
            errors = check_model(chk, args.parity, label, overrides, workdir, seed=2000 + 31 * index)
            print(f"{label}: " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
        check_refusals(chk, args.parity, workdir)
    for line in chk.failures:
        print("FAIL " + line)
    if chk.failures:
        sys.exit(1)
    print("all HF export/import checks passed")


if __name__ == "__main__":
    main()
