#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "commands.h"
#include "moecore/config/arguments.h"
#include "moecore/model/config.h"
#include "moecore/parallel/agreement.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"
#include "moecore/parallel/watchdog.h"
#include "moecore/train/argument_agreement.h"
#include "moecore/train/trainer.h"

namespace {

// Under mpirun every rank runs this; errors in the arguments or the layout, and failures the ranks agreed on
// (parallel::GroupFailure: a damaged checkpoint, a failed save), are the same on every rank, so only rank 0 reports
// them and all ranks exit cleanly. Any other failure may be one rank's alone: it is reported by
// that rank, which aborts the job so no peer waits forever in a collective.
int train_main(const std::vector<std::string>& args, const int rank, const int world_size) {
  try {
    // Every rank must run the same job: the effective flags are compared with rank 0's first, then parsed on every
    // rank together, so that a failure on some ranks only (a per-rank --threads value) ends all of them.
    moecore::TrainingArgs parsed;
    if (world_size > 1) {
      const moecore::parallel::ProcessGroup world = moecore::parallel::ProcessGroup::world();
      moecore::check_ranks_agree_on_arguments(world, args);
      moecore::parallel::run_on_all_ranks(world, [&] { parsed = moecore::parse_train_args(args, world_size); });
    } else {
      parsed = moecore::parse_train_args(args, world_size);
    }
    moecore::parallel::set_collective_timeout(parsed.distributed_timeout_minutes * 60.0);
    if (parsed.help_requested) {
      if (rank == 0) std::cout << "usage: moecore train [flags]\n\n" << moecore::train_flags_help();
      return 0;
    }
    const moecore::parallel::ParallelState parallel = moecore::make_parallel_state(parsed);
    try {
      moecore::run_training(parsed, std::cout, parallel);
    } catch (const moecore::ConfigError&) {
      throw;
    } catch (const moecore::parallel::GroupFailure&) {
      throw;  // every rank failed alike (run_on_all_ranks): reported once, by rank 0, with a clean exit
    } catch (const moecore::TrainingError&) {
      throw;  // a non-finite loss or gradient norm stops every rank together with the same message
    } catch (const std::exception& e) {
      std::cout.flush();
      std::cerr << "error: " << (world_size > 1 ? "[rank " + std::to_string(rank) + "] " : std::string()) << e.what()
                << '\n';
      if (world_size > 1) moecore::parallel::abort_world(1);
      return 1;
    }
    // The log's last lines (standard output may be a file on a disk that filled up).
    std::cout.flush();
    if (std::fflush(stdout) != 0 || std::ferror(stdout) != 0 || !std::cout) {
      const int error = errno;
      std::cerr << "error: writing the training log to standard output failed"
                << (error != 0 ? std::string(": ") + std::strerror(error) : std::string()) << '\n';
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::cout.flush();
    if (rank == 0) std::cerr << "error: " << e.what() << '\n';
    return 1;
  }
}

}  // namespace

int run_train(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (!moecore::parallel::launched_by_mpi()) return train_main(args, 0, 1);
  moecore::parallel::MpiRuntime mpi(nullptr, nullptr);
  const moecore::parallel::ProcessGroup world = moecore::parallel::ProcessGroup::world();
  return train_main(args, world.rank(), world.size());
}
