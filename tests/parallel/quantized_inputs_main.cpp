// Linear layers keep their input quantized for the weight gradient under FP8 / FP4 (ops/linear.h, as
// TransformerEngine's Linear / GroupedLinear save inputmat quantized for the column-wise usage):
// `dist_quantized_inputs_test -- <moecore train flags with a recipe>` trains the configuration twice in one process
// (or under mpirun, on every rank): once keeping the high-precision inputs and quantizing them again in backward
// (QuantizedLinearConfig::save_quantized_input = false, the path before), once keeping the quantized inputs. The
// backward quantizes the same values the same way, so the two must agree bit for bit (every iteration's losses and
// every final parameter and buffer), and the saved activations must peak strictly lower. Exit status 1 otherwise.
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
  int64_t activations_peak = 0;  // bytes, this process
  std::string memory_line;
};

std::string last_line_with(const std::string& log, const std::string& marker) {
  std::istringstream in(log);
  std::string line, last;
  while (std::getline(in, line)) {
    if (line.find(marker) != std::string::npos) last = line;
  }
  return last;
}

Run train(moecore::TrainingArgs args, const moecore::parallel::ParallelState& parallel, const bool save_quantized) {
  args.model.quantization->save_quantized_input = save_quantized;
  moecore::MemoryTracker& tracker = moecore::MemoryTracker::instance();
  tracker.reset_peaks();
  Run run;
  std::ostringstream log;
  const moecore::TrainResult result = moecore::run_training(
      args, log, parallel, [&](const moecore::GPTModel& full) { run.tensors = moecore::test::model_tensors(full); });
  run.losses = result.train_losses;
  run.activations_peak = tracker.peak(moecore::MemCategory::kActivations);
  run.memory_line = last_line_with(log.str(), "memory (MB");
  return run;
}

double mib(const int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] != "--") {
    std::cerr << "usage: dist_quantized_inputs_test -- <moecore train flags with an FP8 / FP4 recipe>\n";
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
    if (!parsed.model.quantization) {
      std::cerr << "error: the configuration needs --fp8-format or --fp4-format\n";
      return 2;
    }
    const moecore::parallel::ParallelState parallel = moecore::make_parallel_state(parsed);
    const Run high = train(parsed, parallel, false);
    const Run quantized = train(parsed, parallel, true);
    int failures = moecore::test::bit_differences(high.losses, high.tensors, "high-precision inputs", quantized.losses,
                                                  quantized.tensors, "quantized inputs", std::cout);
    if (quantized.activations_peak >= high.activations_peak) {
      std::cout << "rank " << parallel.rank << ": the activation peak did not fall: " << mib(high.activations_peak)
                << " MiB -> " << mib(quantized.activations_peak) << " MiB\n";
      ++failures;
    }
    if (parallel.rank == 0) {
      std::cout << "activation peak (rank 0): " << mib(high.activations_peak) << " MiB with high-precision inputs, "
                << mib(quantized.activations_peak) << " MiB with quantized inputs\n";
      std::cout << "high-precision inputs: " << high.memory_line << '\n';
      std::cout << "quantized inputs: " << quantized.memory_line << '\n';
      std::cout << high.losses.size() << " iterations, " << high.tensors.size()
                << " tensors: " << (failures == 0 ? "PASS" : "FAILED") << " on " << world_size << " ranks\n";
    }
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    if (world_size > 1) moecore::parallel::abort_world(1);
    return 1;
  }
}
