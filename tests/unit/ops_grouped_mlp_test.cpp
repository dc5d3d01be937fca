// The fused grouped MLP (ops/grouped_mlp.h) beyond the op table (ops_backend_test runs its forward, backward,
// gradients and bad arguments on every device): under --bf16 / --fp16 it must round where the per-op sequence rounds,
// so on each device it equals, bit for bit, each expert's rows run through ops::linear, the activation ops,
// scale_rows and add_outer (GroupedMLP's path without the fused op); and it refuses what it does not fuse.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/ops/ops.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/quantization.h"
#include "unit/test_device.h"

namespace moecore::ops {
namespace {

using test::kDevices;
using test::tensor_on;
using test::TestDevice;

struct Problem {
  std::vector<int64_t> offsets_E1;
  int64_t H = 0, F = 0, F1 = 0;
  GroupedMlpSpec spec;
  bool bias = false;
  Tensor x, probs, dy;
  std::vector<Tensor> w1, b1, w2, b2;
};

Tensor random_tensor(std::vector<int64_t> shape, std::mt19937& gen, const float scale) {
  Tensor t = tensor_on(std::move(shape), DType::kF32);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = u(gen);
  return t;
}

Problem make_problem(const std::vector<int64_t>& rows_E, const GroupedMlpSpec spec, const bool bias) {
  std::mt19937 gen(11);
  Problem p;
  p.offsets_E1 = {0};
  for (const int64_t rows : rows_E) p.offsets_E1.push_back(p.offsets_E1.back() + rows);
  const int64_t R = p.offsets_E1.back();
  p.H = 24;
  p.F = 20;
  p.F1 = activation_input_width(spec.activation, p.F);
  p.spec = spec;
  p.bias = bias;
  p.x = random_tensor({R, p.H}, gen, 1.0f);
  p.probs = random_tensor({R}, gen, 1.0f);
  p.dy = random_tensor({R, p.H}, gen, 1.0f);
  for (size_t e = 0; e < rows_E.size(); ++e) {
    p.w1.push_back(random_tensor({p.F1, p.H}, gen, 0.3f));
    p.w2.push_back(random_tensor({p.H, p.F}, gen, 0.3f));
    if (!bias) continue;
    p.b1.push_back(random_tensor({p.F1}, gen, 0.3f));
    p.b2.push_back(random_tensor({p.H}, gen, 0.3f));
  }
  return p;
}

struct Result {
  Tensor y, fc1, act, xs, dx, dprobs;  // act: the activation, or h with the weighted SwiGLU
  std::vector<Tensor> dw1, db1, dw2, db2;
};

Result zero_result(const Problem& p) {
  const int64_t R = p.offsets_E1.back(), E = static_cast<int64_t>(p.w1.size());
  Result r;
  r.y = tensor_on({R, p.H}, DType::kF32);
  r.fc1 = tensor_on({R, p.F1}, DType::kF32);
  r.act = tensor_on({R, p.F}, DType::kF32);
  r.xs = tensor_on({R, p.H}, DType::kF32);
  r.dx = tensor_on({R, p.H}, DType::kF32);
  r.dprobs = tensor_on({R}, DType::kF32);
  for (int64_t e = 0; e < E; ++e) {
    r.dw1.push_back(tensor_on({p.F1, p.H}, DType::kF32));
    r.dw2.push_back(tensor_on({p.H, p.F}, DType::kF32));
    if (!p.bias) continue;
    r.db1.push_back(tensor_on({p.F1}, DType::kF32));
    r.db2.push_back(tensor_on({p.H}, DType::kF32));
  }
  return r;
}

bool weighted(const Problem& p) { return p.spec.activation == Activation::kSwiGLU && !p.spec.probs_on_input; }

template <typename T>
std::vector<T*> pointers(std::vector<Tensor>& tensors) {
  std::vector<T*> out;
  for (Tensor& t : tensors) out.push_back(&t);
  return out;
}

Result fused(Problem& p) {
  Result r = zero_result(p);
  const std::vector<const Tensor*> w1 = pointers<const Tensor>(p.w1), b1 = pointers<const Tensor>(p.b1),
                                   w2 = pointers<const Tensor>(p.w2), b2 = pointers<const Tensor>(p.b2);
  const GroupedMlpParams params{w1, b1, w2, b2};
  Tensor* act = weighted(p) ? nullptr : &r.act;
  Tensor* h = weighted(p) ? &r.act : nullptr;
  grouped_mlp_forward(r.y, r.fc1, act, h, &r.xs, p.x, p.probs, params, p.offsets_E1, p.spec);
  const std::vector<Tensor*> dw1 = pointers<Tensor>(r.dw1), db1 = pointers<Tensor>(r.db1),
                             dw2 = pointers<Tensor>(r.dw2), db2 = pointers<Tensor>(r.db2);
  grouped_mlp_backward(r.dx, r.dprobs, {dw1, db1, dw2, db2}, p.dy, p.x, &r.xs, r.fc1, act, h, p.probs, params,
                       p.offsets_E1, p.spec);
  return r;
}

// The activation and probability step as the MLP runs it (model/mlp.h).
void activation_and_probs(const Activation kind, Tensor& act, Tensor& h, const Tensor& fc1, const Tensor* probs) {
  activation_forward(kind, act, fc1);
  if (probs != nullptr) scale_rows(h, act, *probs);
}
void activation_and_probs_backward(const Activation kind, Tensor& dfc1, Tensor* dprobs, const Tensor& dh,
                                   const Tensor& fc1, const Tensor& act, const Tensor* probs) {
  if (probs == nullptr) {
    activation_backward(kind, dfc1, dh, fc1);
    return;
  }
  Tensor dact = tensor_on(act.shape(), DType::kF32);
  scale_rows_backward(&dact, dprobs, dh, act, *probs);
  activation_backward(kind, dfc1, dact, fc1);
}

// Each expert's rows through the single ops, in the order GroupedMLP runs them without the fused op.
Result per_op(Problem& p) {
  Result r = zero_result(p);
  const bool poi = p.spec.probs_on_input;
  for (size_t e = 0; e + 1 < p.offsets_E1.size(); ++e) {
    const int64_t b = p.offsets_E1[e], end = p.offsets_E1[e + 1], n = end - b;
    if (n == 0) continue;
    const Tensor probs = p.probs.slice_rows(b, end), x = p.x.slice_rows(b, end), dy = p.dy.slice_rows(b, end);
    Tensor xs = r.xs.slice_rows(b, end), fc1 = r.fc1.slice_rows(b, end), act = r.act.slice_rows(b, end);
    Tensor y = r.y.slice_rows(b, end);
    if (poi) scale_rows(xs, x, probs);
    const Tensor& in = poi ? xs : x;
    linear_forward(fc1, in, p.w1[e], p.bias ? &p.b1[e] : nullptr);
    Tensor h = act;
    if (weighted(p)) {
      weighted_swiglu_forward(h, fc1, probs);
    } else {
      if (!poi) h = tensor_on({n, p.F}, DType::kF32);
      activation_and_probs(p.spec.activation, act, h, fc1, poi ? nullptr : &probs);
    }
    linear_forward(y, h, p.w2[e], poi && p.bias ? &p.b2[e] : nullptr);
    if (!poi && p.bias) add_outer(y, probs, p.b2[e]);
    // backward
    Tensor dh = tensor_on({n, p.F}, DType::kF32), dfc1 = tensor_on({n, p.F1}, DType::kF32);
    Tensor dprobs = r.dprobs.slice_rows(b, end), dx = r.dx.slice_rows(b, end);
    linear_backward(&dh, nullptr, nullptr, dy, nullptr, p.w2[e]);
    if (!poi) {
      if (weighted(p)) {
        weighted_swiglu_backward(dfc1, dprobs, dh, fc1, probs);
      } else {
        activation_and_probs_backward(p.spec.activation, dfc1, &dprobs, dh, fc1, act, &probs);
      }
      if (p.bias) add_outer_backward(&dprobs, nullptr, dy, probs, p.b2[e]);
      linear_backward(&dx, nullptr, nullptr, dfc1, nullptr, p.w1[e]);
    } else {
      activation_and_probs_backward(p.spec.activation, dfc1, nullptr, dh, fc1, act, nullptr);
      Tensor dxs = tensor_on({n, p.H}, DType::kF32);
      linear_backward(&dxs, nullptr, nullptr, dfc1, nullptr, p.w1[e]);
      scale_rows_backward(&dx, &dprobs, dxs, x, probs);
    }
    linear_backward(nullptr, &r.dw1[e], p.bias ? &r.db1[e] : nullptr, dfc1, &in, p.w1[e]);
    Tensor h2 = act;
    if (!weighted(p) && !poi) {
      h2 = tensor_on({n, p.F}, DType::kF32);
      scale_rows(h2, act, probs);
    }
    linear_backward(nullptr, &r.dw2[e], poi && p.bias ? &r.db2[e] : nullptr, dy, &h2, p.w2[e]);
    if (!poi && p.bias) add_outer_backward(nullptr, &r.db2[e], dy, probs, p.b2[e]);
  }
  return r;
}

void expect_identical(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  for (int64_t i = 0; i < got.numel(); ++i) {
    ASSERT_EQ(got.data<float>()[i], want.data<float>()[i]) << what << "[" << i << "]";
  }
}

TEST(OpsGroupedMlp, SixteenBitRoundingIsThePerOpSequences) {
  // One thread: the per-op sequence's GEMMs then run as the fused kernel's do. The convert path: the native 16-bit
  // GEMMs are not fused.
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const kernels::cpu::ScopedLowpGemmPath convert(kernels::cpu::LowpGemmPath::kConvert);
  const std::vector<std::pair<GroupedMlpSpec, bool>> specs = {{{Activation::kSwiGLU, false}, true},
                                                              {{Activation::kGelu, false}, true},
                                                              {{Activation::kSquaredReLU, true}, true},
                                                              {{Activation::kSwiGLU, true}, false},
                                                              {{Activation::kGelu, true}, false}};
  for (const Device device : kDevices) {
    const TestDevice on(device);
    for (const DType dtype : {DType::kBF16, DType::kF16}) {
      for (const auto& [spec, bias] : specs) {
        Problem p = make_problem({37, 0, 90, 5}, spec, bias);
        const ScopedActivationDType precision(dtype, device);
        const Result got = fused(p), want = per_op(p);
        const std::string what = std::string(device_name(device)) + " " + std::string(dtype_name(dtype)) +
                                 " activation " + std::to_string(static_cast<int>(spec.activation)) +
                                 (spec.probs_on_input ? " probs on input" : "") + (bias ? " bias" : "") + ": ";
        expect_identical(got.y, want.y, what + "y");
        expect_identical(got.fc1, want.fc1, what + "fc1");
        expect_identical(got.act, want.act, what + "act / h");
        if (spec.probs_on_input) expect_identical(got.xs, want.xs, what + "xs");
        expect_identical(got.dx, want.dx, what + "dx");
        expect_identical(got.dprobs, want.dprobs, what + "dprobs");
        for (size_t e = 0; e < p.w1.size(); ++e) {
          expect_identical(got.dw1[e], want.dw1[e], what + "dw1");
          expect_identical(got.dw2[e], want.dw2[e], what + "dw2");
          if (!bias) continue;
          expect_identical(got.db1[e], want.db1[e], what + "db1");
          expect_identical(got.db2[e], want.db2[e], what + "db2");
        }
        if (::testing::Test::HasFatalFailure()) break;
      }
    }
  }
  omp_set_num_threads(threads);
}

// The largest |got - want| over the largest |want|.
double relative_max_error(const Tensor& got, const Tensor& want) {
  double err = 0.0, scale = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(got.data<float>()[i]) - want.data<float>()[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want.data<float>()[i])));
  }
  return scale == 0.0 ? err : err / scale;
}

TEST(OpsGroupedMlp, NativeSixteenBitGemmsMatchTheReference) {
  // The fast kernel's GEMMs on the operands' bf16 bits (oneDNN's matmul, rows padded to its quantum) against the
  // reference device (naive fp32 GEMMs on the same values). Both sum products of bf16 values in fp32, in different
  // orders: a rounding of an intermediate activation may land one bf16 ulp (2^-8 relative) apart, which the next
  // GEMM carries at most at that relative size of its largest output; 2^-7 of the largest element bounds it. An
  // operand misread (layout, padding, accumulation) is off by O(1).
  if (!kernels::cpu::lowp_native_available(kernels::LowpType::kBF16)) {
    GTEST_SKIP() << "this CPU has no native bf16 GEMMs";
  }
  const kernels::cpu::ScopedLowpGemmPath native(kernels::cpu::LowpGemmPath::kNative);
  const std::vector<std::pair<GroupedMlpSpec, bool>> specs = {{{Activation::kSwiGLU, false}, false},
                                                              {{Activation::kGelu, false}, true},
                                                              {{Activation::kSquaredReLU, true}, true},
                                                              {{Activation::kSwiGLU, true}, false}};
  // Experts of 37, 0, 90, 300 (two tiles) and 5 rows: padded rows, an idle expert, a split expert.
  const std::vector<int64_t> rows_E = {37, 0, 90, 300, 5};
  const auto run = [&](const Device device, const std::pair<GroupedMlpSpec, bool>& spec) {
    const TestDevice on(device);
    Problem p = make_problem(rows_E, spec.first, spec.second);
    for (Tensor* t : {&p.x, &p.dy}) round_to_dtype_(*t, DType::kBF16);
    for (auto* ws : {&p.w1, &p.w2}) {
      for (Tensor& w : *ws) round_to_dtype_(w, DType::kBF16);
    }
    const ScopedActivationDType precision(DType::kBF16, device);
    return fused(p);
  };
  for (const auto& spec : specs) {
    const Result got = run(Device::kCPU, spec), want = run(Device::kReference, spec);
    const std::string what = "activation " + std::to_string(static_cast<int>(spec.first.activation)) +
                             (spec.first.probs_on_input ? " probs on input" : "") + (spec.second ? " bias" : "") + ": ";
    constexpr double kBound = 1.0 / 128;
    EXPECT_LE(relative_max_error(got.y, want.y), kBound) << what << "y";
    EXPECT_LE(relative_max_error(got.fc1, want.fc1), kBound) << what << "fc1";
    EXPECT_LE(relative_max_error(got.act, want.act), kBound) << what << "act / h";
    EXPECT_LE(relative_max_error(got.dx, want.dx), kBound) << what << "dx";
    EXPECT_LE(relative_max_error(got.dprobs, want.dprobs), kBound) << what << "dprobs";
    for (size_t e = 0; e < rows_E.size(); ++e) {
      EXPECT_LE(relative_max_error(got.dw1[e], want.dw1[e]), kBound) << what << "dw1 of expert " << e;
      EXPECT_LE(relative_max_error(got.dw2[e], want.dw2[e]), kBound) << what << "dw2 of expert " << e;
      if (!spec.second) continue;
      EXPECT_LE(relative_max_error(got.db1[e], want.db1[e]), kBound) << what << "db1 of expert " << e;
      EXPECT_LE(relative_max_error(got.db2[e], want.db2[e]), kBound) << what << "db2 of expert " << e;
    }
  }
}

// ---- the backward in two parts (--delay-wgrad-compute)

// A tensor of `dtype` holding t's values (rounded for 16-bit dtypes).
Tensor as_dtype(const Tensor& t, const DType dtype) {
  Tensor out = tensor_on(t.shape(), dtype);
  convert(out, t);
  return out;
}

bool sixteen_bit(const DType dtype) { return dtype == DType::kBF16 || dtype == DType::kF16; }

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.nbytes() == b.nbytes() &&
         std::equal(a.data<uint8_t>(), a.data<uint8_t>() + a.nbytes(), b.data<uint8_t>());
}

// One backward's tensors in the case's dtypes: activations (x, dy, the saved ones, dx) in `act`, probabilities and
// dprobs fp32 for 16-bit activations, parameters and gradients in `param`. dx and the gradients start from nonzero
// values (they accumulate), dprobs from garbage (overwritten).
struct BackwardCase {
  Problem* p;
  Tensor x, dy, probs, fc1, act, xs, dx, dprobs;
  std::vector<Tensor> w1, b1, w2, b2, dw1, db1, dw2, db2;

  BackwardCase(Problem& problem, const DType act_dtype, const DType param_dtype) : p(&problem) {
    const DType probs_dtype = sixteen_bit(act_dtype) ? DType::kF32 : act_dtype;
    std::mt19937 gen(5);
    x = as_dtype(p->x, act_dtype);
    dy = as_dtype(p->dy, act_dtype);
    probs = as_dtype(p->probs, probs_dtype);
    const int64_t R = p->offsets_E1.back();
    dx = as_dtype(random_tensor({R, p->H}, gen, 1.0f), act_dtype);
    dprobs = as_dtype(random_tensor({R}, gen, 100.0f), probs_dtype);
    const auto params = [&](const std::vector<Tensor>& from, std::vector<Tensor>& to, std::vector<Tensor>& grads) {
      for (const Tensor& t : from) {
        to.push_back(as_dtype(t, param_dtype));
        grads.push_back(as_dtype(random_tensor(t.shape(), gen, 1.0f), param_dtype));
      }
    };
    params(p->w1, w1, dw1);
    params(p->b1, b1, db1);
    params(p->w2, w2, dw2);
    params(p->b2, b2, db2);
    fc1 = tensor_on({R, p->F1}, act_dtype);
    act = tensor_on({R, p->F}, act_dtype);
    xs = tensor_on({R, p->H}, act_dtype);
    const std::vector<const Tensor*> pw1 = params_of(w1), pb1 = params_of(b1), pw2 = params_of(w2), pb2 = params_of(b2);
    Tensor y = tensor_on({R, p->H}, act_dtype);
    grouped_mlp_forward(y, fc1, weighted(*p) ? nullptr : &act, weighted(*p) ? &act : nullptr, &xs, x, probs,
                        {pw1, pb1, pw2, pb2}, p->offsets_E1, p->spec);
  }
  BackwardCase(const BackwardCase& other) = default;

  static std::vector<const Tensor*> params_of(const std::vector<Tensor>& ts) {
    std::vector<const Tensor*> out;
    for (const Tensor& t : ts) out.push_back(&t);
    return out;
  }
  // A copy whose outputs (dx, dprobs, the gradients) are tensors of their own.
  BackwardCase with_own_outputs() const {
    BackwardCase c = *this;
    c.dx = dx.clone();
    c.dprobs = dprobs.clone();
    for (auto* grads : {&c.dw1, &c.db1, &c.dw2, &c.db2}) {
      for (Tensor& g : *grads) g = g.clone();
    }
    return c;
  }
  // The backward, or one part of it (dx_RH, dprobs_R: the call's; undefined tensors for kWeights where asked).
  void backward(Tensor& dx_RH, Tensor& dprobs_R, const GroupedMlpBackwardSplit* split,
                std::span<const uint8_t> weights_zero_E = {}) {
    const std::vector<const Tensor*> pw1 = params_of(w1), pb1 = params_of(b1), pw2 = params_of(w2), pb2 = params_of(b2);
    const std::vector<Tensor*> gw1 = pointers<Tensor>(dw1), gb1 = pointers<Tensor>(db1), gw2 = pointers<Tensor>(dw2),
                               gb2 = pointers<Tensor>(db2);
    grouped_mlp_backward(dx_RH, dprobs_R, {gw1, gb1, gw2, gb2, weights_zero_E}, dy, x, &xs, fc1,
                         weighted(*p) ? nullptr : &act, weighted(*p) ? &act : nullptr, probs, {pw1, pb1, pw2, pb2},
                         p->offsets_E1, p->spec, split);
  }
  std::vector<const Tensor*> grads() const {
    std::vector<const Tensor*> out;
    for (const auto* grads : {&dw1, &db1, &dw2, &db2}) {
      for (const Tensor& g : *grads) out.push_back(&g);
    }
    return out;
  }
};

// kData then kWeights on one workspace gives every output of one whole call bit for bit: fp32 and fp64, and 16-bit
// activations (rounded fp32 tensors, and bf16 tensors: the 16-bit kernels on the CPU, the staging on the reference),
// on both GEMM paths, on each device; kData leaves the gradients untouched and kWeights dx and dprobs (undefined
// tensors, or tensors it must not write). Experts of 37, 0, 300 (two tiles) and 5 rows.
TEST(OpsGroupedMlp, SplitBackwardIsTheWholeBackwardBitForBit) {
  const std::vector<std::pair<GroupedMlpSpec, bool>> specs = {{{Activation::kSwiGLU, false}, true},
                                                              {{Activation::kGelu, false}, true},
                                                              {{Activation::kSwiGLU, true}, true},
                                                              {{Activation::kGelu, true}, false}};
  struct Precision {
    DType act, param, rounding;
    ActivationStorage storage;
  };
  const Precision precisions[] = {{DType::kF32, DType::kF32, DType::kF32, ActivationStorage::kF32},
                                  {DType::kF64, DType::kF64, DType::kF32, ActivationStorage::kF32},
                                  {DType::kF32, DType::kF32, DType::kBF16, ActivationStorage::kF32},
                                  {DType::kBF16, DType::kF32, DType::kBF16, ActivationStorage::k16Bit}};
  std::vector<kernels::cpu::LowpGemmPath> paths = {kernels::cpu::LowpGemmPath::kConvert};
  if (kernels::cpu::lowp_native_available(kernels::LowpType::kBF16)) {
    paths.push_back(kernels::cpu::LowpGemmPath::kNative);
  }
  for (const Device device : kDevices) {
    const TestDevice on(device);
    for (const kernels::cpu::LowpGemmPath path : paths) {
      const kernels::cpu::ScopedLowpGemmPath gemm(path);
      for (const Precision& precision : precisions) {
        const ScopedActivationDType scope(precision.rounding, device, precision.storage);
        for (const auto& [spec, bias] : specs) {
          Problem p = make_problem({37, 0, 300, 5}, spec, bias);
          const BackwardCase base(p, precision.act, precision.param);
          BackwardCase whole = base.with_own_outputs();
          whole.backward(whole.dx, whole.dprobs, nullptr);
          for (const bool undefined_outputs : {true, false}) {
            const std::string what =
                std::string(device_name(device)) + " " + std::string(kernels::cpu::lowp_gemm_path_name(path)) + " " +
                std::string(dtype_name(precision.act)) + " rounded to " + std::string(dtype_name(precision.rounding)) +
                " activation " + std::to_string(static_cast<int>(spec.activation)) +
                (spec.probs_on_input ? " probs on input" : "") + (bias ? " bias" : "") +
                (undefined_outputs ? "" : " defined outputs") + ": ";
            BackwardCase split = base.with_own_outputs();
            Tensor workspace =
                grouped_mlp_backward_workspace(split.dy,
                                               {BackwardCase::params_of(split.w1), BackwardCase::params_of(split.b1),
                                                BackwardCase::params_of(split.w2), BackwardCase::params_of(split.b2)},
                                               p.offsets_E1, spec);
            EXPECT_EQ(workspace.shape(), (std::vector<int64_t>{p.offsets_E1.back(), p.F1})) << what;
            EXPECT_EQ(workspace.dtype(), sixteen_bit(precision.act) ? DType::kF32 : precision.act) << what;
            EXPECT_EQ(workspace.device(), device) << what;
            const GroupedMlpBackwardSplit data{GroupedMlpBackwardPart::kData, &workspace};
            split.backward(split.dx, split.dprobs, &data);
            const std::vector<const Tensor*> start = base.grads(), after_data = split.grads();
            for (size_t i = 0; i < start.size(); ++i) {
              EXPECT_TRUE(same_bits(*after_data[i], *start[i])) << what << "kData changed gradient " << i;
            }
            const Tensor dx = split.dx.clone(), dprobs = split.dprobs.clone();
            const GroupedMlpBackwardSplit weights{GroupedMlpBackwardPart::kWeights, &workspace};
            Tensor none_dx, none_dprobs;
            if (undefined_outputs) {
              split.backward(none_dx, none_dprobs, &weights);
            } else {
              split.backward(split.dx, split.dprobs, &weights);
            }
            EXPECT_TRUE(same_bits(split.dx, dx)) << what << "kWeights changed dx";
            EXPECT_TRUE(same_bits(split.dprobs, dprobs)) << what << "kWeights changed dprobs";
            EXPECT_TRUE(same_bits(split.dx, whole.dx)) << what << "dx";
            EXPECT_TRUE(same_bits(split.dprobs, whole.dprobs)) << what << "dprobs";
            const std::vector<const Tensor*> got = split.grads(), want = whole.grads();
            for (size_t i = 0; i < got.size(); ++i) {
              EXPECT_TRUE(same_bits(*got[i], *want[i])) << what << "gradient " << i;
            }
            // The idle expert (1) keeps its starting gradients.
            EXPECT_TRUE(same_bits(split.dw1[1], base.dw1[1])) << what << "dw1 of the idle expert";
            EXPECT_TRUE(same_bits(split.dw2[1], base.dw2[1])) << what << "dw2 of the idle expert";
          }
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// Weight gradients known to be zero (GroupedMlpGrads::weights_zero_E, from Param::grad_zero) may be written instead of
// added to: the same bits as accumulating into the zeros, whole or split, on both GEMM paths and devices, with
// experts of 5, 37 and 300 rows (the rank update, its streaming overwrite, the oneDNN GEMM with beta 0) and an idle
// one whose flag is set but which has no rows (its gradient, zero, stays so).
TEST(OpsGroupedMlp, ZeroWeightGradientsAreWrittenAsAccumulated) {
  std::vector<kernels::cpu::LowpGemmPath> paths = {kernels::cpu::LowpGemmPath::kConvert};
  if (kernels::cpu::lowp_native_available(kernels::LowpType::kBF16)) {
    paths.push_back(kernels::cpu::LowpGemmPath::kNative);
  }
  const std::vector<uint8_t> all_zero = {1, 1, 1, 1};
  for (const Device device : kDevices) {
    const TestDevice on(device);
    for (const kernels::cpu::LowpGemmPath path : paths) {
      const kernels::cpu::ScopedLowpGemmPath gemm(path);
      for (const ActivationStorage storage : {ActivationStorage::kF32, ActivationStorage::k16Bit}) {
        const ScopedActivationDType scope(DType::kBF16, device, storage);
        const DType act = storage == ActivationStorage::k16Bit ? DType::kBF16 : DType::kF32;
        for (const bool bias : {false, true}) {
          Problem p = make_problem({37, 0, 300, 5}, {Activation::kSwiGLU, false}, bias);
          BackwardCase base(p, act, DType::kF32);
          for (auto* grads : {&base.dw1, &base.db1, &base.dw2, &base.db2}) {
            for (Tensor& g : *grads) g.zero_();
          }
          BackwardCase added = base.with_own_outputs(), written = base.with_own_outputs();
          added.backward(added.dx, added.dprobs, nullptr);
          written.backward(written.dx, written.dprobs, nullptr, all_zero);
          BackwardCase split = base.with_own_outputs();
          Tensor workspace =
              grouped_mlp_backward_workspace(split.dy,
                                             {BackwardCase::params_of(split.w1), BackwardCase::params_of(split.b1),
                                              BackwardCase::params_of(split.w2), BackwardCase::params_of(split.b2)},
                                             p.offsets_E1, {Activation::kSwiGLU, false});
          const GroupedMlpBackwardSplit data{GroupedMlpBackwardPart::kData, &workspace};
          const GroupedMlpBackwardSplit weights{GroupedMlpBackwardPart::kWeights, &workspace};
          split.backward(split.dx, split.dprobs, &data, all_zero);
          Tensor none_dx, none_dprobs;
          split.backward(none_dx, none_dprobs, &weights, all_zero);
          const std::string what = std::string(device_name(device)) + " " +
                                   std::string(kernels::cpu::lowp_gemm_path_name(path)) + " " +
                                   std::string(dtype_name(act)) + (bias ? " bias" : "") + ": ";
          const std::vector<const Tensor*> want = added.grads(), got = written.grads(), got_split = split.grads();
          for (size_t i = 0; i < want.size(); ++i) {
            EXPECT_TRUE(same_bits(*got[i], *want[i])) << what << "gradient " << i;
            EXPECT_TRUE(same_bits(*got_split[i], *want[i])) << what << "split, gradient " << i;
          }
          EXPECT_TRUE(same_bits(written.dx, added.dx)) << what << "dx";
          EXPECT_TRUE(same_bits(written.dprobs, added.dprobs)) << what << "dprobs";
          // Accumulating on top of what was written: the second micro-batch, the same rows again, so twice the first
          // up to the fp32 sums' rounding (a second write instead of an add would leave the first).
          std::vector<Tensor> first;
          for (const Tensor* g : got) first.push_back(g->clone());
          written.backward(written.dx, written.dprobs, nullptr);
          added.backward(added.dx, added.dprobs, nullptr);
          for (size_t i = 0; i < want.size(); ++i) {
            EXPECT_TRUE(same_bits(*got[i], *want[i])) << what << "second micro-batch, gradient " << i;
            const Tensor twice = as_dtype(first[i], DType::kF64);
            const Tensor now = as_dtype(*got[i], DType::kF64);
            double scale = 0.0, err = 0.0;
            for (int64_t j = 0; j < now.numel(); ++j) {
              scale = std::max(scale, std::abs(2.0 * twice.data<double>()[j]));
              err = std::max(err, std::abs(now.data<double>()[j] - 2.0 * twice.data<double>()[j]));
            }
            EXPECT_LE(err, 1e-5 * scale) << what << "second micro-batch is not twice the first, gradient " << i;
          }
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// A split backward's workspace: needed by both parts, of the backward's dtype and [R, F1] elements.
TEST(OpsGroupedMlp, SplitBackwardChecksItsWorkspace) {
  for (const Device device : kDevices) {
    const TestDevice on(device);
    Problem p = make_problem({3, 0, 2}, {Activation::kSwiGLU, false}, false);
    BackwardCase c(p, DType::kF32, DType::kF32);
    const int64_t R = p.offsets_E1.back();
    Tensor wrong_size = tensor_on({R, p.F}, DType::kF32), wrong_dtype = tensor_on({R, p.F1}, DType::kF64);
    const auto expect_refused = [&](const GroupedMlpBackwardSplit& split, const std::string& message) {
      try {
        c.backward(c.dx, c.dprobs, &split);
        ADD_FAILURE() << "no error for: " << message;
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()).rfind("grouped_mlp_backward: ", 0), 0u) << e.what();
        EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
      }
    };
    for (const GroupedMlpBackwardPart part : {GroupedMlpBackwardPart::kData, GroupedMlpBackwardPart::kWeights}) {
      expect_refused({part, nullptr}, "dfc1_workspace_RF1");
      expect_refused({part, &wrong_size}, "dfc1_workspace_RF1");
      expect_refused({part, &wrong_dtype}, "dfc1_workspace_RF1 is float64, expected float32");
    }
    expect_refused({GroupedMlpBackwardPart::kAll, &wrong_size}, "dfc1_workspace_RF1");
    // The workspace of the op's parameter checks.
    try {
      grouped_mlp_backward_workspace(c.dy, GroupedMlpParams{}, p.offsets_E1, p.spec);
      ADD_FAILURE() << "no error without experts";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("grouped_mlp_backward_workspace: ", 0), 0u) << e.what();
    }
  }
}

TEST(OpsGroupedMlp, QuantizationIsNotFused) {
  EXPECT_TRUE(grouped_mlp_fused());
  Problem p = make_problem({3, 2}, {Activation::kGelu, false}, false);
  const quant::QuantizedLinearConfig config;
  const ScopedLinearQuantization fp8(&config);
  EXPECT_FALSE(grouped_mlp_fused());
  try {
    fused(p);
    FAIL() << "the fused op ran under FP8";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("grouped_mlp_forward: ", 0), 0u) << e.what();
  }
}

}  // namespace
}  // namespace moecore::ops
