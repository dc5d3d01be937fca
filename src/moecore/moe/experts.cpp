// Routed experts: parameter registration, the per-expert row-block math shared
// by GroupedMLP and SequentialMLP, and the factory. Each expert computes y =
// fc2(act(fc1(x)) * p) + b2, or y = fc2(act(fc1(x * p))) + b2 with
// --moe-apply-probs-on-input (Megatron's placement of the router probability).
// Legend: R rows grouped by expert, H hidden, F expert ffn width, F1 = 2F with
// SwiGLU else F, E local experts.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "moecore/kernels/cpu/activation.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/moe/experts_internal.h"

namespace moecore {
namespace experts_detail {
namespace {

Tensor activation_tensor(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), DType::kF32, MemCategory::kActivations);
}

const float *value_or_null(const Param *p) { return p == nullptr ? nullptr : p->value.data<float>(); }
float *grad_or_null(Param *p) { return p == nullptr ? nullptr : p->grad.data<float>(); }

}  // namespace

std::vector<int64_t> expert_offsets(const std::vector<int64_t> &tokens_per_expert_E, const int64_t E) {
  if (static_cast<int64_t>(tokens_per_expert_E.size()) != E) {
    throw std::invalid_argument("experts: tokens_per_expert has " + std::to_string(tokens_per_expert_E.size()) +
                                " entries, expected " + std::to_string(E) + " local experts");
  }
  std::vector<int64_t> offsets_E1(static_cast<size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) {
    if (tokens_per_expert_E[e] < 0) {
      throw std::invalid_argument("experts: negative token count " + std::to_string(tokens_per_expert_E[e]) +
                                  " for expert " + std::to_string(e));
    }
    offsets_E1[e + 1] = offsets_E1[e] + tokens_per_expert_E[e];
  }
  return offsets_E1;
}

ExpertMLPBase::ExpertMLPBase(const MoEConfig &moe, const ModelConfig &model, const std::string &prefix,
                             std::vector<Param> &params, const parallel::ParallelState &parallel, const int module)
    : E_(moe.num_experts),
      H_(model.hidden_size),
      F_(moe.ffn_hidden_size),
      activation_(model.activation),
      probs_on_input_(moe.apply_probs_on_input),
      bias_(model.add_bias_linear) {
  if (E_ <= 0) throw ConfigError("experts: --num-experts must be positive, got " + std::to_string(E_));
  if (F_ <= 0) throw ConfigError("experts: --moe-ffn-hidden-size must be positive, got " + std::to_string(F_));
  if (H_ <= 0) throw ConfigError("experts: --hidden-size must be positive, got " + std::to_string(H_));
  const int ep = parallel.ep_size(), etp = parallel.etp_size();
  if (E_ % ep != 0) {
    throw ConfigError("experts: --num-experts " + std::to_string(E_) +
                      " is not divisible by --expert-model-parallel-size " + std::to_string(ep));
  }
  if (bias_ && etp > 1) {
    throw ConfigError(
        std::string("experts: bias in MoE layers (--add-bias-linear) needs --expert-tensor-parallel-size 1, got ") +
        std::to_string(etp));
  }
  const int segments = model.activation == Activation::kSwiGLU ? 2 : 1;
  if (F_ % etp != 0) {
    throw ConfigError("experts: --moe-ffn-hidden-size " + std::to_string(F_) +
                      " is not divisible by --expert-tensor-parallel-size " + std::to_string(etp));
  }
  const int64_t F1_full = activation_ == Activation::kSwiGLU ? 2 * F_ : F_;
  E_ /= ep;
  F_ /= etp;
  F1_ = activation_ == Activation::kSwiGLU ? 2 * F_ : F_;
  const int64_t first = static_cast<int64_t>(parallel.ep_rank()) * E_;
  auto add = [&](const std::string &name, const int dim, const int segs, std::vector<int64_t> full_shape,
                 const InitKind init) {
    const ParamShard shard{dim, segs, etp, parallel.etp_rank(), std::move(full_shape)};
    names_.push_back(prefix + name);
    Param p = make_sharded_param(prefix + name, shard, init);
    p.is_expert = true;
    p.module = module;
    params.push_back(std::move(p));
  };
  for (int64_t e = first; e < first + E_; ++e) {
    const std::string expert = "mlp.experts.local_experts." + std::to_string(e) + ".";
    add(expert + "linear_fc1.weight", 0, segments, {F1_full, H_}, InitKind::kNormal);
    if (bias_) add(expert + "linear_fc1.bias", 0, segments, {F1_full}, InitKind::kZeros);
    add(expert + "linear_fc2.weight", 1, 1, {H_, F_ * etp}, InitKind::kScaledNormal);
    if (bias_) add(expert + "linear_fc2.bias", 0, 1, {H_}, InitKind::kZeros);
  }
}

void ExpertMLPBase::bind(std::vector<Param> &params) {
  const std::vector<Param *> found = find_params(params, names_);
  experts_.assign(static_cast<size_t>(E_), ExpertParams{});
  const size_t per_expert = bias_ ? 4 : 2;
  for (int64_t e = 0; e < E_; ++e) {
    Param *const *p = found.data() + static_cast<size_t>(e) * per_expert;
    ExpertParams &ex = experts_[static_cast<size_t>(e)];
    ex.fc1_weight = p[0];
    ex.fc1_bias = bias_ ? p[1] : nullptr;
    ex.fc2_weight = bias_ ? p[2] : p[1];
    ex.fc2_bias = bias_ ? p[3] : nullptr;
  }
}

void ExpertMLPBase::forward(float *y_RH, const float *x_RH, const float *probs_R,
                            const std::vector<int64_t> &tokens_per_expert_E, ExpertActivations &saved) {
  if (experts_.empty()) throw std::logic_error("experts: forward called before bind()");
  const std::vector<int64_t> offsets_E1 = expert_offsets(tokens_per_expert_E, E_);
  const int64_t R = offsets_E1.back();
  saved = ExpertActivations{};
  saved.tokens_per_expert_E = tokens_per_expert_E;
  saved.probs_R.assign(probs_R, probs_R + R);
  saved.x_RH = activation_tensor({R, H_});
  saved.fc1_RF1 = activation_tensor({R, F1_});
  saved.act_RF = activation_tensor({R, F_});
  Tensor h_RF;
  if (probs_on_input_) {
    saved.x_raw_RH = activation_tensor({R, H_});
  } else {
    h_RF = activation_tensor({R, F_});
  }
  const ForwardBuffers buf{y_RH,
                           x_RH,
                           saved.probs_R.data(),
                           saved.x_RH.data<float>(),
                           probs_on_input_ ? saved.x_raw_RH.data<float>() : nullptr,
                           saved.fc1_RF1.data<float>(),
                           saved.act_RF.data<float>(),
                           probs_on_input_ ? saved.act_RF.data<float>() : h_RF.data<float>()};
  run_forward(offsets_E1, buf);
}

void ExpertMLPBase::backward(float *dx_RH, float *dprobs_R, const float *dy_RH, const ExpertActivations &saved) {
  if (experts_.empty()) throw std::logic_error("experts: backward called before bind()");
  const std::vector<int64_t> offsets_E1 = expert_offsets(saved.tokens_per_expert_E, E_);
  const int64_t R = offsets_E1.back();
  Tensor h_RF = probs_on_input_ ? Tensor() : activation_tensor({R, F_});
  Tensor dfc1_RF1 = activation_tensor({R, F1_});
  Tensor dxs_RH = probs_on_input_ ? activation_tensor({R, H_}) : Tensor();
  const BackwardBuffers buf{dx_RH,
                            dprobs_R,
                            dy_RH,
                            &saved,
                            probs_on_input_ ? nullptr : h_RF.data<float>(),
                            dfc1_RF1.data<float>(),
                            probs_on_input_ ? dxs_RH.data<float>() : nullptr};
  run_backward(offsets_E1, buf);
}

void ExpertMLPBase::forward_rows(const int64_t e, const int64_t row_begin, const int64_t n,
                                 const ForwardBuffers &buf) const {
  namespace k = kernels::cpu;
  const ExpertParams &ex = experts_[static_cast<size_t>(e)];
  const float *x = buf.x_RH + row_begin * H_;
  const float *p = buf.probs_R + row_begin;
  float *xs = buf.xs_RH + row_begin * H_;
  if (probs_on_input_) {
    std::memcpy(buf.x_raw_RH + row_begin * H_, x, sizeof(float) * static_cast<size_t>(n * H_));
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t h = 0; h < H_; ++h) xs[r * H_ + h] = x[r * H_ + h] * p[r];
    }
  } else {
    std::memcpy(xs, x, sizeof(float) * static_cast<size_t>(n * H_));
  }
  float *fc1 = buf.fc1_RF1 + row_begin * F1_;
  k::linear_forward(fc1, xs, ex.fc1_weight->value.data<float>(), value_or_null(ex.fc1_bias), n, H_, F1_);
  float *act = buf.act_RF + row_begin * F_;
  switch (activation_) {
    case Activation::kSwiGLU: k::swiglu_forward(act, fc1, n, F_); break;
    case Activation::kGelu: k::gelu_forward(act, fc1, n * F_); break;
    case Activation::kSquaredReLU: k::squared_relu_forward(act, fc1, n * F_); break;
  }
  float *h = buf.h_RF + row_begin * F_;
  if (!probs_on_input_) {
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t f = 0; f < F_; ++f) h[r * F_ + f] = act[r * F_ + f] * p[r];
    }
  }
  if (probs_on_input_) {
    k::linear_forward(buf.y_RH + row_begin * H_, h, ex.fc2_weight->value.data<float>(), value_or_null(ex.fc2_bias), n,
                      F_, H_);
    return;
  }
  // Megatron scales the fc2 bias by the probability too: y = W2 (act * p) + p * b2.
  float *y = buf.y_RH + row_begin * H_;
  k::linear_forward<float>(y, h, ex.fc2_weight->value.data<float>(), nullptr, n, F_, H_);
  if (ex.fc2_bias) {
    const float *b2 = ex.fc2_bias->value.data<float>();
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < H_; ++c) y[r * H_ + c] += p[r] * b2[c];
    }
  }
}

void ExpertMLPBase::backward_rows(const int64_t e, const int64_t row_begin, const int64_t n,
                                  const BackwardBuffers &buf) const {
  namespace k = kernels::cpu;
  const ExpertParams &ex = experts_[static_cast<size_t>(e)];
  const ExpertActivations &saved = *buf.saved;
  const float *p = saved.probs_R.data() + row_begin;
  const float *act = saved.act_RF.data<float>() + row_begin * F_;
  const float *fc1 = saved.fc1_RF1.data<float>() + row_begin * F1_;

  // d(fc2 input) = dy @ W2.
  std::vector<float> dh_nF(static_cast<size_t>(n * F_), 0.0f);
  k::linear_backward<float>(dh_nF.data(), nullptr, nullptr, buf.dy_RH + row_begin * H_, nullptr,
                            ex.fc2_weight->value.data<float>(), n, F_, H_);
  if (!probs_on_input_) {
    // h = act * p: dp = <dh, act>, dact = dh * p; h is rebuilt for the fc2
    // weight gradient.
    float *h = buf.h_RF + row_begin * F_;
    for (int64_t r = 0; r < n; ++r) {
      double dp = 0.0;
      for (int64_t f = 0; f < F_; ++f) {
        const int64_t i = r * F_ + f;
        dp += static_cast<double>(dh_nF[i]) * static_cast<double>(act[i]);
        h[i] = act[i] * p[r];
        dh_nF[i] *= p[r];
      }
      if (ex.fc2_bias) {  // y = W2 (act * p) + p * b2
        const float *b2 = ex.fc2_bias->value.data<float>();
        const float *dy = buf.dy_RH + (row_begin + r) * H_;
        for (int64_t c = 0; c < H_; ++c) dp += static_cast<double>(dy[c]) * static_cast<double>(b2[c]);
      }
      buf.dprobs_R[row_begin + r] = static_cast<float>(dp);
    }
  }
  float *dfc1 = buf.dfc1_RF1 + row_begin * F1_;
  switch (activation_) {
    case Activation::kSwiGLU: k::swiglu_backward(dfc1, dh_nF.data(), fc1, n, F_); break;
    case Activation::kGelu: k::gelu_backward(dfc1, dh_nF.data(), fc1, n * F_); break;
    case Activation::kSquaredReLU: k::squared_relu_backward(dfc1, dh_nF.data(), fc1, n * F_); break;
  }
  const float *w1 = ex.fc1_weight->value.data<float>();
  if (!probs_on_input_) {
    k::linear_backward<float>(buf.dx_RH + row_begin * H_, nullptr, nullptr, dfc1, nullptr, w1, n, H_, F1_);
    return;
  }
  // xs = x * p: dp = <dxs, x>, dx += dxs * p.
  float *dxs = buf.dxs_RH + row_begin * H_;
  k::linear_backward<float>(dxs, nullptr, nullptr, dfc1, nullptr, w1, n, H_, F1_);
  const float *x = saved.x_raw_RH.data<float>() + row_begin * H_;
  float *dx = buf.dx_RH + row_begin * H_;
  for (int64_t r = 0; r < n; ++r) {
    double dp = 0.0;
    for (int64_t h = 0; h < H_; ++h) {
      const int64_t i = r * H_ + h;
      dp += static_cast<double>(dxs[i]) * static_cast<double>(x[i]);
      dx[i] += dxs[i] * p[r];
    }
    buf.dprobs_R[row_begin + r] = static_cast<float>(dp);
  }
}

void ExpertMLPBase::backward_weights(const int64_t e, const int64_t row_begin, const int64_t n, const int which,
                                     const BackwardBuffers &buf) const {
  namespace k = kernels::cpu;
  const ExpertParams &ex = experts_[static_cast<size_t>(e)];
  const ExpertActivations &saved = *buf.saved;
  if (which == 0) {
    k::linear_backward<float>(nullptr, ex.fc1_weight->grad.data<float>(), grad_or_null(ex.fc1_bias),
                              buf.dfc1_RF1 + row_begin * F1_, saved.x_RH.data<float>() + row_begin * H_,
                              ex.fc1_weight->value.data<float>(), n, H_, F1_);
  } else {
    const float *h = probs_on_input_ ? saved.act_RF.data<float>() : buf.h_RF;
    const float *dy = buf.dy_RH + row_begin * H_;
    k::linear_backward<float>(nullptr, ex.fc2_weight->grad.data<float>(),
                              probs_on_input_ ? grad_or_null(ex.fc2_bias) : nullptr, dy, h + row_begin * F_,
                              ex.fc2_weight->value.data<float>(), n, F_, H_);
    if (!probs_on_input_ && ex.fc2_bias) {  // d(p * b2)/d b2 = p
      float *db2 = ex.fc2_bias->grad.data<float>();
      const float *p = saved.probs_R.data() + row_begin;
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < H_; ++c) db2[c] += p[r] * dy[r * H_ + c];
      }
    }
  }
}

}  // namespace experts_detail

std::unique_ptr<ExpertMLP> make_experts(const MoEConfig &moe, const ModelConfig &model, const std::string &prefix,
                                        std::vector<Param> &params, const parallel::ParallelState &parallel,
                                        const int module) {
  if (moe.grouped_gemm) return experts_detail::make_grouped_mlp(moe, model, prefix, params, parallel, module);
  return experts_detail::make_sequential_mlp(moe, model, prefix, params, parallel, module);
}

}  // namespace moecore
