// Megatron-format log lines (expected strings written from training.py's format specs, non-finite and rounding cases
// checked against Python's own format() output) and the FLOPs count of dense and MoE GPTs (checked against GEMM FLOPs
// summed by hand and against Megatron's formula evaluated by hand).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <ctime>
#include <limits>

#include "moecore/train/log_format.h"
#include "moecore/train/moe_logging.h"
#include "moecore/train/training_log.h"

namespace moecore {
namespace {

IterationLog example_log() {
  IterationLog log;
  log.timestamp = "2026-11-29 17:40:00.250000";
  log.iteration = 10;
  log.train_iters = 100;
  log.consumed_samples = 640;
  log.elapsed_ms_per_iteration = 123.4;
  log.throughput_tflops_per_gpu = 1.2;
  log.learning_rate = 3e-4;
  log.global_batch_size = 64;
  log.losses = {{"lm loss", 6.123456}};
  log.loss_scale = 1.0;
  log.grad_norm = 1.234;
  return log;
}

TEST(LogFormat, IterationLineMatchesMegatron) {
  EXPECT_EQ(
      format_iteration_log(example_log()),
      " [2026-11-29 17:40:00.250000] iteration       10/     100 | consumed samples:          640 | elapsed time per "
      "iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 1.2 | learning rate: 3.000000E-04 | global "
      "batch size:    64 | lm loss: 6.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped "
      "iterations:   0 | number of nan iterations:   0 |");
}

TEST(LogFormat, OptionalFieldsAndWideNumbers) {
  IterationLog log = example_log();
  log.timestamp.clear();
  log.iteration = 123456789;  // wider than the field: printed in full, as Python does
  log.train_iters = 200000000;
  log.consumed_samples = 7;
  log.skipped_samples = 3;
  log.throughput_tflops_per_gpu.reset();
  log.learning_rate.reset();
  log.global_batch_size = 123456;
  log.losses = {{"lm loss", 0.5}, {"load_balancing_loss", 1.0123456789}};
  log.loss_scale = 65536.0;
  log.grad_norm.reset();
  log.num_zeros_in_grad = 42;
  log.params_norm = 12.3456;
  log.skipped_iterations = 1;
  log.nan_iterations = 1234;
  EXPECT_EQ(format_iteration_log(log),
            " iteration 123456789/200000000 | consumed samples:            7 | skipped samples:            3 | "
            "elapsed time per iteration (ms): 123.4 | global batch size: 123456 | lm loss: 5.000000E-01 | "
            "load_balancing_loss: 1.012346E+00 | loss scale: 65536.0 | num zeros: 42 | params norm: 12.346 | "
            "number of skipped iterations:   1 | number of nan iterations: 1234 |");
}

TEST(LogFormat, NonFiniteAndRoundingAsPython) {
  // Python: '{:.6E}'.format(nan) -> 'NAN' (also for -nan), inf -> 'INF'; '{:.3f}'.format(-inf) -> '-inf';
  // '{:.1f}'.format(123.45) -> '123.5' and '{:.1f}'.format(0.05) -> '0.1' (the binary values lie just above).
  IterationLog log = example_log();
  log.timestamp.clear();
  log.losses = {{"lm loss", 2.0}, {"z_loss", HUGE_VAL}};
  log.grad_norm = -HUGE_VAL;
  log.learning_rate = 0.0;
  log.elapsed_ms_per_iteration = 123.45;
  log.throughput_tflops_per_gpu = 0.05;
  const std::string line = format_iteration_log(log);
  EXPECT_NE(line.find(" z_loss: INF |"), std::string::npos) << line;
  EXPECT_NE(line.find(" grad norm: -inf |"), std::string::npos) << line;
  EXPECT_NE(line.find(" learning rate: 0.000000E+00 |"), std::string::npos) << line;
  EXPECT_NE(line.find(" elapsed time per iteration (ms): 123.5 |"), std::string::npos) << line;
  // Below 1 TFLOP/s moecore prints three decimals (Megatron: one), so CPU runs show a figure.
  EXPECT_NE(line.find(" throughput per GPU (TFLOP/s/GPU): 0.050 |"), std::string::npos) << line;
}

TEST(LogFormat, TimeLeftEndsTheLineAsPythonsTimedelta) {
  IterationLog log = example_log();
  EXPECT_EQ(format_iteration_log(log).find("time left"), std::string::npos);
  log.seconds_left = 3723.4;
  const std::string line = format_iteration_log(log);
  const std::string tail = "number of nan iterations:   0 | time left (estimate): 1:02:03 |";
  ASSERT_GE(line.size(), tail.size());
  EXPECT_EQ(line.substr(line.size() - tail.size()), tail) << line;
  // Python: str(timedelta(seconds=5)) '0:00:05', (seconds=86400) '1 day, 0:00:00', (seconds=200000) '2 days, 7:33:20'.
  EXPECT_EQ(timedelta_text(5.0), "0:00:05");
  EXPECT_EQ(timedelta_text(0.4), "0:00:00");
  EXPECT_EQ(timedelta_text(86400.0), "1 day, 0:00:00");
  EXPECT_EQ(timedelta_text(200000.0), "2 days, 7:33:20");
}

TEST(LogFormat, RealTokensOfPackedSequencesFollowTheBatchSize) {
  IterationLog log = example_log();
  EXPECT_EQ(format_iteration_log(log).find("real tokens"), std::string::npos);
  log.real_tokens_per_iteration = 4096;
  const std::string line = format_iteration_log(log);
  EXPECT_NE(line.find(" global batch size:    64 | real tokens per iteration: 4096 | lm loss:"), std::string::npos)
      << line;
}

TEST(LogFormat, LossesBelowZeroOrNaNAreNotPrinted) {
  // Megatron's training_log: `if avg >= 0.0: log_string += ' {}: {:.6E} |'.format(key, avg)`.
  IterationLog log = example_log();
  log.timestamp.clear();
  log.losses = {{"lm loss", -std::numeric_limits<double>::quiet_NaN()},
                {"load_balancing_loss", 0.0},
                {"z_loss", -1e-3},
                {"global_load_balancing_loss", std::numeric_limits<double>::quiet_NaN()}};
  const std::string line = format_iteration_log(log);
  EXPECT_EQ(line.find("lm loss"), std::string::npos) << line;
  EXPECT_EQ(line.find("z_loss"), std::string::npos) << line;
  EXPECT_EQ(line.find("global_load_balancing_loss"), std::string::npos) << line;
  EXPECT_NE(line.find(" global batch size:    64 | load_balancing_loss: 0.000000E+00 | loss scale: 1.0 |"),
            std::string::npos)
      << line;
}

TEST(LogFormat, ValidationLine) {
  // exp(5.123456) = 1.679147E+02 and exp(20) = 4.851652E+08 (Python's math.exp and format).
  const std::string line = format_validation_log(100, {{"lm loss", 5.123456}});
  EXPECT_EQ(line, " validation loss at iteration 100 | lm loss value: 5.123456E+00 | lm loss PPL: 1.679147E+02 | ");
  EXPECT_EQ(validation_rule(line), std::string(line.size() + 1, '-'));
  EXPECT_EQ(format_validation_log("iteration 7 on test set", {{"lm loss", 25.0}}),
            " validation loss at iteration 7 on test set | lm loss value: 2.500000E+01 | lm loss PPL: 4.851652E+08 | ");
}

TEST(LogFormat, TimestampFormat) {
  const char* previous = std::getenv("TZ");
  const std::string saved = previous != nullptr ? previous : "";
  setenv("TZ", "UTC", 1);
  tzset();
  // 1796000000 s after the epoch is 2026-11-30 00:53:20 UTC (Python's datetime.fromtimestamp(..., utc)); Megatron's
  // training_log formats it with '%Y-%m-%d %H:%M:%S.%f': six digits of microseconds, zero-padded.
  const auto at = std::chrono::system_clock::from_time_t(1796000000);
  EXPECT_EQ(format_log_timestamp(at), "2026-11-30 00:53:20.000000");
  EXPECT_EQ(format_log_timestamp(at + std::chrono::microseconds(42)), "2026-11-30 00:53:20.000042");
  EXPECT_EQ(format_log_timestamp(at + std::chrono::microseconds(999999)), "2026-11-30 00:53:20.999999");
  if (previous != nullptr) {
    setenv("TZ", saved.c_str(), 1);
  } else {
    unsetenv("TZ");
  }
  tzset();
}

ModelConfig small_gqa_config() {
  ModelConfig config;
  config.num_layers = 2;
  config.hidden_size = 64;
  config.num_attention_heads = 4;
  config.kv_channels = 16;      // query projection 64
  config.num_query_groups = 2;  // key / value projections 32 each
  config.ffn_hidden_size = 256;
  config.seq_length = 32;
  config.vocab_size = 128;
  return config;
}

// Forward GEMM FLOPs of the model summed by hand, times 3 (forward, weight grad, input grad).
double hand_counted_flops(const ModelConfig& c, const double batch, const double seq, const double fc1_width) {
  const double tokens = batch * seq;
  const double q = static_cast<double>(c.kv_channels * c.num_attention_heads);
  const double kv = static_cast<double>(c.kv_channels * c.num_query_groups);
  const double h = static_cast<double>(c.hidden_size);
  const double ffn = static_cast<double>(c.ffn_hidden_size);
  const double qkv = 2 * tokens * h * (q + 2 * kv);
  const double scores = 2 * batch * (seq * seq / 2) * q;  // causal: half of the s x s score matrix
  const double weighted_values = 2 * batch * (seq * seq / 2) * q;
  const double out_proj = 2 * tokens * q * h;
  const double fc1 = 2 * tokens * h * fc1_width;
  const double fc2 = 2 * tokens * ffn * h;
  const double logits = 2 * tokens * h * static_cast<double>(c.vocab_size);
  const double per_layer = qkv + scores + weighted_values + out_proj + fc1 + fc2;
  return 3 * (static_cast<double>(c.num_layers) * per_layer + logits);
}

TEST(LogFormat, FlopsDenseGelu) {
  const ModelConfig config = small_gqa_config();
  const double flops = num_floating_point_operations(config, 3, 32);
  EXPECT_DOUBLE_EQ(flops, hand_counted_flops(config, 3, 32, 256));
  EXPECT_DOUBLE_EQ(flops, 58982400.0);  // the same sum evaluated by hand: 3 * (2 * 9043968 + 1572864)
}

TEST(LogFormat, FlopsSwigluCountsThreeMlpGemms) {
  ModelConfig config = small_gqa_config();
  config.activation = Activation::kSwiGLU;  // fc1 is 2 * ffn wide
  const double flops = num_floating_point_operations(config, 3, 32);
  EXPECT_DOUBLE_EQ(flops, hand_counted_flops(config, 3, 32, 512));
  EXPECT_DOUBLE_EQ(flops, 77856768.0);
}

// A 4-layer MoE model (first layer dense), SwiGLU, 8 experts of size 48, top-2, a shared expert of size 96.
ModelConfig small_moe_config() {
  ModelConfig config = small_gqa_config();
  config.num_layers = 4;
  config.activation = Activation::kSwiGLU;
  config.moe.num_experts = 8;
  config.moe.ffn_hidden_size = 48;
  config.moe.topk = 2;
  config.moe.shared_expert_intermediate_size = 96;
  config.moe.moe_layer_pattern = {false, true, true, true};
  return config;
}

// Forward GEMM FLOPs of a SwiGLU MoE model summed by hand (each of the T tokens goes through k experts and the shared
// expert in a MoE layer; fc1 is 2 * width wide), times 3 for the backward GEMMs.
double hand_counted_moe_flops(const ModelConfig& c, const double batch, const double seq) {
  const double tokens = batch * seq;
  const double h = static_cast<double>(c.hidden_size);
  const double q = static_cast<double>(c.kv_channels * c.num_attention_heads);
  const double kv = static_cast<double>(c.kv_channels * c.num_query_groups);
  const double attention = 2 * tokens * h * (q + 2 * kv) + 2 * (2 * batch * (seq * seq / 2) * q) + 2 * tokens * q * h;
  const auto swiglu_mlp = [&](const double rows, const double width) {
    return 2 * rows * h * (2 * width) + 2 * rows * width * h;
  };
  const double dense_mlp = swiglu_mlp(tokens, static_cast<double>(c.ffn_hidden_size));
  const double routed_rows = tokens * static_cast<double>(c.moe.topk);
  const double moe_mlp = swiglu_mlp(routed_rows, static_cast<double>(c.moe.ffn_hidden_size)) +
                         swiglu_mlp(tokens, static_cast<double>(c.moe.shared_expert_intermediate_size));
  const double logits = 2 * tokens * h * static_cast<double>(c.vocab_size);
  double forward = logits;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    forward += attention + (c.moe.is_moe_layer(layer) ? moe_mlp : dense_mlp);
  }
  return 3 * forward;
}

TEST(LogFormat, FlopsMoEAsMegatron) {
  const ModelConfig config = small_moe_config();
  const double flops = num_floating_point_operations(config, 3, 32);
  EXPECT_DOUBLE_EQ(flops, hand_counted_moe_flops(config, 3, 32));
  // Megatron's formula by hand, per token (T = 96, F*M = 6, x = 3):
  //   attention 6*(64*128 + 64*32 + 64*64) * 4 layers = 344064
  //   dense MLP 6*64*3*256 * 1 layer = 294912, MoE MLP 6*64*3*(48*2 + 96) * 3 layers = 663552, logits 6*64*128 = 49152
  //   (344064 + 294912 + 663552 + 49152) * 96 = 129761280
  EXPECT_DOUBLE_EQ(flops, 129761280.0);
}

// Megatron's MTP term: each depth adds one layer like the last decoder layer, its norms and eh_proj (3h + 2h^2 per
// token, forward) and the shared output layer once more.
TEST(LogFormat, FlopsMtpCountsTheDepths) {
  ModelConfig config = small_moe_config();
  const double without = num_floating_point_operations(config, 3, 32);
  config.mtp_num_layers = 2;
  const double tokens = 3 * 32, h = static_cast<double>(config.hidden_size);
  ModelConfig one_layer = config;  // the last (MoE) layer alone: attention + MoE MLP + logits
  one_layer.num_layers = 1;
  one_layer.moe.moe_layer_pattern = {true};
  one_layer.mtp_num_layers = 0;
  const double layer_and_logits = hand_counted_moe_flops(one_layer, 3, 32);
  const double projection = 3 * 2 * tokens * (3 * h + 2 * h * h);
  EXPECT_DOUBLE_EQ(num_floating_point_operations(config, 3, 32), without + 2 * (layer_and_logits + projection));
}

TEST(LogFormat, FlopsMoEVariants) {
  ModelConfig config = small_moe_config();
  // The same model with every layer dense (no --num-experts) counts ffn everywhere, whatever the moe fields say.
  config.moe.num_experts = 0;
  EXPECT_DOUBLE_EQ(num_floating_point_operations(config, 3, 32), (344064.0 + 4 * 294912.0 + 49152.0) * 96);
  // GeLU (x = 2), every layer MoE, top-1, no shared expert, the expert size falling back to --ffn-hidden-size:
  // per token 344064 + 6*64*2*256*1 * 4 layers + 49152 = 1179648.
  config = small_moe_config();
  config.activation = Activation::kGelu;
  config.moe.moe_layer_pattern = {true, true, true, true};
  config.moe.topk = 1;
  config.moe.shared_expert_intermediate_size = 0;
  config.moe.ffn_hidden_size = 0;
  EXPECT_DOUBLE_EQ(num_floating_point_operations(config, 3, 32), 1179648.0 * 96);
}

TEST(LogFormat, FlopsOfPackedDocumentsCountAttentionPerDocument) {
  const ModelConfig config = small_moe_config();
  // One document per sequence: the packed form is the plain one.
  EXPECT_DOUBLE_EQ(num_floating_point_operations_packed(config, 96, 3 * 32.0 * 32.0),
                   num_floating_point_operations(config, 3, 32));
  // The 96 tokens as documents of 16, 16 | 8, 8, 16 | 32: sum L^2 = 2*256 + 2*64 + 256 + 1024 = 1920 instead of
  // 3 * 1024. Only the score and value GEMMs change: per layer 3 * 2 * (2 * q * sum L^2 / 2), q = 64, 4 layers.
  const double per_unit_of_squared_sum = 3.0 * 2.0 * 2.0 * 64.0 / 2.0 * 4.0;
  EXPECT_DOUBLE_EQ(num_floating_point_operations_packed(config, 96, 1920.0),
                   num_floating_point_operations(config, 3, 32) - (3072.0 - 1920.0) * per_unit_of_squared_sum);
}

TEST(LogFormat, FlopsNeedVocabulary) {
  ModelConfig config = small_gqa_config();
  config.vocab_size = 0;
  EXPECT_THROW(num_floating_point_operations(config, 1, 32), ConfigError);
}

TEST(LogFormat, Throughput) { EXPECT_DOUBLE_EQ(throughput_tflops_per_gpu(1e15, 0.5, 2), 1000.0); }

TEST(LogFormat, ThroughputIsPerProcessOfTheWorld) {
  // Megatron: num_floating_point_operations(args, batch_size) / (elapsed_time_per_iteration * 10**12 * world_size),
  // with batch_size the global batch: the same run on N processes reports 1/N of the one-process figure.
  EXPECT_DOUBLE_EQ(throughput_tflops_per_gpu(8e12, 2.0, 1), 4.0);
  EXPECT_DOUBLE_EQ(throughput_tflops_per_gpu(8e12, 2.0, 4), 1.0);
}

TEST(TrainingLog, LineAfterFirstIterationAndEveryInterval) {
  // Megatron's training_log: `if iteration % args.log_interval == 0 or is_first_iteration`; nothing at the last
  // iteration unless it is a multiple of the interval.
  EXPECT_TRUE(logs_iteration(1, 10, 1));
  EXPECT_FALSE(logs_iteration(2, 10, 1));
  EXPECT_FALSE(logs_iteration(9, 10, 1));
  EXPECT_TRUE(logs_iteration(10, 10, 1));
  EXPECT_FALSE(logs_iteration(25, 10, 1));
  EXPECT_TRUE(logs_iteration(1, 1, 1));
  EXPECT_TRUE(logs_iteration(2, 1, 1));
}

MoEStats one_layer_stats(const std::vector<double>& per_type, const double z_loss) {
  MoEStats stats;
  stats.num_forwards = 2;  // values are sums over the forwards
  stats.moe_layers = {1};
  stats.load_balancing_losses = {per_type};
  stats.z_losses = {z_loss};
  stats.tokens_per_expert = {{3, 5}};
  return stats;
}

MoEConfig moe_config(const std::vector<LoadBalancingType>& types, const std::vector<double>& coeffs) {
  MoEConfig config;
  config.num_experts = 2;
  config.load_balancing_types = types;
  config.aux_loss_coeffs = coeffs;
  return config;
}

TEST(MoELogging, LoadBalancingLossIsPrintedAsZeroWhenItsCoefficientIsZero) {
  // Megatron's default MoE run (--moe-router-load-balancing-type aux_loss, --moe-aux-loss-coeff 0): training_log
  // tracks "load_balancing_loss" (force_initialize creates it at 0, the router records nothing) and prints 0.
  MoEMetrics metrics(moe_config({LoadBalancingType::kAuxLoss}, {0.0}));
  metrics.add(one_layer_stats({0.0}, 0.0));
  ASSERT_EQ(metrics.losses().size(), 1u);
  EXPECT_EQ(metrics.losses()[0].first, "load_balancing_loss");
  EXPECT_EQ(metrics.losses()[0].second, 0.0);
  IterationLog log = example_log();
  log.losses.push_back(metrics.losses()[0]);
  EXPECT_NE(format_iteration_log(log).find(" lm loss: 6.123456E+00 | load_balancing_loss: 0.000000E+00 |"),
            std::string::npos);
}

TEST(MoELogging, TrackedNamesFollowMegatronsMembershipTest) {
  using T = LoadBalancingType;
  const auto names = [](const MoEConfig& config) {
    std::vector<std::string> out;
    for (const auto& [name, type] : tracked_balancing_losses(config)) out.push_back(name);
    return out;
  };
  using Names = std::vector<std::string>;
  // One type is a string in Megatron: `"aux_loss" in "seq_aux_loss"` is a substring test.
  EXPECT_EQ(names(moe_config({T::kAuxLoss}, {0.01})), Names{"load_balancing_loss"});
  EXPECT_EQ(names(moe_config({T::kSeqAuxLoss}, {0.01})), (Names{"load_balancing_loss", "seq_load_balancing_loss"}));
  EXPECT_EQ(names(moe_config({T::kGlobalAuxLoss}, {0.01})),
            (Names{"load_balancing_loss", "global_load_balancing_loss"}));
  EXPECT_EQ(names(moe_config({T::kSinkhorn}, {0.0})), Names{});
  EXPECT_EQ(names(moe_config({T::kNone}, {0.0})), Names{});
  // Several types are a list: exact membership.
  EXPECT_EQ(names(moe_config({T::kSeqAuxLoss, T::kGlobalAuxLoss}, {0.01, 0.01})),
            (Names{"seq_load_balancing_loss", "global_load_balancing_loss"}));
  EXPECT_EQ(names(moe_config({T::kGlobalAuxLoss, T::kAuxLoss}, {0.01, 0.01})),
            (Names{"load_balancing_loss", "global_load_balancing_loss"}));
}

TEST(MoELogging, ValuesAreAveragedOverForwardsAndPickedByType) {
  // Types listed as [global, aux] with coefficients [0.01, 0]: load_balancing_loss prints 0 (no record), the global
  // loss its mean over the 2 forwards, z_loss its mean when its coefficient is non-zero.
  MoEConfig config = moe_config({LoadBalancingType::kGlobalAuxLoss, LoadBalancingType::kAuxLoss}, {0.01, 0.0});
  config.z_loss_coeff = 1e-3;
  MoEMetrics metrics(config);
  metrics.add(one_layer_stats({3.0, 7.0}, 5.0));
  const NamedValues losses = metrics.losses();
  ASSERT_EQ(losses.size(), 3u);
  EXPECT_EQ(losses[0], (std::pair<std::string, double>{"load_balancing_loss", 0.0}));
  EXPECT_EQ(losses[1], (std::pair<std::string, double>{"global_load_balancing_loss", 1.5}));
  EXPECT_EQ(losses[2], (std::pair<std::string, double>{"z_loss", 2.5}));
}

}  // namespace
}  // namespace moecore
