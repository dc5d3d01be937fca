// The expert-collapse alarm on hand-made intervals: when it warns, what a warning names, that it warns once per
// streak and again after a recovery, the overload side, and the thresholds turned off.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moecore/train/expert_collapse.h"

namespace moecore {
namespace {

// One interval's statistics: MoE layers 1 and 3 (model numbering), each with these tokens per expert.
MoEStats interval(const std::vector<int64_t>& layer1, const std::vector<int64_t>& layer3) {
  MoEStats stats;
  stats.num_forwards = 2;
  stats.moe_layers = {1, 3};
  stats.tokens_per_expert = {layer1, layer3};
  return stats;
}

const std::vector<int64_t> kBalanced = {100, 100, 100, 100};

TEST(ExpertCollapseAlarm, WarnsOnceAfterTheGivenIntervalsNamingLayerExpertRatioAndStart) {
  ExpertCollapseAlarm alarm(CollapseThresholds{.min_load_ratio = 0.1, .max_load_ratio = 0.0, .intervals = 3});
  std::vector<LayerLoad> loads;
  EXPECT_TRUE(alarm.observe(1, 10, interval(kBalanced, kBalanced), &loads).empty());
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_DOUBLE_EQ(loads[0].min_load_ratio, 1.0);
  EXPECT_DOUBLE_EQ(loads[0].max_load_ratio, 1.0);
  // Layer 3's expert 2 gets 5 tokens of a mean of 100 (ratio 0.05) from iteration 11 on.
  const MoEStats starving = interval(kBalanced, {130, 135, 5, 130});
  EXPECT_TRUE(alarm.observe(11, 20, starving).empty());
  EXPECT_TRUE(alarm.observe(21, 30, starving).empty());
  const std::vector<std::string> warnings = alarm.observe(31, 40, starving, &loads);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0],
            "WARNING: [MoE] layer 3: expert 2 (load ratio 0.050) has had under 0.100 of the layer's mean tokens per "
            "expert since iteration 11 (3 log intervals or more)");
  EXPECT_EQ(loads[1].collapsed, 1);
  EXPECT_EQ(loads[0].collapsed, 0);
  EXPECT_DOUBLE_EQ(loads[1].min_load_ratio, 0.05);
  EXPECT_DOUBLE_EQ(loads[1].max_load_ratio, 1.35);
  // Not again while it stays so; counted as collapsed still.
  EXPECT_TRUE(alarm.observe(41, 50, starving, &loads).empty());
  EXPECT_EQ(loads[1].collapsed, 1);
  // A recovery re-arms it: three more starving intervals warn again, since the new streak's start.
  EXPECT_TRUE(alarm.observe(51, 60, interval(kBalanced, kBalanced)).empty());
  EXPECT_TRUE(alarm.observe(61, 70, starving).empty());
  EXPECT_TRUE(alarm.observe(71, 80, starving).empty());
  const std::vector<std::string> again = alarm.observe(81, 90, starving);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_NE(again[0].find("since iteration 61 "), std::string::npos) << again[0];
}

TEST(ExpertCollapseAlarm, AnInterruptedStreakStartsAgain) {
  ExpertCollapseAlarm alarm(CollapseThresholds{.min_load_ratio = 0.1, .max_load_ratio = 0.0, .intervals = 2});
  const MoEStats dead = interval({0, 200, 100, 100}, kBalanced);
  EXPECT_TRUE(alarm.observe(1, 5, dead).empty());
  const std::vector<std::string> second = alarm.observe(6, 10, interval({9, 191, 100, 100}, kBalanced));  // 0.09
  ASSERT_EQ(second.size(), 1u);  // two intervals under: warned
  EXPECT_NE(second[0].find("since iteration 1 "), std::string::npos) << second[0];
  EXPECT_TRUE(alarm.observe(11, 15, interval(kBalanced, kBalanced)).empty());
  EXPECT_TRUE(alarm.observe(16, 20, dead).empty());  // a new streak of one interval
}

TEST(ExpertCollapseAlarm, ACollapseOntoOneExpertNamesEveryStarvedExpertInOneLine) {
  ExpertCollapseAlarm alarm(CollapseThresholds{.min_load_ratio = 0.1, .max_load_ratio = 0.0, .intervals = 1});
  std::vector<int64_t> one_expert(20, 0);
  one_expert[7] = 400;
  const std::vector<std::string> warnings = alarm.observe(1, 100, interval(one_expert, kBalanced));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0].rfind("WARNING: [MoE] layer 1: experts 0 (load ratio 0.000), 1 (load ratio 0.000)", 0), 0u)
      << warnings[0];
  EXPECT_EQ(warnings[0].find(" 7 (load ratio"), std::string::npos) << warnings[0];
  // 19 starved experts: 16 named (0-6, 8-16), the rest counted.
  EXPECT_NE(warnings[0].find("16 (load ratio 0.000) and 3 more have had under 0.100"), std::string::npos)
      << warnings[0];
  EXPECT_NE(warnings[0].find("(1 log interval or more)"), std::string::npos) << warnings[0];
}

TEST(ExpertCollapseAlarm, OverloadedExpertsWhenThatThresholdIsSet) {
  ExpertCollapseAlarm alarm(CollapseThresholds{.min_load_ratio = 0.0, .max_load_ratio = 2.5, .intervals = 2});
  const MoEStats hot = interval({300, 40, 30, 30}, kBalanced);  // mean 100: ratios 3.0 / 0.4 / 0.3 / 0.3
  std::vector<LayerLoad> loads;
  EXPECT_TRUE(alarm.observe(1, 10, hot).empty());
  const std::vector<std::string> warnings = alarm.observe(11, 20, hot, &loads);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_EQ(warnings[0],
            "WARNING: [MoE] layer 1: expert 0 (load ratio 3.000) has had over 2.500 of the layer's mean tokens per "
            "expert since iteration 1 (2 log intervals or more)");
  EXPECT_EQ(loads[0].overloaded, 1);
  EXPECT_EQ(loads[0].collapsed, 0);  // the under side is off
}

TEST(ExpertCollapseAlarm, OffOrNoTokensMeansNoWarning) {
  ExpertCollapseAlarm off(CollapseThresholds{.min_load_ratio = 0.0, .max_load_ratio = 0.0, .intervals = 1});
  EXPECT_TRUE(off.observe(1, 10, interval({0, 0, 0, 400}, kBalanced)).empty());
  ExpertCollapseAlarm on(CollapseThresholds{.min_load_ratio = 0.1, .max_load_ratio = 0.0, .intervals = 1});
  std::vector<LayerLoad> loads;
  EXPECT_TRUE(on.observe(1, 10, interval({0, 0, 0, 0}, kBalanced), &loads).empty());  // nothing routed
  ASSERT_EQ(loads.size(), 1u);
  EXPECT_EQ(loads[0].layer, 3);
}

}  // namespace
}  // namespace moecore
