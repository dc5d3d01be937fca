// Where a training run stands: what Megatron's train() carries between iterations (args.iteration,
// args.consumed_train_samples, args.consumed_valid_samples, num_floating_point_operations_so_far) and what a
// checkpoint saves to resume the run at the same samples.
#pragma once

#include <cstdint>

namespace moecore {

struct TrainingProgress {
  int64_t iteration = 0;               // iterations completed
  int64_t consumed_train_samples = 0;  // training samples read (iteration x global batch size)
  int64_t consumed_valid_samples = 0;  // validation samples read by the evaluations during and after training
  double floating_point_operations_so_far = 0.0;  // Megatron's num_floating_point_operations summed per iteration
};

}  // namespace moecore
