// A named buffer: model state that is not trained by the optimizer but is part of the model (PyTorch's
// register_buffer, Megatron's buffers), e.g. the router's aux-loss-free balancing bias
// "decoder.layers.{i}.mlp.router.expert_bias" [E] fp32. Modules register buffers into the model's BufferStore in
// their constructors and keep references to them, exactly as parameters.
#pragma once

#include <string>
#include <vector>

#include "moecore/model/param.h"
#include "moecore/tensor/tensor.h"

namespace moecore {

struct Buffer {
  std::string name;
  Tensor value;      // MemCategory::kParams
  ParamShard shard;  // where this rank's tensor sits in the one-process tensor (num_shards 1: replicated)
};

// The model's buffers in registration order; a registered Buffer never moves (model/stable_store.h).
using BufferStore = StableStore<Buffer>;

// A zero-filled, replicated buffer of `shape` and `dtype`.
Buffer make_buffer(std::string name, const std::vector<int64_t>& shape, DType dtype = DType::kF32);

}  // namespace moecore
