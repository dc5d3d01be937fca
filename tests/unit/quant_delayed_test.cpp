// Delayed scaling's amax history (quant/delayed_scaling.h), stepped by hand against TE's amax_and_scale_update.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "moecore/quant/delayed_scaling.h"
#include "moecore/quant/quantize.h"

namespace moecore::quant {
namespace {

TEST(QuantDelayed, MaxAlgoKeepsAnAmaxForTheWholeWindow) {
  DelayedScaling state(3, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3);
  EXPECT_EQ(state.scale(), 1.0f);  // TE's initial scale
  const std::vector<float> amaxes = {2, 4, 1, 1, 1};
  // Window after each step = the last 3 amaxes: {2} {2,4} {2,4,1} {4,1,1} {1,1,1}.
  const std::vector<float> expected = {448.0f / 2, 448.0f / 4, 448.0f / 4, 448.0f / 4, 448.0f / 1};
  for (size_t step = 0; step < amaxes.size(); ++step) {
    state.record_amax(amaxes[step]);
    state.update();
    EXPECT_EQ(state.scale(), expected[step]) << step;
  }
  // TE's layout: slot 0 zeroed, then oldest to newest.
  EXPECT_EQ(state.amax_history(), (std::vector<float>{0, 1, 1}));
}

TEST(QuantDelayed, MostRecentUsesThisStepOnly) {
  DelayedScaling state(4, AmaxComputeAlgo::kMostRecent, 0, ElementFormat::kE5M2);
  state.record_amax(8.0f);
  state.update();
  EXPECT_EQ(state.scale(), 57344.0f / 8);
  state.record_amax(2.0f);
  state.update();
  EXPECT_EQ(state.scale(), 57344.0f / 2);
}

TEST(QuantDelayed, SlotZeroTakesTheMaxOfTheStepsQuantizations) {
  DelayedScaling state(2, AmaxComputeAlgo::kMostRecent, 0, ElementFormat::kE4M3);
  state.record_amax(3.0f);
  state.record_amax(7.0f);
  state.record_amax(5.0f);
  state.record_amax(std::numeric_limits<float>::quiet_NaN());  // skipped, as fmaxf
  state.update();
  EXPECT_EQ(state.scale(), 64.0f);
}

TEST(QuantDelayed, MarginDividesByPowersOfTwo) {
  DelayedScaling state(1, AmaxComputeAlgo::kMax, 2, ElementFormat::kE4M3);
  state.record_amax(7.0f);
  state.update();
  EXPECT_EQ(state.scale(), (448.0f / 4.0f) / 7.0f);
}

TEST(QuantDelayed, ZeroAndNonFiniteAmaxesKeepThePreviousScale) {
  DelayedScaling state(2, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3);
  state.record_amax(4.0f);
  state.update();
  EXPECT_EQ(state.scale(), 112.0f);
  state.update();  // a step of zeros: nothing rolls, the scale stays
  EXPECT_EQ(state.scale(), 112.0f);
  EXPECT_EQ(state.amax_history(), (std::vector<float>{0, 4}));
  state.record_amax(std::numeric_limits<float>::infinity());
  state.update();  // Inf in the window: the scale stays for as long as it is there (2 updates)
  EXPECT_EQ(state.scale(), 112.0f);
  state.record_amax(1.0f);
  state.update();
  EXPECT_EQ(state.scale(), 112.0f);
  state.record_amax(1.0f);
  state.update();
  EXPECT_EQ(state.scale(), 448.0f);
  state.record_amax(1e-44f);
  state.update();  // window {1, 1e-44}: max 1
  EXPECT_EQ(state.scale(), 448.0f);
  DelayedScaling tiny(1, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3);
  tiny.record_amax(1e-44f);
  tiny.update();  // 448 / 1e-44 overflows: FLT_MAX
  EXPECT_EQ(tiny.scale(), std::numeric_limits<float>::max());
}

TEST(QuantDelayed, QuantizesWithTheStepsScaleAndRecordsTheAmax) {
  DelayedScaling state(1, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3);
  const std::vector<float> x = {0.5f, -600.0f, 2.0f, 0.0f};
  const QuantSpec spec = make_spec(Recipe::kDelayed, ElementFormat::kE4M3, Role::kActivation);
  QuantizeOptions options;
  options.tensor_scale = state.scale();
  QuantizedTensor q = quantize(x.data(), 2, 2, spec, Usage::kRowwise, options);
  EXPECT_EQ(q.codes[1], 0xFE);  // scale 1: -600 saturates
  EXPECT_EQ(q.scales[0], 1.0f);
  state.record_amax(q.amax);
  state.update();
  EXPECT_EQ(state.scale(), 448.0f / 600.0f);
  options.tensor_scale = state.scale();
  q = quantize(x.data(), 2, 2, spec, Usage::kRowwise, options);
  EXPECT_EQ(q.scales[0], 1.0f / (448.0f / 600.0f));
  EXPECT_EQ(q.codes[2], encode_e4m3(2.0f * (448.0f / 600.0f)));
}

TEST(QuantDelayed, RejectsBadSettings) {
  EXPECT_THROW(DelayedScaling(0, AmaxComputeAlgo::kMax, 0, ElementFormat::kE4M3), std::invalid_argument);
  EXPECT_THROW(DelayedScaling(1, AmaxComputeAlgo::kMax, 0, ElementFormat::kE2M1), std::invalid_argument);
  EXPECT_THROW(parse_amax_compute_algo("mean"), std::invalid_argument);
  EXPECT_EQ(parse_amax_compute_algo("most_recent"), AmaxComputeAlgo::kMostRecent);
}

}  // namespace
}  // namespace moecore::quant
