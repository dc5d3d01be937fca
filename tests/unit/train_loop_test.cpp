// The training loop against Megatron's train() / evaluate(): the lm loss is token-weighted over the global batch
// (checked with --eod-mask-loss on micro-batches with different numbers of masked tokens, against the model's own
// per-micro-batch losses), validations read the samples Megatron's would whatever moecore evaluates before
// training, the final validation line is Megatron's, there is no periodic evaluation without --eval-interval, and
// iteration lines appear after iteration 1 and every --log-interval. --lr 0 keeps the model at its initial values,
// so every expected loss is computed from a freshly built model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/data/indexed_dataset.h"
#include "moecore/train/trainer.h"
#include "moecore/train/training_setup.h"
#include "test_temp_dir.h"
#include "unit/test_recipe.h"

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
  return test::recipe_flags("tiny-one-layer", {"--attention-dropout",
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
                                               "1"});
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

// A small MoE run with the distributed optimizer and every auxiliary loss, learning for real.
std::vector<std::string> loss_scale_run(const int train_iters) {
  return {"--train-iters",
          std::to_string(train_iters),
          "--lr-decay-iters",
          "10",
          "--lr",
          "1e-2",
          "--min-lr",
          "1e-3",
          "--eval-iters",
          "1",
          "--eval-interval",
          std::to_string(train_iters),
          "--use-distributed-optimizer",
          "--num-experts",
          "4",
          "--moe-router-topk",
          "2",
          "--moe-ffn-hidden-size",
          "16",
          "--moe-aux-loss-coeff",
          "0.01",
          "--moe-z-loss-coeff",
          "0.001"};
}

TEST(TrainLoop, PowerOfTwoLossScaleTrainsBitIdentically) {
  // Scaling the backward seed by 2^10 and the gradients back by 2^-10 is exact in binary floating point, so every
  // gradient (lm loss, aux and z losses alike) must come out bit for bit the same: a term left unscaled would not.
  const test::TempDir dir("train_loop");
  const std::string prefix = write_corpus(dir);
  std::ostringstream plain_log, scaled_log;
  const TrainResult plain = run_training(parse(base_flags(dir, prefix), loss_scale_run(4)), plain_log);
  std::vector<std::string> scaled_flags = loss_scale_run(4);
  scaled_flags.insert(scaled_flags.end(), {"--loss-scale", "1024"});
  const TrainResult scaled = run_training(parse(base_flags(dir, prefix), scaled_flags), scaled_log);
  ASSERT_EQ(plain.train_losses.size(), 4u);
  EXPECT_EQ(scaled.train_losses, plain.train_losses) << scaled_log.str();
  EXPECT_EQ(scaled.last_valid_loss, plain.last_valid_loss);
  EXPECT_NE(plain.last_valid_loss, plain.first_valid_loss);  // it did learn
  EXPECT_NE(scaled_log.str().find(" loss scale: 1024.0 |"), std::string::npos) << scaled_log.str();
}

TEST(TrainLoop, NonFiniteGradientsSkipTheIterationUnderDynamicLossScaling) {
  // Iteration 2's gradients overflow: with fp16's dynamic loss scaler it is skipped as Megatron skips it (no update,
  // the LR schedule stays, "number of skipped iterations" counts it, no grad norm, the lm loss averages the advanced
  // iterations), and the run continues; without loss scaling, or with a constant --loss-scale (Megatron keeps
  // check_for_nan_in_loss_and_grad there), training stops naming the iteration.
  const test::TempDir dir("train_loop");
  const std::string prefix = write_corpus(dir);
  const std::vector<std::string> dynamic = {"--fp16", "--initial-loss-scale", "1024"};
  ASSERT_EQ(setenv("MOECORE_INJECT_GRAD_OVERFLOW_AT", "2", 1), 0);
  std::vector<std::string> flags = loss_scale_run(3);
  flags.insert(flags.end(), dynamic.begin(), dynamic.end());
  flags.insert(flags.end(), {"--log-interval", "1", "--lr-warmup-iters", "2"});
  std::ostringstream out;
  const TrainResult skipped = run_training(parse(base_flags(dir, prefix), flags), out);
  const std::string log = out.str();
  EXPECT_EQ(skipped.progress.iteration, 3);
  const auto line = [&](const int iteration) {
    const size_t at = log.find("] iteration        " + std::to_string(iteration) + "/       3 |");
    return at == std::string::npos ? std::string() : log.substr(at, log.find('\n', at) - at);
  };
  EXPECT_NE(line(1).find(" number of skipped iterations:   0 |"), std::string::npos) << log;
  EXPECT_NE(line(2).find(" number of skipped iterations:   1 |"), std::string::npos) << log;
  EXPECT_EQ(line(2).find(" grad norm: "), std::string::npos) << log;
  // The first line does not reset the interval, so line 2 averages the one advanced iteration, 1.
  const auto lm_loss = [&](const int iteration) {
    const std::string text = line(iteration);
    const size_t at = text.find(" lm loss: ");
    return at == std::string::npos ? std::string() : text.substr(at, text.find('|', at) - at);
  };
  EXPECT_FALSE(lm_loss(1).empty()) << log;
  EXPECT_EQ(lm_loss(2), lm_loss(1)) << log;
  EXPECT_NE(line(3).find(" number of skipped iterations:   0 |"), std::string::npos) << log;
  EXPECT_NE(line(3).find(" grad norm: "), std::string::npos) << log;
  // Warmup over 2 steps: 1e-2 * 1/2 after iteration 1; the skipped iteration 2 leaves the schedule there; the
  // update of iteration 3 is the second step (lr 1e-2 after it).
  EXPECT_NE(line(1).find(" learning rate: 5.000000E-03 |"), std::string::npos) << log;
  EXPECT_NE(line(2).find(" learning rate: 5.000000E-03 |"), std::string::npos) << log;
  EXPECT_NE(line(3).find(" learning rate: 1.000000E-02 |"), std::string::npos) << log;

  // Skipping made no update: a run of 2 iterations with iteration 2 skipped ends where a 1-iteration run ends.
  std::vector<std::string> two = loss_scale_run(2);
  two.insert(two.end(), dynamic.begin(), dynamic.end());
  two.insert(two.end(), {"--lr-warmup-iters", "2"});
  std::ostringstream unused;
  const TrainResult two_with_skip = run_training(parse(base_flags(dir, prefix), two), unused);
  ASSERT_EQ(unsetenv("MOECORE_INJECT_GRAD_OVERFLOW_AT"), 0);
  std::vector<std::string> one = loss_scale_run(1);
  one.insert(one.end(), dynamic.begin(), dynamic.end());
  one.insert(one.end(), {"--lr-warmup-iters", "2", "--eval-interval", "1"});
  const TrainResult one_iteration = run_training(parse(base_flags(dir, prefix), one), unused);
  EXPECT_EQ(two_with_skip.last_valid_loss, one_iteration.last_valid_loss);

  // Without loss scaling, or with a constant loss scale, an Inf gradient stops the run.
  ASSERT_EQ(setenv("MOECORE_INJECT_GRAD_OVERFLOW_AT", "2", 1), 0);
  for (const std::vector<std::string>& scaling :
       {std::vector<std::string>{}, std::vector<std::string>{"--loss-scale", "1"},
        std::vector<std::string>{"--fp16", "--loss-scale", "1024"}}) {
    std::vector<std::string> stopping = loss_scale_run(3);
    stopping.insert(stopping.end(), scaling.begin(), scaling.end());
    try {
      run_training(parse(base_flags(dir, prefix), stopping), unused);
      ADD_FAILURE() << "an Inf gradient must stop training with " << testing::PrintToString(scaling);
    } catch (const TrainingError& e) {
      EXPECT_NE(std::string(e.what()).find("grad norm is not finite at iteration 2"), std::string::npos) << e.what();
    }
  }
  ASSERT_EQ(unsetenv("MOECORE_INJECT_GRAD_OVERFLOW_AT"), 0);
}

TEST(TrainLoop, Bf16KeepsBf16WeightsFp32MainParamsAndResumesExactly) {
  // --bf16: after training every weight is a bf16 value while the optimizer's fp32 main parameters carry the bits
  // below (so the update is not lost to rounding); a run resumed from a checkpoint at iteration 2 continues exactly
  // as the run that did not stop (the checkpoint holds the main parameters, not only the rounded weights).
  const test::TempDir dir("train_loop");
  const std::string prefix = write_corpus(dir);
  std::vector<std::string> flags = loss_scale_run(4);
  flags.push_back("--bf16");
  std::ostringstream straight_log;
  const TrainingArgs args = parse(base_flags(dir, prefix), flags);
  const TrainResult straight = run_training(args, straight_log);
  std::vector<std::string> first_half = flags;
  first_half.insert(first_half.end(), {"--save", dir.path("ckpt"), "--save-interval", "2", "--exit-interval", "2"});
  std::ostringstream unused;
  run_training(parse(base_flags(dir, prefix), first_half), unused);
  std::vector<std::string> second_half = flags;
  second_half.insert(second_half.end(), {"--load", dir.path("ckpt")});
  std::ostringstream resumed_log;
  const TrainResult resumed = run_training(parse(base_flags(dir, prefix), second_half), resumed_log);
  ASSERT_EQ(resumed.train_losses.size(), 2u) << resumed_log.str();
  EXPECT_EQ(resumed.train_losses[0], straight.train_losses[2]);
  EXPECT_EQ(resumed.train_losses[1], straight.train_losses[3]);
  EXPECT_EQ(resumed.last_valid_loss, straight.last_valid_loss);

  // The weights and main parameters of a bf16 model after training.
  const Vocabulary vocabulary = build_vocabulary(args);
  const TrainingArgs run_args = with_padded_vocabulary(args, vocabulary);
  ModelAndOptimizer built = build_model_and_optimizer(run_args, parallel::ParallelState::single_process());
  built.optimizer->step(1e-2);  // zero gradients, but weight decay moves every decayed weight by a sub-bf16 amount
  int64_t weights = 0, main_below_bf16 = 0;
  for (const AdamWMomentSlice& slice : built.optimizer->moment_slices()) {
    ASSERT_TRUE(slice.main_param.defined());
    const Param& p = built.model->params()[static_cast<size_t>(slice.param)];
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      const float w = p.value.data<float>()[i], main = slice.main_param.data<float>()[i];
      ASSERT_EQ(w, bf16_to_fp32(fp32_to_bf16(w))) << p.name;
      ASSERT_EQ(w, bf16_to_fp32(fp32_to_bf16(main))) << p.name;
      main_below_bf16 += main != w ? 1 : 0;
      ++weights;
    }
  }
  EXPECT_GT(main_below_bf16, weights / 4);
}

TEST(TrainLoop, Fp16DynamicLossScalingSkipsAnOverflowAsMegatron) {
  // --fp16 with the dynamic scaler (initial scale 2^16, hysteresis 2, window 2): the overflow injected at iteration 2
  // is skipped with the scale unchanged (hysteresis 2 -> 1); iterations 3 and 4 are finite, so after the second of
  // them the scale doubles. A non-finite loss alone would not stop the run (Megatron turns the NaN check off).
  const test::TempDir dir("train_loop");
  const std::string prefix = write_corpus(dir);
  ASSERT_EQ(setenv("MOECORE_INJECT_GRAD_OVERFLOW_AT", "2", 1), 0);
  std::vector<std::string> flags = loss_scale_run(4);
  flags.insert(flags.end(), {"--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "2", "--log-interval",
                             "1", "--use-distributed-optimizer"});
  std::ostringstream out;
  const TrainResult result = run_training(parse(base_flags(dir, prefix), flags), out);
  ASSERT_EQ(unsetenv("MOECORE_INJECT_GRAD_OVERFLOW_AT"), 0);
  const std::string log = out.str();
  const auto line = [&](const int iteration) {
    const size_t at = log.find("] iteration        " + std::to_string(iteration) + "/       4 |");
    return at == std::string::npos ? std::string() : log.substr(at, log.find('\n', at) - at);
  };
  EXPECT_NE(line(1).find(" loss scale: 65536.0 |"), std::string::npos) << log;
  EXPECT_NE(line(2).find(" loss scale: 65536.0 |"), std::string::npos) << log;
  EXPECT_NE(line(2).find(" number of skipped iterations:   1 |"), std::string::npos) << log;
  EXPECT_NE(line(3).find(" loss scale: 65536.0 |"), std::string::npos) << log;
  EXPECT_NE(line(4).find(" loss scale: 131072.0 |"), std::string::npos) << log;
  for (const double loss : result.train_losses) EXPECT_TRUE(std::isfinite(loss));
  EXPECT_LT(result.last_valid_loss, result.first_valid_loss);
}

}  // namespace
}  // namespace moecore
