// Loss scaling against Megatron's grad_scaler.py, stepped by hand.
#include <gtest/gtest.h>

#include <stdexcept>

#include "moecore/optim/grad_scaler.h"

namespace moecore {
namespace {

TEST(GradScaler, ConstantNeverChanges) {
  GradScaler scaler = GradScaler::constant(1024.0);
  EXPECT_FALSE(scaler.is_dynamic());
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_EQ(scaler.inv_scale(), 1.0f / 1024.0f);
  for (int i = 0; i < 5; ++i) scaler.update(true);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 1024.0f);
}

TEST(GradScaler, InverseIsTakenInDoubleThenRounded) {
  // 1/3 in double rounded to fp32 (0x3EAAAAAB), not fp32 division of a rounded 3.
  EXPECT_EQ(GradScaler::constant(3.0).inv_scale(), static_cast<float>(1.0 / 3.0));
}

TEST(GradScaler, DynamicBacksOffAfterHysteresisAndGrowsAfterWindow) {
  // initial 2^16, min 2^14, window 3, hysteresis 2.
  GradScaler scaler = GradScaler::dynamic({65536.0, 16384.0, 3, 2});
  EXPECT_TRUE(scaler.is_dynamic());
  scaler.update(true);  // hysteresis 2 -> 1: the scale stays
  EXPECT_EQ(scaler.scale(), 65536.0f);
  scaler.update(true);  // 1 -> 0: halves
  EXPECT_EQ(scaler.scale(), 32768.0f);
  scaler.update(true);  // -1: halves again (the tracker is not restored by finite steps, only by growth)
  EXPECT_EQ(scaler.scale(), 16384.0f);
  scaler.update(true);  // the floor
  EXPECT_EQ(scaler.scale(), 16384.0f);
  scaler.update(false);
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), 16384.0f);
  scaler.update(true);  // resets the growth tracker; hysteresis tracker still <= 0: halves, floored
  EXPECT_EQ(scaler.scale(), 16384.0f);
  EXPECT_EQ(scaler.state().growth_tracker, 0);
  scaler.update(false);
  scaler.update(false);
  scaler.update(false);  // third finite step in a row: doubles, hysteresis restored to 2
  EXPECT_EQ(scaler.scale(), 32768.0f);
  EXPECT_EQ(scaler.state().hysteresis_tracker, 2);
  EXPECT_EQ(scaler.state().growth_tracker, 0);
  scaler.update(true);  // 2 -> 1: stays
  EXPECT_EQ(scaler.scale(), 32768.0f);
}

TEST(GradScaler, StateRoundTripsForDynamicOnly) {
  GradScaler scaler = GradScaler::dynamic({1024.0, 1.0, 10, 3});
  scaler.update(true);
  scaler.update(false);
  const GradScaler::State saved = scaler.state();
  EXPECT_EQ(saved.scale, 1024.0f);
  EXPECT_EQ(saved.growth_tracker, 1);
  EXPECT_EQ(saved.hysteresis_tracker, 2);
  GradScaler restored = GradScaler::dynamic({8.0, 1.0, 10, 3});
  restored.load_state(saved);
  EXPECT_EQ(restored.scale(), 1024.0f);
  EXPECT_EQ(restored.state().growth_tracker, 1);
  EXPECT_EQ(restored.state().hysteresis_tracker, 2);
  GradScaler constant = GradScaler::constant(4.0);
  constant.load_state(saved);
  EXPECT_EQ(constant.scale(), 4.0f);
}

TEST(GradScaler, BadOptionsAreRefused) {
  EXPECT_THROW(GradScaler::constant(0.0), std::invalid_argument);
  EXPECT_THROW(GradScaler::constant(-2.0), std::invalid_argument);
  EXPECT_THROW(GradScaler::constant(1e39), std::invalid_argument);  // Inf in fp32
  EXPECT_THROW(GradScaler::dynamic({1.0, 2.0, 1, 1}), std::invalid_argument);
  EXPECT_THROW(GradScaler::dynamic({4.0, 1.0, 0, 1}), std::invalid_argument);
  EXPECT_THROW(GradScaler::dynamic({4.0, 1.0, 1, 0}), std::invalid_argument);
}

}  // namespace
}  // namespace moecore
