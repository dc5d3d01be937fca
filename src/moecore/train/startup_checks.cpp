#include "moecore/train/startup_checks.h"

#include <algorithm>
#include <array>
#include <exception>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "moecore/ckpt/checkpoint_dir.h"
#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/data/blended_dataset.h"
#include "moecore/data/indexed_dataset.h"
#include "moecore/data/split.h"
#include "moecore/train/checkpointing.h"
#include "moecore/util/output_folder.h"

namespace moecore {
namespace {

namespace fs = std::filesystem;

std::string str(const int64_t value) { return std::to_string(value); }

// Whether `inner` is `outer` or lies inside it (paths resolved as far as they exist).
bool within_folder(const std::string& inner, const std::string& outer) {
  std::error_code ec;
  fs::path in = fs::weakly_canonical(fs::absolute(inner), ec);
  if (ec) return false;
  fs::path out = fs::weakly_canonical(fs::absolute(outer), ec);
  if (ec) return false;
  if (in.filename().empty()) in = in.parent_path();  // "run/" -> "run"
  if (out.filename().empty()) out = out.parent_path();
  return std::mismatch(out.begin(), out.end(), in.begin(), in.end()).first == out.end();
}

// Whether `a` and `b` name the same folder (resolved through links as far as they exist).
bool same_folder(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (fs::equivalent(a, b, ec)) return true;
  const fs::path left = fs::weakly_canonical(fs::absolute(a), ec);
  if (ec) return false;
  const fs::path right = fs::weakly_canonical(fs::absolute(b), ec);
  return !ec && left.lexically_normal() == right.lexically_normal();
}

// The tracker of save folder `dir`, or nullopt when it has none or one that names no iteration (a save rewrites it).
std::optional<int64_t> tracked_iteration(const std::string& dir) {
  try {
    return read_tracker(dir);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// --save DIR whose newest checkpoint is another model's: its "args"."model" in metadata.json differs from this run's
// (compared flag by flag, as a load compares them). A resume (--load the same folder) is the load's to check.
void check_save_folder_model(const TrainingArgs& args) {
  if (args.save_overwrite_other_model || (!args.load.empty() && same_folder(args.save, args.load))) return;
  const std::optional<int64_t> tracked = tracked_iteration(args.save);
  if (!tracked) return;
  const std::string override_hint =
      " (pass --save-overwrite-other-model to save over it, or choose another --save folder)";
  const std::string metadata_path = (fs::path(iteration_dir(args.save, *tracked)) / "metadata.json").string();
  nlohmann::ordered_json saved;
  try {
    std::ifstream in(metadata_path);
    if (!in) throw std::runtime_error("missing");
    saved = nlohmann::ordered_json::parse(in).at("args").at("model");
    if (!saved.is_object()) throw std::runtime_error("not an object");
  } catch (const std::exception&) {
    throw ConfigError("--save " + args.save + ": its latest checkpoint (iteration " + str(*tracked) +
                      ") has no moecore model flags in " + metadata_path + override_hint);
  }
  const nlohmann::ordered_json mine = checkpoint_args(args).at("model");
  for (const auto& [flag, value] : mine.items()) {
    if (!saved.contains(flag) || saved[flag] != value) {
      throw ConfigError("--save " + args.save + " holds another model's checkpoint: iteration " + str(*tracked) +
                        " was saved with " + flag + " " +
                        (saved.contains(flag) ? saved[flag].dump() : std::string("(absent)")) + ", this run has " +
                        value.dump() + override_hint);
    }
  }
  for (const auto& [flag, value] : saved.items()) {  // a recorded flag this run does not have (e.g. MTP off)
    if (!mine.contains(flag)) {
      throw ConfigError("--save " + args.save + " holds another model's checkpoint: iteration " + str(*tracked) +
                        " was saved with " + flag + " " + value.dump() + ", this run has none" + override_hint);
    }
  }
}

void check_sample_prompt(const TrainingArgs& args, const Vocabulary& vocabulary) {
  if (args.sample_prompt.empty()) return;
  if (!vocabulary.tokenizer) throw ConfigError("--sample-prompt needs a text tokenizer (--tokenizer-type)");
  std::vector<int32_t> tokens;
  try {
    tokens = vocabulary.tokenizer->tokenize(args.sample_prompt);
  } catch (const std::exception& e) {
    throw ConfigError("--sample-prompt: " + std::string(e.what()));
  }
  if (tokens.empty()) throw ConfigError("--sample-prompt '" + args.sample_prompt + "' has no tokens");
  // The sample after training would refuse it (generate.h check_prompt): say so before training.
  if (static_cast<int64_t>(tokens.size()) > args.model.seq_length) {
    throw ConfigError("--sample-prompt is " + std::to_string(tokens.size()) + " tokens, longer than --seq-length " +
                      std::to_string(args.model.seq_length));
  }
}

}  // namespace

void check_outputs(const TrainingArgs& run_args, const Vocabulary& vocabulary, const bool writes_export) {
  if (!run_args.save.empty()) {
    if (const std::string problem = folder_write_problem(run_args.save); !problem.empty()) {
      throw ConfigError("--save: " + problem);
    }
    check_save_folder_model(run_args);
  }
  if (!run_args.tensorboard_dir.empty()) {  // the last rank writes there: every rank refuses it before training
    if (const std::string problem = folder_write_problem(run_args.tensorboard_dir); !problem.empty()) {
      throw ConfigError("--tensorboard-dir: " + problem);
    }
  }
  if (!run_args.moe_routing_trace.path.empty()) {  // every rank writes its own files there
    if (const std::string problem = folder_write_problem(run_args.moe_routing_trace.path); !problem.empty()) {
      throw ConfigError("--moe-routing-trace-path: " + problem);
    }
  }
  if (!run_args.load.empty()) {
    std::error_code ec;
    if (fs::exists(run_args.load, ec) && !fs::is_directory(run_args.load, ec)) {
      throw ConfigError("--load " + run_args.load + " is a file, not a checkpoint folder");
    }
  }
  if (!run_args.export_hf_dir.empty()) {
    hf_model_type(run_args.model);  // the message export_hf would give after training
    if (!run_args.save.empty() && within_folder(run_args.save, run_args.export_hf_dir)) {
      throw ConfigError("--save " + run_args.save + " lies in the --export-hf folder " + run_args.export_hf_dir +
                        ", which an export replaces whole");
    }
    if (writes_export) {
      if (const std::string problem = hf_export_dir_problem(run_args.export_hf_dir); !problem.empty()) {
        throw ConfigError("--export-hf: " + problem);
      }
    }
  }
  check_sample_prompt(run_args, vocabulary);
}

std::string save_tracker_regression(const TrainingArgs& args, const int64_t start_iteration) {
  if (args.save.empty() || !args.save_interval || start_iteration >= args.train_iters) return "";
  const std::optional<int64_t> tracked = tracked_iteration(args.save);
  const int64_t first_save =
      std::min((start_iteration / *args.save_interval + 1) * *args.save_interval, args.train_iters);
  if (!tracked || first_save >= *tracked) return "";
  return "--save " + args.save + ": " + tracker_path(args.save) + " names iteration " + str(*tracked) +
         ", this run starts at iteration " + str(start_iteration) + " and its first save (iteration " +
         str(first_save) + ") moves it back" +
         (args.load.empty() ? " (to continue that run, pass --load " + args.save + ")" : "");
}

void check_split_weights(const TrainingArgs& args) {
  if (args.mock_data || args.split.empty()) return;
  std::array<double, kNumDatasetSplits> weights{};
  try {
    weights = parse_and_normalize_split(args.split);
  } catch (const DataError& e) {
    throw ConfigError(e.what());
  }
  if (weights[static_cast<size_t>(DatasetSplit::kTrain)] == 0.0) {
    throw ConfigError("--split '" + args.split + "': the train split has weight 0, so there is nothing to train on");
  }
  if (args.eval_interval && weights[static_cast<size_t>(DatasetSplit::kValid)] == 0.0) {
    throw ConfigError("--split '" + args.split + "': the valid split has weight 0, so --eval-interval " +
                      str(*args.eval_interval) + " would evaluate nothing (give it a weight or drop --eval-interval)");
  }
}

void check_built_splits(const TrainingArgs& args, const GPTDataProvider& data) {
  if (!args.sample_data_path.empty()) return;  // whole samples: no GPT dataset (epochs repeat the samples)
  const std::string where = args.mock_data ? std::string("--mock-data") : "--split '" + args.split + "'";
  const int64_t reads = split_sample_counts(args).train;
  const int64_t train = data.num_samples(DatasetSplit::kTrain);
  if (train < reads) {
    throw ConfigError(where + ": the train split holds " + str(train) + " samples of " + str(args.model.seq_length) +
                      " tokens, the run reads " + str(reads) + " (--train-iters x --global-batch-size)");
  }
  const int64_t valid = data.num_samples(DatasetSplit::kValid);
  if (data.has_split(DatasetSplit::kValid) && args.eval_iters > 0 && valid < args.global_batch_size) {
    throw ConfigError(where + ": the valid split holds " + str(valid) + " samples of " + str(args.model.seq_length) +
                      " tokens, an evaluation reads " + str(args.global_batch_size) +
                      " at a time (--global-batch-size)");
  }
}

void check_token_ids(const std::vector<std::string>& data_path, const int64_t vocab_size, const int64_t max_tokens) {
  if (data_path.empty()) return;
  const std::vector<std::string> prefixes = parse_blend(data_path).prefixes;
  // The budget is shared by a blend's datasets, each reading at least its first sequence.
  const int64_t per_dataset = max_tokens / static_cast<int64_t>(prefixes.size());
  for (const std::string& prefix : prefixes) {
    const IndexedDataset dataset(prefix);
    int64_t scanned = 0;
    for (int64_t i = 0; i < dataset.num_sequences() && (i == 0 || scanned < per_dataset); ++i) {
      const std::vector<int32_t> tokens = dataset.get(i);
      const auto [lowest, highest] = std::minmax_element(tokens.begin(), tokens.end());
      if (lowest != tokens.end() && (*lowest < 0 || *highest >= vocab_size)) {
        throw ConfigError("--data-path " + prefix + ": token id " + str(*lowest < 0 ? *lowest : *highest) +
                          " in sequence " + str(i) + " is outside the tokenizer's vocabulary [0, " + str(vocab_size) +
                          "); was the data tokenized with another tokenizer or --vocab-size?");
      }
      scanned += static_cast<int64_t>(tokens.size());
    }
  }
}

}  // namespace moecore
