// The collective watchdog under mpirun -np 2: rank 1 stays out of MPI (it sleeps) while rank 0 waits for `mode`'s
// operation on a group named "dp", with a 1 s collective timeout. Rank 0 must print one line naming the operation,
// the group and rank 1, and end the job (MPI_Abort, non-zero). The CTest cases match that line. "healthy" checks
// that operations which complete in time pass under the timeout (exit 0).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "moecore/parallel/process_group.h"
#include "moecore/parallel/watchdog.h"

namespace parallel = moecore::parallel;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  parallel::MpiRuntime mpi(&argc, &argv);
  const parallel::ProcessGroup world = parallel::ProcessGroup::world();
  const parallel::ProcessGroup dp = world.split(0, world.rank());
  dp.set_name("dp");
  parallel::set_collective_timeout(1.0);
  std::vector<float> data(16, 1.0f);
  const std::span<float> values(data);
  if (mode == "healthy") {
    for (int i = 0; i < 20; ++i) {
      dp.all_reduce(values, parallel::ReduceOp::kSum);
      dp.all_reduce_async(values, parallel::ReduceOp::kMax).wait();
      dp.barrier();
    }
    if (world.rank() == 0) std::printf("healthy: ok\n");
    return 0;
  }
  // Two collectives both ranks take part in, so the group's sequence numbers are past the start.
  dp.all_reduce(values, parallel::ReduceOp::kSum);
  dp.barrier();
  if (world.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(60));  // never arrives: ended by rank 0's MPI_Abort
    return 1;
  }
  if (mode == "all_reduce") {
    dp.all_reduce(values, parallel::ReduceOp::kSum);
  } else if (mode == "async") {
    parallel::Work work = dp.all_reduce_async(values, parallel::ReduceOp::kSum);
    work.wait();
  } else if (mode == "recv") {
    dp.recv(values, 1);
  } else {
    std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
  }
  return 1;  // not reached when the watchdog works
}
