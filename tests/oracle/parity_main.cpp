// moecore_parity: runs the C++ GPT model on a given config, weights and batch, and writes everything the PyTorch
// twin computes, for tests/oracle/test_parity.py and test_hf_export.py to compare.
//
//   moecore_parity --config C.json --weights W.safetensors --batch B.safetensors --out O.safetensors
//                  [--steps N] [--lr 1e-3] [--weight-decay 0.1] [--clip-grad 1.0] [--beta1 0.9] [--beta2 0.999]
//                  [--eps 1e-8] [--microbatches 1] [--export-hf DIR] [--export-hf-bf16] [--export-hf-type T]
//                  [--import-hf DIR]
//
// C.json holds ModelConfig fields by name (enums as strings: "RMSNorm", "swiglu", "rope", ...), and optionally
// "moe": {MoEConfig fields by name} (tests/oracle/twin_moe.py MOE_DEFAULTS lists them), "mla": {MlaConfig fields}
// and "yarn": {YarnConfig fields} (tests/oracle/twin_mla.py lists both). W.safetensors holds
// every parameter under its Megatron name; B.safetensors holds tokens and labels [B, S] (int32/int64) and optionally
// loss_mask [B, S], and the twin's optional packed-sequence inputs position_ids / document_ids [B, S] (positions of
// the rows, documents that attention does not cross).
// With --import-hf DIR the model (config and weights) comes from an HF export instead.
// W.safetensors may also hold MoE router buffers decoder.layers.{i}.mlp.router.expert_bias [E] (loaded as state).
// Protocol (dropout must be 0): for step k = 0..N: forward (losses[k]); if k < N: backward, finish_global_batch
// (MoE expert-bias update), clip, AdamW step, record step{k+1}.<name>. Step 0 also records logits [S, B, V], loss and
// grad.<name> (before clipping). MoE models also record, per forward, load_balancing_loss [(N+1) M, n_moe_layers,
// n_types] and z_loss [(N+1) M, n_moe_layers] (logged values, loss / coeff), and with expert bias
// step{k+1}.decoder.layers.{i}.mlp.router.expert_bias [E]. With "mtp_num_layers" D, the MoE records list the MTP
// depths' MoE layers after the decoder's, and mtp_losses [(N+1) M, D] holds each forward's unscaled depth losses.
// With --microbatches M (dividing B) every step is a global batch of M micro-batches of B / M consecutive batch rows,
// as the trainer runs them: forward and backward(1 / M) each (the lm and the aux / z gradients scaled by 1 / M), the
// loss is the mean of the micro-batch losses, logits are the micro-batches' concatenated along B.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/ckpt/hf_checkpoint.h"
#include "moecore/ckpt/safetensors.h"
#include "moecore/model/gpt_model.h"
#include "moecore/optim/adamw_optimizer.h"

namespace moecore {
namespace {

using json = nlohmann::json;

struct Args {
  std::string config, weights, batch, out, export_hf, import_hf, export_hf_type;
  int64_t steps = 0, microbatches = 1;
  double lr = 1e-3, weight_decay = 0.1, clip_grad = 1.0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool export_bf16 = false;
};

Args parse_args(int argc, char** argv) {
  Args a;
  const std::map<std::string, std::string*> strings = {{"--config", &a.config},
                                                       {"--weights", &a.weights},
                                                       {"--batch", &a.batch},
                                                       {"--out", &a.out},
                                                       {"--export-hf", &a.export_hf},
                                                       {"--import-hf", &a.import_hf},
                                                       {"--export-hf-type", &a.export_hf_type}};
  const std::map<std::string, double*> doubles = {{"--lr", &a.lr},
                                                  {"--weight-decay", &a.weight_decay},
                                                  {"--clip-grad", &a.clip_grad},
                                                  {"--beta1", &a.beta1},
                                                  {"--beta2", &a.beta2},
                                                  {"--eps", &a.eps}};
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--export-hf-bf16") {
      a.export_bf16 = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument("flag " + flag + " needs a value");
    const std::string value = argv[++i];
    if (strings.contains(flag)) {
      *strings.at(flag) = value;
    } else if (doubles.contains(flag)) {
      *doubles.at(flag) = std::stod(value);
    } else if (flag == "--steps") {
      a.steps = std::stoll(value);
    } else if (flag == "--microbatches") {
      a.microbatches = std::stoll(value);
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  if (a.batch.empty() || a.out.empty()) throw std::invalid_argument("--batch and --out are required");
  if (a.import_hf.empty() && (a.config.empty() || a.weights.empty())) {
    throw std::invalid_argument("give --config and --weights, or --import-hf");
  }
  return a;
}

ModelConfig config_fields(const json& j, const std::string& path);

// The "moe" object: MoEConfig fields by name (enums as strings, optionals as null or a number).
MoEConfig moe_fields(const json& j, const std::string& path) {
  if (!j.is_object()) throw std::runtime_error(path + ": \"moe\" must be an object");
  MoEConfig m;
  auto optional_double = [](const json& v) {
    return v.is_null() ? std::nullopt : std::optional<double>(v.get<double>());
  };
  for (const auto& [key, value] : j.items()) {
    if (key == "num_experts") {
      m.num_experts = value;
    } else if (key == "ffn_hidden_size") {
      m.ffn_hidden_size = value;
    } else if (key == "moe_layer_pattern") {
      m.moe_layer_pattern.clear();
      for (const auto& v : value) m.moe_layer_pattern.push_back(v.is_boolean() ? v.get<bool>() : v.get<int>() != 0);
    } else if (key == "topk") {
      m.topk = value;
    } else if (key == "score_function") {
      const std::string v = value;
      if (v == "softmax")
        m.score_function = RouterScoreFunction::kSoftmax;
      else if (v == "sigmoid")
        m.score_function = RouterScoreFunction::kSigmoid;
      else if (v == "sqrtsoftplus")
        m.score_function = RouterScoreFunction::kSqrtSoftplus;
      else
        throw std::runtime_error(path + ": moe.score_function " + v);
    } else if (key == "pre_softmax") {
      m.pre_softmax = value;
    } else if (key == "topk_scaling_factor") {
      m.topk_scaling_factor = optional_double(value);
    } else if (key == "num_groups") {
      m.num_groups = value;
    } else if (key == "group_topk") {
      m.group_topk = value;
    } else if (key == "input_jitter_eps") {
      m.input_jitter_eps = value;
    } else if (key == "router_dtype") {
      const std::string v = value;
      if (v != "fp32" && v != "fp64") throw std::runtime_error(path + ": moe.router_dtype " + v);
      m.router_dtype = v == "fp32" ? RouterDType::kFP32 : RouterDType::kFP64;
    } else if (key == "enable_expert_bias") {
      m.enable_expert_bias = value;
    } else if (key == "bias_update_rate") {
      m.bias_update_rate = value;
    } else if (key == "force_load_balancing") {
      m.force_load_balancing = value;
    } else if (key == "load_balancing_types") {
      m.load_balancing_types.clear();
      for (const auto& item : value) {
        const std::string v = item;
        if (v == "aux_loss")
          m.load_balancing_types.push_back(LoadBalancingType::kAuxLoss);
        else if (v == "seq_aux_loss")
          m.load_balancing_types.push_back(LoadBalancingType::kSeqAuxLoss);
        else if (v == "global_aux_loss")
          m.load_balancing_types.push_back(LoadBalancingType::kGlobalAuxLoss);
        else if (v == "sinkhorn")
          m.load_balancing_types.push_back(LoadBalancingType::kSinkhorn);
        else if (v == "none")
          m.load_balancing_types.push_back(LoadBalancingType::kNone);
        else
          throw std::runtime_error(path + ": moe.load_balancing_types entry " + v);
      }
    } else if (key == "aux_loss_coeffs") {
      m.aux_loss_coeffs = value.get<std::vector<double>>();
    } else if (key == "z_loss_coeff") {
      m.z_loss_coeff = value;
    } else if (key == "capacity_factor") {
      m.capacity_factor = optional_double(value);
    } else if (key == "drop_policy") {
      const std::string v = value;
      if (v != "probs" && v != "position") throw std::runtime_error(path + ": moe.drop_policy " + v);
      m.drop_policy = v == "probs" ? TokenDropPolicy::kProbs : TokenDropPolicy::kPosition;
    } else if (key == "pad_expert_input_to_capacity") {
      m.pad_expert_input_to_capacity = value;
    } else if (key == "apply_probs_on_input") {
      m.apply_probs_on_input = value;
    } else if (key == "grouped_gemm") {
      m.grouped_gemm = value;
    } else if (key == "shared_expert_intermediate_size") {
      m.shared_expert_intermediate_size = value;
    } else if (key == "shared_expert_gate") {
      m.shared_expert_gate = value;
    } else if (key == "latent_size") {
      m.latent_size = value;
    } else if (key == "per_layer_logging") {
      m.per_layer_logging = value;
    } else {
      throw std::runtime_error(path + ": unknown moe config field '" + key + "'");
    }
  }
  return m;
}

// The "mla" object: MlaConfig fields by name (rope_type "yarn" or "rope").
MlaConfig mla_fields(const json& j, const std::string& path) {
  if (!j.is_object()) throw std::runtime_error(path + ": \"mla\" must be an object or null");
  MlaConfig m;
  for (const auto& [key, value] : j.items()) {
    if (key == "q_lora_rank") {
      m.q_lora_rank = value;
    } else if (key == "kv_lora_rank") {
      m.kv_lora_rank = value;
    } else if (key == "qk_head_dim") {
      m.qk_head_dim = value;
    } else if (key == "qk_pos_emb_head_dim") {
      m.qk_pos_emb_head_dim = value;
    } else if (key == "v_head_dim") {
      m.v_head_dim = value;
    } else if (key == "rope_type") {
      const std::string v = value;
      if (v != "yarn" && v != "rope") throw std::runtime_error(path + ": mla.rope_type " + v);
      m.rope_type = v == "yarn" ? RopeType::kYarn : RopeType::kRope;
    } else {
      throw std::runtime_error(path + ": unknown mla config field '" + key + "'");
    }
  }
  return m;
}

// The "yarn" object: YarnConfig fields by name.
YarnConfig yarn_fields(const json& j, const std::string& path) {
  if (!j.is_object()) throw std::runtime_error(path + ": \"yarn\" must be an object");
  YarnConfig y;
  for (const auto& [key, value] : j.items()) {
    if (key == "rotary_scaling_factor") {
      y.rotary_scaling_factor = value;
    } else if (key == "mscale") {
      y.mscale = value;
    } else if (key == "mscale_all_dim") {
      y.mscale_all_dim = value;
    } else if (key == "original_max_position_embeddings") {
      y.original_max_position_embeddings = value;
    } else if (key == "beta_fast") {
      y.beta_fast = value;
    } else if (key == "beta_slow") {
      y.beta_slow = value;
    } else if (key == "correction_range_round_to_int") {
      y.correction_range_round_to_int = value;
    } else {
      throw std::runtime_error(path + ": unknown yarn config field '" + key + "'");
    }
  }
  return y;
}

ModelConfig config_from_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open");
  try {
    return config_fields(json::parse(in), path);
  } catch (const json::exception& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
}

ModelConfig config_fields(const json& j, const std::string& path) {
  ModelConfig c;
  for (const auto& [key, value] : j.items()) {
    if (key == "num_layers")
      c.num_layers = value;
    else if (key == "hidden_size")
      c.hidden_size = value;
    else if (key == "ffn_hidden_size")
      c.ffn_hidden_size = value;
    else if (key == "num_attention_heads")
      c.num_attention_heads = value;
    else if (key == "num_query_groups")
      c.num_query_groups = value;
    else if (key == "kv_channels")
      c.kv_channels = value;
    else if (key == "seq_length")
      c.seq_length = value;
    else if (key == "max_position_embeddings")
      c.max_position_embeddings = value;
    else if (key == "vocab_size")
      c.vocab_size = value;
    else if (key == "norm_epsilon")
      c.norm_epsilon = value;
    else if (key == "add_bias_linear")
      c.add_bias_linear = value;
    else if (key == "qk_layernorm")
      c.qk_layernorm = value;
    else if (key == "rotary_base")
      c.rotary_base = value;
    else if (key == "rotary_percent")
      c.rotary_percent = value;
    else if (key == "init_method_std")
      c.init_method_std = value;
    else if (key == "attention_dropout")
      c.attention_dropout = value;
    else if (key == "hidden_dropout")
      c.hidden_dropout = value;
    else if (key == "untie_embeddings_and_output_weights")
      c.untie_embeddings_and_output_weights = value;
    else if (key == "mtp_num_layers")
      c.mtp_num_layers = value;
    else if (key == "mtp_loss_scaling_factor")
      c.mtp_loss_scaling_factor = value;
    else if (key == "moe") {
      if (!value.is_null()) c.moe = moe_fields(value, path);
    } else if (key == "mla") {
      if (!value.is_null()) c.mla = mla_fields(value, path);
    } else if (key == "yarn") {
      if (!value.is_null()) c.yarn = yarn_fields(value, path);
    } else if (key == "normalization") {
      const std::string v = value;
      if (v != "LayerNorm" && v != "RMSNorm") throw std::runtime_error(path + ": normalization " + v);
      c.normalization = v == "LayerNorm" ? Normalization::kLayerNorm : Normalization::kRMSNorm;
    } else if (key == "activation") {
      const std::string v = value;
      if (v == "gelu")
        c.activation = Activation::kGelu;
      else if (v == "swiglu")
        c.activation = Activation::kSwiGLU;
      else if (v == "squared_relu")
        c.activation = Activation::kSquaredReLU;
      else
        throw std::runtime_error(path + ": activation " + v);
    } else if (key == "position_embedding_type") {
      const std::string v = value;
      if (v == "learned_absolute")
        c.position_embedding_type = PositionEmbedding::kLearnedAbsolute;
      else if (v == "rope")
        c.position_embedding_type = PositionEmbedding::kRope;
      else if (v == "none")
        c.position_embedding_type = PositionEmbedding::kNone;
      else if (v == "yarn")
        c.position_embedding_type = PositionEmbedding::kYarn;
      else
        throw std::runtime_error(path + ": position_embedding_type " + v);
    } else {
      throw std::runtime_error(path + ": unknown config field '" + key + "'");
    }
  }
  return c;
}

std::vector<int32_t> int_tensor(const SafetensorsFile& file, const std::string& name, int64_t& B, int64_t& S) {
  const Tensor& t = file.at(name);
  if (t.ndim() != 2) throw std::runtime_error(file.source + ": " + name + " must be [B, S], got " + t.shape_str());
  if (B >= 0 && (t.dim(0) != B || t.dim(1) != S)) throw std::runtime_error(file.source + ": " + name + " shape");
  B = t.dim(0);
  S = t.dim(1);
  std::vector<int32_t> out(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t.dtype() == DType::kI32)
      out[i] = t.data<int32_t>()[i];
    else if (t.dtype() == DType::kI64)
      out[i] = static_cast<int32_t>(t.data<int64_t>()[i]);
    else
      throw std::runtime_error(file.source + ": " + name + " must be int32 or int64");
  }
  return out;
}

constexpr const char* kExpertBiasSuffix = ".mlp.router.expert_bias";

std::string expert_bias_name(const int64_t layer) {
  return "decoder.layers." + std::to_string(layer) + kExpertBiasSuffix;
}

// Every parameter and the routers' expert-bias buffers (state, not parameters) from one Megatron-named file.
void load_weights(GPTModel& model, const std::string& path) {
  const SafetensorsFile file = read_safetensors(path);
  std::set<std::string> expected;
  for (Param& p : model.params()) {
    expected.insert(p.name);
    const Tensor& stored = file.at(p.name);
    if (stored.shape() != p.value.shape()) {
      throw std::runtime_error(path + ": parameter '" + p.name + "' has shape " + stored.shape_str() +
                               ", the model expects " + p.value.shape_str());
    }
    p.value.copy_from(to_float32(stored));
  }
  for (int64_t layer = 0; layer < model.config().num_layers; ++layer) {
    Buffer* bias_E = model.expert_bias(layer);
    const std::string name = expert_bias_name(layer);
    if (bias_E == nullptr || !file.contains(name)) continue;
    expected.insert(name);
    const Tensor stored = to_float32(file.at(name));
    if (stored.ndim() != 1 || stored.numel() != bias_E->value.numel()) {
      throw std::runtime_error(path + ": buffer '" + name + "' has shape " + stored.shape_str() +
                               ", the model expects [" + std::to_string(bias_E->value.numel()) + "]");
    }
    bias_E->value.copy_from(stored);
  }
  for (const auto& [name, unused] : file.tensors) {
    if (!expected.contains(name)) {
      throw std::runtime_error(path + ": tensor '" + name + "' is neither a model parameter nor a router buffer");
    }
  }
}

// values as float64 of `shape` (default: 1-D).
Tensor f64_tensor(const std::vector<double>& values, std::vector<int64_t> shape = {}) {
  if (shape.empty()) shape = {static_cast<int64_t>(values.size())};
  Tensor t(shape, DType::kF64);
  if (t.numel() != static_cast<int64_t>(values.size())) throw std::logic_error("f64_tensor: shape mismatch");
  std::memcpy(t.data<double>(), values.data(), values.size() * sizeof(double));
  return t;
}

// Logits [S, Bm, V] of consecutive micro-batches -> [S, M Bm, V].
Tensor concat_batch(const std::vector<Tensor>& parts) {
  if (parts.size() == 1) return parts[0];
  const int64_t S = parts[0].dim(0), Bm = parts[0].dim(1), V = parts[0].dim(2);
  const int64_t M = static_cast<int64_t>(parts.size());
  Tensor out({S, M * Bm, V}, DType::kF32);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t s = 0; s < S; ++s) {
      std::memcpy(out.data<float>() + (s * M * Bm + m * Bm) * V, parts[m].data<float>() + s * Bm * V,
                  sizeof(float) * static_cast<size_t>(Bm * V));
    }
  }
  return out;
}

int run(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  std::unique_ptr<GPTModel> model;
  if (!args.import_hf.empty()) {
    model = load_hf(args.import_hf);
  } else {
    model = std::make_unique<GPTModel>(config_from_json(args.config), 1234);
    load_weights(*model, args.weights);
  }
  if (model->config().hidden_dropout != 0.0 || model->config().attention_dropout != 0.0) {
    throw std::runtime_error("parity runs need hidden_dropout = attention_dropout = 0");
  }
  if (!args.export_hf.empty()) {
    HfExportInfo info;
    info.model_type = args.export_hf_type;
    if (args.export_bf16) info.dtype = DType::kBF16;
    export_hf(*model, info, args.export_hf);
  }

  const SafetensorsFile batch = read_safetensors(args.batch);
  int64_t B = -1, S = -1;
  const std::vector<int32_t> tokens = int_tensor(batch, "tokens", B, S);
  const std::vector<int32_t> labels = int_tensor(batch, "labels", B, S);
  std::vector<float> loss_mask(static_cast<size_t>(B * S), 1.0f);
  if (batch.contains("loss_mask")) {
    const Tensor mask = to_float32(batch.at("loss_mask"));
    if (mask.numel() != B * S) throw std::runtime_error(args.batch + ": loss_mask must be [B, S]");
    std::memcpy(loss_mask.data(), mask.data<float>(), loss_mask.size() * sizeof(float));
  }
  // Packed sequences: the rows' positions (rotary / learned) and documents (no attention across them).
  std::vector<int64_t> position_ids;
  std::vector<int32_t> document_ids;
  if (batch.contains("position_ids")) {
    const std::vector<int32_t> ids = int_tensor(batch, "position_ids", B, S);
    position_ids.assign(ids.begin(), ids.end());
  }
  if (batch.contains("document_ids")) document_ids = int_tensor(batch, "document_ids", B, S);

  AdamWOptions options;
  options.beta1 = args.beta1;
  options.beta2 = args.beta2;
  options.eps = args.eps;
  options.weight_decay = args.weight_decay;
  AdamWOptimizer optimizer(model->params(), options);

  std::vector<NamedTensor> out;
  std::vector<double> losses, grad_norms;
  std::vector<double> lb_logs, z_logs;  // flattened [step][MoE layer][type] and [step][MoE layer]
  std::vector<double> mtp_logs;         // flattened [forward][depth]
  int64_t n_moe_layers = 0, n_types = 0;
  const bool is_moe = model->config().moe.enabled();
  const int64_t M = args.microbatches;
  if (M < 1 || B % M != 0) throw std::runtime_error("--microbatches must divide the batch size");
  const int64_t Bm = B / M;  // rows of one micro-batch
  for (int64_t step = 0; step <= args.steps; ++step) {
    model->zero_grad();
    double loss_sum = 0.0;
    std::vector<Tensor> logits_per_microbatch;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t first = m * Bm * S;  // [B, S] row-major: micro-batch m is rows [m Bm, (m + 1) Bm)
      std::unique_ptr<MicroBatchContext> ctx;
      ForwardOptions forward_options;
      forward_options.training = true;
      forward_options.backward_seed = 1.0 / static_cast<double>(M);
      forward_options.dropout_stream = static_cast<uint64_t>(step * M + m);
      if (!position_ids.empty()) forward_options.position_ids_BS = position_ids.data() + first;
      if (!document_ids.empty()) forward_options.document_ids_BS = document_ids.data() + first;
      Tensor logits;
      loss_sum += model->forward(ctx, tokens.data() + first, labels.data() + first, loss_mask.data() + first, Bm, S,
                                 forward_options, step == 0 ? &logits : nullptr);
      if (step == 0) logits_per_microbatch.push_back(logits);
      if (is_moe) {
        const MoEStats stats = model->take_moe_stats();
        if (stats.num_forwards != 1) throw std::runtime_error("expected the stats of exactly one forward");
        n_moe_layers = static_cast<int64_t>(stats.moe_layers.size());
        n_types = n_moe_layers > 0 ? static_cast<int64_t>(stats.load_balancing_losses[0].size()) : 0;
        for (const auto& per_type : stats.load_balancing_losses)
          lb_logs.insert(lb_logs.end(), per_type.begin(), per_type.end());
        z_logs.insert(z_logs.end(), stats.z_losses.begin(), stats.z_losses.end());
      }
      if (model->config().mtp_num_layers > 0) {
        const MtpStats stats = model->take_mtp_stats();
        if (stats.num_forwards != 1) throw std::runtime_error("expected the MTP losses of exactly one forward");
        mtp_logs.insert(mtp_logs.end(), stats.loss_sums.begin(), stats.loss_sums.end());
      }
      if (step < args.steps) model->backward(std::move(ctx), 1.0 / static_cast<double>(M));
    }
    const double loss = loss_sum / static_cast<double>(M);
    losses.push_back(loss);
    if (step == 0) {
      out.emplace_back("logits", concat_batch(logits_per_microbatch));
      Tensor loss_t({}, DType::kF64);
      loss_t.data<double>()[0] = loss;
      out.emplace_back("loss", loss_t);
    }
    if (step == args.steps) break;
    if (step == 0) {
      for (const Param& p : model->params()) out.emplace_back("grad." + p.name, p.grad.clone());
    }
    model->finish_global_batch();
    grad_norms.push_back(optimizer.clip_grad_norm(args.clip_grad));
    optimizer.step(args.lr);
    for (const Param& p : model->params()) {
      out.emplace_back("step" + std::to_string(step + 1) + "." + p.name, p.value.clone());
    }
    for (int64_t layer = 0; layer < model->config().num_layers; ++layer) {
      const Buffer* bias_E = model->expert_bias(layer);
      if (bias_E != nullptr) {
        out.emplace_back("step" + std::to_string(step + 1) + "." + expert_bias_name(layer), bias_E->value.clone());
      }
    }
  }
  out.emplace_back("losses", f64_tensor(losses));
  out.emplace_back("grad_norms", f64_tensor(grad_norms));
  if (is_moe) {
    const int64_t forwards = static_cast<int64_t>(losses.size()) * M;
    out.emplace_back("load_balancing_loss", f64_tensor(lb_logs, {forwards, n_moe_layers, n_types}));
    out.emplace_back("z_loss", f64_tensor(z_logs, {forwards, n_moe_layers}));
  }
  if (model->config().mtp_num_layers > 0) {
    const int64_t forwards = static_cast<int64_t>(losses.size()) * M;
    out.emplace_back("mtp_losses", f64_tensor(mtp_logs, {forwards, model->config().mtp_num_layers}));
  }
  write_safetensors(args.out, out);
  return 0;
}

}  // namespace
}  // namespace moecore

int main(int argc, char** argv) {
  try {
    return moecore::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moecore_parity: error: %s\n", e.what());
    return 1;
  }
}
