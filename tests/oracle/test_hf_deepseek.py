"""moecore's DeepSeek-V3 HF export / import (model_type deepseek_v3) against the twins:

1. moecore_parity --export-hf: every exported tensor equals test_twin_hf_deepseek.to_hf's independent conversion of
   the Megatron weights bit for bit (no other tensor is written; MTP depths as layers num_hidden_layers + k),
   config.json carries the fields transformers'
   DeepseekV3Config reads, and twin_hf_deepseek's DeepseekV3ForCausalLM forward on the folder gives the C++ logits.
2. HF -> moecore -> HF: --import-hf of the export gives the C++ logits, and exporting the imported model again writes
   the same tensors bit for bit and the same config.json.
3. What DeepseekV3ForCausalLM cannot compute is refused with one line and no folder: standard attention, MLA without
   the latent norms, a group-limited router whose top-k is not twice its group top-k.

Usage: /usr/bin/python3 test_hf_deepseek.py --parity PATH/TO/moecore_parity
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

sys.dont_write_bytecode = True  # keep the source tree clean
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
import test_twin_hf_deepseek  # noqa: E402
import twin  # noqa: E402
import twin_hf_deepseek  # noqa: E402
from test_hf_export import Checker, run_parity  # noqa: E402
from test_parity import make_batch  # noqa: E402

BASE = {**test_twin_hf_deepseek.BASE, "seq_length": 16, "max_position_embeddings": 16, "num_query_groups": 4,
        "kv_channels": 8, "attention_dropout": 0.0, "hidden_dropout": 0.0}  # kv_channels = hidden / heads, unused by MLA
MLA = test_twin_hf_deepseek.MLA  # value heads 6 wide, query / key heads 16
MOE = {**test_twin_hf_deepseek.MOE, "aux_loss_coeffs": [1e-3], "load_balancing_types": ["seq_aux_loss"]}
CONFIGS = {
    "dsv3_like": {"mla": MLA, "moe": MOE,
                  "yarn": {"rotary_scaling_factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "no_q_lora_tied_mscale_all_dim_0": {
        "untie_embeddings_and_output_weights": False, "mla": {**MLA, "q_lora_rank": 0},
        "moe": {**MOE, "num_groups": 2, "group_topk": 1, "topk": 2, "shared_expert_intermediate_size": 32},
        "yarn": {"rotary_scaling_factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                 "original_max_position_embeddings": 64, "beta_fast": 4.0}},
    "rope_type_rope_two_dense_layers": {"mla": {**MLA, "rope_type": "rope"}, "rotary_base": 500.0,
                                        "moe": {**MOE, "moe_layer_pattern": [0, 0, 1]}},
    # DeepSeek-V3's Multi-Token Prediction depths: HF layers num_hidden_layers + k
    "dsv3_like_mtp2": {"mla": MLA, "moe": MOE, "mtp_num_layers": 2,
                       "yarn": {"rotary_scaling_factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
}
# Fields of transformers' DeepseekV3Config the export must write (values checked against the model).
REQUIRED_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                   "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                   "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                   "rope_scaling", "rope_theta", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                   "num_nextn_predict_layers", "rope_interleave", "hidden_size", "intermediate_size",
                   "num_hidden_layers", "num_attention_heads", "vocab_size")


def mtp_to_hf(cfg, weights):
    """The HF tensors of the MTP depths (Megatron-Bridge's mapping): depth k is HF layer L + k, its transformer layer
    converted as decoder layer L + k of an (L + D)-layer model would be, plus enorm, hnorm, eh_proj and
    shared_head.norm (= final_layernorm)."""
    L, D = cfg["num_layers"], cfg.get("mtp_num_layers", 0)
    if not D:
        return {}
    c = twin.full_config(cfg)
    pattern = list(c["moe"]["moe_layer_pattern"])
    longer = {**cfg, "num_layers": L + D, "mtp_num_layers": 0,
              "moe": {**cfg["moe"], "moe_layer_pattern": pattern + [pattern[-1]] * D}}
    renamed = dict(weights)
    out = {}
    for k in range(D):
        depth = f"mtp.layers.{k}."
        for name, value in weights.items():
            if name.startswith(depth + "mtp_model_layer."):
                renamed[f"decoder.layers.{L + k}." + name[len(depth + "mtp_model_layer."):]] = value
        bias = f"decoder.layers.{L + k}.mlp.router.expert_bias"
        renamed.setdefault(bias, np.zeros(c["moe"]["num_experts"], dtype=np.float32))  # the twin keeps none
        hf = f"model.layers.{L + k}."
        out[hf + "enorm.weight"] = weights[depth + "enorm.weight"]
        out[hf + "hnorm.weight"] = weights[depth + "hnorm.weight"]
        out[hf + "eh_proj.weight"] = weights[depth + "eh_proj.weight"]
        out[hf + "shared_head.norm.weight"] = weights[depth + "final_layernorm.weight"]
    _, converted = test_twin_hf_deepseek.to_hf(longer, renamed)
    for k in range(D):
        hf = f"model.layers.{L + k}."
        out.update({name: value for name, value in converted.items() if name.startswith(hf)})
    return out


def check_model(chk, exe, label, overrides, workdir, seed):
    cfg = {**BASE, **overrides}
    # random non-zero expert biases too, so their mapping and their use in HF's routing are both exercised
    weights = {**twin.random_params(cfg, seed), **twin.random_buffers(cfg, seed + 7)}
    batch = make_batch(cfg, seed + 1, "ones")
    files = {k: os.path.join(workdir, f"{label}.{k}") for k in ("config.json", "w.safetensors", "b.safetensors",
                                                                "out.safetensors", "import.safetensors")}
    with open(files["config.json"], "w") as f:
        json.dump(cfg, f)
    st.save(files["w.safetensors"], weights)
    st.save(files["b.safetensors"], batch)
    tokens = torch.tensor(batch["tokens"], dtype=torch.long)
    expected_config, expected = test_twin_hf_deepseek.to_hf(cfg, weights)
    expected = {k: v for k, v in expected.items() if not k.startswith(f"model.layers.{cfg['num_layers']}.")}
    expected.update(mtp_to_hf(cfg, weights))
    errors = {}

    # 1. Export.
    export_dir = os.path.join(workdir, f"{label}.hf")
    result = run_parity(exe, "--config", files["config.json"], "--weights", files["w.safetensors"], "--batch",
                        files["b.safetensors"], "--out", files["out.safetensors"], "--export-hf", export_dir)
    if not chk.check(result.returncode == 0, f"{label}: moecore_parity --export-hf failed: {result.stderr.strip()}"):
        return errors
    with open(os.path.join(export_dir, "config.json")) as f:
        config = json.load(f)
    chk.check(config.get("model_type") == "deepseek_v3" and config.get("architectures") == ["DeepseekV3ForCausalLM"],
              f"{label}: model_type / architectures {config.get('model_type')} {config.get('architectures')}")
    for key in REQUIRED_FIELDS:
        if key == "num_nextn_predict_layers":
            want = cfg.get("mtp_num_layers", 0)
            chk.check(config.get(key) == want, f"{label}: config.json {key} = {config.get(key)!r}, expected {want}")
            continue
        want = expected_config[key]
        got = config.get(key)
        if key == "rope_scaling" and want is not None and got is not None:
            got = {k: got[k] for k in want if k in got}
        chk.check(got == want, f"{label}: config.json {key} = {got!r}, expected {want!r}")
    exported, _ = st.load(os.path.join(export_dir, "model.safetensors"))
    chk.check(set(exported) == set(expected),
              f"{label}: exported names differ: extra {sorted(set(exported) - set(expected))[:4]}, "
              f"missing {sorted(set(expected) - set(exported))[:4]}")
    for name in sorted(set(exported) & set(expected)):
        chk.check(exported[name].dtype == np.float32 and np.array_equal(exported[name], expected[name]),
                  f"{label}: exported {name} differs from the Megatron weights it should hold")
    cpp, _ = st.load(files["out.safetensors"])
    cpp_logits_BSV = np.transpose(cpp["logits"], (1, 0, 2))
    loaded_config, loaded, _ = twin.load_hf_dir(export_dir)
    with torch.no_grad():
        hf_logits = twin_hf_deepseek.hf_deepseek_forward(loaded_config, loaded, tokens).numpy()
    errors["cpp_vs_twin_hf"] = chk.close(f"{label}: C++ logits vs the DeepseekV3ForCausalLM twin on the export",
                                         cpp_logits_BSV, hf_logits)

    # 2. Import, then export the imported model again: the same files.
    again_dir = os.path.join(workdir, f"{label}.again.hf")
    result = run_parity(exe, "--import-hf", export_dir, "--batch", files["b.safetensors"], "--out",
                        files["import.safetensors"], "--export-hf", again_dir)
    if chk.check(result.returncode == 0, f"{label}: moecore_parity --import-hf failed: {result.stderr.strip()}"):
        imported, _ = st.load(files["import.safetensors"])
        errors["import_vs_cpp"] = chk.close(f"{label}: C++ logits after --import-hf", imported["logits"], cpp["logits"])
        again, _ = st.load(os.path.join(again_dir, "model.safetensors"))
        chk.check(set(again) == set(exported), f"{label}: HF -> moecore -> HF changed the tensor names")
        for name in sorted(set(again) & set(exported)):
            chk.check(again[name].dtype == exported[name].dtype and np.array_equal(again[name], exported[name]),
                      f"{label}: HF -> moecore -> HF changed {name}")
        with open(os.path.join(again_dir, "config.json")) as f:
            chk.check(json.load(f) == config, f"{label}: HF -> moecore -> HF changed config.json")
    return errors


def check_refusals(chk, exe, workdir):
    base = {**BASE, "mla": MLA, "moe": MOE}
    cases = {
        "standard_attention": ({**BASE, "num_query_groups": 4, "moe": MOE, "position_embedding_type": "rope"},
                               "deepseek_v3"),
        "no_latent_norms": ({**base, "qk_layernorm": False}, "no --qk-layernorm"),
        "group_topk_not_half": ({**base, "moe": {**MOE, "topk": 2, "group_topk": 2}}, "--moe-router-group-topk 2"),
    }
    for label, (cfg, needle) in cases.items():
        files = [os.path.join(workdir, f"refuse_{label}.{k}") for k in ("json", "w", "b", "out")]
        with open(files[0], "w") as f:
            json.dump(cfg, f)
        st.save(files[1], twin.random_params(cfg, 5))
        st.save(files[2], make_batch(cfg, 6, "ones"))
        export_dir = os.path.join(workdir, f"refuse_{label}.hf")
        args = ["--config", files[0], "--weights", files[1], "--batch", files[2], "--out", files[3], "--export-hf",
                export_dir]
        if label == "standard_attention":
            args += ["--export-hf-type", "deepseek_v3"]
        result = run_parity(exe, *args)
        lines = result.stderr.strip().splitlines()
        chk.check(result.returncode != 0 and len(lines) == 1 and needle in lines[0],
                  f"refusal {label}: rc {result.returncode}, stderr {result.stderr.strip()!r}")
        chk.check(not os.path.exists(export_dir), f"refusal {label}: a folder was created")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parity", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    chk = Checker()
    with tempfile.TemporaryDirectory() as workdir:
        for index, (label, overrides) in enumerate(CONFIGS.items()):
            errors = check_model(chk, args.parity, label, overrides, workdir, seed=4000 + 17 * index)
            print(f"{label}: " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
        check_refusals(chk, args.parity, workdir)
    for line in chk.failures:
        print("FAIL " + line)
    if chk.failures:
        sys.exit(1)
    print("all DeepSeek-V3 HF export / import checks passed")


if __name__ == "__main__":
    main()
