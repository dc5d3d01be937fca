// What one rank of a training run will hold, estimated from the flags before anything is allocated, so that a
// configuration that cannot fit ends with the numbers instead of std::bad_alloc half-way through set-up.
#pragma once

#include <optional>
#include <string>

#include "moecore/config/arguments.h"

namespace moecore {

// Bytes on the rank holding the most. Sums in double: the flags' products may exceed 64-bit integers for
// configurations this estimate exists to refuse. moecore_plan's estimate_run_memory fills the model's parts from the
// CPU engine's memory model (the accounting of `moecore plan --gpu cpu`), each the peak of its category.
struct MemoryEstimate {
  double parameters = 0;    // the params category's peak (fp32 storage; shards under Megatron-FSDP)
  double gradients = 0;     // the grads category's peak (fp32 main gradients)
  double optimizer = 0;     // Adam moments (+ fp32 main parameters of 16-bit weights), as the optimizer shards them
  double activations = 0;   // the activation peak of a step, with the communication buffers
  double data_indices = 0;  // the GPT dataset's sample and shuffle indices of every split

  double total() const { return parameters + gradients + optimizer + activations + data_indices; }
};

// The GPT dataset's sample and shuffle indices of every split the run reads.
double data_index_bytes(const TrainingArgs& args);

// The memory this process can count on: MemAvailable + SwapFree of /proc/meminfo, shared by the ranks of the job on
// this host (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE). None where /proc/meminfo cannot be read.
std::optional<double> available_memory_per_rank();

// Throws ConfigError with the estimate's parts when it exceeds `available` bytes.
void check_memory_fits(const MemoryEstimate& estimate, double available);

std::string format_bytes(double bytes);  // "3.2 GiB"

}  // namespace moecore
