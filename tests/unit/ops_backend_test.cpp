// Every op of src/moecore/ops on every device, in the spirit of ggml's tests/test-backend-ops.cpp. Each case of
// ops_test_cases.h runs four ways:
//   OpsConsistency: fp32 and fp64, forward and backward on the CPU device (at 1 and 2 OpenMP threads) against the
//     reference device on identical inputs, outputs and gradient buffers pre-filled with the same random values;
//     tensors an op must not write are checked unchanged, and after every op on the reference device no tensor's
//     guard bytes are touched (no kernel wrote outside its outputs).
//   OpsGradient: fp64, on both devices, the backward op with dout = w against central finite differences of
//     L = sum <out, w> for every differentiable input and parameter.
//   OpsContract: calling a backward op twice accumulates exactly twice, or gives the same values, as its header says.
//   OpsBadArgs: a wrong-sized or other-dtype tensor raises std::invalid_argument naming the op.
// The low-precision cases (lowp_cases(): linear layers on bf16 / fp16 tensors with fp32 or low-precision outputs) run
// OpsLowPrecision: each device, and on the CPU each GEMM path (native, convert), against the reference forward and
// backward, with a tolerance derived from the formats (see there); OpsLowPrecision.BadArgumentsAreRefused covers the
// dtype mixes and shapes they refuse.
// Hand-written checks below cover what a table cannot: the dropout mask from the counter RNG, AdamW's formula,
// sum_squares / all_finite, in-place aliasing, two vocabulary-parallel ranks against the whole vocabulary, a
// tensor-parallel attention shard against the one-process heads, the fused qkv layout, and the devices.
//
// Ops in src/moecore/ops/*.h (kOpsInHeaders; OpsCoverage checks every one is exercised):
//   activation.h  activation_input_width activation_forward activation_backward
//   attention.h   attention_forward attention_backward attention_merge attention_products rope_forward rope_backward
//   convert.h     convert
//   device.h      supports synchronize
//   dropout.h     dropout_forward dropout_backward
//   elementwise.h add_ scale_ sum_squares sum_squares_each all_finite count_zeros
//   expert_activation.h weighted_swiglu_forward weighted_swiglu_backward
//   linear.h      linear_forward linear_backward gemm_library gemm_lowp_library gemm_lowp_native
//   linear_cross_entropy.h  linear_cross_entropy linear_cross_entropy_chunk_rows linear_cross_entropy_logit_bytes
//   grouped_mlp.h grouped_mlp_fused grouped_mlp_forward grouped_mlp_backward grouped_mlp_backward_workspace
//   init.h        normal_fill
//   moe_rows.h    moe_permute moe_unpermute moe_unpermute_backward sort_chunks unsort_chunks
//   loss.h        embedding_forward embedding_backward cross_entropy_forward cross_entropy_backward
//                 vocab_ce_local_max vocab_ce_local_stats vocab_ce_finish vocab_ce_backward
//   norm.h        rmsnorm_forward rmsnorm_backward layernorm_forward layernorm_backward
//   optim.h       adamw_step
//   rows.h        split_qkv merge_qkv copy_columns add_bias_rows bias_grad_rows scale_rows scale_rows_backward
//   add_outer
//                 add_outer_backward row_dot sigmoid_forward sigmoid_backward gather_rows scatter_add_rows
//                 add_position_embedding
//                 position_embedding_backward
//   routing.h     topk_routing_forward topk_routing_backward sinkhorn expert_capacity routing_map aux_scores_forward
//                 aux_scores_backward aux_loss_sums switch_loss switch_loss_backward z_loss_forward z_loss_backward
//                 expert_bias_update
//   input_jitter.h  input_jitter_forward input_jitter_backward
//   routing_padding.h  pad_routing_map
//   expert_rows.h  expert_major_rows
#include <gtest/gtest.h>
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "moecore/kernels/cpu/attention_products.h"
#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/ops/ops.h"
#include "moecore/ops/precision.h"
#include "moecore/tensor/rng.h"
#include "unit/ops_test_cases.h"
#include "unit/test_device.h"

namespace moecore::ops {
namespace {

using test::close;
using test::Env;
using test::make_env;
using test::OpCase;

const std::vector<std::string> kOpsInHeaders = {"activation_input_width",
                                                "activation_forward",
                                                "activation_backward",
                                                "attention_forward",
                                                "attention_backward",
                                                "attention_merge",
                                                "attention_products",
                                                "rope_forward",
                                                "rope_backward",
                                                "convert",
                                                "supports",
                                                "synchronize",
                                                "dropout_forward",
                                                "dropout_backward",
                                                "add_",
                                                "scale_",
                                                "sum_squares",
                                                "sum_squares_each",
                                                "all_finite",
                                                "count_zeros",
                                                "weighted_swiglu_forward",
                                                "weighted_swiglu_backward",
                                                "linear_forward",
                                                "linear_backward",
                                                "gemm_library",
                                                "gemm_lowp_library",
                                                "gemm_lowp_native",
                                                "linear_cross_entropy",
                                                "linear_cross_entropy_chunk_rows",
                                                "linear_cross_entropy_logit_bytes",
                                                "embedding_forward",
                                                "embedding_backward",
                                                "cross_entropy_forward",
                                                "cross_entropy_backward",
                                                "vocab_ce_local_max",
                                                "vocab_ce_local_stats",
                                                "vocab_ce_finish",
                                                "vocab_ce_backward",
                                                "rmsnorm_forward",
                                                "rmsnorm_backward",
                                                "layernorm_forward",
                                                "layernorm_backward",
                                                "adamw_step",
                                                "split_qkv",
                                                "merge_qkv",
                                                "copy_columns",
                                                "add_bias_rows",
                                                "bias_grad_rows",
                                                "scale_rows",
                                                "scale_rows_backward",
                                                "add_outer",
                                                "add_outer_backward",
                                                "row_dot",
                                                "sigmoid_forward",
                                                "sigmoid_backward",
                                                "gather_rows",
                                                "scatter_add_rows",
                                                "add_position_embedding",
                                                "position_embedding_backward",
                                                "moe_permute",
                                                "moe_unpermute",
                                                "moe_unpermute_backward",
                                                "sort_chunks",
                                                "unsort_chunks",
                                                "grouped_mlp_fused",
                                                "grouped_mlp_forward",
                                                "grouped_mlp_backward",
                                                "grouped_mlp_backward_workspace",
                                                "normal_fill",
                                                "topk_routing_forward",
                                                "topk_routing_backward",
                                                "sinkhorn",
                                                "expert_capacity",
                                                "routing_map",
                                                "aux_scores_forward",
                                                "aux_scores_backward",
                                                "aux_loss_sums",
                                                "switch_loss",
                                                "switch_loss_backward",
                                                "z_loss_forward",
                                                "z_loss_backward",
                                                "expert_bias_update",
                                                "input_jitter_forward",
                                                "input_jitter_backward",
                                                "pad_routing_map",
                                                "expert_major_rows"};

// Ops exercised by the hand-written tests below (grouped_mlp_backward_workspace: ops_grouped_mlp_test) rather than
// (only) by the case table.
const std::vector<std::string> kOpsInHandWrittenTests = {"activation_input_width",
                                                         "supports",
                                                         "synchronize",
                                                         "sum_squares",
                                                         "sum_squares_each",
                                                         "all_finite",
                                                         "count_zeros",
                                                         "linear_cross_entropy_chunk_rows",
                                                         "linear_cross_entropy_logit_bytes",
                                                         "gemm_library",
                                                         "gemm_lowp_library",
                                                         "gemm_lowp_native",
                                                         "expert_capacity",
                                                         "grouped_mlp_fused",
                                                         "grouped_mlp_backward_workspace",
                                                         "attention_products"};

// Ops whose bad arguments only hand-written tests provoke (one tensor: no size or dtype mismatch; convert accepts
// every floating dtype, so the table's fp64 swap is no error for it; grouped_mlp_backward_workspace: in
// ops_grouped_mlp_test).
const std::vector<std::string> kOpsWithHandWrittenErrors = {
    "scale_",  "sum_squares", "sum_squares_each", "all_finite",
    "convert", "normal_fill", "count_zeros",      "grouped_mlp_backward_workspace"};
const std::vector<std::string> kOpsWithoutTensors = {"activation_input_width",
                                                     "supports",
                                                     "synchronize",
                                                     "linear_cross_entropy_chunk_rows",
                                                     "linear_cross_entropy_logit_bytes",
                                                     "gemm_library",
                                                     "gemm_lowp_library",
                                                     "gemm_lowp_native",
                                                     "expert_capacity",
                                                     "grouped_mlp_fused",
                                                     "attention_products"};

using test::kDevices;
using test::tensor_on;
using test::TestDevice;
constexpr DType kDTypes[] = {DType::kF32, DType::kF64};

double consistency_tol(const DType dtype) { return dtype == DType::kF32 ? 1e-5 : 1e-12; }

std::string label(const Device device, const DType dtype) {
  return std::string(device_name(device)) + " " + std::string(dtype_name(dtype));
}

// Restores the OpenMP thread count when a test changes it.
class ThreadCount {
 public:
  explicit ThreadCount(const int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ThreadCount() { omp_set_num_threads(saved_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int saved_;
};

// The device compared with the reference device, at a thread count.
struct Config {
  Device device;
  int threads;
};
constexpr Config kConfigs[] = {{Device::kCPU, 1}, {Device::kCPU, 2}};

std::string label(const Config& config, const DType dtype) {
  return label(config.device, dtype) + " threads=" + std::to_string(config.threads);
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::vector<std::string> grad_names(const OpCase& c) {
  std::vector<std::string> names;
  for (const test::GradOf& g : c.grads) names.push_back(g.grad);
  return names;
}

// Every tensor not in `names` bit-identical to `unchanged`'s: the op wrote only what it may write.
void expect_unchanged_except(const Env& got, const std::vector<std::string>& names,
                             const std::map<std::string, Tensor>& unchanged, const std::string& what) {
  for (const auto& [name, t] : got.tensors()) {
    if (!contains(names, name)) {
      EXPECT_EQ(test::values(t), test::values(unchanged.at(name))) << what << ": wrote into " << name;
    }
  }
}

// Tensors in `names` close to `want`'s (tol); every other tensor bit-identical to `unchanged`'s.
void expect_state(const Env& got, const std::map<std::string, Tensor>& want, const std::vector<std::string>& names,
                  const std::map<std::string, Tensor>& unchanged, const double tol, const std::string& what) {
  for (const auto& [name, t] : got.tensors()) {
    if (contains(names, name)) {
      EXPECT_TRUE(close(t, want.at(name), tol)) << what << ": " << name;
    }
  }
  expect_unchanged_except(got, names, unchanged, what);
}

// ---- the case table, four ways ----------------------------------------------------------------------------------

std::vector<size_t> case_indices(const bool backward_only) {
  std::vector<size_t> out;
  const auto& cases = test::all_cases();
  for (size_t i = 0; i < cases.size(); ++i) {
    if (!backward_only || cases[i].has_backward()) out.push_back(i);
  }
  return out;
}

std::vector<size_t> bad_arg_case_indices() {
  std::vector<size_t> out;
  const auto& cases = test::all_cases();
  for (size_t i = 0; i < cases.size(); ++i) {
    if (!cases[i].bad_args.empty()) out.push_back(i);
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<size_t>& info) { return test::all_cases()[info.param].name; }

class OpsConsistency : public ::testing::TestWithParam<size_t> {};
class OpsGradient : public ::testing::TestWithParam<size_t> {};
class OpsContract : public ::testing::TestWithParam<size_t> {};
class OpsBadArgs : public ::testing::TestWithParam<size_t> {};

// Runs `op` on `env`; on the reference device, then checks that no kernel wrote outside a tensor of `env`.
template <typename Op>
void run_checked(const Op& op, Env& env, const std::string& what) {
  op(env);
  if (env.device() == Device::kReference) {
    EXPECT_EQ(env.outside_writes(), "") << what;
  }
}

TEST_P(OpsConsistency, MatchesReferenceDevice) {
  const OpCase& c = test::all_cases()[GetParam()];
  for (const DType dtype : kDTypes) {
    const double tol = consistency_tol(dtype);
    const auto initial = make_env(c, dtype).snapshot();
    // Reference results: forward, then backward from the reference forward's saved tensors, each writing only its
    // outputs.
    Env ref = make_env(c, dtype, Device::kReference);
    std::map<std::string, Tensor> ref_forward, ref_backward;
    run_checked(c.forward, ref, c.name + " forward on the reference device");
    ref_forward = ref.snapshot();
    expect_unchanged_except(ref, c.outputs, initial, c.name + " forward, " + label(Device::kReference, dtype));
    if (c.has_backward()) {
      run_checked(c.backward, ref, c.name + " backward on the reference device");
      ref_backward = ref.snapshot();
      expect_unchanged_except(ref, grad_names(c), ref_forward,
                              c.name + " backward, " + label(Device::kReference, dtype));
    }
    for (const Config& config : kConfigs) {
      const ThreadCount threads(config.threads);
      Env fwd = make_env(c, dtype, config.device);
      c.forward(fwd);
      expect_state(fwd, ref_forward, c.outputs, initial, tol, c.name + " forward, " + label(config, dtype));
      if (!c.has_backward()) continue;
      // The backward alone: same saved tensors (reference forward), then this device's backward.
      Env bwd = make_env(c, dtype, Device::kReference);
      c.forward(bwd);
      bwd.to(config.device);
      const auto before = bwd.snapshot();
      c.backward(bwd);
      expect_state(bwd, ref_backward, grad_names(c), before, tol, c.name + " backward, " + label(config, dtype));
    }
  }
}

// The elements a finite-difference check perturbs: all of a small tensor, about 25 spread over a large one (an odd
// stride, so they fall in different rows and columns).
std::vector<int64_t> probed_elements(const int64_t n) {
  int64_t stride = n <= 256 ? 1 : n / 24;
  if (stride > 1 && stride % 2 == 0) ++stride;
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; i += stride) out.push_back(i);
  if (out.back() != n - 1) out.push_back(n - 1);
  return out;
}

TEST_P(OpsGradient, MatchesFiniteDifferences) {
  const OpCase& c = test::all_cases()[GetParam()];
  constexpr double eps = 1e-6, tol = 1e-6;
  // One thread: the thousands of forward calls stay cheap on a loaded machine; OpsConsistency covers 2 threads.
  const ThreadCount one_thread(1);
  for (const Device device : kDevices) {
    Env env = make_env(c, DType::kF64, device);
    for (const test::GradOf& g : c.grads) env(g.grad).zero_();
    c.forward(env);
    c.backward(env);
    for (const test::GradOf& g : c.grads) {
      Tensor& x = env(g.input);
      std::vector<double> numeric, analytic;
      for (const int64_t i : probed_elements(x.numel())) {
        const double saved = test::get(x, i);
        test::set(x, i, saved + eps);
        c.forward(env);
        const double plus = test::weighted_loss(c, env);
        test::set(x, i, saved - eps);
        c.forward(env);
        const double minus = test::weighted_loss(c, env);
        test::set(x, i, saved);
        numeric.push_back((plus - minus) / (2 * eps));
        analytic.push_back(test::get(env(g.grad), i));
      }
      EXPECT_TRUE(close(analytic, numeric, tol))
          << c.name << " on " << device_name(device) << ": d loss / d " << g.input;
    }
  }
}

TEST_P(OpsContract, AccumulatesOrOverwritesAsDocumented) {
  const OpCase& c = test::all_cases()[GetParam()];
  constexpr double tol = 1e-12;
  for (const Device device : kDevices) {
    Env env = make_env(c, DType::kF64, Device::kReference);
    const auto prefill = env.snapshot();
    c.forward(env);
    env.to(device);
    for (const test::GradOf& g : c.grads) env(g.grad).zero_();
    c.backward(env);
    const auto once = env.snapshot();
    c.backward(env);
    const auto twice = env.snapshot();
    for (const test::GradOf& g : c.grads) env(g.grad).copy_from(prefill.at(g.grad));
    c.backward(env);
    for (const test::GradOf& g : c.grads) {
      const std::string what = c.name + " on " + std::string(device_name(device)) + ": " + g.grad;
      const std::vector<double> one = test::values(once.at(g.grad)), pre = test::values(prefill.at(g.grad));
      ASSERT_TRUE(std::any_of(one.begin(), one.end(), [](const double v) { return v != 0.0; })) << what << " is 0";
      std::vector<double> want_twice = one, want_prefilled = one;
      if (g.contract == test::Contract::kAccumulates) {
        for (size_t i = 0; i < one.size(); ++i) {
          want_twice[i] = 2 * one[i];
          want_prefilled[i] = pre[i] + one[i];
        }
      }
      const char* contract = g.contract == test::Contract::kAccumulates ? "accumulate" : "overwrite";
      EXPECT_TRUE(close(test::values(twice.at(g.grad)), want_twice, tol)) << what << " must " << contract;
      EXPECT_TRUE(close(test::values(env(g.grad)), want_prefilled, tol))
          << what << " must " << contract << " onto a pre-filled buffer";
    }
  }
}

TEST_P(OpsBadArgs, WrongSizeOrDTypeNamesTheOp) {
  const OpCase& c = test::all_cases()[GetParam()];
  for (const test::BadArg& bad : c.bad_args) {
    for (const bool wrong_size : {true, false}) {
      for (const Device device : kDevices) {
        Env env = make_env(c, DType::kF32, Device::kReference);
        if (bad.phase == test::Phase::kBackward) c.forward(env);
        env.to(device);
        Tensor& t = env(bad.tensor);
        t = wrong_size ? Tensor({t.numel() + 1}, DType::kF32, MemCategory::kOther, device)
                       : Tensor(t.shape(), DType::kF64, MemCategory::kOther, device);
        const std::string what = c.name + ": " + bad.tensor + (wrong_size ? " one element too many" : " in fp64") +
                                 " on " + std::string(device_name(device));
        try {
          bad.phase == test::Phase::kForward ? c.forward(env) : c.backward(env);
          ADD_FAILURE() << what << ": no error";
        } catch (const std::invalid_argument& error) {
          EXPECT_EQ(std::string(error.what()).rfind(bad.op + ": ", 0), 0u) << what << ": " << error.what();
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllOps, OpsConsistency, ::testing::ValuesIn(case_indices(false)), case_name);
INSTANTIATE_TEST_SUITE_P(AllOps, OpsGradient, ::testing::ValuesIn(case_indices(true)), case_name);
INSTANTIATE_TEST_SUITE_P(AllOps, OpsContract, ::testing::ValuesIn(case_indices(true)), case_name);
INSTANTIATE_TEST_SUITE_P(AllOps, OpsBadArgs, ::testing::ValuesIn(bad_arg_case_indices()), case_name);

TEST(OpsCoverage, EveryOpInTheHeadersIsExercised) {
  std::set<std::string> exercised(kOpsInHandWrittenTests.begin(), kOpsInHandWrittenTests.end());
  for (const OpCase& c : test::all_cases()) exercised.insert(c.ops.begin(), c.ops.end());
  for (const std::string& op : kOpsInHeaders) EXPECT_TRUE(exercised.count(op)) << op << " has no test";
  for (const std::string& op : exercised) EXPECT_TRUE(contains(kOpsInHeaders, op)) << op << " is not in the list";
  // A case with a backward checks gradients (and has a loss to differentiate).
  std::set<std::string> refused(kOpsWithHandWrittenErrors.begin(), kOpsWithHandWrittenErrors.end());
  for (const OpCase& c : test::all_cases()) {
    EXPECT_EQ(c.has_backward(), !c.grads.empty()) << c.name;
    EXPECT_EQ(c.has_backward(), !c.loss.empty()) << c.name;
    for (const test::BadArg& bad : c.bad_args) refused.insert(bad.op);
  }
  // Every op on tensors is given bad arguments somewhere (device.h and activation_input_width take none).
  for (const std::string& op : kOpsInHeaders) {
    if (contains(kOpsWithoutTensors, op)) continue;
    EXPECT_TRUE(refused.count(op)) << op << " is never given bad arguments";
  }
}

// ---- hand-written checks ----------------------------------------------------------------------------------------

Tensor random_tensor(const std::vector<int64_t>& shape, const DType dtype, const uint64_t seed, double scale = 1.0) {
  Env env(dtype, seed, test::test_device());
  return env.rand("t", shape, scale);
}

// Elements [begin, end) of `axis` of a row-major tensor, copied.
Tensor slice_axis(const Tensor& x, const int axis, const int64_t begin, const int64_t end) {
  std::vector<int64_t> shape = x.shape();
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= shape[static_cast<size_t>(i)];
  for (int i = axis + 1; i < x.ndim(); ++i) inner *= shape[static_cast<size_t>(i)];
  const int64_t width = shape[static_cast<size_t>(axis)];
  shape[static_cast<size_t>(axis)] = end - begin;
  Tensor out(shape, x.dtype(), MemCategory::kOther, x.device());
  int64_t n = 0;
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t a = begin; a < end; ++a) {
      for (int64_t i = 0; i < inner; ++i) test::set(out, n++, test::get(x, (o * width + a) * inner + i));
    }
  }
  return out;
}

// Concatenation along the last axis of tensors with the same leading shape.
Tensor concat_columns(const Tensor& a, const Tensor& b) {
  const int64_t wa = a.dim(-1), wb = b.dim(-1), rows = a.numel() / wa;
  Tensor out({rows, wa + wb}, a.dtype(), MemCategory::kOther, a.device());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < wa; ++j) test::set(out, r * (wa + wb) + j, test::get(a, r * wa + j));
    for (int64_t j = 0; j < wb; ++j) test::set(out, r * (wa + wb) + wa + j, test::get(b, r * wb + j));
  }
  return out;
}

TEST(OpsDropout, MaskIsTheCounterRngAndBackwardAppliesIt) {
  const DropoutSpec spec = test::test_dropout();
  const CounterRng rng(spec.seed, spec.key);
  const double keep_scale = 1.0 / (1.0 - static_cast<double>(spec.p));
  for (const Device device : kDevices) {
    for (const DType dtype : kDTypes) {
      const TestDevice scope(device);
      const Tensor inp = random_tensor({9, 7}, dtype, 1), dout = random_tensor({9, 7}, dtype, 2);
      const Tensor prefill = random_tensor({9, 7}, dtype, 3);
      Tensor out = random_tensor({9, 7}, dtype, 4), dinp = prefill.clone();
      dropout_forward(out, inp, spec);
      dropout_backward(dinp, dout, spec);
      std::vector<double> want_out, want_dinp;
      int dropped = 0;
      for (int64_t i = 0; i < inp.numel(); ++i) {
        const bool drop = rng.uniform(spec.offset + static_cast<uint64_t>(i)) < spec.p;
        dropped += drop ? 1 : 0;
        want_out.push_back(drop ? 0.0 : test::get(inp, i) * keep_scale);
        want_dinp.push_back(test::get(prefill, i) + (drop ? 0.0 : test::get(dout, i) * keep_scale));
      }
      ASSERT_GT(dropped, 0);
      ASSERT_LT(dropped, inp.numel());
      EXPECT_TRUE(close(test::values(out), want_out, consistency_tol(dtype))) << label(device, dtype);
      EXPECT_TRUE(close(test::values(dinp), want_dinp, consistency_tol(dtype))) << label(device, dtype);
    }
  }
}

// torch.optim.AdamW (kernels/cpu/adamw.h), written out in double.
TEST(OpsAdamW, OneStepMatchesTheFormula) {
  const OpCase& c = *std::find_if(test::all_cases().begin(), test::all_cases().end(),
                                  [](const OpCase& x) { return x.name == "adamw_step"; });
  const AdamWHyper h = test::test_adamw_hyper();
  for (const Device device : kDevices) {
    for (const DType dtype : kDTypes) {
      Env env = make_env(c, dtype);
      {
        const TestDevice scope(device);
        c.forward(env);
      }
      std::vector<double> param, m, v;
      for (int64_t i = 0; i < env("grad").numel(); ++i) {
        const double g = test::get(env("grad"), i) * h.grad_scale;  // the clipped gradient
        double p = test::get(env("param0"), i) * (1.0 - h.lr * h.weight_decay);
        const double mi = h.beta1 * test::get(env("exp_avg0"), i) + (1.0 - h.beta1) * g;
        const double vi = h.beta2 * test::get(env("exp_avg_sq0"), i) + (1.0 - h.beta2) * g * g;
        const double bias1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
        const double bias2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
        p -= (h.lr / bias1) * mi / (std::sqrt(vi) / std::sqrt(bias2) + h.eps);
        param.push_back(p);
        m.push_back(mi);
        v.push_back(vi);
      }
      const double tol = dtype == DType::kF32 ? 1e-6 : 1e-14;
      EXPECT_TRUE(close(test::values(env("param")), param, tol)) << label(device, dtype);
      EXPECT_TRUE(close(test::values(env("exp_avg")), m, tol)) << label(device, dtype);
      EXPECT_TRUE(close(test::values(env("exp_avg_sq")), v, tol)) << label(device, dtype);
    }
  }
}

TEST(OpsElementwise, SumSquaresAndAllFinite) {
  for (const Device device : kDevices) {
    for (const DType dtype : kDTypes) {
      const TestDevice scope(device);
      Tensor x = random_tensor({13, 11}, dtype, 5, 3.0);
      double want = 0.0;
      for (int64_t i = 0; i < x.numel(); ++i) want += test::get(x, i) * test::get(x, i);
      EXPECT_NEAR(sum_squares(x), want, 1e-12 * want) << label(device, dtype);
      EXPECT_TRUE(all_finite(x)) << label(device, dtype);
      for (const double bad : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                               std::numeric_limits<double>::quiet_NaN()}) {
        Tensor y = x.clone();
        test::set(y, 100, bad);
        EXPECT_FALSE(all_finite(y)) << label(device, dtype) << " with " << bad;
      }
    }
  }
}

// Each tensor's sum of squares against the naive sum, for tensors of one element to several of the kernel's chunks
// (2^18 elements) and an empty one; the sums are the same bits on one thread and on two.
TEST(OpsElementwise, SumSquaresEachMatchesEachTensorAndNotTheThreads) {
  const std::vector<std::vector<int64_t>> shapes = {{13, 11}, {1}, {0}, {600, 1000}, {3, 70001}, {262144}};
  for (const Device device : kDevices) {
    for (const DType dtype : kDTypes) {
      const TestDevice scope(device);
      std::vector<Tensor> xs;
      for (size_t j = 0; j < shapes.size(); ++j) xs.push_back(random_tensor(shapes[j], dtype, 40 + j, 3.0));
      std::vector<double> one, two;
      {
        const ThreadCount threads(1);
        one = sum_squares_each(xs);
      }
      {
        const ThreadCount threads(2);
        two = sum_squares_each(xs);
      }
      ASSERT_EQ(one.size(), xs.size());
      for (size_t j = 0; j < xs.size(); ++j) {
        double want = 0.0;
        for (int64_t i = 0; i < xs[j].numel(); ++i) want += test::get(xs[j], i) * test::get(xs[j], i);
        EXPECT_NEAR(one[j], want, 1e-12 * want) << label(device, dtype) << " tensor " << j;
        EXPECT_EQ(std::bit_cast<uint64_t>(one[j]), std::bit_cast<uint64_t>(two[j]))
            << label(device, dtype) << " tensor " << j;
      }
    }
  }
}

// Zeros of both signs are counted, every other value (denormals included) is not; 16-bit tensors count as their values.
TEST(OpsElementwise, CountZeros) {
  for (const Device device : kDevices) {
    for (const DType dtype : {DType::kF32, DType::kF64, DType::kBF16}) {
      const TestDevice scope(device);
      Tensor x = random_tensor({37, 29}, dtype == DType::kBF16 ? DType::kF32 : dtype, 7, 3.0);
      int64_t want = 0;
      for (int64_t i = 0; i < x.numel(); ++i) {
        if (i % 7 == 3) test::set(x, i, i % 2 == 0 ? 0.0 : -0.0);
        if (i % 11 == 5) test::set(x, i, 1e-40);  // a float denormal, not zero
        want += test::get(x, i) == 0.0 ? 1 : 0;
      }
      if (dtype == DType::kBF16) {
        Tensor narrow = tensor_on({37, 29}, DType::kBF16);
        convert(narrow, x);
        x = narrow;
      }
      ASSERT_GT(want, 100);
      EXPECT_EQ(count_zeros(x), want) << label(device, dtype);
    }
  }
}

// Ops whose output may alias an input give the same values in place.
TEST(OpsInPlace, AliasedOutputsMatchSeparateOnes) {
  const std::vector<int32_t> targets = {0, 12, 5, 5, 7, 1, 11, 3};
  const DropoutSpec spec = test::test_dropout();
  for (const Device device : kDevices) {
    for (const DType dtype : kDTypes) {
      const TestDevice scope(device);
      const double tol = consistency_tol(dtype);
      const std::string what = label(device, dtype);
      const Tensor logits = random_tensor({8, 13}, dtype, 6, 3.0), dlosses = random_tensor({8}, dtype, 7);
      Tensor losses = tensor_on({8}, dtype), lse = tensor_on({8}, dtype), dlogits = tensor_on({8, 13}, dtype);
      cross_entropy_forward(losses, lse, logits, targets);
      cross_entropy_backward(dlogits, dlosses, logits, lse, targets);
      Tensor in_place = logits.clone();
      cross_entropy_backward(in_place, dlosses, in_place, lse, targets);
      EXPECT_TRUE(close(in_place, dlogits, tol)) << what << " cross_entropy_backward";
      // The same logits as one vocabulary-parallel rank holding all 13 columns.
      vocab_ce_backward(dlogits, dlosses, logits, lse, targets, 0);
      in_place = logits.clone();
      vocab_ce_backward(in_place, dlosses, in_place, lse, targets, 0);
      EXPECT_TRUE(close(in_place, dlogits, tol)) << what << " vocab_ce_backward";

      const Tensor x = random_tensor({9, 7}, dtype, 8), s = random_tensor({9}, dtype, 9);
      Tensor out = tensor_on({9, 7}, dtype);
      dropout_forward(out, x, spec);
      in_place = x.clone();
      dropout_forward(in_place, in_place, spec);
      EXPECT_TRUE(close(in_place, out, tol)) << what << " dropout_forward";
      scale_rows(out, x, s);
      in_place = x.clone();
      scale_rows(in_place, in_place, s);
      EXPECT_TRUE(close(in_place, out, tol)) << what << " scale_rows";
    }
  }
}

// Two ranks holding vocabulary columns [0, 6) and [6, 12) of V = 12, combined as the tensor-parallel group would
// (max of the maxima, sum of the statistics), give the whole-vocabulary loss and gradient; the ranks' embeddings sum
// to the whole-vocabulary embedding.
TEST(OpsVocabParallel, TwoRanksEqualTheWholeVocabulary) {
  constexpr int64_t T = 8, V = 12, Vl = 6, D = 5;
  const std::vector<int32_t> ids = {0, 11, 5, 6, 7, 3, 6, 10};
  for (const Device device : kDevices) {
    for (const DType dtype : kDTypes) {
      const TestDevice scope(device);
      const double tol = consistency_tol(dtype);
      const std::string what = label(device, dtype);
      const Tensor logits = random_tensor({T, V}, dtype, 10, 3.0), dlosses = random_tensor({T}, dtype, 11);
      Tensor losses = tensor_on({T}, dtype), lse = tensor_on({T}, dtype), dlogits = tensor_on({T, V}, dtype);
      cross_entropy_forward(losses, lse, logits, ids);
      cross_entropy_backward(dlogits, dlosses, logits, lse, ids);

      const Tensor part[2] = {slice_axis(logits, 1, 0, Vl), slice_axis(logits, 1, Vl, V)};
      Tensor max[2] = {tensor_on({T}, dtype), tensor_on({T}, dtype)};
      for (int r = 0; r < 2; ++r) vocab_ce_local_max(max[r], part[r]);
      Tensor group_max = tensor_on({T}, dtype), group_stats = tensor_on({2, T}, dtype),
             stats = tensor_on({2, T}, dtype);
      for (int64_t t = 0; t < T; ++t) test::set(group_max, t, std::max(test::get(max[0], t), test::get(max[1], t)));
      for (int r = 0; r < 2; ++r) {
        vocab_ce_local_stats(stats, part[r], group_max, ids, V, r * Vl);
        add_(group_stats, stats);
      }
      Tensor vp_losses = tensor_on({T}, dtype), vp_lse = tensor_on({T}, dtype),
             vp_dlogits[2] = {tensor_on({T, Vl}, dtype), tensor_on({T, Vl}, dtype)};
      vocab_ce_finish(vp_losses, vp_lse, group_max, group_stats);
      for (int r = 0; r < 2; ++r) vocab_ce_backward(vp_dlogits[r], dlosses, part[r], vp_lse, ids, r * Vl);
      EXPECT_TRUE(close(vp_losses, losses, tol)) << what;
      EXPECT_TRUE(close(vp_lse, lse, tol)) << what;
      EXPECT_TRUE(close(concat_columns(vp_dlogits[0], vp_dlogits[1]), dlogits, tol)) << what;

      const Tensor weight = random_tensor({V, D}, dtype, 12), dout = random_tensor({T, D}, dtype, 13);
      Tensor out = tensor_on({T, D}, dtype), dweight = tensor_on({V, D}, dtype), vp_out = tensor_on({T, D}, dtype),
             piece = tensor_on({T, D}, dtype);
      embedding_forward(out, ids, weight, V);
      embedding_backward(dweight, dout, ids);
      Tensor vp_dweight[2] = {tensor_on({Vl, D}, dtype), tensor_on({Vl, D}, dtype)};
      for (int r = 0; r < 2; ++r) {
        embedding_forward(piece, ids, slice_axis(weight, 0, r * Vl, (r + 1) * Vl), V, r * Vl);
        add_(vp_out, piece);
        embedding_backward(vp_dweight[r], dout, ids, r * Vl);
      }
      EXPECT_TRUE(close(vp_out, out, tol)) << what;
      EXPECT_TRUE(close(vp_dweight[0], slice_axis(dweight, 0, 0, Vl), tol)) << what;
      EXPECT_TRUE(close(vp_dweight[1], slice_axis(dweight, 0, Vl, V), tol)) << what;
    }
  }
}

// A tensor-parallel rank holding query heads [2, 4) of 4 (kv group 1 of 2) draws the one-process dropout mask: its
// outputs and gradients are the one-process ones of those heads.
TEST(OpsAttention, TensorParallelShardEqualsTheOneProcessHeads) {
  DropoutSpec dropout = test::test_dropout();
  dropout.offset = 0;
  const AttentionDims full = test::attention_dims(6, 2, 4, 2);
  AttentionDims shard = test::attention_dims(6, 2, 2, 1);
  shard.dropout_total_heads = 4;
  shard.dropout_head_offset = 2;
  const int64_t S = full.S, B = full.B, d = full.head_dim;
  for (const Device device : kDevices) {
    for (const DType dtype : kDTypes) {
      const TestDevice scope(device);
      const double tol = consistency_tol(dtype);
      const std::string what = label(device, dtype);
      const Tensor q = random_tensor({S, B, 4, d}, dtype, 14, 1.5), k = random_tensor({S, B, 2, d}, dtype, 15, 1.5);
      const Tensor v = random_tensor({S, B, 2, d}, dtype, 16), dout = random_tensor({S, B, 4, d}, dtype, 17);
      Tensor out = tensor_on({S, B, 4, d}, dtype), lse = tensor_on({B, 4, S}, dtype);
      Tensor dq = tensor_on({S, B, 4, d}, dtype), dk = tensor_on({S, B, 2, d}, dtype),
             dv = tensor_on({S, B, 2, d}, dtype);
      attention_forward(out, lse, q, k, v, full, dropout);
      attention_backward(dq, dk, dv, dout, q, k, v, out, lse, full, dropout);

      const Tensor sq = slice_axis(q, 2, 2, 4), sk = slice_axis(k, 2, 1, 2), sv = slice_axis(v, 2, 1, 2);
      const Tensor sdout = slice_axis(dout, 2, 2, 4);
      Tensor sout = tensor_on({S, B, 2, d}, dtype), slse = tensor_on({B, 2, S}, dtype);
      Tensor sdq = tensor_on({S, B, 2, d}, dtype), sdk = tensor_on({S, B, 1, d}, dtype),
             sdv = tensor_on({S, B, 1, d}, dtype);
      attention_forward(sout, slse, sq, sk, sv, shard, dropout);
      attention_backward(sdq, sdk, sdv, sdout, sq, sk, sv, sout, slse, shard, dropout);
      EXPECT_TRUE(close(sout, slice_axis(out, 2, 2, 4), tol)) << what;
      EXPECT_TRUE(close(slse, slice_axis(lse, 1, 2, 4), tol)) << what;
      EXPECT_TRUE(close(sdq, slice_axis(dq, 2, 2, 4), tol)) << what;
      EXPECT_TRUE(close(sdk, slice_axis(dk, 2, 1, 2), tol)) << what;
      EXPECT_TRUE(close(sdv, slice_axis(dv, 2, 1, 2), tol)) << what;
    }
  }
}

// Megatron's fused qkv row, per query group g: [N/G query heads | k | v], each d wide.
TEST(OpsRows, SplitQkvFollowsMegatronsLayout) {
  constexpr int64_t T = 3, N = 4, G = 2, d = 2, heads_per_group = N / G;
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    Tensor qkv = tensor_on({T, (N + 2 * G) * d}, DType::kF64);
    for (int64_t i = 0; i < qkv.numel(); ++i) test::set(qkv, i, static_cast<double>(i + 1));
    Tensor q = tensor_on({T, N, d}, DType::kF64), k = tensor_on({T, G, d}, DType::kF64),
           v = tensor_on({T, G, d}, DType::kF64);
    split_qkv(q, k, v, qkv, N, G, d);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = t * (N + 2 * G) * d + g * (heads_per_group + 2) * d;
        for (int64_t c = 0; c < d; ++c) {
          for (int64_t j = 0; j < heads_per_group; ++j) {
            EXPECT_EQ(test::get(q, (t * N + g * heads_per_group + j) * d + c), test::get(qkv, row + j * d + c));
          }
          EXPECT_EQ(test::get(k, (t * G + g) * d + c), test::get(qkv, row + heads_per_group * d + c));
          EXPECT_EQ(test::get(v, (t * G + g) * d + c), test::get(qkv, row + (heads_per_group + 1) * d + c));
        }
      }
    }
    Tensor merged = tensor_on({T, (N + 2 * G) * d}, DType::kF64);
    merge_qkv(merged, q, k, v, N, G, d);
    EXPECT_EQ(test::values(merged), test::values(qkv)) << device_name(device);
  }
}

TEST(OpsActivation, InputWidthIsTwiceForSwiGLU) {
  for (const int64_t F : {1, 5, 64}) {
    EXPECT_EQ(activation_input_width(Activation::kSwiGLU, F), 2 * F);
    EXPECT_EQ(activation_input_width(Activation::kGelu, F), F);
    EXPECT_EQ(activation_input_width(Activation::kSquaredReLU, F), F);
  }
  // The widths the model builds its fc1 layers with are the activation's inputs: activation_forward accepts an
  // [T, activation_input_width(kind, F)] input for an [T, F] output and refuses another width.
  for (const Activation kind : {Activation::kGelu, Activation::kSwiGLU, Activation::kSquaredReLU}) {
    const int64_t T = 3, F = 4;
    Tensor out({T, F}, DType::kF32);
    const Tensor inp({T, activation_input_width(kind, F)}, DType::kF32);
    EXPECT_NO_THROW(activation_forward(kind, out, inp));
    const Tensor wrong({T, activation_input_width(kind, F) + 1}, DType::kF32);
    EXPECT_THROW(activation_forward(kind, out, wrong), std::invalid_argument);
  }
}

// `call` on the current test device raises std::invalid_argument whose message starts with "op: ".
template <typename Call>
void expect_invalid(const std::string& op, const Call& call) {
  try {
    call();
    ADD_FAILURE() << op << " on " << device_name(test::test_device()) << ": no error";
  } catch (const std::invalid_argument& error) {
    EXPECT_EQ(std::string(error.what()).rfind(op + ": ", 0), 0u) << error.what();
  }
}

// Errors the case table cannot provoke: unsupported dtypes, undefined tensors, index and id ranges.
TEST(OpsBadArgs, OtherArgumentErrors) {
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    // bf16 / fp16 tensors are 16-bit activations (ops/staging.h); integer tensors are refused.
    Tensor i32 = tensor_on({4, 3}, DType::kI32), i32_b = tensor_on({4, 3}, DType::kI32), undefined;
    const Tensor x = random_tensor({4, 3}, DType::kF32, 18);
    expect_invalid("scale_", [&] { scale_(i32, 2.0); });
    expect_invalid("sum_squares", [&] { sum_squares(i32); });
    expect_invalid("all_finite", [&] { all_finite(i32); });
    expect_invalid("count_zeros", [&] { count_zeros(i32); });
    expect_invalid("add_", [&] { add_(i32, i32_b); });
    expect_invalid("add_", [&] { add_(undefined, x); });
    expect_invalid("sum_squares", [&] { sum_squares(undefined); });
    const std::vector<Tensor> mixed = {x, random_tensor({4, 3}, DType::kF64, 20)};
    expect_invalid("sum_squares_each", [&] { sum_squares_each(mixed); });
    const std::vector<Tensor> with_i32 = {x, i32};
    expect_invalid("sum_squares_each", [&] { sum_squares_each(with_i32); });

    Tensor dweight = tensor_on({5, 3}, DType::kF32), dout = tensor_on({4, 5}, DType::kF32);
    const Tensor weight = random_tensor({5, 3}, DType::kF32, 19);
    expect_invalid("linear_backward", [&] { linear_backward(nullptr, &dweight, nullptr, dout, nullptr, weight); });

    Tensor rows = tensor_on({2, 3}, DType::kF32), table = tensor_on({4, 3}, DType::kF32);
    const std::vector<int64_t> past_end = {1, 4};
    expect_invalid("gather_rows", [&] { gather_rows(rows, table, past_end); });
    expect_invalid("scatter_add_rows", [&] { scatter_add_rows(table, rows, past_end); });

    Tensor q = tensor_on({2, 3, 2}, DType::kF32), kv = tensor_on({2, 2, 2}, DType::kF32),
           qkv = tensor_on({2, 14}, DType::kF32);
    expect_invalid("split_qkv", [&] { split_qkv(q, kv, kv, qkv, 3, 2, 2); });

    Tensor rope_x = tensor_on({2, 3, 1, 4}, DType::kF32);
    const std::vector<int64_t> five_positions = {0, 1, 2, 3, 4};
    expect_invalid("rope_forward", [&] { rope_forward(rope_x, rope_x, 2, 3, 4, 4, 10000.0, five_positions); });
    expect_invalid("rope_backward", [&] { rope_backward(rope_x, rope_x, 2, 3, 4, 4, 10000.0, five_positions); });

    AttentionDims keys_documents_only = test::attention_dims(2, 1, 1, 1);
    const std::vector<int32_t> documents = {0, 0};
    keys_documents_only.k_document_SB = documents.data();
    Tensor aq = tensor_on({2, 1, 1, 8}, DType::kF32), alse = tensor_on({1, 1, 2}, DType::kF32);
    expect_invalid("attention_forward",
                   [&] { attention_forward(aq, alse, aq, aq, aq, keys_documents_only, DropoutSpec{}); });
    // Value heads of v_head_dim = 5: v and out of the query / key width are refused, naming the tensor and dv; a
    // negative v_head_dim is refused.
    const AttentionDims narrow_values = test::attention_dims(2, 1, 1, 1, 5);
    Tensor av = tensor_on({2, 1, 1, 5}, DType::kF32);
    {
      for (const bool wide_v : {true, false}) {
        try {
          attention_forward(wide_v ? av : aq, alse, aq, aq, wide_v ? aq : av, narrow_values, DropoutSpec{});
          ADD_FAILURE() << "attention_forward accepted " << (wide_v ? "v" : "out") << " 8 wide with v_head_dim 5";
        } catch (const std::invalid_argument& error) {
          const std::string message = error.what();
          EXPECT_EQ(message.rfind(std::string("attention_forward: ") + (wide_v ? "v_SBGd" : "out_SBNd"), 0), 0u)
              << message;
          EXPECT_NE(message.find("dv=5"), std::string::npos) << message;
        }
      }
    }
    AttentionDims negative_value_dim = test::attention_dims(2, 1, 1, 1, -1);
    expect_invalid("attention_forward",
                   [&] { attention_forward(aq, alse, aq, aq, aq, negative_value_dim, DropoutSpec{}); });
    expect_invalid("attention_merge", [&] { attention_merge(aq, alse, aq, alse, negative_value_dim); });

    Tensor tokens = tensor_on({6, 3}, DType::kF32), pos = tensor_on({2, 3}, DType::kF32);
    expect_invalid("add_position_embedding", [&] { add_position_embedding(tokens, pos, 2, 1); });
    expect_invalid("position_embedding_backward", [&] { position_embedding_backward(pos, tokens, 2, 1); });

    // Ids outside [0, V) are std::out_of_range (loss.h).
    {
      const std::vector<int32_t> too_big = {1, 13}, negative = {-1, 2};
      Tensor emb = tensor_on({2, 3}, DType::kF32), losses = tensor_on({2}, DType::kF32),
             lse = tensor_on({2}, DType::kF32), stats = tensor_on({2, 2}, DType::kF32);
      const Tensor vocab = random_tensor({13, 3}, DType::kF32, 20), logits = random_tensor({2, 13}, DType::kF32, 21);
      const Tensor maxima = random_tensor({2}, DType::kF32, 22);
      EXPECT_THROW(embedding_forward(emb, too_big, vocab, 13), std::out_of_range) << device_name(device);
      EXPECT_THROW(embedding_forward(emb, negative, vocab, 13), std::out_of_range) << device_name(device);
      EXPECT_THROW(cross_entropy_forward(losses, lse, logits, too_big), std::out_of_range) << device_name(device);
      EXPECT_THROW(vocab_ce_local_stats(stats, logits, maxima, negative, 13, 0), std::out_of_range)
          << device_name(device);
    }
  }
}

// Megatron's get_capacity: ceil(tokens * topk / experts * capacity_factor).
TEST(OpsRouting, ExpertCapacityIsMegatronsCeiling) {
  EXPECT_EQ(expert_capacity(10, 2, 4, 1.5), 8);   // 5 * 1.5 = 7.5 -> 8
  EXPECT_EQ(expert_capacity(12, 2, 8, 1.0), 3);   // exactly 3
  EXPECT_EQ(expert_capacity(7, 1, 3, 1.0), 3);    // 2.33 -> 3
  EXPECT_EQ(expert_capacity(16, 2, 4, 0.25), 2);  // 8 * 0.25
}

// The MoE row moves', the grouped MLP's and the initialiser's argument errors.
TEST(OpsBadArgs, MoeRowsGroupedMlpAndInitErrors) {
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    Tensor i32 = tensor_on({4, 3}, DType::kI32), rows = tensor_on({2, 3}, DType::kF32),
           table = tensor_on({4, 3}, DType::kF32);
    const std::vector<int64_t> past_end = {1, 4};
    const std::vector<int64_t> two_runs = {0, 8};
    expect_invalid("normal_fill", [&] { normal_fill(i32, two_runs, 6, 1, 2, 0.02); });
    Tensor eleven = tensor_on({11}, DType::kF32);
    expect_invalid("normal_fill", [&] { normal_fill(eleven, two_runs, 6, 1, 2, 0.02); });  // 2 runs of 6
    const std::vector<int64_t> negative_first = {-6, 0};
    Tensor ten = tensor_on({10}, DType::kF32);
    expect_invalid("normal_fill", [&] { normal_fill(ten, negative_first, 5, 1, 2, 0.02); });
    expect_invalid("moe_permute", [&] { moe_permute(rows, table, past_end); });
    expect_invalid("moe_unpermute", [&] { moe_unpermute(table, rows, past_end); });
    expect_invalid("moe_unpermute_backward", [&] { moe_unpermute_backward(&rows, nullptr, table, past_end); });
    Tensor probs2 = tensor_on({2}, DType::kF32);
    const std::vector<int64_t> in_range = {1, 3};
    expect_invalid("moe_unpermute_backward",
                   [&] { moe_unpermute_backward(&rows, &probs2, table, in_range); });  // dprobs without probs
    const std::vector<int64_t> first_past = {3}, two_rows = {2}, overlap_first = {0, 1};
    const std::vector<int64_t> overlap_rows = {2, 2};
    Tensor four_rows = tensor_on({4, 3}, DType::kF32);
    expect_invalid("sort_chunks", [&] { sort_chunks(rows, table, first_past, two_rows); });
    expect_invalid("unsort_chunks", [&] { unsort_chunks(table, rows, first_past, two_rows); });
    expect_invalid("unsort_chunks", [&] { unsort_chunks(table, four_rows, overlap_first, overlap_rows); });

    // The grouped MLP's offsets and the saved activations its spec needs.
    Tensor w1 = tensor_on({5, 3}, DType::kF32), w2 = tensor_on({3, 5}, DType::kF32), y = tensor_on({4, 3}, DType::kF32),
           fc1 = tensor_on({4, 5}, DType::kF32), act = tensor_on({4, 5}, DType::kF32),
           probs4 = tensor_on({4}, DType::kF32);
    const std::vector<const Tensor*> fc1_weights = {&w1, &w1}, fc2_weights = {&w2, &w2};
    const GroupedMlpParams params{fc1_weights, {}, fc2_weights, {}};
    const std::vector<int64_t> three_offsets = {0, 1, 4}, decreasing = {0, 3, 2}, one_offset = {0};
    const GroupedMlpSpec gelu{Activation::kGelu, false}, on_input{Activation::kGelu, true};
    expect_invalid("grouped_mlp_forward", [&] {
      grouped_mlp_forward(y, fc1, &act, nullptr, nullptr, table, probs4, params, one_offset, gelu);
    });
    expect_invalid("grouped_mlp_forward", [&] {
      grouped_mlp_forward(y, fc1, &act, nullptr, nullptr, table, probs4, params, decreasing, gelu);
    });
    expect_invalid("grouped_mlp_forward", [&] {  // no experts
      grouped_mlp_forward(y, fc1, &act, nullptr, nullptr, table, probs4, GroupedMlpParams{}, one_offset, gelu);
    });
    expect_invalid("grouped_mlp_forward", [&] {  // the activation output is saved
      grouped_mlp_forward(y, fc1, nullptr, nullptr, nullptr, table, probs4, params, three_offsets, gelu);
    });
    expect_invalid("grouped_mlp_forward", [&] {  // probs on the input save x p
      grouped_mlp_forward(y, fc1, &act, nullptr, nullptr, table, probs4, params, three_offsets, on_input);
    });
    expect_invalid("grouped_mlp_backward", [&] {  // SwiGLU's fc1 is 2F wide
      grouped_mlp_backward(table, probs4, {}, y, table, nullptr, fc1, &act, nullptr, probs4, params, three_offsets,
                           {Activation::kSwiGLU, true});
    });
  }
}

// ---- devices ----------------------------------------------------------------------------------------------------

TEST(OpsDevices, SupportsWhatTheKernelTablesHold) {
  for (const Device device : kDevices) {
    for (const DType dtype : kDTypes) EXPECT_TRUE(supports("rmsnorm_forward", dtype, device)) << label(device, dtype);
    EXPECT_TRUE(supports("linear_forward", DType::kBF16, device));
    EXPECT_TRUE(grouped_mlp_fused(device));  // fp32 without quantization (the rest: ops_grouped_mlp_test)
    EXPECT_TRUE(supports("convert", DType::kF16, device));
    EXPECT_FALSE(supports("rmsnorm_forward", DType::kBF16, device));
    EXPECT_FALSE(supports("linear_forward", DType::kI32, device));
    EXPECT_NO_THROW(synchronize(device));
  }
  EXPECT_FALSE(supports("linear_forward", DType::kF32, Device::kCUDA));
  EXPECT_THROW(synchronize(Device::kCUDA), std::runtime_error);
  try {
    Tensor({4}, DType::kF32, MemCategory::kOther, Device::kCUDA);
    ADD_FAILURE() << "allocated on cuda";
  } catch (const std::runtime_error& error) {
    EXPECT_NE(std::string(error.what()).find("no allocator for it"), std::string::npos) << error.what();
  }
}

// The reference device's guard bytes: a write one element past the end, or before the start, of an allocation is
// named; the harness checks this after every op on the reference device.
TEST(OpsDevices, ReferenceGuardsCatchWritesOutsideAnAllocation) {
  Tensor t({3, 5}, DType::kF32, MemCategory::kOther, Device::kReference);
  EXPECT_EQ(outside_writes(t), "");
  for (const int64_t offset : {t.numel(), int64_t{-1}}) {
    float* element = t.data<float>() + offset;
    const float saved = *element;
    *element = 1.0f;
    const std::string problem = outside_writes(t);
    EXPECT_NE(problem.find(offset < 0 ? "before the start of a 60-byte" : "past the end of a 60-byte"),
              std::string::npos)
        << problem;
    *element = saved;  // repaired, so freeing it does not abort
  }
  EXPECT_EQ(outside_writes(t), "");
  // A slice of the same storage is checked against the whole allocation.
  EXPECT_EQ(outside_writes(t.slice_rows(1, 2)), "");
  EXPECT_EQ(outside_writes(Tensor({3}, DType::kF32)), "") << "the CPU device has no guards to check";
}

// The device picks the kernels: the reference linear layer sums in double (one rounding per output), the fast one
// is the fp32 sgemm, whose result differs in the last bits for a long inner dimension.
TEST(OpsDevices, EachDeviceRunsItsOwnKernels) {
  constexpr int64_t T = 4, I = 1024, O = 8;
  const Tensor inp = random_tensor({T, I}, DType::kF32, 23), weight = random_tensor({O, I}, DType::kF32, 24);
  std::vector<float> rounded_exact;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t o = 0; o < O; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < I; ++i) acc += test::get(inp, t * I + i) * test::get(weight, o * I + i);
      rounded_exact.push_back(static_cast<float>(acc));
    }
  }
  Tensor ref_out({T, O}, DType::kF32, MemCategory::kOther, Device::kReference), cpu_out({T, O}, DType::kF32);
  linear_forward(ref_out, inp.to(Device::kReference), weight.to(Device::kReference));
  linear_forward(cpu_out, inp, weight);
  const std::vector<float> ref(ref_out.span<float>().begin(), ref_out.span<float>().end());
  const std::vector<float> cpu(cpu_out.span<float>().begin(), cpu_out.span<float>().end());
  EXPECT_EQ(ref, rounded_exact);
  EXPECT_NE(cpu, rounded_exact);
  EXPECT_TRUE(close(cpu_out, ref_out, 1e-5));
  // Tensors of two devices in one op are refused, naming the op.
  try {
    linear_forward(cpu_out, inp.to(Device::kReference), weight);
    ADD_FAILURE() << "linear_forward mixed devices";
  } catch (const std::invalid_argument& error) {
    EXPECT_EQ(std::string(error.what()).rfind("linear_forward: ", 0), 0u) << error.what();
  }
  // The GEMM library a device's log line names is its own table's.
  EXPECT_EQ(gemm_library(Device::kReference), "naive reference loops");
  EXPECT_EQ(gemm_lowp_library(DType::kBF16, Device::kReference), "fp32 conversion + naive reference loops");
  EXPECT_NE(gemm_library(Device::kCPU).find("sgemm"), std::string::npos) << gemm_library(Device::kCPU);
  EXPECT_THROW(gemm_library(Device::kCUDA), std::invalid_argument);
}

// The unfused output layer + loss: whole logits, cross-entropy forward and backward, linear backward.
struct UnfusedOutputLayer {
  Tensor losses, dinp, dweight;
  UnfusedOutputLayer(const Tensor& inp, const Tensor& weight, const std::vector<int32_t>& targets,
                     const Tensor& dlosses) {
    const DType dtype = inp.dtype();
    const int64_t T = inp.dim(0), I = inp.dim(1), V = weight.dim(0);
    Tensor logits = tensor_on({T, V}, dtype), lse = tensor_on({T}, dtype);
    losses = tensor_on({T}, dtype);
    linear_forward(logits, inp, weight);
    cross_entropy_forward(losses, lse, logits, targets);
    cross_entropy_backward(logits, dlosses, logits, lse, targets);
    dinp = tensor_on({T, I}, dtype);
    dweight = tensor_on({V, I}, dtype);
    linear_backward(&dinp, &dweight, nullptr, logits, &inp, weight);
  }
};

// The chunk size bounds the transient logits and changes nothing else: losses and gradients from chunks of 1, 3 and
// all 8 tokens agree, and equal the unfused ops.
TEST(LinearCrossEntropy, ChunkingChangesNothing) {
  constexpr int64_t T = 8, I = 6, V = 11;
  const std::vector<int32_t> targets = {3, 0, 10, 4, 4, 7, 1, 9};
  const Tensor inp = random_tensor({T, I}, DType::kF64, 31), weight = random_tensor({V, I}, DType::kF64, 32, 2.0);
  const Tensor dlosses = random_tensor({T}, DType::kF64, 33);
  const UnfusedOutputLayer unfused(inp, weight, targets, dlosses);
  const Tensor &losses = unfused.losses, &dinp = unfused.dinp, &dweight = unfused.dweight;
  for (const int64_t chunk : {int64_t{1}, int64_t{3}, T, 2 * T}) {
    Tensor fused_losses = tensor_on({T}, DType::kF64), fused_dinp = tensor_on({T, I}, DType::kF64),
           fused_dweight = tensor_on({V, I}, DType::kF64);
    linear_cross_entropy(fused_losses, inp, weight, targets, chunk, &dlosses, &fused_dinp, &fused_dweight);
    EXPECT_TRUE(close(fused_losses, losses, 1e-12)) << "chunk " << chunk;
    EXPECT_TRUE(close(fused_dinp, dinp, 1e-12)) << "chunk " << chunk;
    EXPECT_TRUE(close(fused_dweight, dweight, 1e-12)) << "chunk " << chunk;
  }
}

// Under 16-bit activations on the convert path the fused layer's loss rounds the fp32 logits as it reads them: the
// same losses and gradients, bit for bit, as the unfused ops, whose linear layer rounds its logits when it writes them
// (one chunk; the input gradient and the losses for any chunking).
TEST(LinearCrossEntropy, ConvertPathUnderSixteenBitsMatchesTheUnfusedOps) {
  constexpr int64_t T = 9, I = 16, V = 37;
  const std::vector<int32_t> targets = {3, 0, 36, 4, 4, 7, 1, 9, 20};
  const kernels::cpu::ScopedLowpGemmPath convert(kernels::cpu::LowpGemmPath::kConvert);
  for (const DType low : {DType::kBF16, DType::kF16}) {
    Tensor inp = random_tensor({T, I}, DType::kF32, 41), weight = random_tensor({V, I}, DType::kF32, 42, 4.0);
    Tensor dlosses = random_tensor({T}, DType::kF32, 43);
    round_to_dtype_(inp, low);
    round_to_dtype_(weight, low);
    const ScopedActivationDType precision(low, Device::kCPU, ActivationStorage::kF32);
    const UnfusedOutputLayer unfused(inp, weight, targets, dlosses);
    const Tensor &losses = unfused.losses, &dinp = unfused.dinp, &dweight = unfused.dweight;
    for (const int64_t chunk : {int64_t{2}, T}) {
      Tensor fused_losses = tensor_on({T}, DType::kF32), fused_dinp = tensor_on({T, I}, DType::kF32),
             fused_dweight = tensor_on({V, I}, DType::kF32);
      linear_cross_entropy(fused_losses, inp, weight, targets, chunk, &dlosses, &fused_dinp, &fused_dweight);
      const std::string what = std::string(dtype_name(low)) + ", chunk " + std::to_string(chunk);
      EXPECT_TRUE(close(fused_losses, losses, 0.0)) << what;
      EXPECT_TRUE(close(fused_dinp, dinp, 0.0)) << what;
      // Several chunks add their weight gradients in another order.
      EXPECT_TRUE(close(fused_dweight, dweight, chunk == T ? 0.0 : 1e-6)) << what;
    }
  }
}

TEST(LinearCrossEntropy, ChunkRowsFollowTheBudget) {
  EXPECT_EQ(linear_cross_entropy_chunk_rows(2048, 32000, int64_t{32} << 20), 256);     // 32 MiB / (4 B * 32000): 262
  EXPECT_EQ(linear_cross_entropy_chunk_rows(100, 32000, int64_t{32} << 20), 100);      // never more than T
  EXPECT_EQ(linear_cross_entropy_chunk_rows(100, 32000, 16), 1);                       // never less than one row
  EXPECT_EQ(linear_cross_entropy_chunk_rows(2048, 32000, int64_t{32} << 20, 2), 512);  // 16-bit logits: 524
  EXPECT_EQ(linear_cross_entropy_chunk_rows(2048, 32000, int64_t{8} << 20), 64);       // 65 rows
  EXPECT_EQ(linear_cross_entropy_chunk_rows(2048, 50304, int64_t{32} << 20), 160);     // 166 rows: multiple of 16
  EXPECT_EQ(linear_cross_entropy_chunk_rows(2048, 50304, int64_t{32} << 20, 2), 320);  // 333: of 64 for 16 bits
  EXPECT_EQ(linear_cross_entropy_chunk_rows(2048, 32000, int64_t{1} << 20), 8);        // under 16: as they fit
  EXPECT_EQ(linear_cross_entropy_chunk_rows(2048, 32000, int64_t{2} << 20, 2), 32);    // under 64: as they fit
  EXPECT_THROW(linear_cross_entropy_chunk_rows(2048, 32000, 16, 0), std::invalid_argument);
}

TEST(LinearCrossEntropy, LogitBytesAreSixteenBitOnlyOnTheNativeUnsplitPath) {
  const Tensor weight = random_tensor({5, 3}, DType::kF32, 2);
  EXPECT_EQ(linear_cross_entropy_logit_bytes(weight, false), 4) << "fp32 activations";
  for (const DType low : {DType::kBF16, DType::kF16}) {
    const ScopedActivationDType precision(low);
    EXPECT_EQ(linear_cross_entropy_logit_bytes(weight, false), gemm_lowp_native(low) ? 2 : 4) << dtype_name(low);
    EXPECT_EQ(linear_cross_entropy_logit_bytes(weight, true), 4) << dtype_name(low) << ", vocabulary split";
  }
  const Tensor weight64 = random_tensor({5, 3}, DType::kF64, 2);
  EXPECT_EQ(linear_cross_entropy_logit_bytes(weight64, false), 8);
}

TEST(LinearCrossEntropy, RefusesGradientsWithoutDlossesAndZeroChunks) {
  const Tensor inp = random_tensor({2, 3}, DType::kF32, 1), weight = random_tensor({5, 3}, DType::kF32, 2);
  Tensor losses = tensor_on({2}, DType::kF32), dinp = tensor_on({2, 3}, DType::kF32);
  const std::vector<int32_t> targets = {1, 4};
  const auto expect_refused = [](const auto& call) {
    try {
      call();
      ADD_FAILURE() << "no error";
    } catch (const std::invalid_argument& error) {
      EXPECT_EQ(std::string(error.what()).rfind("linear_cross_entropy: ", 0), 0u) << error.what();
    }
  };
  expect_refused([&] { linear_cross_entropy(losses, inp, weight, targets, 0); });
  expect_refused([&] { linear_cross_entropy(losses, inp, weight, targets, 1, nullptr, &dinp, nullptr); });
}

// ---- low precision ----------------------------------------------------------------------------------------------

// Tolerance of a low-precision output, derived from the formats. The inputs are exact in the low dtype and so are
// their products in fp32 (8 + 8 or 11 + 11 significant bits), so the fast backend differs from the exact sum only by
// its fp32 summation of the element's n terms, at most (n + 2) * 2^-24 * S_abs (S_abs: the sum of the terms'
// absolute values; the 2 covers the old value or bias and a scaling), and by one final rounding to the output
// format. The reference rounds the exact sum once. Two such roundings are at most one unit in the last place of the
// output format apart (2^-7 of the element's binade for bf16, 2^-10 for fp16, 2^-23 for fp32):
//   |fast - reference| <= ulp_out(max(|fast|, |reference|)) + (n + 2) * 2^-24 * S_abs.
double ulp_of(const DType dtype, const double x) {
  const int mantissa_bits = dtype == DType::kBF16 ? 7 : (dtype == DType::kF16 ? 10 : 23);
  const int min_exponent = dtype == DType::kF16 ? -14 : -126;
  return std::ldexp(1.0, std::max(x == 0.0 ? min_exponent : std::ilogb(x), min_exponent) - mantissa_bits);
}

::testing::AssertionResult lowp_close(const Tensor& got, const Tensor& want, const test::AbsSum& abs_sum) {
  if (got.dtype() != want.dtype() || got.numel() != want.numel() ||
      static_cast<size_t>(got.numel()) != abs_sum.values.size()) {
    return ::testing::AssertionFailure() << "dtype or size differs";
  }
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = test::get(got, i), w = test::get(want, i);
    const double bound = ulp_of(got.dtype(), std::max(std::abs(g), std::abs(w))) +
                         static_cast<double>(abs_sum.terms + 2) * 0x1p-24 * abs_sum.values[static_cast<size_t>(i)];
    if (!(std::abs(g - w) <= bound)) {
      return ::testing::AssertionFailure() << dtype_name(got.dtype()) << " element " << i << " is " << g
                                           << ", reference " << w << ", bound " << bound;
    }
  }
  return ::testing::AssertionSuccess();
}

Env make_lowp_env(const test::LowpCase& c, const Device device) {
  Env env(c.low, stream_key(c.name), device);
  c.build(env);
  return env;
}

// The GEMM paths of the fast backend for a case's dtype: convert always, native where oneDNN has kernels for it.
std::vector<kernels::cpu::LowpGemmPath> lowp_paths(const DType low) {
  const auto type = low == DType::kBF16 ? kernels::LowpType::kBF16 : kernels::LowpType::kF16;
  std::vector<kernels::cpu::LowpGemmPath> paths = {kernels::cpu::LowpGemmPath::kConvert};
  if (kernels::cpu::lowp_native_available(type)) paths.push_back(kernels::cpu::LowpGemmPath::kNative);
  return paths;
}

class OpsLowPrecision : public ::testing::TestWithParam<size_t> {};

TEST_P(OpsLowPrecision, MatchesReferenceDevice) {
  const test::LowpCase& c = test::lowp_cases()[GetParam()];
  Env ref = make_lowp_env(c, Device::kReference);
  const auto initial = ref.snapshot();
  const std::map<std::string, test::AbsSum> forward_sums = c.abs_sums(ref);
  std::map<std::string, Tensor> ref_forward, ref_backward;
  run_checked(c.forward, ref, c.name + " forward on the reference device");
  ref_forward = ref.snapshot();
  expect_unchanged_except(ref, c.outputs, initial, c.name + ", " + label(Device::kReference, c.low) + " forward");
  run_checked(c.backward, ref, c.name + " backward on the reference device");
  ref_backward = ref.snapshot();
  expect_unchanged_except(ref, c.grads, ref_forward, c.name + ", " + label(Device::kReference, c.low) + " backward");
  for (const Config& config : kConfigs) {
    for (const auto path : lowp_paths(c.low)) {
      const kernels::cpu::ScopedLowpGemmPath path_scope(path);
      const ThreadCount threads(config.threads);
      const std::string what =
          c.name + ", " + label(config, c.low) + " " + std::string(kernels::cpu::lowp_gemm_path_name(path));
      Env fwd = make_lowp_env(c, config.device);
      c.forward(fwd);
      for (const auto& [name, t] : fwd.tensors()) {
        if (contains(c.outputs, name)) {
          EXPECT_TRUE(lowp_close(t, ref_forward.at(name), forward_sums.at(name))) << what << " forward: " << name;
        } else {
          EXPECT_EQ(test::values(t), test::values(initial.at(name))) << what << " forward wrote into " << name;
        }
      }
      // The backward alone, from the reference forward's tensors.
      Env bwd = make_lowp_env(c, Device::kReference);
      c.forward(bwd);
      bwd.to(config.device);
      const auto before = bwd.snapshot();
      c.backward(bwd);
      for (const auto& [name, t] : bwd.tensors()) {
        if (contains(c.grads, name)) {
          EXPECT_TRUE(lowp_close(t, ref_backward.at(name), forward_sums.at(name))) << what << " backward: " << name;
        } else {
          EXPECT_EQ(test::values(t), test::values(before.at(name))) << what << " backward wrote into " << name;
        }
      }
    }
  }
}

std::string lowp_case_name(const ::testing::TestParamInfo<size_t>& param) {
  return test::lowp_cases()[param.param].name;
}

std::vector<size_t> lowp_case_indices() {
  std::vector<size_t> out(test::lowp_cases().size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = i;
  return out;
}
INSTANTIATE_TEST_SUITE_P(AllLowpCases, OpsLowPrecision, ::testing::ValuesIn(lowp_case_indices()), lowp_case_name);

// Both devices refuse dtype mixes a low-precision linear layer does not take, and wrong sizes, naming the op.
TEST(OpsLowPrecision, BadArgumentsAreRefused) {
  const auto rand = [](const std::vector<int64_t>& shape, const DType dtype) { return random_tensor(shape, dtype, 3); };
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    for (const DType low : {DType::kBF16, DType::kF16}) {
      const DType other_low = low == DType::kBF16 ? DType::kF16 : DType::kBF16;
      const Tensor weight = rand({5, 4}, low), inp = rand({3, 4}, low), dout = rand({3, 5}, low);
      const Tensor bias = rand({5}, DType::kF32);
      struct Bad {
        std::string what;
        std::function<void()> call;
      };
      Tensor out = rand({3, 5}, low);
      std::vector<Bad> bads = {
          {"fp32 input",
           [&] {
             linear_forward(out, rand({3, 4}, DType::kF32), weight);
           }},
          {"other low input",
           [&] {
             linear_forward(out, rand({3, 4}, other_low), weight);
           }},
          {"fp64 output",
           [&] {
             Tensor o = rand({3, 5}, DType::kF64);
             linear_forward(o, inp, weight);
           }},
          {"other low output",
           [&] {
             Tensor o = rand({3, 5}, other_low);
             linear_forward(o, inp, weight);
           }},
          {"int32 bias",
           [&] {
             const Tensor b = tensor_on({5}, DType::kI32);
             linear_forward(out, inp, weight, &b);
           }},
          {"fp64 bias",
           [&] {
             const Tensor b = rand({5}, DType::kF64);
             linear_forward(out, inp, weight, &b);
           }},
          {"fp64 input, fp32 weight",  // (a 16-bit input with an fp32 weight is a 16-bit activation: staged)
           [&] {
             linear_forward(out, rand({3, 4}, DType::kF64), rand({5, 4}, DType::kF32));
           }},
          {"output size",
           [&] {
             Tensor o = rand({3, 6}, low);
             linear_forward(o, inp, weight);
           }},
          {"input size",
           [&] {
             linear_forward(out, rand({3, 3}, low), weight);
           }},
          {"bias size",
           [&] {
             const Tensor b = rand({4}, low);
             linear_forward(out, inp, weight, &b);
           }},
      };
      Tensor dinp = rand({3, 4}, DType::kF32), dweight = rand({5, 4}, DType::kF32), dbias = rand({5}, DType::kF32);
      std::vector<Bad> backward_bads = {
          {"fp32 dout",
           [&] {
             linear_backward(&dinp, nullptr, nullptr, rand({3, 5}, DType::kF32), nullptr, weight);
           }},
          {"other low inp",
           [&] {
             linear_backward(&dinp, &dweight, nullptr, dout, &static_cast<const Tensor&>(rand({3, 4}, other_low)),
                             weight);
           }},
          {"fp64 dinp",
           [&] {
             Tensor d = rand({3, 4}, DType::kF64);
             linear_backward(&d, nullptr, nullptr, dout, nullptr, weight);
           }},
          {"other low dweight",
           [&] {
             Tensor d = rand({5, 4}, other_low);
             linear_backward(nullptr, &d, nullptr, dout, &inp, weight);
           }},
          {"int64 dbias",
           [&] {
             Tensor d = tensor_on({5}, DType::kI64);
             linear_backward(nullptr, nullptr, &d, dout, nullptr, weight);
           }},
          {"dinp size",
           [&] {
             Tensor d = rand({3, 5}, low);
             linear_backward(&d, nullptr, nullptr, dout, nullptr, weight);
           }},
          {"dweight size",
           [&] {
             Tensor d = rand({4, 4}, DType::kF32);
             linear_backward(nullptr, &d, nullptr, dout, &inp, weight);
           }},
          {"dbias size",
           [&] {
             Tensor d = rand({6}, DType::kF32);
             linear_backward(nullptr, nullptr, &d, dout, nullptr, weight);
           }},
          {"dweight without inp", [&] { linear_backward(nullptr, &dweight, &dbias, dout, nullptr, weight); }},
      };
      {
        for (const auto& [list, op] :
             {std::pair{&bads, "linear_forward: "}, std::pair{&backward_bads, "linear_backward: "}}) {
          for (const Bad& bad : *list) {
            const std::string what =
                bad.what + " (" + std::string(dtype_name(low)) + " weight, " + std::string(device_name(device)) + ")";
            try {
              bad.call();
              ADD_FAILURE() << what << ": no error";
            } catch (const std::invalid_argument& error) {
              EXPECT_EQ(std::string(error.what()).rfind(op, 0), 0u) << what << ": " << error.what();
            }
          }
        }
      }
    }
  }
}

// The values of every conversion pair against dtype.h's scalar functions, bit for bit, on both devices; and its
// refusals.
TEST(OpsConvert, EveryPairIsTheScalarRounding) {
  // Exact in fp32 (so fp64 sources round as their fp32 twins): specials, the fp16 limits, denormals of each format.
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -2.5f,
                               65504.0f,
                               65520.0f,
                               1e-8f,
                               3e-5f,
                               1e-40f,
                               3.0e38f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN()};
  std::mt19937 gen(17);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  for (int i = 0; i < 39999; ++i) values.push_back(normal(gen));  // 40012 in all: two rows
  const int64_t n = static_cast<int64_t>(values.size());
  const auto bits_of = [](const Tensor& t, const int64_t i) -> uint64_t {
    switch (dtype_size(t.dtype())) {
      case 2: return t.data<uint16_t>()[i];
      case 4: return std::bit_cast<uint32_t>(t.data<float>()[i]);
      default: return std::bit_cast<uint64_t>(t.data<double>()[i]);
    }
  };
  // The expected element: the value rounded to `dtype` by dtype.h (via fp32, exact here).
  const auto expected = [](const float v, const DType from, const DType to) -> uint64_t {
    float x = v;  // the source element's value
    if (from == DType::kBF16) x = bf16_to_fp32(fp32_to_bf16(v));
    if (from == DType::kF16) x = fp16_to_fp32(fp32_to_fp16(v));
    switch (to) {
      case DType::kBF16: return fp32_to_bf16(x);
      case DType::kF16: return fp32_to_fp16(x);
      case DType::kF32: return std::bit_cast<uint32_t>(x);
      default: return std::bit_cast<uint64_t>(static_cast<double>(x));
    }
  };
  const DType dtypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16};
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    for (const DType from : dtypes) {
      Tensor wide({n}, DType::kF32, MemCategory::kOther, Device::kReference);
      std::copy(values.begin(), values.end(), wide.data<float>());
      Tensor src_on_reference({n}, from, MemCategory::kOther, Device::kReference);
      convert(src_on_reference, wide);  // the source elements from the reference conversion
      const Tensor src = src_on_reference.to(device);
      for (const DType to : dtypes) {
        Tensor dst = tensor_on({2, n / 2}, to);
        convert(dst, src);
        for (int64_t i = 0; i < n; ++i) {
          const bool nan = std::isnan(values[static_cast<size_t>(i)]);
          if (nan) {
            EXPECT_TRUE(std::isnan(test::get(dst, i))) << dtype_name(from) << " -> " << dtype_name(to);
            continue;
          }
          ASSERT_EQ(bits_of(dst, i), expected(values[static_cast<size_t>(i)], from, to))
              << dtype_name(from) << " -> " << dtype_name(to) << " on " << device_name(device) << ", element " << i
              << " = " << values[static_cast<size_t>(i)];
        }
      }
    }
  }
  for (const Device device : kDevices) {
    const TestDevice scope(device);
    const Tensor src = random_tensor({4, 3}, DType::kF32, 1);
    const auto refused = [&](Tensor dst, const Tensor& from, const std::string& what) {
      try {
        convert(dst, from);
        ADD_FAILURE() << what << ": no error";
      } catch (const std::invalid_argument& error) {
        EXPECT_EQ(std::string(error.what()).rfind("convert: ", 0), 0u) << what << ": " << error.what();
      }
    };
    refused(tensor_on({13}, DType::kBF16), src, "one element too many");
    refused(tensor_on({4, 3}, DType::kI32), src, "int32 destination");
    refused(tensor_on({4, 3}, DType::kF16), tensor_on({4, 3}, DType::kU8), "uint8 source");
    refused(Tensor(), src, "undefined destination");
  }
}

TEST(OpsGemmLibrary, NamesTheLibraryOfEachDType) {
  EXPECT_NE(gemm_library().find("sgemm"), std::string::npos) << gemm_library();
  EXPECT_NE(gemm_lowp_library(DType::kBF16).find("bf16"), std::string::npos) << gemm_lowp_library(DType::kBF16);
  EXPECT_NE(gemm_lowp_library(DType::kF16).find("fp16"), std::string::npos) << gemm_lowp_library(DType::kF16);
  EXPECT_THROW(gemm_lowp_library(DType::kF32), std::invalid_argument);
  // The 16-bit kernels run where the library is not the conversion to fp32 in front of the sgemm.
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    EXPECT_EQ(gemm_lowp_native(dtype), gemm_lowp_library(dtype).find("conversion") == std::string::npos)
        << gemm_lowp_library(dtype);
    EXPECT_FALSE(gemm_lowp_native(dtype, Device::kReference));
  }
  EXPECT_THROW(gemm_lowp_native(DType::kF32), std::invalid_argument);
}

TEST(OpsAttentionProducts, NamesTheProductsOfEachDType) {
  EXPECT_EQ(attention_products(DType::kF32), "fp32 products");
  EXPECT_EQ(attention_products(DType::kF16), "fp32 products");
  const bool bf16 = kernels::cpu::attention_product_path() == kernels::cpu::AttentionProductPath::kBF16;
  EXPECT_EQ(attention_products(DType::kBF16).rfind(bf16 ? "bf16 products on " : "fp32 products", 0), 0u)
      << attention_products(DType::kBF16);
  const kernels::cpu::ScopedAttentionProductPath fp32(kernels::cpu::AttentionProductPath::kF32);
  EXPECT_EQ(attention_products(DType::kBF16), "fp32 products");
}

}  // namespace
}  // namespace moecore::ops
