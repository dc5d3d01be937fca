#include "moecore/train/training_log.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/parallel/comm_stats.h"
#include "moecore/tensor/memory_tracker.h"

namespace moecore {
namespace {

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
  const auto at_peak = mem.activations_at_peak();
  for (const int64_t bytes : at_peak) mb.push_back(static_cast<float>(bytes) / (1024.0f * 1024.0f));
  parallel.world.all_reduce(std::span<float>(mb), parallel::ReduceOp::kMax);
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  out << "[Rank 0] (after " << iteration << " iterations) memory (MB"
      << (parallel.world.size() > 1 ? ", max over " + std::to_string(parallel.world.size()) + " ranks" : "") << ")";
  for (size_t i = 0; i < categories.size(); ++i) {
    out << " | " << mem_category_name(categories[i]) << ": " << mb[2 * i] << " (peak " << mb[2 * i + 1] << ")";
  }
  const size_t total_peak = 2 * categories.size();
  out << " | total peak: " << mb[total_peak];
  // What the activations held at their peak, by the model part that allocated them.
  out << "\n[Rank 0] activations at their peak by model part (MB):";
  for (size_t o = 0; o < at_peak.size(); ++o) {
    out << (o == 0 ? " " : " | ") << activation_owner_name(static_cast<ActivationOwner>(o)) << ": "
        << mb[total_peak + 1 + o];
  }
  return out.str();
}

// Seconds per iteration in each communication kind over `iterations`, the maximum over the ranks, with the share of
// the iteration time (collective).
std::string comm_report(const double seconds_per_iter, const int64_t iterations,
                        const parallel::ParallelState& parallel) {
  constexpr auto kKinds = static_cast<size_t>(parallel::CommKind::kCount);
  // And the all-to-all's inter-host megabytes, towards the experts and back.
  std::vector<float> seconds(kKinds), megabytes(kKinds + 2);
  for (size_t k = 0; k < kKinds; ++k) {
    const auto kind = static_cast<parallel::CommKind>(k);
    seconds[k] = static_cast<float>(parallel::CommStats::instance().seconds(kind));
    megabytes[k] = static_cast<float>(parallel::CommStats::instance().bytes(kind) / 1e6);
  }
  megabytes[kKinds] = static_cast<float>(parallel::CommStats::instance().inter_host_bytes(true) / 1e6);
  megabytes[kKinds + 1] = static_cast<float>(parallel::CommStats::instance().inter_host_bytes(false) / 1e6);
  parallel.world.all_reduce(std::span<float>(seconds), parallel::ReduceOp::kMax);
  parallel.world.all_reduce(std::span<float>(megabytes), parallel::ReduceOp::kMax);
  std::ostringstream out;
  out << std::fixed << std::setprecision(1)
      << " [comm] per iteration, max over ranks (ms / share of step [/ MB sent]):";
  for (size_t k = 0; k < kKinds; ++k) {
    const double ms = 1000.0 * seconds[k] / static_cast<double>(iterations);
    out << " " << parallel::comm_kind_name(static_cast<parallel::CommKind>(k)) << " " << ms << " / "
        << (seconds_per_iter > 0 ? 100.0 * ms / (1000.0 * seconds_per_iter) : 0.0) << "%";
    if (megabytes[k] > 0.0f) {
      out << std::defaultfloat << std::setprecision(4) << " / " << megabytes[k] / static_cast<double>(iterations)
          << " MB" << std::fixed << std::setprecision(1);
    }
    out << " |";
  }
  if (megabytes[kKinds] > 0.0f || megabytes[kKinds + 1] > 0.0f) {
    out << " all-to-all inter-host MB to experts " << std::defaultfloat << std::setprecision(4)
        << megabytes[kKinds] / static_cast<double>(iterations) << " / back "
        << megabytes[kKinds + 1] / static_cast<double>(iterations) << " |";
  }
  return out.str();
}

}  // namespace

bool logs_iteration(const int64_t iteration, const int64_t log_interval, const int64_t first_iteration) {
  return iteration % log_interval == 0 || iteration == first_iteration;
}

void reduce_moe_stats(MoEStats& stats, const ModelConfig& model, const parallel::ParallelState& parallel) {
  const MoEConfig& config = model.moe;
  if (parallel.world.size() == 1 || !config.enabled()) return;
  // Every MoE layer of the model in layer order, zero where this rank does not hold the layer: the sum over the
  // world is Megatron's sum over PP (each layer lives on one stage), then over tp-dp-cp.
  std::vector<int64_t> layers;
  for (int64_t l = 0; l < static_cast<int64_t>(config.moe_layer_pattern.size()); ++l) {
    if (config.is_moe_layer(l)) layers.push_back(l);
  }
  if (config.is_moe_layer(model.num_layers - 1)) {
    for (int64_t k = 0; k < model.mtp_num_layers; ++k) layers.push_back(model.num_layers + k);
  }
  const size_t types = config.load_balancing_types.size();
  const auto E = static_cast<size_t>(config.num_experts);
  const size_t per_layer = types + 1 + E;
  std::vector<float> flat(layers.size() * per_layer, 0.0f);
  for (size_t l = 0; l < stats.moe_layers.size(); ++l) {
    const auto at = static_cast<size_t>(std::find(layers.begin(), layers.end(), stats.moe_layers[l]) - layers.begin());
    float* slot = flat.data() + at * per_layer;
    for (size_t j = 0; j < types && j < stats.load_balancing_losses[l].size(); ++j) {
      slot[j] = static_cast<float>(stats.load_balancing_losses[l][j]);
    }
    slot[types] = static_cast<float>(stats.z_losses[l]);
    for (size_t e = 0; e < E && e < stats.tokens_per_expert[l].size(); ++e) {
      slot[types + 1 + e] = static_cast<float>(stats.tokens_per_expert[l][e]);
    }
  }
  {
    const parallel::CommTimer timer(parallel::CommKind::kOther);
    parallel.world.all_reduce(std::span<float>(flat), parallel::ReduceOp::kSum);
  }
  const auto dp = static_cast<double>(parallel.dp_size());
  MoEStats out;
  out.num_forwards = stats.num_forwards;  // this rank's micro-batches, the same count on every rank
  out.moe_layers = layers;
  for (size_t l = 0; l < layers.size(); ++l) {
    const float* slot = flat.data() + l * per_layer;
    std::vector<double> losses(types);
    for (size_t j = 0; j < types; ++j) {
      const bool dp_average = config.load_balancing_types[j] != LoadBalancingType::kGlobalAuxLoss;
      losses[j] = slot[j] / (dp_average ? dp : 1.0);
    }
    out.load_balancing_losses.push_back(std::move(losses));
    out.z_losses.push_back(slot[types] / dp);
    std::vector<int64_t> counts(E);
    for (size_t e = 0; e < E; ++e) counts[e] = static_cast<int64_t>(slot[types + 1 + e] + 0.5f);
    out.tokens_per_expert.push_back(std::move(counts));
  }
  stats = std::move(out);
}

TrainingLogger::TrainingLogger(const TrainingArgs& run_args, const LRSchedule& schedule,
                               const parallel::ParallelState& parallel, std::ostream& log)
    : args_(run_args),
      parallel_(parallel),
      log_(log),
      schedule_(schedule),
      flops_per_iteration_(
          num_floating_point_operations(run_args.model, run_args.global_batch_size, run_args.model.seq_length)),
      moe_metrics_(run_args.model.moe),
      iteration_moe_metrics_(run_args.model.moe),
      tensorboard_(run_args, parallel),
      collapse_alarm_(CollapseThresholds{.min_load_ratio = run_args.moe_collapse_min_load_ratio,
                                         .max_load_ratio = run_args.moe_collapse_max_load_ratio,
                                         .intervals = run_args.moe_collapse_intervals}) {}

double TrainingLogger::throughput_per_gpu(const double seconds_per_iteration) const {
  return throughput_per_gpu(flops_per_iteration_, seconds_per_iteration);
}

double TrainingLogger::throughput_per_gpu(const double flops_per_iteration, const double seconds_per_iteration) const {
  return throughput_tflops_per_gpu(flops_per_iteration, seconds_per_iteration, parallel_.world.size());
}

double TrainingLogger::flops_of(const StepResult& step) const {
  if (!step.seqlen_stats) return flops_per_iteration_;
  return num_floating_point_operations_packed(args_.model, static_cast<double>(step.seqlen_stats->tokens),
                                              static_cast<double>(step.seqlen_stats->squared_sum));
}

IterationLog TrainingLogger::iteration_log(const TrainingProgress& progress, const double seconds_per_iteration,
                                           const double lm_loss, const NamedValues& moe_losses, const double grad_norm,
                                           std::string timestamp) const {
  IterationLog entry;
  entry.timestamp = std::move(timestamp);
  entry.iteration = progress.iteration;
  entry.train_iters = args_.train_iters;
  entry.consumed_samples = progress.consumed_train_samples;
  entry.elapsed_ms_per_iteration = seconds_per_iteration * 1000.0;
  if (args_.log_throughput) entry.throughput_tflops_per_gpu = throughput_per_gpu(seconds_per_iteration);
  entry.learning_rate = schedule_.lr();
  entry.global_batch_size = args_.global_batch_size;
  entry.losses = {{"lm loss", lm_loss}};
  for (const auto& named : moe_losses) entry.losses.push_back(named);
  entry.grad_norm = grad_norm;
  return entry;
}

bool TrainingLogger::reports(const int64_t iteration) const {
  return logs_iteration(iteration, args_.log_interval, first_iteration_) ||
         (!args_.tensorboard_dir.empty() && iteration % args_.tensorboard_log_interval == 0);
}

void TrainingLogger::start() {
  parallel::CommStats::instance().reset();  // communication of the training iterations only
  interval_start_ = Clock::now();
}

void TrainingLogger::record(const TrainingProgress& progress, StepResult step) {
  if (iterations_ == 0) interval_first_iteration_ = progress.iteration;
  reduce_moe_stats(step.moe_stats, args_.model, parallel_);
  moe_metrics_.add(step.moe_stats);
  // Megatron's training_log: losses are averaged over the advanced (not skipped) iterations; a skipped iteration
  // with a non-finite loss counts as a nan iteration.
  if (step.skipped) {
    ++skipped_iterations_;
    nan_iterations_ += std::isfinite(step.lm_loss) ? 0 : 1;
  } else {
    loss_sum_ += step.lm_loss;
    ++advanced_iterations_;
    loss_seen_ = true;
  }
  flops_sum_ += flops_of(step);
  if (step.seqlen_stats) real_tokens_sum_ += step.seqlen_stats->tokens;
  if (step.packing) {
    if (!packing_sum_) packing_sum_.emplace();
    packing_sum_->bins += step.packing->bins;
    packing_sum_->padding_bins += step.packing->padding_bins;
    packing_sum_->padding_tokens += step.packing->padding_tokens;
  }
  // Megatron adds "mtp_k loss" to its total_loss_dict every iteration and divides by the advanced iterations.
  mtp_loss_sums_.resize(step.mtp_losses.size(), 0.0);
  for (size_t k = 0; k < step.mtp_losses.size(); ++k) mtp_loss_sums_[k] += step.mtp_losses[k];
  ++iterations_;
  const int64_t iteration = progress.iteration;
  if (tensorboard_.enabled()) {
    TensorBoardIteration scalars;
    scalars.iteration = iteration;
    scalars.consumed_samples = progress.consumed_train_samples;
    scalars.learning_rate = schedule_.lr();
    scalars.loss_scale = step.loss_scale;
    scalars.skipped = step.skipped;
    scalars.lm_loss = step.lm_loss;
    scalars.grad_norm = step.grad_norm;
    scalars.num_zeros_in_grad = step.num_zeros_in_grad;
    scalars.params_norm = step.params_norm;
    iteration_moe_metrics_.reset();
    iteration_moe_metrics_.add(step.moe_stats);
    if (!iteration_moe_metrics_.empty()) scalars.moe_losses = iteration_moe_metrics_.losses();
    for (size_t k = 0; k < step.mtp_losses.size(); ++k) {
      scalars.mtp_losses.emplace_back("mtp_" + std::to_string(k + 1) + " loss", step.mtp_losses[k]);
    }
    tensorboard_.iteration(scalars);
  }
  if (!logs_iteration(iteration, args_.log_interval, first_iteration_)) return;

  const bool reset = iteration != first_iteration_;
  const double seconds_per_iter =
      std::chrono::duration<double>(Clock::now() - interval_start_).count() / static_cast<double>(iterations_);
  // No lm loss before the first advanced iteration (Megatron has no such key yet); NaN is not printed.
  const double lm_loss = loss_seen_ ? loss_sum_ / static_cast<double>(std::max<int64_t>(1, advanced_iterations_))
                                    : std::numeric_limits<double>::quiet_NaN();
  NamedValues extra_losses = moe_metrics_.losses();
  for (size_t k = 0; k < mtp_loss_sums_.size(); ++k) {
    extra_losses.emplace_back("mtp_" + std::to_string(k + 1) + " loss",
                              mtp_loss_sums_[k] / static_cast<double>(std::max<int64_t>(1, advanced_iterations_)));
  }
  IterationLog entry = iteration_log(progress, seconds_per_iter, lm_loss, extra_losses, step.grad_norm,
                                     format_log_timestamp(std::chrono::system_clock::now()));
  entry.loss_scale = step.loss_scale;
  if (step.skipped) entry.grad_norm.reset();  // Megatron: grad_norm is None for a skipped iteration
  entry.num_zeros_in_grad = step.num_zeros_in_grad;
  entry.params_norm = step.params_norm;
  entry.skipped_iterations = skipped_iterations_;
  entry.nan_iterations = nan_iterations_;
  if (iteration < args_.train_iters) {
    entry.seconds_left = seconds_per_iter * static_cast<double>(args_.train_iters - iteration);
  }
  if (step.seqlen_stats) {
    if (args_.log_throughput) {
      entry.throughput_tflops_per_gpu =
          throughput_per_gpu(flops_sum_ / static_cast<double>(iterations_), seconds_per_iter);
    }
    entry.real_tokens_per_iteration = real_tokens_sum_ / iterations_;
  }
  if (packing_sum_) {
    entry.packed_bins_per_iteration = packing_sum_->bins / iterations_;
    entry.padding_bins_per_iteration = packing_sum_->padding_bins / iterations_;
    entry.padding_tokens_per_iteration = packing_sum_->padding_tokens / iterations_;
  }
  log_ << format_iteration_log(entry) << std::endl;
  if (reset) tensorboard_.timers(iteration, seconds_per_iter, entry.throughput_tflops_per_gpu);  // not the first line
  for (const std::string& line : moe_metrics_.usage_lines()) log_ << line << '\n';
  if (reset && !moe_metrics_.empty()) {  // whole intervals only: the first line's does not end one
    std::vector<LayerLoad> loads;
    for (const std::string& warning :
         collapse_alarm_.observe(interval_first_iteration_, iteration, moe_metrics_.totals(), &loads)) {
      log_ << warning << '\n';
    }
    tensorboard_.expert_load(iteration, loads);
  }
  tensorboard_.flush();  // the line's scalars, the expert loads included, reach the file with the line
  if (parallel_.world.size() > 1) {
    log_ << comm_report(seconds_per_iter, iterations_, parallel_) << std::endl;
    if (reset) parallel::CommStats::instance().reset();
  }
  if (report_memory_) {  // Megatron: after the first iteration and at the next log line (optimizer state included)
    log_ << memory_report(iteration, parallel_) << std::endl;
    if (iteration > first_iteration_) report_memory_ = false;
  }
  if (!reset) return;
  moe_metrics_.reset();
  std::fill(mtp_loss_sums_.begin(), mtp_loss_sums_.end(), 0.0);
  loss_sum_ = 0.0;
  advanced_iterations_ = 0;
  skipped_iterations_ = 0;
  nan_iterations_ = 0;
  flops_sum_ = 0.0;
  real_tokens_sum_ = 0;
  packing_sum_.reset();
  iterations_ = 0;
  interval_start_ = Clock::now();
}

}  // namespace moecore
