// When this process started, as wall-clock seconds since the Unix epoch: Megatron's _TRAIN_START_TIME, taken before
// anything else runs, so --exit-duration-in-mins counts the start-up (data, model, checkpoint load) too.
#pragma once

namespace moecore {

double process_start_seconds();

}  // namespace moecore
