#include "moecore/ops/scoped_state.h"

namespace moecore::ops {

ScopedState current_scoped_state() {
  ScopedState state;
  state.activation_dtype = detail::activation_dtype_state();
  state.linear_quantization = detail::linear_quantization_state();
  state.delayed_scales = delayed_scales_log(&state.delayed_scales_mode);
  return state;
}

void restore_scoped_state(const ScopedState& state) {
  detail::restore_activation_dtype_state(state.activation_dtype);
  detail::restore_linear_quantization_state(state.linear_quantization);
  detail::restore_delayed_scales_state(state.delayed_scales, state.delayed_scales_mode);
}

}  // namespace moecore::ops
