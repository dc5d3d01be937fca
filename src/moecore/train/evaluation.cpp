#include "moecore/train/evaluation.h"

#include <cmath>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/pipeline/pipeline_schedule.h"
#include "moecore/train/batch_schedule.h"
#include "moecore/train/log_format.h"
#include "moecore/train/norm_overflow_check.h"
#include "moecore/train/pipeline_executor.h"
#include "moecore/train/trainer.h"

namespace moecore {
namespace {

// Training forwards use streams iteration * micro-batches + g, far below this.
constexpr uint64_t kEvalStreamBase = uint64_t{1} << 40;

std::string format_number(const double value) {
  std::ostringstream out;
  out.precision(4);
  out << value;
  return out.str();
}

}  // namespace

double evaluate(const TrainingArgs& args, GPTModel& model, const GPTDataProvider& data,
                const parallel::ParallelState& parallel, const int64_t first_sample, int64_t& samples_read,
                const std::string_view prefix) {
  const int64_t available = data.num_samples(DatasetSplit::kValid);
  const int64_t num_microbatches = args.global_batch_size / args.micro_batch_size;
  const std::vector<int64_t> mine = local_microbatches(num_microbatches, parallel.dp_size(), parallel.dp_rank());
  const PipelineSchedule schedule =
      make_schedule(parallel.pp_size(), parallel.pp_rank(), model.num_chunks(), static_cast<int>(mine.size()),
                    static_cast<int>(args.microbatch_group_size_per_vp_stage), /*forward_only=*/true);
  TokenWeightedLoss loss;
  int64_t batch_start = first_sample;
  for (int64_t it = 0; it < args.eval_iters; ++it) {
    if (batch_start + args.global_batch_size > available) batch_start = 0;
    PipelineMicrobatches microbatches;
    microbatches.B = args.micro_batch_size;
    microbatches.S = args.model.seq_length;
    microbatches.overlap_p2p_comm = args.pipeline_split.overlap_p2p_comm && model.num_chunks() > 1;
    microbatches.position_ids = args.reset_position_ids;
    microbatches.document_ids = args.reset_attention_mask;
    microbatches.batch = [&](const int m) {
      return data.get_batch(DatasetSplit::kValid, batch_start + mine[static_cast<size_t>(m)] * args.micro_batch_size,
                            args.micro_batch_size);
    };
    // No dropout in evaluation, but the router's input jitter applies (as Megatron): it draws from the run seed and
    // a stream keyed by the validation micro-batch, disjoint from the training streams.
    microbatches.options = [&](const int m) {
      ForwardOptions options;
      options.training = false;
      options.dropout_seed = static_cast<uint64_t>(args.seed);
      options.dropout_stream =
          kEvalStreamBase + static_cast<uint64_t>(batch_start / args.micro_batch_size + mine[static_cast<size_t>(m)]);
      return options;
    };
    const TokenWeightedLoss part = run_pipeline_schedule(schedule, model, nullptr, parallel, microbatches);
    loss.loss_sum += part.loss_sum;
    loss.tokens += part.tokens;
    batch_start += args.global_batch_size;
  }
  samples_read = args.eval_iters * args.global_batch_size;
  const double reduced = reduce_pipeline_loss(loss, parallel);
  if (const std::optional<NormOverflow> overflow = agree_on_norm_overflow(model, parallel.world)) {
    throw TrainingError(
        "validation at " + std::string(prefix) + ": " + describe_norm_overflow(*overflow) +
        ": the norm outputs zeros there, so the validation loss (" + format_number(reduced) +
        ") is meaningless; check the weights (" +
        (args.load.empty() ? "--init-method-std " + format_number(args.model.init_method_std) : "--load " + args.load) +
        ", --lr " + format_number(args.lr) + ")");
  }
  return reduced;
}

double evaluate_and_print(const TrainingArgs& args, GPTModel& model, const GPTDataProvider& data,
                          const parallel::ParallelState& parallel, const std::string_view prefix,
                          int64_t& consumed_valid_samples, std::ostream& log) {
  int64_t samples_read = 0;
  const double loss = evaluate(args, model, data, parallel, consumed_valid_samples, samples_read, prefix);
  consumed_valid_samples += samples_read;
  const std::string line = format_validation_log(prefix, {{"lm loss", loss}});
  const std::string rule = validation_rule(line);
  log << rule << '\n' << line << '\n' << rule << std::endl;
  return loss;
}

std::string validation_prefix_during_training(const int64_t iteration) {
  return "iteration " + std::to_string(iteration);
}

std::string validation_prefix_after_training(const int64_t iteration) {
  return "iteration " + std::to_string(iteration) + " on validation set";
}

double unigram_baseline(const GPTDataProvider& data, const int64_t vocab, const int64_t train_samples,
                        const int64_t valid_samples) {
  std::vector<double> counts(static_cast<size_t>(vocab), 1.0);
  double total = static_cast<double>(vocab);
  const Batch train = data.get_batch(DatasetSplit::kTrain, 0, train_samples);
  for (size_t i = 0; i < train.labels_BS.size(); ++i) {
    const auto id = static_cast<size_t>(train.labels_BS[i]);
    if (id < counts.size()) {
      counts[id] += 1.0;
      total += 1.0;
    }
  }
  const Batch valid = data.get_batch(DatasetSplit::kValid, 0, valid_samples);
  double loss = 0.0, weight = 0.0;
  for (size_t i = 0; i < valid.labels_BS.size(); ++i) {
    const auto id = static_cast<size_t>(valid.labels_BS[i]);
    const double p = id < counts.size() ? counts[id] / total : 1.0 / total;
    loss -= valid.loss_mask_BS[i] * std::log(p);
    weight += valid.loss_mask_BS[i];
  }
  return weight > 0 ? loss / weight : 0.0;
}

}  // namespace moecore
