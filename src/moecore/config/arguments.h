// `moecore train` command line: Megatron-LM's flag names and defaults (megatron/training/arguments.py) -> TrainingArgs.
//
// Syntax: util/flag_parser.h, the parser of every command (as argparse with allow_abbrev=False): `--flag value` or
// `--flag=value`; switches take no value; list flags (--data-path) take every following token up to the next flag;
// a flag given twice: last wins; a string value that starts with '-' must be written `--flag=value`.
//
// Errors (one line each, thrown as ConfigError):
//   unknown flag               "unknown flag --num-layer (did you mean --num-layers?)"
//   Megatron flag not built    "--moe-permute-fusion is a Megatron flag that moecore does not implement yet"
//   bad value                  "invalid value 'abc' for --num-layers: expected an integer"
//   inconsistent settings      one line naming the flags involved.
//
// Defaults that depend on other flags are filled as Megatron's validate_args does:
//   --ffn-hidden-size          4 * hidden, or int((4 * hidden * 2 / 3) / 64) * 64 with --swiglu
//   --kv-channels              hidden / heads (hidden must divide)
//   --num-query-groups         heads without --group-query-attention; with it, the flag's value (Megatron default 1)
//   --global-batch-size        micro batch * data-parallel size
//   --lr-decay-iters           --train-iters
//   --split                    "969, 30, 1" when --data-path is given without --split (Megatron's legacy default);
//                              an error with --mock-data, which Megatron always splits 1,1,1
//   --max-position-embeddings  Megatron requires it always; moecore requires it only with learned_absolute position
//                              embeddings (where it sizes a table) and otherwise defaults it to --seq-length.
//
// Mixture of Experts (model.moe; names and defaults of Megatron's _add_moe_args and TransformerConfig):
//   --num-experts E            enables MoE; absent or 0 (Megatron maps 0 to None) gives a dense model, and then every
//                              other --moe-* flag is an error ("--moe-router-topk requires --num-experts").
//   --moe-ffn-hidden-size      default --ffn-hidden-size (after its own default).
//   --moe-layer-freq           int N (layer i is MoE iff i % N == 0) or a list expression ("([0]*3+[1]*9)",
//                              "[1,0,1,0]") whose length must be --num-layers; default 1 (every layer MoE).
//   --moe-router-dtype         fp32 (default) or fp64. Megatron's default None means "the model dtype" (bf16 logits
//                              under --bf16); moecore's router never computes below fp32, so None == fp32 here.
//   --moe-expert-capacity-factor  a negative value means dropless (None), as in Megatron.
//   --moe-token-dispatcher-type   allgather (default) or alltoall: in one process both are the local dispatcher;
//                              flex is rejected (it needs GPU communication backends).
//   Cross-flag checks: MoEConfig::validate (moe/moe_config.h).
//
// moecore-only flags (not in Megatron):
//   --export-hf DIR            after training, write the model as a HuggingFace checkpoint directory
//   --sample-prompt TEXT       after training, generate from this prompt and print it
//   --sample-tokens N          number of tokens to generate for --sample-prompt (default 32)
//   --threads N                CPU threads for the kernels (0 = all cores, the default)
//   --add-bias-linear          the counterpart of --disable-bias-linear (bias is already Megatron's default)
//
// Vocabulary. ModelConfig::vocab_size (the padded vocabulary) is left 0 here: the trainer builds the tokenizer,
// pads its size with padded_vocab_size() and fills it. parse_train_args therefore validates every ModelConfig field
// except the vocabulary size; the trainer must call ModelConfig::validate() again once vocab_size is set.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moecore/model/config.h"
#include "moecore/optim/grad_scaler.h"
#include "moecore/optim/lr_schedule.h"
#include "moecore/parallel/parallel_layout.h"
#include "moecore/pipeline/pipeline_layout.h"

namespace moecore {

struct TrainingArgs {
  ModelConfig model;                           // vocab_size stays 0 (see above)
  bool group_query_attention = false;          // --group-query-attention
  bool multi_latent_attention = false;         // --multi-latent-attention: model.mla = mla
  MlaConfig mla;                               // --q-lora-rank ... --rope-type, staged until finalize
  bool rotary_interleaved = false;             // --rotary-interleaved (refused: with MLA as Megatron refuses it)
  int64_t make_vocab_size_divisible_by = 128;  // --make-vocab-size-divisible-by

  // Batches and length of training.
  int64_t micro_batch_size = 0;   // --micro-batch-size (required)
  int64_t global_batch_size = 0;  // --global-batch-size
  int64_t train_iters = 0;        // --train-iters (required)

  // Learning-rate schedule.
  double lr = 0.0;                                                 // --lr (required)
  double min_lr = 0.0;                                             // --min-lr
  LRDecayStyle lr_decay_style = LRDecayStyle::kLinear;             // --lr-decay-style
  int64_t lr_decay_iters = 0;                                      // --lr-decay-iters
  int64_t lr_warmup_iters = 0;                                     // --lr-warmup-iters
  std::optional<double> lr_warmup_fraction;                        // --lr-warmup-fraction
  double lr_warmup_init = 0.0;                                     // --lr-warmup-init
  std::optional<int64_t> lr_wsd_decay_iters;                       // --lr-wsd-decay-iters
  WSDDecayStyle lr_wsd_decay_style = WSDDecayStyle::kExponential;  // --lr-wsd-decay-style

  // Optimizer (Adam with decoupled weight decay, Megatron's "adam").
  std::string optimizer = "adam";                                // --optimizer
  double adam_beta1 = 0.9;                                       // --adam-beta1
  double adam_beta2 = 0.999;                                     // --adam-beta2
  double adam_eps = 1e-8;                                        // --adam-eps
  double weight_decay = 0.01;                                    // --weight-decay
  std::optional<double> start_weight_decay;                      // --start-weight-decay
  std::optional<double> end_weight_decay;                        // --end-weight-decay
  WDIncrStyle weight_decay_incr_style = WDIncrStyle::kConstant;  // --weight-decay-incr-style
  double clip_grad = 1.0;                                        // --clip-grad (0 disables clipping)
  // Loss scaling (optim/grad_scaler.h): a constant scale; iterations whose gradients are not finite are skipped.
  std::optional<double> loss_scale;  // --loss-scale
  // fp16 without --loss-scale: the dynamic scaler (--initial-loss-scale --min-loss-scale --loss-scale-window
  // --hysteresis, Megatron's defaults).
  DynamicLossScaleOptions dynamic_loss_scale;
  bool grad_reduce_in_bf16 = false;                 // --grad-reduce-in-bf16 (bf16: reduce gradients in bf16)
  bool accumulate_allreduce_grads_in_fp32 = false;  // --accumulate-allreduce-grads-in-fp32 (fp16: reduce in fp32)
  // The precision-aware optimizer (optim/scaled_state.h; Megatron's names fp32, fp16, bf16, fp8; all fp32 without it).
  bool use_precision_aware_optimizer = false;  // --use-precision-aware-optimizer
  std::string main_grads_dtype = "fp32";       // --main-grads-dtype {fp32,bf16}
  std::string main_params_dtype = "fp32";      // --main-params-dtype {fp32,fp16}
  std::string exp_avg_dtype = "fp32";          // --exp-avg-dtype {fp32,fp16,bf16,fp8}
  std::string exp_avg_sq_dtype = "fp32";       // --exp-avg-sq-dtype {fp32,fp16,bf16,fp8}
  // FP8 / FP4 linear layers, as given (finalize turns them into model.quantization).
  std::optional<std::string> fp8_format;  // --fp8-format {e4m3,hybrid}
  std::optional<std::string> fp8_recipe;  // --fp8-recipe {delayed,tensorwise,blockwise,mxfp8} (default delayed)
  int64_t fp8_amax_history_len = 1;       // --fp8-amax-history-len (delayed)
  std::string fp8_amax_compute_algo = "most_recent";  // --fp8-amax-compute-algo {most_recent,max} (delayed)
  int64_t fp8_margin = 0;                             // --fp8-margin (delayed)
  std::optional<std::string> fp4_format;              // --fp4-format e2m1
  std::optional<std::string> fp4_recipe;              // --fp4-recipe nvfp4 (the default with --fp4-format)
  bool fp8_param_gather = false;                      // --fp8-param-gather
  bool fp4_param_gather = false;                      // --fp4-param-gather

  // Run control and logging.
  int64_t seed = 1234;         // --seed
  int64_t log_interval = 100;  // --log-interval
  // --eval-interval; unset (Megatron's default None): no evaluation during training, only after it.
  std::optional<int64_t> eval_interval;
  int64_t eval_iters = 100;     // --eval-iters
  bool log_throughput = false;  // --log-throughput
  // Megatron's router traces (moe/router_trace.h).
  struct RoutingTrace {
    std::string path;                           // --moe-routing-trace-path (empty: none)
    std::optional<int64_t> max_training_iters;  // --moe-routing-trace-max-training-iters (unset: --train-iters)
    bool capture_logits = false;                // --moe-routing-trace-capture-logits
    bool capture_hidden_states = false;         // --moe-routing-trace-capture-hidden-states
    bool dump_weights = false;                  // --moe-routing-trace-dump-weights
  } moe_routing_trace;
  bool log_params_norm = false;        // --log-params-norm
  bool log_num_zeros_in_grad = false;  // --log-num-zeros-in-grad
  // TensorBoard event files, written by the last rank as Megatron's SummaryWriter (train/tensorboard_log.h).
  std::string tensorboard_dir;                     // --tensorboard-dir (empty: none)
  int64_t tensorboard_log_interval = 1;            // --tensorboard-log-interval
  int64_t tensorboard_queue_size = 1000;           // --tensorboard-queue-size
  bool log_timers_to_tensorboard = false;          // --log-timers-to-tensorboard
  bool log_loss_scale_to_tensorboard = true;       // --no-log-loss-scale-to-tensorboard
  bool log_validation_ppl_to_tensorboard = false;  // --log-validation-ppl-to-tensorboard
  bool log_memory_to_tensorboard = false;          // --log-memory-to-tensorboard
  bool log_world_size_to_tensorboard = false;      // --log-world-size-to-tensorboard
  bool log_progress = false;                       // --log-progress: <--save>/progress.txt (train/progress_log.h)
  // The expert-collapse alarm (moecore's; train/expert_collapse.h).
  double moe_collapse_min_load_ratio = 0.1;  // --moe-collapse-min-load-ratio (0: off)
  double moe_collapse_max_load_ratio = 0.0;  // --moe-collapse-max-load-ratio (0: off)
  int64_t moe_collapse_intervals = 3;        // --moe-collapse-intervals

  // Data and tokenizer.
  std::vector<std::string> data_path;  // --data-path: "prefix", "p1 p2 ...", or "w1 p1 w2 p2 ..."
  bool mock_data = false;              // --mock-data
  // Whole variable-length samples (train/packed_samples.h): --sample-data-path (moecore's), packed by Megatron-RL's
  // packer with --rl-use-sequence-packing, --rl-sequence-packing-max-sequences-per-bin, --rl-sequence-packing-algo;
  // --rl-microbatch-order serpentine (moecore's) runs each rank's bins small-large-small by attention cost.
  std::string sample_data_path;
  bool rl_use_sequence_packing = false;
  int64_t rl_sequence_packing_max_sequences_per_bin = 50;
  std::string rl_sequence_packing_algo = "fifo";
  std::string rl_microbatch_order = "packing";
  // Dynamic context parallelism (Megatron's --hybrid-context-parallel, --max-seqlen-per-dp-cp-rank; train_step.cpp):
  // each whole sample runs on the smallest power-of-two group of the DP x CP ranks that holds it.
  bool hybrid_context_parallel = false;
  int64_t max_seqlen_per_dp_cp_rank = 0;
  int64_t mock_max_sequence_length = 4096;  // --mock-max-sequence-length (moecore): mock documents' longest length
  std::string split;                        // --split, e.g. "969, 30, 1" (empty with --mock-data and no --split)
  std::string data_cache_path;              // --data-cache-path (empty = none)
  bool eod_mask_loss = false;               // --eod-mask-loss
  bool reset_position_ids = false;          // --reset-position-ids (rotary positions restart in every document)
  bool reset_attention_mask = false;        // --reset-attention-mask (no attention across documents)
  std::string tokenizer_type;               // --tokenizer-type: GPT2BPETokenizer or NullTokenizer
  std::string vocab_file;                   // --vocab-file
  std::string merge_file;                   // --merge-file
  std::optional<int64_t> vocab_size;        // --vocab-size (NullTokenizer: vocabulary size before EOD and padding)

  // Mixture of Experts: the rest lives in model.moe.
  std::string moe_layer_freq = "1";                     // --moe-layer-freq text, expanded into moe_layer_pattern
  std::string moe_token_dispatcher_type = "allgather";  // --moe-token-dispatcher-type
  std::string moe_flex_dispatcher_backend = "mpiep";    // --moe-flex-dispatcher-backend
  bool calculate_per_token_loss = false;                // --calculate-per-token-loss
  // Router replay (moe/routing_replay.h): --moe-enable-routing-replay and the recording the training forwards replay.
  bool moe_enable_routing_replay = false;
  std::string moe_routing_replay_file;  // --moe-routing-replay-file
  // --moe-router-padding-for-quantization / --moe-router-padding-for-fp8 (finalize sets model.moe's multiple).
  bool moe_router_padding_for_quantization = false;

  // Parallelism: the layout's sizes (TP, PP, CP, EP, ETP, the rank order of --use-tp-pp-dp-mapping) and the world
  // size, which comes from the launcher (mpirun -np N). ETP is set to the TP size after parsing unless given.
  ParallelSizes parallel;
  // The pipeline split (pipeline/pipeline_layout.h): which decoder layers each pipeline rank and virtual stage holds;
  // pipeline_layout(args) builds it.
  PipelineSplitFlags pipeline_split;
  int64_t virtual_pipeline_model_parallel_size = 1;  // derived: virtual stages per rank (1: none)
  int64_t microbatch_group_size_per_vp_stage = 0;    // --microbatch-group-size-per-virtual-pipeline-stage (0: PP)
  int64_t data_parallel_size = 1;                    // derived: world / (TP * PP * CP)
  bool sequence_parallel = false;                    // --sequence-parallel
  bool use_distributed_optimizer = false;            // --use-distributed-optimizer
  bool overlap_grad_reduce = false;                  // --overlap-grad-reduce
  bool overlap_param_gather = false;                 // --overlap-param-gather
  int64_t ddp_bucket_size = 0;                       // --ddp-bucket-size (0: Megatron's default)
  bool use_megatron_fsdp = false;                    // --use-megatron-fsdp (forces use_distributed_optimizer)
  // --data-parallel-sharding-strategy: no_shard, optim, optim_grads or optim_grads_params (Megatron's CLI default).
  std::string data_parallel_sharding_strategy = "optim_grads_params";
  std::string megatron_fsdp_version = "1";    // --megatron-fsdp-version (2, the fully_shard API, is not implemented)
  double distributed_timeout_minutes = 10.0;  // --distributed-timeout-minutes: bound of every collective wait

  // Checkpointing (megatron/training/arguments.py _add_checkpointing_args; semantics in train/checkpointing.h).
  std::string save;                                     // --save DIR
  std::string load;                                     // --load DIR (a save folder, or a HuggingFace folder)
  std::optional<int64_t> save_interval;                 // --save-interval / --persistent-save-interval
  bool no_save_optim = false;                           // --no-save-optim
  bool no_save_rng = false;                             // --no-save-rng
  bool no_load_optim = false;                           // --no-load-optim
  bool no_load_rng = false;                             // --no-load-rng
  bool finetune = false;                                // --finetune
  std::optional<int64_t> ckpt_step;                     // --ckpt-step
  bool exit_on_missing_checkpoint = false;              // --exit-on-missing-checkpoint
  bool async_save = false;                              // --async-save
  bool continue_after_failed_save = false;              // --ckpt-save-failure continue (moecore; default stop)
  bool save_overwrite_other_model = false;              // --save-overwrite-other-model (moecore)
  std::optional<int64_t> non_persistent_save_interval;  // --non-persistent-save-interval
  std::string non_persistent_ckpt_type;                 // --non-persistent-ckpt-type (global)
  std::optional<int64_t> exit_interval;                 // --exit-interval
  std::optional<double> exit_duration_in_mins;          // --exit-duration-in-mins
  bool exit_signal_handler = false;                     // --exit-signal-handler
  std::string exit_signal = "SIGTERM";                  // --exit-signal: the signal the handler catches
  std::string non_persistent_global_ckpt_dir;       // --non-persistent-global-ckpt-dir (default SAVE/non_persistent)
  bool override_opt_param_scheduler = false;        // --override-opt_param-scheduler
  bool use_checkpoint_opt_param_scheduler = false;  // --use-checkpoint-opt_param-scheduler
  bool moe_use_upcycling = false;                   // --moe-use-upcycling
  int64_t moe_upcycling_granularity = 1;            // --moe-upcycling-granularity

  // Profiling (Megatron's _add_profiling_args): a Chrome / Perfetto trace of iterations
  // (profile_step_start, profile_step_end] on the ranks listed, written to --profile-dir/trace_rank<R>.json.
  bool profile = false;                   // --profile
  int64_t profile_step_start = 10;        // --profile-step-start
  int64_t profile_step_end = 12;          // --profile-step-end
  std::vector<int64_t> profile_ranks{0};  // --profile-ranks
  std::string profile_dir = ".";          // --profile-dir (moecore)

  // moecore-only (see the header comment).
  std::string export_hf_dir;   // --export-hf
  std::string sample_prompt;   // --sample-prompt
  int64_t sample_tokens = 32;  // --sample-tokens
  int64_t threads = 0;         // --threads

  // --help / -h was given: nothing else was parsed or validated.
  bool help_requested = false;
};

// Parses the arguments that follow `moecore train`. Throws ConfigError with one line on any problem.
// world_size: the number of processes launched (the data-parallel size is derived from it).
TrainingArgs parse_train_args(const std::vector<std::string>& args, int world_size = 1);

// One line per implemented flag: name, value placeholder and a short description (for --help).
std::string train_flags_help();

// Every implemented flag name (with "--"), in table order.
std::vector<std::string> implemented_train_flags();
// Whether a command-line token is a flag (argparse's rule: not a value such as -3 or -1,1,1).
bool looks_like_train_flag(std::string_view token);

// What the pipeline splits: the model's decoder layers and MTP depths over args.parallel's PP ranks.
PipelineShape pipeline_shape(const TrainingArgs& args);
// The pipeline split these arguments describe; throws LayoutError (one line) on a bad split.
PipelineLayout pipeline_layout(const TrainingArgs& args);

// Megatron's padded vocabulary: the smallest multiple of make_vocab_size_divisible_by * TP that holds `vocab_size`.
int64_t padded_vocab_size(int64_t vocab_size, const TrainingArgs& args);

// The learning-rate schedule these arguments describe.
LRScheduleConfig lr_schedule_config(const TrainingArgs& args);

}  // namespace moecore
