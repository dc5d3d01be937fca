// Delayed scaling (TE's DelayedScaling; Megatron's --fp8-recipe delayed with --fp8-amax-history-len,
// --fp8-amax-compute-algo, --fp8-margin): one tensor's scale for this step comes from the amax history of earlier
// steps; this step's amax is recorded while quantizing and pushed into the history after the step.
//
//   DelayedScaling state(1024, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3);
//   q = quantize(x, ..., {.tensor_scale = state.scale()}); state.record_amax(q.amax);   // forward of step t
//   state.update();                                                                     // after the step
// A linear layer's three operands keep their state together in TE's layout (delayed_linear_scaling.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/quant/fp8_formats.h"

namespace moecore::quant {

enum class AmaxComputeAlgo { kMax, kMostRecent };
// "max" / "most_recent" (std::invalid_argument otherwise).
AmaxComputeAlgo parse_amax_compute_algo(std::string_view name);
std::string amax_compute_algo_name(AmaxComputeAlgo algo);

// One operand of a quantized GEMM under delayed scaling: the encode scale it is quantized with, and where its amax
// is max-recorded (NaN skipped; the history's slot 0), or null when this quantization is not recorded.
struct DelayedOperand {
  float scale = 1.0f;
  float* amax = nullptr;
};
// *slot = max(*slot, amax), NaN skipped, as the cast kernels' atomic max.
void record_amax(float* slot, float amax);

// TE's amax_and_scale_update for one tensor (the rules under DelayedScaling::update) on a history of `length`
// entries `stride` floats apart (a column of TE's [L, n] amax_history): history[0] this step's amax, then the older
// ones, oldest first. `scale` is read (the previous scale) and written.
void update_amax_history_and_scale(float* history, int64_t length, int64_t stride, float& scale, AmaxComputeAlgo algo,
                                   int margin, ElementFormat format);

// The largest |margin| that leaves a format's range usable: the scaled amax is format max x 2^-margin, and the format
// spans its smallest subnormal to its max (E4M3 2^-9 .. 448, 17.8 binades; E5M2 2^-16 .. 57344, 31.8). A margin
// beyond floor(log2(max / smallest subnormal)) puts the amax itself below the smallest subnormal (every element
// quantizes to 0); its negative saturates every element above amax x 2^margin. 17 for E4M3, 31 for E5M2.
int delayed_margin_limit(ElementFormat format);

class DelayedScaling {
 public:
  // history_len >= 1 and margin as Megatron's flags; the scale starts at 1 and the history at zeros (TE's
  // initial fp8 meta). std::invalid_argument for history_len < 1 or an E2M1 format.
  DelayedScaling(int64_t history_len, AmaxComputeAlgo algo, int margin, ElementFormat format);

  // The encode scale of this step (quantize with it; decode scale 1 / scale).
  float scale() const { return scale_; }
  // This state as a GEMM operand: its scale, its amax recorded into slot 0.
  DelayedOperand operand() { return {scale_, history_.data()}; }
  // Records this step's amax: slot 0 of the history keeps the max (NaN skipped) over every quantization of the
  // tensor in the step, as the cast kernels' atomic max into amax_history[0].
  void record_amax(float amax);
  // TE's amax_and_scale_update after the step (transformer_engine/common/recipe/delayed_scaling.cu kernel_bulk, the
  // kernel PyTorch's reduce_and_update_fp8_tensors calls), with a = this step's amax (slot 0):
  //   a == 0:   nothing rolls and the scale stays.
  //   a != 0:   the window is the L - 1 older amaxes and a; amax = max over it (algo max, NaN skipped) or a
  //             (most_recent); the history rolls (the oldest leaves, a becomes the newest, slot 0 is zeroed).
  //   scale = (format max x 2^-margin) / amax when amax is finite and > 0, else the previous scale; an infinite
  //   quotient becomes FLT_MAX.
  void update();

  // The stored history, TE's layout: [0] this step's slot, [1] the oldest ... [L - 1] the newest.
  const std::vector<float>& amax_history() const { return history_; }
  AmaxComputeAlgo algo() const { return algo_; }
  int margin() const { return margin_; }
  ElementFormat format() const { return format_; }

 private:
  std::vector<float> history_;
  AmaxComputeAlgo algo_;
  int margin_;
  ElementFormat format_;
  float scale_ = 1.0f;
};

}  // namespace moecore::quant
