#include "moecore/train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <optional>
#include <ostream>
#include <sstream>

#include "moecore/config/memory_estimate.h"
#include "moecore/ops/attention.h"
#include "moecore/ops/linear.h"
#include "moecore/parallel/agreement.h"
#include "moecore/plan/run_memory_estimate.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/evaluation.h"
#include "moecore/train/final_export.h"
#include "moecore/train/nonfinite_diagnosis.h"
#include "moecore/train/startup_checks.h"
#include "moecore/train/train_step.h"
#include "moecore/train/training_log.h"
#include "moecore/train/training_setup.h"
#include "moecore/util/trace.h"

namespace moecore {
namespace {

using Clock = std::chrono::steady_clock;

// Tokens whose ids are checked against the vocabulary at start-up, shared by the datasets of a blend (about 0.2 s).
constexpr int64_t kStartupTokenScan = int64_t{1} << 22;

void print_layout(const TrainingArgs& args, const parallel::ParallelState& parallel, std::ostream& log) {
  if (parallel.world.size() == 1) return;
  log << "> " << parallel.world.size() << " ranks: TP " << args.parallel.tensor_model_parallel_size << ", EP "
      << args.parallel.expert_model_parallel_size << ", ETP " << args.parallel.expert_tensor_parallel() << ", DP "
      << parallel.dp_size() << ", expert DP " << parallel.edp.size()
      << (parallel.sequence_parallel && args.parallel.tensor_model_parallel_size > 1 ? ", sequence parallel" : "")
      << (args.use_megatron_fsdp           ? ", Megatron-FSDP " + args.data_parallel_sharding_strategy
          : args.use_distributed_optimizer ? ", distributed optimizer"
                                           : "")
      << std::endl;
}

// The unigram baseline over the whole train split (capped): the frequencies a context-free model would know at best.
double print_unigram_baseline(const TrainingArgs& args, const GPTDataProvider& data, const int64_t vocab,
                              std::ostream& log) {
  const int64_t n_train = std::min<int64_t>(data.num_samples(DatasetSplit::kTrain), 20000);
  const int64_t n_valid =
      std::min<int64_t>(data.num_samples(DatasetSplit::kValid), args.eval_iters * args.global_batch_size);
  const double baseline = unigram_baseline(data, vocab, n_train, n_valid);
  log << "> unigram baseline: validation cross-entropy " << std::fixed << std::setprecision(4) << baseline
      << " under the token frequencies of " << n_train << " training samples" << std::endl;
  log.unsetf(std::ios::floatfield);
  return baseline;
}

// A log that can no longer be written (standard output redirected to a full disk) stops the run at once: a run that
// trains on unlogged is a silent failure. The failing flush sets errno just before the stream turns bad.
void check_log_written(const std::ostream& log) {
  if (log.good()) return;
  const int error = errno;
  throw std::runtime_error(std::string("writing the training log failed") +
                           (error != 0 ? std::string(": ") + std::strerror(error) : std::string()));
}

void write_trace(const TrainingArgs& args, const int rank, std::ostream& log) {
  trace::stop();
  std::error_code ec;
  std::filesystem::create_directories(args.profile_dir, ec);
  if (ec) throw std::runtime_error("--profile-dir " + args.profile_dir + ": cannot create the folder: " + ec.message());
  const std::string path =
      (std::filesystem::path(args.profile_dir) / ("trace_rank" + std::to_string(rank) + ".json")).string();
  trace::write(path);
  log << "> wrote the trace of iterations " << args.profile_step_start + 1 << "-" << args.profile_step_end << " to "
      << path << " (" << trace::event_count() << " events; open it in https://ui.perfetto.dev)" << std::endl;
}

}  // namespace

TrainResult run_training(const TrainingArgs& args, std::ostream& log) {
  return run_training(args, log, parallel::ParallelState::single_process());
}

parallel::ParallelState make_parallel_state(const TrainingArgs& args) {
  if (!parallel::launched_by_mpi()) {
    if (args.parallel.world_size != 1) throw ConfigError("a layout of several ranks needs mpirun");
    return parallel::ParallelState::single_process();
  }
  return parallel::ParallelState::create(args.parallel, args.sequence_parallel, parallel::ProcessGroup::world());
}

TrainResult run_training(const TrainingArgs& args, std::ostream& rank0_log, const parallel::ParallelState& parallel,
                         const FullModelCallback& on_full_model) {
  if (args.threads > 0) omp_set_num_threads(static_cast<int>(args.threads));
  if (parallel.world.size() != args.parallel.world_size) {
    throw ConfigError("the arguments were parsed for " + std::to_string(args.parallel.world_size) + " processes, but " +
                      std::to_string(parallel.world.size()) + " run");
  }
  std::ostringstream discarded;
  std::ostream& log = parallel.rank == 0 ? rank0_log : discarded;
  print_layout(args, parallel, log);
  log << "> GEMM: " << ops::gemm_library() << ", " << omp_get_max_threads() << " threads" << std::endl;
  if (const DType low = args.model.params_dtype; low != DType::kF32) {
    log << "> " << (low == DType::kBF16 ? "bf16" : "fp16") << " GEMMs: " << ops::gemm_lowp_library(low)
        << "; attention: " << ops::attention_products(low) << std::endl;
  }

  // Setup: vocabulary, data, model and optimizer.
  const Vocabulary vocabulary = build_vocabulary(args);
  TrainingArgs run_args = with_padded_vocabulary(args, vocabulary);
  const MemoryEstimate memory = plan::estimate_run_memory(run_args);
  parallel::run_on_all_ranks(parallel.world, [&] {
    if (const std::optional<double> available = available_memory_per_rank()) check_memory_fits(memory, *available);
  });
  log << "> memory estimate per rank: " << format_bytes(memory.total()) << " (parameters "
      << format_bytes(memory.parameters) << ", gradients " << format_bytes(memory.gradients) << ", optimizer "
      << format_bytes(memory.optimizer) << ", activations " << format_bytes(memory.activations) << ")" << std::endl;
  // What would otherwise fail after training (saving, exporting, sampling) or at its first step (the data).
  parallel::run_on_all_ranks(parallel.world, [&] {
    check_outputs(run_args, vocabulary, parallel.rank == 0);
    check_split_weights(run_args);
    check_token_ids(run_args.data_path, vocabulary.unpadded_size, kStartupTokenScan);
  });
  LoadPlan load_plan;
  parallel::run_on_all_ranks(parallel.world, [&] { load_plan = plan_load(run_args, log); });
  if (load_plan.seed) run_args.seed = *load_plan.seed;  // the checkpoint's RNG stream goes on
  log << "> padded vocab (size: " << vocabulary.unpadded_size << ") with "
      << vocabulary.padded_size - vocabulary.unpadded_size << " dummy tokens (new size: " << vocabulary.padded_size
      << ")" << std::endl;
  const GPTDataProvider data = build_data(run_args, vocabulary.eod_id, log);
  parallel::run_on_all_ranks(parallel.world, [&] { check_built_splits(run_args, data); });
  ModelAndOptimizer built = build_model_and_optimizer(run_args, parallel);
  GPTModel& model = *built.model;
  const double total_parameters = one_process_parameter_count(model);
  log << "> number of parameters: " << static_cast<int64_t>(total_parameters) << " (" << std::setprecision(2)
      << std::fixed << total_parameters / 1e6 << "M)" << std::endl;
  if (run_args.use_precision_aware_optimizer) {
    const double state_mb = static_cast<double>(built.optimizer->state_bytes()) / (1024.0 * 1024.0);
    log << "> precision-aware optimizer: exp_avg " << run_args.exp_avg_dtype << ", exp_avg_sq "
        << run_args.exp_avg_sq_dtype << ", main params "
        << (run_args.model.params_dtype == DType::kF32   ? "(the fp32 weights)"
            : built.optimizer->stores_param_remainders() ? "fp32 (bf16 weights + 16-bit remainders)"
            : run_args.main_params_dtype == "fp32"       ? "fp32 (a full copy)"
                                                         : run_args.main_params_dtype)
        << ", main grads " << run_args.main_grads_dtype << "; optimizer states " << std::setprecision(2) << state_mb
        << " MB on rank 0" << std::endl;
  }
  log.unsetf(std::ios::floatfield);
  log << std::setprecision(6);
  LRSchedule schedule(lr_schedule_config(run_args));
  // Megatron's optimizers: the dense parameters' and, with routed experts, the experts' (each with its own scaler).
  LossScalers loss_scalers;
  const auto make_scaler = [&] {
    return run_args.loss_scale ? GradScaler::constant(*run_args.loss_scale)
                               : GradScaler::dynamic(run_args.dynamic_loss_scale);
  };
  if (run_args.loss_scale || run_args.model.params_dtype == DType::kF16) {
    loss_scalers.dense = make_scaler();
    if (run_args.model.moe.enabled()) loss_scalers.expert = make_scaler();
  }
  // Nothing but the optimizer step changes a weight between two steps (loading precedes the loop; evaluation and
  // saving read the weights), so the steps may carry their 16-bit weight casts.
  ops::WeightCastCarry weight_casts;
  // Whole variable-length samples: every rank reads them and packs every step alike.
  std::optional<SampleDataset> sample_data;
  std::optional<PackedSamples> packed_samples;
  if (!run_args.sample_data_path.empty()) {
    parallel::run_on_all_ranks(parallel.world, [&] {
      sample_data.emplace(run_args.sample_data_path, vocabulary.unpadded_size);
      packed_samples.emplace(*sample_data, packed_samples_options(run_args, parallel.cp_size()));
    });
    log << "> whole samples: " << sample_data->size() << " from " << run_args.sample_data_path
        << (run_args.rl_use_sequence_packing ? ", packed into bins of " : ", one per sequence of ")
        << run_args.model.seq_length << " tokens" << std::endl;
  }
  // Dynamic context parallelism: the blocks of data- and context-parallel ranks a sample can run on.
  std::optional<HybridCpGroups> hybrid_cp;
  if (run_args.hybrid_context_parallel) hybrid_cp.emplace(parallel.dp_cp);
  // Router replay: every rank reads the recording (a bad one fails them all alike).
  std::optional<RoutingReplaySource> routing_replay;
  if (!run_args.moe_routing_replay_file.empty()) {
    routing_replay.emplace(run_args.moe_routing_replay_file, run_args.model, !run_args.sample_data_path.empty());
    log << "> router replay: " << routing_replay->num_records() << " recorded sequences from "
        << run_args.moe_routing_replay_file << std::endl;
  }
  const TrainingModules modules{model,
                                *built.ddp,
                                *built.optimizer,
                                schedule,
                                data,
                                loss_scalers,
                                &weight_casts,
                                routing_replay ? &*routing_replay : nullptr,
                                packed_samples ? &*packed_samples : nullptr,
                                hybrid_cp ? &*hybrid_cp : nullptr};

  TrainResult result;
  TrainingProgress& progress = result.progress;
  const CheckpointTarget checkpoint_target{
      model, *built.ddp, *built.optimizer, schedule, vocabulary.unpadded_size, &loss_scalers};
  load_checkpoint(load_plan, run_args, checkpoint_target, progress, parallel, log);
  load_plan.checkpoint.reset();  // the checkpoint's metadata is not needed while training
  if (const std::string warning = save_tracker_regression(run_args, progress.iteration); !warning.empty()) {
    log << "WARNING: " << warning << std::endl;
  }
  Checkpointer checkpointer(run_args, parallel, log, progress.floating_point_operations_so_far);
  if (run_args.moe_use_upcycling) checkpointer.save(checkpoint_target, progress, false);  // Megatron's iteration 1
  const bool has_valid = data.has_split(DatasetSplit::kValid) && args.eval_iters > 0;
  if (has_valid && !args.mock_data && parallel.rank == 0) {
    result.unigram_baseline = print_unigram_baseline(run_args, data, vocabulary.unpadded_size, log);
  }
  TrainingLogger logger(run_args, schedule, parallel, log);
  // Megatron's init_moe_router_tracer in training mode: the first max steps of this run, on every rank.
  std::optional<RouterTracer> router_tracer;
  if (const auto& trace = run_args.moe_routing_trace; !trace.path.empty()) {
    router_tracer.emplace(RouterTraceOptions{.dir = trace.path,
                                             .max_steps = trace.max_training_iters.value_or(run_args.train_iters),
                                             .rank = parallel.rank,
                                             .capture_hidden_states = trace.capture_hidden_states,
                                             .capture_logits = trace.capture_logits,
                                             .dump_router_weights = trace.dump_weights});
    model.set_router_tracer(&*router_tracer);
  }
  if (has_valid) {
    // moecore's extra look before training (Megatron has none): on a cursor of its own, so the evaluations during and
    // after training read the validation samples Megatron's would.
    log << "> validation before training" << std::endl;
    int64_t own_cursor = 0;
    // It leaves the FP8 delayed-scaling state as it found it (evaluation records amaxes into the histories), so that
    // training, and a resumed run, proceed as Megatron's.
    const std::vector<float> scaling = model.delayed_scaling().snapshot();
    result.first_valid_loss =
        evaluate_and_print(run_args, model, data, parallel, validation_prefix_during_training(0), own_cursor, log);
    model.delayed_scaling().restore(scaling);
    logger.validation(progress, result.first_valid_loss);
  }

  // Training: Megatron's train() loop.
  log << "> training ..." << std::endl;
  double train_seconds = 0.0;
  logger.start();
  std::optional<double> previous_grad_norm;  // of the last update made (for the message when a step stops)
  const bool profiled_rank = args.profile && std::find(args.profile_ranks.begin(), args.profile_ranks.end(),
                                                       parallel.rank) != args.profile_ranks.end();
  while (progress.iteration < args.train_iters) {
    // Megatron's window: the steps taken while progress.iteration is in [--profile-step-start, --profile-step-end).
    if (profiled_rank && progress.iteration == args.profile_step_start) trace::start(parallel.rank);
    const auto step_start = Clock::now();
    StepResult step;
    try {
      const bool reported = logger.reports(progress.iteration + 1);
      step = train_step(run_args, modules, parallel, progress,
                        {.num_zeros_in_grad = reported && args.log_num_zeros_in_grad,
                         .params_norm = reported && args.log_params_norm});
    } catch (const NonFiniteStep& failure) {
      // The failing step's routing records too (Megatron's tracer writes its buffer at exit).
      if (router_tracer) {
        try {
          router_tracer->advance_step(progress.iteration);
          router_tracer->finish();
        } catch (const std::exception&) {  // the step's own error is the one to report
        }
      }
      const NonFiniteDiagnosis diagnosis{.step = failure.facts(),
                                         .previous_losses = result.train_losses,
                                         .previous_grad_norm = previous_grad_norm,
                                         .scan = scan_model_for_nonfinite(model, parallel.world),
                                         .num_layers = run_args.model.num_layers,
                                         .lr = run_args.lr,
                                         .adam_eps = run_args.adam_eps,
                                         .weight_decay = run_args.weight_decay,
                                         .clip_grad = run_args.clip_grad,
                                         .init_method_std = run_args.model.init_method_std,
                                         .loaded_from = run_args.load,
                                         .fp16 = run_args.model.params_dtype == DType::kF16};
      throw TrainingError(describe_nonfinite(diagnosis));
    }
    if (!step.skipped) previous_grad_norm = step.grad_norm;
    if (router_tracer) router_tracer->advance_step(progress.iteration);  // Megatron's step: the iteration before it
    progress.iteration += 1;
    progress.consumed_train_samples += args.global_batch_size;
    progress.floating_point_operations_so_far += logger.flops_of(step);
    train_seconds += std::chrono::duration<double>(Clock::now() - step_start).count();
    result.train_losses.push_back(step.lm_loss);
    logger.record(progress, std::move(step));
    check_log_written(log);
    // Megatron: `if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid`, the last iteration
    // included (the evaluation after training then reads the next validation samples).
    if (has_valid && args.eval_interval && progress.iteration % *args.eval_interval == 0) {
      const auto eval_start = Clock::now();
      result.last_valid_loss =
          evaluate_and_print(run_args, model, data, parallel, validation_prefix_during_training(progress.iteration),
                             progress.consumed_valid_samples, log);
      logger.validation(progress, result.last_valid_loss);
      logger.exclude(Clock::now() - eval_start);  // evaluation time is not training time
    }
    if (profiled_rank && progress.iteration == args.profile_step_end) write_trace(args, parallel.rank, log);
    const auto save_start = Clock::now();
    const bool exit_now = checkpointer.after_iteration(checkpoint_target, progress);
    logger.exclude(Clock::now() - save_start);  // nor is checkpointing
    if (exit_now) {
      result.exited_early = true;
      break;
    }
  }
  if (profiled_rank && trace::enabled()) write_trace(args, parallel.rank, log);  // the run ended inside the window
  if (router_tracer) {
    router_tracer->finish();
    log << "> routing trace: " << router_tracer->records_written() << " records of rank 0 in "
        << run_args.moe_routing_trace.path;
    if (router_tracer->records_left_out() > 0) {
      log << " (" << router_tracer->records_left_out()
          << " left out, as Megatron's: their routing maps dropped tokens)";
    }
    log << std::endl;
  }
  if (result.exited_early) {
    if (!result.train_losses.empty()) {
      result.first_train_loss = result.train_losses.front();
      result.last_train_loss = result.train_losses.back();
    }
    return result;
  }
  checkpointer.finish(checkpoint_target, progress);
  if (!result.train_losses.empty()) {
    result.first_train_loss = result.train_losses.front();
    result.last_train_loss = result.train_losses.back();
  }
  result.tokens_per_second =
      static_cast<double>(progress.consumed_train_samples * run_args.model.seq_length) / std::max(train_seconds, 1e-9);
  if (has_valid) {
    result.last_valid_loss =
        evaluate_and_print(run_args, model, data, parallel, validation_prefix_after_training(progress.iteration),
                           progress.consumed_valid_samples, log);
    logger.validation(progress, result.last_valid_loss);
  }
  log << "> training throughput: " << std::fixed << std::setprecision(1) << result.tokens_per_second
      << " tokens/s over " << args.train_iters << " iterations" << std::endl;
  log.unsetf(std::ios::floatfield);

  finish_training(args, model, *built.ddp, vocabulary, parallel, on_full_model, log);
  return result;
}

}  // namespace moecore
