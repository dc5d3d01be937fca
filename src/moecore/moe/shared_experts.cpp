// Shared experts: a dense MLP on every token, out += g_t * fc2(act(fc1(x_t))), no bias; with
// --moe-shared-expert-gate g_t = sigmoid(x_t . w_g), else g_t = 1. Under TP: fc1 column-parallel, fc2
// row-parallel; the local sequence shard is all-gathered over TP and the fc2 partial sums reduce-scattered back.
// Legend: T local tokens, Tf = T * TP gathered tokens, H hidden, S shared ffn width
// (--moe-shared-expert-intermediate-size), S1 = 2S with SwiGLU else S; Sl, S1l their TP shards.
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/activation.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/model/tp_comm.h"
#include "moecore/moe/experts.h"

namespace moecore {
namespace {

Tensor activation_tensor(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), DType::kF32, MemCategory::kActivations);
}

int64_t fc1_width(const ModelConfig &model, const int64_t S) {
  return model.activation == Activation::kSwiGLU ? 2 * S : S;
}

std::string fc1_name(const std::string &prefix) { return prefix + "mlp.shared_experts.linear_fc1.weight"; }
std::string fc2_name(const std::string &prefix) { return prefix + "mlp.shared_experts.linear_fc2.weight"; }
std::string gate_name(const std::string &prefix) { return prefix + "mlp.shared_experts.gate_weight"; }

}  // namespace

SharedExpertMLP::SharedExpertMLP(const MoEConfig &moe, const ModelConfig &model, const std::string &prefix,
                                 std::vector<Param> &params, const parallel::ParallelState &parallel, const int module)
    : moe_(moe), model_(model), prefix_(prefix), tp_(parallel.tp) {
  const int64_t S = moe.shared_expert_intermediate_size, H = model.hidden_size;
  if (S <= 0) {
    throw ConfigError(
        "shared experts: --moe-shared-expert-intermediate-size "
        "must be positive, got " +
        std::to_string(S));
  }
  if (H <= 0) throw ConfigError("shared experts: --hidden-size must be positive, got " + std::to_string(H));
  const int tp = tp_.size();
  if (S % tp != 0) {
    throw ConfigError("shared experts: --moe-shared-expert-intermediate-size " + std::to_string(S) +
                      " is not divisible by --tensor-model-parallel-size " + std::to_string(tp));
  }
  auto add = [&](const std::string &name, const int dim, const int segments, std::vector<int64_t> full_shape,
                 const InitKind init) {
    const ParamShard shard{dim, segments, tp, tp_.rank(), std::move(full_shape)};
    Param p = make_sharded_param(name, shard, init);
    p.module = module;
    params.push_back(std::move(p));
  };
  add(fc1_name(prefix), 0, model.activation == Activation::kSwiGLU ? 2 : 1, {fc1_width(model, S), H},
      InitKind::kNormal);
  add(fc2_name(prefix), 1, 1, {H, S}, InitKind::kScaledNormal);
  // Megatron initialises the gate [1, H] with config.init_method: N(0, init_method_std). Replicated over TP, each
  // rank sees only its sequence shard.
  if (moe.shared_expert_gate) {
    Param gate = make_param(gate_name(prefix), {1, H}, InitKind::kNormal);
    gate.grad_sum_over_tp = true;
    gate.module = module;
    params.push_back(std::move(gate));
  }
}

void SharedExpertMLP::bind(std::vector<Param> &params) {
  fc1_ = find_param(params, fc1_name(prefix_));
  fc2_ = find_param(params, fc2_name(prefix_));
  gate_ = moe_.shared_expert_gate ? find_param(params, gate_name(prefix_)) : nullptr;
}

void SharedExpertMLP::forward(float *out_TH, const float *x_TH, const int64_t T, SharedExpertActivations &saved) const {
  if (fc1_ == nullptr) throw std::logic_error("shared experts: forward called before bind()");
  namespace k = kernels::cpu;
  const int tp = tp_.size();
  const int64_t H = model_.hidden_size, S = moe_.shared_expert_intermediate_size / tp, S1 = fc1_width(model_, S);
  const int64_t Tf = T * tp;
  saved = SharedExpertActivations{};
  const float *xf = x_TH;
  if (tp > 1) {
    saved.x_full_TH = activation_tensor({Tf, H});
    tp::all_gather_rows(saved.x_full_TH.data<float>(), x_TH, T, H, tp_);
    xf = saved.x_full_TH.data<float>();
  }
  saved.fc1_TF1 = activation_tensor({Tf, S1});
  k::linear_forward<float>(saved.fc1_TF1.data<float>(), xf, fc1_->value.data<float>(), nullptr, Tf, H, S1);
  saved.act_TF = activation_tensor({Tf, S});
  const float *fc1 = saved.fc1_TF1.data<float>();
  float *act = saved.act_TF.data<float>();
  switch (model_.activation) {
    case Activation::kSwiGLU: k::swiglu_forward(act, fc1, Tf, S); break;
    case Activation::kGelu: k::gelu_forward(act, fc1, Tf * S); break;
    case Activation::kSquaredReLU: k::squared_relu_forward(act, fc1, Tf * S); break;
  }
  saved.fc2_TH = activation_tensor({T, H});
  float *fc2 = saved.fc2_TH.data<float>();
  if (tp > 1) {
    Tensor partial_TH = activation_tensor({Tf, H});
    k::linear_forward<float>(partial_TH.data<float>(), act, fc2_->value.data<float>(), nullptr, Tf, S, H);
    tp::reduce_scatter_rows(fc2, partial_TH.data<float>(), T, H, tp_);
  } else {
    k::linear_forward<float>(fc2, act, fc2_->value.data<float>(), nullptr, T, S, H);
  }
  if (gate_ == nullptr) {
#pragma omp parallel for simd schedule(static) if (T * H > 16384)
    for (int64_t i = 0; i < T * H; ++i) out_TH[i] += fc2[i];
    saved.fc2_TH = Tensor();  // backward needs it only for the gate
    return;
  }
  saved.gate_T.assign(static_cast<size_t>(T), 0.0f);
  const float *w_g = gate_->value.data<float>();
#pragma omp parallel for schedule(static) if (T * H > 16384)
  for (int64_t t = 0; t < T; ++t) {
    double logit = 0.0;
    for (int64_t h = 0; h < H; ++h) logit += static_cast<double>(x_TH[t * H + h]) * static_cast<double>(w_g[h]);
    const float g = static_cast<float>(1.0 / (1.0 + std::exp(-logit)));
    saved.gate_T[t] = g;
    for (int64_t h = 0; h < H; ++h) out_TH[t * H + h] += g * fc2[t * H + h];
  }
}

void SharedExpertMLP::backward(float *dx_TH, const float *dout_TH, const float *x_TH, const int64_t T,
                               const SharedExpertActivations &saved) const {
  if (fc1_ == nullptr) throw std::logic_error("shared experts: backward called before bind()");
  namespace k = kernels::cpu;
  const int tp = tp_.size();
  const int64_t H = model_.hidden_size, S = moe_.shared_expert_intermediate_size / tp, S1 = fc1_width(model_, S);
  const int64_t Tf = T * tp;
  const float *dfc2 = dout_TH;
  Tensor dfc2_TH;
  if (gate_ != nullptr) {
    // out = g * fc2, g = sigmoid(z), z = x . w_g: dfc2 = g * dout; dz = <dout,
    // fc2> g (1 - g).
    dfc2_TH = activation_tensor({T, H});
    float *dfc2_scaled = dfc2_TH.data<float>();
    const float *fc2 = saved.fc2_TH.data<float>();
    const float *w_g = gate_->value.data<float>();
    std::vector<float> dz_T(static_cast<size_t>(T));
#pragma omp parallel for schedule(static) if (T * H > 16384)
    for (int64_t t = 0; t < T; ++t) {
      const float g = saved.gate_T[t];
      double dg = 0.0;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t i = t * H + h;
        dg += static_cast<double>(dout_TH[i]) * static_cast<double>(fc2[i]);
        dfc2_scaled[i] = g * dout_TH[i];
      }
      const float dz = static_cast<float>(dg * g * (1.0 - g));
      dz_T[t] = dz;
      for (int64_t h = 0; h < H; ++h) dx_TH[t * H + h] += dz * w_g[h];
    }
    // dw_g += dz^T @ x ([1, T] @ [T, H]).
    k::gemm<float>(true, false, 1, H, T, 1.0f, dz_T.data(), 1, x_TH, H, 1.0f, gate_->grad.data<float>(), H);
    dfc2 = dfc2_scaled;
  }
  // Row-parallel fc2 backward: every TP rank needs d(fc2 output) of all gathered tokens.
  Tensor dfc2_full_TH;
  if (tp > 1) {
    dfc2_full_TH = activation_tensor({Tf, H});
    tp::all_gather_rows(dfc2_full_TH.data<float>(), dfc2, T, H, tp_);
    dfc2 = dfc2_full_TH.data<float>();
    dfc2_TH = Tensor();
  }
  Tensor dact_TF = activation_tensor({Tf, S});
  k::linear_backward<float>(dact_TF.data<float>(), fc2_->grad.data<float>(), nullptr, dfc2, saved.act_TF.data<float>(),
                            fc2_->value.data<float>(), Tf, S, H);
  dfc2_full_TH = Tensor();
  Tensor dfc1_TF1 = activation_tensor({Tf, S1});
  const float *fc1 = saved.fc1_TF1.data<float>();
  float *dfc1 = dfc1_TF1.data<float>();
  switch (model_.activation) {
    case Activation::kSwiGLU: k::swiglu_backward(dfc1, dact_TF.data<float>(), fc1, Tf, S); break;
    case Activation::kGelu: k::gelu_backward(dfc1, dact_TF.data<float>(), fc1, Tf * S); break;
    case Activation::kSquaredReLU: k::squared_relu_backward(dfc1, dact_TF.data<float>(), fc1, Tf * S); break;
  }
  dact_TF = Tensor();
  if (tp == 1) {
    k::linear_backward<float>(dx_TH, fc1_->grad.data<float>(), nullptr, dfc1, x_TH, fc1_->value.data<float>(), T, H,
                              S1);
    return;
  }
  // Column-parallel fc1 backward: partial dx of all gathered tokens, reduce-scattered back to the shard.
  Tensor dx_full_TH = activation_tensor({Tf, H});
  dx_full_TH.zero_();
  k::linear_backward<float>(dx_full_TH.data<float>(), fc1_->grad.data<float>(), nullptr, dfc1,
                            saved.x_full_TH.data<float>(), fc1_->value.data<float>(), Tf, H, S1);
  std::vector<float> dx_local(static_cast<size_t>(T * H));
  tp::reduce_scatter_rows(dx_local.data(), dx_full_TH.data<float>(), T, H, tp_);
  for (int64_t i = 0; i < T * H; ++i) dx_TH[i] += dx_local[static_cast<size_t>(i)];
}

}  // namespace moecore
