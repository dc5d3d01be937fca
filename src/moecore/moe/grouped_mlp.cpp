// GroupedMLP: all local experts in one pass over the grouped buffer. In fp32 and 16 bits (either GEMM path) the
// fused grouped-MLP op (ops/grouped_mlp.h) runs fc1, activation, probability and fc2 of every expert, and in
// backward the data and weight gradients; its kernel schedules the row tiles. FP8 / FP4 quantization, which the op
// does not fuse, runs here through ops::linear and the activation ops, one expert after another, each op using every
// thread: each expert's rows are one tile, as Megatron's TEGroupedLinear quantizes each expert's rows as one tensor
// (per-tensor scales must see all of them). With --delay-wgrad-compute (ExpertMLP::backward's deferred_weight_grads)
// both paths split backward: the data gradients now, the weight gradients later.
#include "moecore/ops/grouped_mlp.h"

#include <functional>
#include <utility>
#include <vector>

#include "moecore/moe/experts_internal.h"
#include "moecore/ops/expert_activation.h"
#include "moecore/ops/linear.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"
#include "moecore/ops/rows.h"
#include "moecore/ops/scoped_state.h"
#include "moecore/parallel/process_group.h"

namespace moecore::experts_detail {
namespace {

struct RowTile {
  int64_t expert, begin, end;
};

std::vector<RowTile> row_tiles(const std::vector<int64_t> &offsets_E1) {
  std::vector<RowTile> tiles;
  const int64_t E = static_cast<int64_t>(offsets_E1.size()) - 1;
  for (int64_t e = 0; e < E; ++e) {
    if (offsets_E1[e + 1] > offsets_E1[e]) tiles.push_back({e, offsets_E1[e], offsets_E1[e + 1]});
  }
  return tiles;
}

// Expert e's entry of a saved-quantized-input list: the slot to fill in forward, the input to read in backward (null
// when the list is empty, or in backward when the entry is).
quant::PackedQuantizedTensor *saved_input(std::vector<quant::PackedQuantizedTensor> &q_E, const size_t e) {
  return q_E.empty() ? nullptr : &q_E[e];
}
const quant::PackedQuantizedTensor *saved_input(const std::vector<quant::PackedQuantizedTensor> &q_E, const int64_t e) {
  if (q_E.empty()) return nullptr;
  const quant::PackedQuantizedTensor &q = q_E[static_cast<size_t>(e)];
  return q.defined() ? &q : nullptr;
}

// Buffers of one backward call on the unfused path (tensors share the caller's storage; the weight gradients, when
// deferred, keep their copy of the buffers: dy_RH and dfc1_RF1).
struct BackwardBuffers {
  Tensor dx_RH, dprobs_R;
  Tensor dy_RH;
  Tensor dfc1_RF1;  // zero-initialised
  Tensor dxs_RH;    // probs on input: d(fc1 input), zero-initialised
};

// The ops' scopes of a backward call (precision, quantization), which its deferred weight gradients run under again
// (they may run inside another layer's scopes, e.g. an unquantized one of --first-last-layers-bf16).
class CallScopes {
 public:
  CallScopes() : state_(ops::current_scoped_state()) {}
  // Runs fn under the scopes, then puts the caller's back.
  template <typename Fn>
  void run(Fn &&fn) const {
    struct Restore {
      ops::ScopedState outer = ops::current_scoped_state();
      ~Restore() { ops::restore_scoped_state(outer); }
    } restore;
    ops::restore_scoped_state(state_);
    fn();
  }

 private:
  ops::ScopedState state_;
};

// The experts' parameter (or gradient) tensors as the grouped-MLP op takes them.
template <typename T>
struct ExpertTensors {
  std::vector<T *> fc1_weight, fc1_bias, fc2_weight, fc2_bias;
};

class GroupedMLP final : public ExpertMLPBase {
 public:
  using ExpertMLPBase::ExpertMLPBase;

 private:
  const Param *fc2_bias(const int64_t e) const { return experts_[static_cast<size_t>(e)].fc2().bias(); }
  // SwiGLU with the probability after it (Megatron's default expert MLP): the fused weighted SwiGLU, which saves
  // fc2's input h = swiglu(fc1) * p instead of the activation and recomputes swiglu in backward.
  bool weighted_swiglu() const { return activation_ == ops::Activation::kSwiGLU && !probs_on_input_; }
  ops::GroupedMlpSpec spec() const { return {activation_, probs_on_input_}; }

  // Tensors of Param::value (values) or Param::grad of every local expert; biases empty without them.
  template <typename T>
  ExpertTensors<T> expert_tensors(const bool values) const {
    ExpertTensors<T> out;
    auto of = [values](Param &p) -> T * { return values ? &p.value : &p.grad; };
    for (const MLP &expert : experts_) {
      out.fc1_weight.push_back(of(expert.fc1().weight()));
      out.fc2_weight.push_back(of(expert.fc2().weight()));
      if (Param *b1 = expert.fc1().bias()) out.fc1_bias.push_back(of(*b1));
      if (Param *b2 = expert.fc2().bias()) out.fc2_bias.push_back(of(*b2));
    }
    return out;
  }

  void run_forward(const std::vector<int64_t> &offsets_E1, Tensor &y_RH, ExpertActivations &saved) const override {
    const int64_t R = offsets_E1.back();
    if (ops::grouped_mlp_fused(y_RH.device())) {  // the fused op overwrites every row of its outputs: not zeroed
      saved.fc1_RF1 = ops::uninitialized_activation({R, F1_});
      (weighted_swiglu() ? saved.h_RF : saved.act_RF) = ops::uninitialized_activation({R, F_});
      if (probs_on_input_) saved.xs_RH = ops::uninitialized_activation({R, H_});
      const ExpertTensors<const Tensor> p = expert_tensors<const Tensor>(true);
      ops::grouped_mlp_forward(y_RH, saved.fc1_RF1, &saved.act_RF, &saved.h_RF, &saved.xs_RH, saved.x_RH, saved.probs_R,
                               {p.fc1_weight, p.fc1_bias, p.fc2_weight, p.fc2_bias}, offsets_E1, spec());
      return;
    }
    saved.fc1_RF1 = ops::activation_tensor({R, F1_});
    (weighted_swiglu() ? saved.h_RF : saved.act_RF) = ops::activation_tensor({R, F_});
    if (probs_on_input_) saved.xs_RH = ops::activation_tensor({R, H_});
    if (probs_on_input_) ops::scale_rows(saved.xs_RH, saved.x_RH, saved.probs_R);
    saved.fc1_delayed_E.assign(static_cast<size_t>(E_), {});
    saved.fc2_delayed_E.assign(static_cast<size_t>(E_), {});
    const bool quantized = ops::linear_quantization() != nullptr;
    if (quantized) {
      saved.fc1_input_q_E.assign(static_cast<size_t>(E_), {});
      saved.fc2_input_q_E.assign(static_cast<size_t>(E_), {});
    }
    for (const RowTile &tile : row_tiles(offsets_E1)) forward_tile(tile, y_RH, saved);
    if (quantized) keep_quantized_inputs(offsets_E1, saved);
  }

  // Under FP8 / FP4 each expert is one tile, whose fc1 and fc2 inputs were saved quantized: the high-precision ones go
  // where nothing else reads them (x_RH is read again with the probability on the input; h_RF exists only with
  // weighted SwiGLU, as fc2's input alone).
  void keep_quantized_inputs(const std::vector<int64_t> &offsets_E1, ExpertActivations &saved) const {
    const auto all_saved = [&](const std::vector<quant::PackedQuantizedTensor> &q_E) {
      for (int64_t e = 0; e < E_; ++e) {
        if (offsets_E1[e + 1] > offsets_E1[e] && !q_E[static_cast<size_t>(e)].defined()) return false;
      }
      return true;
    };
    if (all_saved(saved.fc1_input_q_E)) (probs_on_input_ ? saved.xs_RH : saved.x_RH) = Tensor();
    if (weighted_swiglu() && all_saved(saved.fc2_input_q_E)) saved.h_RF = Tensor();
  }

  // The unfused path's forward of one tile.
  void forward_tile(const RowTile &tile, Tensor &y_RH, ExpertActivations &saved) const {
    const auto e = static_cast<size_t>(tile.expert);
    const MLP &expert = experts_[e];
    const Tensor &fc1_in = probs_on_input_ ? saved.xs_RH : saved.x_RH;
    const Tensor probs = saved.probs_R.slice_rows(tile.begin, tile.end);
    Tensor fc1 = saved.fc1_RF1.slice_rows(tile.begin, tile.end);
    const Param *b1 = expert.fc1().bias();
    const Param &w1 = expert.fc1().weight(), &w2 = expert.fc2().weight();
    // Under FP8 delayed scaling each expert is one tile (row_tiles), so each scaling state records one forward.
    ops::linear_forward(fc1, fc1_in.slice_rows(tile.begin, tile.end), w1.value, b1 ? &b1->value : nullptr,
                        w1.delayed_scaling.get(), &saved.fc1_delayed_E[e], saved_input(saved.fc1_input_q_E, e));
    // fc2's input: h = swiglu(fc1) * p (saved), the activation itself (probs on the input), or act * p in a
    // tile-sized buffer (not saved: backward recomputes it).
    Tensor h;
    if (weighted_swiglu()) {
      h = saved.h_RF.slice_rows(tile.begin, tile.end);
      ops::weighted_swiglu_forward(h, fc1, probs);
    } else {
      Tensor act = saved.act_RF.slice_rows(tile.begin, tile.end);
      h = probs_on_input_ ? act : ops::activation_tensor({tile.end - tile.begin, F_});
      mlp_activation_forward(activation_, act, h, fc1, probs_on_input_ ? nullptr : &probs);
    }
    Tensor y = y_RH.slice_rows(tile.begin, tile.end);
    const Param *b2 = fc2_bias(tile.expert);
    ops::linear_forward(y, h, w2.value, probs_on_input_ && b2 ? &b2->value : nullptr, w2.delayed_scaling.get(),
                        &saved.fc2_delayed_E[e], weighted_swiglu() ? saved_input(saved.fc2_input_q_E, e) : nullptr);
    if (!probs_on_input_ && b2) ops::add_outer(y, probs, b2->value);  // y = W2 (act p) + p b2
  }

  // The unfused path's row-local gradients of one tile: dx, dprobs and d(fc1 output).
  void backward_tile(const RowTile &tile, BackwardBuffers &buf, const ExpertActivations &saved) const {
    const MLP &expert = experts_[static_cast<size_t>(tile.expert)];
    const Tensor probs = saved.probs_R.slice_rows(tile.begin, tile.end);
    const Tensor dy = buf.dy_RH.slice_rows(tile.begin, tile.end);
    Tensor dprobs = buf.dprobs_R.slice_rows(tile.begin, tile.end);
    Tensor dh = ops::activation_tensor({tile.end - tile.begin, F_});
    const Param &w2 = expert.fc2().weight();
    const auto e = static_cast<size_t>(tile.expert);
    ops::linear_backward(&dh, nullptr, nullptr, dy, nullptr, w2.value, w2.delayed_scaling.get(),
                         &saved.fc2_delayed_E[e]);
    Tensor dfc1 = buf.dfc1_RF1.slice_rows(tile.begin, tile.end);
    const Tensor fc1 = saved.fc1_RF1.slice_rows(tile.begin, tile.end);
    const Param &w1 = expert.fc1().weight();
    if (!probs_on_input_) {
      if (weighted_swiglu()) {
        ops::weighted_swiglu_backward(dfc1, dprobs, dh, fc1, probs);
      } else {
        mlp_activation_backward(activation_, dfc1, &dprobs, dh, fc1, saved.act_RF.slice_rows(tile.begin, tile.end),
                                &probs);
      }
      if (const Param *b2 = fc2_bias(tile.expert)) ops::add_outer_backward(&dprobs, nullptr, dy, probs, b2->value);
      Tensor dx = buf.dx_RH.slice_rows(tile.begin, tile.end);
      ops::linear_backward(&dx, nullptr, nullptr, dfc1, nullptr, w1.value, w1.delayed_scaling.get(),
                           &saved.fc1_delayed_E[e]);
      return;
    }
    mlp_activation_backward(activation_, dfc1, nullptr, dh, fc1, saved.act_RF.slice_rows(tile.begin, tile.end),
                            nullptr);
    // fc1 input x * p: dx += d(fc1 input) p, dp = <d(fc1 input), x>.
    Tensor dxs = buf.dxs_RH.slice_rows(tile.begin, tile.end);
    ops::linear_backward(&dxs, nullptr, nullptr, dfc1, nullptr, w1.value, w1.delayed_scaling.get(),
                         &saved.fc1_delayed_E[e]);
    Tensor dx = buf.dx_RH.slice_rows(tile.begin, tile.end);
    ops::scale_rows_backward(&dx, &dprobs, dxs, saved.x_RH.slice_rows(tile.begin, tile.end), probs);
  }

  // The unfused path's weight gradients of expert e over its rows [begin, end).
  void backward_weights(const int64_t e, const int64_t begin, const int64_t end, const BackwardBuffers &buf,
                        const ExpertActivations &saved) const {
    const MLP &expert = experts_[static_cast<size_t>(e)];
    Param &w1 = expert.fc1().weight();
    Param *b1 = expert.fc1().bias();
    const Tensor &fc1_in = probs_on_input_ ? saved.xs_RH : saved.x_RH;
    const quant::PackedQuantizedTensor *in_q = saved_input(saved.fc1_input_q_E, e);
    const Tensor in = in_q != nullptr ? Tensor() : fc1_in.slice_rows(begin, end);
    ops::linear_backward(nullptr, &w1.grad, b1 ? &b1->grad : nullptr, buf.dfc1_RF1.slice_rows(begin, end),
                         in_q != nullptr ? nullptr : &in, w1.value, w1.delayed_scaling.get(),
                         &saved.fc1_delayed_E[static_cast<size_t>(e)], in_q);
    Param &w2 = expert.fc2().weight();
    Param *b2 = expert.fc2().bias();
    const Tensor dy = buf.dy_RH.slice_rows(begin, end);
    // fc2's input: saved (weighted SwiGLU, or the activation itself with probs on the input), else recomputed as
    // act * p in a buffer of this expert's rows.
    const quant::PackedQuantizedTensor *h_q = saved_input(saved.fc2_input_q_E, e);
    Tensor h;
    if (h_q == nullptr) {
      h = weighted_swiglu() ? saved.h_RF.slice_rows(begin, end) : saved.act_RF.slice_rows(begin, end);
      if (!weighted_swiglu() && !probs_on_input_) {
        h = ops::activation_tensor({end - begin, F_});
        ops::scale_rows(h, saved.act_RF.slice_rows(begin, end), saved.probs_R.slice_rows(begin, end));
      }
    }
    ops::linear_backward(nullptr, &w2.grad, probs_on_input_ && b2 ? &b2->grad : nullptr, dy,
                         h_q != nullptr ? nullptr : &h, w2.value, w2.delayed_scaling.get(),
                         &saved.fc2_delayed_E[static_cast<size_t>(e)], h_q);
    if (!probs_on_input_ && b2) {  // d(p b2)/d b2 = p
      ops::add_outer_backward(nullptr, &b2->grad, dy, saved.probs_R.slice_rows(begin, end), b2->value);
    }
  }

  // fc2's input: h = swiglu(fc1) * p with weighted SwiGLU, else the activation output (the probability, when
  // applied after it, is recomputed per tile in backward anyway).
  void drop_activation(ExpertActivations &saved) const override {
    (weighted_swiglu() ? saved.h_RF : saved.act_RF) = Tensor();
    saved.fc2_input_q_E.clear();  // backward reads the recomputed h_RF
  }
  void recompute_activation(ExpertActivations &saved) const override {
    const int64_t R = saved.fc1_RF1.dim(0);
    if (weighted_swiglu()) {
      saved.h_RF = ops::activation_tensor({R, F_});
      ops::weighted_swiglu_forward(saved.h_RF, saved.fc1_RF1, saved.probs_R);
      return;
    }
    saved.act_RF = ops::activation_tensor({R, F_});
    mlp_activation_forward(activation_, saved.act_RF, saved.act_RF, saved.fc1_RF1, nullptr);
  }

  bool defers_weight_grads() const override { return true; }

  // The fused op's backward, or one part of it with the workspace of a split call. Where it computes weight
  // gradients it tells the op which experts' gradients are known zero (Param::grad_zero) and then clears the flags of
  // every expert with rows.
  void fused_backward(const std::vector<int64_t> &offsets_E1, Tensor &dx_RH, Tensor &dprobs_R, const Tensor &dy_RH,
                      const ExpertActivations &saved, const ops::GroupedMlpBackwardSplit *split) const {
    const ExpertTensors<const Tensor> p = expert_tensors<const Tensor>(true);
    const ExpertTensors<Tensor> g = expert_tensors<Tensor>(false);
    const bool weights = split == nullptr || split->part != ops::GroupedMlpBackwardPart::kData;
    std::vector<uint8_t> weights_zero_E;
    if (weights) {
      for (const MLP &expert : experts_) {
        weights_zero_E.push_back(expert.fc1().weight().grad_zero && expert.fc2().weight().grad_zero ? 1 : 0);
      }
    }
    ops::grouped_mlp_backward(dx_RH, dprobs_R, {g.fc1_weight, g.fc1_bias, g.fc2_weight, g.fc2_bias, weights_zero_E},
                              dy_RH, saved.x_RH, &saved.xs_RH, saved.fc1_RF1, &saved.act_RF, &saved.h_RF, saved.probs_R,
                              {p.fc1_weight, p.fc1_bias, p.fc2_weight, p.fc2_bias}, offsets_E1, spec(), split);
    if (weights) clear_grad_zero(offsets_E1);
  }

  // The experts with rows have written their gradients.
  void clear_grad_zero(const std::vector<int64_t> &offsets_E1) const {
    for (int64_t e = 0; e < E_; ++e) {
      if (offsets_E1[e + 1] == offsets_E1[e]) continue;
      const MLP &expert = experts_[static_cast<size_t>(e)];
      for (Param *param : {&expert.fc1().weight(), expert.fc1().bias(), &expert.fc2().weight(), expert.fc2().bias()}) {
        if (param != nullptr) param->grad_zero = false;
      }
    }
  }

  // The unfused path's weight gradients; experts with zero rows keep their gradients as they are.
  void backward_all_weights(const std::vector<int64_t> &offsets_E1, const BackwardBuffers &buf,
                            const ExpertActivations &saved) const {
    for (int64_t e = 0; e < E_; ++e) {
      if (offsets_E1[e + 1] > offsets_E1[e]) backward_weights(e, offsets_E1[e], offsets_E1[e + 1], buf, saved);
    }
    clear_grad_zero(offsets_E1);
  }

  // --delay-wgrad-compute (Megatron's, TE's GroupedLinear delay_wgrad_compute): the data gradients now, the weight
  // gradients' GEMMs in *deferred_weight_grads, under this call's scopes.
  void run_backward(const std::vector<int64_t> &offsets_E1, Tensor &dx_RH, Tensor &dprobs_R, const Tensor &dy_RH,
                    const ExpertActivations &saved, std::function<void()> *deferred_weight_grads) const override {
    if (ops::grouped_mlp_fused(dy_RH.device())) {
      if (deferred_weight_grads == nullptr) {
        fused_backward(offsets_E1, dx_RH, dprobs_R, dy_RH, saved, nullptr);
        parallel::drive_progress();
        return;
      }
      const ExpertTensors<const Tensor> p = expert_tensors<const Tensor>(true);
      Tensor workspace = ops::grouped_mlp_backward_workspace(
          dy_RH, {p.fc1_weight, p.fc1_bias, p.fc2_weight, p.fc2_bias}, offsets_E1, spec());
      const ops::GroupedMlpBackwardSplit data{ops::GroupedMlpBackwardPart::kData, &workspace};
      fused_backward(offsets_E1, dx_RH, dprobs_R, dy_RH, saved, &data);
      parallel::drive_progress();
      *deferred_weight_grads = [this, offsets_E1, dy = dy_RH, workspace, saved = &saved,
                                scopes = CallScopes()]() mutable {
        scopes.run([&] {
          const ops::GroupedMlpBackwardSplit weights{ops::GroupedMlpBackwardPart::kWeights, &workspace};
          Tensor unused;  // dx and dprobs: the data part wrote them
          fused_backward(offsets_E1, unused, unused, dy, *saved, &weights);
        });
      };
      return;
    }
    const int64_t R = offsets_E1.back();
    BackwardBuffers buf{dx_RH, dprobs_R, dy_RH, ops::activation_tensor({R, F1_}),
                        probs_on_input_ ? ops::activation_tensor({R, H_}) : Tensor()};
    for (const RowTile &tile : row_tiles(offsets_E1)) backward_tile(tile, buf, saved);
    parallel::drive_progress();
    if (deferred_weight_grads == nullptr) {
      backward_all_weights(offsets_E1, buf, saved);
      return;
    }
    // The weight gradients read dy and dfc1 only: the data part's outputs and dxs are not kept.
    buf.dx_RH = buf.dprobs_R = buf.dxs_RH = Tensor();
    *deferred_weight_grads = [this, offsets_E1, buf = std::move(buf), saved = &saved, scopes = CallScopes()] {
      scopes.run([&] { backward_all_weights(offsets_E1, buf, *saved); });
    };
  }
};

}  // namespace

std::unique_ptr<ExpertMLP> make_grouped_mlp(const MoEConfig &moe, const ModelConfig &model, const std::string &prefix,
                                            ParamStore &params, const parallel::ParallelState &parallel,
                                            const int module) {
  return std::make_unique<GroupedMLP>(moe, model, prefix, params, parallel, module);
}

}  // namespace moecore::experts_detail
