// The ops' scoped settings (ScopedActivationDType, ScopedLinearQuantization, ScopedDelayedScales) as one value: a
// program that runs two pieces of work taking turns (the EP overlap's lanes, parallel/turn_taking.h) takes them when
// a lane hands the cores over and puts them back when it resumes, so each lane sees only its own scopes.
#pragma once

#include <array>

#include "moecore/ops/delayed_scales_replay.h"
#include "moecore/quant/quantized_gemm.h"

namespace moecore::ops {

struct ScopedState {
  std::array<int, 3> activation_dtype{};  // per device, as precision.cpp keeps it
  std::array<const quant::QuantizedLinearConfig*, 3> linear_quantization{};
  DelayedScalesLog* delayed_scales = nullptr;
  ScopedDelayedScales::Mode delayed_scales_mode = ScopedDelayedScales::Mode::kRecord;
};

ScopedState current_scoped_state();
void restore_scoped_state(const ScopedState& state);

namespace detail {
// Each piece from the file that keeps it.
std::array<int, 3> activation_dtype_state();
void restore_activation_dtype_state(const std::array<int, 3>& state);
std::array<const quant::QuantizedLinearConfig*, 3> linear_quantization_state();
void restore_linear_quantization_state(const std::array<const quant::QuantizedLinearConfig*, 3>& state);
void restore_delayed_scales_state(DelayedScalesLog* log, ScopedDelayedScales::Mode mode);
}  // namespace detail

}  // namespace moecore::ops
