#include "moecore/model/buffer.h"

#include <stdexcept>
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

Buffer* find_buffer(BufferStore& buffers, const std::string& name) {
  for (Buffer& b : buffers) {
    if (b.name == name) return &b;
  }
  throw std::logic_error("buffer " + name + " was not registered");
}

}  // namespace moecore
