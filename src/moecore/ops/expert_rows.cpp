#include "moecore/ops/expert_rows.h"

#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/ops/dispatch.h"

namespace moecore::ops {

void expert_major_rows(Tensor& token_R, Tensor& probs_R, const Tensor& map_TE, const Tensor& probs_TE,
                       const int64_t e_begin, const std::span<const int64_t> rows_X, const int64_t capacity) {
  constexpr const char* op = "expert_major_rows";
  detail::check_tensors(op, {&probs_TE, &probs_R});
  const auto check = [&](const Tensor& t, const char* name, const DType dtype) {
    if (!t.defined()) detail::fail(op, std::string(name) + " is undefined");
    if (t.dtype() != dtype) {
      detail::fail(op, std::string(name) + " is " + std::string(dtype_name(t.dtype())) + ", expected " +
                           std::string(dtype_name(dtype)));
    }
    if (t.device() != probs_TE.device()) {
      detail::fail(op, std::string(name) + " is on " + std::string(device_name(t.device())) + ", probs_TE on " +
                           std::string(device_name(probs_TE.device())));
    }
  };
  check(map_TE, "map_TE", DType::kU8);
  check(token_R, "token_R", DType::kI64);
  if (map_TE.ndim() != 2) detail::fail(op, "map_TE must be 2-D, got " + map_TE.shape_str());
  const int64_t num_tokens = map_TE.dim(0), E = map_TE.dim(1), X = static_cast<int64_t>(rows_X.size());
  if (e_begin < 0 || e_begin + X > E) {
    detail::fail(op, "experts [" + std::to_string(e_begin) + ", " + std::to_string(e_begin + X) + ") outside [0, " +
                         std::to_string(E) + ")");
  }
  detail::check_numel(op, "probs_TE", probs_TE, num_tokens * E);
  int64_t R = 0;
  for (const int64_t rows : rows_X) {
    if (rows < 0) detail::fail(op, "negative row count " + std::to_string(rows));
    R += rows;
  }
  detail::check_numel(op, "token_R", token_R, R);
  detail::check_numel(op, "probs_R", probs_R, R);

  std::vector<int64_t> routed_X(static_cast<size_t>(X));
  detail::with_kernels(op, map_TE.device(), [&](auto k) {
    k.expert_routed_counts(routed_X.data(), map_TE.data<uint8_t>(), num_tokens, E, e_begin, e_begin + X);
  });
  for (int64_t x = 0; x < X; ++x) {
    const int64_t rows = rows_X[static_cast<size_t>(x)], routed = routed_X[static_cast<size_t>(x)];
    // Pad-to-capacity: the router reports C rows per expert while the map holds at most C tokens.
    if (rows != routed && (capacity < 0 || rows != capacity || routed > rows)) {
      throw std::invalid_argument("token dispatcher: expert " + std::to_string(e_begin + x) + " has " +
                                  std::to_string(routed) + " routed tokens but tokens_per_expert says " +
                                  std::to_string(rows) + " (capacity " + std::to_string(capacity) + ")");
    }
  }
  detail::dispatch(op, probs_TE, [&]<typename T>(auto k) {
    k.expert_major_rows(token_R.data<int64_t>(), detail::ptr<T>(probs_R), map_TE.data<uint8_t>(),
                        detail::ptr<T>(probs_TE), num_tokens, E, e_begin, e_begin + X, rows_X.data());
  });
}

}  // namespace moecore::ops
