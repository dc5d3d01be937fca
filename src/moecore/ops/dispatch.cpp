#include "moecore/ops/dispatch.h"

namespace moecore::ops::detail {

void fail(const char* op, const std::string& what) { throw std::invalid_argument(std::string(op) + ": " + what); }

namespace {
// bf16 / fp16 activations are staged to fp32 for the kernels (staging.h).
DType storage_class(const DType dtype) { return is_16bit(dtype) ? DType::kF32 : dtype; }
}  // namespace

void check_tensors(const char* op, const std::initializer_list<const Tensor*> tensors) {
  const Tensor* first = nullptr;
  for (const Tensor* t : tensors) {
    if (t == nullptr) continue;
    if (!t->defined()) fail(op, "an argument tensor is undefined");
    if (first == nullptr) {
      first = t;
      continue;
    }
    if (storage_class(t->dtype()) != storage_class(first->dtype())) {
      fail(op,
           "mixed dtypes " + std::string(dtype_name(first->dtype())) + " and " + std::string(dtype_name(t->dtype())));
    }
    if (t->device() != first->device()) fail(op, "tensors on different devices");
  }
}

void check_numel(const char* op, const char* name, const Tensor& t, const int64_t expected) {
  if (t.numel() != expected) {
    fail(op, std::string(name) + " is " + t.shape_str() + " (" + std::to_string(t.numel()) + " elements), expected " +
                 std::to_string(expected) + " elements");
  }
}

}  // namespace moecore::ops::detail
