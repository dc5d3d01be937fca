#include "moecore/train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <memory>
#include <ostream>
#include <span>
#include <sstream>

#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/data/data_loader.h"
#include "moecore/model/gpt_model.h"
#include "moecore/optim/adamw_optimizer.h"
#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/optim/lr_schedule.h"
#include "moecore/parallel/comm_stats.h"
#include "moecore/tensor/memory_tracker.h"
#include "moecore/tokenizer/tokenizer.h"
#include "moecore/train/gather_model.h"
#include "moecore/train/generate.h"
#include "moecore/train/log_format.h"
#include "moecore/train/moe_logging.h"

namespace moecore {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(const Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Current and peak bytes per category, each the maximum over the ranks (collective).
std::string memory_report(const int64_t iteration, const parallel::ParallelState& parallel) {
  const MemoryTracker& mem = MemoryTracker::instance();
  const std::vector<MemCategory> categories{MemCategory::kParams, MemCategory::kGrads, MemCategory::kOptimizer,
                                            MemCategory::kActivations, MemCategory::kOther};
  std::vector<float> mb;  // [current, peak] per category, then the total peak
  for (const MemCategory c : categories) {
    mb.push_back(static_cast<float>(mem.current(c)) / (1024.0f * 1024.0f));
    mb.push_back(static_cast<float>(mem.peak(c)) / (1024.0f * 1024.0f));
  }
  mb.push_back(static_cast<float>(mem.peak_total()) / (1024.0f * 1024.0f));
  parallel.world.all_reduce(std::span<float>(mb), parallel::ReduceOp::kMax);
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  out << "[Rank 0] (after " << iteration << " iterations) memory (MB"
      << (parallel.world.size() > 1 ? ", max over " + std::to_string(parallel.world.size()) + " ranks" : "") << ")";
  for (size_t i = 0; i < categories.size(); ++i) {
    out << " | " << mem_category_name(categories[i]) << ": " << mb[2 * i] << " (peak " << mb[2 * i + 1] << ")";
  }
  out << " | total peak: " << mb.back();
  return out.str();
}

// Seconds per iteration in each communication kind since the last report, the maximum over the ranks, with the
// share of the iteration time (collective).
std::string comm_report(const double seconds_per_iter, const int64_t iterations,
                        const parallel::ParallelState& parallel) {
  constexpr auto kKinds = static_cast<size_t>(parallel::CommKind::kCount);
  std::vector<float> seconds(kKinds);
  for (size_t k = 0; k < kKinds; ++k) {
    seconds[k] = static_cast<float>(parallel::CommStats::instance().seconds(static_cast<parallel::CommKind>(k)));
  }
  parallel.world.all_reduce(std::span<float>(seconds), parallel::ReduceOp::kMax);
  parallel::CommStats::instance().reset();
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << " [comm] per iteration, max over ranks (ms / share of step):";
  for (size_t k = 0; k < kKinds; ++k) {
    const double ms = 1000.0 * seconds[k] / static_cast<double>(iterations);
    out << " " << parallel::comm_kind_name(static_cast<parallel::CommKind>(k)) << " " << ms << " / "
        << (seconds_per_iter > 0 ? 100.0 * ms / (1000.0 * seconds_per_iter) : 0.0) << "% |";
  }
  return out.str();
}

// This rank's MoE statistics turned into the global ones: losses summed over tp-cp (each rank holds its share)
// and averaged over DP, token counts summed over every rank (collective).
void reduce_moe_stats(MoEStats& stats, const parallel::ParallelState& parallel) {
  if (parallel.world.size() == 1 || stats.moe_layers.empty()) return;
  std::vector<float> flat;
  for (size_t l = 0; l < stats.moe_layers.size(); ++l) {
    for (const double v : stats.load_balancing_losses[l]) flat.push_back(static_cast<float>(v));
    flat.push_back(static_cast<float>(stats.z_losses[l]));
    for (const int64_t c : stats.tokens_per_expert[l]) flat.push_back(static_cast<float>(c));
  }
  {
    const parallel::CommTimer timer(parallel::CommKind::kOther);
    parallel.world.all_reduce(std::span<float>(flat), parallel::ReduceOp::kSum);
  }
  const auto dp = static_cast<double>(parallel.dp_size());
  size_t i = 0;
  for (size_t l = 0; l < stats.moe_layers.size(); ++l) {
    for (double& v : stats.load_balancing_losses[l]) v = flat[i++] / dp;
    stats.z_losses[l] = flat[i++] / dp;
    for (int64_t& c : stats.tokens_per_expert[l]) c = static_cast<int64_t>(flat[i++] + 0.5f);
  }
}

// Parameters of the one-process model: every shard's full tensor, every EP rank's experts.
double one_process_parameter_count(const GPTModel& model) {
  double count = 0.0;
  for (const Param& p : model.params()) {
    double n = 1.0;
    for (const int64_t d : p.shard.full_shape) n *= static_cast<double>(d);
    count += p.is_expert ? n * model.parallel().ep_size() : n;
  }
  return count;
}

// Sum of `value` over the data-parallel group (every TP rank of a replica holds the same value).
double dp_sum(const double value, const parallel::ParallelState& parallel) {
  if (parallel.dp_size() == 1) return value;
  const parallel::CommTimer timer(parallel::CommKind::kOther);
  return parallel::sum_double(parallel.dp_cp, value);
}

// Trains on sample indices [consumed, consumed + global batch) of the train split, one micro-batch at a time.
// Data parallelism as Megatron's sampler: global micro-batch g (mbs consecutive samples) goes to DP rank g % dp as
// its micro-batch g / dp; every TP rank of a replica reads the same samples.
struct Loop {
  const TrainingArgs& args;
  GPTModel& model;
  DistributedDataParallel& ddp;
  const GPTDataProvider& data;
  std::ostream& log;
  const parallel::ParallelState& parallel;

  int64_t dp() const { return parallel.dp_size(); }
  int64_t num_microbatches() const { return args.global_batch_size / args.micro_batch_size; }  // all DP ranks
  int64_t local_microbatches() const { return num_microbatches() / dp(); }

  // Mean lm loss over the global batch; gradients of that mean are reduced over DP.
  double train_step(const int64_t iteration, const int64_t consumed) {
    ddp.zero_grad();
    const int64_t n_micro = local_microbatches();
    double loss_sum = 0.0;
    for (int64_t m = 0; m < n_micro; ++m) {
      const int64_t g = m * dp() + parallel.dp_rank();
      const Batch batch =
          data.get_batch(DatasetSplit::kTrain, consumed + g * args.micro_batch_size, args.micro_batch_size);
      ForwardOptions options;
      options.training = true;
      options.dropout_seed = static_cast<uint64_t>(args.seed);
      options.dropout_stream = static_cast<uint64_t>(iteration * num_microbatches() + g);
      std::unique_ptr<MicroBatchContext> ctx;
      const double loss = model.forward(ctx, batch.tokens_BS.data(), batch.labels_BS.data(), batch.loss_mask_BS.data(),
                                        batch.B, batch.S, options);
      ddp.set_last_microbatch(m + 1 == n_micro);
      model.backward(std::move(ctx), 1.0 / static_cast<double>(n_micro));
      loss_sum += loss;
    }
    ddp.finish_grad_sync();
    const double loss = dp_sum(loss_sum, parallel) / static_cast<double>(num_microbatches());
    if (!std::isfinite(loss)) {  // after the reduction, so every rank stops together
      throw TrainingError("lm loss is " + std::string(std::isnan(loss) ? "NaN" : "Inf") + " at iteration " +
                          std::to_string(iteration) + ": stopping; try a lower --lr or a smaller --init-method-std");
    }
    return loss;
  }

  // Megatron's evaluate(): eval_iters global batches of the validation split, continuing where the last
  // evaluation stopped (wrapping around when the split is exhausted).
  double evaluate(int64_t& valid_consumed) {
    const int64_t available = data.num_samples(DatasetSplit::kValid);
    double loss_sum = 0.0;
    int64_t count = 0;
    for (int64_t it = 0; it < args.eval_iters; ++it) {
      for (int64_t g = 0; g < num_microbatches(); ++g) {
        if (valid_consumed + args.micro_batch_size > available) valid_consumed = 0;
        const int64_t first = valid_consumed;
        valid_consumed += args.micro_batch_size;
        ++count;
        if (g % dp() != parallel.dp_rank()) continue;  // another DP rank's micro-batch
        const Batch batch = data.get_batch(DatasetSplit::kValid, first, args.micro_batch_size);
        ForwardOptions options;
        options.training = false;
        std::unique_ptr<MicroBatchContext> unused;
        loss_sum += model.forward(unused, batch.tokens_BS.data(), batch.labels_BS.data(), batch.loss_mask_BS.data(),
                                  batch.B, batch.S, options);
      }
    }
    return dp_sum(loss_sum, parallel) / static_cast<double>(count);
  }

  double evaluate_and_print(const int64_t iteration, int64_t& valid_consumed) {
    const double loss = evaluate(valid_consumed);
    const std::string line = format_validation_log(iteration, {{"lm loss", loss}});
    const std::string rule = validation_rule(line);
    log << rule << '\n' << line << '\n' << rule << std::endl;
    return loss;
  }
};

// Cross-entropy of the validation tokens under the unigram (token frequency) distribution of the training
// samples, add-one smoothed over the real vocabulary: the loss a model without context would reach.
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

}  // namespace

TrainResult run_training(const TrainingArgs& args, std::ostream& log) {
  return run_training(args, log, parallel::ParallelState::single_process());
}

parallel::ParallelState make_parallel_state(const TrainingArgs& args) {
  if (!parallel::launched_by_mpi()) {
    if (args.world_size != 1) throw ConfigError("a layout of several ranks needs mpirun");
    return parallel::ParallelState::single_process();
  }
  return parallel::ParallelState::create(parallel_sizes(args), args.sequence_parallel, parallel::ProcessGroup::world());
}

TrainResult run_training(const TrainingArgs& args, std::ostream& rank0_log, const parallel::ParallelState& parallel,
                         const FullModelCallback& on_full_model) {
  if (args.threads > 0) omp_set_num_threads(static_cast<int>(args.threads));
  if (parallel.world.size() != args.world_size) {
    throw ConfigError("the arguments were parsed for " + std::to_string(args.world_size) + " processes, but " +
                      std::to_string(parallel.world.size()) + " run");
  }
  std::ostringstream discarded;
  std::ostream& log = parallel.rank == 0 ? rank0_log : discarded;
  if (parallel.world.size() > 1) {
    log << "> " << parallel.world.size() << " ranks: TP " << args.tensor_model_parallel_size << ", EP "
        << args.expert_model_parallel_size << ", ETP " << args.expert_tensor_parallel_size << ", DP "
        << parallel.dp_size() << ", expert DP " << parallel.edp.size()
        << (parallel.sequence_parallel && args.tensor_model_parallel_size > 1 ? ", sequence parallel" : "")
        << (args.use_distributed_optimizer ? ", distributed optimizer" : "") << std::endl;
  }

  // Tokenizer and vocabulary.
  std::unique_ptr<Tokenizer> tokenizer;
  TrainingArgs run_args = args;
  int32_t eod_id = 0;
  int64_t unpadded_vocab = 0;
  if (!args.tokenizer_type.empty()) {
    TokenizerOptions tok_options;
    tok_options.type = args.tokenizer_type;
    tok_options.vocab_file = args.vocab_file;
    tok_options.merge_file = args.merge_file;
    tok_options.vocab_size = args.vocab_size.value_or(-1);
    tokenizer = build_tokenizer(tok_options);
    unpadded_vocab = tokenizer->vocab_size();
    eod_id = tokenizer->eod();
  } else if (args.vocab_size) {
    unpadded_vocab = *args.vocab_size;
    eod_id = static_cast<int32_t>(unpadded_vocab - 1);
  } else {
    throw ConfigError("the vocabulary is unknown: give --tokenizer-type (with its files) or --vocab-size");
  }
  run_args.model.vocab_size = padded_vocab_size(unpadded_vocab, args);
  run_args.model.validate();
  log << "> padded vocab (size: " << unpadded_vocab << ") with " << run_args.model.vocab_size - unpadded_vocab
      << " dummy tokens (new size: " << run_args.model.vocab_size << ")" << std::endl;

  // Data: Megatron's sample counts per split.
  const int64_t gbs = args.global_batch_size;
  const int64_t train_samples = args.train_iters * gbs;
  const int64_t eval_runs = args.eval_interval > 0 ? args.train_iters / args.eval_interval + 1 : 1;
  const int64_t valid_samples = args.eval_iters > 0 ? eval_runs * args.eval_iters * gbs : 0;
  const int64_t test_samples = args.eval_iters * gbs;
  DataOptions data_options;
  data_options.data_path = args.data_path;
  data_options.mock_data = args.mock_data;
  if (!args.split.empty()) data_options.split = args.split;
  data_options.seq_length = args.model.seq_length;
  data_options.seed = static_cast<uint64_t>(args.seed);
  data_options.data_cache_path = args.data_cache_path;
  data_options.eod_mask_loss = args.eod_mask_loss;
  data_options.eod_id = eod_id;
  data_options.vocab_size = run_args.model.vocab_size;
  const auto data_start = Clock::now();
  const GPTDataProvider data = GPTDataProvider::build(data_options, train_samples, valid_samples, test_samples);
  log << "> built datasets in " << std::fixed << std::setprecision(2) << seconds_since(data_start) << " s: train "
      << data.num_samples(DatasetSplit::kTrain) << " samples, valid " << data.num_samples(DatasetSplit::kValid)
      << " samples" << std::endl;
  log.unsetf(std::ios::floatfield);

  GPTModel model(run_args.model, static_cast<uint64_t>(args.seed), parallel);
  const double total_parameters = one_process_parameter_count(model);
  log << "> number of parameters: " << static_cast<int64_t>(total_parameters) << " (" << std::setprecision(2)
      << std::fixed << total_parameters / 1e6 << "M)" << std::endl;
  log.unsetf(std::ios::floatfield);
  log << std::setprecision(6);
  AdamWOptions adam;
  adam.beta1 = args.adam_beta1;
  adam.beta2 = args.adam_beta2;
  adam.eps = args.adam_eps;
  adam.weight_decay = args.weight_decay;
  DdpOptions ddp_options;
  ddp_options.bucket_size = args.ddp_bucket_size;
  ddp_options.overlap_grad_reduce = args.overlap_grad_reduce;
  ddp_options.use_distributed_optimizer = args.use_distributed_optimizer;
  ddp_options.overlap_param_gather = args.overlap_param_gather;
  DistributedDataParallel ddp(model.params(), parallel, ddp_options);
  model.set_hooks(&ddp);
  DistributedAdamW optimizer(ddp, model.params(), adam);
  const LRSchedule schedule(lr_schedule_config(run_args));
  const double flops_per_iteration = num_floating_point_operations(run_args.model, gbs, run_args.model.seq_length);

  Loop loop{run_args, model, ddp, data, log, parallel};
  TrainResult result;
  const bool has_valid = data.has_split(DatasetSplit::kValid) && args.eval_iters > 0;
  int64_t valid_consumed = 0;
  if (has_valid && !args.mock_data && parallel.rank == 0) {
    // The whole train split (capped): the frequencies the baseline would know at best.
    const int64_t n_train = std::min<int64_t>(data.num_samples(DatasetSplit::kTrain), 20000);
    const int64_t n_valid = std::min<int64_t>(data.num_samples(DatasetSplit::kValid), args.eval_iters * gbs);
    result.unigram_baseline = unigram_baseline(data, unpadded_vocab, n_train, n_valid);
    log << "> unigram baseline: validation cross-entropy " << std::fixed << std::setprecision(4)
        << result.unigram_baseline << " under the token frequencies of " << n_train << " training samples" << std::endl;
    log.unsetf(std::ios::floatfield);
  }
  if (has_valid) {
    log << "> validation before training" << std::endl;
    result.first_valid_loss = loop.evaluate_and_print(0, valid_consumed);
  }

  log << "> training ..." << std::endl;
  parallel::CommStats::instance().reset();  // communication of the training iterations only
  int64_t consumed = 0;
  double interval_loss = 0.0;
  int64_t interval_iters = 0;
  double train_seconds = 0.0;
  auto interval_start = Clock::now();
  MoEMetrics moe_metrics(run_args.model.moe);
  double last_grad_norm = 0.0;
  for (int64_t iteration = 1; iteration <= args.train_iters; ++iteration) {
    const auto step_start = Clock::now();
    const double loss = loop.train_step(iteration, consumed);
    last_grad_norm = optimizer.clip_grad_norm(args.clip_grad);
    if (!std::isfinite(last_grad_norm)) {
      throw TrainingError("grad norm is not finite at iteration " + std::to_string(iteration) + ": stopping");
    }
    optimizer.step(schedule.lr_at(iteration - 1));
    model.finish_global_batch();
    MoEStats moe_stats = model.take_moe_stats();
    reduce_moe_stats(moe_stats, parallel);
    moe_metrics.add(moe_stats);
    consumed += gbs;
    train_seconds += seconds_since(step_start);
    result.train_losses.push_back(loss);
    if (iteration == 1) result.first_train_loss = loss;
    result.last_train_loss = loss;
    interval_loss += loss;
    ++interval_iters;

    if (iteration % args.log_interval == 0 || iteration == args.train_iters) {
      const double seconds_per_iter = seconds_since(interval_start) / static_cast<double>(interval_iters);
      IterationLog entry;
      entry.timestamp = format_log_timestamp(std::chrono::system_clock::now());
      entry.iteration = iteration;
      entry.train_iters = args.train_iters;
      entry.consumed_samples = consumed;
      entry.elapsed_ms_per_iteration = seconds_per_iter * 1000.0;
      if (args.log_throughput) {  // as Megatron: the TFLOP/s field only with --log-throughput
        entry.throughput_tflops_per_gpu = throughput_tflops_per_gpu(flops_per_iteration, seconds_per_iter, 1);
      }
      entry.learning_rate = schedule.lr_at(iteration);
      entry.global_batch_size = gbs;
      entry.losses = {{"lm loss", interval_loss / static_cast<double>(interval_iters)}};
      for (const auto& named : moe_metrics.losses()) entry.losses.push_back(named);
      entry.grad_norm = last_grad_norm;
      log << format_iteration_log(entry) << std::endl;
      for (const std::string& line : moe_metrics.usage_lines()) log << line << '\n';
      moe_metrics.reset();
      if (parallel.world.size() > 1) log << comm_report(seconds_per_iter, interval_iters, parallel) << std::endl;
      if (iteration == args.log_interval || (iteration == args.train_iters && iteration < args.log_interval)) {
        const std::string report = memory_report(iteration, parallel);
        log << report << std::endl;
      }
      interval_loss = 0.0;
      interval_iters = 0;
      interval_start = Clock::now();
    }
    if (has_valid && args.eval_interval > 0 && iteration % args.eval_interval == 0 && iteration != args.train_iters) {
      const auto eval_start = Clock::now();
      result.last_valid_loss = loop.evaluate_and_print(iteration, valid_consumed);
      interval_start += Clock::now() - eval_start;  // evaluation time is not training time
    }
  }
  result.tokens_per_second =
      static_cast<double>(args.train_iters * gbs * run_args.model.seq_length) / std::max(train_seconds, 1e-9);
  if (has_valid) {
    log << "> validation after training" << std::endl;
    result.last_valid_loss = loop.evaluate_and_print(args.train_iters, valid_consumed);
  }
  log << "> training throughput: " << std::fixed << std::setprecision(1) << result.tokens_per_second
      << " tokens/s over " << args.train_iters << " iterations" << std::endl;
  log.unsetf(std::ios::floatfield);

  ddp.wait_param_gather();
  std::unique_ptr<GPTModel> gathered;
  if (parallel.world.size() > 1) gathered = gather_full_model(model, static_cast<uint64_t>(args.seed));
  if (parallel.rank != 0) return result;
  GPTModel& full_model = gathered ? *gathered : model;
  if (on_full_model) on_full_model(full_model);
  if (!args.export_hf_dir.empty()) {
    HfExportInfo info;
    info.bos_token_id = eod_id;
    info.eos_token_id = eod_id;
    if (args.tokenizer_type == "GPT2BPETokenizer") {
      info.gpt2_vocab_file = args.vocab_file;
      info.gpt2_merge_file = args.merge_file;
    }
    export_hf(full_model, info, args.export_hf_dir);
    log << "> exported HuggingFace checkpoint to " << args.export_hf_dir << std::endl;
  }
  if (!args.sample_prompt.empty()) {
    if (!tokenizer) throw ConfigError("--sample-prompt needs a text tokenizer (--tokenizer-type)");
    SamplingOptions sampling;
    sampling.max_new_tokens = args.sample_tokens;
    sampling.vocab_limit = unpadded_vocab;
    const std::vector<int32_t> prompt = tokenizer->tokenize(args.sample_prompt);
    const std::vector<int32_t> out = generate(full_model, prompt, sampling);
    log << "> sample (greedy): " << tokenizer->detokenize(out) << std::endl;
  }
  return result;
}

}  // namespace moecore
