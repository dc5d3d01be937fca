// Internal to src/moecore/moe (not a public interface): the pieces GroupedMLP
// and SequentialMLP share, so the two differ only in how the per-expert work is
// scheduled, and therefore give the same results. Legend: R rows grouped by
// expert, H hidden, F expert ffn width, F1 = 2F with SwiGLU else F, E local
// experts.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moecore/moe/experts.h"

namespace moecore::experts_detail {

struct ExpertParams {
  Param *fc1_weight = nullptr;  // [F1, H]
  Param *fc1_bias = nullptr;    // [F1] or null
  Param *fc2_weight = nullptr;  // [H, F]
  Param *fc2_bias = nullptr;    // [H] or null
};

// Buffers of one forward or backward call, so the block functions below take
// one argument.
struct ForwardBuffers {
  float *y_RH;
  const float *x_RH;  // expert input as given (before probs)
  const float *probs_R;
  float *xs_RH;     // fc1 input (saved): x * p with probs on input, else a copy of x
  float *x_raw_RH;  // copy of x (probs on input only, else null)
  float *fc1_RF1;
  float *act_RF;
  float *h_RF;  // fc2 input: act * p, or act with probs on input
};

struct BackwardBuffers {
  float *dx_RH;
  float *dprobs_R;
  const float *dy_RH;
  const ExpertActivations *saved;
  float *h_RF;      // fc2 input, recomputed
  float *dfc1_RF1;  // zero-initialised
  float *dxs_RH;    // zero-initialised; d(fc1 input)
};

class ExpertMLPBase : public ExpertMLP {
 public:
  // Registers this EP rank's experts (global names), each sharded over expert-TP.
  ExpertMLPBase(const MoEConfig &moe, const ModelConfig &model, const std::string &prefix, std::vector<Param> &params,
                const parallel::ParallelState &parallel, int module);
  void bind(std::vector<Param> &params) final;
  void forward(float *y_RH, const float *x_RH, const float *probs_R, const std::vector<int64_t> &tokens_per_expert_E,
               ExpertActivations &saved) final;
  void backward(float *dx_RH, float *dprobs_R, const float *dy_RH, const ExpertActivations &saved) final;

 protected:
  // Forward of rows [row_begin, row_begin + n) of expert e: fc1, activation,
  // probs, fc2.
  void forward_rows(int64_t e, int64_t row_begin, int64_t n, const ForwardBuffers &buf) const;
  // Backward of rows [row_begin, row_begin + n) of expert e: every row-local
  // gradient (dx, dprobs, dfc1) and h.
  void backward_rows(int64_t e, int64_t row_begin, int64_t n, const BackwardBuffers &buf) const;
  // Weight gradients of expert e (rows [row_begin, row_begin + n)): which = 0
  // for fc1, 1 for fc2.
  void backward_weights(int64_t e, int64_t row_begin, int64_t n, int which, const BackwardBuffers &buf) const;

  // How the per-expert work is scheduled: the only difference between the two
  // implementations.
  virtual void run_forward(const std::vector<int64_t> &offsets_E1, const ForwardBuffers &buf) const = 0;
  virtual void run_backward(const std::vector<int64_t> &offsets_E1, const BackwardBuffers &buf) const = 0;

  int64_t E_ = 0, H_ = 0, F_ = 0, F1_ = 0;
  Activation activation_ = Activation::kGelu;
  bool probs_on_input_ = false;

 private:
  std::vector<std::string> names_;     // registered parameter names, 2 or 4 per expert
  std::vector<ExpertParams> experts_;  // resolved in bind()
  bool bias_ = false;
};

// Exclusive prefix sums of tokens_per_expert_E ([E + 1]); throws on a wrong
// count or a negative entry.
std::vector<int64_t> expert_offsets(const std::vector<int64_t> &tokens_per_expert_E, int64_t E);

std::unique_ptr<ExpertMLP> make_sequential_mlp(const MoEConfig &moe, const ModelConfig &model,
                                               const std::string &prefix, std::vector<Param> &params,
                                               const parallel::ParallelState &parallel, int module);
std::unique_ptr<ExpertMLP> make_grouped_mlp(const MoEConfig &moe, const ModelConfig &model, const std::string &prefix,
                                            std::vector<Param> &params, const parallel::ParallelState &parallel,
                                            int module);

}  // namespace moecore::experts_detail
