"""Expected FLOPs of tests/unit/plan_flops_test.cpp, from Megatron-LM's own formula.

Usage: python3 megatron_flops_reference.py <path to Megatron-LM's megatron/training/training.py>

Pulls the function num_floating_point_operations out of training.py with `ast` (no Megatron or torch import), runs
it with the helpers it imports stubbed (no hybrid model, no linear-attention variant) and prints, per model, the
FLOPs of one sequence / seq_length (per token) and of one global batch, as Python's repr of the float.
The numbers in the test were made from Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553. Not run by
the test suite.
"""
import ast
import sys
import types


def load_megatron_flops(training_py):
    tree = ast.parse(open(training_py).read())
    function = next(node for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name == "num_floating_point_operations")
    namespace = {
        "is_hybrid_model": lambda args: False,
        "is_linear_attention_variant": lambda variant: False,
        "is_gated_delta_net_variant": lambda variant: False,
    }
    exec(compile(ast.Module(body=[function], type_ignores=[]), training_py, "exec"), namespace)
    return namespace["num_floating_point_operations"]


def args(**overrides):
    base = dict(
        # attention
        group_query_attention=False, num_query_groups=None, kv_channels=None, attention_output_gate=False,
        multi_latent_attention=False, q_lora_rank=None, kv_lora_rank=None, qk_head_dim=None,
        qk_pos_emb_head_dim=None, v_head_dim=None, experimental_attention_variant=None,
        # MLP / MoE
        swiglu=True, num_experts=None, moe_layer_freq=1, moe_router_topk=2, moe_ffn_hidden_size=None,
        moe_latent_size=None, moe_shared_expert_intermediate_size=None,
        mtp_num_layers=None,
    )
    base.update(overrides)
    return types.SimpleNamespace(**base)


DEEPSEEK_V3 = dict(
    num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
    multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
    v_head_dim=128, kv_channels=128,
    num_experts=256, moe_layer_freq=[0] * 3 + [1] * 58, moe_ffn_hidden_size=2048, moe_router_topk=8,
    moe_shared_expert_intermediate_size=2048, padded_vocab_size=129280)
QWEN3_235B = dict(
    num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64, group_query_attention=True,
    num_query_groups=4, kv_channels=128, num_experts=128, moe_layer_freq=1, moe_ffn_hidden_size=1536,
    moe_router_topk=8, padded_vocab_size=151936)
QWEN3_30B = dict(
    num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, group_query_attention=True,
    num_query_groups=4, kv_channels=128, num_experts=128, moe_layer_freq=1, moe_ffn_hidden_size=768,
    moe_router_topk=8, padded_vocab_size=151936)
MIXTRAL_8X7B = dict(
    num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, group_query_attention=True,
    num_query_groups=8, kv_channels=128, num_experts=8, moe_layer_freq=1, moe_router_topk=2,
    padded_vocab_size=32000)
# The hand-checked case of the test: 2 layers (dense, MoE), MLA, 1 MTP layer.
TINY_MLA = dict(
    num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
    multi_latent_attention=True, q_lora_rank=4, kv_lora_rank=2, qk_head_dim=3, qk_pos_emb_head_dim=1,
    v_head_dim=2, kv_channels=4, num_experts=4, moe_layer_freq=[0, 1], moe_ffn_hidden_size=4, moe_router_topk=2,
    moe_shared_expert_intermediate_size=4, padded_vocab_size=10, mtp_num_layers=1)

CASES = [
    # name, model, seq_length, global batch size, extra args
    ("DeepSeek-V3", DEEPSEEK_V3, 4096, 8192, {}),
    ("DeepSeek-V3 + 1 MTP layer", DEEPSEEK_V3, 4096, 8192, dict(mtp_num_layers=1)),
    ("Qwen3-235B-A22B", QWEN3_235B, 4096, 2048, {}),
    ("Qwen3-235B-A22B seq 131072", QWEN3_235B, 131072, 1024, {}),
    ("Qwen3-30B-A3B", QWEN3_30B, 4096, 512, {}),
    ("Mixtral-8x7B", MIXTRAL_8X7B, 4096, 256, {}),
    ("Qwen3-30B-A3B as LatentMoE, latent 512", QWEN3_30B, 4096, 512, dict(moe_latent_size=512)),
    ("tiny MLA + MTP", TINY_MLA, 4, 3, {}),
    ("tiny MLA + MTP, q_lora_rank None", TINY_MLA, 4, 3, dict(q_lora_rank=None)),
]


def main():
    flops = load_megatron_flops(sys.argv[1])
    for name, model, seq_length, global_batch_size, extra in CASES:
        shape = {**model, **extra, "seq_length": seq_length}
        per_sequence = flops(args(**shape), 1)
        per_step = flops(args(**shape), global_batch_size)
        print(f"{name}: seq {seq_length}, per token {per_sequence / seq_length!r}, "
              f"global batch {global_batch_size}: {per_step!r}")


if __name__ == "__main__":
    main()
