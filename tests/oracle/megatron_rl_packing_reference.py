"""Expected values of tests/unit/data_sequence_packing_test.cpp, from Megatron-RL's own sequence-packing code.

Usage: /usr/bin/python3 tests/oracle/megatron_rl_packing_reference.py [--mirror DIR] [--commit REV]

Extracts megatron/rl/sequence_packing_utils.py and megatron/core/num_microbatches_calculator.py from a Megatron-LM
git mirror (default /work/.mirror/NVIDIA+Megatron-LM/repo, revision HEAD) with `git show` into a temporary folder
and imports them, with the imports they cannot satisfy here stubbed: megatron.core.mpu (the data-parallel rank and
size, set per call), the tokenizer (only its pad id), logging and NVTX helpers, and megatron.core.utils, of which
round_up_to_nearest_multiple is taken from the mirror's utils.py with `ast`. PackedSeqParams is the mirror's own.
It then runs SequencePacker.pack_sequences, create_packed_seq_params_for_bin, distribute_packed_bins (once per DP
rank) and update_microbatch_calculator on the test's fixed inputs and prints the results as C++ initializers.
Needs torch and numpy. The test's numbers were made from commit d98e8a64ddf34856e74b24714e3bedb2f5a39553.
Not run by the test suite: CI has no Megatron mirror.
"""
import argparse
import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
import types

PAD = 0

# name -> (lengths by sample id, bin size = --seq-length, max sequences per bin, context-parallel size).
# Shared with the C++ test.
PACKING_CASES = {
    "NextFitDecreasing": ([5, 9, 3, 7, 2, 9, 4, 1], 16, 6, 1),
    "ContextParallelSlots": ([5, 3, 6, 2, 7, 1], 16, 4, 2),
    "MaxSequencesPerBin": ([10, 10, 0, 10, 10, 10, 10, 10], 100, 3, 1),
    "FullBins": ([8, 1, 8, 7], 8, 50, 1),
    "SevenBins": ([9, 8, 7, 6, 6, 5, 5, 4, 3, 2], 10, 50, 1),
}
# (packing case, DP size, algorithm) for distribute_packed_bins.
DISTRIBUTION_CASES = [
    ("SevenBins", 3, "fifo"), ("SevenBins", 3, "round-robin"),
    ("SevenBins", 4, "fifo"), ("SevenBins", 4, "round-robin"),
    ("SevenBins", 8, "fifo"), ("SevenBins", 8, "round-robin"),
    ("SevenBins", 1, "fifo"),
]
# (global batch size, prompts per step, group size, bins on this rank, DP size) for update_microbatch_calculator.
MICROBATCH_CASES = [(16, 4, 8, 5, 2), (32, 4, 8, 7, 4), (8, 3, 8, 9, 2), (9, 3, 9, 7, 3), (6, 7, 3, 10, 1),
                    (4, 5, 8, 30, 2), (9, 2, 7, 42, 3)]


def git_show(mirror, commit, path):
    return subprocess.run(["git", "-C", mirror, "show", f"{commit}:{path}"], check=True,
                          capture_output=True).stdout


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stub(name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


class Mpu:
    """megatron.core.mpu as the packing code uses it: one data-parallel rank of a DP group, no process groups."""

    dp_rank = 0
    dp_size = 1


def load_megatron(mirror, commit):
    folder = tempfile.mkdtemp(prefix="megatron_rl_packing_")
    paths = {}
    for name, path in [("num_microbatches_calculator", "megatron/core/num_microbatches_calculator.py"),
                       ("packed_seq_params", "megatron/core/packed_seq_params.py"),
                       ("sequence_packing_utils", "megatron/rl/sequence_packing_utils.py"),
                       ("core_utils", "megatron/core/utils.py")]:
        paths[name] = os.path.join(folder, name + ".py")
        with open(paths[name], "wb") as f:
            f.write(git_show(mirror, commit, path))

    # round_up_to_nearest_multiple, pulled out of megatron/core/utils.py (whose imports need a GPU stack).
    tree = ast.parse(open(paths["core_utils"]).read())
    function = next(node for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name == "round_up_to_nearest_multiple")
    namespace = {"math": __import__("math")}
    exec(compile(ast.Module(body=[function], type_ignores=[]), paths["core_utils"], "exec"), namespace)

    megatron = stub("megatron")
    core = stub("megatron.core")
    megatron.core = core
    stub("megatron.core.utils", log_single_rank=lambda *args, **kwargs: None,
         round_up_to_nearest_multiple=namespace["round_up_to_nearest_multiple"])
    core.mpu = stub("megatron.core.mpu", get_data_parallel_rank=lambda: Mpu.dp_rank,
                    get_data_parallel_world_size=lambda: Mpu.dp_size,
                    get_context_parallel_world_size=lambda: 1)
    stub("megatron.training")
    stub("megatron.training.global_vars", get_tokenizer=lambda: types.SimpleNamespace(pad=PAD))
    stub("megatron.training.utils", get_nvtx_range=lambda: None)
    calculator = load_module("megatron.core.num_microbatches_calculator", paths["num_microbatches_calculator"])
    load_module("megatron.core.packed_seq_params", paths["packed_seq_params"])
    packing = load_module("megatron.rl.sequence_packing_utils", paths["sequence_packing_utils"])
    return packing, calculator


def trajectories(lengths, width):
    import torch
    rows = torch.full((len(lengths), width), PAD, dtype=torch.long)
    for i, length in enumerate(lengths):
        rows[i, :length] = torch.arange(1, length + 1)  # any non-pad tokens
    return rows


def pack(packing, lengths, bin_size, max_per_bin, cp):
    packer = packing.SequencePacker(bin_size=bin_size, pad_token=PAD, max_sequences_per_bin=max_per_bin,
                                    seq_length_multiple=2 * cp if cp > 1 else 1)
    trajs, position_ids, loss_mask, info = packer.pack_sequences(trajectories(lengths, max(max(lengths), 1)))
    return packer, trajs, position_ids, loss_mask, info


def ints(values):
    return "{" + ", ".join(str(int(v)) for v in values) + "}"


def nested(lists):
    return "{" + ", ".join(ints(values) for values in lists) + "}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mirror", default="/work/.mirror/NVIDIA+Megatron-LM/repo")
    parser.add_argument("--commit", default="HEAD")
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", args.mirror, "rev-parse", args.commit], check=True, capture_output=True,
                            text=True).stdout.strip()
    packing, calculator = load_megatron(args.mirror, commit)
    print(f"// Megatron-LM {commit}, megatron/rl/sequence_packing_utils.py")

    for name, (lengths, bin_size, max_per_bin, cp) in PACKING_CASES.items():
        packer, _, position_ids, loss_mask, info = pack(packing, lengths, bin_size, max_per_bin, cp)
        bins = range(len(info.bin_seq_indices))
        print(f"// {name}: pack_sequences -> bin_seq_indices, seq_starts (offsets + padded end)")
        print(nested(info.bin_seq_indices))
        print(nested(info.seq_starts[b] for b in bins))
        if bin_size <= 16:  # short enough to paste
            print(f"// {name}: packed_position_ids, loss_mask (no generation mask) per bin")
            print(nested(position_ids[b].tolist() for b in bins))
            print(nested(loss_mask[b].tolist() for b in bins))
        if max_per_bin > 6:  # arrays of max_per_bin + 2 entries: too long to paste
            continue
        params = [packing.create_packed_seq_params_for_bin(info, b, bin_size, max_per_bin, "cpu",
                                                           packer.seq_length_multiple) for b in bins]
        print(f"// {name}: create_packed_seq_params_for_bin -> cu_seqlens_q, cu_seqlens_q_padded (None: same)")
        print(nested(p.cu_seqlens_q.tolist() for p in params))
        print(nested((p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q).tolist()
                     for p in params))
    default = packing.get_default_packed_seq_params(16, 4, "cpu")
    print("// get_default_packed_seq_params(seq_length 16, max_sequences_per_bin 4) (an empty bin's params)")
    print(ints(default.cu_seqlens_q.tolist()))

    for name, dp, algo in DISTRIBUTION_CASES:
        lengths, bin_size, max_per_bin, cp = PACKING_CASES[name]
        _, trajs, position_ids, loss_mask, info = pack(packing, lengths, bin_size, max_per_bin, cp)
        ranks = []
        for rank in range(dp):
            Mpu.dp_rank, Mpu.dp_size = rank, dp
            info.packing_algo = algo
            global_info = packing.PackingInfo([list(b) for b in info.bin_seq_indices], dict(info.seq_starts),
                                              info.seq_lengths, info.seq_to_bin_idx, algo)
            _, my_positions, _, my_info = packing.distribute_packed_bins(trajs, position_ids, loss_mask, global_info)
            # Global bin index of each local bin (-1: an empty padding bin), found by its sample ids.
            ranks.append([info.bin_seq_indices.index(b) if b else -1 for b in my_info.bin_seq_indices])
            assert all(my_positions[i].abs().sum() == 0 for i, b in enumerate(ranks[-1]) if b == -1)
        print(f"// distribute_packed_bins({name}, DP {dp}, {algo}): per rank, global bin per local bin (-1: empty)")
        print(nested(ranks))

    print("// update_microbatch_calculator(ratio = gbs / (prompts * group), bins on rank, DP):")
    print("// {gbs, prompts, group, bins, dp, num_microbatches, running global batch in bins}")
    for gbs, prompts, group, bins, dp in MICROBATCH_CASES:
        Mpu.dp_rank, Mpu.dp_size = 0, dp
        calculator.unset_num_microbatches_calculator()
        calculator.init_num_microbatches_calculator(0, None, gbs, 1, dp, False)
        packing.update_microbatch_calculator(gbs / (prompts * group), bins, [[0]] * bins, gbs, 1, False)
        print(ints([gbs, prompts, group, bins, dp, calculator.get_num_microbatches(),
                    calculator.get_current_running_global_batch_size()]) + ",")

    # A sample longer than the bin: what pack_sequences does with it (rl_utils asserts before it gets there).
    try:
        pack(packing, [5, 20, 3], 16, 50, 1)
        print("// over-long sample: packed")
    except Exception as error:  # noqa: BLE001 - reporting whatever Megatron raises
        print(f"// over-long sample (length 20, bin 16): {type(error).__name__}: {str(error).splitlines()[0]}")


if __name__ == "__main__":
    main()
