// The report page: the template with the report's JSON in place of its placeholder, nothing fetched from elsewhere,
// and text that could close the data's <script> element escaped.
#include "moecore/report/report_page.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

namespace moecore::report {
namespace {

RunReport sample() {
  RunReport report;
  report.add_source("runs/a </script> b.log");
  report.add_point("loss", "lm loss", 1, 10.5);
  report.add_point("loss", "lm loss", 2, std::nan(""));
  report.add_point("loss", "lm loss validation", 2, 9.25);
  ExpertLoad& load = report.expert_load("moe-layer-0", "MoE layer 0: tokens per expert");
  load.iterations = {1, 2};
  load.tokens = {{3, 1}, {0, 4}};
  load.under = {{"min load ratio", {{1, 0.5}, {2, 0.0}}}};
  load.alarms = {{2, 0}};
  report.add_alarm(2, "WARNING: [MoE] layer 0: expert 0 ...");
  report.add_summary("last iteration", "2");
  return report;
}

TEST(ReportPage, CarriesTheReportAsJson) {
  const nlohmann::json data = nlohmann::json::parse(report_json(sample(), "my run"));
  EXPECT_EQ(data["title"], "my run");
  EXPECT_EQ(data["sources"][0], "runs/a </script> b.log");
  ASSERT_EQ(data["charts"].size(), 1u);
  EXPECT_EQ(data["charts"][0]["id"], "loss");
  EXPECT_EQ(data["charts"][0]["series"][0]["points"][0], nlohmann::json({1, 10.5}));
  EXPECT_TRUE(data["charts"][0]["series"][0]["points"][1][1].is_null());  // NaN
  EXPECT_EQ(data["heatmaps"][0]["experts"], 2);
  EXPECT_EQ(data["heatmaps"][0]["values"], nlohmann::json({{3, 1}, {0, 4}}));
  EXPECT_EQ(data["heatmaps"][0]["under"][0]["values"], nlohmann::json({0.5, 0.0}));
  EXPECT_EQ(data["heatmaps"][0]["alarms"][0]["expert"], 0);
  EXPECT_EQ(data["alarms"][0]["iteration"], 2);
  EXPECT_EQ(data["summary"][0], nlohmann::json({"last iteration", "2"}));
}

TEST(ReportPage, IsOneSelfContainedFile) {
  const std::string page = report_html(sample(), "my run");
  EXPECT_EQ(page.find("__MOECORE_REPORT_DATA__"), std::string::npos);
  EXPECT_NE(page.find("<\\/script> b.log"), std::string::npos);  // escaped inside the data
  EXPECT_EQ(page.find("</script> b.log"), std::string::npos);
  for (const char* outside : {"<script src", "<link", "@import", "url(http", "fetch("}) {
    EXPECT_EQ(page.find(outside), std::string::npos) << outside;
  }
  EXPECT_TRUE(page.starts_with("<!DOCTYPE html>"));
}

}  // namespace
}  // namespace moecore::report
