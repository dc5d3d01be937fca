#include "moecore/parallel/parallel_state.h"

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

#include "moecore/parallel/shared_window.h"

namespace moecore::parallel {
namespace {

// The communicator of `rank`'s group among `groups`, members in the group's listed order.
ProcessGroup split_by(const ProcessGroup& world, const RankGroups& groups, const int rank) {
  const int color = group_index_of(groups, rank);
  const std::vector<int>& members = groups[static_cast<size_t>(color)];
  const int key = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  return world.split(color, key);
}

}  // namespace

ParallelState ParallelState::single_process() { return ParallelState{}; }

ParallelState ParallelState::create(const ParallelSizes& sizes, const bool sequence_parallel,
                                    const ProcessGroup& world) {
  if (world.size() != sizes.world_size) {
    throw LayoutError("the layout is for " + std::to_string(sizes.world_size) + " ranks but " +
                      std::to_string(world.size()) + " processes were launched");
  }
  ParallelState state{ParallelLayout(sizes)};
  state.rank = world.rank();
  state.world = world;
  state.sequence_parallel = sequence_parallel;
  if (world.size() == 1) return state;
  const DenseGroups& dense = state.layout.dense();
  const ExpertGroups& expert = state.layout.expert();
  const int r = world.rank();
  state.tp = split_by(world, dense.tp, r);
  state.cp = split_by(world, dense.cp, r);
  state.dp = split_by(world, dense.dp, r);
  state.dp_cp = split_by(world, dense.dp_cp, r);
  state.tp_cp = split_by(world, dense.tp_cp, r);
  state.tp_dp_cp = split_by(world, dense.tp_dp_cp, r);
  state.ep = split_by(world, expert.ep, r);
  state.etp = split_by(world, expert.tp, r);
  state.tp_ep = split_by(world, expert.tp_ep, r);
  state.edp = split_by(world, expert.dp, r);
  state.pp = split_by(world, dense.pp, r);
  state.host = host_id(world);
  // Embedding group: the first and last member of each pipeline group together; every other rank alone.
  const int pipeline = group_index_of(dense.pp, r);
  const std::vector<int>& stages = dense.pp[static_cast<size_t>(pipeline)];
  const bool end_stage = r == stages.front() || r == stages.back();
  state.embedding =
      world.split(end_stage ? pipeline : static_cast<int>(dense.pp.size()) + r, r == stages.front() ? 0 : 1);
  // Names in watchdog reports, as the fields above.
  for (const auto& [group, name] :
       std::initializer_list<std::pair<const ProcessGroup*, const char*>>{{&state.tp, "tp"},
                                                                          {&state.cp, "cp"},
                                                                          {&state.dp, "dp"},
                                                                          {&state.dp_cp, "dp_cp"},
                                                                          {&state.tp_cp, "tp_cp"},
                                                                          {&state.tp_dp_cp, "tp_dp_cp"},
                                                                          {&state.ep, "ep"},
                                                                          {&state.etp, "etp"},
                                                                          {&state.tp_ep, "tp_ep"},
                                                                          {&state.edp, "edp"},
                                                                          {&state.pp, "pp"},
                                                                          {&state.embedding, "embedding"}}) {
    group->set_name(name);
  }
  return state;
}

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

}  // namespace moecore::parallel
