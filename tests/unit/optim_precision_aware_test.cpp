// The precision-aware distributed optimizer in one process (DistributedAdamW with reduced-format states,
// optim/scaled_state.h) against the same optimizer with fp32 states:
// - step 1 from zero moments: the update runs on the fp32 values before they are stored, so the weights are
//   bit-identical and each stored moment is the reference rounding (optimizer_state_reference.h) of the fp32 one;
// - step 2 starts from the rounded moments: u = lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) is monotone in each of the
//   moments, so the weight lies between the updates at the corners of the moments' rounding intervals (each moment
//   within its format's rounding bound), computed in double;
// - fp16 main parameters with bf16 weights: initialised from the weights as TE's set_scaled_state, within rounding of
//   the fp32-main run after a step;
// - checkpoint exchange: moment_slices are fp32 copies, load_moment_slices stores them back (any format to any);
// - memory: the states' bytes fall with the format (bf16 half, fp8 a quarter);
// - bf16 main gradients: rounded after every micro-batch's backward, so they accumulate in bf16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/tensor/memory_tracker.h"
#include "moecore/tensor/rng.h"
#include "optimizer_state_reference.h"

namespace moecore {
namespace {

using quant::StateFormat;

constexpr double kLr = 1e-2;

AdamWOptions adam_options(const StateFormat m, const StateFormat v, const DType params_dtype = DType::kF32,
                          const StateFormat main = StateFormat::kF32, const bool remainders = false) {
  AdamWOptions o;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  o.params_dtype = params_dtype;
  o.exp_avg_format = m;
  o.exp_avg_sq_format = v;
  o.main_params_format = main;
  o.store_param_remainders = remainders;
  return o;
}

ParamStore make_params() {
  ParamStore params;
  const auto add = [&](const std::string& name, const std::vector<int64_t>& shape, const int module) {
    Param p = make_param(name, shape, InitKind::kNormal);
    p.module = module;
    init_param(p, 11, 0.5, 2);
    params.push_back(std::move(p));
  };
  add("embedding.word_embeddings.weight", {40, 8}, -1);
  add("decoder.layers.0.linear_qkv.weight", {24, 8}, 0);
  add("decoder.layers.0.input_layernorm.weight", {8}, 0);  // no weight decay
  add("decoder.layers.1.linear_fc1.weight", {30, 8}, 1);
  return params;
}

// One process with the distributed optimizer: every parameter is one piece of the rank's shard.
struct OptRun {
  ParamStore params = make_params();
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<DistributedAdamW> opt;

  explicit OptRun(const AdamWOptions& options, const DType main_grad_dtype = DType::kF32) {
    DdpOptions ddp_options;
    ddp_options.use_distributed_optimizer = true;
    ddp_options.param_gather_dtype = options.params_dtype;
    ddp_options.grad_dtype = main_grad_dtype;
    ddp = std::make_unique<DistributedDataParallel>(params, parallel::ParallelState::single_process(), ddp_options);
    opt = std::make_unique<DistributedAdamW>(*ddp, params, options);
  }

  // Gradients of spread magnitudes (a few binades per parameter), then one step.
  void step(const int iteration) {
    ddp->zero_grad();
    for (Param& p : params) {
      const CounterRng rng(static_cast<uint64_t>(100 + iteration), stream_key(p.name));
      for (int64_t i = 0; i < p.grad.numel(); ++i) {
        const double magnitude = std::ldexp(1.0, static_cast<int>(i % 9) - 6);
        p.grad.data<float>()[i] = static_cast<float>(rng.normal(static_cast<uint64_t>(i)) * magnitude);
      }
    }
    ddp->finish_grad_sync();
    opt->step(kLr);
  }

  std::vector<std::vector<float>> weights() const {
    std::vector<std::vector<float>> out;
    for (const Param& p : params) out.emplace_back(p.value.span<float>().begin(), p.value.span<float>().end());
    return out;
  }
};

std::vector<float> values(const Tensor& t) { return {t.span<float>().begin(), t.span<float>().end()}; }

class ReducedMoments : public ::testing::TestWithParam<std::pair<StateFormat, StateFormat>> {};

TEST_P(ReducedMoments, FirstStepIsExactSecondWithinTheRounding) {
  const auto [fm, fv] = GetParam();
  OptRun ref(adam_options(StateFormat::kF32, StateFormat::kF32));
  OptRun low(adam_options(fm, fv));
  ref.step(1);
  low.step(1);
  EXPECT_EQ(low.weights(), ref.weights()) << "step 1 updates from the fp32 moments before storing them";
  const std::vector<AdamWMomentSlice> ref1 = ref.opt->moment_slices(), low1 = low.opt->moment_slices();
  ASSERT_EQ(ref1.size(), ref.params.size());
  ASSERT_EQ(low1.size(), ref1.size());
  std::vector<std::vector<float>> m1, v1, m1_low, v1_low;
  for (size_t i = 0; i < ref1.size(); ++i) {
    m1.push_back(values(ref1[i].exp_avg));
    v1.push_back(values(ref1[i].exp_avg_sq));
    m1_low.push_back(values(low1[i].exp_avg));
    v1_low.push_back(values(low1[i].exp_avg_sq));
    EXPECT_EQ(m1_low[i], test::reference_store(fm, m1[i])) << ref.params[i].name;
    EXPECT_EQ(v1_low[i], test::reference_store(fv, v1[i])) << ref.params[i].name;
  }
  const std::vector<std::vector<float>> w1 = ref.weights();

  ref.step(2);
  low.step(2);
  // Step 2's weights from the corners of the moments' rounding intervals, in double.
  const AdamWOptions o = adam_options(fm, fv);
  const double bc1 = 1.0 - o.beta1 * o.beta1, bc2 = 1.0 - o.beta2 * o.beta2;
  int differ = 0;
  for (size_t i = 0; i < ref.params.size(); ++i) {
    const Param& p = ref.params[i];
    const double decay = p.no_weight_decay ? 1.0 : 1.0 - kLr * o.weight_decay;
    const test::RoundingBound bm = test::rounding_bound(fm, test::reference_scale(fm, test::reference_abs_max(m1[i])));
    const test::RoundingBound bv = test::rounding_bound(fv, test::reference_scale(fv, test::reference_abs_max(v1[i])));
    const CounterRng rng(102, stream_key(p.name));
    const std::vector<float> w2 = values(low.params[i].value), w2_ref = values(p.value);
    for (size_t e = 0; e < w2.size(); ++e) {
      const double g = static_cast<float>(rng.normal(e) * std::ldexp(1.0, static_cast<int>(e % 9) - 6));
      const double em = bm.relative * std::fabs(m1[i][e]) + bm.absolute;
      const double ev = bv.relative * std::fabs(v1[i][e]) + bv.absolute;
      double lo = INFINITY, hi = -INFINITY;
      for (const double m_old : {m1[i][e] - em, m1[i][e] + em}) {
        for (const double v_old : {std::max(0.0, v1[i][e] - ev), v1[i][e] + ev}) {
          const double m = o.beta1 * m_old + (1.0 - o.beta1) * g;
          const double v = o.beta2 * v_old + (1.0 - o.beta2) * g * g;
          const double w = w1[i][e] * decay - kLr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + o.eps);
          lo = std::min(lo, w);
          hi = std::max(hi, w);
        }
      }
      // fp32 arithmetic of the kernel: a few ulps of the weight and of the update.
      const double slack = 1e-6 * (std::fabs(w1[i][e]) + kLr / bc1 * 10.0);
      EXPECT_GE(w2[e], lo - slack) << p.name << "[" << e << "]";
      EXPECT_LE(w2[e], hi + slack) << p.name << "[" << e << "]";
      EXPECT_GE(w2_ref[e], lo - slack) << "the fp32 run lies in the interval too";
      EXPECT_LE(w2_ref[e], hi + slack) << "the fp32 run lies in the interval too";
      differ += w2[e] != w2_ref[e] ? 1 : 0;
    }
  }
  EXPECT_GT(differ, 0) << "step 2 must see the rounded moments";
}

INSTANTIATE_TEST_SUITE_P(Formats, ReducedMoments,
                         ::testing::Values(std::pair{StateFormat::kBF16, StateFormat::kBF16},
                                           std::pair{StateFormat::kF16, StateFormat::kF16},
                                           std::pair{StateFormat::kFP8, StateFormat::kFP8},
                                           std::pair{StateFormat::kFP8, StateFormat::kBF16},
                                           std::pair{StateFormat::kF32, StateFormat::kF16}));

TEST(PrecisionAwareOptimizer, Fp16MainParamsWithBf16Weights) {
  OptRun ref(adam_options(StateFormat::kF32, StateFormat::kF32, DType::kBF16));
  OptRun low(adam_options(StateFormat::kF32, StateFormat::kF32, DType::kBF16, StateFormat::kF16));
  EXPECT_EQ(low.weights(), ref.weights()) << "both round the initial weights to bf16";
  // TE's initialize_state: the master from the weights, stored scaled (set_scaled_state).
  std::vector<std::vector<float>> main0;
  const std::vector<AdamWMomentSlice> ref0 = ref.opt->moment_slices();
  for (const AdamWMomentSlice& s : low.opt->moment_slices()) {
    ASSERT_TRUE(s.main_param.defined());
    main0.push_back(values(s.main_param));
    const std::vector<float> main_ref0 = values(ref0[main0.size() - 1].main_param);
    EXPECT_EQ(main0.back(), test::reference_store(StateFormat::kF16, main_ref0));
  }
  ref.step(1);
  low.step(1);
  // The update term is the same (fp32 moments; it does not depend on the main parameters), so the main parameters
  // differ by decay x the initial rounding plus the new rounding; each weight is its fp32 main value rounded to bf16.
  const std::vector<AdamWMomentSlice> ref1 = ref.opt->moment_slices(), low1 = low.opt->moment_slices();
  const AdamWOptions o = adam_options(StateFormat::kF32, StateFormat::kF32);
  for (size_t i = 0; i < ref1.size(); ++i) {
    const std::vector<float> main_ref = values(ref1[i].main_param), main_low = values(low1[i].main_param);
    const std::vector<float> w_low = values(low.params[i].value);
    const float scale0 = test::reference_scale(StateFormat::kF16, test::reference_abs_max(main0[i]));
    const float scale1 = test::reference_scale(StateFormat::kF16, test::reference_abs_max(main_low));
    const test::RoundingBound b0 = test::rounding_bound(StateFormat::kF16, scale0);
    const test::RoundingBound b1 = test::rounding_bound(StateFormat::kF16, scale1);
    for (size_t e = 0; e < main_ref.size(); ++e) {
      const double decay = low.params[i].no_weight_decay ? 1.0 : 1.0 - kLr * o.weight_decay;
      const double e0 = b0.relative * std::fabs(main0[i][e]) + b0.absolute;
      const double e1 = b1.relative * std::fabs(main_ref[e]) + b1.absolute;
      const double slack = 1e-6 * (std::fabs(main_ref[e]) + kLr * 10.0);
      EXPECT_LE(std::fabs(static_cast<double>(main_low[e]) - main_ref[e]), decay * e0 + e1 + slack);
      // The bf16 weight is within half a bf16 ulp of the fp32 main value, which is within e1 of the stored one.
      EXPECT_LE(std::fabs(static_cast<double>(w_low[e]) - main_low[e]),
                std::ldexp(1.0, -8) * std::fabs(main_low[e]) + 2 * e1 + slack);
    }
  }
}

// TE's store_param_remainders: the fp32 main parameters kept as the bf16 weights + 16-bit remainders are exactly the
// fp32 main parameters of the plain run (started from the same bf16 weights), step after step, and each weight is
// its main value rounded to the nearest bf16, ties away from zero; the main copy takes 2 bytes per element.
TEST(PrecisionAwareOptimizer, ParamRemaindersKeepTheExactMainParams) {
  OptRun ref(adam_options(StateFormat::kF32, StateFormat::kF32, DType::kBF16));
  OptRun rem(adam_options(StateFormat::kF32, StateFormat::kF32, DType::kBF16, StateFormat::kF32, true));
  // Megatron's master starts as the bf16 weights (TE: zero remainders); give the plain run the same start.
  for (const AdamWMomentSlice& s : ref.opt->moment_slices()) {
    Tensor main = s.main_param;
    main.copy_from(ref.params[static_cast<size_t>(s.param)].value.view({s.end - s.begin}));
  }
  int64_t elements = 0;
  for (const auto& b : rem.ddp->buckets()) elements += b.shard_size;
  EXPECT_EQ(rem.opt->state_bytes(), (4 + 4 + 2) * elements);
  for (int step = 0; step <= 3; ++step) {
    if (step > 0) {
      ref.step(step);
      rem.step(step);
    }
    const std::vector<AdamWMomentSlice> a = ref.opt->moment_slices(), b = rem.opt->moment_slices();
    for (size_t i = 0; i < a.size(); ++i) {
      const std::vector<float> main = values(a[i].main_param);
      ASSERT_EQ(values(b[i].main_param), main) << "step " << step << " " << ref.params[i].name;
      const std::vector<float> w = values(rem.params[i].value);
      for (size_t e = 0; e < main.size(); ++e) ASSERT_EQ(w[e], test::bf16_nearest_ties_away(main[e]));
    }
  }
  // Loading fp32 main parameters (a checkpoint) sets both halves; the weights follow.
  std::vector<AdamWMomentSlice> slices = rem.opt->moment_slices();
  std::vector<std::vector<float>> loaded;
  for (AdamWMomentSlice& s : slices) {
    float* m = s.main_param.data<float>();
    for (int64_t e = 0; e < s.main_param.numel(); ++e) m[e] = m[e] * 1.5f + 1e-3f;
    loaded.push_back(values(s.main_param));
  }
  rem.opt->load_moment_slices(slices);
  const std::vector<AdamWMomentSlice> after = rem.opt->moment_slices();
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(values(after[i].main_param), loaded[i]);
    const std::vector<float> w = values(rem.params[i].value);
    for (size_t e = 0; e < w.size(); ++e) ASSERT_EQ(w[e], test::bf16_nearest_ties_away(loaded[i][e]));
  }
  // Without the main parameters (a checkpoint of fp32 weights) nothing of them is loaded.
  rem.opt->load_moment_slices(rem.opt->moment_slices(), false);
  // A tie rounds away from zero: 1 + 2^-8 -> 1 + 2^-7 (RNE would give 1), and the join restores it.
  Tensor main = Tensor::zeros({2}), weight = Tensor::zeros({2}), remainder = Tensor::zeros({2}, DType::kBF16);
  main.data<float>()[0] = 1.0f + std::ldexp(1.0f, -8);
  main.data<float>()[1] = -(1.0f + std::ldexp(1.0f, -8));
  ops::split_param_remainders(main, weight, remainder);
  EXPECT_EQ(weight.data<float>()[0], 1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(weight.data<float>()[1], -(1.0f + std::ldexp(1.0f, -7)));
  Tensor joined = Tensor::zeros({2});
  ops::join_param_remainders(weight, remainder, joined);
  EXPECT_EQ(values(joined), values(main));
}

TEST(PrecisionAwareOptimizer, MomentSlicesAreUnscaledCopiesLoadedBackInAnyFormat) {
  OptRun fp8(adam_options(StateFormat::kFP8, StateFormat::kFP8));
  OptRun fp32(adam_options(StateFormat::kF32, StateFormat::kF32));
  OptRun bf16(adam_options(StateFormat::kBF16, StateFormat::kF16));
  fp8.step(1);
  fp8.step(2);
  fp32.step(1);

  // Writing into the copies changes nothing until load_moment_slices.
  std::vector<AdamWMomentSlice> saved = fp8.opt->moment_slices();
  std::vector<std::vector<float>> saved_m, saved_v;
  for (const AdamWMomentSlice& s : saved) {
    saved_m.push_back(values(s.exp_avg));
    saved_v.push_back(values(s.exp_avg_sq));
  }
  saved.front().exp_avg.data<float>()[0] += 1.0f;
  EXPECT_EQ(values(fp8.opt->moment_slices().front().exp_avg), saved_m.front());

  // fp8 -> fp32 (a checkpoint saved with fp8 moments loaded with fp32 ones): the unscaled fp8 values, exactly.
  const std::vector<AdamWMomentSlice> into32 = fp32.opt->moment_slices();
  for (size_t i = 0; i < into32.size(); ++i) {
    Tensor m = into32[i].exp_avg, v = into32[i].exp_avg_sq;
    std::copy(saved_m[i].begin(), saved_m[i].end(), m.data<float>());
    std::copy(saved_v[i].begin(), saved_v[i].end(), v.data<float>());
  }
  fp32.opt->load_moment_slices(into32);
  const std::vector<AdamWMomentSlice> loaded32 = fp32.opt->moment_slices();
  for (size_t i = 0; i < loaded32.size(); ++i) {
    EXPECT_EQ(values(loaded32[i].exp_avg), saved_m[i]);
    EXPECT_EQ(values(loaded32[i].exp_avg_sq), saved_v[i]);
  }

  // fp32 -> bf16 / fp16 (and fp32 -> fp8): each piece rescaled from its absmax and rounded.
  std::vector<std::vector<float>> fp32_m, fp32_v;
  for (const AdamWMomentSlice& s : fp32.opt->moment_slices()) {
    fp32_m.push_back(values(s.exp_avg));
    fp32_v.push_back(values(s.exp_avg_sq));
  }
  for (OptRun* target : {&bf16, &fp8}) {
    const std::vector<AdamWMomentSlice> into = target->opt->moment_slices();
    for (size_t i = 0; i < into.size(); ++i) {
      Tensor m = into[i].exp_avg, v = into[i].exp_avg_sq;
      std::copy(fp32_m[i].begin(), fp32_m[i].end(), m.data<float>());
      std::copy(fp32_v[i].begin(), fp32_v[i].end(), v.data<float>());
    }
    target->opt->load_moment_slices(into);
    const AdamWOptions& o = target->opt->options();
    const std::vector<AdamWMomentSlice> loaded = target->opt->moment_slices();
    for (size_t i = 0; i < loaded.size(); ++i) {
      EXPECT_EQ(values(loaded[i].exp_avg), test::reference_store(o.exp_avg_format, fp32_m[i]));
      EXPECT_EQ(values(loaded[i].exp_avg_sq), test::reference_store(o.exp_avg_sq_format, fp32_v[i]));
    }
  }
  EXPECT_THROW(fp32.opt->load_moment_slices({}), std::invalid_argument);
}

TEST(PrecisionAwareOptimizer, StateMemoryFallsWithTheFormat) {
  const MemoryTracker& mem = MemoryTracker::instance();
  ParamStore params = make_params();
  DdpOptions ddp_options;
  ddp_options.use_distributed_optimizer = true;
  DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), ddp_options);
  const auto optimizer_bytes = [&](const AdamWOptions& o) {
    const int64_t before = mem.current(MemCategory::kOptimizer);
    const DistributedAdamW opt(ddp, params, o);
    const int64_t bytes = mem.current(MemCategory::kOptimizer) - before;
    EXPECT_EQ(bytes, opt.state_bytes());
    return bytes;
  };
  const int64_t fp32 = optimizer_bytes(adam_options(StateFormat::kF32, StateFormat::kF32));
  // Two moments of every shard element (the bucket padded to a multiple of 128 elements).
  int64_t elements = 0;
  for (const auto& b : ddp.buckets()) elements += b.shard_size;
  EXPECT_EQ(fp32, 2 * 4 * elements);
  EXPECT_EQ(optimizer_bytes(adam_options(StateFormat::kBF16, StateFormat::kBF16)), fp32 / 2);
  EXPECT_EQ(optimizer_bytes(adam_options(StateFormat::kF16, StateFormat::kBF16)), fp32 / 2);
  EXPECT_EQ(optimizer_bytes(adam_options(StateFormat::kFP8, StateFormat::kFP8)), fp32 / 4);
  EXPECT_EQ(optimizer_bytes(adam_options(StateFormat::kFP8, StateFormat::kBF16)), fp32 * 3 / 8);
}

TEST(PrecisionAwareOptimizer, Fp16MainParamsHalveTheMainCopy) {
  const MemoryTracker& mem = MemoryTracker::instance();
  ParamStore params = make_params();
  DdpOptions ddp_options;
  ddp_options.use_distributed_optimizer = true;
  ddp_options.param_gather_dtype = DType::kBF16;
  DistributedDataParallel ddp(params, parallel::ParallelState::single_process(), ddp_options);
  int64_t elements = 0;
  for (const auto& b : ddp.buckets()) elements += b.shard_size;
  const int64_t before = mem.current(MemCategory::kOptimizer);
  const DistributedAdamW opt(ddp, params,
                             adam_options(StateFormat::kBF16, StateFormat::kBF16, DType::kBF16, StateFormat::kF16));
  EXPECT_EQ(mem.current(MemCategory::kOptimizer) - before, 3 * 2 * elements);
}

TEST(PrecisionAwareOptimizer, RejectsWhatItCannotStore) {
  ParamStore params = make_params();
  DistributedDataParallel replicated(params, parallel::ParallelState::single_process(), DdpOptions{});
  EXPECT_THROW((DistributedAdamW{replicated, params, adam_options(StateFormat::kBF16, StateFormat::kF32)}),
               std::invalid_argument);
  EXPECT_THROW((AdamWOptimizer{params, adam_options(StateFormat::kF32, StateFormat::kFP8)}), std::invalid_argument);
  ParamStore sharded = make_params();
  DdpOptions ddp_options;
  ddp_options.use_distributed_optimizer = true;
  DistributedDataParallel ddp(sharded, parallel::ParallelState::single_process(), ddp_options);
  // fp16 main parameters need 16-bit weights (fp32 weights are their own main parameters); bf16 main ones do not exist.
  EXPECT_THROW((DistributedAdamW{ddp, sharded,
                                 adam_options(StateFormat::kF32, StateFormat::kF32, DType::kF32, StateFormat::kF16)}),
               std::invalid_argument);
  EXPECT_THROW((DistributedAdamW{ddp, sharded,
                                 adam_options(StateFormat::kF32, StateFormat::kF32, DType::kBF16, StateFormat::kBF16)}),
               std::invalid_argument);
}

TEST(PrecisionAwareOptimizer, Bf16MainGradsAccumulateInBf16) {
  OptRun run(adam_options(StateFormat::kBF16, StateFormat::kBF16), DType::kBF16);
  run.ddp->zero_grad();
  std::vector<std::vector<float>> expected;
  for (const Param& p : run.params) expected.emplace_back(static_cast<size_t>(p.grad.numel()), 0.0f);
  for (int mb = 0; mb < 3; ++mb) {
    for (int module = 1; module >= -1; --module) {  // backward order
      for (size_t i = 0; i < run.params.size(); ++i) {
        Param& p = run.params[i];
        if (p.module != module) continue;
        const CounterRng rng(static_cast<uint64_t>(mb), stream_key(p.name));
        for (int64_t e = 0; e < p.grad.numel(); ++e) {
          const auto g = static_cast<float>(rng.normal(static_cast<uint64_t>(e)));
          p.grad.data<float>()[e] += g;
          // Megatron's bf16 main_grad: each micro-batch's gradient is added into the bf16 buffer (fp32 add, rounded).
          float& want = expected[i][static_cast<size_t>(e)];
          want = static_cast<float>(test::nearest_on_grid(test::bf16_grid(), want + g));
        }
      }
      run.ddp->after_backward(module);
    }
  }
  run.ddp->finish_grad_sync();  // one process: the bf16 reduction leaves bf16 values as they are
  for (size_t i = 0; i < run.params.size(); ++i) EXPECT_EQ(values(run.params[i].grad), expected[i]);
}

}  // namespace
}  // namespace moecore
