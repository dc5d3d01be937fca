// AdamW exactly as torch.optim.AdamW (decoupled weight decay applied first):
//   p *= 1 - lr * wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   p -= (lr / (1 - b1^step)) * m / (sqrt(v) / sqrt(1 - b2^step) + eps)
#pragma once

#include <cstdint>

namespace moecore::kernels {

struct AdamWHyper {
  double lr = 0.0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  int64_t step = 1;  // 1-based count of updates including this one
};

#define MOECORE_ADAMW_DECL \
  template <typename T>    \
  void adamw_step(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, int64_t n, const AdamWHyper& hp);

namespace cpu {
MOECORE_ADAMW_DECL
}
namespace ref {
MOECORE_ADAMW_DECL
}
#undef MOECORE_ADAMW_DECL

}  // namespace moecore::kernels
