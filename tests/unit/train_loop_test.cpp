// The training loop against Megatron's train() / evaluate(): the lm loss is token-weighted over the global batch
// (checked with --eod-mask-loss on micro-batches with different numbers of masked tokens, against the model's own
// per-micro-batch losses), validations read the samples Megatron's would whatever moecore evaluates before
// training, the final validation line is Megatron's, there is no periodic evaluation without --eval-interval, and
// iteration lines appear after iteration 1 and every --log-interval. --lr 0 keeps the model at its initial values,
// so every expected loss is computed from a freshly built model.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/data/indexed_dataset.h"
#include "moecore/train/trainer.h"
#include "moecore/train/training_setup.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

constexpr int32_t kVocab = 50;  // NullTokenizer: ids [0, 50), EOD = 50

// Short documents of 1..7 tokens ending in EOD, so the 16-token samples hold different numbers of EODs.
std::string write_corpus(const test::TempDir& dir) {
  const std::string prefix = dir.path("corpus");
  IndexedDatasetWriter writer(prefix, IndexedDType::kI32);
  uint64_t state = 12345;
  for (int d = 0; d < 400; ++d) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const int length = 1 + static_cast<int>((state >> 33) % 7);
    std::vector<int32_t> tokens;
    for (int t = 0; t < length; ++t) tokens.push_back(static_cast<int32_t>((state >> (t + 5)) % kVocab));
    tokens.push_back(kVocab);
    writer.add_document(tokens);
  }
  writer.finalize();
  return prefix;
}

std::vector<std::string> base_flags(const test::TempDir& dir, const std::string& prefix) {
  return {"--num-layers",
          "1",
          "--hidden-size",
          "16",
          "--num-attention-heads",
          "2",
          "--seq-length",
          "16",
          "--max-position-embeddings",
          "16",
          "--attention-dropout",
          "0",
          "--hidden-dropout",
          "0",
          "--micro-batch-size",
          "1",
          "--global-batch-size",
          "4",
          "--lr",
          "0",
          "--min-lr",
          "0",
          "--log-interval",
          "1",
          "--eval-iters",
          "1",
          "--tokenizer-type",
          "NullTokenizer",
          "--vocab-size",
          std::to_string(kVocab),
          "--data-path",
          prefix,
          "--split",
          "50,50,0",
          "--data-cache-path",
          dir.path("cache"),
          "--eod-mask-loss",
          "--seed",
          "5",
          "--threads",
          "1"};
}

TrainingArgs parse(std::vector<std::string> flags, const std::vector<std::string>& extra) {
  flags.insert(flags.end(), extra.begin(), extra.end());
  return parse_train_args(flags);
}

// Per-micro-batch mean losses and unmasked token counts of the initial model over samples [first, first + count).
struct MicroBatchLosses {
  std::vector<double> means, tokens;
  double token_weighted() const {
    double sum = 0, n = 0;
    for (size_t i = 0; i < means.size(); ++i) sum += means[i] * tokens[i], n += tokens[i];
    return sum / n;
  }
  double mean_of_means() const {
    double sum = 0;
    for (const double m : means) sum += m;
    return sum / static_cast<double>(means.size());
  }
};
MicroBatchLosses initial_model_losses(const TrainingArgs& args, const DatasetSplit split, const int64_t first,
                                      const int64_t count) {
  const Vocabulary vocabulary = build_vocabulary(args);
  const TrainingArgs run_args = with_padded_vocabulary(args, vocabulary);
  std::ostringstream quiet;
  const GPTDataProvider data = build_data(run_args, vocabulary.eod_id, quiet);
  GPTModel model(run_args.model, static_cast<uint64_t>(args.seed), parallel::ParallelState::single_process());
  MicroBatchLosses out;
  for (int64_t s = first; s < first + count; ++s) {
    const Batch batch = data.get_batch(split, s, 1);
    std::unique_ptr<MicroBatchContext> unused;
    ForwardOptions options;
    options.training = false;
    out.means.push_back(model.forward(unused, batch.tokens_BS.data(), batch.labels_BS.data(), batch.loss_mask_BS.data(),
                                      batch.B, batch.S, options));
    double n = 0;
    for (const float m : batch.loss_mask_BS) n += m;
    out.tokens.push_back(n);
  }
  return out;
}

// The "lm loss value" of the validation line " validation loss at <prefix> | ..."; NaN when absent.
double validation_value(const std::string& log, const std::string& prefix) {
  const std::string key = " validation loss at " + prefix + " | lm loss value: ";
  const size_t at = log.find(key);
  return at == std::string::npos ? std::nan("") : std::stod(log.substr(at + key.size()));
}

int count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(TrainLoop, TrainingAndValidationLossesAreTokenWeighted) {
  const test::TempDir dir("train_loop");
  const TrainingArgs args = parse(base_flags(dir, write_corpus(dir)), {"--train-iters", "1"});
  const MicroBatchLosses train = initial_model_losses(args, DatasetSplit::kTrain, 0, 4);
  const MicroBatchLosses valid = initial_model_losses(args, DatasetSplit::kValid, 0, 4);
  // The data must tell the two reductions apart.
  ASSERT_NE(train.tokens[0], train.tokens[1]);
  ASSERT_GT(std::abs(train.token_weighted() - train.mean_of_means()), 1e-5 * train.token_weighted());
  ASSERT_GT(std::abs(valid.token_weighted() - valid.mean_of_means()), 1e-5 * valid.token_weighted());

  std::ostringstream log;
  const TrainResult result = run_training(args, log);
  ASSERT_EQ(result.train_losses.size(), 1u);
  EXPECT_NEAR(result.train_losses[0], train.token_weighted(), 1e-6 * train.token_weighted()) << log.str();
  EXPECT_NEAR(result.first_valid_loss, valid.token_weighted(), 1e-6 * valid.token_weighted());
  // The logged line (6 significant decimals) shows the same value.
  const std::string text = log.str();
  const size_t line = text.find("] iteration        1/       1 |");
  ASSERT_NE(line, std::string::npos) << text;
  const size_t at = text.find(" lm loss: ", line);
  ASSERT_NE(at, std::string::npos) << text;
  EXPECT_NEAR(std::stod(text.substr(at + 10)), train.token_weighted(), 2e-6 * train.token_weighted());
}

TEST(TrainLoop, ValidationsReadMegatronsSamplesAndTheLastLineIsMegatrons) {
  const test::TempDir dir("train_loop");
  const TrainingArgs args = parse(base_flags(dir, write_corpus(dir)), {"--train-iters", "4", "--eval-interval", "2"});
  // Megatron: evaluations at iterations 2 and 4 read validation samples [0, 4) and [4, 8); the one after training
  // [8, 12). moecore's look before training must not shift them.
  const double at_0_4 = initial_model_losses(args, DatasetSplit::kValid, 0, 4).token_weighted();
  const double at_4_8 = initial_model_losses(args, DatasetSplit::kValid, 4, 4).token_weighted();
  const double at_8_12 = initial_model_losses(args, DatasetSplit::kValid, 8, 4).token_weighted();
  ASSERT_GT(std::abs(at_0_4 - at_4_8), 1e-5 * at_0_4);
  std::ostringstream out;
  const TrainResult result = run_training(args, out);
  const std::string log = out.str();
  constexpr double kPrinted = 2e-6;  // "{:.6E}"
  EXPECT_NEAR(validation_value(log, "iteration 0"), at_0_4, kPrinted * at_0_4) << log;
  EXPECT_NEAR(validation_value(log, "iteration 2"), at_0_4, kPrinted * at_0_4) << log;
  EXPECT_NEAR(validation_value(log, "iteration 4"), at_4_8, kPrinted * at_4_8) << log;
  // Megatron's pretrain(): prefix f'iteration {iteration} on validation set' after training.
  EXPECT_NEAR(validation_value(log, "iteration 4 on validation set"), at_8_12, kPrinted * at_8_12) << log;
  EXPECT_EQ(count(log, " validation loss at "), 4) << log;
  EXPECT_EQ(result.progress.consumed_valid_samples, 12);
  EXPECT_EQ(result.progress.consumed_train_samples, 16);
  EXPECT_EQ(result.progress.iteration, 4);
  EXPECT_NEAR(result.last_valid_loss, at_8_12, 1e-6 * at_8_12);
}

TEST(TrainLoop, NoPeriodicEvaluationWithoutEvalInterval) {
  const test::TempDir dir("train_loop");
  const TrainingArgs args = parse(base_flags(dir, write_corpus(dir)), {"--train-iters", "3"});
  ASSERT_FALSE(args.eval_interval.has_value());
  std::ostringstream out;
  const TrainResult result = run_training(args, out);
  const std::string log = out.str();
  EXPECT_EQ(count(log, " validation loss at "), 2) << log;  // moecore's look before training, Megatron's after
  EXPECT_FALSE(std::isnan(validation_value(log, "iteration 3 on validation set"))) << log;
  EXPECT_EQ(result.progress.consumed_valid_samples, 4);
}

TEST(TrainLoop, IterationLinesAfterTheFirstIterationAndEveryInterval) {
  const test::TempDir dir("train_loop");
  const TrainingArgs args =
      parse(base_flags(dir, write_corpus(dir)), {"--train-iters", "5", "--log-interval", "2", "--eval-iters", "0"});
  std::ostringstream out;
  const TrainResult result = run_training(args, out);
  const std::string log = out.str();
  EXPECT_EQ(count(log, "] iteration "), 3) << log;
  for (const int iteration : {1, 2, 4}) {
    EXPECT_EQ(count(log, "] iteration        " + std::to_string(iteration) + "/       5 |"), 1) << log;
  }
  // The first line does not reset the interval: the line at 2 averages iterations 1 and 2 (lr 0: equal losses on
  // other samples, so compare with the two losses directly).
  const double mean_1_2 = (result.train_losses[0] + result.train_losses[1]) / 2.0;
  std::ostringstream expected;
  expected << std::uppercase << std::scientific;
  expected.precision(6);
  expected << mean_1_2;
  const size_t line_2 = log.find("] iteration        2/       5 |");
  ASSERT_NE(line_2, std::string::npos);
  EXPECT_NE(log.find(" lm loss: " + expected.str() + " |", line_2), std::string::npos) << log;
  // Megatron's timestamp: "%Y-%m-%d %H:%M:%S.%f".
  EXPECT_TRUE(std::regex_search(log, std::regex(R"( \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration)"))) << log;
}

TEST(TrainLoop, DefaultMoERunPrintsZeroLoadBalancingLoss) {
  const test::TempDir dir("train_loop");
  const TrainingArgs args =
      parse(base_flags(dir, write_corpus(dir)), {"--train-iters", "1", "--eval-iters", "0", "--num-experts", "4",
                                                 "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16"});
  std::ostringstream out;
  run_training(args, out);
  EXPECT_NE(out.str().find(" load_balancing_loss: 0.000000E+00 |"), std::string::npos) << out.str();
}

}  // namespace
}  // namespace moecore
