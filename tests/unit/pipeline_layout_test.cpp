// Megatron's pipeline split (pipeline/pipeline_layout.h). The expected assignments are the examples of Megatron's
// own docs and code comments (transformer_block.py get_num_layers_to_build, pipeline_parallel_layer_layout.py,
// the --pipeline-model-parallel-layout help) and hand-worked cases of Megatron's formulas, not moecore's output.
#include "moecore/pipeline/pipeline_layout.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

namespace moecore::parallel {
namespace {

using Ranges = std::vector<std::pair<int64_t, int64_t>>;  // [first, last] per virtual stage; {first, first - 1}: none

// One case's input: the layers to split and the split flags, set field by field.
struct Split : PipelineShape, PipelineSplitFlags {};

Split split(const int64_t num_layers, const int64_t pp) {
  Split flags;
  flags.num_layers = num_layers;
  flags.pipeline_model_parallel_size = pp;
  return flags;
}

PipelineLayout layout_of(const Split& input) { return PipelineLayout(input, input); }

// The virtual stages of one pp rank as inclusive layer ranges.
Ranges ranges_of(const PipelineLayout& layout, const int pp_rank) {
  Ranges ranges;
  for (int v = 0; v < layout.virtual_pipeline_size(); ++v) {
    const PipelineStage& stage = layout.stage(pp_rank, v);
    EXPECT_EQ(stage.pp_rank, pp_rank);
    EXPECT_EQ(stage.virtual_stage, v);
    ranges.emplace_back(stage.first_layer, stage.end_layer() - 1);
  }
  return ranges;
}

// Every layer is held by exactly one chunk, in virtual-stage-major then pp-rank order, the embedding by (0, 0) and
// the loss by (PP-1, VPP-1) only.
void expect_consistent(const PipelineLayout& layout) {
  int64_t next = 0;
  for (int v = 0; v < layout.virtual_pipeline_size(); ++v) {
    for (int r = 0; r < layout.pipeline_size(); ++r) {
      const PipelineStage& stage = layout.stage(r, v);
      EXPECT_EQ(stage.first_layer, next) << "pp " << r << " vp " << v;
      EXPECT_GE(stage.num_layers, 0);
      EXPECT_EQ(layout.layer_offset(r, v), stage.first_layer);
      EXPECT_EQ(layout.num_layers_to_build(r, v), stage.num_layers);
      EXPECT_EQ(stage.has_embedding, r == 0 && v == 0);
      EXPECT_EQ(stage.has_loss, r == layout.pipeline_size() - 1 && v == layout.virtual_pipeline_size() - 1);
      for (int64_t layer = stage.first_layer; layer < stage.end_layer(); ++layer) {
        const PipelineStage& holder = layout.stage_of_layer(layer);
        EXPECT_EQ(holder.pp_rank, r);
        EXPECT_EQ(holder.virtual_stage, v);
      }
      next = stage.end_layer();
    }
  }
  EXPECT_EQ(next, layout.num_layers());
  EXPECT_EQ(static_cast<int>(layout.stages().size()), layout.pipeline_size() * layout.virtual_pipeline_size());
}

std::string error_of(const Split& flags) {
  try {
    PipelineLayout layout = layout_of(flags);
  } catch (const LayoutError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  }
  ADD_FAILURE() << "no error";
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

#define EXPECT_ERROR(flags, part)                      \
  do {                                                 \
    const std::string message_ = error_of(flags);      \
    EXPECT_TRUE(contains(message_, part)) << message_; \
  } while (0)

TEST(PipelineSplit, NoPipelineIsOneStageWithEverything) {
  const PipelineLayout layout = layout_of(split(12, 1));
  EXPECT_EQ(layout.pipeline_size(), 1);
  EXPECT_EQ(layout.virtual_pipeline_size(), 1);
  EXPECT_FALSE(layout.interleaved());
  EXPECT_EQ(ranges_of(layout, 0), (Ranges{{0, 11}}));
  EXPECT_TRUE(layout.stage(0, 0).has_embedding);
  EXPECT_TRUE(layout.stage(0, 0).has_loss);
  expect_consistent(layout);
}

TEST(PipelineSplit, UniformSplitsContiguously) {
  const PipelineLayout layout = layout_of(split(8, 4));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(ranges_of(layout, r), (Ranges{{2 * r, 2 * r + 1}}));
  expect_consistent(layout);
}

// transformer_block.py get_num_layers_to_build's comment: 8 layers, 2 stages, 2 virtual stages.
TEST(PipelineSplit, InterleavedEightLayersTwoStagesTwoChunks) {
  for (const bool per_rank_flag : {true, false}) {
    Split flags = split(8, 2);
    if (per_rank_flag) {
      flags.num_virtual_stages_per_pipeline_rank = 2;
    } else {
      flags.num_layers_per_virtual_pipeline_stage = 2;  // VPP = (8 / 2) / 2
    }
    const PipelineLayout layout = layout_of(flags);
    EXPECT_EQ(layout.virtual_pipeline_size(), 2);
    EXPECT_TRUE(layout.interleaved());
    EXPECT_EQ(ranges_of(layout, 0), (Ranges{{0, 1}, {4, 5}}));
    EXPECT_EQ(ranges_of(layout, 1), (Ranges{{2, 3}, {6, 7}}));
    expect_consistent(layout);
  }
}

// The same comment: 8 layers, 2 stages, 4 model chunks: stage 0 [0] [2] [4] [6], stage 1 [1] [3] [5] [7].
TEST(PipelineSplit, InterleavedEightLayersTwoStagesFourChunks) {
  Split flags = split(8, 2);
  flags.num_layers_per_virtual_pipeline_stage = 1;
  const PipelineLayout layout = layout_of(flags);
  EXPECT_EQ(layout.virtual_pipeline_size(), 4);
  EXPECT_EQ(ranges_of(layout, 0), (Ranges{{0, 0}, {2, 2}, {4, 4}, {6, 6}}));
  EXPECT_EQ(ranges_of(layout, 1), (Ranges{{1, 1}, {3, 3}, {5, 5}, {7, 7}}));
  expect_consistent(layout);
}

TEST(PipelineSplit, AccountingForEmbeddingAndLoss) {
  // 14 layers + embedding + loss = 16 over PP 4: [0-2] [3-6] [7-10] [11-13].
  Split flags = split(14, 4);
  flags.account_for_embedding_in_pipeline_split = true;
  flags.account_for_loss_in_pipeline_split = true;
  const PipelineLayout layout = layout_of(flags);
  EXPECT_EQ(ranges_of(layout, 0), (Ranges{{0, 2}}));
  EXPECT_EQ(ranges_of(layout, 1), (Ranges{{3, 6}}));
  EXPECT_EQ(ranges_of(layout, 2), (Ranges{{7, 10}}));
  EXPECT_EQ(ranges_of(layout, 3), (Ranges{{11, 13}}));
  expect_consistent(layout);

  // The same with PP 2 and two virtual stages: pp0 [0-2] [7-10], pp1 [3-6] [11-13].
  flags.pipeline_model_parallel_size = 2;
  flags.num_virtual_stages_per_pipeline_rank = 2;
  const PipelineLayout interleaved = layout_of(flags);
  EXPECT_EQ(ranges_of(interleaved, 0), (Ranges{{0, 2}, {7, 10}}));
  EXPECT_EQ(ranges_of(interleaved, 1), (Ranges{{3, 6}, {11, 13}}));
  expect_consistent(interleaved);

  // --num-layers-per-virtual-pipeline-stage counts the embedding and loss too: (16 / 2) / 4 = 2 chunks.
  flags.num_virtual_stages_per_pipeline_rank.reset();
  flags.num_layers_per_virtual_pipeline_stage = 4;
  EXPECT_EQ(layout_of(flags).virtual_pipeline_size(), 2);
}

TEST(PipelineSplit, AccountingForOnlyOneSide) {
  // 7 layers + embedding over PP 4: the first stage gives one place to the embedding.
  Split flags = split(7, 4);
  flags.account_for_embedding_in_pipeline_split = true;
  const PipelineLayout embedding = layout_of(flags);
  EXPECT_EQ(ranges_of(embedding, 0), (Ranges{{0, 0}}));
  EXPECT_EQ(ranges_of(embedding, 1), (Ranges{{1, 2}}));
  EXPECT_EQ(ranges_of(embedding, 3), (Ranges{{5, 6}}));
  expect_consistent(embedding);

  flags.account_for_embedding_in_pipeline_split = false;
  flags.account_for_loss_in_pipeline_split = true;
  const PipelineLayout loss = layout_of(flags);
  EXPECT_EQ(ranges_of(loss, 0), (Ranges{{0, 1}}));
  EXPECT_EQ(ranges_of(loss, 3), (Ranges{{6, 6}}));
  expect_consistent(loss);

  // One stage holds the embedding and the loss: all layers.
  Split one = split(5, 1);
  one.account_for_embedding_in_pipeline_split = true;
  one.account_for_loss_in_pipeline_split = true;
  EXPECT_EQ(ranges_of(layout_of(one), 0), (Ranges{{0, 4}}));
}

TEST(PipelineSplit, UnevenFirstAndLast) {
  // 30 layers, PP 4, first 6, last 6: [0-5] [6-14] [15-23] [24-29].
  Split flags = split(30, 4);
  flags.decoder_first_pipeline_num_layers = 6;
  flags.decoder_last_pipeline_num_layers = 6;
  const PipelineLayout layout = layout_of(flags);
  EXPECT_EQ(ranges_of(layout, 0), (Ranges{{0, 5}}));
  EXPECT_EQ(ranges_of(layout, 1), (Ranges{{6, 14}}));
  EXPECT_EQ(ranges_of(layout, 2), (Ranges{{15, 23}}));
  EXPECT_EQ(ranges_of(layout, 3), (Ranges{{24, 29}}));
  expect_consistent(layout);
}

TEST(PipelineSplit, UnevenInterleaved) {
  // 28 layers, PP 4, VPP 2, first 4, last 8: pp0 [0,1] [14,15]; pp1 [2-5] [16-19]; pp2 [6-9] [20-23];
  // pp3 [10-13] [24-27].
  Split flags = split(28, 4);
  flags.num_virtual_stages_per_pipeline_rank = 2;
  flags.decoder_first_pipeline_num_layers = 4;
  flags.decoder_last_pipeline_num_layers = 8;
  const PipelineLayout layout = layout_of(flags);
  EXPECT_EQ(ranges_of(layout, 0), (Ranges{{0, 1}, {14, 15}}));
  EXPECT_EQ(ranges_of(layout, 1), (Ranges{{2, 5}, {16, 19}}));
  EXPECT_EQ(ranges_of(layout, 2), (Ranges{{6, 9}, {20, 23}}));
  EXPECT_EQ(ranges_of(layout, 3), (Ranges{{10, 13}, {24, 27}}));
  expect_consistent(layout);
}

TEST(PipelineSplit, UnevenOneSideOnly) {
  // First only: 10 layers, PP 3, first 2: the other two ranks share 8.
  Split first = split(10, 3);
  first.decoder_first_pipeline_num_layers = 2;
  const PipelineLayout first_layout = layout_of(first);
  EXPECT_EQ(ranges_of(first_layout, 0), (Ranges{{0, 1}}));
  EXPECT_EQ(ranges_of(first_layout, 1), (Ranges{{2, 5}}));
  EXPECT_EQ(ranges_of(first_layout, 2), (Ranges{{6, 9}}));
  expect_consistent(first_layout);

  // Last only: 10 layers, PP 3, last 4: [0-2] [3-5] [6-9].
  Split last = split(10, 3);
  last.decoder_last_pipeline_num_layers = 4;
  const PipelineLayout last_layout = layout_of(last);
  EXPECT_EQ(ranges_of(last_layout, 0), (Ranges{{0, 2}}));
  EXPECT_EQ(ranges_of(last_layout, 1), (Ranges{{3, 5}}));
  EXPECT_EQ(ranges_of(last_layout, 2), (Ranges{{6, 9}}));
  expect_consistent(last_layout);

  // Last only, interleaved: 12 layers, PP 2, VPP 2, last 4: T = 8/2 + 4/2 = 6 per round.
  Split interleaved = split(12, 2);
  interleaved.num_virtual_stages_per_pipeline_rank = 2;
  interleaved.decoder_last_pipeline_num_layers = 4;
  const PipelineLayout interleaved_layout = layout_of(interleaved);
  EXPECT_EQ(ranges_of(interleaved_layout, 0), (Ranges{{0, 3}, {6, 9}}));
  EXPECT_EQ(ranges_of(interleaved_layout, 1), (Ranges{{4, 5}, {10, 11}}));
  expect_consistent(interleaved_layout);

  // PP 1 with the first count equal to every layer: one stage (Megatron accepts it).
  Split one = split(6, 1);
  one.decoder_first_pipeline_num_layers = 6;
  EXPECT_EQ(ranges_of(layout_of(one), 0), (Ranges{{0, 5}}));
}

// PP 2 with both counts and VPP 2: no middle rank (Megatron's offset formula divides by the middle rank count,
// 0 here; nothing is in the middle).
TEST(PipelineSplit, UnevenTwoRanksInterleaved) {
  Split flags = split(12, 2);
  flags.num_virtual_stages_per_pipeline_rank = 2;
  flags.decoder_first_pipeline_num_layers = 4;
  flags.decoder_last_pipeline_num_layers = 8;
  const PipelineLayout layout = layout_of(flags);
  EXPECT_EQ(ranges_of(layout, 0), (Ranges{{0, 1}, {6, 7}}));
  EXPECT_EQ(ranges_of(layout, 1), (Ranges{{2, 5}, {8, 11}}));
  expect_consistent(layout);
}

// pipeline_parallel_layer_layout.py: "Et|tt|tt|tL" with PP 2 is VPP 2: pp0/v0 [0]; pp1/v0 [1,2]; pp0/v1 [3,4];
// pp1/v1 [5].
TEST(PipelineSplit, LayoutExampleInterleaved) {
  Split flags = split(6, 2);
  flags.pipeline_model_parallel_layout = "Et|tt|tt|tL";
  const PipelineLayout layout = layout_of(flags);
  EXPECT_EQ(layout.virtual_pipeline_size(), 2);
  EXPECT_EQ(ranges_of(layout, 0), (Ranges{{0, 0}, {3, 4}}));
  EXPECT_EQ(ranges_of(layout, 1), (Ranges{{1, 2}, {5, 5}}));
  EXPECT_EQ(layout.stage_of_layer(4).pp_rank, 0);
  EXPECT_EQ(layout.stage_of_layer(4).virtual_stage, 1);
  expect_consistent(layout);
}

// "E(tt|)*2,tL" with PP 3 is "Ett|tt|tL": pp0 embedding + [0,1]; pp1 [2,3]; pp2 [4] + loss.
TEST(PipelineSplit, LayoutExampleWithRepeat) {
  Split flags = split(5, 3);
  flags.pipeline_model_parallel_layout = "E(tt|)*2,tL";
  const PipelineLayout layout = layout_of(flags);
  EXPECT_EQ(layout.virtual_pipeline_size(), 1);
  EXPECT_FALSE(layout.interleaved());
  EXPECT_EQ(ranges_of(layout, 0), (Ranges{{0, 1}}));
  EXPECT_EQ(ranges_of(layout, 1), (Ranges{{2, 3}}));
  EXPECT_EQ(ranges_of(layout, 2), (Ranges{{4, 4}}));
  EXPECT_TRUE(layout.stage(0, 0).has_embedding);
  EXPECT_TRUE(layout.stage(2, 0).has_loss);
  expect_consistent(layout);
}

// Empty stages hold no layers. The embedding stays on (pp 0, virtual stage 0) and the loss on the last chunk even
// when E / L sit in a later / earlier stage after empty ones: Megatron's pre_process / post_process follow the
// ranks, the layout's E and L only have to come first / last in layer order.
TEST(PipelineSplit, LayoutEmptyStages) {
  Split flags = split(4, 2);
  flags.pipeline_model_parallel_layout = "Ett||tt|L";
  const PipelineLayout layout = layout_of(flags);
  EXPECT_EQ(layout.virtual_pipeline_size(), 2);
  EXPECT_EQ(layout.stage(1, 0).num_layers, 0);
  EXPECT_EQ(layout.stage(1, 1).num_layers, 0);
  EXPECT_EQ(ranges_of(layout, 0), (Ranges{{0, 1}, {2, 3}}));
  expect_consistent(layout);

  Split shifted = split(2, 3);
  shifted.pipeline_model_parallel_layout = "|Et|tL";
  const PipelineLayout shifted_layout = layout_of(shifted);
  EXPECT_EQ(shifted_layout.stage(0, 0).num_layers, 0);
  EXPECT_TRUE(shifted_layout.stage(0, 0).has_embedding);
  EXPECT_FALSE(shifted_layout.stage(1, 0).has_embedding);
  EXPECT_EQ(ranges_of(shifted_layout, 1), (Ranges{{0, 0}}));
  EXPECT_EQ(ranges_of(shifted_layout, 2), (Ranges{{1, 1}}));
  expect_consistent(shifted_layout);
}

TEST(PipelineLayoutGrammar, CommasAreCosmetic) {
  EXPECT_EQ(parse_pipeline_layout("E,t,t|t,L"), (std::vector<std::string>{"Ett", "tL"}));
  EXPECT_EQ(parse_pipeline_layout("E(tt|)*2,tL"), (std::vector<std::string>{"Ett", "tt", "tL"}));
}

// The examples of parse_str_to_list's comments, with layer characters for their letters.
TEST(PipelineLayoutGrammar, GroupRepeats) {
  // xy(ab|cd|ef)*2,pq -> xyab|cd|efab|cd|efpq
  EXPECT_EQ(parse_pipeline_layout("Et(tt|tm|mt)*2,tL"), (std::vector<std::string>{"Ettt", "tm", "mttt", "tm", "mttL"}));
  // (ab)*3 -> ababab
  EXPECT_EQ(parse_pipeline_layout("(tE)*3"), (std::vector<std::string>{"tEtEtE"}));
  // ab,(cd|)*2 -> abcd|cd|
  EXPECT_EQ(parse_pipeline_layout("Et,(tt|)*2"), (std::vector<std::string>{"Ettt", "tt", ""}));
  // (|ab)*2,cd -> |ab|abcd
  EXPECT_EQ(parse_pipeline_layout("(|Et)*2,tL"), (std::vector<std::string>{"", "Et", "EttL"}));
  // The docstring's "Ettt|(tt|)*29,m|L": 32 stages.
  const std::vector<std::string> docstring = parse_pipeline_layout("Ettt|(tt|)*29,m|L");
  ASSERT_EQ(docstring.size(), 32u);
  EXPECT_EQ(docstring[0], "Ettt");
  EXPECT_EQ(docstring[29], "tt");
  EXPECT_EQ(docstring[30], "m");
  EXPECT_EQ(docstring[31], "L");
  // The flag's help: "E|(t|)*3,m|m||L".
  EXPECT_EQ(parse_pipeline_layout("E|(t|)*3,m|m||L"),
            (std::vector<std::string>{"E", "t", "t", "t", "m", "m", "", "L"}));
}

TEST(PipelineLayoutGrammar, CharacterRepeats) {
  EXPECT_EQ(parse_pipeline_layout("Et*3|t*2L"), (std::vector<std::string>{"Ettt", "ttL"}));
  EXPECT_EQ(parse_pipeline_layout("Et*12|L"), (std::vector<std::string>{"E" + std::string(12, 't'), "L"}));
  EXPECT_EQ(parse_pipeline_layout("Et*0|L"), (std::vector<std::string>{"E", "L"}));
  EXPECT_EQ(parse_pipeline_layout("E|*3L"), (std::vector<std::string>{"E", "", "", "L"}));  // '|' is a character
  // Groups expand first, then characters: "(t*2|)*2" -> "t*2|t*2|" -> "tt|tt|".
  EXPECT_EQ(parse_pipeline_layout("(t*2|)*2"), (std::vector<std::string>{"tt", "tt", ""}));
}

TEST(PipelineLayoutGrammar, EmptyStagesAndEmptyText) {
  EXPECT_EQ(parse_pipeline_layout("E||L"), (std::vector<std::string>{"E", "", "L"}));
  EXPECT_EQ(parse_pipeline_layout("|"), (std::vector<std::string>{"", ""}));
  EXPECT_EQ(parse_pipeline_layout(""), (std::vector<std::string>{""}));
}

TEST(PipelineLayoutGrammar, InvalidCharacters) {
  const auto parse_error = [](const std::string& text) {
    try {
      parse_pipeline_layout(text);
    } catch (const LayoutError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string message = parse_error("Et|tx|L");
  EXPECT_TRUE(contains(message, "--pipeline-model-parallel-layout: Invalid layer character: x (stage='tx'")) << message;
  EXPECT_TRUE(contains(message, "known layer characters: ['E', 'L', 't', 'm']")) << message;
  EXPECT_TRUE(contains(parse_error("Et T|L"), "Invalid layer character:   (stage='Et T'"));  // a space
  EXPECT_TRUE(contains(parse_error("EtD|L"), "Invalid layer character: D"));
  // No nesting: the group ends at the first ')', so the outer ')*2' is left as characters.
  EXPECT_TRUE(contains(parse_error("E((t)*2|)*2L"), "Invalid layer character: ("));
  // One pass: "t*2*3" -> "tt*3".
  EXPECT_TRUE(contains(parse_error("Et*2*3|L"), "Invalid layer character: *"));
  EXPECT_TRUE(contains(parse_error("E(t|L"), "Invalid layer character: ("));
  EXPECT_TRUE(contains(parse_error("Et*99999999999999999999|L"), "expands to more than 1048576 characters"));
}

TEST(PipelineSplitErrors, VirtualPipelineSources) {
  Split two = split(8, 2);
  two.num_layers_per_virtual_pipeline_stage = 2;
  two.num_virtual_stages_per_pipeline_rank = 2;
  EXPECT_ERROR(two,
               "No more than one of the following arguments can be set at the same time: "
               "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank, "
               "--pipeline-model-parallel-layout (got --num-layers-per-virtual-pipeline-stage and "
               "--num-virtual-stages-per-pipeline-rank)");
  Split with_layout = split(2, 2);
  with_layout.num_virtual_stages_per_pipeline_rank = 1;
  with_layout.pipeline_model_parallel_layout = "Et|tL";
  EXPECT_ERROR(with_layout, "No more than one of the following arguments");

  Split zero = split(8, 2);
  zero.num_layers_per_virtual_pipeline_stage = 0;
  EXPECT_ERROR(zero, "--num-layers-per-virtual-pipeline-stage must be positive (got 0)");
  Split negative = split(8, 2);
  negative.num_virtual_stages_per_pipeline_rank = -1;
  EXPECT_ERROR(negative, "--num-virtual-stages-per-pipeline-rank must be positive (got -1)");

  Split uneven = split(8, 2);
  uneven.num_layers_per_virtual_pipeline_stage = 2;
  uneven.decoder_first_pipeline_num_layers = 4;
  EXPECT_ERROR(uneven,
               "please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel degree when "
               "enable uneven pipeline parallelism");

  Split not_divisible = split(9, 2);
  not_divisible.num_layers_per_virtual_pipeline_stage = 1;
  EXPECT_ERROR(not_divisible,
               "--num-layers-per-virtual-pipeline-stage: number of layers of the model must be divisible pipeline "
               "model parallel size (--num-layers 9, --pipeline-model-parallel-size 2)");
  Split per_stage = split(12, 2);
  per_stage.num_layers_per_virtual_pipeline_stage = 4;
  EXPECT_ERROR(per_stage,
               "--num-layers-per-virtual-pipeline-stage: number of layers per pipeline stage must be divisible "
               "number of layers per virtual pipeline stage (6 per pipeline stage, 4 per virtual stage)");
}

TEST(PipelineSplitErrors, VirtualPipelineDerivations) {
  // One virtual stage is Megatron's None: no interleaving, so PP 1 is fine.
  Split one = split(8, 1);
  one.num_virtual_stages_per_pipeline_rank = 1;
  EXPECT_FALSE(layout_of(one).interleaved());
  Split whole_rank = split(8, 2);
  whole_rank.num_layers_per_virtual_pipeline_stage = 4;
  EXPECT_EQ(layout_of(whole_rank).virtual_pipeline_size(), 1);
  Split six_stages = split(6, 3);
  six_stages.pipeline_model_parallel_layout = "Et|t|t|t|t|tL";
  EXPECT_EQ(layout_of(six_stages).virtual_pipeline_size(), 2);

  // The interleaved schedule needs PP > 1 (PP > 2 without p2p overlap).
  Split single = split(8, 1);
  single.num_virtual_stages_per_pipeline_rank = 2;
  EXPECT_ERROR(single,
               "--num-virtual-stages-per-pipeline-rank: When interleaved schedule is used, pipeline-model-parallel "
               "size should be greater than 1 (--pipeline-model-parallel-size 1, 2 virtual stages per rank)");
  Split single_layout = split(2, 1);
  single_layout.pipeline_model_parallel_layout = "Et|tL";
  EXPECT_ERROR(single_layout, "--pipeline-model-parallel-layout: When interleaved schedule is used");
  Split no_overlap = split(8, 2);
  no_overlap.num_virtual_stages_per_pipeline_rank = 2;
  no_overlap.overlap_p2p_comm = false;
  EXPECT_ERROR(no_overlap,
               "When interleaved schedule is used and p2p communication overlap is disabled, pipeline-model-parallel "
               "size should be greater than 2 to avoid having multiple p2p sends and recvs between same 2 ranks per "
               "communication batch (--pipeline-model-parallel-size 2)");
  no_overlap.num_layers = 12;
  no_overlap.pipeline_model_parallel_size = 3;
  EXPECT_EQ(layout_of(no_overlap).virtual_pipeline_size(), 2);
}

TEST(PipelineSplitErrors, UniformNotDivisible) {
  EXPECT_ERROR(split(7, 2),
               "Number of layers should be divisible by the pipeline-model-parallel size (--num-layers 7, "
               "--pipeline-model-parallel-size 2)");
  Split accounted = split(7, 4);
  accounted.account_for_embedding_in_pipeline_split = true;
  accounted.account_for_loss_in_pipeline_split = true;
  EXPECT_ERROR(accounted,
               "Number of layers should be divisible by the pipeline-model-parallel size (--num-layers 7 + 1 "
               "(embedding) + 1 (loss) = 9, --pipeline-model-parallel-size 4)");
  // Without the embedding counted, 8 layers split over PP 4 fine.
  accounted.account_for_embedding_in_pipeline_split = false;
  EXPECT_NO_THROW(layout_of(accounted));

  // With --num-virtual-stages-per-pipeline-rank: get_num_layers_to_build's checks.
  Split chunks = split(7, 2);
  chunks.num_virtual_stages_per_pipeline_rank = 2;
  EXPECT_ERROR(chunks, "--num-layers 7 should be divisible by --pipeline-model-parallel-size 2");
  chunks.num_layers = 6;
  EXPECT_ERROR(chunks,
               "num_layers_per_pipeline_rank 3 should be divisible by vp_size 2 "
               "(--num-virtual-stages-per-pipeline-rank)");

  // And TransformerConfig's, when the embedding / loss are counted.
  Split counted = split(8, 2);
  counted.num_virtual_stages_per_pipeline_rank = 2;
  counted.account_for_embedding_in_pipeline_split = true;
  EXPECT_ERROR(counted,
               "num_layers: 9 after enable --account-for-embedding-in-pipeline-split or "
               "--account-for-loss-in-pipeline-split must be divisible by --pipeline-model-parallel-size 2");
  counted.account_for_loss_in_pipeline_split = true;
  EXPECT_ERROR(counted,
               "number of layers on each pipeline rank: 5 (after enable --account-for-embedding-in-pipeline-split or "
               "--account-for-loss-in-pipeline-split) must be divisible by virtual_pipeline_model_parallel_size 2");
}

TEST(PipelineSplitErrors, ModesCombined) {
  Split uneven_accounted = split(8, 2);
  uneven_accounted.decoder_first_pipeline_num_layers = 3;
  uneven_accounted.account_for_loss_in_pipeline_split = true;
  EXPECT_ERROR(uneven_accounted,
               "--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers cannot be set at the same "
               "time with --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split");

  Split layout = split(2, 2);
  layout.pipeline_model_parallel_layout = "Et|tL";
  layout.decoder_last_pipeline_num_layers = 1;
  EXPECT_ERROR(layout,
               "--pipeline-model-parallel-layout cannot be set with other pipeline layout arguments (got "
               "--decoder-last-pipeline-num-layers)");
  layout.decoder_last_pipeline_num_layers.reset();
  layout.account_for_embedding_in_pipeline_split = true;
  layout.account_for_loss_in_pipeline_split = true;
  EXPECT_ERROR(layout,
               "--pipeline-model-parallel-layout cannot be set with other pipeline layout arguments (got "
               "--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split)");
}

TEST(PipelineSplitErrors, Uneven) {
  Split first_zero = split(8, 2);
  first_zero.decoder_first_pipeline_num_layers = 0;
  EXPECT_ERROR(first_zero, "--decoder-first-pipeline-num-layers must be larger than 0 (got 0)");
  Split last_negative = split(8, 2);
  last_negative.decoder_last_pipeline_num_layers = -2;
  EXPECT_ERROR(last_negative, "--decoder-last-pipeline-num-layers must be larger than 0 (got -2)");

  Split first_vpp = split(12, 4);
  first_vpp.num_virtual_stages_per_pipeline_rank = 2;
  first_vpp.decoder_first_pipeline_num_layers = 3;
  EXPECT_ERROR(first_vpp,
               "--decoder-first-pipeline-num-layers: number of layers at first stage: 3 must be divisible by virtual "
               "pipeline parallel degree 2");
  Split last_vpp = split(12, 4);
  last_vpp.num_virtual_stages_per_pipeline_rank = 2;
  last_vpp.decoder_last_pipeline_num_layers = 5;
  EXPECT_ERROR(last_vpp,
               "--decoder-last-pipeline-num-layers: number of layers at last stage: 5 must be divisible by virtual "
               "pipeline parallel degree 2");

  // 8 layers, PP 2, first 3, last 3: 2 layers left and no middle rank; PP 3, first 4, last 4: a middle rank, no
  // layers.
  Split no_middle_rank = split(8, 2);
  no_middle_rank.decoder_first_pipeline_num_layers = 3;
  no_middle_rank.decoder_last_pipeline_num_layers = 3;
  EXPECT_ERROR(no_middle_rank, "Mismatch: 2 middle layers remaining but 0 middle PP stages available");
  Split no_middle_layers = split(8, 3);
  no_middle_layers.decoder_first_pipeline_num_layers = 4;
  no_middle_layers.decoder_last_pipeline_num_layers = 4;
  EXPECT_ERROR(no_middle_layers, "Mismatch: 0 middle layers remaining but 1 middle PP stages available");

  Split middle = split(11, 4);
  middle.decoder_first_pipeline_num_layers = 3;
  middle.decoder_last_pipeline_num_layers = 3;
  EXPECT_ERROR(middle,
               "number of layers at middle stage: 5 must be divisible by the middle pipeline model parallel size 2");
  Split middle_vpp = split(10, 4);
  middle_vpp.num_virtual_stages_per_pipeline_rank = 2;
  middle_vpp.decoder_first_pipeline_num_layers = 2;
  middle_vpp.decoder_last_pipeline_num_layers = 2;
  EXPECT_ERROR(middle_vpp,
               "number of layers on each middle pipeline rank: 3 must be divisible by virtual pipeline parallel "
               "degree 2");

  // moecore's: counts beyond --num-layers, and both counts in a single stage.
  Split too_many = split(8, 2);
  too_many.decoder_first_pipeline_num_layers = 10;
  EXPECT_ERROR(too_many,
               "--decoder-first-pipeline-num-layers (10) and --decoder-last-pipeline-num-layers (0) hold more layers "
               "than --num-layers (8)");
  Split single = split(8, 1);
  single.decoder_first_pipeline_num_layers = 3;
  single.decoder_last_pipeline_num_layers = 5;
  EXPECT_ERROR(single,
               "--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers together need "
               "--pipeline-model-parallel-size >= 2");
  Split single_short = split(8, 1);
  single_short.decoder_first_pipeline_num_layers = 3;
  EXPECT_ERROR(single_short, "Mismatch: 5 middle layers remaining but 0 middle PP stages available");
}

TEST(PipelineSplitErrors, Layout) {
  const auto layout_error = [](const int64_t num_layers, const int64_t pp, const std::string& text) {
    Split flags = split(num_layers, pp);
    flags.pipeline_model_parallel_layout = text;
    return error_of(flags);
  };
  EXPECT_TRUE(contains(layout_error(4, 2, "Et|t|tL"),
                       "The length of --pipeline-model-parallel-layout must be divisible by "
                       "--pipeline-model-parallel-size (num_stages=3, pipeline_model_parallel_size=2)"));
  EXPECT_TRUE(contains(layout_error(2, 2, "Et|tmL"),
                       "--pipeline-model-parallel-layout: Number of mtp layers in layout must match mtp_num_layers (1 "
                       "in the layout, --mtp-num-layers 0)"));
  EXPECT_TRUE(contains(layout_error(2, 2, "tE|tL"),
                       "--pipeline-model-parallel-layout: The first layer must be embedding, but got decoder"));
  EXPECT_TRUE(contains(layout_error(2, 2, "Et|Lt"), "The last layer must be loss, but got decoder"));
  EXPECT_TRUE(contains(layout_error(2, 1, ""), "The first layer must be embedding, but got nothing"));
  EXPECT_TRUE(contains(layout_error(2, 2, "|"), "The first layer must be embedding, but got nothing"));
  EXPECT_TRUE(contains(layout_error(2, 2, "EtE|tL"), "Embedding must be specified exactly once"));
  EXPECT_TRUE(contains(layout_error(2, 2, "ELt|tL"), "Loss must be specified exactly once"));
  EXPECT_TRUE(contains(layout_error(3, 2, "Et|tL"), "Number of decoder layers 2 must match --num-layers 3"));
  EXPECT_TRUE(contains(layout_error(3, 2, "Et|tx"), "Invalid layer character: x"));
}

// Multi-Token Prediction depths: on the loss stage by default, where the layout's 'm's are otherwise, with
// validate_layer_layout's checks; moecore runs them only beside the loss.
TEST(PipelineSplit, MultiTokenPrediction) {
  Split flags = split(4, 2);
  flags.mtp_num_layers = 2;
  const PipelineLayout uniform = layout_of(flags);
  EXPECT_EQ(uniform.stage(0, 0).mtp_layers, 0);
  EXPECT_EQ(uniform.stage(1, 0).mtp_layers, 2);
  flags.pipeline_model_parallel_layout = "Et|tttmmL";
  const PipelineLayout by_hand = layout_of(flags);
  EXPECT_EQ(by_hand.stage(1, 0).num_layers, 3);
  EXPECT_EQ(by_hand.stage(1, 0).mtp_layers, 2);

  const auto mtp_error = [](const int64_t num_layers, const int64_t pp, const std::string& text) {
    Split f = split(num_layers, pp);
    f.mtp_num_layers = 2;
    f.pipeline_model_parallel_layout = text;
    return error_of(f);
  };
  const std::string prefix = "--pipeline-model-parallel-layout: ";
  EXPECT_EQ(mtp_error(2, 2, "Et|tmL"),
            prefix + "Number of mtp layers in layout must match mtp_num_layers (1 in the layout, --mtp-num-layers 2)");
  EXPECT_EQ(mtp_error(2, 2, "Etm|mtL"), prefix + "decoder layers must be placed before MTP layers");
  EXPECT_EQ(mtp_error(2, 2, "Et|tm||mL"),
            prefix +
                "Currently we restrict that the MTP should be always in the last virtual pipeline stage of that "
                "rank. But got 'tm' (pipeline rank 1, virtual stage 0)");
  EXPECT_EQ(mtp_error(2, 2, "Ettm|mL"),
            prefix + "All of the MTP layers must be in the same one virtual pipeline stage");
  EXPECT_EQ(mtp_error(2, 2, "Ettmm|L"),
            prefix +
                "Multi-Token Prediction layers on a stage without the loss (Megatron's standalone MTP stage) are "
                "not supported by moecore yet: put the 'm's beside the 'L'");
}

TEST(PipelineSplitErrors, SizesAndLookups) {
  EXPECT_ERROR(split(8, 0), "--pipeline-model-parallel-size must be positive (got 0)");
  EXPECT_ERROR(split(0, 1), "--num-layers must be positive (got 0)");
  const PipelineLayout layout = layout_of(split(8, 2));
  EXPECT_THROW(layout.stage(2, 0), LayoutError);
  EXPECT_THROW(layout.stage(0, 1), LayoutError);
  EXPECT_THROW(layout.stage_of_layer(8), LayoutError);
  EXPECT_THROW(layout.stage_of_layer(-1), LayoutError);
  EXPECT_EQ(layout.stage_of_layer(3).pp_rank, 0);
  EXPECT_EQ(layout.stage_of_layer(4).pp_rank, 1);
}

}  // namespace
}  // namespace moecore::parallel
