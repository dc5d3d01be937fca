#include "moecore/ckpt/upcycling.h"

#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>

#include "moecore/ckpt/model_state_keys.h"
#include "moecore/model/param.h"

namespace moecore {
namespace {

// Megatron's _get_weight_scale: a^(1/3) for gated linear units and squared ReLU, else a^(1/2), with a = g
// post-softmax or (E / g) * g * g / topk pre-softmax (_get_moe_activation_scale).
double weight_scale(const ModelConfig& c, const int64_t g) {
  const MoEConfig& m = c.moe;
  const double a = m.pre_softmax ? static_cast<double>((m.num_experts / g) * g * g) / static_cast<double>(m.topk)
                                 : static_cast<double>(g);
  const bool cube = c.activation == Activation::kSwiGLU || c.activation == Activation::kSquaredReLU;
  return std::pow(a, cube ? 1.0 / 3.0 : 1.0 / 2.0);
}

// Piece `j` of `g` of a dense fc1 weight [F1, H] or bias [F1]: row block j (SwiGLU: block j of the gate half then
// block j of the up half), times `scale`.
Tensor fc1_piece(const Tensor& dense, const bool swiglu, const int64_t g, const int64_t j, const float scale) {
  const int64_t rows = dense.dim(0), row_numel = dense.numel() / rows;
  const int64_t halves = swiglu ? 2 : 1, half = rows / halves, block = half / g;
  std::vector<int64_t> shape = dense.shape();
  shape[0] = halves * block;
  Tensor out(shape, DType::kF32);
  float* dst = out.data<float>();
  for (int64_t h = 0; h < halves; ++h) {
    const float* src = dense.data<float>() + (h * half + j * block) * row_numel;
    for (int64_t i = 0; i < block * row_numel; ++i) *dst++ = src[i] * scale;
  }
  return out;
}

// Piece `j` of `g` of a dense fc2 weight [H, F]: column block j, times `scale`.
Tensor fc2_piece(const Tensor& dense, const int64_t g, const int64_t j, const float scale) {
  const int64_t H = dense.dim(0), F = dense.dim(1), block = F / g;
  Tensor out({H, block}, DType::kF32);
  for (int64_t r = 0; r < H; ++r) {
    const float* src = dense.data<float>() + r * F + j * block;
    float* dst = out.data<float>() + r * block;
    for (int64_t i = 0; i < block; ++i) dst[i] = src[i] * scale;
  }
  return out;
}

// The MoE model's own initial value of `key` (GPTModel's init_param), as an fp32 tensor.
Tensor own_init(const ModelStateKey& key, const uint64_t seed, const double init_method_std, const int64_t num_layers) {
  Param p = make_param(key.key, key.global_shape, key.init);
  init_param(p, seed, init_method_std, num_layers);
  return p.value.clone();
}

// "decoder.layers.{i}.REST" -> (i, REST).
std::optional<std::pair<int64_t, std::string>> layer_of(const std::string& key) {
  const std::string prefix = "decoder.layers.";
  if (!key.starts_with(prefix)) return std::nullopt;
  const size_t dot = key.find('.', prefix.size());
  return std::make_pair(std::stoll(key.substr(prefix.size(), dot - prefix.size())), key.substr(dot + 1));
}

}  // namespace

ModelConfig dense_config_for_upcycling(const ModelConfig& moe_config, const int64_t granularity) {
  const MoEConfig& m = moe_config.moe;
  if (!m.enabled()) throw ConfigError("--moe-use-upcycling needs a MoE model (--num-experts)");
  if (granularity < 1) {
    throw ConfigError("--moe-upcycling-granularity must be a positive integer, got " + std::to_string(granularity));
  }
  if (m.num_experts % granularity != 0) {
    throw ConfigError("--moe-upcycling-granularity " + std::to_string(granularity) + " does not divide --num-experts " +
                      std::to_string(m.num_experts) + " (upcycling gives each dense MLP's pieces to groups of " +
                      std::to_string(granularity) + " experts)");
  }
  if (m.latent_size > 0) {
    throw ConfigError(
        "--moe-use-upcycling does not support LatentMoE (--moe-latent-size): the dense MLP's [F, H] weights do not fit "
        "latent experts");
  }
  if (m.shared_expert_intermediate_size > 0) {
    throw ConfigError(
        "--moe-use-upcycling does not support shared experts (--moe-shared-expert-intermediate-size): Megatron's "
        "upcycling leaves them at their random init");
  }
  const int64_t dense_ffn = m.ffn_hidden_size * granularity;
  for (int64_t i = 0; i < moe_config.num_layers; ++i) {
    if (!m.is_moe_layer(i) && moe_config.ffn_hidden_size != dense_ffn) {
      throw ConfigError("--ffn-hidden-size " + std::to_string(moe_config.ffn_hidden_size) + " of the dense layer " +
                        std::to_string(i) + " (--moe-layer-freq) must be --moe-ffn-hidden-size " +
                        std::to_string(m.ffn_hidden_size) + " x --moe-upcycling-granularity " +
                        std::to_string(granularity) + " = " + std::to_string(dense_ffn) +
                        ": it copies the dense model's MLP");
    }
  }
  ModelConfig dense = moe_config;
  dense.moe = MoEConfig{};
  dense.ffn_hidden_size = dense_ffn;
  return dense;
}

std::unique_ptr<GlobalTensorSource> upcycled_state_source(const StateSource& dense, const ModelConfig& moe_config,
                                                          const int64_t granularity, const uint64_t seed,
                                                          const double init_method_std) {
  const ModelConfig dense_config = dense_config_for_upcycling(moe_config, granularity);
  const MoEConfig& m = moe_config.moe;
  const int64_t g = granularity;
  // The dense checkpoint's FFN width must split into g experts of --moe-ffn-hidden-size (Megatron's _get_config).
  const std::string width_key = "decoder.layers.0.mlp.linear_fc2.weight";
  const std::optional<StoredTensorInfo> width_info = dense.info(width_key);
  if (!width_info || width_info->global_shape.size() != 2) {
    throw std::runtime_error(dense.description() + ": no dense MLP tensor " + width_key + " to upcycle");
  }
  const int64_t dense_ffn = width_info->global_shape[1];
  if (dense_ffn != m.ffn_hidden_size * g) {
    throw ConfigError("the dense checkpoint's FFN hidden size " + std::to_string(dense_ffn) + " is not " +
                      "--moe-ffn-hidden-size " + std::to_string(m.ffn_hidden_size) + " x --moe-upcycling-granularity " +
                      std::to_string(g) +
                      (dense_ffn % m.ffn_hidden_size == 0
                           ? " (it gives granularity " + std::to_string(dense_ffn / m.ffn_hidden_size) + ")"
                           : " (and no multiple of --moe-ffn-hidden-size)"));
  }
  const auto require_dense = [&](const std::string& key, const std::vector<int64_t>& shape) {
    const std::optional<StoredTensorInfo> info = dense.info(key);
    if (!info) throw std::runtime_error(dense.description() + ": no tensor " + key + " (the dense model's) to upcycle");
    if (info->global_shape != shape) {
      throw std::runtime_error(dense.description() + ": " + key + " has shape " + shape_text(info->global_shape) +
                               ", the dense model of the upcycling has " + shape_text(shape));
    }
  };
  std::map<std::string, std::vector<int64_t>> dense_shapes;
  for (const ModelStateKey& k : model_state_keys(dense_config)) dense_shapes[k.key] = k.global_shape;

  const bool swiglu = moe_config.activation == Activation::kSwiGLU;
  const auto scale = static_cast<float>(weight_scale(moe_config, g));
  auto source = std::make_unique<GlobalTensorSource>("upcycled from " + dense.description());
  const StateSource* from = &dense;
  for (const ModelStateKey& key : model_state_keys(moe_config)) {
    const StoredTensorInfo info{DType::kF32, key.global_shape};
    const auto layer = layer_of(key.key);
    if (!layer || !m.is_moe_layer(layer->first)) {  // not a MoE layer's MLP: the dense value
      require_dense(key.key, key.global_shape);
      source->add(key.key, info, [from, name = key.key] { return read_global_tensor(*from, name); });
      continue;
    }
    const std::string prefix = "decoder.layers." + std::to_string(layer->first) + ".";
    const std::string& rest = layer->second;
    if (!rest.starts_with("mlp.")) {  // attention and norms of a MoE layer
      require_dense(key.key, key.global_shape);
      source->add(key.key, info, [from, name = key.key] { return read_global_tensor(*from, name); });
    } else if (rest == "mlp.router.weight") {
      source->add(key.key, info, [key, g, seed, init_method_std, layers = moe_config.num_layers] {
        const Tensor own = own_init(key, seed, init_method_std, layers);
        const int64_t E = key.global_shape[0], H = key.global_shape[1];
        Tensor out({E, H}, DType::kF32);
        for (int64_t r = 0; r < E; ++r) {
          std::memcpy(out.data<float>() + r * H, own.data<float>() + (r / g) * H,
                      static_cast<size_t>(H) * sizeof(float));
        }
        return out;
      });
    } else if (rest == "mlp.router.bias" || rest == "mlp.router.expert_bias") {
      source->add(key.key, info, [key, seed, init_method_std, layers = moe_config.num_layers] {
        return own_init(key, seed, init_method_std, layers);
      });
    } else if (rest.starts_with("mlp.experts.local_experts.")) {
      const std::string tail = rest.substr(std::string("mlp.experts.local_experts.").size());
      const int64_t expert = std::stoll(tail.substr(0, tail.find('.')));
      const std::string part = tail.substr(tail.find('.') + 1);  // linear_fc1.weight, ...
      const std::string dense_key = prefix + "mlp." + part;
      require_dense(dense_key, dense_shapes.at(dense_key));
      const int64_t piece = expert % g;
      if (part == "linear_fc1.weight" || part == "linear_fc1.bias") {
        source->add(key.key, info, [from, dense_key, swiglu, g, piece, scale] {
          return fc1_piece(read_global_tensor(*from, dense_key), swiglu, g, piece, scale);
        });
      } else if (part == "linear_fc2.weight") {
        source->add(key.key, info, [from, dense_key, g, piece, scale] {
          return fc2_piece(read_global_tensor(*from, dense_key), g, piece, scale);
        });
      } else if (part == "linear_fc2.bias") {
        source->add(key.key, info, [from, dense_key] { return read_global_tensor(*from, dense_key); });
      } else {
        throw std::logic_error("upcycling: no rule for " + key.key);
      }
    } else {
      throw std::logic_error("upcycling: no rule for " + key.key);
    }
  }
  return source;
}

}  // namespace moecore
