// What one rank of a training run will hold, estimated from the flags before anything is allocated, so that a
// configuration that cannot fit ends with the numbers instead of std::bad_alloc half-way through set-up.
#pragma once

#include <optional>
#include <string>

#include "moecore/config/arguments.h"

namespace moecore {

// Bytes on the rank holding the most (the first pipeline stage). Sums in double: the flags' products may exceed
// 64-bit integers for configurations this estimate exists to refuse.
struct MemoryEstimate {
  double parameters = 0;    // the weights (fp32 storage)
  double gradients = 0;     // fp32 main gradients
  double optimizer = 0;     // Adam moments (+ fp32 main parameters of 16-bit weights), sharded by the distributed
                            // optimizer over data-parallel ranks
  double activations = 0;   // a first estimate: what backward keeps of the live micro-batches, plus the output
                            // layer's logits chunk
  double data_indices = 0;  // the GPT dataset's sample and shuffle indices of every split

  double total() const { return parameters + gradients + optimizer + activations + data_indices; }
};

// `args` after finalisation, with the padded vocabulary in args.model.vocab_size.
MemoryEstimate estimate_memory(const TrainingArgs& args);

// The memory this process can count on: MemAvailable + SwapFree of /proc/meminfo, shared by the ranks of the job on
// this host (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE). None where /proc/meminfo cannot be read.
std::optional<double> available_memory_per_rank();

// Throws ConfigError with the estimate's parts when it exceeds `available` bytes.
void check_memory_fits(const MemoryEstimate& estimate, double available);

std::string format_bytes(double bytes);  // "3.2 GiB"

}  // namespace moecore
