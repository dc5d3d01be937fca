// Reference grouped expert MLP: each expert's rows through the reference kernels, one expert at a time.
#include <utility>

#include "moecore/kernels/cpu/activation.h"
#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/expert_activation.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/grouped_mlp.h"
#include "moecore/kernels/cpu/grouped_mlp_steps.h"
#include "moecore/kernels/cpu/rows.h"

namespace moecore::kernels::ref {
namespace {

MOECORE_GROUPED_MLP_KERNELS(Kernels, ref)

template <typename T>
using Steps = grouped_mlp_detail::Steps<Kernels, T>;

}  // namespace

template <typename T>
void grouped_mlp_forward(T* y_RH, T* fc1_RF1, T* act_RF, T* h_RF, T* xs_RH, const T* x_RH, const T* probs_R,
                         const GroupedMlpWeights<T>& w, const GroupedMlpShape& s) {
  const Steps<T> steps(w, s);
  for (int64_t e = 0; e < s.E; ++e) {
    if (s.offsets_E1[e + 1] == s.offsets_E1[e]) continue;
    steps.forward(e, s.offsets_E1[e], s.offsets_E1[e + 1], y_RH, fc1_RF1, act_RF, h_RF, xs_RH, x_RH, probs_R);
  }
}

template <typename T>
void grouped_mlp_backward(T* dx_RH, T* dprobs_R, const GroupedMlpGrads<T>& g, T* dfc1_RF1, const T* dy_RH,
                          const T* x_RH, const T* xs_RH, const T* fc1_RF1, const T* act_RF, const T* h_RF,
                          const T* probs_R, const GroupedMlpWeights<T>& w, const GroupedMlpShape& s) {
  const Steps<T> steps(w, s);
  // Every expert's data gradients, then every expert's weight gradients (each expert's results are its own, so the
  // order of the experts' parts changes nothing).
  if (s.part != GroupedMlpBackwardPart::kWeights) {
    for (int64_t e = 0; e < s.E; ++e) {
      const int64_t begin = s.offsets_E1[e], end = s.offsets_E1[e + 1];
      if (end == begin) continue;
      steps.backward_data(e, begin, end, dx_RH, dprobs_R, dfc1_RF1, dy_RH, x_RH, fc1_RF1, act_RF, probs_R);
    }
  }
  if (s.part == GroupedMlpBackwardPart::kData) return;
  for (int64_t e = 0; e < s.E; ++e) {
    const int64_t begin = s.offsets_E1[e], end = s.offsets_E1[e + 1];
    if (end == begin) continue;
    for (const bool fc1 : {true, false}) {
      steps.weight_grads(e, fc1, begin, end, g, dfc1_RF1, dy_RH, x_RH, xs_RH, act_RF, h_RF, probs_R);
    }
  }
}

#define MOECORE_INSTANTIATE(T)                                                                                         \
  template void grouped_mlp_forward<T>(T*, T*, T*, T*, T*, const T*, const T*, const GroupedMlpWeights<T>&,            \
                                       const GroupedMlpShape&);                                                        \
  template void grouped_mlp_backward<T>(T*, T*, const GroupedMlpGrads<T>&, T*, const T*, const T*, const T*, const T*, \
                                        const T*, const T*, const T*, const GroupedMlpWeights<T>&,                     \
                                        const GroupedMlpShape&);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::ref
