"""Expected schedules of tests/unit/data_hybrid_cp_schedule_test.cpp, from Megatron-LM's own BalancedCPScheduler.

Usage: /usr/bin/python3 tests/oracle/megatron_hybrid_cp_reference.py [--mirror DIR] [--commit REV]

Extracts megatron/core/pipeline_parallel/hybrid_cp_schedule.py from a Megatron-LM git mirror (default
/work/.mirror/NVIDIA+Megatron-LM/repo, revision HEAD) with `git show` into a temporary folder, imports it with
megatron.core.parallel_state and megatron.core.rerun_state_machine stubbed (the scheduler itself only asks the
DP x CP group for its size), runs BalancedCPScheduler.get_groups_and_subsamples on the test's fixed inputs (sample
id i has length lengths[i], as HybridCPDataLoaderWrapper numbers the gathered sub-samples) and prints, per case and
round, the sample ids each rank runs (Megatron's sample_id_groups) as C++ initializers. Needs torch (for the
module's imports). The test's numbers were made from commit d98e8a64ddf34856e74b24714e3bedb2f5a39553.
Not run by the test suite: CI has no Megatron mirror.
"""
import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import types

SCHEDULER_PATH = "megatron/core/pipeline_parallel/hybrid_cp_schedule.py"

# name -> (DP x CP ranks, --max-seqlen-per-dp-cp-rank, lengths by sample id). Shared with the C++ test.
CASES = {
    "AllRanksSampleN4": (4, 1024, [1000, 4096, 900, 800, 700, 600, 500, 400, 300]),
    "MixedN8": (8, 1024, [512, 3000, 2000, 1800, 1024, 1000, 900, 512, 300, 200]),
    "ManyShortN8": (8, 4096, [1900, 350, 1210, 640, 1999, 720, 180, 1500, 980, 415, 1333, 260,
                              870, 1760, 505, 1111, 199, 1450, 777, 1620, 333, 1024, 888, 1299]),
    "IdleRanksFilledN8": (8, 1024, [700, 500, 300]),
    "OneSampleN8": (8, 1024, [2048]),
    "LongTailN4": (4, 1000, [3900, 2100, 1900, 1000, 990, 980, 970, 960, 950, 500, 400, 100, 90, 80]),
    "TrimmedRoundsN4": (4, 100, [190, 100, 84, 83, 82, 77, 64, 58, 43, 41, 33]),
    "BalancedStopN4": (4, 100, [200, 100, 100, 100, 100, 50, 50, 50]),
    "TrimTieN2": (2, 100, [75, 75, 50, 100]),
    "SingleRank": (1, 512, [300, 500, 100]),
    "MisalignedLaterRoundN16": (16, 64, [269, 124, 410, 231, 154, 288, 85, 119, 358, 367, 271, 97, 340, 7, 68,
                                         203]),
}


def load_scheduler(mirror, commit):
    source = subprocess.run(["git", "-C", mirror, "show", f"{commit}:{SCHEDULER_PATH}"], check=True,
                            capture_output=True).stdout
    folder = tempfile.mkdtemp(prefix="megatron_hybrid_cp_")
    path = os.path.join(folder, "hybrid_cp_schedule.py")
    with open(path, "wb") as f:
        f.write(source)
    megatron = types.ModuleType("megatron")
    core = types.ModuleType("megatron.core")
    parallel_state = types.ModuleType("megatron.core.parallel_state")
    rerun = types.ModuleType("megatron.core.rerun_state_machine")
    rerun.RerunDataIterator = object
    core.parallel_state = parallel_state
    megatron.core = core
    sys.modules.update({"megatron": megatron, "megatron.core": core,
                        "megatron.core.parallel_state": parallel_state,
                        "megatron.core.rerun_state_machine": rerun})
    spec = importlib.util.spec_from_file_location("hybrid_cp_schedule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BalancedCPScheduler


class Group:
    """The DP x CP process group as the scheduler sees it: only its size."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def schedule(scheduler_class, ranks, max_seqlen, lengths):
    scheduler = scheduler_class(max_seqlen, Group(ranks))
    _, sample_id_groups = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)
    return sample_id_groups


def cpp(rounds):
    return "{" + ", ".join("{" + ", ".join("{" + ", ".join(map(str, ids)) + "}" for ids in r) + "}"
                           for r in rounds) + "}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mirror", default="/work/.mirror/NVIDIA+Megatron-LM/repo")
    parser.add_argument("--commit", default="HEAD")
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", args.mirror, "rev-parse", args.commit], check=True, capture_output=True,
                            text=True).stdout.strip()
    scheduler_class = load_scheduler(args.mirror, commit)
    print(f"// Megatron-LM {commit}, {SCHEDULER_PATH}")
    for name, (ranks, max_seqlen, lengths) in CASES.items():
        print(f"// {name}: {ranks} ranks, max {max_seqlen} tokens per rank; rounds of per-rank sample ids")
        print(cpp(schedule(scheduler_class, ranks, max_seqlen, lengths)))


if __name__ == "__main__":
    main()
