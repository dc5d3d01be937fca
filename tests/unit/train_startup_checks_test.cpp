// The checks `moecore train` makes before building its model (train/startup_checks.h): each refusal names the flag,
// and what a run legitimately asks for passes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/ckpt/checkpoint_dir.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/startup_checks.h"
#include "test_temp_dir.h"
#include "unit/test_recipe.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

// A small dense model on mock data with NullTokenizer (ids 0..99, EOD 100), LayerNorm as Megatron's default.
Args base() {
  return test::recipe_flags("tiny-one-layer",
                            {"--train-iters", "4", "--lr", "1e-3", "--micro-batch-size", "2", "--mock-data",
                             "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"});
}
Args llama_style() {
  Args args = base();
  for (const char* flag : {"--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "32",
                           "--position-embedding-type", "rope", "--disable-bias-linear"}) {
    args.emplace_back(flag);
  }
  return args;
}
Args with(Args args, const Args& extra) {
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// check_outputs on parsed `args` (vocabulary and padded model as the trainer builds them); "" when it passes.
std::string outputs_error(const Args& args) {
  const TrainingArgs parsed = parse_train_args(args);
  const Vocabulary vocabulary = build_vocabulary(parsed);
  try {
    check_outputs(with_padded_vocabulary(parsed, vocabulary), vocabulary, true);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string split_error(const Args& args) {
  try {
    check_split_weights(parse_train_args(args));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(TrainStartupChecks, SaveAndLoadFolders) {
  const test::TempDir dir("startup");
  EXPECT_EQ(outputs_error(with(base(), {"--save-interval", "10", "--save", dir.path("ckpt/run1")})), "");
  std::ofstream(dir.path("file")) << "x";
  EXPECT_EQ(outputs_error(with(base(), {"--save-interval", "10", "--save", dir.path("file")})),
            "--save: " + dir.path("file") + " exists and is not a folder");
  EXPECT_EQ(outputs_error(with(base(), {"--save-interval", "10", "--save", dir.path("file/run")})),
            "--save: " + dir.path("file/run") + " cannot be created: " + dir.path("file") + " is not a folder");
  EXPECT_EQ(outputs_error(with(base(), {"--save-interval", "10", "--save", "/proc/moecore_run"}))
                .rfind("--save: /proc/moecore_run cannot", 0),
            0u);
  EXPECT_EQ(outputs_error(with(base(), {"--load", dir.path("file")})),
            "--load " + dir.path("file") + " is a file, not a checkpoint folder");
  EXPECT_EQ(outputs_error(with(base(), {"--load", dir.path("absent")})), "");  // Megatron: a fresh start
}

// A save folder whose tracker names `iteration`, saved (metadata.json only) with the model flags of `args`.
void fake_checkpoint(const std::string& dir, const Args& args, const int64_t iteration) {
  fs::create_directories(iteration_dir(dir, iteration));
  const nlohmann::ordered_json metadata = {
      {"format", "moecore_sharded"}, {"iteration", iteration}, {"args", checkpoint_args(parse_train_args(args))}};
  std::ofstream(fs::path(iteration_dir(dir, iteration)) / "metadata.json") << metadata.dump(1);
  write_tracker(dir, iteration);
}

TEST(TrainStartupChecks, SaveFolderOfAnotherModelIsRefused) {
  const test::TempDir dir("startup");
  const std::string run = dir.path("run");
  fake_checkpoint(run, base(), 4);
  const Args save = {"--save-interval", "10", "--save", run};
  EXPECT_EQ(outputs_error(with(base(), save)), "");  // the same model: its own folder
  const Args wider = with(base(), {"--hidden-size", "32"});
  EXPECT_EQ(outputs_error(with(wider, save)),
            "--save " + run + " holds another model's checkpoint: iteration 4 was saved with --hidden-size 16, this " +
                "run has 32 (pass --save-overwrite-other-model to save over it, or choose another --save folder)");
  EXPECT_EQ(outputs_error(with(wider, with(save, {"--save-overwrite-other-model"}))), "");
  // A resume from the same folder: the load compares the flags (with its own message).
  EXPECT_EQ(outputs_error(with(wider, with(save, {"--load", run + "/"}))), "");
  // A tracker naming a folder without moecore model flags.
  fs::remove(fs::path(iteration_dir(run, 4)) / "metadata.json");
  EXPECT_EQ(outputs_error(with(base(), save)),
            "--save " + run + ": its latest checkpoint (iteration 4) has no moecore model flags in " +
                iteration_dir(run, 4) + "/metadata.json (pass --save-overwrite-other-model to save over it, or " +
                "choose another --save folder)");
  EXPECT_EQ(outputs_error(with(base(), {"--save-interval", "10", "--save", dir.path("empty")})), "");
}

TEST(TrainStartupChecks, TrackerGoingBackIsNamed) {
  const test::TempDir dir("startup");
  const std::string run = dir.path("run");
  const auto warning = [&](const Args& extra, const int64_t start) {
    return save_tracker_regression(parse_train_args(with(with(base(), {"--save", run}), extra)), start);
  };
  EXPECT_EQ(warning({"--save-interval", "2"}, 0), "");  // no tracker yet
  fake_checkpoint(run, base(), 4);
  EXPECT_EQ(warning({"--save-interval", "2"}, 0),
            "--save " + run + ": " + tracker_path(run) + " names iteration 4, this run starts at iteration 0 and " +
                "its first save (iteration 2) moves it back (to continue that run, pass --load " + run + ")");
  EXPECT_EQ(warning({"--save-interval", "4"}, 0), "");                 // saves iteration 4 again: not back
  EXPECT_EQ(warning({"--save-interval", "2", "--load", run}, 4), "");  // the resume
  EXPECT_EQ(warning({"--save-interval", "1", "--load", run, "--ckpt-step", "2"}, 2),
            "--save " + run + ": " + tracker_path(run) + " names iteration 4, this run starts at iteration 2 and " +
                "its first save (iteration 3) moves it back");
}

TEST(TrainStartupChecks, ExportNeedsAnExportableModelAndAUsableFolder) {
  const test::TempDir dir("startup");
  // Megatron's default LayerNorm model: the message export_hf gives after training.
  EXPECT_EQ(outputs_error(with(base(), {"--export-hf", dir.path("hf")})),
            "HF export supports llama/qwen3-style models (RMSNorm, SwiGLU, RoPE); this model has --normalization "
            "LayerNorm");
  EXPECT_EQ(outputs_error(with(llama_style(), {"--export-hf", dir.path("hf")})), "");
  fs::create_directories(dir.path("busy"));
  std::ofstream(dir.path("busy/data.bin")) << "x";
  EXPECT_EQ(
      outputs_error(with(llama_style(), {"--export-hf", dir.path("busy")})),
      "--export-hf: refusing to replace " + dir.path("busy") + ": it holds 'data.bin', which an export does not write");
  std::ofstream(dir.path("file")) << "x";
  EXPECT_EQ(outputs_error(with(llama_style(), {"--export-hf", dir.path("file")})),
            "--export-hf: " + dir.path("file") + " exists and is not a folder");
  EXPECT_EQ(outputs_error(with(llama_style(),
                               {"--export-hf", dir.path("run"), "--save-interval", "10", "--save", dir.path("run/")})),
            "--save " + dir.path("run/") + " lies in the --export-hf folder " + dir.path("run") +
                ", which an export replaces whole");
  EXPECT_EQ(outputs_error(with(llama_style(), {"--export-hf", dir.path("run/"), "--save-interval", "10", "--save",
                                               dir.path("run/ckpt")})),
            "--save " + dir.path("run/ckpt") + " lies in the --export-hf folder " + dir.path("run/") +
                ", which an export replaces whole");
  EXPECT_EQ(outputs_error(with(llama_style(), {"--export-hf", dir.path("run/hf"), "--save-interval", "10", "--save",
                                               dir.path("run")})),
            "");
  EXPECT_EQ(outputs_error(with(llama_style(),
                               {"--export-hf", dir.path("run"), "--save-interval", "10", "--save", dir.path("run2")})),
            "");
}

TEST(TrainStartupChecks, SamplePromptMustTokenize) {
  EXPECT_EQ(outputs_error(with(base(), {"--sample-prompt", "1 2 3"})), "");
  EXPECT_EQ(outputs_error(with(base(), {"--sample-prompt", "hello"})),
            "--sample-prompt: NullTokenizer: 'hello' is not an integer (the text must be token ids separated by "
            "single spaces)");
  const std::string out_of_range = outputs_error(with(base(), {"--sample-prompt", "1 101"}));
  EXPECT_EQ(out_of_range.rfind("--sample-prompt: NullTokenizer: token id 101 is outside [0, 101)", 0), 0u)
      << out_of_range;
}

TEST(TrainStartupChecks, SplitWeightsOfWhatTheRunReads) {
  Args real = base();
  real.erase(std::find(real.begin(), real.end(), "--mock-data"));
  real = with(real, {"--data-path", "corpus_text_document"});  // not opened by check_split_weights
  EXPECT_EQ(split_error(with(real, {"--split", "98,2,0"})), "");
  EXPECT_EQ(split_error(with(real, {"--split", "100,0,0"})), "");  // no evaluation asked for: Megatron's skip
  EXPECT_EQ(split_error(with(real, {"--split", "0,1,0"})),
            "--split '0,1,0': the train split has weight 0, so there is nothing to train on");
  EXPECT_EQ(split_error(with(real, {"--split", "100,0,0", "--eval-interval", "10"})),
            "--split '100,0,0': the valid split has weight 0, so --eval-interval 10 would evaluate nothing (give it a "
            "weight or drop --eval-interval)");
  EXPECT_EQ(split_error(with(base(), {"--eval-interval", "10"})), "");  // mock data: always 1,1,1
}

TEST(TrainStartupChecks, BuiltSplitsHoldWhatTheRunReads) {
  const test::TempDir dir("startup");
  // Two datasets of 3 documents of 40 tokens blended without weights: one epoch each. With --split 1,1,0 the train
  // split of each holds round(1.5) = 2 documents: 80 tokens, so (80 - 1) / 16 = 4 samples of 16 tokens per dataset,
  // 8 in all; the valid split 1 document each: (40 - 1) / 16 = 2 samples per dataset, 4 in all.
  std::vector<std::string> prefixes;
  for (const char* name : {"a", "b"}) {
    IndexedDatasetWriter writer(dir.path(name), IndexedDType::kU16);
    for (int d = 0; d < 3; ++d) {
      std::vector<int32_t> tokens(39, 7);
      tokens.push_back(100);
      writer.add_document(tokens);
    }
    writer.finalize();
    prefixes.push_back(dir.path(name));
  }
  Args args = base();
  args.erase(std::find(args.begin(), args.end(), "--mock-data"));
  args = with(args, {"--data-path", prefixes[0], prefixes[1], "--split", "1,1,0", "--data-cache-path",
                     dir.path("cache"), "--global-batch-size", "2", "--eval-iters", "1"});
  const auto built_error = [&](const Args& extra) {
    const TrainingArgs parsed = parse_train_args(with(args, extra));
    const Vocabulary vocabulary = build_vocabulary(parsed);
    const TrainingArgs run_args = with_padded_vocabulary(parsed, vocabulary);
    std::ostringstream log;
    const GPTDataProvider data = build_data(run_args, vocabulary.eod_id, log);
    try {
      check_built_splits(run_args, data);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(built_error({"--train-iters", "4"}), "");  // reads 4 x 2 = 8
  EXPECT_EQ(built_error({"--train-iters", "5"}),
            "--split '1,1,0': the train split holds 8 samples of 16 tokens, the run reads 10 (--train-iters x "
            "--global-batch-size)");
  EXPECT_EQ(built_error({"--train-iters", "1", "--global-batch-size", "8"}),
            "--split '1,1,0': the valid split holds 4 samples of 16 tokens, an evaluation reads 8 at a time "
            "(--global-batch-size)");
}

TEST(TrainStartupChecks, TokenIdsAgainstTheVocabulary) {
  const test::TempDir dir("startup");
  IndexedDatasetWriter writer(dir.path("d"), IndexedDType::kU16);
  writer.add_document({1, 2, 3});
  writer.add_document({99, 100});
  writer.add_document({4, 700});  // beyond the scan below when it stops after 5 tokens
  writer.finalize();
  EXPECT_NO_THROW(check_token_ids({dir.path("d")}, 701, 100));
  EXPECT_NO_THROW(check_token_ids({dir.path("d")}, 101, 5));
  EXPECT_NO_THROW(check_token_ids({}, 10, 100));  // mock data
  test::expect_error_containing<ConfigError>(
      [&] {
        check_token_ids({"1", dir.path("d")}, 101, 100);
      },
      "--data-path " + dir.path("d") +
          ": token id 700 in sequence 2 is outside the tokenizer's vocabulary [0, 101); was the data tokenized with "
          "another tokenizer or --vocab-size?");
  test::expect_error_containing<ConfigError>([&] { check_token_ids({dir.path("d")}, 100, 100); },
                                             "token id 100 in sequence 1");
}

}  // namespace
}  // namespace moecore
