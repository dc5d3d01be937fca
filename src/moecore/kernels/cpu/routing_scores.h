// Scalar score functions of the routing kernels (routing.h), shared by the fast and the reference ones. Internal to
// kernels/cpu.
#pragma once

#include <cmath>

#include "moecore/kernels/cpu/routing.h"

namespace moecore::kernels::routing_scores {

inline double to_fp32(const double value) { return static_cast<double>(static_cast<float>(value)); }

// torch.nn.functional.softplus (beta 1, threshold 20: x itself above 20) and its derivative.
inline double sigmoid(const double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double z = std::exp(x);
  return z / (1.0 + z);
}
inline double softplus(const double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
inline double softplus_grad(const double x) { return x > 20.0 ? 1.0 : sigmoid(x); }

// The elementwise score of sigmoid / sqrtsoftplus routing, and d(score)/d(logit) given the score.
inline double pointwise(const RoutingScore fn, const double logit) {
  if (fn == RoutingScore::kSqrtSoftplus) return std::sqrt(softplus(logit));
  return sigmoid(logit);
}
inline double pointwise_grad(const RoutingScore fn, const double logit, const double score) {
  if (fn == RoutingScore::kSqrtSoftplus) return score > 0 ? softplus_grad(logit) / (2.0 * score) : 0.0;
  return score * (1.0 - score);
}
// pointwise() evaluated on the logit rounded to fp32 and rounded to fp32 (fp32) or in double.
inline double pointwise_scored(const RoutingScore fn, const double logit, const bool fp32) {
  return fp32 ? to_fp32(pointwise(fn, to_fp32(logit))) : pointwise(fn, logit);
}

}  // namespace moecore::kernels::routing_scores
