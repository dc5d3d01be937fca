// 16-bit activation storage (ops/precision.h, ops/staging.h): `dist_storage16_test -- <moecore train flags>`
// trains a --bf16 / --fp16 configuration twice in one process (or under mpirun, on every rank): once with activations
// in fp32 tensors that hold 16-bit values (ActivationStorage::kF32, the storage before bf16 / fp16 tensors) and once
// with bf16 / fp16 tensors (k16Bit, Megatron's Float16Module). Staging reads 16-bit tensors exactly and narrows
// every write once, so the two must agree bit for bit: every iteration's losses and every final parameter and
// buffer. Exit status 1 on any difference.
#include <sys/resource.h>

#include <cstdint>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/memory_tracker.h"
#include "moecore/train/trainer.h"
#include "moecore/train/training_setup.h"
#include "parallel/model_tensors.h"

namespace {

struct Run {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> tensors;
  std::string log;
  double cpu_seconds = 0;  // of this process (every thread), for the step-time record
};

double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}

Run train(moecore::TrainingArgs args, const moecore::parallel::ParallelState& parallel,
          const moecore::ops::ActivationStorage storage) {
  args.model.activation_storage = storage;
  moecore::MemoryTracker::instance().reset_peaks();  // each run's memory line shows its own peaks
  Run run;
  const double cpu_before = cpu_seconds();
  std::ostringstream log;
  const moecore::TrainResult result = moecore::run_training(
      args, log, parallel, [&](const moecore::GPTModel& full) { run.tensors = moecore::test::model_tensors(full); });
  run.losses = result.train_losses;
  run.log = log.str();
  run.cpu_seconds = cpu_seconds() - cpu_before;
  return run;
}

// The last line of `log` that holds `marker` (empty when none).
std::string last_line_with(const std::string& log, const std::string& marker) {
  std::istringstream in(log);
  std::string line, last;
  while (std::getline(in, line)) {
    if (line.find(marker) != std::string::npos) last = line;
  }
  return last;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] != "--") {
    std::cerr << "usage: dist_storage16_test -- <moecore train flags with --bf16 or --fp16>\n";
    return 2;
  }
  std::optional<moecore::parallel::MpiRuntime> mpi;
  int world_size = 1;
  if (moecore::parallel::launched_by_mpi()) {
    mpi.emplace(&argc, &argv);
    world_size = moecore::parallel::ProcessGroup::world().size();
  }
  try {
    const moecore::TrainingArgs parsed =
        moecore::parse_train_args(std::vector<std::string>(args.begin() + 1, args.end()), world_size);
    if (parsed.model.params_dtype == moecore::DType::kF32) {
      std::cerr << "error: the configuration needs --bf16 or --fp16\n";
      return 2;
    }
    const moecore::parallel::ParallelState parallel = moecore::make_parallel_state(parsed);
    const Run fp32 = train(parsed, parallel, moecore::ops::ActivationStorage::kF32);
    const Run bits16 = train(parsed, parallel, moecore::ops::ActivationStorage::k16Bit);
    if (parallel.rank != 0) return 0;
    const int failures = moecore::test::bit_differences(fp32.losses, fp32.tensors, "fp32 storage", bits16.losses,
                                                        bits16.tensors, "16-bit storage", std::cout);
    // Each run's last memory and timing lines, for the record (bench/run_storage16_step.sh reads them).
    for (const auto& [name, run] :
         {std::pair<const char*, const Run*>{"fp32 storage", &fp32}, {"16-bit storage", &bits16}}) {
      std::cout << name << ": " << last_line_with(run->log, "memory (MB") << '\n';
      std::cout << name << ": " << last_line_with(run->log, "elapsed time per iteration") << '\n';
      std::cout << name << ": cpu seconds " << run->cpu_seconds << '\n';
    }
    std::cout << fp32.losses.size() << " iterations, " << fp32.tensors.size()
              << " tensors: " << (failures == 0 ? "PASS" : "FAILED") << " on " << world_size << " ranks\n";
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    if (world_size > 1) moecore::parallel::abort_world(1);
    return 1;
  }
}
