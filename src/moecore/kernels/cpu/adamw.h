// AdamW exactly as torch.optim.AdamW (decoupled weight decay applied first):
//   p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   p -= (lr / (1 - b1^step)) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)
// with g = grad * grad_scale (in the element type: the gradient clipping's coefficient, applied as the gradient is
// read rather than in a pass of its own). With `model`, the same pass writes each updated parameter rounded to
// `model_rounding` there too: the 16-bit model weights from the fp32 main parameters (float only). With `grad_to_zero`
// (the gradient array itself) each gradient element is set to zero once the update has read it: an optimizer that
// consumes the gradients spares the next step its separate zeroing pass over them. With `model_bf16` (float, model
// rounding kBF16 only) the same pass also writes each model weight's bf16 bits there: the 16-bit copy the native
// GEMMs read, made with the weights instead of by a cast pass over them before the next step.
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/convert.h"

namespace moecore::kernels {

struct AdamWHyper {
  double lr = 0.0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  int64_t step = 1;         // 1-based count of updates including this one
  float grad_scale = 1.0f;  // the clipping coefficient (1: none)
};

#define MOECORE_ADAMW_DECL                                                                             \
  template <typename T>                                                                                \
  void adamw_step(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, int64_t n, const AdamWHyper& hp, \
                  T* model = nullptr, ActivationRounding model_rounding = ActivationRounding::kNone,   \
                  T * grad_to_zero = nullptr, uint16_t * model_bf16 = nullptr);

namespace cpu {
MOECORE_ADAMW_DECL

// The vector code of the fp32 update that writes 16-bit model weights: each vector of parameters updated in registers
// and its rounded values streamed from there (AVX2 + FMA + F16C, AVX-512 CPUs included), or the portable loop through
// a chunk buffer. The same bits on both; adamw_step takes the best the CPU has, or the innermost live
// ScopedAdamWModelPath's (tests).
enum class AdamWModelPath : uint8_t { kPortable, kAvx2 };
bool adamw_model_path_supported(AdamWModelPath path);
AdamWModelPath adamw_model_path();
class ScopedAdamWModelPath {
 public:
  explicit ScopedAdamWModelPath(AdamWModelPath path);  // throws std::invalid_argument for a path this CPU lacks
  ~ScopedAdamWModelPath();
  ScopedAdamWModelPath(const ScopedAdamWModelPath&) = delete;
  ScopedAdamWModelPath& operator=(const ScopedAdamWModelPath&) = delete;

 private:
  int previous_ = -1;
};
}  // namespace cpu

namespace ref {
MOECORE_ADAMW_DECL
}
#undef MOECORE_ADAMW_DECL

}  // namespace moecore::kernels
