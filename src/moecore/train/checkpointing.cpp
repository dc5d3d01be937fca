#include "moecore/train/checkpointing.h"

#include <omp.h>
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <iomanip>
#include <map>
#include <ostream>
#include <sstream>

#include "moecore/ckpt/checkpoint_dir.h"
#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/ckpt/hf_state_source.h"
#include "moecore/ckpt/upcycling.h"
#include "moecore/model/config.h"
#include "moecore/parallel/agreement.h"
#include "moecore/train/checkpoint_contents.h"
#include "moecore/train/training_state.h"
#include "moecore/util/process_start.h"

namespace moecore {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

namespace {

volatile std::sig_atomic_t g_exit_signal_received = 0;
extern "C" void on_exit_signal(int) { g_exit_signal_received = 1; }

int signal_number(const std::string& name) {
  static const std::map<std::string, int> numbers = {{"SIGTERM", SIGTERM}, {"SIGINT", SIGINT},   {"SIGHUP", SIGHUP},
                                                     {"SIGQUIT", SIGQUIT}, {"SIGUSR1", SIGUSR1}, {"SIGUSR2", SIGUSR2},
                                                     {"SIGALRM", SIGALRM}, {"SIGXCPU", SIGXCPU}};
  const auto it = numbers.find(name);
  if (it == numbers.end()) throw ConfigError("--exit-signal " + name + " is not a signal moecore can catch");
  return it->second;
}

// Megatron's cleanup_old_non_persistent_checkpoint(leave_ckpt_num=1), before a non-persistent save: every iter_*
// folder but the newest goes, so the previous one survives until the new one is complete.
void cleanup_old_non_persistent_checkpoints(const std::string& root, std::ostream& log) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return;
  std::vector<std::pair<int64_t, fs::path>> iterations;
  for (auto entry = fs::directory_iterator(root, ec); !ec && entry != fs::directory_iterator(); entry.increment(ec)) {
    const std::string name = entry->path().filename().string();
    if (!name.starts_with("iter_") || name.size() == 5 || name.size() > 5 + 18 ||
        name.find_first_not_of("0123456789", 5) != std::string::npos) {
      continue;
    }
    iterations.emplace_back(std::stoll(name.substr(5)), entry->path());
  }
  std::sort(iterations.begin(), iterations.end());
  for (size_t i = 0; i + 1 < iterations.size(); ++i) {
    std::error_code removal;
    fs::remove_all(iterations[i].second, removal);
    if (removal) {
      log << "WARNING: cannot remove the older non-persistent checkpoint " << iterations[i].second.string() << ": "
          << removal.message() << std::endl;
    }
  }
}

std::string now_text(const bool micros) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  localtime_r(&t, &tm);
  std::ostringstream out;
  out << std::put_time(&tm, "%Y-%m-%d %H:%M:%S");
  if (micros) {
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
    out << '.' << std::setw(6) << std::setfill('0') << us;
  }
  return out.str();
}

std::string iter7(const int64_t iteration) {
  std::ostringstream out;
  out << std::setw(7) << iteration;
  return out.str();
}

// Megatron's timers.log line for one timer: min and max over the world, in ms.
void log_time_across_ranks(const parallel::ParallelState& parallel, const std::string& name, const double ms,
                           std::ostream& log) {
  std::vector<float> max_and_neg_min{static_cast<float>(ms), static_cast<float>(-ms)};
  parallel.world.all_reduce(std::span<float>(max_and_neg_min), parallel::ReduceOp::kMax);
  std::string dotted = name + " ";
  dotted.resize(48, '.');
  log << "(min, max) time across ranks (ms):\n    " << dotted << ": (" << std::fixed << std::setprecision(2)
      << -max_and_neg_min[1] << ", " << max_and_neg_min[0] << ")" << std::endl;
  log.unsetf(std::ios::floatfield);
  log << std::setprecision(6);
}

void print_datetime(const std::string& what, std::ostream& log) {
  log << "[" << what << "] datetime: " << now_text(false) << " " << std::endl;
}

std::string normalization_name(const Normalization n) {
  return n == Normalization::kLayerNorm ? "LayerNorm" : "RMSNorm";
}

bool is_vocab_key(const std::string& key) {
  for (const char* name : {"embedding.word_embeddings.weight", "output_layer.weight"}) {
    if (key == name || key == std::string("optimizer.state.exp_avg.") + name ||
        key == std::string("optimizer.state.exp_avg_sq.") + name || key == std::string(kMainParamPrefix) + name) {
      return true;
    }
  }
  return false;
}

// The dynamic loss scalers' state (Megatron's MixedPrecisionOptimizer.load_state_dict: an fp16 run from a checkpoint
// without it keeps its initial scale).
void load_grad_scalers(const ShardedCheckpoint& ckpt, LossScalers& scalers, std::ostream& log) {
  for (const bool expert : {false, true}) {
    std::optional<GradScaler>& scaler = expert ? scalers.expert : scalers.dense;
    if (!scaler || !scaler->is_dynamic()) continue;
    const std::string prefix = grad_scaler_prefix(scalers, expert);
    if (!ckpt.info(prefix + "scale")) {
      log << "***WARNING*** found an old checkpoint, will not load grad scaler (" << prefix << "* missing in "
          << ckpt.dir() << ")" << std::endl;
      continue;
    }
    GradScaler::State state;
    state.scale = static_cast<float>(ckpt.f64(prefix + "scale"));
    state.growth_tracker = ckpt.i64(prefix + "growth_tracker");
    state.hysteresis_tracker = ckpt.i64(prefix + "hysteresis_tracker");
    try {
      scaler->load_state(state);
    } catch (const std::invalid_argument& e) {
      throw CheckpointError("checkpoint " + ckpt.dir() + ": " + prefix + "*: " + e.what());
    }
  }
}

struct FoundCheckpoint {
  std::string dir;
  int64_t iteration = 0;
  bool release = false;
};

// Where --load points (Megatron's _load_base_checkpoint): the tracker's iteration or --ckpt-step; with
// --non-persistent-ckpt-type global, the non-persistent checkpoint wins when its iteration is at least that one.
std::optional<FoundCheckpoint> find_checkpoint(const TrainingArgs& args, std::ostream& log) {
  std::optional<TrackerEntry> persistent = read_tracker_entry(args.load);
  if (args.ckpt_step) persistent = TrackerEntry{*args.ckpt_step, false};
  if (args.non_persistent_ckpt_type == "global") {
    const std::string np_root = non_persistent_root(args, args.load);
    const std::optional<TrackerEntry> non_persistent = read_tracker_entry(np_root);
    if (non_persistent && non_persistent->release) {
      throw CheckpointError(tracker_path(np_root) + ": a non-persistent checkpoint cannot be a release checkpoint");
    }
    if (!non_persistent) {
      log << "WARNING: could not find the metadata file " << tracker_path(np_root) << "\n"
          << "    will not load any non-persistent checkpoint" << std::endl;
    } else if (!persistent || non_persistent->iteration >= persistent->iteration) {
      return FoundCheckpoint{iteration_dir(np_root, non_persistent->iteration), non_persistent->iteration, false};
    } else {
      log << "WARNING: non-persistent checkpoints are older than persistent checkpoint" << std::endl;
    }
  }
  if (!persistent) return std::nullopt;
  return FoundCheckpoint{checkpoint_dir(args.load, *persistent), persistent->iteration, persistent->release};
}

// A HuggingFace folder (training starts at iteration 0 with a fresh optimizer), or Megatron's upcycling of a dense
// checkpoint (moecore's or HuggingFace's): the MoE model from the dense weights, then, as Megatron's
// setup_model_and_optimizer, iteration 1 with the dense run's consumed samples and FLOPs.
void load_model_only(const LoadPlan& plan, const TrainingArgs& run_args, const CheckpointTarget& target,
                     TrainingProgress& progress, const parallel::ParallelState& parallel, std::ostream& log) {
  const bool hf = plan.kind == LoadPlan::Kind::kHuggingFace;
  const bool upcycle = run_args.moe_use_upcycling;
  log << " loading " << (hf ? "HuggingFace checkpoint" : "distributed checkpoint") << " from " << plan.dir
      << (upcycle ? " to upcycle it into " + std::to_string(run_args.model.moe.num_experts) + " experts" : "")
      << std::endl;
  parallel::run_on_all_ranks(parallel.world, [&] {
    ModelConfig source_config =
        upcycle ? dense_config_for_upcycling(run_args.model, run_args.moe_upcycling_granularity) : run_args.model;
    std::shared_ptr<const StateSource> stored;
    if (hf) {
      // The folder's vocabulary may be padded for another TP size (or not at all): it must hold every token, and the
      // rows both have are loaded.
      const int64_t hf_vocab = read_hf_config(plan.dir).vocab_size;
      if (hf_vocab < target.vocab_tokens || hf_vocab > run_args.model.vocab_size) {
        throw ConfigError("HF config.json vocab_size " + std::to_string(hf_vocab) + " does not fit this run: the " +
                          "tokenizer has " + std::to_string(target.vocab_tokens) +
                          " tokens and the padded vocabulary " + std::to_string(run_args.model.vocab_size) + " rows");
      }
      if (hf_vocab != run_args.model.vocab_size) {
        log << "WARNING: config.json's vocab_size is " << hf_vocab << ", this run's padded vocabulary "
            << run_args.model.vocab_size << ": rows " << hf_vocab << ".. keep their initial values (they take part in "
            << "the softmax)" << std::endl;
      }
      source_config.vocab_size = hf_vocab;
      check_hf_config_matches(plan.dir, source_config);
      stored = hf_state_source(plan.dir, source_config);
    } else {
      const ShardedCheckpoint& ckpt = *plan.checkpoint;
      progress.consumed_train_samples = ckpt.i64("consumed_train_samples");
      progress.consumed_valid_samples = ckpt.i64("consumed_valid_samples");
      progress.floating_point_operations_so_far = ckpt.f64("num_floating_point_operations_so_far");
      stored = plan.checkpoint;
    }
    std::unique_ptr<StateSource> upcycled;
    if (upcycle) {
      upcycled = upcycled_state_source(*stored, run_args.model, run_args.moe_upcycling_granularity,
                                       static_cast<uint64_t>(run_args.seed), run_args.model.init_method_std);
    }
    {
      // Megatron-FSDP: the sharded units' parameters whole while the HF / upcycled weights load, each rank's shard
      // taken from them after.
      const FsdpUnshardedScope unsharded(target.ddp, true);
      StateDict model_state;
      add_model_state(model_state, target.model);
      load_state(upcycle ? *upcycled : *stored, model_state, nullptr, is_vocab_key);
    }
    target.optimizer.main_params_from_model();
    target.optimizer.set_steps_taken(0);
    if (upcycle) progress.iteration = 1;
  });
  log << "  successfully loaded checkpoint from " << plan.dir << " [ t 1/"
      << run_args.parallel.tensor_model_parallel_size << ", p 1/" << run_args.parallel.pipeline_model_parallel_size
      << " ] at iteration " << progress.iteration << std::endl;
}

}  // namespace

std::string non_persistent_root(const TrainingArgs& args, const std::string& root) {
  if (!args.non_persistent_global_ckpt_dir.empty()) return args.non_persistent_global_ckpt_dir;
  return (fs::path(root) / "non_persistent").string();
}

ojson checkpoint_args(const TrainingArgs& a) {
  const ModelConfig& m = a.model;
  ojson model = {{"--num-layers", m.num_layers},
                 {"--hidden-size", m.hidden_size},
                 {"--ffn-hidden-size", m.ffn_hidden_size},
                 {"--num-attention-heads", m.num_attention_heads},
                 {"--num-query-groups", m.num_query_groups},
                 {"--kv-channels", m.kv_channels},
                 {"--normalization", normalization_name(m.normalization)},
                 {"--swiglu", m.activation == Activation::kSwiGLU},
                 {"--add-bias-linear", m.add_bias_linear},
                 {"--qk-layernorm", m.qk_layernorm},
                 {"--position-embedding-type", to_string(m.position_embedding_type)},
                 {"--rotary-base", m.rotary_base},
                 {"--rotary-percent", m.rotary_percent},
                 {"--untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights},
                 {"--num-experts", m.moe.num_experts}};
  // Recorded only with Multi-Token Prediction, so checkpoints of models without it keep their flags.
  if (m.mtp_num_layers > 0) model["--mtp-num-layers"] = m.mtp_num_layers;
  if (m.position_embedding_type == PositionEmbedding::kLearnedAbsolute) {
    model["--max-position-embeddings"] = m.max_position_embeddings;
  }
  if (m.mla) {
    model["--multi-latent-attention"] = true;
    model["--q-lora-rank"] = m.mla->q_lora_rank;
    model["--kv-lora-rank"] = m.mla->kv_lora_rank;
    model["--qk-head-dim"] = m.mla->qk_head_dim;
    model["--qk-pos-emb-head-dim"] = m.mla->qk_pos_emb_head_dim;
    model["--v-head-dim"] = m.mla->v_head_dim;
    model["--rope-type"] = m.mla->rope_type == RopeType::kYarn ? "yarn" : "rope";
  }
  if (m.mla || m.position_embedding_type == PositionEmbedding::kYarn) {
    model["--rotary-scaling-factor"] = m.yarn.rotary_scaling_factor;
    model["--mscale"] = m.yarn.mscale;
    model["--mscale-all-dim"] = m.yarn.mscale_all_dim;
    model["--yarn-original-max-position-embeddings"] = m.yarn.original_max_position_embeddings;
    model["--yarn-beta-fast"] = m.yarn.beta_fast;
    model["--yarn-beta-slow"] = m.yarn.beta_slow;
    model["--yarn-correction-range-round-to-int"] = m.yarn.correction_range_round_to_int;
  }
  if (m.moe.enabled()) {
    std::string pattern;
    for (const bool b : m.moe.moe_layer_pattern) pattern += b ? '1' : '0';
    model["--moe-ffn-hidden-size"] = m.moe.ffn_hidden_size;
    model["--moe-layer-freq"] = pattern;
    model["--moe-router-topk"] = m.moe.topk;
    model["--moe-router-score-function"] = to_string(m.moe.score_function);
    model["--moe-router-pre-softmax"] = m.moe.pre_softmax;
    model["--moe-router-topk-scaling-factor"] = m.moe.topk_scaling_factor.value_or(0.0);
    model["--moe-router-num-groups"] = m.moe.num_groups;
    model["--moe-router-group-topk"] = m.moe.group_topk;
    model["--moe-router-enable-expert-bias"] = m.moe.enable_expert_bias;
    model["--moe-shared-expert-intermediate-size"] = m.moe.shared_expert_intermediate_size;
    model["--moe-shared-expert-gate"] = m.moe.shared_expert_gate;
    if (m.moe.latent_size > 0) model["--moe-latent-size"] = m.moe.latent_size;  // absent: no LatentMoE
  }
  ojson training = {{"--seq-length", m.seq_length},
                    {"padded_vocab_size", m.vocab_size},
                    {"--micro-batch-size", a.micro_batch_size},
                    {"--global-batch-size", a.global_batch_size},
                    {"--train-iters", a.train_iters},
                    {"--lr", a.lr},
                    {"--min-lr", a.min_lr},
                    {"--seed", a.seed},
                    {"--weight-decay", a.weight_decay},
                    {"--clip-grad", a.clip_grad}};
  return {{"model", model}, {"training", training}};
}

ojson checkpoint_layout(const TrainingArgs& args, const parallel::ParallelState& parallel) {
  return {{"world_size", parallel.world.size()},
          {"tensor_model_parallel_size", args.parallel.tensor_model_parallel_size},
          {"pipeline_model_parallel_size", args.parallel.pipeline_model_parallel_size},
          {"context_parallel_size", args.parallel.context_parallel_size},
          {"expert_model_parallel_size", args.parallel.expert_model_parallel_size},
          {"expert_tensor_parallel_size", args.parallel.expert_tensor_parallel()},
          {"data_parallel_size", parallel.dp_size()},
          {"sequence_parallel", args.sequence_parallel},
          {"use_distributed_optimizer", args.use_distributed_optimizer}};
}

LoadPlan plan_load(const TrainingArgs& args, std::ostream& log) {
  LoadPlan plan;
  if (args.load.empty()) return plan;
  if (args.moe_use_upcycling && read_tracker(args.save)) {
    // Megatron's assert in setup_model_and_optimizer.
    throw ConfigError("--moe-use-upcycling: " + args.save +
                      " already holds a checkpoint (upcycling is for the first run only; resume without the flag)");
  }
  const bool has_tracker =
      fs::exists(tracker_path(args.load)) ||
      (args.non_persistent_ckpt_type == "global" && fs::exists(tracker_path(non_persistent_root(args, args.load))));
  if (!has_tracker && !args.ckpt_step && fs::exists(fs::path(args.load) / "config.json")) {
    plan.kind = LoadPlan::Kind::kHuggingFace;
    plan.dir = args.load;
    return plan;
  }
  const std::optional<FoundCheckpoint> found = find_checkpoint(args, log);
  if (!found) {
    if (args.exit_on_missing_checkpoint) {
      throw CheckpointError("--exit-on-missing-checkpoint is set but no checkpoint was found under load directory '" +
                            args.load + "' (missing tracker file '" + tracker_path(args.load) + "')");
    }
    if (args.moe_use_upcycling) throw CheckpointError("--moe-use-upcycling: no checkpoint under " + args.load);
    log << "WARNING: could not find the metadata file " << tracker_path(args.load) << "\n"
        << "    will not load any checkpoints and will start from random" << std::endl;
    return plan;
  }
  plan.kind = LoadPlan::Kind::kSharded;
  plan.dir = found->dir;
  plan.iteration = found->iteration;
  plan.release = found->release;
  plan.checkpoint = std::make_shared<const ShardedCheckpoint>(plan.dir);  // validates metadata.json and every file
  const ShardedCheckpoint& ckpt = *plan.checkpoint;
  // Megatron loads no RNG state from a release checkpoint.
  if (!args.no_load_rng && !args.finetune && !args.moe_use_upcycling && !plan.release) {
    if (!ckpt.info("rng.seed")) {
      throw CheckpointError("checkpoint " + plan.dir +
                            " has no RNG state (saved with --no-save-rng): pass --no-load-rng or --finetune");
    }
    plan.seed = ckpt.i64("rng.seed");
  }
  return plan;
}

void load_checkpoint(const LoadPlan& plan, const TrainingArgs& run_args, const CheckpointTarget& target,
                     TrainingProgress& progress, const parallel::ParallelState& parallel, std::ostream& log) {
  if (plan.kind == LoadPlan::Kind::kNone) return;
  const auto start = Clock::now();
  if (plan.kind == LoadPlan::Kind::kHuggingFace || run_args.moe_use_upcycling) {
    load_model_only(plan, run_args, target, progress, parallel, log);
    log_time_across_ranks(parallel, "load-checkpoint",
                          std::chrono::duration<double, std::milli>(Clock::now() - start).count(), log);
    return;
  }
  log << " loading " << (plan.release ? "release " : "") << "distributed checkpoint from " << run_args.load
      << " at iteration " << plan.iteration << std::endl;
  // Megatron's load_checkpoint: the optimizer and the scheduler (and the loss scalers in the optimizer's state) only
  // when neither --no-load-optim nor --finetune is given and the checkpoint is not a release.
  const bool load_optim = !run_args.no_load_optim && !run_args.finetune && !plan.release;
  parallel::run_on_all_ranks(parallel.world, [&] {
    const ShardedCheckpoint& ckpt = *plan.checkpoint;
    // Model flags must match.
    const ojson& saved = recorded_model_flags(ckpt);
    const ojson mine = checkpoint_args(run_args).at("model");
    for (const auto& [flag, value] : mine.items()) {
      if (!saved.contains(flag) || saved[flag] != value) {
        throw ConfigError("checkpoint " + plan.dir + " was saved with " + flag + " " +
                          (saved.contains(flag) ? saved[flag].dump() : std::string("(absent)")) + ", this run has " +
                          value.dump() + " (model flags must match; parallel and batch sizes may change)");
      }
    }
    for (const auto& [flag, value] : saved.items()) {
      if (!mine.contains(flag)) {
        throw ConfigError("checkpoint " + plan.dir + " was saved with " + flag + " " + value.dump() +
                          ", this run has none (model flags must match; parallel and batch sizes may change)");
      }
    }
    const std::optional<StoredTensorInfo> embedding = ckpt.info("embedding.word_embeddings.weight");
    if (embedding && !embedding->global_shape.empty() && embedding->global_shape[0] < target.vocab_tokens) {
      throw ConfigError("checkpoint " + plan.dir + " has " + std::to_string(embedding->global_shape[0]) +
                        " embedding rows, fewer than the tokenizer's " + std::to_string(target.vocab_tokens) +
                        " tokens");
    }
    if (embedding && !embedding->global_shape.empty() && embedding->global_shape[0] != run_args.model.vocab_size) {
      log << "WARNING: the checkpoint's padded vocabulary has " << embedding->global_shape[0] << " rows, this run's "
          << run_args.model.vocab_size << " (--make-vocab-size-divisible-by x TP): the rows both have are loaded; "
          << "padded rows take part in the softmax, so the loss is not the saved run's" << std::endl;
    }
    // Reduced-format optimizer states load through fp32 copies, stored back after the load.
    const std::vector<AdamWMomentSlice> slices = target.optimizer.moment_slices();
    StateDict state = training_state(target.model, target.optimizer, slices, target.schedule, progress, run_args.seed);
    const auto is_optimizer = [](const std::string& key) { return key.starts_with("optimizer."); };
    if (load_optim && !ckpt.info("optimizer.step")) {
      throw CheckpointError("checkpoint " + plan.dir +
                            " has no optimizer state (saved with --no-save-optim): pass --no-load-optim or --finetune");
    }
    // fp32 main parameters: loaded when the checkpoint has them (saved with 16-bit weights), else made from the
    // loaded weights.
    bool main_params_loaded = load_optim;
    bool delayed_scaling_missing = false;
    load_state(
        ckpt, state,
        [&](const StateEntry& e) {
          if (e.local.dtype() != DType::kF32) return false;  // scalars are read below
          if (is_delayed_scaling_key(e.key)) {
            const std::optional<StoredTensorInfo> stored = ckpt.info(e.key);
            if (!stored) {  // saved under another recipe (TE's extra state then holds no FP8 meta): fresh state
              delayed_scaling_missing = true;
              return false;
            }
            if (stored->global_shape != e.global_shape) {
              throw ConfigError("checkpoint " + plan.dir + " holds FP8 amax histories of " +
                                std::to_string(stored->global_shape.front()) + " entries, this run's " +
                                "--fp8-amax-history-len is " + std::to_string(e.global_shape.front()));
            }
          }
          if (e.key.starts_with(kMainParamPrefix) && (!load_optim || !ckpt.info(e.key))) {
            main_params_loaded = false;
            return false;
          }
          return load_optim || !is_optimizer(e.key);
        },
        is_vocab_key);
    if (load_optim) target.optimizer.load_moment_slices(slices, main_params_loaded);
    if (delayed_scaling_missing) {
      log << "WARNING: checkpoint " << plan.dir << " has no FP8 delayed-scaling state (saved under another recipe): "
          << "the amax histories start empty and the scales at 1" << std::endl;
    }
    if (main_params_loaded) {
      target.optimizer.model_from_main_params();
    } else {
      target.optimizer.main_params_from_model();
    }
    if (load_optim) {
      target.optimizer.set_steps_taken(ckpt.i64("optimizer.step"));
      const std::optional<SchedulerState> stored = stored_scheduler_state(ckpt, target.schedule.state());
      if (!stored) {
        throw CheckpointError("checkpoint " + plan.dir +
                              " has no LR scheduler state (saved with --no-save-optim): pass --no-load-optim");
      }
      target.schedule.load(*stored, run_args.override_opt_param_scheduler         ? SchedulerLoadMode::kOverride
                                    : run_args.use_checkpoint_opt_param_scheduler ? SchedulerLoadMode::kUseCheckpoint
                                                                                  : SchedulerLoadMode::kCheck);
      if (target.loss_scalers != nullptr) load_grad_scalers(ckpt, *target.loss_scalers, log);
    } else {
      target.optimizer.set_steps_taken(0);
    }
    // Megatron: the iteration and samples unless --finetune (a release checkpoint starts at iteration 0); the FLOPs
    // so far always.
    if (!run_args.finetune) {
      progress.iteration = plan.release ? 0 : ckpt.i64("iteration");
      if (ckpt.info("consumed_train_samples")) progress.consumed_train_samples = ckpt.i64("consumed_train_samples");
      if (ckpt.info("consumed_valid_samples")) progress.consumed_valid_samples = ckpt.i64("consumed_valid_samples");
    }
    if (ckpt.info("num_floating_point_operations_so_far")) {
      progress.floating_point_operations_so_far = ckpt.f64("num_floating_point_operations_so_far");
    }
    // --override-opt_param-scheduler: the schedule's position from the consumed samples (Megatron's load_checkpoint).
    if (load_optim && run_args.override_opt_param_scheduler &&
        target.schedule.num_steps() != static_cast<double>(progress.consumed_train_samples)) {
      log << " > WARNING: scheduler num_steps (" << static_cast<int64_t>(target.schedule.num_steps())
          << ") differs from consumed_train_samples (" << progress.consumed_train_samples
          << "). Resetting scheduler num_steps to match consumed_train_samples." << std::endl;
      target.schedule.set_num_steps(static_cast<double>(progress.consumed_train_samples));
    }
  });
  log << "  successfully loaded checkpoint from " << run_args.load << " [ t 1/"
      << run_args.parallel.tensor_model_parallel_size << ", p 1/" << run_args.parallel.pipeline_model_parallel_size
      << " ] at iteration " << progress.iteration << std::endl;
  log_time_across_ranks(parallel, "load-checkpoint",
                        std::chrono::duration<double, std::milli>(Clock::now() - start).count(), log);
}

Checkpointer::Checkpointer(const TrainingArgs& run_args, const parallel::ParallelState& parallel, std::ostream& log,
                           const double floating_point_operations_at_start)
    : args_(run_args),
      parallel_(parallel),
      log_(log),
      progress_log_(run_args, parallel, floating_point_operations_at_start) {
  // Megatron's start time: the earliest process start of the job.
  std::vector<int64_t> negated_start_ms{-std::llround(process_start_seconds() * 1000.0)};
  parallel_.world.all_reduce(std::span<int64_t>(negated_start_ms), parallel::ReduceOp::kMax);
  start_seconds_ = static_cast<double>(-negated_start_ms[0]) / 1000.0;
  if (args_.exit_signal_handler) {
    g_exit_signal_received = 0;
    exit_signal_ = signal_number(args_.exit_signal);
    struct sigaction action {};
    action.sa_handler = on_exit_signal;
    sigemptyset(&action.sa_mask);
    // System calls the signal interrupts are restarted (as Python retries them for Megatron's handler, PEP 475):
    // a write, read or fsync failing with EINTR would end the run instead of the save the signal asks for.
    action.sa_flags = SA_RESTART;
    sigaction(exit_signal_, &action, &previous_handler_);
    handler_installed_ = true;
    // The training threads (this one and OpenMP's) block the signal: it stays pending until the check after the
    // iteration takes it (sigtimedwait), so it never interrupts a kernel. Threads that do not block it (MPI's) run
    // the handler, which only sets the flag.
    sigset_t signal_set;
    sigemptyset(&signal_set);
    sigaddset(&signal_set, exit_signal_);
    pthread_sigmask(SIG_BLOCK, &signal_set, &previous_mask_);
#pragma omp parallel
    {
      if (omp_get_thread_num() != 0) pthread_sigmask(SIG_BLOCK, &signal_set, nullptr);
    }
  }
}

bool Checkpointer::exit_signal_pending() const {
  if (g_exit_signal_received) return true;
  sigset_t signal_set;
  sigemptyset(&signal_set);
  sigaddset(&signal_set, exit_signal_);
  const timespec no_wait{0, 0};
  if (sigtimedwait(&signal_set, nullptr, &no_wait) == exit_signal_) g_exit_signal_received = 1;
  return g_exit_signal_received != 0;
}

Checkpointer::~Checkpointer() {
  if (!handler_installed_) return;
  // A signal still pending reaches this run's handler when unblocked, not the previous disposition.
  pthread_sigmask(SIG_SETMASK, &previous_mask_, nullptr);
  sigaction(exit_signal_, &previous_handler_, nullptr);
  // A pending async save is finished by finish(); an exception path drops it (its folder stays .tmp, never named).
}

void Checkpointer::wait_for_pending() { complete_pending(true); }

void Checkpointer::complete_pending(const bool blocking) {
  if (!pending_) return;
  const int64_t iteration = pending_->iteration();
  const bool non_persistent = pending_non_persistent_;
  try {
    if (!pending_->finalize(blocking)) return;
  } catch (const parallel::GroupFailure& e) {
    pending_.reset();
    handle_failed_save(iteration, non_persistent, e.what());
    return;
  }
  pending_.reset();
  if (!non_persistent) last_saved_ = iteration;
  if (!non_persistent && args_.async_save) progress_log_.async_saved(iteration);
  log_ << "  [" << now_text(true) << "] successfully saved checkpoint from iteration " << iter7(iteration) << " to "
       << (non_persistent ? non_persistent_root(args_, args_.save) : args_.save) << " [ t 1/"
       << args_.parallel.tensor_model_parallel_size << ", p 1/" << args_.parallel.pipeline_model_parallel_size << " ]"
       << std::endl;
}

void Checkpointer::handle_failed_save(const int64_t iteration, const bool non_persistent, const std::string& why) {
  const std::string root = non_persistent ? non_persistent_root(args_, args_.save) : args_.save;
  std::string newest = "no checkpoint is saved in " + root;
  try {
    if (const std::optional<int64_t> tracked = read_tracker(root)) {
      newest = tracker_path(root) + " still names iteration " + std::to_string(*tracked);
    }
  } catch (const std::exception&) {
    newest = tracker_path(root) + " is unreadable";
  }
  const std::string message = "saving checkpoint at iteration " + std::to_string(iteration) + " failed: " + why;
  if (!args_.continue_after_failed_save) {
    // Every rank saw the same failure (the save agrees on it), so the run stops as one.
    throw parallel::GroupFailure(message + " (" + newest + "; --ckpt-save-failure continue trains on without it)");
  }
  ++failed_saves_;
  log_ << "WARNING: " << message << "; training goes on without it (--ckpt-save-failure continue), " << newest
       << std::endl;
}

void Checkpointer::report_failed_saves() {
  if (failed_saves_ == 0) return;
  log_ << "WARNING: " << failed_saves_ << " checkpoint save" << (failed_saves_ == 1 ? "" : "s")
       << " failed during this run (--ckpt-save-failure continue); "
       << (last_saved_ >= 0 ? "the newest saved by this run is iteration " + std::to_string(last_saved_)
                            : std::string("this run saved no checkpoint"))
       << std::endl;
}

void Checkpointer::save(const CheckpointTarget& target, const TrainingProgress& progress, const bool non_persistent) {
  wait_for_pending();
  const auto start = Clock::now();
  const std::string root = non_persistent ? non_persistent_root(args_, args_.save) : args_.save;
  if (non_persistent && parallel_.rank == 0) cleanup_old_non_persistent_checkpoints(root, log_);
  log_ << "[" << now_text(true) << "] saving checkpoint at iteration " << iter7(progress.iteration) << " to " << root
       << " in " << kShardedFormat << " format" << std::endl;
  target.ddp.wait_param_gather();
  // FP8 delayed scaling: amaxes recorded since the last update (evaluation's) differ between the ranks of the amax
  // group until the next reduction; reduce them now so the one saved copy is every rank's.
  target.model.delayed_scaling().reduce_pending();
  StateDict full = training_state(target.model, target.optimizer, target.schedule, progress, args_.seed);
  if (target.loss_scalers != nullptr) add_grad_scaler_state(full, *target.loss_scalers);
  StateDict state;
  for (const StateEntry& e : full.entries()) {
    if (args_.no_save_optim && (e.key.starts_with("optimizer.") || e.key.starts_with("lr_scheduler."))) continue;
    if (args_.no_save_rng && e.key.starts_with("rng.")) continue;
    state.add(e);
  }
  CheckpointInfo info;
  info.iteration = progress.iteration;
  info.layout = checkpoint_layout(args_, parallel_);
  info.args = checkpoint_args(args_);
  try {
    pending_ = std::make_unique<ShardedSave>(state, parallel_.world, root, info, args_.async_save);
  } catch (const parallel::GroupFailure& e) {
    handle_failed_save(progress.iteration, non_persistent, e.what());
    return;
  }
  pending_non_persistent_ = non_persistent;
  if (!non_persistent) last_started_ = progress.iteration;
  if (args_.async_save) {
    log_ << "  [" << now_text(true) << "] scheduled an async checkpoint save at iteration " << iter7(progress.iteration)
         << " to " << root << std::endl;
    if (!non_persistent) progress_log_.saved(progress, true, start_seconds_);
  } else {
    wait_for_pending();
    if (!non_persistent && last_saved_ == progress.iteration) progress_log_.saved(progress, false, start_seconds_);
  }
  log_time_across_ranks(parallel_, non_persistent ? "save-checkpoint-non-persistent" : "save-checkpoint",
                        std::chrono::duration<double, std::milli>(Clock::now() - start).count(), log_);
}

bool Checkpointer::after_iteration(const CheckpointTarget& target, const TrainingProgress& progress) {
  complete_pending(false);  // logs the completion of an async save that has finished
  const int64_t it = progress.iteration;
  const bool can_save = !args_.save.empty();
  if (args_.exit_signal_handler) {
    std::vector<int64_t> received{exit_signal_pending() ? 1 : 0};
    parallel_.world.all_reduce(std::span<int64_t>(received), parallel::ReduceOp::kMax);
    if (received[0] != 0) {
      if (can_save) save(target, progress, false);
      wait_for_pending();
      report_failed_saves();
      print_datetime("exiting program after receiving " + args_.exit_signal + ".", log_);
      return true;
    }
  }
  bool saved = false;
  if (can_save && args_.save_interval && it % *args_.save_interval == 0) {
    save(target, progress, false);
    saved = true;
  } else if (can_save && args_.non_persistent_save_interval && it % *args_.non_persistent_save_interval == 0) {
    save(target, progress, true);
    saved = true;
  }
  if (args_.exit_duration_in_mins) {
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    const double minutes = (now - start_seconds_) / 60.0;
    std::vector<int64_t> done{minutes > *args_.exit_duration_in_mins ? 1 : 0};
    parallel_.world.all_reduce(std::span<int64_t>(done), parallel::ReduceOp::kMax);
    if (done[0] != 0) {
      if (can_save && !saved) save(target, progress, false);
      wait_for_pending();
      report_failed_saves();
      print_datetime("exiting program after " + std::to_string(minutes) + " minutes", log_);
      return true;
    }
  }
  if (args_.exit_interval && it % *args_.exit_interval == 0) {
    if (can_save && !saved) save(target, progress, false);
    wait_for_pending();
    report_failed_saves();
    print_datetime("exiting program at iteration " + std::to_string(it), log_);
    return true;
  }
  return false;
}

void Checkpointer::finish(const CheckpointTarget& target, const TrainingProgress& progress) {
  if (!args_.save.empty() && progress.iteration != 0 && progress.iteration != last_started_ &&
      progress.iteration % *args_.save_interval != 0) {
    save(target, progress, false);
  }
  wait_for_pending();
  report_failed_saves();
}

}  // namespace moecore
