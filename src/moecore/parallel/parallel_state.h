// ParallelState: this process's communicators for every group of the layout (Megatron's parallel_state), built
// from a ParallelLayout. A run started without mpirun gets single_process(): every group is ProcessGroup::self().
#pragma once

#include "moecore/parallel/parallel_layout.h"
#include "moecore/parallel/process_group.h"

namespace moecore::parallel {

struct ParallelState {
  ParallelLayout layout{ParallelSizes{}};
  int rank = 0;  // world rank
  ProcessGroup world = ProcessGroup::self();
  // Attention (dense) grid.
  ProcessGroup tp = ProcessGroup::self();        // tensor parallel: heads, ffn, vocabulary, sequence shards
  ProcessGroup cp = ProcessGroup::self();        // context parallel: sequence chunks (attention exchanges keys)
  ProcessGroup dp = ProcessGroup::self();        // data parallel
  ProcessGroup dp_cp = ProcessGroup::self();     // dense gradient reduction
  ProcessGroup tp_cp = ProcessGroup::self();     // router aux / z loss statistics
  ProcessGroup tp_dp_cp = ProcessGroup::self();  // global aux loss, expert-bias counts
  // Expert grid (Parallel Folding).
  ProcessGroup ep = ProcessGroup::self();     // expert parallel: rank r owns experts [r E/EP, (r+1) E/EP)
  ProcessGroup etp = ProcessGroup::self();    // expert tensor parallel: expert ffn shards
  ProcessGroup tp_ep = ProcessGroup::self();  // ETP x EP: the allgather dispatcher's group
  int host = 0;                               // this rank's host (shared_window.h: host_id; MOECORE_PRETEND_HOSTS)
  ProcessGroup edp = ProcessGroup::self();    // expert data parallel: expert gradient reduction
  // Pipeline: this rank's pipeline (pp rank = stage), and Megatron's embedding group: the first and last stage of
  // each pipeline (their tied word-embedding copies' gradients are summed over it); self() on the middle stages.
  ProcessGroup pp = ProcessGroup::self();
  ProcessGroup embedding = ProcessGroup::self();
  bool sequence_parallel = false;

  int tp_size() const { return tp.size(); }
  int tp_rank() const { return tp.rank(); }
  int ep_size() const { return ep.size(); }
  int ep_rank() const { return ep.rank(); }
  int etp_size() const { return etp.size(); }
  int etp_rank() const { return etp.rank(); }
  int cp_size() const { return cp.size(); }
  int cp_rank() const { return cp.rank(); }
  int pp_size() const { return pp.size(); }
  int pp_rank() const { return pp.rank(); }
  bool is_first_stage() const { return pp.rank() == 0; }
  bool is_last_stage() const { return pp.rank() == pp.size() - 1; }
  // Data parallel (Megatron's get_data_parallel_world_size / _rank without context parallelism): which samples a
  // rank reads. Every CP rank of a replica reads the same samples (its own sequence chunk of them).
  int dp_size() const { return dp.size(); }
  int dp_rank() const { return dp.rank(); }
  // Data x context parallel (with_context_parallel=True): the group dense gradients and the lm loss are summed over.
  int dp_cp_size() const { return dp_cp.size(); }
  int dp_cp_rank() const { return dp_cp.rank(); }

  static ParallelState single_process();
  // Collective over `world` (whose size must equal sizes.world_size): splits one communicator per group kind.
  static ParallelState create(const ParallelSizes& sizes, bool sequence_parallel, const ProcessGroup& world);
};

// True when this process was started by an MPI launcher (mpirun / srun set the PMI / OMPI environment).
bool launched_by_mpi();

}  // namespace moecore::parallel
