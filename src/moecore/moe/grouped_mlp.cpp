// GroupedMLP: all local experts in one pass over the grouped buffer. fc1 and fc2 are grouped linear ops over every
// expert's rows (ops/grouped_linear.h: the row tiles and their scheduling live in the kernel); the activation and
// the router probability run over all rows at once. Under FP8 / FP4 (ops/quantization.h) each expert's rows go
// through ops::linear as one tensor instead: Megatron's TEGroupedLinear quantizes each expert's rows as one tensor
// (per-tensor scales must see all of them), and under delayed scaling each expert keeps its own scaling state.
#include <vector>

#include "moecore/moe/experts_internal.h"
#include "moecore/ops/expert_activation.h"
#include "moecore/ops/grouped_linear.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/quantization.h"
#include "moecore/ops/rows.h"
#include "moecore/parallel/process_group.h"

namespace moecore::experts_detail {
namespace {

Tensor activation_tensor(std::vector<int64_t> shape) {
  return Tensor(std::move(shape), DType::kF32, MemCategory::kActivations);
}

// The grouped layer fc1 or fc2 of the local experts.
enum class Layer { kFc1, kFc2 };

class GroupedMLP final : public ExpertMLPBase {
 public:
  using ExpertMLPBase::ExpertMLPBase;

 private:
  // Expert e's parameters of one layer.
  struct LayerParams {
    Param* weight_;
    Param* bias_;
    Param& weight() const { return *weight_; }
    Param* bias() const { return bias_; }
  };
  LayerParams layer(const int64_t e, const Layer which) const {
    const MLP& expert = experts_[static_cast<size_t>(e)];
    if (which == Layer::kFc1) return {&expert.fc1().weight(), expert.fc1().bias()};
    return {&expert.fc2().weight(), expert.fc2().bias()};
  }
  // SwiGLU with the probability after it (Megatron's default expert MLP): the fused weighted SwiGLU, which saves
  // fc2's input h = swiglu(fc1) * p instead of the activation and recomputes swiglu in backward.
  bool weighted_swiglu() const { return activation_ == ops::Activation::kSwiGLU && !probs_on_input_; }
  // fc2's bias goes through the linear layer only with the probability on the input; else it is p b2.
  bool linear_bias(const Layer which) const { return which == Layer::kFc1 || probs_on_input_; }
  static bool quantized() { return ops::linear_quantization() != nullptr; }

  std::vector<const Tensor*> weights(const Layer which) const {
    std::vector<const Tensor*> out;
    for (int64_t e = 0; e < E_; ++e) out.push_back(&layer(e, which).weight().value);
    return out;
  }
  // The biases the linear layer adds (none: empty).
  std::vector<const Tensor*> biases(const Layer which) const {
    std::vector<const Tensor*> out;
    if (!linear_bias(which) || layer(0, which).bias() == nullptr) return out;
    for (int64_t e = 0; e < E_; ++e) out.push_back(&layer(e, which).bias()->value);
    return out;
  }

  // out_RO = layer(in_RI) over every expert's rows.
  void fc_forward(const Layer which, const std::vector<int64_t>& offsets_E1, Tensor& out_RO, const Tensor& in_RI,
                  std::vector<quant::DelayedForwardScales>& scales_E) const {
    if (!quantized()) {
      ops::grouped_linear_forward(out_RO, in_RI, weights(which), biases(which), offsets_E1);
      return;
    }
    for (int64_t e = 0; e < E_; ++e) {
      const int64_t begin = offsets_E1[e], end = offsets_E1[e + 1];
      if (end == begin) continue;
      const Param& w = layer(e, which).weight();
      const Param* b = linear_bias(which) ? layer(e, which).bias() : nullptr;
      Tensor out = out_RO.slice_rows(begin, end);
      ops::linear_forward(out, in_RI.slice_rows(begin, end), w.value, b ? &b->value : nullptr, w.delayed_scaling.get(),
                          &scales_E[static_cast<size_t>(e)]);
    }
  }

  // din_RI += dout_RO W (nullptr: skipped) and the layer's weight (and linear bias) gradients from in_RI (nullptr:
  // skipped).
  void fc_backward(const Layer which, const std::vector<int64_t>& offsets_E1, Tensor* din_RI, const Tensor& dout_RO,
                   const Tensor* in_RI, const std::vector<quant::DelayedForwardScales>& scales_E) const {
    if (!quantized()) {
      std::vector<Tensor*> dweights, dbiases;
      if (in_RI != nullptr) {
        for (int64_t e = 0; e < E_; ++e) {
          dweights.push_back(&layer(e, which).weight().grad);
          Param* b = layer(e, which).bias();
          if (linear_bias(which) && b != nullptr) dbiases.push_back(&b->grad);
        }
      }
      ops::grouped_linear_backward(din_RI, dweights, dbiases, dout_RO, in_RI, weights(which), offsets_E1);
      return;
    }
    for (int64_t e = 0; e < E_; ++e) {
      const int64_t begin = offsets_E1[e], end = offsets_E1[e + 1];
      if (end == begin) continue;
      Param& w = layer(e, which).weight();
      Param* b = linear_bias(which) && in_RI != nullptr ? layer(e, which).bias() : nullptr;
      Tensor din = din_RI ? din_RI->slice_rows(begin, end) : Tensor();
      const Tensor in = in_RI ? in_RI->slice_rows(begin, end) : Tensor();
      ops::linear_backward(din_RI ? &din : nullptr, in_RI ? &w.grad : nullptr, b ? &b->grad : nullptr,
                           dout_RO.slice_rows(begin, end), in_RI ? &in : nullptr, w.value, w.delayed_scaling.get(),
                           &scales_E[static_cast<size_t>(e)]);
    }
  }

  // Calls fn(e, begin, end) for every expert with rows.
  template <typename Fn>
  void for_each_expert(const std::vector<int64_t>& offsets_E1, Fn&& fn) const {
    for (int64_t e = 0; e < E_; ++e) {
      if (offsets_E1[e + 1] > offsets_E1[e]) fn(e, offsets_E1[e], offsets_E1[e + 1]);
    }
  }

  void run_forward(const std::vector<int64_t>& offsets_E1, Tensor& y_RH, ExpertActivations& saved) const override {
    const int64_t R = offsets_E1.back();
    saved.fc1_RF1 = activation_tensor({R, F1_});
    (weighted_swiglu() ? saved.h_RF : saved.act_RF) = activation_tensor({R, F_});
    saved.fc1_delayed_E.assign(static_cast<size_t>(E_), {});
    saved.fc2_delayed_E.assign(static_cast<size_t>(E_), {});
    if (R == 0) return;
    if (probs_on_input_) {
      saved.xs_RH = activation_tensor({R, H_});
      ops::scale_rows(saved.xs_RH, saved.x_RH, saved.probs_R);
    }
    fc_forward(Layer::kFc1, offsets_E1, saved.fc1_RF1, probs_on_input_ ? saved.xs_RH : saved.x_RH, saved.fc1_delayed_E);
    // fc2's input: h = swiglu(fc1) * p (saved), the activation itself (probs on the input), or act * p in a
    // buffer not saved (backward recomputes it).
    Tensor h;
    if (weighted_swiglu()) {
      h = saved.h_RF;
      ops::weighted_swiglu_forward(h, saved.fc1_RF1, saved.probs_R);
    } else {
      h = probs_on_input_ ? saved.act_RF : activation_tensor({R, F_});
      mlp_activation_forward(activation_, saved.act_RF, h, saved.fc1_RF1, probs_on_input_ ? nullptr : &saved.probs_R);
    }
    fc_forward(Layer::kFc2, offsets_E1, y_RH, h, saved.fc2_delayed_E);
    if (probs_on_input_ || layer(0, Layer::kFc2).bias() == nullptr) return;
    for_each_expert(offsets_E1, [&](const int64_t e, const int64_t begin, const int64_t end) {
      Tensor y = y_RH.slice_rows(begin, end);
      ops::add_outer(y, saved.probs_R.slice_rows(begin, end), layer(e, Layer::kFc2).bias()->value);  // + p b2
    });
  }

  void run_backward(const std::vector<int64_t>& offsets_E1, Tensor& dx_RH, Tensor& dprobs_R, const Tensor& dy_RH,
                    const ExpertActivations& saved) const override {
    const int64_t R = offsets_E1.back();
    if (R == 0) return;
    const bool b2 = layer(0, Layer::kFc2).bias() != nullptr;
    // Row-local gradients: dh = dy W2, then the activation (and probability), then dx.
    Tensor dh = activation_tensor({R, F_});
    fc_backward(Layer::kFc2, offsets_E1, &dh, dy_RH, nullptr, saved.fc2_delayed_E);
    Tensor dfc1 = activation_tensor({R, F1_});
    if (!probs_on_input_) {
      if (weighted_swiglu()) {
        ops::weighted_swiglu_backward(dfc1, dprobs_R, dh, saved.fc1_RF1, saved.probs_R);
      } else {
        mlp_activation_backward(activation_, dfc1, &dprobs_R, dh, saved.fc1_RF1, saved.act_RF, &saved.probs_R);
      }
      if (b2) {
        for_each_expert(offsets_E1, [&](const int64_t e, const int64_t begin, const int64_t end) {
          Tensor dprobs = dprobs_R.slice_rows(begin, end);
          ops::add_outer_backward(&dprobs, nullptr, dy_RH.slice_rows(begin, end), saved.probs_R.slice_rows(begin, end),
                                  layer(e, Layer::kFc2).bias()->value);
        });
      }
      fc_backward(Layer::kFc1, offsets_E1, &dx_RH, dfc1, nullptr, saved.fc1_delayed_E);
    } else {
      mlp_activation_backward(activation_, dfc1, nullptr, dh, saved.fc1_RF1, saved.act_RF, nullptr);
      // fc1 input x * p: dx += d(fc1 input) p, dp = <d(fc1 input), x>.
      Tensor dxs = activation_tensor({R, H_});
      fc_backward(Layer::kFc1, offsets_E1, &dxs, dfc1, nullptr, saved.fc1_delayed_E);
      ops::scale_rows_backward(&dx_RH, &dprobs_R, dxs, saved.x_RH, saved.probs_R);
    }
    dh = Tensor();
    parallel::drive_progress();

    // Weight gradients over each expert's rows; experts without rows keep theirs as they are.
    fc_backward(Layer::kFc1, offsets_E1, nullptr, dfc1, probs_on_input_ ? &saved.xs_RH : &saved.x_RH,
                saved.fc1_delayed_E);
    // fc2's input: saved (weighted SwiGLU, or the activation itself with probs on the input), else recomputed as
    // act * p.
    Tensor h = weighted_swiglu() ? saved.h_RF : saved.act_RF;
    if (!weighted_swiglu() && !probs_on_input_) {
      h = activation_tensor({R, F_});
      ops::scale_rows(h, saved.act_RF, saved.probs_R);
    }
    fc_backward(Layer::kFc2, offsets_E1, nullptr, dy_RH, &h, saved.fc2_delayed_E);
    if (probs_on_input_ || !b2) return;
    for_each_expert(offsets_E1, [&](const int64_t e, const int64_t begin, const int64_t end) {
      Param* bias = layer(e, Layer::kFc2).bias();  // d(p b2)/d b2 = p
      ops::add_outer_backward(nullptr, &bias->grad, dy_RH.slice_rows(begin, end), saved.probs_R.slice_rows(begin, end),
                              bias->value);
    });
  }
};

}  // namespace

std::unique_ptr<ExpertMLP> make_grouped_mlp(const MoEConfig& moe, const ModelConfig& model, const std::string& prefix,
                                            std::vector<Param>& params, const parallel::ParallelState& parallel,
                                            const int module) {
  return std::make_unique<GroupedMLP>(moe, model, prefix, params, parallel, module);
}

}  // namespace moecore::experts_detail
