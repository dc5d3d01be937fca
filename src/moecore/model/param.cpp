#include "moecore/model/param.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "moecore/ops/init.h"
#include "moecore/tensor/rng.h"

namespace moecore {

Param make_param(std::string name, const std::vector<int64_t>& shape, const InitKind init) {
  Param p;
  p.name = std::move(name);
  p.value = Tensor(shape, DType::kF32, MemCategory::kParams);
  p.grad = Tensor(shape, DType::kF32, MemCategory::kGrads);
  p.init = init;
  p.no_weight_decay = shape.size() == 1;
  p.shard.full_shape = shape;
  return p;
}

std::vector<int64_t> shard_shape(const ParamShard& shard) {
  std::vector<int64_t> shape = shard.full_shape;
  if (shard.num_shards <= 1) return shape;
  if (shard.dim < 0 || shard.dim >= static_cast<int>(shape.size()) || shard.segments < 1 || shard.shard_index < 0 ||
      shard.shard_index >= shard.num_shards) {
    throw std::invalid_argument("bad parameter shard description");
  }
  const int64_t extent = shape[static_cast<size_t>(shard.dim)];
  if (extent % (static_cast<int64_t>(shard.segments) * shard.num_shards) != 0) {
    throw std::invalid_argument("dimension of size " + std::to_string(extent) + " does not split into " +
                                std::to_string(shard.segments) + " x " + std::to_string(shard.num_shards) + " chunks");
  }
  shape[static_cast<size_t>(shard.dim)] = extent / shard.num_shards;
  return shape;
}

Param make_sharded_param(std::string name, const ParamShard& shard, const InitKind init) {
  Param p = make_param(std::move(name), shard_shape(shard), init);
  p.shard = shard;
  p.no_weight_decay = shard.full_shape.size() == 1;
  return p;
}

int64_t full_index(const ParamShard& shard, const int64_t local_index) {
  if (shard.num_shards <= 1) return local_index;
  const auto dim = static_cast<size_t>(shard.dim);
  int64_t inner = 1;  // elements per step along dim
  for (size_t i = dim + 1; i < shard.full_shape.size(); ++i) inner *= shard.full_shape[i];
  const int64_t full_extent = shard.full_shape[dim];
  const int64_t local_extent = full_extent / shard.num_shards;
  const int64_t chunk = local_extent / shard.segments;  // rows of one segment on this rank
  const int64_t segment_extent = full_extent / shard.segments;
  const int64_t outer = local_index / (local_extent * inner);
  const int64_t c = (local_index / inner) % local_extent;
  const int64_t within = local_index % inner;
  const int64_t full_c = (c / chunk) * segment_extent + shard.shard_index * chunk + c % chunk;
  return (outer * full_extent + full_c) * inner + within;
}

Param* find_param(ParamStore& params, const std::string& name) {
  for (Param& p : params) {
    if (p.name == name) return &p;
  }
  throw std::logic_error("parameter " + name + " was not registered");
}

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
      // The local elements are runs of consecutive one-process elements: one per segment chunk of the sharded
      // dimension (the whole tensor when it is not sharded).
      int64_t run = n;
      if (param.shard.num_shards > 1) {
        run = param.shard.full_shape[static_cast<size_t>(param.shard.dim)] / param.shard.num_shards /
              param.shard.segments;
        for (size_t d = static_cast<size_t>(param.shard.dim) + 1; d < param.shard.full_shape.size(); ++d) {
          run *= param.shard.full_shape[d];
        }
      }
      std::vector<int64_t> first_R(static_cast<size_t>(run == 0 ? 0 : n / run));
      for (size_t r = 0; r < first_R.size(); ++r) first_R[r] = full_index(param.shard, static_cast<int64_t>(r) * run);
      ops::normal_fill(param.value, first_R, run, seed, stream_key(param.name), sigma);
      return;
    }
  }
}

}  // namespace moecore
