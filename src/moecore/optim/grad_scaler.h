// Loss scaling, as Megatron's optimizer/grad_scaler.py. The backward is seeded with loss x scale; after the gradient
// reduction the optimizer multiplies the gradients by 1 / scale and checks them for Inf / NaN. An iteration with a
// non-finite gradient is skipped (no clipping, no update, the LR schedule does not advance) and update(true) is
// called; otherwise update(false).
//
//   constant (--loss-scale S): the scale never changes, whatever update() is told.
//   dynamic (fp16 without --loss-scale): starts at --initial-loss-scale; on a non-finite iteration the growth
//     tracker resets and the hysteresis tracker drops by one, and once it is <= 0 the scale halves (not below
//     --min-loss-scale) on every further non-finite iteration; after --loss-scale-window finite iterations in a row
//     the scale doubles and the hysteresis tracker is restored to --hysteresis. The scale is an fp32 value with no
//     upper bound, as Megatron's tensor.
#pragma once

#include <cstdint>
#include <optional>

namespace moecore {

struct DynamicLossScaleOptions {
  double initial_scale = 4294967296.0;  // --initial-loss-scale (2^32)
  double min_scale = 1.0;               // --min-loss-scale
  int64_t growth_interval = 1000;       // --loss-scale-window
  int64_t hysteresis = 2;               // --hysteresis
};

class GradScaler {
 public:
  // A fixed scale (> 0; std::invalid_argument otherwise).
  static GradScaler constant(double scale);
  // Megatron's DynamicGradScaler with growth factor 2 and backoff factor 0.5 (std::invalid_argument naming the
  // option when an option is out of range: scales > 0, min <= initial, window and hysteresis >= 1).
  static GradScaler dynamic(const DynamicLossScaleOptions& options);

  bool is_dynamic() const { return dynamic_; }
  float scale() const { return scale_; }
  // 1 / scale computed in double and rounded to fp32 (Megatron: scale.double().reciprocal().float()).
  float inv_scale() const;
  void update(bool found_inf);

  // Checkpoint state (Megatron's state_dict: scale, growth_tracker, hysteresis_tracker; empty for a constant scaler).
  struct State {
    float scale = 1.0f;
    int64_t growth_tracker = 0;
    int64_t hysteresis_tracker = 0;
  };
  State state() const { return {scale_, growth_tracker_, hysteresis_tracker_}; }
  void load_state(const State& state);

 private:
  GradScaler() = default;
  bool dynamic_ = false;
  float scale_ = 1.0f;
  float min_scale_ = 1.0f;
  int64_t growth_interval_ = 1;
  int64_t hysteresis_ = 1;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_ = 0;
};

// The loss scalers of a run, as Megatron's ChainedOptimizer holds them (_get_megatron_optimizer_based_on_param_groups
// builds one scaler per optimizer): the dense parameters' optimizer first, the routed experts' second when the model
// has routed experts. Each scaler unscales and checks its own parameters' gradients and updates on its own overflow;
// the iteration is skipped when either overflowed. The backward is seeded with the first scaler's scale
// (ChainedOptimizer.get_loss_scale), which is also the log's "loss scale".
struct LossScalers {
  std::optional<GradScaler> dense;
  std::optional<GradScaler> expert;

  bool enabled() const { return dense.has_value(); }
  bool dynamic() const { return dense.has_value() && dense->is_dynamic(); }
  float backward_scale() const { return dense ? dense->scale() : 1.0f; }
};

}  // namespace moecore
