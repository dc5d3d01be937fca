#include "moecore/plan/plan_flops.h"

#include <string>

namespace moecore::plan {
namespace {

void require(const bool condition, const std::string& message) {
  if (!condition) throw ConfigError(message);
}

double flops_of_sequences(const PlanModel& model, const double sequences) {
  require(model.config.seq_length > 0,
          "FLOPs count needs --seq-length (got " + std::to_string(model.config.seq_length) + ")");
  const auto seq = static_cast<double>(model.config.seq_length);
  return num_floating_point_operations(flops_shape(model), sequences * seq, sequences * seq * seq);
}

}  // namespace

FlopsShape flops_shape(const PlanModel& model) {
  const int64_t mtp = model.config.mtp_num_layers;
  require(mtp >= 0, "--mtp-num-layers must not be negative (got " + std::to_string(mtp) + ")");
  return moecore::flops_shape(model.config);
}

double flops_per_token(const PlanModel& model) {
  return flops_of_sequences(model, 1.0) / static_cast<double>(model.config.seq_length);
}

double flops_per_step(const PlanModel& model, const int64_t global_batch_size) {
  require(global_batch_size > 0,
          "FLOPs count needs a positive --global-batch-size (got " + std::to_string(global_batch_size) + ")");
  return flops_of_sequences(model, static_cast<double>(global_batch_size));
}

}  // namespace moecore::plan
