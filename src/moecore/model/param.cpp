#include "moecore/model/param.h"

#include <cmath>
#include <stdexcept>
#include <utility>

#include "moecore/tensor/rng.h"

namespace moecore {

Param make_param(std::string name, const std::vector<int64_t>& shape, const InitKind init) {
  Param p;
  p.name = std::move(name);
  p.value = Tensor(shape, DType::kF32, MemCategory::kParams);
  p.grad = Tensor(shape, DType::kF32, MemCategory::kGrads);
  p.init = init;
  p.no_weight_decay = shape.size() == 1;
  return p;
}

std::vector<Param*> find_params(std::vector<Param>& params, const std::vector<std::string>& names) {
  std::vector<Param*> found(names.size(), nullptr);
  for (Param& p : params) {
    for (size_t i = 0; i < names.size(); ++i) {
      if (p.name == names[i]) found[i] = &p;
    }
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (found[i] == nullptr) throw std::logic_error("parameter " + names[i] + " was not registered");
  }
  return found;
}

Param* find_param(std::vector<Param>& params, const std::string& name) { return find_params(params, {name})[0]; }

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
