// Derived defaults and cross-flag validation of `moecore train` (Megatron's validate_args, for the implemented flags).
#include "moecore/config/arguments_finalize.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string_view>
#include <utility>

#include "moecore/moe/routing_padding.h"
#include "moecore/pipeline/pipeline_schedule.h"
#include "moecore/quant/delayed_scaling.h"
#include "moecore/quant/recipe.h"

namespace moecore::detail {
namespace {

void require(const bool ok, const std::string& message) {
  if (!ok) throw ConfigError(message);
}

std::string str(const int64_t value) { return std::to_string(value); }
std::string str(const int value) { return std::to_string(value); }

std::string str(const double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}

bool parses_as_number(std::string_view text) {
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  double value = 0.0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  return !text.empty() && error == std::errc() && end == text.data() + text.size();
}

double to_number(std::string_view text) {
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  double value = 0.0;
  std::from_chars(text.data(), text.data() + text.size(), value);
  return value;
}

std::string trim(std::string_view text) {
  while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  while (!text.empty() && text.back() == ' ') text.remove_suffix(1);
  return std::string(text);
}

void check_required(const std::set<std::string>& given) {
  std::string missing;
  for (const char* flag : {"--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--train-iters",
                           "--lr", "--micro-batch-size"}) {
    if (!given.contains(flag)) missing += (missing.empty() ? "" : ", ") + std::string(flag);
  }
  require(missing.empty(), "missing required flag(s): " + missing);
}

// Multi-latent attention and the rotary embeddings (Megatron's MLATransformerConfig and
// TransformerConfig.__post_init__ checks); moecore refuses the flags Megatron would accept and not use.
void finalize_attention(TrainingArgs& args, const std::set<std::string>& given) {
  ModelConfig& model = args.model;
  const PositionEmbedding position = model.position_embedding_type;
  if (args.multi_latent_attention) {
    require(!args.rotary_interleaved, "rotary_interleaved does not work with multi_latent_attention.");
    require(!args.group_query_attention, "--multi-latent-attention cannot be combined with --group-query-attention");
    require(!given.contains("--kv-channels"),
            "--kv-channels is not used by --multi-latent-attention (its heads are --qk-head-dim + "
            "--qk-pos-emb-head-dim wide for queries and keys, --v-head-dim for values)");
    require(!given.contains("--q-lora-rank") || args.mla.q_lora_rank > 0, "--q-lora-rank must be positive");
    require(position != PositionEmbedding::kYarn,
            "--position-embedding-type yarn does not apply to --multi-latent-attention (its rotary embedding is "
            "--rope-type; use --position-embedding-type rope)");
    model.mla = args.mla;
  } else {
    for (const char* flag :
         {"--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--rope-type"}) {
      require(!given.contains(flag), std::string(flag) + " requires --multi-latent-attention");
    }
  }
  require(!args.rotary_interleaved, "--rotary-interleaved is not implemented yet");
  const bool mla_yarn = model.mla && model.mla->rope_type == RopeType::kYarn;
  const bool mla_rope = model.mla && model.mla->rope_type == RopeType::kRope;
  if (position != PositionEmbedding::kYarn && !mla_yarn) {
    for (const char* flag : {"--yarn-original-max-position-embeddings", "--yarn-beta-fast", "--yarn-beta-slow",
                             "--yarn-correction-range-round-to-int", "--no-yarn-correction-range-round-to-int"}) {
      require(!given.contains(flag), std::string(flag) +
                                         " only applies with --position-embedding-type yarn or "
                                         "--multi-latent-attention's --rope-type yarn");
    }
  }
  for (const char* flag : {"--rotary-scaling-factor", "--mscale", "--mscale-all-dim"}) {
    require(!given.contains(flag) || position == PositionEmbedding::kYarn || model.mla,
            std::string(flag) + " only applies with --position-embedding-type yarn or --multi-latent-attention");
  }
  // MultiLatentAttention builds YarnRotaryEmbedding without correction_range_round_to_int: always rounded.
  require(!given.contains("--no-yarn-correction-range-round-to-int") || !model.mla,
          "--no-yarn-correction-range-round-to-int does not apply to --multi-latent-attention (Megatron's MLA always "
          "rounds YaRN's correction range)");
  const bool rotary = position == PositionEmbedding::kRope || position == PositionEmbedding::kYarn || model.mla;
  require(!given.contains("--rotary-base") || rotary,
          "--rotary-base only applies with --position-embedding-type rope or yarn, or --multi-latent-attention");
  // YarnRotaryEmbedding rotates every channel whatever --rotary-percent says.
  require(!given.contains("--rotary-percent") || position == PositionEmbedding::kRope || mla_rope,
          "--rotary-percent only applies with --position-embedding-type rope or --multi-latent-attention's "
          "--rope-type rope");
}

// Mixture of Experts: Megatron's defaults that depend on other flags, then MoEConfig::validate. Runs after the dense
// --ffn-hidden-size default (the expert size defaults to it).
void finalize_moe(TrainingArgs& args, const std::set<std::string>& given) {
  ModelConfig& model = args.model;
  MoEConfig& moe = model.moe;
  require(moe.num_experts >= 0,
          "--num-experts must be positive, or 0 for a dense model (got " + str(moe.num_experts) + ")");
  if (!moe.enabled()) {
    // Megatron ignores most --moe-* flags on a dense model; a flag that silently does nothing is an error here.
    for (const std::string& flag : given) {
      require(!flag.starts_with("--moe-"), flag + " requires --num-experts (a positive number of experts)");
    }
    return;
  }
  if (!given.contains("--moe-ffn-hidden-size")) moe.ffn_hidden_size = model.ffn_hidden_size;
  if (given.contains("--moe-shared-expert-intermediate-size")) {
    require(moe.shared_expert_intermediate_size > 0, "--moe-shared-expert-intermediate-size must be positive (got " +
                                                         str(moe.shared_expert_intermediate_size) + ")");
  }
  moe.moe_layer_pattern = parse_moe_layer_freq(args.moe_layer_freq, model.num_layers);
  moe.validate(model.num_layers);
  // Megatron's SharedExpertMLP asserts add_bias_linear == False (shared_experts.py): shared experts have no bias.
  require(moe.shared_expert_intermediate_size == 0 || !model.add_bias_linear,
          "--moe-shared-expert-intermediate-size requires --disable-bias-linear: shared experts have no bias (as "
          "Megatron)");
  // Megatron's topk_routing_with_score_function reads use_pre_softmax only for softmax scores; its DeepSeek-V3
  // recipes pass it with sigmoid. Accepted, with one warning per process (as Python's warnings.warn).
  static std::atomic<bool> warned_pre_softmax{false};
  if (moe.pre_softmax && moe.score_function != RouterScoreFunction::kSoftmax && !warned_pre_softmax.exchange(true)) {
    std::cerr << "warning: --moe-router-pre-softmax has no effect with --moe-router-score-function "
              << to_string(moe.score_function) << '\n';
  }
}

void finalize_model(TrainingArgs& args, const std::set<std::string>& given) {
  ModelConfig& model = args.model;
  require(model.num_layers > 0, "--num-layers must be positive (got " + str(model.num_layers) + ")");
  require(model.hidden_size > 0, "--hidden-size must be positive (got " + str(model.hidden_size) + ")");
  require(model.num_attention_heads > 0,
          "--num-attention-heads must be positive (got " + str(model.num_attention_heads) + ")");
  require(model.seq_length > 0, "--seq-length must be positive (got " + str(model.seq_length) + ")");
  require(!(given.contains("--swiglu") && given.contains("--squared-relu")),
          "--swiglu and --squared-relu cannot be used together");

  // Megatron passes num_query_groups only with --group-query-attention (else it becomes the head count).
  if (args.group_query_attention) {
    if (!given.contains("--num-query-groups")) model.num_query_groups = 1;
    require(model.num_query_groups > 0,
            "--num-query-groups must be positive (got " + str(model.num_query_groups) + ")");
    require(model.num_attention_heads % model.num_query_groups == 0,
            "--num-attention-heads (" + str(model.num_attention_heads) + ") must be divisible by --num-query-groups (" +
                str(model.num_query_groups) + ")");
  } else {
    require(!given.contains("--num-query-groups"),
            "--num-query-groups requires --group-query-attention (Megatron ignores it otherwise)");
    model.num_query_groups = model.num_attention_heads;
  }

  if (!given.contains("--kv-channels")) {
    require(model.hidden_size % model.num_attention_heads == 0,
            "--hidden-size (" + str(model.hidden_size) + ") must be divisible by --num-attention-heads (" +
                str(model.num_attention_heads) + ") unless --kv-channels is given");
    model.kv_channels = model.hidden_size / model.num_attention_heads;
  }

  if (!given.contains("--ffn-hidden-size")) {
    model.ffn_hidden_size =
        model.activation == Activation::kSwiGLU
            ? static_cast<int64_t>((4.0 * static_cast<double>(model.hidden_size) * 2.0 / 3.0) / 64.0) * 64
            : 4 * model.hidden_size;
    require(model.ffn_hidden_size > 0, "--hidden-size " + str(model.hidden_size) +
                                           " gives an empty SwiGLU MLP (int(8*hidden/3/64)*64 = 0): give "
                                           "--ffn-hidden-size");
  }

  if (!given.contains("--max-position-embeddings")) {
    require(model.position_embedding_type != PositionEmbedding::kLearnedAbsolute,
            "--max-position-embeddings is required with --position-embedding-type learned_absolute (the default)");
    model.max_position_embeddings = model.seq_length;
  }
  // Megatron asserts this for every position-embedding type.
  require(model.max_position_embeddings >= model.seq_length,
          "--max-position-embeddings (" + str(model.max_position_embeddings) + ") must be at least --seq-length (" +
              str(model.seq_length) + ")");

  finalize_attention(args, given);

  finalize_moe(args, given);

  require(args.make_vocab_size_divisible_by > 0,
          "--make-vocab-size-divisible-by must be positive (got " + str(args.make_vocab_size_divisible_by) + ")");

  // Every ModelConfig check except the vocabulary, which the trainer fills from the tokenizer and validates then.
  ModelConfig without_vocab = model;
  if (without_vocab.vocab_size == 0) without_vocab.vocab_size = 1;
  without_vocab.validate();
}

// Megatron's pipeline split checks (pipeline/pipeline_layout.h) and the virtual pipeline size. `moecore train` does
// not run pipeline parallelism yet: after the split flags are validated, PP > 1 is rejected.
void finalize_pipeline(TrainingArgs& args) {
  try {
    args.virtual_pipeline_model_parallel_size = pipeline_layout(args).virtual_pipeline_size();
  } catch (const LayoutError& e) {
    throw ConfigError(e.what());
  }
}

// Megatron-FSDP (Megatron's validate_args under use_megatron_fsdp). v1 forces the distributed optimizer; the
// optimizer must be sgd or adam (moecore has adam). Where moecore's FSDP differs from Megatron's, one line says so.
void finalize_fsdp(TrainingArgs& args, const std::set<std::string>& given) {
  if (!args.use_megatron_fsdp) {
    for (const char* flag : {"--data-parallel-sharding-strategy", "--megatron-fsdp-version"}) {
      require(!given.contains(flag), std::string(flag) + " needs --use-megatron-fsdp");
    }
    return;
  }
  args.use_distributed_optimizer = true;  // "Megatron-FSDP v1 is only compatible with --use-distributed-optimizer"
  require(args.optimizer == "sgd" || args.optimizer == "adam",
          "Megatron-FSDP does not support the " + args.optimizer + " optimizer yet.");
  // Megatron-FSDP's gradients have --megatron-fsdp-main-grads-dtype (default auto: the weights' dtype; the flag
  // itself is not implemented), not the DDP buffer's dtype these flags set.
  for (const char* flag : {"--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16", "--main-grads-dtype"}) {
    require(!given.contains(flag),
            std::string(flag) +
                " sets the DDP gradient buffer's dtype; with --use-megatron-fsdp gradients "
                "take the weights' dtype (Megatron-FSDP's --megatron-fsdp-main-grads-dtype auto)");
  }
  require(!args.use_precision_aware_optimizer || args.model.params_dtype == DType::kF32,
          "--use-precision-aware-optimizer with --use-megatron-fsdp and --bf16 / --fp16 is not implemented yet");
  require(!args.use_precision_aware_optimizer || args.data_parallel_sharding_strategy != "no_shard",
          "--use-precision-aware-optimizer with --data-parallel-sharding-strategy no_shard: moecore keeps no_shard's "
          "Adam states whole in fp32 (its reduced formats live on the distributed optimizer's shards)");
  require(!args.fp8_param_gather && !args.fp4_param_gather,
          "--use-megatron-fsdp with --fp8-param-gather / --fp4-param-gather: moecore's Megatron-FSDP gathers fp32 "
          "parameters only");
}

// Context parallelism (Megatron's validate_args and TransformerEngine's checks): the load-balanced split needs
// 2 x CP chunks of every sequence; a2a splits each tensor-parallel rank's heads over CP.
void finalize_context_parallel(const TrainingArgs& args) {
  const ModelConfig& model = args.model;
  const int64_t cp = args.parallel.context_parallel_size, tp = args.parallel.tensor_model_parallel_size;
  require(model.cp_comm_type.size() == 1 || static_cast<int64_t>(model.cp_comm_type.size()) == model.num_layers,
          "--cp-comm-type takes one value or one per layer (" + str(model.num_layers) + "), got " +
              str(static_cast<int64_t>(model.cp_comm_type.size())));
  if (cp == 1) return;
  require(model.seq_length % (2 * cp) == 0, "--seq-length (" + str(model.seq_length) +
                                                ") must be divisible by 2 x --context-parallel-size (" + str(cp) + ")");
  for (const std::string& type : model.cp_comm_type) {
    if (type != "a2a") continue;
    require(model.num_attention_heads % (tp * cp) == 0 && model.num_query_groups % (tp * cp) == 0,
            "--cp-comm-type a2a needs --num-attention-heads (" + str(model.num_attention_heads) +
                ") and --num-query-groups (" + str(model.num_query_groups) +
                ") divisible by --tensor-model-parallel-size x --context-parallel-size (" + str(tp * cp) + ")");
  }
}

// Megatron's parallel-size checks; the layout itself validates the grid (LayoutError carries one line).
void finalize_parallel(TrainingArgs& args, const std::set<std::string>& given) {
  if (!given.contains("--expert-tensor-parallel-size")) {
    args.parallel.expert_tensor_parallel_size = args.parallel.tensor_model_parallel_size;
  }
  if (args.parallel.tensor_model_parallel_size == 1) args.sequence_parallel = false;  // as Megatron
  try {
    args.data_parallel_size = checked_data_parallel_size(args.parallel);
  } catch (const LayoutError& e) {
    throw ConfigError(e.what());
  }
  const ModelConfig& model = args.model;
  const int64_t tp = args.parallel.tensor_model_parallel_size;
  finalize_context_parallel(args);
  // TransformerConfig.__post_init__'s text.
  require(model.num_attention_heads % tp == 0, "num_attention_heads (" + str(model.num_attention_heads) +
                                                   ") must be a multiple of tensor_model_parallel_size (" + str(tp) +
                                                   ").");
  require(model.num_query_groups % tp == 0,
          "--num-attention-heads (" + str(model.num_attention_heads) + ") and --num-query-groups (" +
              str(model.num_query_groups) + ") must be divisible by --tensor-model-parallel-size (" + str(tp) + ")");
  require(model.ffn_hidden_size % tp == 0, "--ffn-hidden-size (" + str(model.ffn_hidden_size) +
                                               ") must be divisible by --tensor-model-parallel-size (" + str(tp) + ")");
  require(tp == 1 || !(args.sequence_parallel || model.moe.enabled()) || model.seq_length % tp == 0,
          "--seq-length (" + str(model.seq_length) + ") must be divisible by --tensor-model-parallel-size (" + str(tp) +
              ") with --sequence-parallel or MoE layers");
  const MoEConfig& moe = model.moe;
  const int64_t ep = args.parallel.expert_model_parallel_size, etp = args.parallel.expert_tensor_parallel();
  if (!moe.enabled()) {
    require(ep == 1, "--expert-model-parallel-size " + str(ep) + " needs a MoE model (--num-experts)");
  } else {
    require(moe.num_experts % ep == 0, "--num-experts (" + str(moe.num_experts) +
                                           ") must be divisible by --expert-model-parallel-size (" + str(ep) + ")");
    require(moe.ffn_hidden_size % etp == 0, "--moe-ffn-hidden-size (" + str(moe.ffn_hidden_size) +
                                                ") must be divisible by --expert-tensor-parallel-size (" + str(etp) +
                                                ")");
    require(!args.model.add_bias_linear || etp == 1,
            "MoE expert biases need --expert-tensor-parallel-size 1 (as Megatron); add --disable-bias-linear");
    require(moe.shared_expert_intermediate_size % args.parallel.tensor_model_parallel_size == 0,
            "--moe-shared-expert-intermediate-size (" + str(moe.shared_expert_intermediate_size) +
                ") must be divisible by --tensor-model-parallel-size (" +
                str(args.parallel.tensor_model_parallel_size) + ")");
  }
  require(!args.loss_scale || (std::isfinite(*args.loss_scale) && *args.loss_scale > 0.0 &&
                               std::isfinite(static_cast<float>(*args.loss_scale))),
          "--loss-scale must be a positive number that fits fp32");
  // The scale multiplies the gradients in the weights' dtype: below fp16's smallest subnormal 2^-24 even a gradient of
  // magnitude 1 underflows to 0 (fp16), and the unscaling factor 1 / scale leaves fp32 before 2^-128 (Inf x 0 = NaN,
  // every iteration skipped). A scale below 1 only guards against overflow; 2^-24 is far beyond any real need.
  constexpr double kMinLossScale = 0x1p-24;
  require(!args.loss_scale || *args.loss_scale >= kMinLossScale,
          "--loss-scale " + str(args.loss_scale.value_or(0.0)) +
              " is below 2^-24 (5.96e-08): scaled gradients would underflow to 0 (fp16's smallest subnormal is 2^-24)");
  require(!args.overlap_param_gather || args.use_distributed_optimizer,
          "--overlap-param-gather requires --use-distributed-optimizer (as Megatron)");
  require(args.ddp_bucket_size >= 0, "--ddp-bucket-size must be non-negative (got " + str(args.ddp_bucket_size) + ")");
}

// Mixed precision and loss scaling (Megatron's arguments.py validate_args and optimizer/__init__.py).
void finalize_precision(const TrainingArgs& args, const std::set<std::string>& given) {
  require(!(given.contains("--fp16") && given.contains("--bf16")), "--fp16 and --bf16 are mutually exclusive");
  require(!args.grad_reduce_in_bf16 || args.model.params_dtype == DType::kBF16,
          "--grad-reduce-in-bf16 needs --bf16 (fp32 and fp16 gradients are not reduced in bf16)");
  require(!(args.grad_reduce_in_bf16 && args.accumulate_allreduce_grads_in_fp32),
          "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict each other");
  const bool half = args.model.params_dtype == DType::kF16;
  // Megatron scales the loss only in its fp16 / bf16 optimizers and the distributed optimizer; its fp32 optimizer
  // would take --loss-scale and ignore it.
  require(!args.loss_scale || half || args.model.params_dtype == DType::kBF16 || args.use_distributed_optimizer,
          "--loss-scale needs --fp16, --bf16 or --use-distributed-optimizer (the fp32 optimizer does not scale the "
          "loss)");
  for (const char* flag : {"--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis"}) {
    require(!given.contains(flag) || (half && !args.loss_scale),
            std::string(flag) + " sets fp16's dynamic loss scaling: it needs --fp16 without --loss-scale");
  }
  if (half && !args.loss_scale) {
    try {
      (void)GradScaler::dynamic(args.dynamic_loss_scale);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(e.what());
    }
  }
}

// The precision-aware optimizer (Megatron's OptimizerConfig.__post_init__, optimizer/__init__.py and validate_args).
void finalize_precision_aware_optimizer(const TrainingArgs& args) {
  const std::pair<const char*, const std::string*> dtypes[] = {{"--main-grads-dtype", &args.main_grads_dtype},
                                                               {"--main-params-dtype", &args.main_params_dtype},
                                                               {"--exp-avg-dtype", &args.exp_avg_dtype},
                                                               {"--exp-avg-sq-dtype", &args.exp_avg_sq_dtype}};
  if (!args.use_precision_aware_optimizer) {
    for (const auto& [flag, value] : dtypes) {
      require(*value == "fp32", std::string(flag) +
                                    " can only be fp32 when not using precision-aware optimizer (add "
                                    "--use-precision-aware-optimizer)");
    }
    return;
  }
  require(args.optimizer == "adam", "--use-precision-aware-optimizer only supported with adam");
  require(
      args.use_distributed_optimizer,
      "--use-precision-aware-optimizer only supported with distributed optimizer (add --use-distributed-optimizer)");
  if (args.main_grads_dtype == "bf16") {
    // Megatron's buffer holds the weights' dtype unless it accumulates in fp32: bf16 main grads exist only with --bf16.
    require(args.model.params_dtype == DType::kBF16,
            "--main-grads-dtype bf16 needs --bf16 (fp32 and fp16 weights keep gradients of their own dtype)");
    require(!args.accumulate_allreduce_grads_in_fp32,
            "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set");
  }
  require(args.main_params_dtype == "fp32" || args.model.params_dtype != DType::kF32,
          "--main-params-dtype fp16 needs --bf16 or --fp16 (fp32 weights are their own main parameters)");
}

// FP8 / FP4 linear layers (Megatron's TransformerConfig.__post_init__ and validate_args): the flags' pairing, the
// first / last high-precision layers, and widths the recipe's blocks cover.
void finalize_quantization(TrainingArgs& args, const std::set<std::string>& given) {
  ModelConfig& model = args.model;
  require(!(args.fp8_format && args.fp4_format),
          "--fp4-format and --fp8-format cannot be used simultaneously; choose one");
  require(!args.fp8_recipe || args.fp8_format, "--fp8-recipe needs --fp8-format (e4m3 or hybrid)");
  // Megatron's default recipe is delayed (transformer_config.py: fp8_recipe = "delayed").
  const bool delayed = args.fp8_format && args.fp8_recipe.value_or("delayed") == "delayed";
  for (const char* flag : {"--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-margin"}) {
    require(!given.contains(flag) || delayed,
            std::string(flag) + " sets delayed scaling: it needs --fp8-format with --fp8-recipe delayed (the default)");
  }
  require(args.fp8_amax_history_len >= 1,
          "--fp8-amax-history-len must be at least 1 (got " + str(args.fp8_amax_history_len) + ")");
  // Both --fp8-format choices quantize the forward operands to E4M3, the narrower format: its range bounds the margin.
  const int64_t margin_limit = quant::delayed_margin_limit(quant::ElementFormat::kE4M3);
  require(std::abs(args.fp8_margin) <= margin_limit,
          "--fp8-margin must be between -" + str(margin_limit) + " and " + str(margin_limit) + " (got " +
              str(args.fp8_margin) +
              "): scaled values are E4M3's max 448 x 2^-margin, and E4M3 spans 2^-9 .. 448, "
              "so beyond that a positive margin quantizes every element to 0 and a negative one saturates nearly all");
  // TransformerConfig.__post_init__: per-layer autocasts would break the block-wide amax reduction.
  require(!(delayed && model.first_last_layers_bf16),
          "delayed scaling does not support first / last layer in BF16: --first-last-layers-bf16 needs --fp8-recipe "
          "tensorwise, blockwise or mxfp8");
  require(!args.fp4_recipe || args.fp4_format, "--fp4-recipe needs --fp4-format e2m1");
  // Megatron: TransformerConfig.__post_init__ ("fp8_param must be used together with fp8 mode.") and validate_args
  // (the distributed optimizer; FSDP and inference are not in moecore). --fp4-param-gather needs it too here.
  require(!args.fp8_param_gather || args.fp8_format, "--fp8-param-gather must be used together with --fp8-format");
  require(!args.fp4_param_gather || args.fp4_format, "--fp4-param-gather must be used together with --fp4-format");
  require(!args.fp8_param_gather || args.use_distributed_optimizer,
          "--fp8-param-gather only supported with distributed optimizer (--use-distributed-optimizer)");
  require(!args.fp4_param_gather || args.use_distributed_optimizer,
          "--fp4-param-gather only supported with distributed optimizer (--use-distributed-optimizer)");
  const bool quantized = args.fp8_format || args.fp4_format;
  require(!model.first_last_layers_bf16 || quantized,
          "--first-last-layers-bf16 needs --fp8-format or --fp4-format (without them every layer is high precision)");
  for (const char* flag : {"--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"}) {
    require(!given.contains(flag) || model.first_last_layers_bf16,
            std::string(flag) + " needs --first-last-layers-bf16");
  }
  // TransformerConfig.__post_init__: "fp8/fp4 must be specified when moe_router_padding_for_quantization is True".
  require(!args.moe_router_padding_for_quantization || quantized,
          "--moe-router-padding-for-quantization needs --fp8-format or --fp4-format");
  model.quantization.reset();
  model.moe.router_padding_multiple = 0;
  if (!quantized) return;
  quant::QuantizedLinearConfig config;
  config.recipe =
      quant::parse_recipe(args.fp8_format ? args.fp8_recipe.value_or("delayed") : args.fp4_recipe.value_or("nvfp4"));
  if (args.fp8_format) config.format = quant::parse_fp8_format(*args.fp8_format);
  config.delayed.amax_history_len = args.fp8_amax_history_len;
  config.delayed.amax_compute_algo = quant::parse_amax_compute_algo(args.fp8_amax_compute_algo);
  config.delayed.margin = static_cast<int>(args.fp8_margin);
  config.seed = static_cast<uint64_t>(args.seed);
  if (model.first_last_layers_bf16) {
    // Megatron bounds each count by the layers of one pipeline stage.
    const int64_t per_stage = model.num_layers / args.parallel.pipeline_model_parallel_size;
    for (const auto& [flag, count] : {std::pair{"--num-layers-at-start-in-bf16", model.num_layers_at_start_in_bf16},
                                      std::pair{"--num-layers-at-end-in-bf16", model.num_layers_at_end_in_bf16}}) {
      require(count >= 0 && count <= per_stage, std::string(flag) + " (" + str(count) +
                                                    ") must be between 0 and the layers per pipeline stage (" +
                                                    str(per_stage) + ")");
    }
  }
  // mxfp8 blocks 32 elements along either dimension of every operand, nvfp4 16 (quant::check_quantizable); the
  // token dimension is padded, the feature widths of this rank's linear layers must fit.
  const int64_t multiple = config.recipe == quant::Recipe::kMxfp8   ? 32
                           : config.recipe == quant::Recipe::kNvfp4 ? 16
                                                                    : 1;
  if (multiple > 1) {
    const std::string recipe =
        (args.fp8_format ? "--fp8-recipe " : "--fp4-recipe ") + quant::recipe_name(config.recipe);
    const auto check = [&](const std::string& what, const int64_t width) {
      require(width % multiple == 0,
              recipe + " needs linear layer widths divisible by " + str(multiple) + ": " + what + " is " + str(width));
    };
    const int64_t tp = args.parallel.tensor_model_parallel_size;
    const int64_t swiglu = model.activation == Activation::kSwiGLU ? 2 : 1;
    check("--hidden-size", model.hidden_size);
    if (model.mla) {
      const MlaConfig& a = *model.mla;
      const int64_t heads = model.num_attention_heads / tp;
      if (a.q_lora_rank > 0) check("--q-lora-rank", a.q_lora_rank);
      check("--kv-lora-rank", a.kv_lora_rank);
      check("linear_kv_down_proj's width (--kv-lora-rank + --qk-pos-emb-head-dim)",
            a.kv_lora_rank + a.qk_pos_emb_head_dim);
      check("the query projection's width per tensor-parallel rank", heads * a.q_head_dim());
      check("linear_kv_up_proj's width per tensor-parallel rank", heads * (a.qk_head_dim + a.v_head_dim));
      check("the attention's projection width per tensor-parallel rank", heads * a.v_head_dim);
    } else {
      check("the attention's qkv width per tensor-parallel rank", model.qkv_out() / tp);
      check("the attention's projection width per tensor-parallel rank",
            model.num_attention_heads * model.kv_channels / tp);
    }
    check("--ffn-hidden-size per tensor-parallel rank", model.ffn_hidden_size / tp);
    check("fc1's width per tensor-parallel rank", swiglu * model.ffn_hidden_size / tp);
    if (model.moe.enabled()) {
      const int64_t etp = args.parallel.expert_tensor_parallel();
      check("--moe-ffn-hidden-size per expert-tensor-parallel rank", model.moe.ffn_hidden_size / etp);
      check("--moe-shared-expert-intermediate-size per tensor-parallel rank",
            model.moe.shared_expert_intermediate_size / tp);
    }
  }
  model.quantization = config;
  if (args.moe_router_padding_for_quantization) {
    model.moe.router_padding_multiple = align_size_for_quantization(config.recipe);
    model.moe.validate(model.num_layers);  // the dispatcher and capacity rules of the padding
  }
}

void finalize_training(TrainingArgs& args, const std::set<std::string>& given) {
  require(args.micro_batch_size > 0, "--micro-batch-size must be positive (got " + str(args.micro_batch_size) + ")");
  require(args.train_iters > 0, "--train-iters must be positive (got " + str(args.train_iters) + ")");
  require(args.distributed_timeout_minutes > 0.0,
          "--distributed-timeout-minutes must be positive (got " + str(args.distributed_timeout_minutes) + ")");
  const int64_t micro_times_dp = args.micro_batch_size * args.data_parallel_size;
  if (!given.contains("--global-batch-size")) args.global_batch_size = micro_times_dp;
  require(args.global_batch_size > 0, "--global-batch-size must be positive (got " + str(args.global_batch_size) + ")");
  require(args.global_batch_size % micro_times_dp == 0,
          "--global-batch-size (" + str(args.global_batch_size) + ") must be a multiple of --micro-batch-size (" +
              str(args.micro_batch_size) + ") times the data-parallel size (" + str(args.data_parallel_size) + ")");

  // The pipeline schedule's requirements on the micro-batches of one DP rank (Megatron's checks in schedules.py).
  const int64_t microbatches = args.global_batch_size / micro_times_dp;
  require(!given.contains("--microbatch-group-size-per-virtual-pipeline-stage") ||
              args.virtual_pipeline_model_parallel_size > 1,
          "--microbatch-group-size-per-virtual-pipeline-stage applies to the interleaved schedule only (set "
          "--num-virtual-stages-per-pipeline-rank, --num-layers-per-virtual-pipeline-stage or a layout with virtual "
          "stages)");
  check_pipeline_schedule_sizes(static_cast<int>(args.parallel.pipeline_model_parallel_size), 0,
                                static_cast<int>(args.virtual_pipeline_model_parallel_size), microbatches,
                                args.microbatch_group_size_per_vp_stage);

  require(args.adam_beta1 >= 0.0 && args.adam_beta1 < 1.0,
          "--adam-beta1 must be in [0, 1) (got " + str(args.adam_beta1) + ")");
  require(args.adam_beta2 >= 0.0 && args.adam_beta2 < 1.0,
          "--adam-beta2 must be in [0, 1) (got " + str(args.adam_beta2) + ")");
  require(args.adam_eps > 0.0, "--adam-eps must be positive (got " + str(args.adam_eps) +
                                   "): Adam divides by sqrt(exp_avg_sq) + eps, and exp_avg_sq is 0 wherever every "
                                   "gradient so far was 0");
  require(args.weight_decay >= 0.0, "--weight-decay must be non-negative (got " + str(args.weight_decay) + ")");
  require(args.weight_decay * args.lr < 1.0, "--weight-decay (" + str(args.weight_decay) + ") x --lr (" + str(args.lr) +
                                                 ") must be below 1: AdamW shrinks every weight by that fraction "
                                                 "each step");
  require(args.clip_grad >= 0.0, "--clip-grad must be non-negative (got " + str(args.clip_grad) + ")");

  // The samples and tokens the run reads, as the data loader will compute them.
  const auto product = [](const std::vector<std::pair<std::string, int64_t>>& factors, const std::string& what) {
    int64_t value = 1;
    std::string named;
    for (const auto& [name, factor] : factors) {
      named += (named.empty() ? "" : " x ") + name + " (" + str(factor) + ")";
      require(!__builtin_mul_overflow(value, factor, &value),
              named + " is more " + what + " than 64-bit integers count");
    }
    return value;
  };
  // Before the evaluation count divides by --eval-interval.
  require(args.log_interval > 0, "--log-interval must be positive (got " + str(args.log_interval) + ")");
  require(!args.eval_interval || *args.eval_interval > 0,
          "--eval-interval must be positive (got " + str(args.eval_interval.value_or(0)) + ")");
  require(args.eval_iters >= 0, "--eval-iters must be non-negative (got " + str(args.eval_iters) + ")");
  const int64_t eval_points = args.eval_interval ? args.train_iters / *args.eval_interval + 1 : 1;
  product({{"--train-iters", args.train_iters},
           {"--global-batch-size", args.global_batch_size},
           {"--seq-length", args.model.seq_length}},
          "tokens");
  product({{"evaluations", eval_points},
           {"--eval-iters", args.eval_iters},
           {"--global-batch-size", args.global_batch_size},
           {"--seq-length", args.model.seq_length}},
          "tokens");
}

void finalize_lr(TrainingArgs& args, const std::set<std::string>& given) {
  require(args.lr >= 0.0, "--lr must be non-negative (got " + str(args.lr) + ")");
  require(args.min_lr <= args.lr, "--min-lr (" + str(args.min_lr) + ") must not exceed --lr (" + str(args.lr) + ")");
  if (!given.contains("--lr-decay-iters")) args.lr_decay_iters = args.train_iters;
  if (args.lr_decay_style != LRDecayStyle::kWSD) {
    for (const char* flag : {"--lr-wsd-decay-iters", "--lr-wsd-decay-style"}) {
      require(!given.contains(flag), std::string(flag) + " only applies with --lr-decay-style WSD");
    }
  }
  // Megatron asserts iters == 0 when a fraction is given (an explicit "--lr-warmup-iters 0" is accepted).
  require(!(args.lr_warmup_fraction.has_value() && args.lr_warmup_iters != 0),
          "can only specify one of --lr-warmup-fraction and --lr-warmup-iters");
  [[maybe_unused]] const LRSchedule schedule(
      lr_schedule_config(args));  // throws on what Megatron's scheduler asserts against
}

void check_data_path(const std::vector<std::string>& data_path) {
  // Megatron: one prefix, a list of prefixes, or (when the first entry is a number) weight/prefix pairs.
  if (data_path.size() < 2 || !parses_as_number(data_path.front())) return;
  require(data_path.size() % 2 == 0, "--data-path: weighted form needs weight/prefix pairs (got " +
                                         str(static_cast<int64_t>(data_path.size())) + " values)");
  for (size_t i = 0; i < data_path.size(); i += 2) {
    require(
        parses_as_number(data_path[i]) && to_number(data_path[i]) >= 0.0,
        "--data-path: weight '" + data_path[i] + "' (before '" + data_path[i + 1] + "') is not a non-negative number");
  }
}

void check_split(const std::string& split) {
  // Megatron's get_split_from_str: comma- (or slash-) separated proportions, at most three, padded with zeros.
  std::string normalized = split;
  for (char& c : normalized) {
    if (c == '/') c = ',';
  }
  double total = 0.0;
  int parts = 0;
  size_t start = 0;
  while (start <= normalized.size()) {
    const size_t comma = std::min(normalized.find(',', start), normalized.size());
    const std::string part = trim(std::string_view(normalized).substr(start, comma - start));
    require(!parses_as_number(part) || to_number(part) >= 0.0,
            "--split '" + split + "': weight '" + part + "' is negative (split weights must be non-negative)");
    require(parses_as_number(part) && to_number(part) >= 0.0,
            "--split '" + split + "': '" + part + "' is not a non-negative number");
    total += to_number(part);
    ++parts;
    start = comma + 1;
  }
  require(parts <= 3, "--split '" + split + "': at most three proportions (train, valid, test)");
  require(total > 0.0, "--split '" + split + "': the proportions sum to zero");
}

void finalize_tokenizer(const TrainingArgs& args, const std::set<std::string>& given);

// Whole variable-length samples (train/packed_samples.h) and Megatron-RL's packing flags.
void finalize_sample_data(const TrainingArgs& args, const std::set<std::string>& given) {
  const bool samples = !args.sample_data_path.empty();
  require(samples || !args.rl_use_sequence_packing,
          "--rl-use-sequence-packing packs whole samples: it needs --sample-data-path");
  require(samples || args.rl_microbatch_order == "packing", "--rl-microbatch-order needs --sample-data-path");
  for (const char* flag : {"--rl-sequence-packing-max-sequences-per-bin", "--rl-sequence-packing-algo"}) {
    require(args.rl_use_sequence_packing || !given.contains(flag),
            std::string(flag) + " requires --rl-use-sequence-packing");
  }
  require(args.rl_sequence_packing_max_sequences_per_bin >= 1,
          "--rl-sequence-packing-max-sequences-per-bin must be positive (got " +
              str(args.rl_sequence_packing_max_sequences_per_bin) + ")");
  if (!samples) return;
  require(!given.contains("--data-path") && !args.mock_data,
          "--sample-data-path is the training data: drop --data-path / --mock-data");
  // Megatron-RL: "micro_batch_size must be 1 when using sequence packing"; a bin is one row.
  require(args.micro_batch_size == 1,
          "--sample-data-path trains one bin per micro-batch: it needs --micro-batch-size 1");
  require(args.calculate_per_token_loss,
          "--sample-data-path needs --calculate-per-token-loss: bins hold different numbers of loss tokens (padding "
          "bins none), so the objective is the global token mean");
  require(args.eval_iters == 0, "--sample-data-path trains on every sample (no validation split): give --eval-iters 0");
  // As --reset-position-ids: moecore restarts positions through the rotary embedding's position ids.
  require(args.model.position_embedding_type == PositionEmbedding::kRope,
          "--sample-data-path restarts the positions in every sample: it needs --position-embedding-type rope");
  for (const char* flag :
       {"--split", "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss", "--mock-max-sequence-length"}) {
    require(!given.contains(flag), std::string(flag) +
                                       " applies to --data-path / --mock-data (whole samples have their own positions, "
                                       "documents and loss masks)");
  }
  require(args.virtual_pipeline_model_parallel_size == 1,
          "--sample-data-path with virtual pipeline stages is not implemented (the number of micro-batches follows "
          "the packing)");
}

// Megatron's checks on --hybrid-context-parallel (arguments.py validate_args: PP 1, no Megatron-FSDP, per-token loss,
// not with MLA) and moecore's: whole samples scheduled unpacked, no TP / EP (their collectives would span ranks that
// run different samples), no balancing losses (reduced over the layout's CP group), no MTP, no gradient overlap.
void finalize_hybrid_context_parallel(const TrainingArgs& args, const std::set<std::string>& given) {
  require(args.hybrid_context_parallel || !given.contains("--max-seqlen-per-dp-cp-rank"),
          "--max-seqlen-per-dp-cp-rank requires --hybrid-context-parallel");
  if (!args.hybrid_context_parallel) return;
  require(args.max_seqlen_per_dp_cp_rank > 0, "--hybrid-context-parallel needs --max-seqlen-per-dp-cp-rank N (N > 0)");
  require(args.parallel.pipeline_model_parallel_size == 1,
          "Hybrid context parallelism not supported with pipeline parallelism");
  require(!args.use_megatron_fsdp, "Hybrid context parallelism not supported with Megatron FSDP");
  require(args.calculate_per_token_loss, "Hybrid context parallelism must be used with --calculate-per-token-loss");
  require(!args.model.mla, "Hybrid context parallelism is not supported with multi-latent attention");
  require(!args.sample_data_path.empty(),
          "--hybrid-context-parallel schedules whole samples: it needs --sample-data-path");
  require(!args.rl_use_sequence_packing && args.rl_microbatch_order == "packing",
          "--hybrid-context-parallel schedules each sample on its own group: drop --rl-use-sequence-packing and "
          "--rl-microbatch-order");
  const ParallelSizes& sizes = args.parallel;
  const int64_t ranks = sizes.world_size / (sizes.tensor_model_parallel_size * sizes.pipeline_model_parallel_size);
  require(ranks > 0 && (ranks & (ranks - 1)) == 0,
          "--hybrid-context-parallel needs a power-of-two number of data- and context-parallel ranks (got " +
              str(ranks) + ")");
  require(args.parallel.tensor_model_parallel_size == 1 && args.parallel.expert_model_parallel_size == 1 &&
              args.parallel.expert_tensor_parallel() == 1,
          "--hybrid-context-parallel with tensor or expert parallelism is not implemented");
  const bool losses_off = !aux_losses_on(args.model.moe) && args.model.moe.z_loss_coeff == 0.0;
  require(!args.model.moe.enabled() || losses_off,
          "--hybrid-context-parallel with MoE balancing or z losses is not implemented (they reduce over the "
          "layout's context-parallel group): use --moe-router-load-balancing-type none and no --moe-z-loss-coeff");
  require(args.model.mtp_num_layers == 0, "--hybrid-context-parallel with --mtp-num-layers is not implemented");
  require(!args.overlap_grad_reduce, "--hybrid-context-parallel with --overlap-grad-reduce is not implemented");
  require(args.moe_routing_replay_file.empty(), "--hybrid-context-parallel with router replay is not implemented");
}

void finalize_data(TrainingArgs& args, const std::set<std::string>& given) {
  const bool has_path = given.contains("--data-path");
  finalize_sample_data(args, given);
  if (!args.sample_data_path.empty()) return finalize_tokenizer(args, given);
  require(has_path || args.mock_data, "no training data: give --data-path PREFIX or --mock-data");
  require(!(has_path && args.mock_data),
          "--data-path and --mock-data cannot be used together (a single data source must be provided)");
  require(args.mock_data || !given.contains("--mock-max-sequence-length"),
          "--mock-max-sequence-length applies to --mock-data only");
  check_data_path(args.data_path);
  if (has_path && !given.contains("--split")) args.split = "969, 30, 1";  // Megatron's legacy default
  if (!args.split.empty() || given.contains("--split")) check_split(args.split);
  // Megatron splits mock data "1,1,1" whatever --split says (megatron/core/datasets/blended_megatron_dataset_config.py
  // __post_init__).
  require(!(args.mock_data && given.contains("--split")),
          "--split does not apply to --mock-data (mock data is always split 1,1,1, as in Megatron); drop --split");
  finalize_tokenizer(args, given);
}

void finalize_tokenizer(const TrainingArgs& args, const std::set<std::string>& given) {
  require(!args.tokenizer_type.empty(),
          "--tokenizer-type is required (GPT2BPETokenizer with --vocab-file and --merge-file, or NullTokenizer with "
          "--vocab-size)");
  if (args.tokenizer_type == "GPT2BPETokenizer") {
    require(given.contains("--vocab-file") && given.contains("--merge-file"),
            "--tokenizer-type GPT2BPETokenizer requires --vocab-file and --merge-file");
    require(!given.contains("--vocab-size"),
            "--vocab-size is not used with GPT2BPETokenizer (the vocabulary comes from --vocab-file)");
  } else {  // NullTokenizer
    require(given.contains("--vocab-size"), "--tokenizer-type NullTokenizer requires --vocab-size");
    require(*args.vocab_size > 0, "--vocab-size must be positive (got " + str(*args.vocab_size) + ")");
    for (const char* flag : {"--vocab-file", "--merge-file"}) {
      require(!given.contains(flag), std::string(flag) + " is not used with NullTokenizer");
    }
  }
}

// Megatron's checks on the checkpointing flags (arguments.py validate_args, training.py) and moecore's own.
void finalize_checkpointing(TrainingArgs& args, const std::set<std::string>& given) {
  require(args.save.empty() || args.save_interval.has_value(), "--save requires --save-interval (as Megatron)");
  require(!args.save_interval || *args.save_interval > 0,
          "--save-interval must be positive (got " + str(args.save_interval.value_or(0)) + ")");
  for (const char* flag :
       {"--save-interval", "--no-save-optim", "--no-save-rng", "--async-save", "--non-persistent-save-interval",
        "--persistent-save-interval", "--ckpt-save-failure", "--save-overwrite-other-model"}) {
    require(!given.contains(flag) || !args.save.empty(), std::string(flag) + " requires --save");
  }
  // Megatron writes nothing without --save; moecore says so rather than accept a flag that would do nothing.
  require(!args.log_progress || !args.save.empty(),
          "--log-progress writes progress.txt into --save: it requires --save");
  for (const char* flag : {"--no-load-optim", "--no-load-rng", "--finetune", "--ckpt-step",
                           "--exit-on-missing-checkpoint", "--moe-use-upcycling"}) {
    require(!given.contains(flag) || !args.load.empty(), std::string(flag) + " requires --load");
  }
  require(!args.non_persistent_save_interval || *args.non_persistent_save_interval > 0,
          "--non-persistent-save-interval must be positive");
  require(!args.non_persistent_save_interval || args.non_persistent_ckpt_type == "global",
          "--non-persistent-save-interval requires --non-persistent-ckpt-type global");
  require(!args.ckpt_step || *args.ckpt_step >= 0, "--ckpt-step must be non-negative");
  require(!args.exit_interval || *args.exit_interval > 0, "--exit-interval must be positive");
  require(!args.exit_duration_in_mins || *args.exit_duration_in_mins >= 0.0,
          "--exit-duration-in-mins must be non-negative");
  require(!(args.override_opt_param_scheduler && args.use_checkpoint_opt_param_scheduler),
          "both --override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are given (pick one)");
  require(!given.contains("--exit-signal") || args.exit_signal_handler, "--exit-signal requires --exit-signal-handler");
  require(args.non_persistent_global_ckpt_dir.empty() || args.non_persistent_ckpt_type == "global",
          "--non-persistent-global-ckpt-dir requires --non-persistent-ckpt-type global");
  // Megatron's validate_args: the constant style takes --weight-decay, the others both ends.
  if (args.weight_decay_incr_style == WDIncrStyle::kConstant) {
    require(!args.start_weight_decay && !args.end_weight_decay,
            "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or cosine "
            "(the constant style uses --weight-decay)");
  } else {
    require(args.start_weight_decay && args.end_weight_decay, "--weight-decay-incr-style " +
                                                                  to_string(args.weight_decay_incr_style) +
                                                                  " needs --start-weight-decay and --end-weight-decay");
  }
  require(!given.contains("--moe-upcycling-granularity") || args.moe_use_upcycling,
          "--moe-upcycling-granularity requires --moe-use-upcycling");
  require(args.moe_upcycling_granularity > 0, "--moe-upcycling-granularity must be positive");
  if (args.moe_use_upcycling) {
    // Megatron's setup_model_and_optimizer: upcycling needs --save and an MoE model, and never loads the optimizer
    // or RNG state of the dense checkpoint.
    require(args.model.moe.enabled(), "--moe-use-upcycling requires --num-experts");
    require(!args.save.empty(), "--moe-use-upcycling requires --save (the upcycled model is saved at iteration 1)");
    args.no_load_optim = true;
    args.no_load_rng = true;
  }
}

void finalize_profiling(const TrainingArgs& args, const std::set<std::string>& given) {
  for (const char* flag : {"--profile-step-start", "--profile-step-end", "--profile-ranks", "--profile-dir"}) {
    require(!given.contains(flag) || args.profile, std::string(flag) + " requires --profile");
  }
  require(args.profile_step_start >= 0 && args.profile_step_end > args.profile_step_start,
          "--profile-step-end (" + str(args.profile_step_end) + ") must be greater than --profile-step-start (" +
              str(args.profile_step_start) + ")");
  for (const int64_t r : args.profile_ranks) {
    require(r >= 0 && r < args.parallel.world_size, "--profile-ranks: rank " + str(r) + " is not in the world of " +
                                                        str(args.parallel.world_size) + " processes");
  }
}

void finalize_moecore(const TrainingArgs& args, const std::set<std::string>& given) {
  require(args.threads >= 0, "--threads must be non-negative, 0 = all cores (got " + str(args.threads) + ")");
  require(args.sample_tokens > 0, "--sample-tokens must be positive (got " + str(args.sample_tokens) + ")");
  require(!given.contains("--sample-tokens") || given.contains("--sample-prompt"),
          "--sample-tokens requires --sample-prompt");
  for (const char* flag : {"--moe-routing-trace-max-training-iters", "--moe-routing-trace-capture-logits",
                           "--moe-routing-trace-capture-hidden-states", "--moe-routing-trace-dump-weights"}) {
    require(!given.contains(flag) || !args.moe_routing_trace.path.empty(),
            std::string(flag) + " requires --moe-routing-trace-path");
  }
}

// Packed sequences: the model reads the position ids through its rotary embeddings only (Megatron's learned
// absolute table with reset positions is not implemented).
void finalize_packed_sequences(const TrainingArgs& args) {
  require(!args.reset_position_ids || args.model.position_embedding_type == PositionEmbedding::kRope,
          "--reset-position-ids needs --position-embedding-type rope (learned absolute positions with reset position "
          "ids are not implemented)");
}

// Multi-Token Prediction (--mtp-num-layers): Megatron's validate_args checks, then what moecore does not run yet.
void finalize_mtp(const TrainingArgs& args) {
  const ModelConfig& model = args.model;
  require(model.mtp_num_layers >= 0, "--mtp-num-layers must be non-negative (got " + str(model.mtp_num_layers) + ")");
  if (model.mtp_num_layers == 0) return;
  // Megatron's message, word for word (arguments.py).
  require(model.position_embedding_type == PositionEmbedding::kRope ||
              model.position_embedding_type == PositionEmbedding::kNone,
          "Multi-Token Prediction (MTP) is not supported with " + to_string(model.position_embedding_type) +
              " position embedding type.The supported position embedding types are rope and none.");
  // The counter RNG keys layers 0..1022 (two numbers per depth after the decoder's layers).
  require(model.num_layers + 2 * model.mtp_num_layers < 1023, "--num-layers (" + str(model.num_layers) +
                                                                  ") + 2 x --mtp-num-layers (" +
                                                                  str(model.mtp_num_layers) + ") must be below 1023");
  const auto unsupported = [](const bool ok, const std::string& what) {
    require(ok, "--mtp-num-layers is not supported with " + what + " yet");
  };
  unsupported(!args.fp8_format && !args.fp4_format, "--fp8-format / --fp4-format");
}

// Megatron's checks of the EP all-to-all overlap (TransformerConfig.__post_init__), with its texts; and moecore's
// own: the deferred weight gradients are the grouped experts', and Megatron-FSDP's per-layer gathers do not run
// inside the combined schedule.
// The flex dispatcher (Megatron's MoEFlexTokenDispatcher: DeepEP's "requires TPxEP > 1").
void finalize_flex_dispatcher(const TrainingArgs& args, const std::set<std::string>& given) {
  const bool flex = args.model.moe.dispatcher_type == TokenDispatcherType::kFlex;
  require(flex || given.count("--moe-flex-dispatcher-backend") == 0,
          "--moe-flex-dispatcher-backend requires --moe-token-dispatcher-type flex");
  if (!flex) return;
  require(args.parallel.expert_tensor_parallel() * args.parallel.expert_model_parallel_size > 1,
          "the flex dispatcher (mpiep) requires TPxEP > 1");
}

// --calculate-per-token-loss: moecore's Megatron-FSDP scales its units' gradients by 1 / dp-cp as it reduces them.
void finalize_per_token_loss(const TrainingArgs& args) {
  require(!args.calculate_per_token_loss || !args.use_megatron_fsdp,
          "--calculate-per-token-loss cannot be combined with --use-megatron-fsdp");
}

// Router replay: Megatron creates the replay instances with --moe-enable-routing-replay and leaves the actions to its
// caller; moecore's trainer replays a recording file, so the flag needs one (and the file the flag). Megatron's
// sinkhorn selection does not go through the replay; inference records no MTP depth.
void finalize_routing_replay(const TrainingArgs& args) {
  const bool file = !args.moe_routing_replay_file.empty();
  require(args.moe_enable_routing_replay || !file, "--moe-routing-replay-file requires --moe-enable-routing-replay");
  if (!args.moe_enable_routing_replay) return;
  require(file,
          "--moe-enable-routing-replay needs --moe-routing-replay-file FILE (a recording made by moecore generate "
          "--record-routing) for the training forwards to replay");
  const MoEConfig& moe = args.model.moe;
  for (const LoadBalancingType type : moe.load_balancing_types) {
    require(type != LoadBalancingType::kSinkhorn,
            "--moe-enable-routing-replay does not apply to --moe-router-load-balancing-type sinkhorn (its selection "
            "does not go through the router's top-k)");
  }
  require(
      args.model.mtp_num_layers == 0,
      "--moe-enable-routing-replay with --mtp-num-layers: a routing recording holds the decoder's MoE routers only");
}

void finalize_ep_overlap(const TrainingArgs& args) {
  const MoEConfig& moe = args.model.moe;
  require(!moe.delay_wgrad_compute || moe.overlap_ep_comm,
          "overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute");
  if (!moe.overlap_ep_comm) return;
  const RecomputeConfig& r = args.model.recompute;
  require(args.parallel.pipeline_model_parallel_size == 1 || args.virtual_pipeline_model_parallel_size > 1,
          "If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
          "pipeline_model_parallel_size > 1");
  require(args.parallel.expert_model_parallel_size > 1,
          "overlap_moe_expert_parallel_comm is only supported with expert model parallelism");
  require(moe.dispatcher_type != TokenDispatcherType::kAllGather,
          "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher");
  require(!r.full(), "disable full recomputation when enabling overlap_moe_expert_parallel_comm");
  require(!r.has("moe"), "disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm");
  require(args.model.params_dtype == DType::kBF16 || args.model.params_dtype == DType::kF16,
          "overlap_moe_expert_parallel_comm is only supported with bf16 or fp16 model");
  require(!moe.shared_expert_overlap,
          "disable moe_shared_expert_overlap when enabling overlap_moe_expert_parallel_comm");
  require(args.model.mtp_num_layers <= 1,
          "MTP supports at most one layer when enabling overlap_moe_expert_parallel_comm.");
  require(!args.use_megatron_fsdp, "--overlap-moe-expert-parallel-comm cannot be combined with --use-megatron-fsdp");
  require(!moe.delay_wgrad_compute || moe.grouped_gemm, "--delay-wgrad-compute requires --moe-grouped-gemm");
}

}  // namespace

// Megatron's activation-recomputation checks (transformer_config.py __post_init__, arguments.py validate_args).
void finalize_recompute(TrainingArgs& args, const std::set<std::string>& given) {
  RecomputeConfig& r = args.model.recompute;
  using Granularity = RecomputeConfig::Granularity;
  if (given.count("--recompute-activations") != 0) {
    require(r.granularity != Granularity::kFull,
            "--recompute-activations sets --recompute-granularity selective; it cannot be combined with full");
    r.granularity = Granularity::kSelective;
  }
  if (given.count("--moe-layer-recompute") != 0) {
    require(r.granularity != Granularity::kFull, "Do not set --moe-layer-recompute with full recompute granularity");
    r.granularity = Granularity::kSelective;
  }
  const bool method = given.count("--recompute-method") != 0, layers = given.count("--recompute-num-layers") != 0;
  if (r.distribute_saved_activations) {
    require(args.parallel.tensor_model_parallel_size > 1,
            "--distribute-saved-activations distributes across the tensor model parallel group: it needs "
            "--tensor-model-parallel-size > 1");
    require(r.granularity == Granularity::kFull,
            "--distribute-saved-activations applies only to --recompute-granularity full");
    require(method, "--distribute-saved-activations needs --recompute-method");
    require(!args.sequence_parallel,
            "--distribute-saved-activations must be false when --sequence-parallel is enabled");
  }
  if (r.granularity == Granularity::kNone) {
    require(!method && !layers, "--recompute-method and --recompute-num-layers require --recompute-granularity full");
    require(given.count("--recompute-modules") == 0, "--recompute-modules requires --recompute-granularity selective");
    return;
  }
  if (r.granularity == Granularity::kFull) {
    require(method, "Using --recompute-granularity full so --recompute-method must be \"block\" or \"uniform\"");
    require(layers,
            "When using --recompute-granularity full --recompute-num-layers must be between 1 and "
            "num_layers_per_pipeline_rank: " +
                str(args.model.num_layers / args.parallel.pipeline_model_parallel_size));
    require(given.count("--recompute-modules") == 0, "--recompute-modules requires --recompute-granularity selective");
    r.modules.clear();
    return;
  }
  require(!method, "--recompute-method is not supported with --recompute-granularity selective");
  require(!layers, "When using --recompute-granularity selective --recompute-num-layers must be None");
  if (given.count("--recompute-modules") == 0) r.modules = {"core_attn"};
  if (given.count("--moe-layer-recompute") != 0 && !r.has("moe")) r.modules.push_back("moe");
  const MoEConfig& moe = args.model.moe;
  require(!r.has("moe_act") || moe.grouped_gemm,
          "moe_act in --recompute-modules is only supported with --moe-grouped-gemm");
  require(!r.has("mla_up_proj") || args.model.mla.has_value(),
          "mla_up_proj in --recompute-modules is only supported with --multi-latent-attention");
  require(!r.has("shared_experts") || !moe.shared_expert_overlap,
          "shared_experts in --recompute-modules cannot work with --moe-shared-expert-overlap");
  if (args.model.quantization && args.model.quantization->recipe == quant::Recipe::kDelayed) {
    require(!r.has("moe_act") && !r.has("layernorm"),
            "Delayed scaling does not support moe_act and layernorm in --recompute-modules for fp8");
  }
}

void finalize_train_args(TrainingArgs& args, const std::set<std::string>& given) {
  check_required(given);
  finalize_model(args, given);
  finalize_pipeline(args);
  finalize_fsdp(args, given);
  finalize_parallel(args, given);
  finalize_training(args, given);
  finalize_precision(args, given);
  finalize_precision_aware_optimizer(args);
  finalize_quantization(args, given);
  finalize_recompute(args, given);
  finalize_lr(args, given);
  finalize_data(args, given);
  finalize_checkpointing(args, given);
  finalize_profiling(args, given);
  finalize_moecore(args, given);
  finalize_packed_sequences(args);
  finalize_mtp(args);
  finalize_flex_dispatcher(args, given);
  finalize_ep_overlap(args);
  finalize_per_token_loss(args);
  finalize_routing_replay(args);
  finalize_hybrid_context_parallel(args, given);
}

}  // namespace moecore::detail
