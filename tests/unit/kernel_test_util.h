// Shared helpers for kernel tests (namespace moecore::test): deterministic random inputs, error metrics, and a central
// finite-difference gradient in double precision.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace moecore::test {

// n values uniform in [lo, hi), reproducible from seed (std::mt19937_64, independent of the code under test).
template <class T>
std::vector<T> random_vector(size_t n, uint64_t seed, T lo = T(-1), T hi = T(1)) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(static_cast<double>(lo), static_cast<double>(hi));
  std::vector<T> values(n);
  for (auto& v : values) v = static_cast<T>(dist(gen));
  return values;
}

// Converts a vector between floating types (e.g. float inputs to double for a reference computation).
template <class To, class From>
std::vector<To> convert_vector(const std::vector<From>& from) {
  return std::vector<To>(from.begin(), from.end());
}

// max_i |a_i - b_i| / max(|a_i|, |b_i|, floor). The floor keeps near-zero entries from dominating.
template <class TA, class TB>
double max_rel_error_impl(const TA* a, const TB* b, size_t n, double floor) {
  double worst = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(a[i]);
    const double y = static_cast<double>(b[i]);
    if (std::isnan(x) != std::isnan(y)) return INFINITY;
    if (std::isnan(x)) continue;
    const double scale = std::max({std::abs(x), std::abs(y), floor});
    worst = std::max(worst, std::abs(x - y) / scale);
  }
  return worst;
}

inline double max_rel_error(const float* a, const float* b, size_t n, double floor = 1e-6) {
  return max_rel_error_impl(a, b, n, floor);
}
inline double max_rel_error(const double* a, const double* b, size_t n, double floor = 1e-6) {
  return max_rel_error_impl(a, b, n, floor);
}
inline double max_rel_error(const float* a, const double* b, size_t n, double floor = 1e-6) {
  return max_rel_error_impl(a, b, n, floor);
}
template <class T>
double max_rel_error(const std::vector<T>& a, const std::vector<T>& b, double floor = 1e-6) {
  if (a.size() != b.size()) return INFINITY;
  return max_rel_error(a.data(), b.data(), a.size(), floor);
}

// max_i |a_i - b_i|.
template <class T>
double max_abs_error(const T* a, const T* b, size_t n) {
  double worst = 0.0;
  for (size_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
  return worst;
}

// Central differences: grad_i = (f(x + eps e_i) - f(x - eps e_i)) / (2 eps). Truncation error is
// O(eps^2 f'''), rounding error O(ulp(f) / eps); eps = 1e-6 balances both to ~1e-9 relative for O(1) inputs.
inline std::vector<double> numeric_grad(std::function<double(const std::vector<double>&)> f, std::vector<double> x,
                                        double eps = 1e-6) {
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double f_plus = f(x);
    x[i] = saved - eps;
    const double f_minus = f(x);
    x[i] = saved;
    grad[i] = (f_plus - f_minus) / (2.0 * eps);
  }
  return grad;
}

// sum_i a_i * w_i in double: the scalar "loss" whose gradient wrt out is w, used to test backward kernels.
template <class T>
double weighted_sum(const std::vector<T>& a, const std::vector<T>& w) {
  double total = 0.0;
  for (size_t i = 0; i < a.size(); ++i) total += static_cast<double>(a[i]) * static_cast<double>(w[i]);
  return total;
}

}  // namespace moecore::test
