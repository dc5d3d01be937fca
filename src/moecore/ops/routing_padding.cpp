#include "moecore/ops/routing_padding.h"

#include <string>

#include "moecore/ops/dispatch.h"

namespace moecore::ops {

void pad_routing_map(Tensor& map_TE, Tensor& counts_E, const int64_t multiple) {
  constexpr const char* op = "pad_routing_map";
  const auto check = [&](const Tensor& t, const char* name, const DType dtype) {
    if (!t.defined()) detail::fail(op, std::string(name) + " is undefined");
    if (t.dtype() != dtype) {
      detail::fail(op, std::string(name) + " is " + std::string(dtype_name(t.dtype())) + ", expected " +
                           std::string(dtype_name(dtype)));
    }
  };
  check(map_TE, "map_TE", DType::kU8);
  check(counts_E, "counts_E", DType::kI64);
  if (map_TE.ndim() != 2) detail::fail(op, "map_TE must be 2-D, got " + map_TE.shape_str());
  if (counts_E.device() != map_TE.device()) {
    detail::fail(op, "counts_E is on " + std::string(device_name(counts_E.device())) + ", map_TE on " +
                         std::string(device_name(map_TE.device())));
  }
  if (multiple < 1) detail::fail(op, "the multiple must be positive, got " + std::to_string(multiple));
  const int64_t T = map_TE.dim(0), E = map_TE.dim(1);
  detail::check_numel(op, "counts_E", counts_E, E);
  detail::with_kernels(op, map_TE.device(), [&](auto k) {
    k.pad_routing_map(map_TE.data<uint8_t>(), counts_E.data<int64_t>(), T, E, multiple);
  });
}

}  // namespace moecore::ops
