// SequentialMLP: one expert at a time, each GEMM over that expert's whole row
// block (BLAS threads inside).
#include "moecore/moe/experts_internal.h"

namespace moecore::experts_detail {
namespace {

class SequentialMLP final : public ExpertMLPBase {
 public:
  using ExpertMLPBase::ExpertMLPBase;

 private:
  void run_forward(const std::vector<int64_t> &offsets_E1, const ForwardBuffers &buf) const override {
    for (int64_t e = 0; e < E_; ++e) {
      const int64_t n = offsets_E1[e + 1] - offsets_E1[e];
      if (n > 0) forward_rows(e, offsets_E1[e], n, buf);
    }
  }

  void run_backward(const std::vector<int64_t> &offsets_E1, const BackwardBuffers &buf) const override {
    for (int64_t e = 0; e < E_; ++e) {
      const int64_t n = offsets_E1[e + 1] - offsets_E1[e];
      if (n == 0)
        continue;  // zero rows: the gradients stay as they are (present, nothing
                   // added)
      backward_rows(e, offsets_E1[e], n, buf);
      backward_weights(e, offsets_E1[e], n, 1, buf);
      backward_weights(e, offsets_E1[e], n, 0, buf);
    }
  }
};

}  // namespace

std::unique_ptr<ExpertMLP> make_sequential_mlp(const MoEConfig &moe, const ModelConfig &model,
                                               const std::string &prefix, std::vector<Param> &params,
                                               const parallel::ParallelState &parallel, const int module) {
  return std::make_unique<SequentialMLP>(moe, model, prefix, params, parallel, module);
}

}  // namespace moecore::experts_detail
