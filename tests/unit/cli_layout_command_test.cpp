// `moecore layout` (cli/layout_command.h): its flags, the listing of every group kind and the pipeline stages.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "moecore/cli/layout_command.h"

namespace moecore {
namespace {

std::string run_layout_command(const std::vector<std::string>& args) {
  std::ostringstream out;
  EXPECT_EQ(layout_main(args, out), 0);
  return out.str();
}

std::string layout_command_error(const std::vector<std::string>& args) {
  std::ostringstream out;
  try {
    layout_main(args, out);
  } catch (const LayoutError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(LayoutCommand, ParsesMegatronFlags) {
  const ParallelSizes sizes =
      parse_layout_args({"--world-size", "16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size=2",
                         "--context-parallel-size", "2", "--expert-model-parallel-size", "4",
                         "--expert-tensor-parallel-size", "1", "--use-tp-pp-dp-mapping"});
  EXPECT_EQ(sizes.world_size, 16);
  EXPECT_EQ(sizes.tensor_model_parallel_size, 2);
  EXPECT_EQ(sizes.pipeline_model_parallel_size, 2);
  EXPECT_EQ(sizes.context_parallel_size, 2);
  EXPECT_EQ(sizes.expert_model_parallel_size, 4);
  EXPECT_EQ(sizes.expert_tensor_parallel_size, 1);
  EXPECT_EQ(sizes.order, "tp-cp-ep-pp-dp");
  EXPECT_FALSE(parse_layout_args({"--world-size", "4"}).expert_tensor_parallel_size.has_value());
  EXPECT_EQ(parse_layout_args({"--world-size", "4"}).order, "tp-cp-ep-dp-pp");
}

TEST(LayoutCommand, PrintsEveryGroupKind) {
  const std::string text = run_layout_command(
      {"--world-size", "16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
       "--context-parallel-size", "2", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"});
  EXPECT_NE(text.find("world size 16, rank order tp-cp-ep-dp-pp"), std::string::npos) << text;
  EXPECT_NE(text.find("attention grid: TP 2, CP 2, DP 2, PP 2"), std::string::npos) << text;
  EXPECT_NE(text.find("expert grid (Parallel Folding): ETP 1, EP 4, EDP 2, PP 2"), std::string::npos) << text;
  EXPECT_NE(text.find("    dp-cp (data x context parallel: dense gradient reduction): 4 groups of 4\n"
                      "      [0, 2, 4, 6] [1, 3, 5, 7] [8, 10, 12, 14] [9, 11, 13, 15]\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("[0, 8] [1, 9] [2, 10] [3, 11] [4, 12] [5, 13] [6, 14] [7, 15]"), std::string::npos) << text;
  EXPECT_NE(text.find("    ep (expert model parallel): 4 groups of 4\n"
                      "      [0, 1, 2, 3] [4, 5, 6, 7] [8, 9, 10, 11] [12, 13, 14, 15]\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("    dp (expert data parallel: expert gradient reduction): 8 groups of 2\n"
                      "      [0, 4] [1, 5] [2, 6] [3, 7] [8, 12] [9, 13] [10, 14] [11, 15]\n"),
            std::string::npos)
      << text;
  for (const char* kind : {"    tp (", "    cp (", "    dp (", "    pp (", "    tp-pp (", "    tp-dp-cp (",
                           "    tp-cp (", "    tp-ep ("}) {
    EXPECT_NE(text.find(kind), std::string::npos) << kind;
  }
}

TEST(LayoutCommand, WrapsLongGroupListsAt100Columns) {
  const std::string text = run_layout_command({"--world-size", "256"});
  std::istringstream lines(text);
  std::string line;
  int lines_count = 0;
  while (std::getline(lines, line)) {
    EXPECT_LE(line.size(), 100u) << line;
    ++lines_count;
  }
  EXPECT_GT(lines_count, 20);
}

TEST(LayoutCommand, HelpPrintsUsage) {
  EXPECT_NE(run_layout_command({"--help"}).find("usage: moecore layout --world-size N"), std::string::npos);
}

TEST(LayoutCommand, ErrorsNameTheFlagOrProblem) {
  EXPECT_NE(layout_command_error({"--world-size", "8", "--tensor-model-parallel-sise", "2"})
                .find("unknown flag --tensor-model-parallel-sise (did you mean --tensor-model-parallel-size?)"),
            std::string::npos);
  EXPECT_NE(layout_command_error({"--world-size", "8", "--num-experts", "2"}).find("unknown flag --num-experts"),
            std::string::npos);
  EXPECT_NE(layout_command_error({"--tensor-model-parallel-size", "2"}).find("--world-size is required"),
            std::string::npos);
  EXPECT_NE(layout_command_error({"--world-size", "8", "--expert-model-parallel-size"}).find("expects a value"),
            std::string::npos);
  EXPECT_NE(layout_command_error({"--world-size", "eight"})
                .find("invalid value 'eight' for --world-size: expected an integer"),
            std::string::npos);
  EXPECT_NE(layout_command_error({"--world-size", "8", "--context-parallel-size", "0"})
                .find("--context-parallel-size must be positive (got 0)"),
            std::string::npos);
  EXPECT_NE(layout_command_error({"--world-size", "6", "--tensor-model-parallel-size", "4"}).find("not divisible"),
            std::string::npos);
  EXPECT_NE(layout_command_error({"--world-size", "8", "--use-tp-pp-dp-mapping=1"}).find("takes no value"),
            std::string::npos);
}

TEST(LayoutCommand, ParsesPipelineSplitFlags) {
  const LayoutCommandArgs parsed = parse_layout_command_args(
      {"--world-size", "8", "--pipeline-model-parallel-size", "4", "--num-layers=28",
       "--decoder-first-pipeline-num-layers", "4", "--decoder-last-pipeline-num-layers=8",
       "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage", "-1",
       "--pipeline-model-parallel-layout", "Et|tL", "--account-for-embedding-in-pipeline-split",
       "--account-for-loss-in-pipeline-split"});
  ASSERT_TRUE(parsed.pipeline.has_value());
  EXPECT_EQ(parsed.pipeline->num_layers, 28);
  EXPECT_EQ(parsed.pipeline->pipeline_model_parallel_size, 4);
  const PipelineSplitFlags& split = parsed.pipeline_split;
  EXPECT_EQ(split.decoder_first_pipeline_num_layers, 4);
  EXPECT_EQ(split.decoder_last_pipeline_num_layers, 8);
  EXPECT_EQ(split.num_virtual_stages_per_pipeline_rank, 2);
  EXPECT_EQ(split.num_layers_per_virtual_pipeline_stage, -1);  // PipelineLayout rejects it, with Megatron's rule
  EXPECT_EQ(split.pipeline_model_parallel_layout, "Et|tL");
  EXPECT_TRUE(split.account_for_embedding_in_pipeline_split);
  EXPECT_TRUE(split.account_for_loss_in_pipeline_split);
  EXPECT_TRUE(split.overlap_p2p_comm);
  EXPECT_FALSE(parse_layout_command_args({"--world-size", "8"}).pipeline.has_value());
}

// Megatron's example: 14 layers + embedding + loss over PP 4 is [0-2] [3-6] [7-10] [11-13]. The group listing before
// it is the one printed without --num-layers.
TEST(LayoutCommand, PrintsPipelineStagesAfterTheGroups) {
  const std::vector<std::string> grid = {"--world-size", "8", "--pipeline-model-parallel-size", "4"};
  std::vector<std::string> with_split = grid;
  for (const char* arg :
       {"--num-layers", "14", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"}) {
    with_split.emplace_back(arg);
  }
  EXPECT_EQ(run_layout_command(with_split), run_layout_command(grid) +
                                                "pipeline stages: 14 decoder layers, PP 4\n"
                                                "    pp rank 0: layers 0-2 + embedding\n"
                                                "    pp rank 1: layers 3-6\n"
                                                "    pp rank 2: layers 7-10\n"
                                                "    pp rank 3: layers 11-13 + loss\n");
}

// pipeline_parallel_layer_layout.py's example "Et|tt|tt|tL" with PP 2: two virtual stages per rank.
TEST(LayoutCommand, PrintsVirtualStages) {
  const std::string text = run_layout_command({"--world-size", "2", "--pipeline-model-parallel-size", "2",
                                               "--num-layers", "6", "--pipeline-model-parallel-layout", "Et|tt|tt|tL"});
  EXPECT_NE(text.find("pipeline stages: 6 decoder layers, PP 2, 2 virtual stages per rank\n"
                      "    pp rank 0, virtual stage 0: layer 0 + embedding\n"
                      "    pp rank 0, virtual stage 1: layers 3-4\n"
                      "    pp rank 1, virtual stage 0: layers 1-2\n"
                      "    pp rank 1, virtual stage 1: layer 5 + loss\n"),
            std::string::npos)
      << text;
  const std::string empty = run_layout_command({"--world-size", "2", "--pipeline-model-parallel-size", "2",
                                                "--num-layers", "2", "--pipeline-model-parallel-layout", "Ett|||L"});
  EXPECT_NE(empty.find("    pp rank 1, virtual stage 0: no layers\n"), std::string::npos) << empty;
}

// Multi-Token Prediction depths print on the loss stage, by default and from the layout's 'm's.
TEST(LayoutCommand, PrintsMtpLayers) {
  const std::vector<std::string> grid = {
      "--world-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--mtp-num-layers", "2"};
  EXPECT_NE(run_layout_command(grid).find("    pp rank 1: layers 2-3 + loss + 2 MTP layers\n"), std::string::npos);
  std::vector<std::string> by_hand = grid;
  by_hand.insert(by_hand.end(), {"--pipeline-model-parallel-layout", "Et|tttmmL"});
  EXPECT_NE(run_layout_command(by_hand).find("    pp rank 1: layers 1-3 + loss + 2 MTP layers\n"), std::string::npos);
  EXPECT_EQ(layout_command_error({"--world-size", "1", "--num-layers", "2", "--mtp-num-layers", "-1"}),
            "--mtp-num-layers must not be negative (got -1)");
}

TEST(LayoutCommand, PipelineSplitErrors) {
  EXPECT_EQ(layout_command_error({"--world-size", "4", "--decoder-first-pipeline-num-layers", "2"}),
            "moecore layout: --decoder-first-pipeline-num-layers needs --num-layers (the split counts decoder layers)");
  EXPECT_EQ(
      layout_command_error({"--world-size", "4", "--num-layers", "6", "--decoder-last-pipeline-num-layers", "two"}),
      "invalid value 'two' for --decoder-last-pipeline-num-layers: expected an integer");
  EXPECT_EQ(layout_command_error({"--world-size", "4", "--num-layers", "0"}), "--num-layers must be positive (got 0)");
  EXPECT_EQ(layout_command_error({"--world-size", "4", "--num-layers", "6", "--account-for-loss-in-pipeline-split=1"}),
            "--account-for-loss-in-pipeline-split takes no value (got '--account-for-loss-in-pipeline-split=1')");
  EXPECT_NE(layout_command_error({"--world-size", "4", "--num-layers", "6", "--pipeline-model-parallel-layout"})
                .find("--pipeline-model-parallel-layout expects a value"),
            std::string::npos);
  EXPECT_NE(layout_command_error({"--world-size", "4", "--num-layers", "6", "--decoder-frist-pipeline-num-layers", "2"})
                .find("did you mean --decoder-first-pipeline-num-layers?"),
            std::string::npos);
  // An invalid split prints nothing, not the groups and then an error.
  std::ostringstream out;
  EXPECT_THROW(layout_main({"--world-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "7"}, out),
               LayoutError);
  EXPECT_EQ(out.str(), "");
  EXPECT_EQ(layout_command_error({"--world-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "7"}),
            "Number of layers should be divisible by the pipeline-model-parallel size (--num-layers 7, "
            "--pipeline-model-parallel-size 2)");
  EXPECT_NE(layout_command_error({"--world-size", "4", "--pipeline-model-parallel-size", "4", "--num-layers", "4",
                                  "--pipeline-model-parallel-layout", "Et|t|t|tmL"})
                .find("Number of mtp layers in layout must match mtp_num_layers"),
            std::string::npos);
}

}  // namespace
}  // namespace moecore
