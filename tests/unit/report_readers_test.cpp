// moecore report's readers: a training log written here line by line in moecore's formats, TensorBoard files written
// by TensorBoardWriter and routing traces in Megatron's JSONL, each read into the report's curves and heatmaps.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include "moecore/report/log_reader.h"
#include "moecore/report/routing_trace_reader.h"
#include "moecore/report/tensorboard_source.h"
#include "moecore/util/tensorboard_events.h"
#include "test_temp_dir.h"

namespace moecore::report {
namespace {

const Series* find_series(const RunReport& report, const std::string& chart, const std::string& name) {
  for (const Chart& c : report.charts()) {
    if (c.id != chart) continue;
    for (const Series& s : c.series) {
      if (s.name == name) return &s;
    }
  }
  return nullptr;
}

const ExpertLoad* find_load(const RunReport& report, const std::string& id) {
  for (const ExpertLoad& load : report.expert_loads()) {
    if (load.id == id) return &load;
  }
  return nullptr;
}

// Lines as moecore train prints them (two iterations, a validation, the MoE, memory, comm and alarm lines).
constexpr const char* kLog =
    "> training ...\n"
    " [2026-12-06 19:53:36.701150] iteration        1/      30 | consumed samples:            8 | elapsed time per "
    "iteration (ms): 448.7 | throughput per GPU (TFLOP/s/GPU): 0.314 | learning rate: 6.000000E-04 | global batch "
    "size:     8 | lm loss: 1.083297E+01 | load_balancing_loss: 1.053783E+00 | loss scale: 1.0 | grad norm: 4.027 | "
    "num zeros: 12 | params norm: 84.006 | number of skipped iterations:   0 | number of nan iterations:   0 | time "
    "left (estimate): 0:00:12 |\n"
    " [MoE] layer 0 tokens per expert: [796 428 559 650] | min/max load ratio: 0.264 / 1.555 |\n"
    "[Rank 0] (after 1 iterations) memory (MB) | params: 56.6 (peak 56.7) | grads: 56.6 (peak 56.6) | total peak: "
    "344.6\n"
    " [comm] per iteration, max over ranks (ms / share of step [/ MB sent]): tensor-parallel 1.5 / 0.3% / 2.5 MB | "
    "expert-parallel 0.0 / 0.0% |\n"
    " [2026-12-06 19:53:38.413125] iteration        5/      30 | consumed samples:           40 | elapsed time per "
    "iteration (ms): 432.1 | learning rate: 3.000000E-03 | global batch size:     8 | lm loss: nan | loss scale: "
    "1.0 | grad norm: 1.797 | number of skipped iterations:   1 | number of nan iterations:   1 |\n"
    " [MoE] layer 0 tokens per expert: [3508 0 2345 3102] | min/max load ratio: 0.000 / 1.509 |\n"
    "WARNING: [MoE] layer 0: experts 1 (load ratio 0.000), 3 (load ratio 0.010) have had under 0.100 of the layer's "
    "mean tokens per expert since iteration 2 (3 log intervals or more)\n"
    "-----------------------------------------------------------------\n"
    " validation loss at iteration 5 | lm loss value: 7.489700E+00 | lm loss PPL: 1.789515E+03 | \n"
    " validation loss at iteration 5 on test set | lm loss value: 6.819604E+00 | lm loss PPL: 9.156223E+02 | \n"
    "> training throughput: 4812.8 tokens/s over 5 iterations\n"
    "some other line | with: bars |\n";

TEST(ReportLogReader, ReadsEveryKindOfLine) {
  std::istringstream log(kLog);
  RunReport report;
  read_training_log(log, "run.log", report);
  ASSERT_EQ(report.sources(), std::vector<std::string>{"run.log"});
  const Series* loss = find_series(report, "loss", "lm loss");
  ASSERT_NE(loss, nullptr);
  ASSERT_EQ(loss->points.size(), 2u);
  EXPECT_EQ(loss->points[0], std::make_pair(1.0, 10.83297));
  EXPECT_EQ(loss->points[1].first, 5.0);
  EXPECT_TRUE(std::isnan(loss->points[1].second));  // drawn as a gap
  const Series* valid = find_series(report, "loss", "lm loss validation");
  ASSERT_NE(valid, nullptr);
  EXPECT_EQ(valid->points, (std::vector<std::pair<double, double>>{{5.0, 7.4897}}));
  EXPECT_EQ(find_series(report, "learning-rate", "learning rate")->points[1], std::make_pair(5.0, 3e-3));
  EXPECT_EQ(find_series(report, "grad-norm", "grad norm")->points[0], std::make_pair(1.0, 4.027));
  EXPECT_EQ(find_series(report, "num-zeros", "num zeros")->points[0], std::make_pair(1.0, 12.0));
  EXPECT_EQ(find_series(report, "params-norm", "params norm")->points[0], std::make_pair(1.0, 84.006));
  EXPECT_EQ(find_series(report, "throughput", "TFLOP/s per device")->points.size(), 1u);
  EXPECT_EQ(find_series(report, "iteration-time", "iteration time")->points[1], std::make_pair(5.0, 432.1));
  EXPECT_EQ(find_series(report, "load-balancing", "load_balancing_loss")->points[0], std::make_pair(1.0, 1.053783));
  EXPECT_EQ(find_series(report, "skipped", "number of nan iterations")->points[1], std::make_pair(5.0, 1.0));
  EXPECT_EQ(find_series(report, "memory", "params peak")->points[0], std::make_pair(1.0, 56.7));
  EXPECT_EQ(find_series(report, "memory", "total peak")->points[0], std::make_pair(1.0, 344.6));
  EXPECT_EQ(find_series(report, "comm", "tensor-parallel")->points[0], std::make_pair(1.0, 1.5));
  EXPECT_EQ(find_series(report, "comm", "expert-parallel")->points[0], std::make_pair(1.0, 0.0));
  // Fields that are no curve (samples, batch size, the time left) make none.
  for (const Chart& chart : report.charts()) {
    for (const Series& s : chart.series) EXPECT_EQ(s.name.find("samples"), std::string::npos);
  }

  const ExpertLoad* layer = find_load(report, "moe-layer-0");
  ASSERT_NE(layer, nullptr);
  EXPECT_EQ(layer->iterations, (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(layer->tokens[1], (std::vector<int64_t>{3508, 0, 2345, 3102}));
  ASSERT_EQ(layer->under.size(), 2u);
  EXPECT_EQ(layer->under[0].points[1], std::make_pair(5.0, 0.0));
  EXPECT_EQ(layer->under[1].points[0], std::make_pair(1.0, 1.555));
  EXPECT_EQ(layer->alarms, (std::vector<std::pair<int64_t, int64_t>>{{5, 1}, {5, 3}}));
  ASSERT_EQ(report.alarms().size(), 1u);
  EXPECT_EQ(report.alarms()[0].iteration, 5);
  EXPECT_TRUE(report.alarms()[0].text.starts_with("WARNING: [MoE] layer 0: experts 1"));

  const auto& summary = report.summary();
  ASSERT_EQ(summary.size(), 2u);
  EXPECT_EQ(summary[0], std::make_pair(std::string("final test loss"), std::string("6.8196")));
  EXPECT_EQ(summary[1], std::make_pair(std::string("training throughput"), std::string("4812.8 tokens/s")));
}

TEST(ReportLogReader, ALogWithoutTrainingLinesGivesNothing) {
  std::istringstream log("error: --num-layers is required\nusage: moecore train ...\n");
  RunReport report;
  read_training_log(log, "x", report);
  EXPECT_TRUE(report.empty());
}

TEST(ReportTensorBoard, TagsGoToTheirCharts) {
  const test::TempDir dir("report_tb");
  {
    TensorBoardWriter first(dir.path("tb"));
    first.add_scalar("lm loss", 3.0, 1);
    first.add_scalar("lm loss vs samples", 3.0, 8);
    first.add_scalar("iteration-time", 0.5, 1);
    first.add_scalar("mem-params-bytes", 2.0 * 1024 * 1024, 1);
    first.add_scalar("moe/min_load_ratio_layer_2", 0.25, 1);
    first.add_scalar("custom", 9.0, 1);
  }
  {
    TensorBoardWriter resumed(dir.path("tb"));  // a later file: its step 1 replaces the first file's
    resumed.add_scalar("lm loss", 2.5, 1);
    resumed.add_scalar("lm loss", 2.0, 2);
  }
  RunReport report;
  read_tensorboard_dir(dir.path("tb"), report);
  EXPECT_EQ(find_series(report, "loss", "lm loss")->points,
            (std::vector<std::pair<double, double>>{{1.0, 2.5}, {2.0, 2.0}}));
  EXPECT_EQ(find_series(report, "loss", "lm loss vs samples"), nullptr);
  EXPECT_EQ(find_series(report, "iteration-time", "iteration time")->points[0], std::make_pair(1.0, 500.0));
  EXPECT_EQ(find_series(report, "memory", "params")->points[0], std::make_pair(1.0, 2.0));
  EXPECT_EQ(find_series(report, "expert-load", "layer 2 min")->points[0], std::make_pair(1.0, 0.25));
  EXPECT_EQ(find_series(report, "custom", "custom")->points[0], std::make_pair(1.0, 9.0));
  test::expect_error_containing<std::runtime_error>([&] { read_tensorboard_dir(dir.path(""), report); },
                                                    "holds no TensorBoard event file");
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(ReportRoutingTrace, CountsTokensPerExpertOverRanksAndMicroBatches) {
  const test::TempDir dir("report_trace");
  // Rank 0: two micro-batches of step 0 at layer 1 and one of the MTP depth; rank 1: one micro-batch.
  write_text(dir.path("router_trace_rank0.jsonl"),
             "{\"step\": 0, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 1, \"rank\": 0, "
             "\"num_tokens\": 2, \"topk\": 2, \"top_indices\": [[0, 3], [1, 3]]}\n"
             "{\"step\": 0, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 1, \"rank\": 0, "
             "\"num_tokens\": 1, \"topk\": 2, \"top_indices\": [[2, 3]]}\n"
             "{\"step\": 0, \"stage\": \"pre_dispatch\", \"block\": \"mtp\", \"layer\": 0, \"rank\": 0, "
             "\"num_tokens\": 1, \"topk\": 2, \"mtp_idx\": 0, \"top_indices\": [[0, 1]]}\n");
  write_text(dir.path("router_trace_rank1.jsonl"),
             "{\"step\": 0, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 1, \"rank\": 1, "
             "\"num_tokens\": 1, \"topk\": 2, \"top_indices\": [[0, 2]]}\n"
             "{\"step\": 1, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 1, \"rank\": 1, "
             "\"num_tokens\": 1, \"topk\": 2, \"top_indices\": [[0, 1]]}\n");
  EXPECT_TRUE(is_routing_trace_dir(dir.path().string()));
  RunReport report;
  read_routing_trace_dir(dir.path().string(), report);
  const ExpertLoad* layer = find_load(report, "trace-layer-1");
  ASSERT_NE(layer, nullptr);
  EXPECT_EQ(layer->iterations, (std::vector<int64_t>{1, 2}));  // step s is iteration s + 1
  EXPECT_EQ(layer->tokens[0], (std::vector<int64_t>{2, 1, 2, 3}));
  EXPECT_EQ(layer->tokens[1], (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(layer->under[1].points[0], std::make_pair(1.0, 1.5));  // 3 of a mean of 2
  const ExpertLoad* mtp = find_load(report, "trace-mtp-0");
  ASSERT_NE(mtp, nullptr);
  EXPECT_EQ(mtp->tokens[0], (std::vector<int64_t>{1, 1, 0, 0}));

  write_text(dir.path("router_trace_rank2.jsonl"), "{\"step\": 0, \"block\": \"decoder\"}\n");
  RunReport bad;
  test::expect_error_containing<std::runtime_error>([&] { read_routing_trace_dir(dir.path().string(), bad); },
                                                    "router_trace_rank2.jsonl:1: not a routing trace record");
}

}  // namespace
}  // namespace moecore::report
