// SequentialMLP: one expert at a time, each expert's MLP over its whole row block (BLAS threads inside).
#include "moecore/moe/experts_internal.h"

namespace moecore::experts_detail {
namespace {

class SequentialMLP final : public ExpertMLPBase {
 public:
  using ExpertMLPBase::ExpertMLPBase;

 private:
  void run_forward(const std::vector<int64_t> &offsets_E1, Tensor &y_RH, ExpertActivations &saved) const override {
    saved.per_expert.resize(static_cast<size_t>(E_));
    for (int64_t e = 0; e < E_; ++e) {
      const int64_t begin = offsets_E1[e], end = offsets_E1[e + 1];
      if (end == begin) continue;
      const Tensor probs = saved.probs_R.slice_rows(begin, end);
      const Tensor y = experts_[static_cast<size_t>(e)].forward(saved.x_RH.slice_rows(begin, end), &probs,
                                                                saved.per_expert[static_cast<size_t>(e)]);
      y_RH.slice_rows(begin, end).copy_from(y);
    }
  }

  // Never asked to defer its weight gradients (defers_weight_grads() false: ExpertMLPBase::backward refuses).
  void run_backward(const std::vector<int64_t> &offsets_E1, Tensor &dx_RH, Tensor &dprobs_R, const Tensor &dy_RH,
                    const ExpertActivations &saved, std::function<void()> * /*deferred_weight_grads*/) const override {
    for (int64_t e = 0; e < E_; ++e) {
      const int64_t begin = offsets_E1[e], end = offsets_E1[e + 1];
      if (end == begin) continue;  // zero rows: the gradients stay as they are (present, nothing added)
      Tensor dx = dx_RH.slice_rows(begin, end);
      Tensor dprobs = dprobs_R.slice_rows(begin, end);
      const Tensor probs = saved.probs_R.slice_rows(begin, end);
      experts_[static_cast<size_t>(e)].backward(dx, &dprobs, dy_RH.slice_rows(begin, end), &probs,
                                                saved.per_expert[static_cast<size_t>(e)]);
    }
  }
};

}  // namespace

std::unique_ptr<ExpertMLP> make_sequential_mlp(const MoEConfig &moe, const ModelConfig &model,
                                               const std::string &prefix, ParamStore &params,
                                               const parallel::ParallelState &parallel, const int module) {
  return std::make_unique<SequentialMLP>(moe, model, prefix, params, parallel, module);
}

}  // namespace moecore::experts_detail
