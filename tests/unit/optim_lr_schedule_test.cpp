// LRSchedule against Megatron's get_lr formulas, written out here per style and evaluated by hand at warmup start /
// middle / end, mid decay, end of decay and beyond it.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "moecore/model/config.h"
#include "moecore/optim/lr_schedule.h"

namespace moecore {
namespace {

constexpr double kMax = 3e-4;
constexpr double kMin = 3e-5;
constexpr double kInit = 1e-5;
constexpr double kTol = 1e-15;  // values are ~1e-4: a relative error of ~1e-11

// 10 warmup iterations, decay over 110 iterations, 8 samples per iteration (Megatron counts samples).
LRScheduleConfig base_config(const LRDecayStyle style) {
  LRScheduleConfig config;
  config.max_lr = kMax;
  config.min_lr = kMin;
  config.init_lr = kInit;
  config.global_batch_size = 8;
  config.warmup_iters = 10;
  config.decay_iters = 110;
  config.decay_style = style;
  return config;
}

// Warmup is the same for every style: init + (max - init) * step / warmup.
void expect_warmup(const LRSchedule& schedule) {
  EXPECT_NEAR(schedule.lr_at(0), kInit, kTol);
  EXPECT_NEAR(schedule.lr_at(5), kInit + (kMax - kInit) * 0.5, kTol);
  EXPECT_NEAR(schedule.lr_at(3), kInit + (kMax - kInit) * 0.3, kTol);
  EXPECT_NEAR(schedule.lr_at(10), kMax, kTol);
}

TEST(LRSchedule, LinearDecay) {
  const LRSchedule schedule(base_config(LRDecayStyle::kLinear));
  expect_warmup(schedule);
  // decay ratio = (it - 10) / (110 - 10); lr = min + (1 - ratio) * (max - min)
  EXPECT_NEAR(schedule.lr_at(35), kMin + 0.75 * (kMax - kMin), kTol);
  EXPECT_NEAR(schedule.lr_at(60), kMin + 0.5 * (kMax - kMin), kTol);
  EXPECT_NEAR(schedule.lr_at(110), kMin, kTol);
  EXPECT_NEAR(schedule.lr_at(111), kMin, kTol);
  EXPECT_NEAR(schedule.lr_at(1000), kMin, kTol);
}

TEST(LRSchedule, CosineDecay) {
  const LRSchedule schedule(base_config(LRDecayStyle::kCosine));
  expect_warmup(schedule);
  // lr = min + 0.5 * (cos(pi * ratio) + 1) * (max - min); cos(pi/4) = sqrt(2)/2
  EXPECT_NEAR(schedule.lr_at(35), kMin + 0.5 * (std::sqrt(2.0) / 2.0 + 1.0) * (kMax - kMin), kTol);
  EXPECT_NEAR(schedule.lr_at(60), kMin + 0.5 * (kMax - kMin), kTol);
  EXPECT_NEAR(schedule.lr_at(85), kMin + 0.5 * (1.0 - std::sqrt(2.0) / 2.0) * (kMax - kMin), kTol);
  EXPECT_NEAR(schedule.lr_at(110), kMin, kTol);
  EXPECT_NEAR(schedule.lr_at(500), kMin, kTol);
}

TEST(LRSchedule, ConstantKeepsPeakEvenBeyondDecay) {
  const LRSchedule schedule(base_config(LRDecayStyle::kConstant));
  expect_warmup(schedule);
  EXPECT_NEAR(schedule.lr_at(60), kMax, kTol);
  EXPECT_NEAR(schedule.lr_at(110), kMax, kTol);
  EXPECT_NEAR(schedule.lr_at(5000), kMax, kTol);  // Megatron returns max_lr before the "beyond decay" check
}

TEST(LRSchedule, InverseSquareRoot) {
  const LRSchedule schedule(base_config(LRDecayStyle::kInverseSquareRoot));
  expect_warmup(schedule);
  // lr = max * sqrt(warmup_samples) / sqrt(samples) = max * sqrt(10 / it), floored at min
  EXPECT_NEAR(schedule.lr_at(40), kMax * 0.5, kTol);
  EXPECT_NEAR(schedule.lr_at(90), kMax / 3.0, kTol);
  EXPECT_NEAR(schedule.lr_at(110), kMax * std::sqrt(10.0 / 110.0), kTol);
  EXPECT_NEAR(schedule.lr_at(111), kMin, kTol);

  LRScheduleConfig high_floor = base_config(LRDecayStyle::kInverseSquareRoot);
  high_floor.min_lr = 1e-4;  // max * sqrt(10/100) = 9.49e-5 < 1e-4
  EXPECT_NEAR(LRSchedule(high_floor).lr_at(100), 1e-4, kTol);
}

TEST(LRSchedule, InverseSquareRootWithoutWarmupCountsSamples) {
  LRScheduleConfig config = base_config(LRDecayStyle::kInverseSquareRoot);
  config.warmup_iters = 0;
  const LRSchedule schedule(config);
  // Megatron clamps warmup and step counts to at least one *sample*: lr = max * 1 / sqrt(it * 8).
  EXPECT_NEAR(schedule.lr_at(0), kMax, kTol);
  EXPECT_NEAR(schedule.lr_at(2), kMax / 4.0, kTol);
  EXPECT_NEAR(schedule.lr_at(8), kMax / 8.0, kTol);
}

// WSD: stable at max until the last 40 decay iterations (anneal start = 70), then anneal over 40.
LRSchedule wsd_schedule(const WSDDecayStyle style) {
  LRScheduleConfig config = base_config(LRDecayStyle::kWSD);
  config.wsd_decay_iters = 40;
  config.wsd_decay_style = style;
  return LRSchedule(config);
}

void expect_wsd_stable_phase(const LRSchedule& schedule) {
  expect_warmup(schedule);
  EXPECT_NEAR(schedule.lr_at(11), kMax, kTol);
  EXPECT_NEAR(schedule.lr_at(50), kMax, kTol);
  EXPECT_NEAR(schedule.lr_at(70), kMax, kTol);
  EXPECT_NEAR(schedule.lr_at(110), kMin, kTol);  // every anneal style reaches coefficient 0 at ratio 1
  EXPECT_NEAR(schedule.lr_at(111), kMin, kTol);
}

TEST(LRSchedule, WsdExponential) {
  const LRSchedule schedule = wsd_schedule(WSDDecayStyle::kExponential);
  expect_wsd_stable_phase(schedule);
  // coeff = 2 * 0.5^ratio - 1; ratio 0.5 -> sqrt(2) - 1; ratio 0.25 -> 2 * 2^-0.25 - 1
  EXPECT_NEAR(schedule.lr_at(90), kMin + (std::sqrt(2.0) - 1.0) * (kMax - kMin), kTol);
  EXPECT_NEAR(schedule.lr_at(80), kMin + (2.0 / std::pow(2.0, 0.25) - 1.0) * (kMax - kMin), kTol);
}

TEST(LRSchedule, WsdLinear) {
  const LRSchedule schedule = wsd_schedule(WSDDecayStyle::kLinear);
  expect_wsd_stable_phase(schedule);
  EXPECT_NEAR(schedule.lr_at(90), kMin + 0.5 * (kMax - kMin), kTol);
  EXPECT_NEAR(schedule.lr_at(100), kMin + 0.25 * (kMax - kMin), kTol);
}

TEST(LRSchedule, WsdCosine) {
  const LRSchedule schedule = wsd_schedule(WSDDecayStyle::kCosine);
  expect_wsd_stable_phase(schedule);
  EXPECT_NEAR(schedule.lr_at(90), kMin + 0.5 * (kMax - kMin), kTol);
  EXPECT_NEAR(schedule.lr_at(80), kMin + 0.5 * (std::sqrt(2.0) / 2.0 + 1.0) * (kMax - kMin), kTol);
}

TEST(LRSchedule, WsdMinusSqrt) {
  const LRSchedule schedule = wsd_schedule(WSDDecayStyle::kMinusSqrt);
  expect_wsd_stable_phase(schedule);
  EXPECT_NEAR(schedule.lr_at(80), kMin + 0.5 * (kMax - kMin), kTol);  // 1 - sqrt(0.25)
  EXPECT_NEAR(schedule.lr_at(90), kMin + (1.0 - std::sqrt(0.5)) * (kMax - kMin), kTol);
}

TEST(LRSchedule, WarmupFractionOfDecay) {
  LRScheduleConfig config = base_config(LRDecayStyle::kLinear);
  config.warmup_iters = 0;
  config.warmup_fraction = 0.05;  // 0.05 * 110 = 5.5 iterations of warmup
  const LRSchedule schedule(config);
  EXPECT_NEAR(schedule.warmup_steps(), 0.05 * 110 * 8, 1e-9);
  EXPECT_NEAR(schedule.lr_at(0), kInit, kTol);
  EXPECT_NEAR(schedule.lr_at(5), kInit + (kMax - kInit) * 5.0 / 5.5, kTol);
  EXPECT_NEAR(schedule.lr_at(6), kMin + (1.0 - 0.5 / 104.5) * (kMax - kMin), kTol);
  EXPECT_NEAR(schedule.lr_at(110), kMin, kTol);
}

TEST(LRSchedule, NoWarmupStartsAtPeak) {
  LRScheduleConfig config = base_config(LRDecayStyle::kCosine);
  config.warmup_iters = 0;
  const LRSchedule schedule(config);
  EXPECT_NEAR(schedule.lr_at(0), kMax, kTol);
  EXPECT_NEAR(schedule.lr_at(55), kMin + 0.5 * (kMax - kMin), kTol);
}

TEST(LRSchedule, RejectsWhatMegatronAsserts) {
  const auto throws_with = [](LRScheduleConfig config, const std::string& needle) {
    try {
      LRSchedule schedule(config);
      ADD_FAILURE() << "no error; expected one mentioning " << needle;
    } catch (const ConfigError& error) {
      EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
    }
  };
  LRScheduleConfig config = base_config(LRDecayStyle::kLinear);
  config.min_lr = 1e-3;
  throws_with(config, "--min-lr");
  config = base_config(LRDecayStyle::kLinear);
  config.init_lr = 1e-3;
  throws_with(config, "--lr-warmup-init");
  config = base_config(LRDecayStyle::kLinear);
  config.warmup_iters = 110;
  throws_with(config, "warmup");
  config = base_config(LRDecayStyle::kLinear);
  config.warmup_fraction = 0.1;
  throws_with(config, "--lr-warmup-fraction and --lr-warmup-iters");
  config = base_config(LRDecayStyle::kLinear);
  config.decay_iters = 0;
  throws_with(config, "--lr-decay-iters");
  throws_with(base_config(LRDecayStyle::kWSD), "--lr-wsd-decay-iters");
}

TEST(LRSchedule, StyleNamesRoundTrip) {
  for (const LRDecayStyle style : {LRDecayStyle::kConstant, LRDecayStyle::kLinear, LRDecayStyle::kCosine,
                                   LRDecayStyle::kInverseSquareRoot, LRDecayStyle::kWSD}) {
    EXPECT_EQ(parse_lr_decay_style(to_string(style)), style);
  }
  for (const WSDDecayStyle style :
       {WSDDecayStyle::kExponential, WSDDecayStyle::kLinear, WSDDecayStyle::kCosine, WSDDecayStyle::kMinusSqrt}) {
    EXPECT_EQ(parse_wsd_decay_style(to_string(style)), style);
  }
  EXPECT_EQ(to_string(LRDecayStyle::kInverseSquareRoot), "inverse-square-root");
  EXPECT_EQ(parse_lr_decay_style("wsd"), std::nullopt);  // Megatron's choice is spelled "WSD"
}

// Megatron's num_steps counts samples: after a resume with a smaller global batch, each iteration moves the schedule
// by the new batch, from the samples the checkpoint recorded.
TEST(LRSchedule, PositionIsASampleCount) {
  LRSchedule schedule(base_config(LRDecayStyle::kLinear));  // 8 samples per iteration
  for (int i = 0; i < 20; ++i) schedule.step(8);
  EXPECT_EQ(schedule.num_steps(), 160.0);
  EXPECT_NEAR(schedule.lr(), kMin + (1.0 - (160.0 - 80.0) / (880.0 - 80.0)) * (kMax - kMin), kTol);
  LRScheduleConfig smaller = base_config(LRDecayStyle::kLinear);
  smaller.global_batch_size = 4;
  LRSchedule resumed(smaller);
  SchedulerState stored = schedule.state();
  resumed.load(stored, SchedulerLoadMode::kUseCheckpoint);  // the checkpoint's sample lengths
  resumed.step(4);
  EXPECT_EQ(resumed.num_steps(), 164.0);
  EXPECT_NEAR(resumed.lr(), kMin + (1.0 - (164.0 - 80.0) / (880.0 - 80.0)) * (kMax - kMin), kTol);
  // The flags' lengths at the new batch (warmup 40, decay 440 samples) differ from the stored ones.
  LRSchedule checked(smaller);
  try {
    checked.load(stored, SchedulerLoadMode::kCheck);
    ADD_FAILURE() << "a differing warmup length was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("lr_warmup_steps 40 but the checkpoint has 80"), std::string::npos)
        << e.what();
  }
  LRSchedule overridden(smaller);
  overridden.load(stored, SchedulerLoadMode::kOverride);
  EXPECT_EQ(overridden.decay_steps(), 440.0);
  EXPECT_EQ(overridden.num_steps(), 160.0);  // the checkpoint's position; the trainer resets it to the samples
}

TEST(LRSchedule, LoadChecksEveryField) {
  const LRScheduleConfig config = base_config(LRDecayStyle::kCosine);
  const SchedulerState good = LRSchedule(config).state();
  const auto rejects = [&](SchedulerState stored, const std::string& flag) {
    LRSchedule schedule(config);
    try {
      schedule.load(stored, SchedulerLoadMode::kCheck);
      ADD_FAILURE() << "accepted a checkpoint differing in " << flag;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  };
  SchedulerState s = good;
  s.max_lr = 1e-3;
  rejects(s, "--lr ");
  s = good;
  s.min_lr = 0.0;
  rejects(s, "--min-lr");
  s = good;
  s.lr_decay_style = LRDecayStyle::kLinear;
  rejects(s, "--lr-decay-style");
  s = good;
  s.lr_decay_steps = 1000.0;
  rejects(s, "--lr-decay-iters");
  s = good;
  s.start_wd = s.end_wd = 0.5;
  rejects(s, "--start-weight-decay");
  s = good;
  s.wd_incr_steps = 7.0;
  rejects(s, "--train-iters");
  s = good;
  s.wd_incr_style = WDIncrStyle::kLinear;
  rejects(s, "--weight-decay-incr-style");
  LRSchedule same(config);
  s = good;
  s.num_steps = 24.0;
  same.load(s, SchedulerLoadMode::kCheck);
  EXPECT_EQ(same.num_steps(), 24.0);
  // A checkpoint's values that make no schedule are refused whatever the mode.
  s = good;
  s.lr_warmup_steps = 2000.0;
  s.lr_decay_steps = 1000.0;
  LRSchedule taken(config);
  EXPECT_THROW(taken.load(s, SchedulerLoadMode::kUseCheckpoint), ConfigError);
}

// Megatron's get_wd: start + coeff (end - start), coeff = ratio (linear) or 0.5 (cos(pi (1 - ratio)) + 1) (cosine),
// ratio = num_steps / wd_incr_steps; end_wd past the increment.
TEST(LRSchedule, WeightDecayIncrement) {
  LRScheduleConfig config = base_config(LRDecayStyle::kLinear);
  config.start_wd = 0.01;
  config.end_wd = 0.1;
  config.wd_incr_iters = 100;  // 800 samples
  config.wd_incr_style = WDIncrStyle::kLinear;
  const LRSchedule linear(config);
  EXPECT_NEAR(linear.wd_at_steps(0.0), 0.01, 1e-15);
  EXPECT_NEAR(linear.wd_at_steps(200.0), 0.01 + 0.25 * 0.09, 1e-15);
  EXPECT_NEAR(linear.wd_at_steps(800.0), 0.1, 1e-15);
  EXPECT_NEAR(linear.wd_at_steps(5000.0), 0.1, 1e-15);
  config.wd_incr_style = WDIncrStyle::kCosine;
  const LRSchedule cosine(config);
  EXPECT_NEAR(cosine.wd_at_steps(200.0), 0.01 + 0.5 * (std::cos(std::numbers::pi * 0.75) + 1.0) * 0.09, 1e-15);
  config.wd_incr_style = WDIncrStyle::kConstant;
  EXPECT_THROW(LRSchedule{config}, ConfigError);  // constant needs start == end
  config.start_wd = 0.1;
  EXPECT_NEAR(LRSchedule(config).wd_at_steps(200.0), 0.1, 1e-15);
}

}  // namespace
}  // namespace moecore
