// The flag table of `moecore train` and the tokenizer of the command line. Defaults live in TrainingArgs; derived
// defaults and cross-flag checks in arguments_finalize.cpp.
#include "moecore/config/arguments.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <optional>
#include <set>
#include <string_view>
#include <thread>

#include "moecore/config/arguments_finalize.h"
#include "moecore/config/flag_catalog.h"
#include "moecore/tokenizer/tokenizer.h"
#include "moecore/util/flag_parser.h"

namespace moecore {
namespace {

// Upper limits of the size flags: far above any model trained today, and small enough that shapes, parameter counts
// and bytes built from a few of them stay within 64-bit integers (checked where they are multiplied).
constexpr int64_t kMaxWidth = int64_t{1} << 24;  // hidden, ffn and head sizes
constexpr int64_t kMaxCount = int64_t{1} << 16;  // layers, heads, query groups, amax history
constexpr int64_t kMaxMtpDepths = 64;
constexpr int64_t kMaxPositions = int64_t{1} << 24;  // sequence length, position table, generated tokens
constexpr int64_t kMaxExperts = int64_t{1} << 20;
constexpr int64_t kMaxVocab = INT32_MAX;  // token ids are int32 in the indexed dataset and the model
constexpr std::string_view kVocabWhy = "token ids are 32-bit integers";
constexpr int64_t kMaxBatch = int64_t{1} << 31;
constexpr int64_t kMaxIterations = int64_t{1} << 40;
constexpr int64_t kMaxElements = int64_t{1} << 40;
constexpr int64_t kMaxRanks = int64_t{1} << 20;  // parallel sizes, as `moecore layout --world-size`
constexpr double kMaxLossCoeff = 100.0;
constexpr double kMaxCapacityFactor = 1000.0;
constexpr double kMaxTimeoutMinutes = 1e7;  // about 19 years: longer means no bound
constexpr std::string_view kLrWhy = "Adam moves every weight by about the learning rate each step";

int64_t hardware_threads() {
  const unsigned threads = std::thread::hardware_concurrency();
  return threads == 0 ? 1024 : static_cast<int64_t>(threads);
}

using TrainFlag = FlagSpec<TrainingArgs>;

// clang-format off
const std::vector<TrainFlag>& flag_table() {
  static const std::vector<TrainFlag> table = {
    // Network size.
    {"--num-layers", Arity::kOne, "N", "number of transformer layers (required)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.num_layers = v.integer_up_to(kMaxCount); }},
    {"--hidden-size", Arity::kOne, "N", "transformer hidden size (required)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.hidden_size = v.integer_up_to(kMaxWidth); }},
    {"--ffn-hidden-size", Arity::kOne, "N", "MLP hidden size (default 4*hidden, with --swiglu int(8*hidden/3/64)*64)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.ffn_hidden_size = v.integer_up_to(kMaxWidth); }},
    {"--num-attention-heads", Arity::kOne, "N", "number of attention heads (required)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.num_attention_heads = v.integer_up_to(kMaxCount); }},
    {"--group-query-attention", Arity::kSwitch, "", "use grouped-query attention (see --num-query-groups)",
     [](TrainingArgs& a, const FlagValue&) { a.group_query_attention = true; }},
    {"--num-query-groups", Arity::kOne, "N", "key/value groups with --group-query-attention (default 1)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.num_query_groups = v.integer_up_to(kMaxCount); }},
    {"--kv-channels", Arity::kOne, "N", "head dimension (default hidden/heads)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.kv_channels = v.integer_up_to(kMaxWidth); }},
    {"--seq-length", Arity::kOne, "N", "sequence length (required)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.seq_length = v.integer_up_to(kMaxPositions); }},
    {"--max-position-embeddings", Arity::kOne, "N",
     "position-embedding table size (required with learned_absolute, else default --seq-length)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.max_position_embeddings = v.integer_up_to(kMaxPositions); }},
    {"--make-vocab-size-divisible-by", Arity::kOne, "N", "pad the vocabulary to a multiple of N (default 128)",
     [](TrainingArgs& a, const FlagValue& v) { a.make_vocab_size_divisible_by = v.integer_up_to(kMaxVocab, kVocabWhy); }},
    {"--normalization", Arity::kOne, "{LayerNorm,RMSNorm}", "normalization layer (default LayerNorm)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.normalization =
           v.choice({"LayerNorm", "RMSNorm"}) == "LayerNorm" ? Normalization::kLayerNorm : Normalization::kRMSNorm;
     }},
    {"--norm-epsilon", Arity::kOne, "X", "epsilon of LayerNorm/RMSNorm (default 1e-5)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.norm_epsilon = v.real_up_to(1.0); }},
    {"--swiglu", Arity::kSwitch, "", "gated SiLU MLP instead of GeLU",
     [](TrainingArgs& a, const FlagValue&) { a.model.activation = Activation::kSwiGLU; }},
    {"--squared-relu", Arity::kSwitch, "", "squared-ReLU MLP instead of GeLU",
     [](TrainingArgs& a, const FlagValue&) { a.model.activation = Activation::kSquaredReLU; }},
    {"--disable-bias-linear", Arity::kSwitch, "", "no bias in the linear layers",
     [](TrainingArgs& a, const FlagValue&) { a.model.add_bias_linear = false; }},
    {"--add-bias-linear", Arity::kSwitch, "", "bias in the linear layers (the default; moecore-only spelling)",
     [](TrainingArgs& a, const FlagValue&) { a.model.add_bias_linear = true; }},
    {"--qk-layernorm", Arity::kSwitch, "", "normalize queries and keys per head",
     [](TrainingArgs& a, const FlagValue&) { a.model.qk_layernorm = true; }},
    {"--position-embedding-type", Arity::kOne, "{learned_absolute,rope,yarn,none}", "default learned_absolute",
     [](TrainingArgs& a, const FlagValue& v) {
       const std::string& type = v.choice({"learned_absolute", "rope", "yarn", "none"}, {"mrope", "relative"});
       a.model.position_embedding_type = type == "rope"   ? PositionEmbedding::kRope
                                         : type == "yarn" ? PositionEmbedding::kYarn
                                         : type == "none" ? PositionEmbedding::kNone
                                                          : PositionEmbedding::kLearnedAbsolute;
     }},
    {"--rotary-interleaved", Arity::kSwitch, "", "interleaved rotary layout (not implemented; refused with MLA)",
     [](TrainingArgs& a, const FlagValue&) { a.rotary_interleaved = true; }},
    // Multi-latent attention (Megatron's MLATransformerConfig flags and CLI defaults).
    {"--multi-latent-attention", Arity::kSwitch, "", "DeepSeek-V2/V3 multi-latent attention",
     [](TrainingArgs& a, const FlagValue&) { a.multi_latent_attention = true; }},
    {"--q-lora-rank", Arity::kOne, "N", "query latent rank (default: none, queries straight from the hidden state)",
     [](TrainingArgs& a, const FlagValue& v) { a.mla.q_lora_rank = v.integer_up_to(kMaxWidth); }},
    {"--kv-lora-rank", Arity::kOne, "N", "key/value latent rank (default 32)",
     [](TrainingArgs& a, const FlagValue& v) { a.mla.kv_lora_rank = v.integer_up_to(kMaxWidth); }},
    {"--qk-head-dim", Arity::kOne, "N", "query/key head channels without RoPE (default 128)",
     [](TrainingArgs& a, const FlagValue& v) { a.mla.qk_head_dim = v.integer_up_to(kMaxWidth); }},
    {"--qk-pos-emb-head-dim", Arity::kOne, "N", "query/key RoPE channels (default 64)",
     [](TrainingArgs& a, const FlagValue& v) { a.mla.qk_pos_emb_head_dim = v.integer_up_to(kMaxWidth); }},
    {"--v-head-dim", Arity::kOne, "N", "value head channels (default 128)",
     [](TrainingArgs& a, const FlagValue& v) { a.mla.v_head_dim = v.integer_up_to(kMaxWidth); }},
    {"--rope-type", Arity::kOne, "{rope,yarn}", "rotary embedding of multi-latent attention (default yarn)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.mla.rope_type = v.choice({"rope", "yarn"}) == "rope" ? RopeType::kRope : RopeType::kYarn;
     }},
    // YaRN (multi-latent attention's rope, or --position-embedding-type yarn).
    {"--rotary-scaling-factor", Arity::kOne, "X", "YaRN scaling factor (default 1.0)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.yarn.rotary_scaling_factor = v.real_up_to(1e6); }},
    {"--mscale", Arity::kOne, "X", "YaRN mscale (default 1.0)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.yarn.mscale = v.real_up_to(1e6); }},
    {"--mscale-all-dim", Arity::kOne, "X", "YaRN mscale_all_dim (default 0.0)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.yarn.mscale_all_dim = v.real_up_to(1e6); }},
    {"--yarn-original-max-position-embeddings", Arity::kOne, "N", "YaRN's original context length (default 4096)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.yarn.original_max_position_embeddings = v.integer_up_to(kMaxPositions);
     }},
    {"--yarn-beta-fast", Arity::kOne, "X", "YaRN beta_fast (default 32)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.yarn.beta_fast = v.real_up_to(1e6); }},
    {"--yarn-beta-slow", Arity::kOne, "X", "YaRN beta_slow (default 1)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.yarn.beta_slow = v.real_up_to(1e6); }},
    {"--yarn-correction-range-round-to-int", Arity::kSwitch, "", "round YaRN's ramp ends to integers (default)",
     [](TrainingArgs& a, const FlagValue&) { a.model.yarn.correction_range_round_to_int = true; }},
    {"--no-yarn-correction-range-round-to-int", Arity::kSwitch, "", "keep YaRN's ramp ends fractional",
     [](TrainingArgs& a, const FlagValue&) { a.model.yarn.correction_range_round_to_int = false; }},
    {"--rotary-base", Arity::kOne, "N", "RoPE base (integer, default 10000)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.rotary_base = static_cast<double>(v.integer()); }},
    {"--rotary-percent", Arity::kOne, "X", "fraction of the head dimension rotated by RoPE (default 1.0)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.rotary_percent = v.real(); }},
    {"--init-method-std", Arity::kOne, "X", "std of the normal weight initialization (default 0.02)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.init_method_std = v.real_up_to(1.0); }},
    {"--attention-dropout", Arity::kOne, "X", "dropout after the attention softmax (default 0.1)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.attention_dropout = v.real(); }},
    {"--hidden-dropout", Arity::kOne, "X", "dropout on the residual branches (default 0.1)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.hidden_dropout = v.real(); }},
    {"--untie-embeddings-and-output-weights", Arity::kSwitch, "", "separate output layer weight",
     [](TrainingArgs& a, const FlagValue&) { a.model.untie_embeddings_and_output_weights = true; }},
    {"--mtp-num-layers", Arity::kOne, "N", "Multi-Token Prediction depths after the decoder (default none)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.mtp_num_layers = v.integer_up_to(kMaxMtpDepths); }},
    {"--mtp-loss-scaling-factor", Arity::kOne, "X",
     "weight of the mean Multi-Token Prediction loss over the depths (default 0.1)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.mtp_loss_scaling_factor = v.real(); }},

    // Training.
    {"--micro-batch-size", Arity::kOne, "N", "sequences per micro batch (required)",
     [](TrainingArgs& a, const FlagValue& v) { a.micro_batch_size = v.integer_up_to(kMaxBatch); }},
    {"--global-batch-size", Arity::kOne, "N", "sequences per iteration (default micro batch * data parallel)",
     [](TrainingArgs& a, const FlagValue& v) { a.global_batch_size = v.integer_up_to(kMaxBatch); }},
    {"--train-iters", Arity::kOne, "N", "number of training iterations (required)",
     [](TrainingArgs& a, const FlagValue& v) { a.train_iters = v.integer_up_to(kMaxIterations); }},
    {"--optimizer", Arity::kOne, "{adam}", "optimizer (default adam, i.e. AdamW)",
     [](TrainingArgs& a, const FlagValue& v) { a.optimizer = v.choice({"adam"}, {"sgd", "muon", "dist_muon"}); }},
    {"--adam-beta1", Arity::kOne, "X", "Adam beta1 (default 0.9)",
     [](TrainingArgs& a, const FlagValue& v) { a.adam_beta1 = v.real(); }},
    {"--adam-beta2", Arity::kOne, "X", "Adam beta2 (default 0.999)",
     [](TrainingArgs& a, const FlagValue& v) { a.adam_beta2 = v.real(); }},
    {"--adam-eps", Arity::kOne, "X", "Adam epsilon (default 1e-8)",
     [](TrainingArgs& a, const FlagValue& v) { a.adam_eps = v.real_up_to(1.0); }},
    {"--weight-decay", Arity::kOne, "X", "decoupled weight decay (default 0.01)",
     [](TrainingArgs& a, const FlagValue& v) { a.weight_decay = v.real(); }},
    {"--start-weight-decay", Arity::kOne, "X", "weight decay at iteration 0 of a linear / cosine increase",
     [](TrainingArgs& a, const FlagValue& v) { a.start_weight_decay = v.real(); }},
    {"--end-weight-decay", Arity::kOne, "X", "weight decay at --train-iters of a linear / cosine increase",
     [](TrainingArgs& a, const FlagValue& v) { a.end_weight_decay = v.real(); }},
    {"--weight-decay-incr-style", Arity::kOne, "{constant,linear,cosine}",
     "weight decay from --start-weight-decay to --end-weight-decay over the run (default constant: --weight-decay)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.weight_decay_incr_style = *parse_wd_incr_style(v.choice({"constant", "linear", "cosine"}));
     }},
    {"--clip-grad", Arity::kOne, "X", "clip the global gradient L2 norm to X (default 1.0, 0 = off)",
     [](TrainingArgs& a, const FlagValue& v) { a.clip_grad = v.real(); }},
    {"--bf16", Arity::kSwitch, "",
     "bf16 mixed precision: bf16 weights and activations, fp32 main parameters, gradients and optimizer states",
     [](TrainingArgs& a, const FlagValue&) { a.model.params_dtype = DType::kBF16; }},
    {"--fp16", Arity::kSwitch, "",
     "fp16 mixed precision: fp16 weights and activations, fp32 main parameters, gradients (reduced in fp16) and "
     "optimizer states, dynamic loss scaling unless --loss-scale",
     [](TrainingArgs& a, const FlagValue&) { a.model.params_dtype = DType::kF16; }},
    // Megatron upcasts its unfused softmax with this flag; moecore's attention, like TE's fused attention, always
    // computes the softmax and keeps the probabilities in fp32, so the flag states what every run does.
    {"--attention-softmax-in-fp32", Arity::kSwitch, "",
     "compute the attention softmax in fp32 (moecore's attention always does, as TE's fused attention)",
     [](TrainingArgs&, const FlagValue&) {}},
    {"--fp8-format", Arity::kOne, "{e4m3,hybrid}",
     "quantize the decoder layers' linear layers and experts to FP8 (hybrid: E5M2 gradients)",
     [](TrainingArgs& a, const FlagValue& v) { a.fp8_format = v.choice({"e4m3", "hybrid"}); }},
    {"--fp8-recipe", Arity::kOne, "{delayed,tensorwise,blockwise,mxfp8}",
     "FP8 scaling (default delayed: per-tensor scales from an amax history; per-tensor current scaling, 1x128 / "
     "128x128 blocks, or MXFP8 1x32 blocks)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.fp8_recipe = v.choice({"delayed", "tensorwise", "blockwise", "mxfp8"}, {"custom"});
     }},
    {"--fp8-amax-history-len", Arity::kOne, "N", "--fp8-recipe delayed: amax history length (default 1)",
     [](TrainingArgs& a, const FlagValue& v) { a.fp8_amax_history_len = v.integer_up_to(kMaxCount); }},
    {"--fp8-amax-compute-algo", Arity::kOne, "{most_recent,max}",
     "--fp8-recipe delayed: scale from the newest amax or the history's maximum (default most_recent)",
     [](TrainingArgs& a, const FlagValue& v) { a.fp8_amax_compute_algo = v.choice({"most_recent", "max"}); }},
    {"--fp8-margin", Arity::kOne, "N", "--fp8-recipe delayed: scale = FP8 max x 2^-N / amax, N in [-17, 17] (E4M3's 2^-9 .. 448 range; default 0)",
     [](TrainingArgs& a, const FlagValue& v) { a.fp8_margin = v.integer(); }},
    {"--fp4-format", Arity::kOne, "{e2m1}", "quantize the decoder layers' linear layers and experts to FP4 (E2M1)",
     [](TrainingArgs& a, const FlagValue& v) { a.fp4_format = v.choice({"e2m1"}); }},
    {"--fp4-recipe", Arity::kOne, "{nvfp4}", "FP4 scaling (default nvfp4: 1x16 blocks with E4M3 scales)",
     [](TrainingArgs& a, const FlagValue& v) { a.fp4_recipe = v.choice({"nvfp4"}, {"custom"}); }},
    {"--fp8-param-gather", Arity::kSwitch, "",
     "with FP8 and the distributed optimizer: the quantized layers' weights are held as FP8 and all-gathered as "
     "FP8 codes",
     [](TrainingArgs& a, const FlagValue&) { a.fp8_param_gather = true; }},
    {"--fp4-param-gather", Arity::kSwitch, "",
     "with FP4 and the distributed optimizer: the quantized layers' weights are held as NVFP4 and all-gathered as "
     "packed E2M1 codes",
     [](TrainingArgs& a, const FlagValue&) { a.fp4_param_gather = true; }},
    {"--first-last-layers-bf16", Arity::kSwitch, "",
     "with FP8 / FP4: keep the first and last decoder layers in high precision",
     [](TrainingArgs& a, const FlagValue&) { a.model.first_last_layers_bf16 = true; }},
    {"--num-layers-at-start-in-bf16", Arity::kOne, "N",
     "with --first-last-layers-bf16: the first N decoder layers stay unquantized (default 1)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.num_layers_at_start_in_bf16 = v.integer(); }},
    {"--num-layers-at-end-in-bf16", Arity::kOne, "N",
     "with --first-last-layers-bf16: the last N decoder layers stay unquantized (default 1)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.num_layers_at_end_in_bf16 = v.integer(); }},
    {"--initial-loss-scale", Arity::kOne, "S", "fp16 dynamic loss scaling: the first scale (default 2^32)",
     [](TrainingArgs& a, const FlagValue& v) { a.dynamic_loss_scale.initial_scale = v.real(); }},
    {"--min-loss-scale", Arity::kOne, "S", "fp16 dynamic loss scaling: the smallest scale (default 1)",
     [](TrainingArgs& a, const FlagValue& v) { a.dynamic_loss_scale.min_scale = v.real(); }},
    {"--loss-scale-window", Arity::kOne, "N",
     "fp16 dynamic loss scaling: finite iterations in a row before the scale doubles (default 1000)",
     [](TrainingArgs& a, const FlagValue& v) { a.dynamic_loss_scale.growth_interval = v.integer(); }},
    {"--hysteresis", Arity::kOne, "N",
     "fp16 dynamic loss scaling: non-finite iterations before the scale starts halving (default 2)",
     [](TrainingArgs& a, const FlagValue& v) { a.dynamic_loss_scale.hysteresis = v.integer(); }},
    {"--grad-reduce-in-bf16", Arity::kSwitch, "",
     "with --bf16: reduce gradients over data parallelism in bf16 (half the bytes) instead of fp32",
     [](TrainingArgs& a, const FlagValue&) { a.grad_reduce_in_bf16 = true; }},
    {"--accumulate-allreduce-grads-in-fp32", Arity::kSwitch, "",
     "reduce gradients in fp32 (the default with --bf16; with --fp16 they are reduced in fp16 otherwise)",
     [](TrainingArgs& a, const FlagValue&) { a.accumulate_allreduce_grads_in_fp32 = true; }},
    {"--use-precision-aware-optimizer", Arity::kSwitch, "",
     "store Adam's moments / main parameters in the --exp-avg-dtype / --exp-avg-sq-dtype / --main-params-dtype "
     "formats (TransformerEngine FusedAdam's scaled states; needs --use-distributed-optimizer)",
     [](TrainingArgs& a, const FlagValue&) { a.use_precision_aware_optimizer = true; }},
    {"--main-grads-dtype", Arity::kOne, "{fp32,bf16}",
     "precision-aware optimizer: main gradients (bf16: accumulated and reduced in bf16; needs --bf16)",
     [](TrainingArgs& a, const FlagValue& v) { a.main_grads_dtype = v.choice({"fp32", "bf16"}); }},
    {"--main-params-dtype", Arity::kOne, "{fp32,fp16}",
     "precision-aware optimizer: main parameters (fp16: scaled by absmax / 32752; needs --bf16 or --fp16)",
     [](TrainingArgs& a, const FlagValue& v) { a.main_params_dtype = v.choice({"fp32", "fp16"}); }},
    {"--exp-avg-dtype", Arity::kOne, "{fp32,fp16,bf16,fp8}",
     "precision-aware optimizer: Adam's first moment (fp16 / fp8 E4M3 scaled per tensor; the update runs in fp32)",
     [](TrainingArgs& a, const FlagValue& v) { a.exp_avg_dtype = v.choice({"fp32", "fp16", "bf16", "fp8"}); }},
    {"--exp-avg-sq-dtype", Arity::kOne, "{fp32,fp16,bf16,fp8}",
     "precision-aware optimizer: Adam's second moment (fp16 / fp8 E4M3 scaled per tensor; the update runs in fp32)",
     [](TrainingArgs& a, const FlagValue& v) { a.exp_avg_sq_dtype = v.choice({"fp32", "fp16", "bf16", "fp8"}); }},
    {"--loss-scale", Arity::kOne, "S",
     "constant loss scale, at least 2^-24 (with --use-distributed-optimizer); iterations with non-finite gradients "
     "are skipped",
     [](TrainingArgs& a, const FlagValue& v) { a.loss_scale = v.real(); }},
    {"--seed", Arity::kOne, "N", "random seed (default 1234)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.seed = v.integer_up_to(UINT32_MAX, "numpy's RandomState takes seeds below 2^32");
       if (a.seed < 0) throw ConfigError("--seed " + v.text() + " is negative (seeds are between 0 and 2^32 - 1)");
     }},

    // Learning rate.
    {"--lr", Arity::kOne, "X", "peak learning rate (required)",
     [](TrainingArgs& a, const FlagValue& v) { a.lr = v.real_up_to(1.0, kLrWhy); }},
    {"--min-lr", Arity::kOne, "X", "learning rate at the end of the decay (default 0)",
     [](TrainingArgs& a, const FlagValue& v) { a.min_lr = v.real_up_to(1.0, kLrWhy); }},
    {"--lr-decay-style", Arity::kOne, "{constant,linear,cosine,inverse-square-root,WSD}", "default linear",
     [](TrainingArgs& a, const FlagValue& v) {
       a.lr_decay_style = *parse_lr_decay_style(
           v.choice({"constant", "linear", "cosine", "inverse-square-root", "WSD"}));
     }},
    {"--lr-decay-iters", Arity::kOne, "N", "iterations of the decay (default --train-iters)",
     [](TrainingArgs& a, const FlagValue& v) { a.lr_decay_iters = v.integer_up_to(kMaxIterations); }},
    {"--lr-warmup-iters", Arity::kOne, "N", "iterations of linear warmup (default 0)",
     [](TrainingArgs& a, const FlagValue& v) { a.lr_warmup_iters = v.integer_up_to(kMaxIterations); }},
    {"--lr-warmup-fraction", Arity::kOne, "X", "warmup as a fraction of the decay iterations",
     [](TrainingArgs& a, const FlagValue& v) { a.lr_warmup_fraction = v.real(); }},
    {"--lr-warmup-init", Arity::kOne, "X", "learning rate at the start of warmup (default 0)",
     [](TrainingArgs& a, const FlagValue& v) { a.lr_warmup_init = v.real_up_to(1.0, kLrWhy); }},
    {"--lr-wsd-decay-style", Arity::kOne, "{exponential,linear,cosine,minus_sqrt}", "WSD anneal (default exponential)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.lr_wsd_decay_style = *parse_wsd_decay_style(v.choice({"exponential", "linear", "cosine", "minus_sqrt"}));
     }},
    {"--lr-wsd-decay-iters", Arity::kOne, "N", "iterations of the WSD anneal phase",
     [](TrainingArgs& a, const FlagValue& v) { a.lr_wsd_decay_iters = v.integer_up_to(kMaxIterations); }},

    // Logging and evaluation.
    {"--log-interval", Arity::kOne, "N", "print the iteration line every N iterations (default 100)",
     [](TrainingArgs& a, const FlagValue& v) { a.log_interval = v.integer(); }},
    {"--log-throughput", Arity::kSwitch, "", "add TFLOP/s per device to the iteration line",
     [](TrainingArgs& a, const FlagValue&) { a.log_throughput = true; }},
    {"--log-params-norm", Arity::kSwitch, "",
     "add the L2 norm of the (fp32 main) parameters to the iteration line and TensorBoard (params-norm)",
     [](TrainingArgs& a, const FlagValue&) { a.log_params_norm = true; }},
    {"--log-num-zeros-in-grad", Arity::kSwitch, "",
     "add the number of zero gradient elements to the iteration line and TensorBoard (num-zeros)",
     [](TrainingArgs& a, const FlagValue&) { a.log_num_zeros_in_grad = true; }},
    {"--tensorboard-dir", Arity::kOne, "DIR", "write TensorBoard event files here (from the last rank)",
     [](TrainingArgs& a, const FlagValue& v) { a.tensorboard_dir = v.non_empty_text(); }},
    {"--tensorboard-log-interval", Arity::kOne, "N", "write the iteration's scalars every N iterations (default 1)",
     [](TrainingArgs& a, const FlagValue& v) { a.tensorboard_log_interval = v.positive_up_to(kMaxIterations); }},
    {"--tensorboard-queue-size", Arity::kOne, "N", "scalars held before they are written (default 1000)",
     [](TrainingArgs& a, const FlagValue& v) { a.tensorboard_queue_size = v.positive_up_to(kMaxIterations); }},
    {"--log-timers-to-tensorboard", Arity::kSwitch, "", "write iteration-time (and throughput) to TensorBoard",
     [](TrainingArgs& a, const FlagValue&) { a.log_timers_to_tensorboard = true; }},
    {"--no-log-loss-scale-to-tensorboard", Arity::kSwitch, "", "do not write loss-scale to TensorBoard",
     [](TrainingArgs& a, const FlagValue&) { a.log_loss_scale_to_tensorboard = false; }},
    {"--log-validation-ppl-to-tensorboard", Arity::kSwitch, "", "write validation perplexity to TensorBoard",
     [](TrainingArgs& a, const FlagValue&) { a.log_validation_ppl_to_tensorboard = true; }},
    {"--log-memory-to-tensorboard", Arity::kSwitch, "", "write the memory tracker's figures to TensorBoard",
     [](TrainingArgs& a, const FlagValue&) { a.log_memory_to_tensorboard = true; }},
    {"--log-world-size-to-tensorboard", Arity::kSwitch, "", "write world-size to TensorBoard",
     [](TrainingArgs& a, const FlagValue&) { a.log_world_size_to_tensorboard = true; }},
    {"--log-progress", Arity::kSwitch, "", "append job starts and saves with throughput to <--save>/progress.txt",
     [](TrainingArgs& a, const FlagValue&) { a.log_progress = true; }},
    {"--moe-collapse-min-load-ratio", Arity::kOne, "X",
     "warn when an expert gets under X times its layer's mean tokens for --moe-collapse-intervals log intervals "
     "(default 0.1; 0: off)",
     [](TrainingArgs& a, const FlagValue& v) {
       const double ratio = v.real();
       if (ratio < 0.0 || ratio >= 1.0) v.fail("0 (off) or a load ratio in (0, 1)");
       a.moe_collapse_min_load_ratio = ratio;
     }},
    {"--moe-collapse-max-load-ratio", Arity::kOne, "X",
     "warn when an expert gets over X times its layer's mean tokens for --moe-collapse-intervals log intervals "
     "(default 0: off)",
     [](TrainingArgs& a, const FlagValue& v) {
       const double ratio = v.real();
       if (ratio != 0.0 && !(ratio > 1.0)) v.fail("0 (off) or a load ratio above 1");
       a.moe_collapse_max_load_ratio = ratio;
     }},
    {"--moe-collapse-intervals", Arity::kOne, "N", "consecutive log intervals before the collapse warning (default 3)",
     [](TrainingArgs& a, const FlagValue& v) { a.moe_collapse_intervals = v.positive_up_to(kMaxIterations); }},
    {"--eval-interval", Arity::kOne, "N", "evaluate every N iterations (default: only after training)",
     [](TrainingArgs& a, const FlagValue& v) { a.eval_interval = v.integer(); }},
    {"--eval-iters", Arity::kOne, "N", "batches per evaluation (default 100)",
     [](TrainingArgs& a, const FlagValue& v) { a.eval_iters = v.integer_up_to(kMaxIterations); }},

    // Data and tokenizer.
    {"--data-path", Arity::kList, "PATH...", "dataset prefix(es), optionally weighted: W1 P1 W2 P2 ...",
     [](TrainingArgs& a, const FlagValue& v) { a.data_path = v.values; }},
    {"--mock-data", Arity::kSwitch, "", "train on generated data instead of --data-path",
     [](TrainingArgs& a, const FlagValue&) { a.mock_data = true; }},
    {"--sample-data-path", Arity::kOne, "PATH",
     "moecore: train on whole variable-length samples, PATH.jsonl ({\"tokens\": [...], \"loss_mask\": [...]} per "
     "line) or an indexed prefix (PATH_tokens_document, PATH_loss_mask_document), each sample its own sequence",
     [](TrainingArgs& a, const FlagValue& v) { a.sample_data_path = v.text(); }},
    {"--rl-use-sequence-packing", Arity::kSwitch, "",
     "Megatron-RL: pack each global batch's samples into bins of --seq-length (next-fit decreasing)",
     [](TrainingArgs& a, const FlagValue&) { a.rl_use_sequence_packing = true; }},
    {"--rl-sequence-packing-max-sequences-per-bin", Arity::kOne, "N", "at most N samples in a bin (default 50)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.rl_sequence_packing_max_sequences_per_bin = v.integer_up_to(int64_t{1} << 20);
     }},
    {"--rl-sequence-packing-algo", Arity::kOne, "ALGO",
     "how bins are dealt to the data-parallel ranks: fifo (contiguous blocks, the default) or round-robin",
     [](TrainingArgs& a, const FlagValue& v) { a.rl_sequence_packing_algo = v.choice({"fifo", "round-robin"}); }},
    {"--rl-microbatch-order", Arity::kOne, "ORDER",
     "moecore: the order each rank runs its bins in: packing (as dealt, the default) or serpentine (small-large-small "
     "by the sum of squared sample lengths, the report's attention-cost order)",
     [](TrainingArgs& a, const FlagValue& v) { a.rl_microbatch_order = v.choice({"packing", "serpentine"}); }},
    {"--hybrid-context-parallel", Arity::kSwitch, "",
     "Megatron's dynamic context parallelism: each whole sample (--sample-data-path) runs on the smallest "
     "power-of-two group of the data- and context-parallel ranks that holds it, groups balanced by sum L^2 / cp",
     [](TrainingArgs& a, const FlagValue&) { a.hybrid_context_parallel = true; }},
    {"--max-seqlen-per-dp-cp-rank", Arity::kOne, "N",
     "with --hybrid-context-parallel: the most tokens of a sample one rank holds",
     [](TrainingArgs& a, const FlagValue& v) { a.max_seqlen_per_dp_cp_rank = v.integer_up_to(int64_t{1} << 30); }},
    {"--split", Arity::kOne, "A,B,C", "train,valid,test proportions (default 969, 30, 1)",
     [](TrainingArgs& a, const FlagValue& v) { a.split = v.text(); }},
    {"--data-cache-path", Arity::kOne, "DIR", "directory for the cached dataset indices",
     [](TrainingArgs& a, const FlagValue& v) { a.data_cache_path = v.non_empty_text(); }},
    {"--eod-mask-loss", Arity::kSwitch, "", "exclude end-of-document tokens from the loss",
     [](TrainingArgs& a, const FlagValue&) { a.eod_mask_loss = true; }},
    {"--reset-position-ids", Arity::kSwitch, "", "restart position ids at 0 after every end-of-document token",
     [](TrainingArgs& a, const FlagValue&) { a.reset_position_ids = true; }},
    {"--reset-attention-mask", Arity::kSwitch, "", "no attention across end-of-document tokens (documents)",
     [](TrainingArgs& a, const FlagValue&) { a.reset_attention_mask = true; }},
    {"--tokenizer-type", Arity::kOne, "{GPT2BPETokenizer,NullTokenizer}", "tokenizer (required)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.tokenizer_type = v.choice({"GPT2BPETokenizer", "NullTokenizer"},
                                   {"BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer",
                                    "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer",
                                    "TikTokenizer", "MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"});
     }},
    {"--vocab-file", Arity::kOne, "FILE", "GPT-2 vocab.json",
     [](TrainingArgs& a, const FlagValue& v) { a.vocab_file = v.non_empty_text(); }},
    {"--merge-file", Arity::kOne, "FILE", "GPT-2 merges.txt",
     [](TrainingArgs& a, const FlagValue& v) { a.merge_file = v.non_empty_text(); }},
    {"--vocab-size", Arity::kOne, "N", "NullTokenizer vocabulary size before EOD and padding",
     [](TrainingArgs& a, const FlagValue& v) { a.vocab_size = v.integer_up_to(kMaxVocab, kVocabWhy); }},

    // Mixture of Experts (model.moe; cross-flag checks in MoEConfig::validate).
    {"--num-experts", Arity::kOne, "E", "number of experts; enables MoE (default none: dense)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.moe.num_experts = v.integer_up_to(kMaxExperts); }},
    {"--moe-ffn-hidden-size", Arity::kOne, "N", "hidden size of each expert's MLP (default --ffn-hidden-size)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.moe.ffn_hidden_size = v.integer_up_to(kMaxWidth); }},
    {"--moe-layer-freq", Arity::kOne, "N|PATTERN",
     "MoE every N layers from layer 0, or a 0/1 list such as ([0]*3+[1]*9) (default 1)",
     [](TrainingArgs& a, const FlagValue& v) { a.moe_layer_freq = v.text(); }},
    {"--moe-router-topk", Arity::kOne, "K", "experts per token (default 2)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.moe.topk = v.integer_up_to(kMaxExperts); }},
    {"--moe-router-score-function", Arity::kOne, "{softmax,sigmoid,sqrtsoftplus}", "router score (default softmax)",
     [](TrainingArgs& a, const FlagValue& v) {
       const std::string& name = v.choice({"softmax", "sigmoid", "sqrtsoftplus"});
       a.model.moe.score_function = name == "softmax"   ? RouterScoreFunction::kSoftmax
                                    : name == "sigmoid" ? RouterScoreFunction::kSigmoid
                                                        : RouterScoreFunction::kSqrtSoftplus;
     }},
    {"--moe-router-pre-softmax", Arity::kSwitch, "", "softmax over all experts before the top-k (softmax only)",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.pre_softmax = true; }},
    {"--moe-router-topk-scaling-factor", Arity::kOne, "X", "multiply the routing probabilities by X (default none)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.moe.topk_scaling_factor = v.real_up_to(kMaxLossCoeff, "it multiplies routing probabilities; DeepSeek-V3 uses 2.5"); }},
    {"--moe-router-num-groups", Arity::kOne, "G", "expert groups for group-limited routing",
     [](TrainingArgs& a, const FlagValue& v) { a.model.moe.num_groups = v.integer_up_to(kMaxExperts); }},
    {"--moe-router-group-topk", Arity::kOne, "N", "groups each token may use (with --moe-router-num-groups)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.moe.group_topk = v.integer_up_to(kMaxExperts); }},
    {"--moe-input-jitter-eps", Arity::kOne, "X", "multiply the router input by Uniform(1-X, 1+X) (default off)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.moe.input_jitter_eps = v.real(); }},
    {"--moe-router-dtype", Arity::kOne, "{fp32,fp64}", "router precision (default fp32, the model dtype)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.moe.router_dtype = v.choice({"fp32", "fp64"}) == "fp32" ? RouterDType::kFP32 : RouterDType::kFP64;
     }},
    {"--moe-router-enable-expert-bias", Arity::kSwitch, "", "aux-loss-free balancing with an expert bias (sigmoid)",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.enable_expert_bias = true; }},
    {"--moe-router-bias-update-rate", Arity::kOne, "X", "expert bias step per global batch (default 1e-3)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.moe.bias_update_rate = v.real_up_to(1.0); }},
    {"--moe-router-force-load-balancing", Arity::kSwitch, "", "route on random logits (benchmarking only)",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.force_load_balancing = true; }},
    {"--moe-router-load-balancing-type", Arity::kList, "{aux_loss,seq_aux_loss,global_aux_loss,sinkhorn,none}...",
     "load-balancing strategies (default aux_loss)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.moe.load_balancing_types = v.each([](const FlagValue& one) {
         const std::string& name = one.choice({"aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"});
         return name == "aux_loss"          ? LoadBalancingType::kAuxLoss
                : name == "seq_aux_loss"    ? LoadBalancingType::kSeqAuxLoss
                : name == "global_aux_loss" ? LoadBalancingType::kGlobalAuxLoss
                : name == "sinkhorn"        ? LoadBalancingType::kSinkhorn
                                            : LoadBalancingType::kNone;
       });
     }},
    {"--moe-aux-loss-coeff", Arity::kList, "X...", "coefficient of each load-balancing loss (default 0)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.moe.aux_loss_coeffs = v.each([](const FlagValue& one) { return one.real_up_to(kMaxLossCoeff); });
     }},
    {"--moe-z-loss-coeff", Arity::kOne, "X", "router z-loss coefficient (default off)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.moe.z_loss_coeff = v.real_up_to(kMaxLossCoeff); }},
    {"--moe-expert-capacity-factor", Arity::kOne, "X", "expert capacity factor; negative = dropless (default dropless)",
     [](TrainingArgs& a, const FlagValue& v) {
       const double factor = v.real_up_to(kMaxCapacityFactor);
       a.model.moe.capacity_factor = factor < 0.0 ? std::nullopt : std::optional<double>(factor);
     }},
    {"--moe-token-drop-policy", Arity::kOne, "{probs,position}", "which tokens an expert over capacity drops",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.moe.drop_policy =
           v.choice({"probs", "position"}) == "probs" ? TokenDropPolicy::kProbs : TokenDropPolicy::kPosition;
     }},
    {"--moe-pad-expert-input-to-capacity", Arity::kSwitch, "", "pad every expert's input to its capacity",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.pad_expert_input_to_capacity = true; }},
    {"--moe-router-padding-for-quantization", Arity::kSwitch, "",
     "with FP8 / FP4: pad each rank's routing map so every expert's token count is a multiple of the recipe's "
     "alignment (zero-probability tokens)",
     [](TrainingArgs& a, const FlagValue&) { a.moe_router_padding_for_quantization = true; }},
    {"--moe-router-padding-for-fp8", Arity::kSwitch, "", "alias of --moe-router-padding-for-quantization",
     [](TrainingArgs& a, const FlagValue&) { a.moe_router_padding_for_quantization = true; }},
    {"--moe-token-dispatcher-type", Arity::kOne, "{allgather,alltoall,flex}", "token dispatcher (default allgather)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.moe_token_dispatcher_type = v.choice({"allgather", "alltoall", "flex"});
       a.model.moe.dispatcher_type = a.moe_token_dispatcher_type == "alltoall" ? TokenDispatcherType::kAllToAll
                                     : a.moe_token_dispatcher_type == "flex"   ? TokenDispatcherType::kFlex
                                                                               : TokenDispatcherType::kAllGather;
     }},
    {"--moe-flex-dispatcher-backend", Arity::kOne, "{deepep,hybridep,ncclep,mpiep}",
     "the flex dispatcher's backend: mpiep (moecore's, on MPI: each token once per destination host, then shared "
     "memory inside the host; the default here); DeepEP, HybridEP and NCCL EP need NVIDIA GPUs",
     [](TrainingArgs& a, const FlagValue& v) {
       const std::string backend = v.choice({"deepep", "hybridep", "ncclep", "mpiep"});
       if (backend != "mpiep") {
         throw ConfigError("--moe-flex-dispatcher-backend " + backend +
                           " needs NVIDIA GPUs; on this backend the flex dispatcher runs on mpiep");
       }
       a.moe_flex_dispatcher_backend = backend;
     }},
    {"--no-moe-memory-efficient-permutation", Arity::kSwitch, "",
     "moecore: apply the routed experts' probabilities to their output, keeping it for the probabilities' gradient, "
     "instead of to fc2's input (the report's memory-efficient permutation, the default)",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.memory_efficient_permutation = false; }},
    {"--moe-apply-probs-on-input", Arity::kSwitch, "", "scale expert inputs by their probability (top-1 only)",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.apply_probs_on_input = true; }},
    {"--moe-grouped-gemm", Arity::kSwitch, "", "run all local experts as one grouped GEMM",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.grouped_gemm = true; }},
    {"--moe-shared-expert-intermediate-size", Arity::kOne, "N", "total MLP size of the shared experts (default none)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.moe.shared_expert_intermediate_size = v.integer_up_to(kMaxWidth); }},
    {"--moe-shared-expert-gate", Arity::kSwitch, "", "gate the shared experts' output by sigmoid(x w)",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.shared_expert_gate = true; }},
    {"--moe-shared-expert-overlap", Arity::kSwitch, "",
     "compute the shared experts while the alltoall dispatcher's token exchange is in flight",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.shared_expert_overlap = true; }},
    {"--moe-latent-size", Arity::kOne, "N",
     "LatentMoE: project tokens to N features before dispatch, run the routed experts in that width and project "
     "back after combine (router and shared experts stay on the hidden size)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.moe.latent_size = v.integer_up_to(kMaxWidth);
       if (a.model.moe.latent_size <= 0) {
         throw ConfigError("MoE latent projection dimension has to be greater than zero (--moe-latent-size " +
                           std::to_string(a.model.moe.latent_size) + ")");
       }
     }},
    {"--moe-enable-routing-replay", Arity::kSwitch, "",
     "Megatron's router replay: with --moe-routing-replay-file the training forwards route by a recording",
     [](TrainingArgs& a, const FlagValue&) { a.moe_enable_routing_replay = true; }},
    {"--moe-routing-replay-file", Arity::kOne, "FILE",
     "moecore: the routing recording (moecore generate --record-routing) whose experts the training forwards take "
     "for their samples, probabilities from the live router scores",
     [](TrainingArgs& a, const FlagValue& v) { a.moe_routing_replay_file = v.text(); }},
    {"--calculate-per-token-loss", Arity::kSwitch, "",
     "Megatron's per-token loss: each micro-batch's loss is summed over its tokens and every gradient divided by the "
     "global batch's loss tokens (over micro-batches and data-parallel ranks), instead of a mean of micro-batch means",
     [](TrainingArgs& a, const FlagValue&) { a.calculate_per_token_loss = true; }},
    {"--overlap-moe-expert-parallel-comm", Arity::kSwitch, "",
     "Megatron's combined 1F1B schedule: the forward of one micro-batch and the backward of another run together, "
     "each one's expert all-to-all travelling while the other computes",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.overlap_ep_comm = true; }},
    {"--delay-wgrad-compute", Arity::kSwitch, "",
     "with --overlap-moe-expert-parallel-comm: compute the routed experts' weight gradients while the dispatch "
     "backward's all-to-all travels",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.delay_wgrad_compute = true; }},
    {"--moe-per-layer-logging", Arity::kSwitch, "", "log the auxiliary losses of every MoE layer",
     [](TrainingArgs& a, const FlagValue&) { a.model.moe.per_layer_logging = true; }},
    {"--moe-routing-trace-path", Arity::kOne, "DIR",
     "write each rank's routing decisions of the training iterations to DIR/router_trace_rank<r>.jsonl",
     [](TrainingArgs& a, const FlagValue& v) { a.moe_routing_trace.path = v.non_empty_text(); }},
    {"--moe-routing-trace-max-training-iters", Arity::kOne, "N", "trace the first N iterations (default: all)",
     [](TrainingArgs& a, const FlagValue& v) { a.moe_routing_trace.max_training_iters = v.positive_up_to(kMaxIterations); }},
    {"--moe-routing-trace-capture-logits", Arity::kSwitch, "", "also write the router logits (bf16 sidecar)",
     [](TrainingArgs& a, const FlagValue&) { a.moe_routing_trace.capture_logits = true; }},
    {"--moe-routing-trace-capture-hidden-states", Arity::kSwitch, "",
     "also write the router inputs (bf16 sidecar)",
     [](TrainingArgs& a, const FlagValue&) { a.moe_routing_trace.capture_hidden_states = true; }},
    {"--moe-routing-trace-dump-weights", Arity::kSwitch, "",
     "also write each router's weight and expert bias to DIR/router_state_rank<r>.pt (torch.save)",
     [](TrainingArgs& a, const FlagValue&) { a.moe_routing_trace.dump_weights = true; }},

    // Activation recomputation (Megatron's transformer_config.py recompute_*; checks in arguments_finalize.cpp).
    {"--recompute-granularity", Arity::kOne, "{full,selective}",
     "recompute whole layers in backward (full) or the --recompute-modules of each layer (selective)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.recompute.granularity = v.choice({"full", "selective"}) == "full"
                                           ? RecomputeConfig::Granularity::kFull
                                           : RecomputeConfig::Granularity::kSelective;
     }},
    {"--recompute-method", Arity::kOne, "{uniform,block}",
     "full: checkpoints of --recompute-num-layers layers (uniform), or only the first N layers of each chunk (block)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.recompute.method = v.choice({"uniform", "block"}) == "uniform" ? RecomputeConfig::Method::kUniform
                                                                              : RecomputeConfig::Method::kBlock;
     }},
    {"--recompute-num-layers", Arity::kOne, "N", "full: layers per checkpoint (uniform) or checkpointed layers (block)",
     [](TrainingArgs& a, const FlagValue& v) { a.model.recompute.num_layers = v.positive_up_to(kMaxCount); }},
    {"--recompute-modules", Arity::kList, "M...",
     "selective: core_attn (default) moe_act layernorm mla_up_proj mlp moe shared_experts",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.recompute.modules = v.each([](const FlagValue& one) {
         return one.choice({"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"},
                           {"gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc"});
       });
     }},
    {"--recompute-activations", Arity::kSwitch, "", "--recompute-granularity selective",
     [](TrainingArgs&, const FlagValue&) {}},
    {"--moe-layer-recompute", Arity::kSwitch, "", "deprecated: adds moe to selective --recompute-modules",
     [](TrainingArgs&, const FlagValue&) {}},
    {"--distribute-saved-activations", Arity::kSwitch, "",
     "full, TP > 1 without --sequence-parallel: each TP rank keeps 1/TP of a checkpoint's input",
     [](TrainingArgs& a, const FlagValue&) { a.model.recompute.distribute_saved_activations = true; }},

    // Parallelism: the world size is the number of processes mpirun launched.
    {"--tensor-model-parallel-size", Arity::kOne, "N", "tensor parallel size (heads, ffn, vocabulary)",
     [](TrainingArgs& a, const FlagValue& v) { a.parallel.tensor_model_parallel_size = v.positive_up_to(kMaxRanks); }},
    {"--pipeline-model-parallel-size", Arity::kOne, "N", "pipeline parallel size (`moecore layout` prints the split)",
     [](TrainingArgs& a, const FlagValue& v) { a.parallel.pipeline_model_parallel_size = v.positive_up_to(kMaxRanks); }},
    {"--decoder-first-pipeline-num-layers", Arity::kOne, "N", "decoder layers of the first pipeline stage",
     [](TrainingArgs& a, const FlagValue& v) { a.pipeline_split.decoder_first_pipeline_num_layers = v.integer(); }},
    {"--decoder-last-pipeline-num-layers", Arity::kOne, "N", "decoder layers of the last pipeline stage",
     [](TrainingArgs& a, const FlagValue& v) { a.pipeline_split.decoder_last_pipeline_num_layers = v.integer(); }},
    {"--account-for-embedding-in-pipeline-split", Arity::kSwitch, "", "count the embedding as a layer in the split",
     [](TrainingArgs& a, const FlagValue&) { a.pipeline_split.account_for_embedding_in_pipeline_split = true; }},
    {"--account-for-loss-in-pipeline-split", Arity::kSwitch, "", "count the loss as a layer in the split",
     [](TrainingArgs& a, const FlagValue&) { a.pipeline_split.account_for_loss_in_pipeline_split = true; }},
    {"--pipeline-model-parallel-layout", Arity::kOne, "LAYOUT",
     "pipeline stages by hand, e.g. \"Et|(tt|)*2,tL\" (E embedding, t layer, L loss)",
     [](TrainingArgs& a, const FlagValue& v) { a.pipeline_split.pipeline_model_parallel_layout = v.text(); }},
    {"--num-layers-per-virtual-pipeline-stage", Arity::kOne, "N", "layers per virtual pipeline stage",
     [](TrainingArgs& a, const FlagValue& v) { a.pipeline_split.num_layers_per_virtual_pipeline_stage = v.integer(); }},
    {"--num-virtual-stages-per-pipeline-rank", Arity::kOne, "N", "virtual pipeline stages per pipeline rank",
     [](TrainingArgs& a, const FlagValue& v) { a.pipeline_split.num_virtual_stages_per_pipeline_rank = v.integer(); }},
    {"--no-overlap-p2p-communication", Arity::kSwitch, "",
     "interleaved schedule: wait for each transfer at its p2p call instead of when its step needs it",
     [](TrainingArgs& a, const FlagValue&) { a.pipeline_split.overlap_p2p_comm = false; }},
    {"--microbatch-group-size-per-virtual-pipeline-stage", Arity::kOne, "N",
     "interleaved schedule: micro-batches run through a model chunk before the next (default: PP)",
     [](TrainingArgs& a, const FlagValue& v) { a.microbatch_group_size_per_vp_stage = v.positive_up_to(kMaxRanks); }},
    {"--context-parallel-size", Arity::kOne, "N", "context parallel size (sequence split over N ranks)",
     [](TrainingArgs& a, const FlagValue& v) { a.parallel.context_parallel_size = v.positive_up_to(kMaxRanks); }},
    {"--cp-comm-type", Arity::kList, "TYPE...",
     "context-parallel attention: p2p (ring), all_gather or a2a (Ulysses); one value or one per layer",
     [](TrainingArgs& a, const FlagValue& v) {
       a.model.cp_comm_type = v.each([](const FlagValue& one) {
         return std::string(one.choice({"p2p", "all_gather", "a2a"}, {"a2a+p2p"}));
       });
     }},
    {"--expert-model-parallel-size", Arity::kOne, "N", "expert parallel size (experts split over EP ranks)",
     [](TrainingArgs& a, const FlagValue& v) { a.parallel.expert_model_parallel_size = v.positive_up_to(kMaxRanks); }},
    {"--expert-tensor-parallel-size", Arity::kOne, "N", "expert tensor parallel size (default: TP size)",
     [](TrainingArgs& a, const FlagValue& v) { a.parallel.expert_tensor_parallel_size = v.positive_up_to(kMaxRanks); }},
    {"--use-tp-pp-dp-mapping", Arity::kSwitch, "", "rank order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp",
     [](TrainingArgs& a, const FlagValue&) { a.parallel.order = kTpPpDpRankOrder; }},
    {"--sequence-parallel", Arity::kSwitch, "", "shard norms / dropout / residuals over the sequence across TP",
     [](TrainingArgs& a, const FlagValue&) { a.sequence_parallel = true; }},
    {"--use-distributed-optimizer", Arity::kSwitch, "", "shard fp32 master weights and Adam states over DP",
     [](TrainingArgs& a, const FlagValue&) { a.use_distributed_optimizer = true; }},
    {"--overlap-grad-reduce", Arity::kSwitch, "", "reduce each gradient bucket while backward continues",
     [](TrainingArgs& a, const FlagValue&) { a.overlap_grad_reduce = true; }},
    {"--overlap-param-gather", Arity::kSwitch, "", "all-gather parameters while the next forward runs",
     [](TrainingArgs& a, const FlagValue&) { a.overlap_param_gather = true; }},
    {"--ddp-bucket-size", Arity::kOne, "N", "gradient bucket size in elements (default max(40M, 1M * DP))",
     [](TrainingArgs& a, const FlagValue& v) { a.ddp_bucket_size = v.integer_up_to(kMaxElements); }},
    {"--use-megatron-fsdp", Arity::kSwitch, "",
     "Megatron-FSDP: shard each decoder layer's parameters, gradients and optimizer states over DP (experts over "
     "expert-DP) by --data-parallel-sharding-strategy; implies --use-distributed-optimizer",
     [](TrainingArgs& a, const FlagValue&) { a.use_megatron_fsdp = true; }},
    {"--data-parallel-sharding-strategy", Arity::kOne, "{no_shard,optim,optim_grads,optim_grads_params}",
     "what Megatron-FSDP shards (default optim_grads_params: optimizer states, gradients and parameters)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.data_parallel_sharding_strategy = v.choice({"no_shard", "optim", "optim_grads", "optim_grads_params"}, {});
     }},
    {"--megatron-fsdp-version", Arity::kOne, "{1}", "Megatron-FSDP implementation (1, Megatron's default)",
     [](TrainingArgs& a, const FlagValue& v) { a.megatron_fsdp_version = v.choice({"1"}, {"2"}); }},
    {"--distributed-timeout-minutes", Arity::kOne, "N",
     "end the job when a collective or point-to-point wait lasts N minutes, naming the ranks that did not arrive "
     "(default 10; fractions allowed)",
     [](TrainingArgs& a, const FlagValue& v) { a.distributed_timeout_minutes = v.real_up_to(kMaxTimeoutMinutes); }},

    // Checkpointing.
    {"--save", Arity::kOne, "DIR", "save checkpoints to DIR (iter_NNNNNNN folders + latest_checkpointed_iteration.txt)",
     [](TrainingArgs& a, const FlagValue& v) { a.save = v.non_empty_text(); }},
    {"--load", Arity::kOne, "DIR", "resume from DIR's latest checkpoint, or start from a HuggingFace folder",
     [](TrainingArgs& a, const FlagValue& v) { a.load = v.non_empty_text(); }},
    {"--save-interval", Arity::kOne, "N", "save a checkpoint every N iterations (required with --save)",
     [](TrainingArgs& a, const FlagValue& v) { a.save_interval = v.integer(); }},
    {"--persistent-save-interval", Arity::kOne, "N", "alias of --save-interval",
     [](TrainingArgs& a, const FlagValue& v) { a.save_interval = v.integer(); }},
    {"--no-save-optim", Arity::kSwitch, "", "do not save the optimizer and scheduler state",
     [](TrainingArgs& a, const FlagValue&) { a.no_save_optim = true; }},
    {"--no-save-rng", Arity::kSwitch, "", "do not save the RNG state",
     [](TrainingArgs& a, const FlagValue&) { a.no_save_rng = true; }},
    {"--no-load-optim", Arity::kSwitch, "", "do not load the optimizer and scheduler state",
     [](TrainingArgs& a, const FlagValue&) { a.no_load_optim = true; }},
    {"--no-load-rng", Arity::kSwitch, "", "do not load the RNG state (use --seed)",
     [](TrainingArgs& a, const FlagValue&) { a.no_load_rng = true; }},
    {"--finetune", Arity::kSwitch, "", "load the model weights only and start at iteration 0",
     [](TrainingArgs& a, const FlagValue&) { a.finetune = true; }},
    {"--ckpt-step", Arity::kOne, "N", "load iteration N instead of the tracker's",
     [](TrainingArgs& a, const FlagValue& v) { a.ckpt_step = v.integer(); }},
    {"--exit-on-missing-checkpoint", Arity::kSwitch, "", "exit with an error when --load has no checkpoint",
     [](TrainingArgs& a, const FlagValue&) { a.exit_on_missing_checkpoint = true; }},
    {"--async-save", Arity::kSwitch, "", "write checkpoints in the background while training goes on",
     [](TrainingArgs& a, const FlagValue&) { a.async_save = true; }},
    {"--ckpt-save-failure", Arity::kOne, "{stop,continue}",
     "when a save fails (full disk, I/O error): stop the run (default), or warn and train on (moecore)",
     [](TrainingArgs& a, const FlagValue& v) { a.continue_after_failed_save = v.choice({"stop", "continue"}, {}) == "continue"; }},
    {"--save-overwrite-other-model", Arity::kSwitch, "",
     "let --save replace checkpoints of a model with other model flags (moecore)",
     [](TrainingArgs& a, const FlagValue&) { a.save_overwrite_other_model = true; }},
    {"--non-persistent-save-interval", Arity::kOne, "N", "also save to DIR/non_persistent every N iterations",
     [](TrainingArgs& a, const FlagValue& v) { a.non_persistent_save_interval = v.integer(); }},
    {"--non-persistent-ckpt-type", Arity::kOne, "{global}", "kind of non-persistent checkpoint (global)",
     [](TrainingArgs& a, const FlagValue& v) { a.non_persistent_ckpt_type = v.choice({"global"}, {"local", "in_memory"}); }},
    {"--exit-interval", Arity::kOne, "N", "save and exit when the iteration is a multiple of N",
     [](TrainingArgs& a, const FlagValue& v) { a.exit_interval = v.integer(); }},
    {"--exit-duration-in-mins", Arity::kOne, "X", "save and exit after X minutes of running",
     [](TrainingArgs& a, const FlagValue& v) { a.exit_duration_in_mins = v.real(); }},
    {"--exit-signal-handler", Arity::kSwitch, "", "on --exit-signal: finish the iteration, save, exit 0",
     [](TrainingArgs& a, const FlagValue&) { a.exit_signal_handler = true; }},
    {"--exit-signal", Arity::kOne, "SIGNAL", "the signal --exit-signal-handler catches (default SIGTERM)",
     [](TrainingArgs& a, const FlagValue& v) {
       a.exit_signal = v.choice({"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU"});
     }},
    {"--non-persistent-global-ckpt-dir", Arity::kOne, "DIR",
     "where non-persistent checkpoints go and are looked for (default SAVE/non_persistent, LOAD/non_persistent)",
     [](TrainingArgs& a, const FlagValue& v) { a.non_persistent_global_ckpt_dir = v.non_empty_text(); }},
    {"--override-opt_param-scheduler", Arity::kSwitch, "",
     "on --load, take the LR and weight-decay schedule from the flags and its position from the consumed samples",
     [](TrainingArgs& a, const FlagValue&) { a.override_opt_param_scheduler = true; }},
    {"--override-opt-param-scheduler", Arity::kSwitch, "", "the same as --override-opt_param-scheduler",
     [](TrainingArgs& a, const FlagValue&) { a.override_opt_param_scheduler = true; }},
    {"--use-checkpoint-opt_param-scheduler", Arity::kSwitch, "",
     "on --load, take the LR and weight-decay schedule from the checkpoint",
     [](TrainingArgs& a, const FlagValue&) { a.use_checkpoint_opt_param_scheduler = true; }},
    {"--use-checkpoint-opt-param-scheduler", Arity::kSwitch, "", "the same as --use-checkpoint-opt_param-scheduler",
     [](TrainingArgs& a, const FlagValue&) { a.use_checkpoint_opt_param_scheduler = true; }},
    {"--moe-use-upcycling", Arity::kSwitch, "", "build the MoE model from the dense checkpoint of --load",
     [](TrainingArgs& a, const FlagValue&) { a.moe_use_upcycling = true; }},
    {"--moe-upcycling-granularity", Arity::kOne, "N", "split the dense MLP into N experts' worth (default 1)",
     [](TrainingArgs& a, const FlagValue& v) { a.moe_upcycling_granularity = v.integer_up_to(kMaxWidth); }},

    // Profiling.
    {"--profile", Arity::kSwitch, "", "write a Chrome/Perfetto trace of --profile-step-start..--profile-step-end",
     [](TrainingArgs& a, const FlagValue&) { a.profile = true; }},
    {"--profile-step-start", Arity::kOne, "N", "first profiled step: iterations after N (default 10)",
     [](TrainingArgs& a, const FlagValue& v) { a.profile_step_start = v.integer(); }},
    {"--profile-step-end", Arity::kOne, "N", "profiling stops after iteration N (default 12)",
     [](TrainingArgs& a, const FlagValue& v) { a.profile_step_end = v.integer(); }},
    {"--profile-ranks", Arity::kList, "R...", "global ranks to profile (default 0)",
     [](TrainingArgs& a, const FlagValue& v) { a.profile_ranks = v.each([](const FlagValue& one) { return one.integer(); }); }},
    {"--profile-dir", Arity::kOne, "DIR", "where the traces go: DIR/trace_rank<R>.json (default ., moecore)",
     [](TrainingArgs& a, const FlagValue& v) { a.profile_dir = v.non_empty_text(); }},

    // moecore-only.
    {"--export-hf", Arity::kOne, "DIR", "after training, write a HuggingFace checkpoint to DIR (moecore)",
     [](TrainingArgs& a, const FlagValue& v) { a.export_hf_dir = v.non_empty_text(); }},
    {"--sample-prompt", Arity::kOne, "TEXT", "after training, generate a continuation of TEXT (moecore)",
     [](TrainingArgs& a, const FlagValue& v) { a.sample_prompt = v.non_empty_text(); }},
    {"--sample-tokens", Arity::kOne, "N", "tokens to generate for --sample-prompt (default 32, moecore)",
     [](TrainingArgs& a, const FlagValue& v) { a.sample_tokens = v.integer_up_to(kMaxPositions); }},
    {"--mock-max-sequence-length", Arity::kOne, "N",
     "--mock-data documents up to N tokens (default 4096, moecore): smaller packs more documents per sequence",
     [](TrainingArgs& a, const FlagValue& v) {
       a.mock_max_sequence_length = v.positive_up_to(INT32_MAX);
     }},
    {"--threads", Arity::kOne, "N", "CPU threads, 0 = all cores (default 0, moecore)",
     [](TrainingArgs& a, const FlagValue& v) { a.threads = v.integer_up_to(hardware_threads(), "the hardware threads of this machine"); }},
  };
  return table;
}
// clang-format on

}  // namespace

bool looks_like_train_flag(const std::string_view token) { return looks_like_flag(token); }

TrainingArgs parse_train_args(const std::vector<std::string>& args, const int world_size) {
  TrainingArgs parsed;
  parsed.parallel.world_size = world_size;
  FlagParserOptions options;
  options.is_megatron_only = [](const std::string_view name) { return is_unimplemented_megatron_flag(name); };
  for (const std::string_view flag : unimplemented_megatron_flags()) options.megatron_names.emplace_back(flag);
  options.refusal = [](const std::string_view name) { return offloading_refusal(name); };
  for (const std::string_view flag : offloading_megatron_flags()) options.megatron_names.emplace_back(flag);
  try {
    const ParsedFlags flags = parse_flags(flag_table(), args, parsed, options);
    if (flags.help_requested) {
      parsed.help_requested = true;
      return parsed;
    }
    detail::finalize_train_args(parsed, flags.given);
  } catch (const FlagError& error) {
    throw ConfigError(error.what());
  }
  return parsed;
}

std::string train_flags_help() { return flags_help(flag_table()); }

std::vector<std::string> implemented_train_flags() { return flag_names(flag_table()); }

PipelineShape pipeline_shape(const TrainingArgs& args) {
  return {args.model.num_layers, args.parallel.pipeline_model_parallel_size, args.model.mtp_num_layers};
}

PipelineLayout pipeline_layout(const TrainingArgs& args) {
  return PipelineLayout(pipeline_shape(args), args.pipeline_split);
}

int64_t padded_vocab_size(const int64_t vocab_size, const TrainingArgs& args) {
  return padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, args.parallel.tensor_model_parallel_size);
}

LRScheduleConfig lr_schedule_config(const TrainingArgs& args) {
  LRScheduleConfig config;
  config.max_lr = args.lr;
  config.min_lr = args.min_lr;
  config.init_lr = args.lr_warmup_init;
  config.global_batch_size = args.global_batch_size;
  config.warmup_iters = args.lr_warmup_iters;
  config.warmup_fraction = args.lr_warmup_fraction;
  config.decay_iters = args.lr_decay_iters;
  config.decay_style = args.lr_decay_style;
  config.wsd_decay_iters = args.lr_wsd_decay_iters;
  config.wsd_decay_style = args.lr_wsd_decay_style;
  config.start_wd = args.start_weight_decay.value_or(args.weight_decay);
  config.end_wd = args.end_weight_decay.value_or(args.weight_decay);
  config.wd_incr_iters = args.train_iters;
  config.wd_incr_style = args.weight_decay_incr_style;
  return config;
}

}  // namespace moecore
