// The precision-aware optimizer's states (Megatron's --use-precision-aware-optimizer with --exp-avg-dtype,
// --exp-avg-sq-dtype, --main-params-dtype): each state of a parameter piece is stored in its format with one fp32
// scale (quant/optimizer_state.h), as TransformerEngine's FusedAdam keeps one scale per state tensor and Megatron's
// distributed optimizer hands it one tensor per parameter piece of the rank's shard
// (megatron/core/optimizer/distrib_optimizer.py). Every step unscales to fp32, runs the fp32 AdamW update and stores
// the updated states with new scales from their absmax (fused_adam.py: step, _apply_scale).
#pragma once

#include <cstdint>

#include "moecore/ops/optim.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

using quant::StateFormat;

// One state of one parameter piece: a flat view of `numel` stored elements (dtype ops::state_storage_dtype(format))
// and its scale.
class ScaledState {
 public:
  ScaledState() = default;
  // `stored` is a 1-D view of zeros in the format's storage dtype (scale 1: the value 0).
  ScaledState(Tensor stored, StateFormat format);

  StateFormat format() const { return format_; }
  bool scaled() const { return quant::state_format_range(format_) > 0.0f; }
  int64_t numel() const { return stored_.numel(); }
  float scale() const { return scale_; }
  void set_scale(float scale) { scale_ = scale; }
  const Tensor& stored() const { return stored_; }

  // out (fp32) := the unscaled elements [begin, begin + out.numel()).
  void read(int64_t begin, Tensor& out) const { read(begin, out, scale_); }
  // Elements [begin, begin + in.numel()) := in (fp32), encoded with the current scale.
  void write(int64_t begin, const Tensor& in) { write(begin, in, scale_); }
  // The same with a given scale (a step reads with the old scale and writes with the new one).
  void read(int64_t begin, Tensor& out, float scale) const;
  void write(int64_t begin, const Tensor& in, float scale);
  // TE's set_scaled_state: the whole state from fp32 values, its scale from their absmax. A no-op when `unscaled` is
  // this fp32 state's own storage.
  void assign(const Tensor& unscaled);
  // TE's get_unscaled_state: an fp32 copy of the whole state.
  Tensor unscaled(MemCategory category = MemCategory::kOther) const;

 private:
  Tensor stored_;
  StateFormat format_ = StateFormat::kF32;
  float scale_ = 1.0f;
};

// One AdamW update of a parameter piece whose states are ScaledStates (TE FusedAdam.step): the states are unscaled
// to fp32, updated by ops::adamw_step, and stored back with the scales of their updated absmax. Without `main` the
// update goes to `param` (fp32 weights); with it to the main parameters, and param := the updated main parameters
// rounded to params_dtype (before they are stored in main's format, as TE writes the model weights from the fp32
// master inside the kernel). param and grad are flat fp32 tensors of the pieces' length. Works through fp32 chunks, so
// no whole-piece fp32 copy is ever held: with a scaled format the updated chunks are computed twice, once for the new
// absmax and once to store them (bit-identical: the same kernel on the same inputs). With `remainder` (bf16 weights,
// no `main`) the fp32 main parameters are the weights joined with their 16-bit remainders, and the update is split
// back into both (ops::split_param_remainders, TE's store_param_remainders).
void scaled_adamw_step(Tensor& param, const Tensor& grad, ScaledState& exp_avg, ScaledState& exp_avg_sq,
                       ScaledState* main, DType params_dtype, const ops::AdamWHyper& hyper,
                       Tensor* remainder = nullptr);

}  // namespace moecore
