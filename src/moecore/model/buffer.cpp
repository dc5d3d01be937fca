#include "moecore/model/buffer.h"

#include <utility>

namespace moecore {

Buffer make_buffer(std::string name, const std::vector<int64_t>& shape, const DType dtype) {
  Buffer b;
  b.name = std::move(name);
  b.value = Tensor(shape, dtype, MemCategory::kParams);
  b.value.zero_();
  b.shard.full_shape = shape;
  return b;
}

}  // namespace moecore
