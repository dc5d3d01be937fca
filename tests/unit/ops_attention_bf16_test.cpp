// Who asks for the attention's bf16 products (ops/attention.cpp): under bf16 activations the attention ops of both
// devices run their kernel with AttentionDims::bf16_products as attention_product_path() says (the reference rounds the
// same operands as the fast kernel, kernels_attention_bf16_test), and with fp32 products under fp16 activations, fp32
// activations or MOECORE_ATTENTION_PRODUCTS=fp32 (ScopedAttentionProductPath here). Each op's 16-bit output must be,
// bit for bit, its device's kernel called directly with that flag on the same values and rounded once.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/attention.h"
#include "moecore/kernels/cpu/attention_products.h"
#include "moecore/ops/attention.h"
#include "moecore/ops/precision.h"
#include "moecore/tensor/dtype.h"
#include "unit/kernel_test_util.h"

namespace moecore::ops {
namespace {

using kernels::cpu::AttentionProductPath;
using kernels::cpu::ScopedAttentionProductPath;

constexpr int64_t kS = 40, kB = 2, kN = 4, kG = 2, kD = 64;

uint16_t bits_of(const float x, const DType dtype) { return dtype == DType::kBF16 ? fp32_to_bf16(x) : fp32_to_fp16(x); }
float value_of(const uint16_t bits, const DType dtype) {
  return dtype == DType::kBF16 ? bf16_to_fp32(bits) : fp16_to_fp32(bits);
}

// Random values representable in `dtype`, in [-bound, bound).
std::vector<float> values(const size_t n, const uint64_t seed, const float bound, const DType dtype) {
  std::vector<float> x = test::random_vector<float>(n, seed, -bound, bound);
  for (float& v : x) v = value_of(bits_of(v, dtype), dtype);
  return x;
}

Tensor tensor_of(const std::vector<int64_t>& shape, const std::vector<float>& x, const DType dtype,
                 const Device device) {
  Tensor t(shape, dtype, MemCategory::kOther, device);
  for (size_t i = 0; i < x.size(); ++i) {
    if (dtype == DType::kF32) {
      t.data<float>()[i] = x[i];
    } else {
      t.data<uint16_t>()[i] = bits_of(x[i], dtype);
    }
  }
  return t;
}

std::vector<float> floats_of(const Tensor& t) {
  std::vector<float> x(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = t.dtype() == DType::kF32 ? t.data<float>()[i] : value_of(t.data<uint16_t>()[i], t.dtype());
  }
  return x;
}

AttentionDims dims() {
  AttentionDims d;
  d.S = kS;
  d.B = kB;
  d.N = kN;
  d.G = kG;
  d.head_dim = kD;
  d.scale = 1.0 / std::sqrt(static_cast<double>(kD));
  return d;
}

struct Outputs {
  std::vector<float> out, dq, dk, dv;
};

// The ops on `device` under activation dtype `dtype` (tensors of that dtype).
Outputs run_ops(const DType dtype, const Device device) {
  const size_t q_n = kS * kB * kN * kD, kv_n = kS * kB * kG * kD;
  Tensor q = tensor_of({kS, kB, kN, kD}, values(q_n, 1, 2.0f, dtype), dtype, device);
  Tensor k = tensor_of({kS, kB, kG, kD}, values(kv_n, 2, 2.0f, dtype), dtype, device);
  Tensor v = tensor_of({kS, kB, kG, kD}, values(kv_n, 3, 1.0f, dtype), dtype, device);
  Tensor dout = tensor_of({kS, kB, kN, kD}, values(q_n, 4, 1.0f, dtype), dtype, device);
  Tensor out({kS, kB, kN, kD}, dtype, MemCategory::kOther, device),
      lse({kB, kN, kS}, DType::kF32, MemCategory::kOther, device);
  Tensor dq = tensor_of({kS, kB, kN, kD}, std::vector<float>(q_n, 0.0f), dtype, device);
  Tensor dk = tensor_of({kS, kB, kG, kD}, std::vector<float>(kv_n, 0.0f), dtype, device);
  Tensor dv = tensor_of({kS, kB, kG, kD}, std::vector<float>(kv_n, 0.0f), dtype, device);
  const ScopedActivationDType precision(dtype, device);
  attention_forward(out, lse, q, k, v, dims(), DropoutSpec{});
  attention_backward(dq, dk, dv, dout, q, k, v, out, lse, dims(), DropoutSpec{});
  return {floats_of(out), floats_of(dq), floats_of(dk), floats_of(dv)};
}

// The device's kernels called directly on the same values with bf16_products = `bf16`, each output rounded once to
// `dtype` (backward from the rounded out, as the op's).
Outputs run_kernels(const DType dtype, const Device device, const bool bf16) {
  const size_t q_n = kS * kB * kN * kD, kv_n = kS * kB * kG * kD;
  const std::vector<float> q = values(q_n, 1, 2.0f, dtype), k = values(kv_n, 2, 2.0f, dtype),
                           v = values(kv_n, 3, 1.0f, dtype), dout = values(q_n, 4, 1.0f, dtype);
  AttentionDims d = dims();
  d.bf16_products = bf16;
  std::vector<float> out(q_n), lse(kB * kN * kS), dq(q_n), dk(kv_n), dv(kv_n);
  const bool fast = device == Device::kCPU;
  (fast ? kernels::cpu::attention_forward<float> : kernels::ref::attention_forward<float>)(out.data(), lse.data(),
                                                                                           q.data(), k.data(), v.data(),
                                                                                           d, DropoutSpec{});
  auto round_all = [dtype](std::vector<float>& x) {
    for (float& e : x) e = value_of(bits_of(e, dtype), dtype);
  };
  round_all(out);
  (fast ? kernels::cpu::attention_backward<float>
        : kernels::ref::attention_backward<float>)(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                                                   v.data(), out.data(), lse.data(), d, DropoutSpec{});
  round_all(dq);
  round_all(dk);
  round_all(dv);
  return {out, dq, dk, dv};
}

void expect_same(const Outputs& got, const Outputs& want, const std::string& what) {
  EXPECT_EQ(got.out, want.out) << what << ": out";
  EXPECT_EQ(got.dq, want.dq) << what << ": dq";
  EXPECT_EQ(got.dk, want.dk) << what << ": dk";
  EXPECT_EQ(got.dv, want.dv) << what << ": dv";
}

TEST(OpsAttentionBf16, OpsPassTheProductPathToTheirKernels) {
  for (const Device device : {Device::kCPU, Device::kReference}) {
    const std::string where(device_name(device));
    {
      const ScopedAttentionProductPath bf16(AttentionProductPath::kBF16);
      const Outputs got = run_ops(DType::kBF16, device);
      expect_same(got, run_kernels(DType::kBF16, device, true), where + " bf16 activations, bf16 products");
      // A check that can fail: the products' rounding shows in the outputs.
      EXPECT_NE(got.dq, run_kernels(DType::kBF16, device, false).dq) << where;
      // fp16 activations never take bf16 products.
      expect_same(run_ops(DType::kF16, device), run_kernels(DType::kF16, device, false), where + " fp16 activations");
    }
    {
      const ScopedAttentionProductPath fp32(AttentionProductPath::kF32);
      expect_same(run_ops(DType::kBF16, device), run_kernels(DType::kBF16, device, false),
                  where + " bf16 activations, fp32 products");
    }
  }
}

}  // namespace
}  // namespace moecore::ops
