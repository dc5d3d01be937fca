#include "moecore/ops/routing.h"

#include <cmath>
#include <string>

#include "moecore/ops/dispatch.h"

namespace moecore::ops {
using detail::fail;
using detail::opt;
using detail::ptr;

namespace {

// t is defined, of `dtype`, on the device of the op's other tensors (`like`).
void check_dtype(const char* op, const char* name, const Tensor& t, const DType dtype, const Tensor& like) {
  if (!t.defined()) fail(op, std::string(name) + " is undefined");
  if (t.dtype() != dtype) {
    fail(op, std::string(name) + " is " + std::string(dtype_name(t.dtype())) + ", expected " +
                 std::string(dtype_name(dtype)));
  }
  if (t.device() != like.device()) {
    fail(op, std::string(name) + " is on " + std::string(device_name(t.device())) + ", the other tensors on " +
                 std::string(device_name(like.device())));
  }
}

// A 2-D [rows, cols] tensor's sizes.
void matrix(const char* op, const char* name, const Tensor& t, int64_t& rows, int64_t& cols) {
  if (!t.defined() || t.ndim() != 2) fail(op, std::string(name) + " must be 2-D, got " + t.shape_str());
  rows = t.dim(0);
  cols = t.dim(1);
}

// The logits' [n, E] and the selection's k from idx_TK [n, k] (kI32), checked against each other.
void selection_sizes(const char* op, const Tensor& logits_TE, const Tensor& idx_TK, int64_t& n, int64_t& E,
                     int64_t& k) {
  detail::check_tensors(op, {&logits_TE});
  matrix(op, "logits_TE", logits_TE, n, E);
  check_dtype(op, "idx_TK", idx_TK, DType::kI32, logits_TE);
  int64_t rows = 0;
  matrix(op, "idx_TK", idx_TK, rows, k);
  if (rows != n) fail(op, "idx_TK has " + std::to_string(rows) + " rows for " + std::to_string(n) + " tokens");
  if (k < 1 || k > E) fail(op, "top-k " + std::to_string(k) + " outside [1, " + std::to_string(E) + "]");
}

void check_indices(const char* op, const Tensor& idx_TK, const int64_t E) {
  for (const int32_t e : idx_TK.span<int32_t>()) {
    if (e < 0 || e >= E) fail(op, "expert index " + std::to_string(e) + " outside [0, " + std::to_string(E) + ")");
  }
}

double switch_factor(const SwitchLossSpec& spec) {
  return static_cast<double>(spec.num_experts) * spec.coeff /
         (static_cast<double>(spec.topk) * spec.total_tokens * spec.total_tokens);
}

}  // namespace

void topk_routing_forward(Tensor& idx_TK, Tensor& probs_TK, const Tensor& logits_TE, const Tensor* bias_E,
                          const Tensor* select_TE, const TopkRoutingSpec& spec) {
  constexpr const char* op = "topk_routing_forward";
  int64_t n = 0, E = 0, k = 0;
  selection_sizes(op, logits_TE, idx_TK, n, E, k);
  detail::check_tensors(op, {&logits_TE, &probs_TK, select_TE});
  detail::check_numel(op, "probs_TK", probs_TK, n * k);
  if (select_TE != nullptr) detail::check_numel(op, "select_TE", *select_TE, n * E);
  if (bias_E != nullptr) {
    check_dtype(op, "bias_E", *bias_E, DType::kF32, logits_TE);
    detail::check_numel(op, "bias_E", *bias_E, E);
  }
  if (spec.group_topk > 0 && (spec.num_groups <= 0 || E % spec.num_groups != 0 || spec.group_topk > spec.num_groups ||
                              k < spec.group_topk || k > spec.group_topk * (E / spec.num_groups))) {
    fail(op,
         "group-limited top-k needs num_groups dividing the experts and group_topk <= k <= the experts of "
         "group_topk groups");
  }
  if (spec.given_selection) {
    if (spec.sinkhorn) fail(op, "a given selection (router replay) does not apply to sinkhorn routing");
  }
  if (spec.given_selection && idx_TK.device() == Device::kCPU) {
    const int32_t* ids = ptr<int32_t>(idx_TK);
    for (int64_t t = 0; t < n; ++t) {
      if (ids[t * k] < 0) continue;  // not recorded: selected from the scores
      for (int64_t i = 0; i < k; ++i) {
        const int32_t e = ids[t * k + i];
        if (e < 0 || e >= E)
          fail(op, "a given expert " + std::to_string(e) + " is outside [0, " + std::to_string(E) + ")");
        for (int64_t j = 0; j < i; ++j) {
          if (ids[t * k + j] == e) fail(op, "a given selection names expert " + std::to_string(e) + " twice");
        }
      }
    }
  }
  detail::dispatch(op, logits_TE, [&]<typename S>(auto kt) {
    kt.topk_routing_forward(ptr<int32_t>(idx_TK), ptr<S>(probs_TK), ptr<S>(logits_TE), opt<float>(bias_E),
                            opt<S>(select_TE), n, E, k, spec);
  });
}

void topk_routing_backward(Tensor& dlogits_TE, const Tensor& dprobs_TE, const Tensor* map_TE, const Tensor& idx_TK,
                           const Tensor& logits_TE, const TopkRoutingSpec& spec) {
  constexpr const char* op = "topk_routing_backward";
  int64_t n = 0, E = 0, k = 0;
  selection_sizes(op, logits_TE, idx_TK, n, E, k);
  detail::check_tensors(op, {&logits_TE, &dlogits_TE, &dprobs_TE});
  detail::check_numel(op, "dlogits_TE", dlogits_TE, n * E);
  detail::check_numel(op, "dprobs_TE", dprobs_TE, n * E);
  if (map_TE != nullptr) {
    check_dtype(op, "map_TE", *map_TE, DType::kU8, logits_TE);
    detail::check_numel(op, "map_TE", *map_TE, n * E);
  }
  check_indices(op, idx_TK, E);
  detail::dispatch(op, logits_TE, [&]<typename S>(auto kt) {
    kt.topk_routing_backward(ptr<S>(dlogits_TE), ptr<S>(dprobs_TE), opt<uint8_t>(map_TE), ptr<int32_t>(idx_TK),
                             ptr<S>(logits_TE), n, E, k, spec);
  });
}

void sinkhorn(Tensor& out_TE, const Tensor& logits_TE, const double tol) {
  constexpr const char* op = "sinkhorn";
  detail::check_tensors(op, {&out_TE, &logits_TE});
  int64_t n = 0, E = 0;
  matrix(op, "logits_TE", logits_TE, n, E);
  detail::check_numel(op, "out_TE", out_TE, n * E);
  if (out_TE.data<std::byte>() == logits_TE.data<std::byte>()) fail(op, "out_TE may not alias logits_TE");
  detail::dispatch(op, logits_TE,
                   [&]<typename S>(auto kt) { kt.sinkhorn(ptr<S>(out_TE), ptr<S>(logits_TE), n, E, tol); });
}

int64_t expert_capacity(const int64_t n, const int64_t k, const int64_t E, const double capacity_factor) {
  return static_cast<int64_t>(std::ceil((static_cast<double>(n * k) / static_cast<double>(E)) * capacity_factor));
}

void routing_map(Tensor& map_TE, Tensor& probs_TE, Tensor& counts_E, const Tensor& idx_TK, const Tensor& probs_TK,
                 const int64_t capacity, const RoutingDropPolicy policy, const bool pad) {
  constexpr const char* op = "routing_map";
  detail::check_tensors(op, {&probs_TE, &probs_TK});
  int64_t n = 0, E = 0, k = 0, rows = 0;
  matrix(op, "probs_TE", probs_TE, n, E);
  check_dtype(op, "idx_TK", idx_TK, DType::kI32, probs_TE);
  matrix(op, "idx_TK", idx_TK, rows, k);
  if (rows != n) fail(op, "idx_TK has " + std::to_string(rows) + " rows for " + std::to_string(n) + " tokens");
  detail::check_numel(op, "probs_TK", probs_TK, n * k);
  check_dtype(op, "map_TE", map_TE, DType::kU8, probs_TE);
  detail::check_numel(op, "map_TE", map_TE, n * E);
  check_dtype(op, "counts_E", counts_E, DType::kI64, probs_TE);
  detail::check_numel(op, "counts_E", counts_E, E);
  check_indices(op, idx_TK, E);
  detail::dispatch(op, probs_TE, [&]<typename S>(auto kt) {
    kt.routing_map(ptr<uint8_t>(map_TE), ptr<S>(probs_TE), ptr<int64_t>(counts_E), ptr<int32_t>(idx_TK),
                   ptr<S>(probs_TK), n, E, k, capacity, policy, pad);
  });
}

void aux_scores_forward(Tensor& scores_TE, Tensor& idx_TK, const Tensor& logits_TE, const RoutingScore score,
                        const bool fp32_scores) {
  constexpr const char* op = "aux_scores_forward";
  int64_t n = 0, E = 0, k = 0;
  selection_sizes(op, logits_TE, idx_TK, n, E, k);
  detail::check_tensors(op, {&logits_TE, &scores_TE});
  detail::check_numel(op, "scores_TE", scores_TE, n * E);
  detail::dispatch(op, logits_TE, [&]<typename S>(auto kt) {
    kt.aux_scores_forward(ptr<S>(scores_TE), ptr<int32_t>(idx_TK), ptr<S>(logits_TE), n, E, k, score, fp32_scores);
  });
}

void aux_scores_backward(Tensor& dlogits_TE, const Tensor& dscores_RE, const Tensor& scores_TE, const Tensor& logits_TE,
                         const RoutingScore score) {
  constexpr const char* op = "aux_scores_backward";
  detail::check_tensors(op, {&dlogits_TE, &dscores_RE, &scores_TE, &logits_TE});
  int64_t n = 0, E = 0, R = 0, width = 0;
  matrix(op, "logits_TE", logits_TE, n, E);
  matrix(op, "dscores_RE", dscores_RE, R, width);
  if (width != E || R < 1) {
    fail(op, "dscores_RE is " + dscores_RE.shape_str() + " for " + std::to_string(n) + " tokens of " +
                 std::to_string(E) + " experts");
  }
  detail::check_numel(op, "dlogits_TE", dlogits_TE, n * E);
  detail::check_numel(op, "scores_TE", scores_TE, n * E);
  detail::dispatch(op, logits_TE, [&]<typename S>(auto kt) {
    kt.aux_scores_backward(ptr<S>(dlogits_TE), ptr<S>(dscores_RE), R, ptr<S>(scores_TE), ptr<S>(logits_TE), n, E,
                           score);
  });
}

void aux_loss_sums(Tensor& sums_E, Tensor& sums_BE, Tensor& counts_BE, const Tensor& scores_TE, const Tensor& idx_TK,
                   const int64_t B) {
  constexpr const char* op = "aux_loss_sums";
  int64_t n = 0, E = 0, k = 0;
  selection_sizes(op, scores_TE, idx_TK, n, E, k);
  detail::check_tensors(op, {&scores_TE, &sums_E, &sums_BE, &counts_BE});
  if (B < 1 || n % B != 0) fail(op, std::to_string(n) + " tokens are not sequences of B = " + std::to_string(B));
  detail::check_numel(op, "sums_E", sums_E, E);
  detail::check_numel(op, "sums_BE", sums_BE, B * E);
  detail::check_numel(op, "counts_BE", counts_BE, B * E);
  check_indices(op, idx_TK, E);
  detail::dispatch(op, scores_TE, [&]<typename S>(auto kt) {
    kt.aux_loss_sums(ptr<S>(sums_E), ptr<S>(sums_BE), ptr<S>(counts_BE), ptr<S>(scores_TE), ptr<int32_t>(idx_TK), n, B,
                     E, k);
  });
}

double switch_loss(const Tensor& sums_J, const Tensor& counts_J, const SwitchLossSpec& spec) {
  constexpr const char* op = "switch_loss";
  detail::check_tensors(op, {&sums_J, &counts_J});
  const int64_t J = sums_J.numel();
  detail::check_numel(op, "counts_J", counts_J, J);
  double loss = 0.0;
  detail::dispatch(op, sums_J, [&]<typename S>(auto kt) {
    loss = kt.switch_loss(ptr<S>(sums_J), ptr<S>(counts_J), J, switch_factor(spec));
  });
  return loss;
}

void switch_loss_backward(Tensor& dsums_J, const Tensor& counts_J, const SwitchLossSpec& spec, const double dloss) {
  constexpr const char* op = "switch_loss_backward";
  detail::check_tensors(op, {&dsums_J, &counts_J});
  const int64_t J = dsums_J.numel();
  detail::check_numel(op, "counts_J", counts_J, J);
  detail::dispatch(op, dsums_J, [&]<typename S>(auto kt) {
    kt.switch_loss_backward(ptr<S>(dsums_J), ptr<S>(counts_J), J, switch_factor(spec), dloss);
  });
}

double z_loss_forward(Tensor& lse_T, const Tensor& logits_TE, const double coeff) {
  constexpr const char* op = "z_loss_forward";
  detail::check_tensors(op, {&lse_T, &logits_TE});
  int64_t n = 0, E = 0;
  matrix(op, "logits_TE", logits_TE, n, E);
  detail::check_numel(op, "lse_T", lse_T, n);
  double sum = 0.0;
  detail::dispatch(op, logits_TE,
                   [&]<typename S>(auto kt) { sum = kt.z_loss_forward(ptr<S>(lse_T), ptr<S>(logits_TE), n, E); });
  return n == 0 ? 0.0 : coeff * sum / static_cast<double>(n);
}

void z_loss_backward(Tensor& dlogits_TE, const Tensor& logits_TE, const Tensor& lse_T, const double coeff_scale) {
  constexpr const char* op = "z_loss_backward";
  detail::check_tensors(op, {&dlogits_TE, &logits_TE, &lse_T});
  int64_t n = 0, E = 0;
  matrix(op, "logits_TE", logits_TE, n, E);
  detail::check_numel(op, "dlogits_TE", dlogits_TE, n * E);
  detail::check_numel(op, "lse_T", lse_T, n);
  detail::dispatch(op, logits_TE, [&]<typename S>(auto kt) {
    kt.z_loss_backward(ptr<S>(dlogits_TE), ptr<S>(logits_TE), ptr<S>(lse_T), n, E, coeff_scale);
  });
}

void expert_bias_update(Tensor& bias_E, const Tensor& counts_E, const double rate) {
  constexpr const char* op = "expert_bias_update";
  detail::check_tensors(op, {&counts_E});
  check_dtype(op, "bias_E", bias_E, DType::kF32, counts_E);
  const int64_t E = bias_E.numel();
  detail::check_numel(op, "counts_E", counts_E, E);
  detail::dispatch(op, counts_E,
                   [&]<typename S>(auto kt) { kt.expert_bias_update(ptr<float>(bias_E), ptr<S>(counts_E), E, rate); });
}

}  // namespace moecore::ops
