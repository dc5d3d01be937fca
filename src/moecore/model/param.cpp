#include "moecore/model/param.h"

#include <cmath>

#include "moecore/tensor/rng.h"

namespace moecore {

void init_param(Param& param, const uint64_t seed, const double std, const int64_t num_layers) {
  float* value = param.value.data<float>();
  const int64_t n = param.value.numel();
  switch (param.init) {
    case InitKind::kZeros: param.value.zero_(); return;
    case InitKind::kOnes:
      for (int64_t i = 0; i < n; ++i) value[i] = 1.0f;
      return;
    case InitKind::kNormal:
    case InitKind::kScaledNormal: {
      const double sigma =
          param.init == InitKind::kNormal ? std : std / std::sqrt(2.0 * static_cast<double>(num_layers));
      const CounterRng rng(seed, stream_key(param.name));
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) value[i] = static_cast<float>(sigma * rng.normal(static_cast<uint64_t>(i)));
      return;
    }
  }
}

}  // namespace moecore
