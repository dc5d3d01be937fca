// Two pieces of work that take turns on the cores: Megatron's combined 1F1B schedule (pipeline_parallel/
// combined_1f1b.py) runs the forward of one micro-batch and the backward of another together, so that each one's
// expert all-to-all travels while the other computes. On CUDA the two run as streams; here each runs on a thread of
// its own, and exactly one of them computes at any time: a lane runs until it has started a non-blocking exchange
// and calls pass_turn(), then the other lane runs until it does the same (or finishes), and so on. The cores thus
// stay with one lane's OpenMP team, the exchange progresses underneath (MPI progress is driven by whichever lane
// calls MPI), and each lane computes exactly what it would compute alone, in the same order, so results are bit for
// bit those of running the two one after the other.
//
// Where the turns pass is deterministic (the same program points on every rank), so collectives start in the same
// order on every rank of a group. MPI is called from two threads, never at once: MPI_THREAD_SERIALIZED
// (mpi_runtime.h).
#pragma once

#include <any>
#include <functional>

namespace moecore::parallel {

// Process-wide scoped settings that belong to the lane that set them (the ops' activation dtype, linear quantization
// and delayed-scale scopes: ops/scoped_state.h): taken by `save` when a lane hands the cores over and put back by
// `restore` when it resumes, so neither lane sees the other's scopes (which also open and close out of order across
// the lanes). Both lanes start from the caller's settings, which are back when run_taking_turns returns. The memory
// tracker's activation owner (ActivationOwnerScope) is swapped the same way without being named here.
struct LaneState {
  std::function<std::any()> save;
  std::function<void(const std::any&)> restore;
};

// Runs `first` on the calling thread and `second` on a helper thread (kept for the process, with the caller's
// OpenMP thread count), `first` starting, each running until it calls pass_turn() or returns; returns when both have
// returned. An exception of either is rethrown here (the first lane's when both throw) once both have stopped.
// Nesting is not allowed (std::logic_error).
void run_taking_turns(const std::function<void()>& first, const std::function<void()>& second,
                      const LaneState& state = {});

// Inside run_taking_turns: hands the cores to the other lane unless it has returned, and returns when it is this
// lane's turn again. Elsewhere: does nothing.
void pass_turn();

// Whether the calling thread is a lane of run_taking_turns.
bool taking_turns();

}  // namespace moecore::parallel
