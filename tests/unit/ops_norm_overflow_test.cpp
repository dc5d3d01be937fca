// The norm ops report rows whose statistics are not finite: a finite row whose sum of squares (LayerNorm: variance,
// or mean) overflows the type gets rstd 1 / sqrt(Inf) = 0 and an output of zeros, which nothing after it notices.
// Every device (the CPU at 1 and 2 OpenMP threads, the reference) and both types count the same rows.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "moecore/ops/norm.h"

namespace moecore::ops {
namespace {

constexpr int64_t kD = 64;

// Rows of width kD, every element of row r equal to values[r] times (-1)^d (LayerNorm's mean 0, variance v^2).
template <typename T>
Tensor alternating_rows(const std::vector<double>& values) {
  Tensor x({static_cast<int64_t>(values.size()), kD}, std::is_same_v<T, float> ? DType::kF32 : DType::kF64);
  T* data = x.data<T>();
  for (size_t r = 0; r < values.size(); ++r) {
    for (int64_t d = 0; d < kD; ++d) data[r * kD + d] = static_cast<T>(d % 2 == 0 ? values[r] : -values[r]);
  }
  return x;
}

template <typename T>
Tensor ones(const int64_t n) {
  Tensor w({n}, std::is_same_v<T, float> ? DType::kF32 : DType::kF64);
  for (T& v : w.span<T>()) v = T(1);
  return w;
}

struct NormRun {
  int64_t nonfinite_rows = 0;
  std::vector<double> rstd;
  std::vector<double> out_row0;
};

template <typename T>
NormRun forward_rows(const bool layernorm, const Tensor& x) {
  const int64_t R = x.numel() / kD;
  const DType dtype = x.dtype();
  const Device device = x.device();
  Tensor out({R, kD}, dtype, MemCategory::kOther, device), mean({R}, dtype, MemCategory::kOther, device),
      rstd({R}, dtype, MemCategory::kOther, device);
  const Tensor w = ones<T>(kD).to(device);
  Tensor bias({kD}, dtype, MemCategory::kOther, device);
  for (T& v : bias.span<T>()) v = T(0);
  NormRun result;
  result.nonfinite_rows =
      layernorm ? layernorm_forward(out, mean, rstd, x, w, &bias, 1e-5) : rmsnorm_forward(out, rstd, x, w, 1e-5);
  for (const T v : rstd.span<const T>()) result.rstd.push_back(static_cast<double>(v));
  for (int64_t d = 0; d < kD; ++d) result.out_row0.push_back(static_cast<double>(out.data<T>()[d]));
  return result;
}

struct Backends {
  const char* name;
  Device device;
  int threads;
};
constexpr Backends kBackends[] = {
    {"cpu 1 thread", Device::kCPU, 1}, {"cpu 2 threads", Device::kCPU, 2}, {"reference", Device::kReference, 1}};

class OpsNormOverflow : public ::testing::TestWithParam<bool> {};  // LayerNorm?

TEST_P(OpsNormOverflow, Fp32RowsBeyondTheRangeAreCountedAndOutputZeros) {
  const bool layernorm = GetParam();
  // 1e20^2 * 64 overflows fp32 (3.4e38); 1e18^2 * 64 = 6.4e37 does not; 1 is ordinary.
  const Tensor x = alternating_rows<float>({1e20, 1.0, 1e18, 1e20});
  for (const Backends& b : kBackends) {
    SCOPED_TRACE(b.name);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(b.threads);
    const NormRun r = forward_rows<float>(layernorm, x.to(b.device));
    omp_set_num_threads(threads);
    EXPECT_EQ(r.nonfinite_rows, 2);
    // What makes it silent: rstd 0 and a finite output of zeros.
    EXPECT_EQ(r.rstd[0], 0.0);
    for (const double v : r.out_row0) EXPECT_EQ(v, 0.0);
    EXPECT_GT(r.rstd[2], 0.0);
  }
}

TEST_P(OpsNormOverflow, Fp64HoldsWhatOverflowsFp32) {
  const Tensor x = alternating_rows<double>({1e20, 1.0});
  for (const Backends& b : kBackends) {
    SCOPED_TRACE(b.name);
    EXPECT_EQ(forward_rows<double>(GetParam(), x.to(b.device)).nonfinite_rows, 0);
  }
  const Tensor huge = alternating_rows<double>({1e160, 1.0});  // 1e320 overflows fp64
  for (const Backends& b : kBackends) {
    SCOPED_TRACE(b.name);
    EXPECT_EQ(forward_rows<double>(GetParam(), huge.to(b.device)).nonfinite_rows, 1);
  }
}

TEST_P(OpsNormOverflow, ManyRowsOnTheParallelPath) {
  // 512 x 64 elements: above the fast kernels' threshold for OpenMP threads; every third row overflows.
  std::vector<double> values;
  for (int r = 0; r < 512; ++r) values.push_back(r % 3 == 0 ? 3e19 : 0.5);
  const Tensor x = alternating_rows<float>(values);
  for (const Backends& b : kBackends) {
    SCOPED_TRACE(b.name);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(b.threads);
    EXPECT_EQ(forward_rows<float>(GetParam(), x.to(b.device)).nonfinite_rows, 171);
    omp_set_num_threads(threads);
  }
}

TEST(OpsNormOverflowLayerNorm, AnOverflowingMeanIsCountedAndAConstantHugeRowIsNot) {
  // Every element 3e38: the sum overflows, so the mean is Inf. Every element 1e20: mean 1e20, variance 0, finite.
  Tensor x({2, kD}, DType::kF32);
  float* data = x.data<float>();
  for (int64_t d = 0; d < kD; ++d) {
    data[d] = 3e38f;
    data[kD + d] = 1e20f;
  }
  for (const Backends& b : kBackends) {
    SCOPED_TRACE(b.name);
    EXPECT_EQ(forward_rows<float>(true, x.to(b.device)).nonfinite_rows, 1);
  }
}

TEST(OpsNormOverflowRMSNorm, NonFiniteInputRowsAreCountedToo) {
  Tensor x = alternating_rows<float>({1.0, 1.0});
  x.data<float>()[kD + 3] = std::numeric_limits<float>::quiet_NaN();
  for (const Backends& b : kBackends) {
    SCOPED_TRACE(b.name);
    EXPECT_EQ(forward_rows<float>(false, x.to(b.device)).nonfinite_rows, 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Norms, OpsNormOverflow, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& param) {
                           return std::string(param.param ? "LayerNorm" : "RMSNorm");
                         });

}  // namespace
}  // namespace moecore::ops
