// The 16-bit gradient buffer in one process (Megatron's grad buffer in the weights' dtype: --grad-reduce-in-bf16,
// --main-grads-dtype bf16, --fp16 without --accumulate-allreduce-grads-in-fp32): each micro-batch's gradients are
// added into 16-bit values, so fp16 accumulation can overflow to Inf and the optimizer's unscale check sees it; the
// buffer's values against a naive re-implementation of Megatron's order; Megatron's clipping threshold, and clipping
// fused into the optimizer step. The
// 1/DP scaling and the 16-bit reduction over two ranks are tested under mpirun (tests/parallel/grad_buffer16_main.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "moecore/optim/adamw_optimizer.h"
#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/dtype.h"
#include "moecore/tensor/rng.h"

namespace moecore {
namespace {

ParamStore make_model() {
  ParamStore params;
  const auto add = [&](const std::string& name, const std::vector<int64_t>& shape, const int module) {
    Param p = make_param(name, shape, InitKind::kNormal);
    p.module = module;
    init_param(p, 5, 0.5, 4);
    params.push_back(std::move(p));
  };
  add("embedding.word_embeddings.weight", {17, 8}, -1);
  add("decoder.layers.0.linear_qkv.weight", {24, 8}, 0);
  add("decoder.layers.0.input_layernorm.weight", {8}, 0);
  add("output_layer.weight", {17, 8}, 1);
  return params;
}

DdpOptions ddp_options(const DType grad_dtype, const bool dist_opt) {
  DdpOptions o;
  o.grad_dtype = grad_dtype;
  o.use_distributed_optimizer = dist_opt;
  return o;
}

// Megatron's bf16 / fp16 tensor ops: fp32 arithmetic, the result rounded to the 16-bit format.
float round16(const float x, const DType dtype) {
  return dtype == DType::kBF16 ? bf16_to_fp32(fp32_to_bf16(x)) : fp16_to_fp32(fp32_to_fp16(x));
}

struct GradBufferCase {
  DType grad_dtype;
  bool dist_opt;
};

class GradBuffer16 : public ::testing::TestWithParam<GradBufferCase> {};

// Random gradients over three micro-batches, handed over module by module as the model's backward does. Megatron's
// order, naively: main_grad = round16(main_grad + wgrad) per micro-batch; one rank, so no 1/DP scaling and the
// reduction leaves the values; the optimizer reads them as fp32.
TEST_P(GradBuffer16, AccumulatesIn16BitsAsMegatron) {
  const auto [grad_dtype, dist_opt] = GetParam();
  ParamStore params = make_model();
  DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), ddp_options(grad_dtype, dist_opt));
  std::vector<std::vector<float>> want;
  for (const Param& p : params) want.emplace_back(static_cast<size_t>(p.grad.numel()), 0.0f);
  ddp.zero_grad();
  int differs_from_fp32 = 0;
  std::vector<std::vector<double>> exact = {params.size(), std::vector<double>()};
  for (size_t i = 0; i < params.size(); ++i) exact[i].assign(static_cast<size_t>(params[i].grad.numel()), 0.0);
  for (int mb = 0; mb < 3; ++mb) {
    ddp.set_last_microbatch(mb == 2);
    for (int module = 1; module >= -1; --module) {
      for (size_t i = 0; i < params.size(); ++i) {
        Param& p = params[i];
        if (p.module != module) continue;
        const CounterRng rng(static_cast<uint64_t>(40 + mb), stream_key(p.name));
        for (int64_t e = 0; e < p.grad.numel(); ++e) {
          const auto g = static_cast<float>(rng.normal(static_cast<uint64_t>(e)) * 3.0);
          p.grad.data<float>()[e] += g;
          float& w = want[i][static_cast<size_t>(e)];
          w = round16(w + g, grad_dtype);
          exact[i][static_cast<size_t>(e)] += g;
        }
      }
      ddp.after_backward(module);
    }
  }
  ddp.finish_grad_sync();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::span<const float> got = std::as_const(params[i].grad).span<float>();
    for (size_t e = 0; e < got.size(); ++e) {
      ASSERT_EQ(got[e], want[i][e]) << params[i].name << " element " << e;
      differs_from_fp32 += got[e] != round16(static_cast<float>(exact[i][e]), grad_dtype);
    }
  }
  EXPECT_GT(differs_from_fp32, 0) << "the per-micro-batch rounding shows against an fp32 accumulation";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GradBuffer16,
                         ::testing::Values(GradBufferCase{DType::kBF16, false}, GradBufferCase{DType::kBF16, true},
                                           GradBufferCase{DType::kF16, false}, GradBufferCase{DType::kF16, true}));

// Two micro-batches of 40000 in one element: 80000 overflows fp16 (max 65504) in a 16-bit accumulation but not in
// fp32; the optimizer's unscale check (Megatron's _unscale_main_grads_and_check_for_nan) reports the Inf.
class Fp16GradBuffer : public ::testing::TestWithParam<bool> {};  // with the distributed optimizer or without

TEST_P(Fp16GradBuffer, AccumulationOverflowIsFoundByTheUnscaleCheck) {
  const bool dist_opt = GetParam();
  const auto run = [&](const DType grad_dtype, bool& inf_after_accumulation) {
    ParamStore params = make_model();
    DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), ddp_options(grad_dtype, dist_opt));
    AdamWOptions adam;
    adam.params_dtype = DType::kF16;
    DistributedAdamW opt(ddp, params, adam);
    ddp.zero_grad();
    Param& qkv = params[1];
    for (int mb = 0; mb < 2; ++mb) {
      ddp.set_last_microbatch(mb == 1);
      for (int module = 1; module >= -1; --module) {
        if (module == qkv.module) qkv.grad.data<float>()[3] += 40000.0f;
        ddp.after_backward(module);
      }
    }
    inf_after_accumulation = std::isinf(qkv.grad.data<float>()[3]);
    ddp.finish_grad_sync();
    return opt.unscale_grads_and_check_for_nan(1.0f / 4.0f);  // a loss scale of 4
  };
  bool inf16 = false, inf32 = true;
  EXPECT_TRUE(run(DType::kF16, inf16)) << "the fp16 buffer's Inf reaches the optimizer's check";
  EXPECT_TRUE(inf16) << "40000 + 40000 overflows in the fp16 buffer";
  EXPECT_FALSE(run(DType::kF32, inf32)) << "--accumulate-allreduce-grads-in-fp32: 80000 / 4 is finite";
  EXPECT_FALSE(inf32);
}

INSTANTIATE_TEST_SUITE_P(DistributedOptimizer, Fp16GradBuffer, ::testing::Bool());

// Megatron's clip_grad_by_total_norm_fp32: clip_coeff = max_norm / (norm + 1e-6), applied when below 1, so a norm
// just under max_norm is clipped too; a norm well under it is not.
TEST(GradClipping, MegatronThreshold) {
  const auto clipped = [](const double norm_target) {
    ParamStore params;
    params.push_back(make_param("w", {1}, InitKind::kZeros));
    params[0].grad.data<float>()[0] = static_cast<float>(norm_target);
    AdamWOptimizer opt(params, AdamWOptions{});
    const double norm = opt.clip_grad_norm(1.0);
    return std::pair{norm, static_cast<double>(params[0].grad.data<float>()[0])};
  };
  const auto [norm, grad] = clipped(1.0 - 5e-7);
  EXPECT_LT(norm, 1.0);
  EXPECT_NEAR(grad, norm / (norm + 1e-6), 1e-7);
  EXPECT_LT(grad, norm) << "clipped";
  const auto [small_norm, small_grad] = clipped(0.5);
  EXPECT_EQ(small_grad, small_norm);
}

// The train step's clipping: grad_norm then step(lr, clip_coefficient) applies the coefficient as the update reads
// each gradient and writes the 16-bit weights in the same pass; it must be clip_grad_norm then step(lr) bit for bit:
// weights, main parameters and moments, over three steps, each clipped, with and without the distributed optimizer,
// with fp32 and bf16 gradient buffers (the latter clip in place and round, as Megatron's 16-bit main grads).
struct FusedClipCase {
  DType params_dtype, grad_dtype;
  bool dist_opt;
};
class FusedClip : public ::testing::TestWithParam<FusedClipCase> {};

TEST_P(FusedClip, IsTheSeparateClipBitForBit) {
  const auto [params_dtype, grad_dtype, dist_opt] = GetParam();
  struct Run {
    ParamStore params = make_model();
    DistributedDataParallel ddp;
    DistributedAdamW opt;
    Run(const DType params_dtype, const DType grad_dtype, const bool dist_opt)
        : ddp(params, parallel::ParallelState::single_process(), ddp_options(grad_dtype, dist_opt)),
          opt(ddp, params, [&] {
            AdamWOptions adam;
            adam.params_dtype = params_dtype;
            adam.weight_decay = 0.1;
            return adam;
          }()) {}
    void backward(const int step) {
      ddp.zero_grad();
      ddp.set_last_microbatch(true);
      for (int module = 1; module >= -1; --module) {
        for (Param& p : params) {
          if (p.module != module) continue;
          const CounterRng rng(static_cast<uint64_t>(70 + step), stream_key(p.name));
          for (int64_t e = 0; e < p.grad.numel(); ++e) {
            p.grad.data<float>()[e] += static_cast<float>(rng.normal(static_cast<uint64_t>(e)) * 4.0);
          }
        }
        ddp.after_backward(module);
      }
      ddp.finish_grad_sync();
    }
  };
  Run separate(params_dtype, grad_dtype, dist_opt), fused(params_dtype, grad_dtype, dist_opt);
  constexpr double kMaxNorm = 1.0;
  for (int step = 0; step < 3; ++step) {
    separate.backward(step);
    fused.backward(step);
    const double norm = separate.opt.clip_grad_norm(kMaxNorm);
    separate.opt.step(1e-2);
    const double fused_norm = fused.opt.grad_norm();
    ASSERT_EQ(fused_norm, norm);
    ASSERT_TRUE(clip_coefficient(kMaxNorm, norm).has_value()) << "every step clips";
    fused.opt.step(1e-2, *clip_coefficient(kMaxNorm, fused_norm));
  }
  fused.ddp.wait_param_gather();
  separate.ddp.wait_param_gather();
  for (size_t i = 0; i < separate.params.size(); ++i) {
    const std::span<const float> want = std::as_const(separate.params[i].value).span<float>();
    const std::span<const float> got = std::as_const(fused.params[i].value).span<float>();
    for (size_t e = 0; e < want.size(); ++e) ASSERT_EQ(got[e], want[e]) << separate.params[i].name << " " << e;
  }
  const std::vector<AdamWMomentSlice> want = separate.opt.moment_slices(), got = fused.opt.moment_slices();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    for (const auto& [g, w] :
         {std::pair{&got[i].exp_avg, &want[i].exp_avg}, std::pair{&got[i].exp_avg_sq, &want[i].exp_avg_sq},
          std::pair{&got[i].main_param, &want[i].main_param}}) {
      ASSERT_EQ(g->defined(), w->defined());
      if (!w->defined()) continue;
      for (int64_t e = 0; e < w->numel(); ++e) ASSERT_EQ(g->data<float>()[e], w->data<float>()[e]) << "slice " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Precisions, FusedClip,
    ::testing::Values(FusedClipCase{DType::kF32, DType::kF32, false}, FusedClipCase{DType::kF32, DType::kF32, true},
                      FusedClipCase{DType::kBF16, DType::kF32, false}, FusedClipCase{DType::kBF16, DType::kF32, true},
                      FusedClipCase{DType::kBF16, DType::kBF16, true}, FusedClipCase{DType::kF16, DType::kF32, true}));

}  // namespace
}  // namespace moecore
