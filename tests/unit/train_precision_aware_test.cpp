// The precision-aware optimizer's flags (Megatron's arguments.py / OptimizerConfig.__post_init__ /
// optimizer/__init__.py: choices, defaults, one error per bad combination), its wiring into the optimizer and DDP,
// and checkpoints: they hold the unscaled fp32 states under the usual keys, so a checkpoint saved with bf16 / fp8
// moments loads with fp32 ones (the stored values exactly) and the other way round (each state rounded into the new
// format from its absmax).
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "moecore/config/arguments.h"
#include "moecore/config/optimizer_master.h"
#include "moecore/train/checkpointing.h"
#include "moecore/train/training_setup.h"
#include "optimizer_state_reference.h"
#include "test_temp_dir.h"
#include "unit/test_recipe.h"
#include "unit/train_args_error.h"

namespace moecore {
namespace {

using quant::StateFormat;
using Args = std::vector<std::string>;
using test::error_of;

Args tiny(const Args& extra = {}) {
  // clang-format off
  Args a = test::recipe_flags("tiny-moe", {
      "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data",
      "--tokenizer-type", "NullTokenizer", "--vocab-size", "250", "--seed", "5"
  });
  // clang-format on
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

const Args kPao = {"--use-distributed-optimizer", "--use-precision-aware-optimizer"};

Args pao(const Args& extra) {
  Args a = kPao;
  a.insert(a.end(), extra.begin(), extra.end());
  return tiny(a);
}

TEST(PrecisionAwareArgs, MegatronDefaultsAndChoices) {
  const TrainingArgs d = parse_train_args(tiny());
  EXPECT_FALSE(d.use_precision_aware_optimizer);
  EXPECT_EQ(d.main_grads_dtype, "fp32");
  EXPECT_EQ(d.main_params_dtype, "fp32");
  EXPECT_EQ(d.exp_avg_dtype, "fp32");
  EXPECT_EQ(d.exp_avg_sq_dtype, "fp32");
  // fp32 is allowed without the flag (Megatron checks the values).
  EXPECT_NO_THROW(parse_train_args(tiny({"--exp-avg-dtype", "fp32", "--main-grads-dtype", "fp32"})));
  const TrainingArgs a = parse_train_args(pao({"--bf16", "--main-grads-dtype", "bf16", "--main-params-dtype", "fp16",
                                               "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "bf16"}));
  EXPECT_TRUE(a.use_precision_aware_optimizer);
  EXPECT_EQ(a.main_grads_dtype, "bf16");
  EXPECT_EQ(a.main_params_dtype, "fp16");
  EXPECT_EQ(a.exp_avg_dtype, "fp8");
  EXPECT_EQ(a.exp_avg_sq_dtype, "bf16");
  for (const char* f : {"fp32", "fp16", "bf16", "fp8"}) {
    EXPECT_EQ(parse_train_args(pao({"--exp-avg-dtype", f})).exp_avg_dtype, f);
    EXPECT_EQ(parse_train_args(pao({"--exp-avg-sq-dtype", f})).exp_avg_sq_dtype, f);
  }
  EXPECT_EQ(error_of(pao({"--exp-avg-dtype", "fp64"})),
            "invalid value 'fp64' for --exp-avg-dtype (choose from fp32, fp16, bf16, fp8)");
  EXPECT_EQ(error_of(pao({"--main-grads-dtype", "fp16"})),
            "invalid value 'fp16' for --main-grads-dtype (choose from fp32, bf16)");
  EXPECT_EQ(error_of(pao({"--bf16", "--main-params-dtype", "bf16"})),
            "invalid value 'bf16' for --main-params-dtype (choose from fp32, fp16)");
}

TEST(PrecisionAwareArgs, ValidationErrors) {
  for (const char* flag : {"--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"}) {
    const char* value = std::string(flag) == "--main-grads-dtype" ? "bf16" : "fp16";
    EXPECT_EQ(error_of(tiny({"--bf16", "--use-distributed-optimizer", flag, value})),
              std::string(flag) +
                  " can only be fp32 when not using precision-aware optimizer (add --use-precision-aware-optimizer)");
  }
  EXPECT_EQ(error_of(tiny({"--use-precision-aware-optimizer"})),
            "--use-precision-aware-optimizer only supported with distributed optimizer (add "
            "--use-distributed-optimizer)");
  EXPECT_EQ(error_of(pao({"--main-grads-dtype", "bf16"})),
            "--main-grads-dtype bf16 needs --bf16 (fp32 and fp16 weights keep gradients of their own dtype)");
  EXPECT_EQ(error_of(pao({"--fp16", "--main-grads-dtype", "bf16"})),
            "--main-grads-dtype bf16 needs --bf16 (fp32 and fp16 weights keep gradients of their own dtype)");
  EXPECT_EQ(error_of(pao({"--bf16", "--accumulate-allreduce-grads-in-fp32", "--main-grads-dtype", "bf16"})),
            "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set");
  EXPECT_EQ(error_of(pao({"--main-params-dtype", "fp16"})),
            "--main-params-dtype fp16 needs --bf16 or --fp16 (fp32 weights are their own main parameters)");
  EXPECT_NO_THROW(parse_train_args(pao({"--fp16", "--main-params-dtype", "fp16"})));
  EXPECT_NO_THROW(parse_train_args(pao({"--bf16", "--grad-reduce-in-bf16", "--main-grads-dtype", "bf16"})));
}

Args with_distributed_optimizer(Args a) {
  a.push_back("--use-distributed-optimizer");
  return a;
}

TrainingArgs run_args_of(const Args& flags) {
  const TrainingArgs args = parse_train_args(flags);
  return with_padded_vocabulary(args, build_vocabulary(args));
}

TEST(PrecisionAwareSetup, FlagsReachTheOptimizerAndDdp) {
  const TrainingArgs args = run_args_of(pao({"--bf16", "--main-grads-dtype", "bf16", "--main-params-dtype", "fp16",
                                             "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp16"}));
  const ModelAndOptimizer mo = build_model_and_optimizer(args, parallel::ParallelState::single_process());
  const AdamWOptions& o = mo.optimizer->options();
  EXPECT_EQ(o.exp_avg_format, StateFormat::kFP8);
  EXPECT_EQ(o.exp_avg_sq_format, StateFormat::kF16);
  EXPECT_EQ(o.main_params_format, StateFormat::kF16);
  EXPECT_EQ(mo.ddp->options().grad_dtype, DType::kBF16);
  int64_t elements = 0;
  for (const auto& b : mo.ddp->buckets()) elements += b.shard_size;
  EXPECT_EQ(mo.optimizer->state_bytes(), elements * (1 + 2 + 2));

  // --bf16 with fp32 main parameters: Megatron's store_param_remainders, 2 bytes per main parameter.
  const ModelAndOptimizer remainders =
      build_model_and_optimizer(run_args_of(pao({"--bf16"})), parallel::ParallelState::single_process());
  EXPECT_TRUE(remainders.optimizer->options().store_param_remainders);
  EXPECT_EQ(remainders.optimizer->state_bytes(), elements * (4 + 4 + 2));

  const ModelAndOptimizer plain =
      build_model_and_optimizer(run_args_of(tiny({"--bf16"})), parallel::ParallelState::single_process());
  EXPECT_EQ(plain.optimizer->options().exp_avg_format, StateFormat::kF32);
  EXPECT_EQ(plain.ddp->options().grad_dtype, DType::kF32);
  EXPECT_FALSE(plain.optimizer->options().decoupled_grads);
  EXPECT_TRUE(mo.optimizer->options().decoupled_grads);
}

// Megatron keeps bf16 weights' fp32 main parameters as 16-bit remainders only where TE's FusedAdam holds the master
// weights (optimizer_config.py: use_precision_aware_optimizer_no_fp8_or_ds_fp8, fp8_recipe None or "delayed"): FP8
// recipes tensorwise / blockwise / mxfp8 with fp32 main parameters keep a full fp32 master (and fp32 gradient
// copies); without FP8, under delayed scaling and under FP4 the remainders stay.
TEST(PrecisionAwareSetup, Fp8RecipesBeyondDelayedKeepAFullFp32Master) {
  struct Case {
    Args flags;
    bool remainders;
    bool te_master;  // TE's FusedAdam holds the master weights and reads the gradient buffer (decoupled_grad)
  };
  const std::vector<Case> cases = {
      {{"--bf16"}, true, true},
      {{"--bf16", "--fp8-format", "e4m3"}, true, true},  // delayed, Megatron's default recipe
      {{"--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"}, true, true},
      {{"--bf16", "--fp4-format", "e2m1"}, true, true},  // Megatron's fp8_recipe stays "delayed"
      {{"--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"}, false, false},
      {{"--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "blockwise"}, false, false},
      {{"--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"}, false, false},
      {{"--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-param-gather"}, false, false},
      {{"--bf16", "--fp8-format", "e4m3", "--fp8-param-gather"}, false, true},  // quantized weights: no remainders
      {{"--bf16", "--fp4-format", "e2m1", "--fp4-param-gather"}, false, true},
      // fp16 main parameters: TE holds them whatever the recipe.
      {{"--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--main-params-dtype", "fp16"}, false, true},
  };
  for (const Case& c : cases) {
    std::string what;
    for (const std::string& f : c.flags) what += f + " ";
    const TrainingArgs args = run_args_of(pao(c.flags));
    EXPECT_EQ(stores_param_remainders(args), c.remainders) << what;
    EXPECT_EQ(te_holds_master_weights(args), c.te_master) << what;
    const ModelAndOptimizer mo = build_model_and_optimizer(args, parallel::ParallelState::single_process());
    EXPECT_EQ(mo.optimizer->options().store_param_remainders, c.remainders) << what;
    EXPECT_EQ(mo.optimizer->stores_param_remainders(), c.remainders) << what;
    EXPECT_EQ(mo.optimizer->options().decoupled_grads, c.te_master) << what;
    int64_t elements = 0;
    for (const auto& b : mo.ddp->buckets()) elements += b.shard_size;
    const int64_t main_bytes = c.remainders ? 2 : args.main_params_dtype == "fp16" ? 2 : 4;
    EXPECT_EQ(mo.optimizer->state_bytes(), elements * (4 + 4 + main_bytes)) << what;
  }
}

// Megatron's grad buffer dtype: one 16-bit buffer for --grad-reduce-in-bf16 and --main-grads-dtype bf16, fp16 under
// --fp16 unless --accumulate-allreduce-grads-in-fp32.
TEST(PrecisionAwareSetup, GradBufferDtypeAsMegatron) {
  const auto grad_dtype = [](const Args& flags) {
    return build_model_and_optimizer(run_args_of(flags), parallel::ParallelState::single_process())
        .ddp->options()
        .grad_dtype;
  };
  EXPECT_EQ(grad_dtype(tiny({"--bf16", "--grad-reduce-in-bf16"})), DType::kBF16);
  EXPECT_EQ(grad_dtype(pao({"--bf16", "--grad-reduce-in-bf16"})), DType::kBF16);
  EXPECT_EQ(grad_dtype(pao({"--bf16", "--main-grads-dtype", "bf16"})), DType::kBF16);
  EXPECT_EQ(grad_dtype(tiny({"--fp16"})), DType::kF16);
  EXPECT_EQ(grad_dtype(tiny({"--fp16", "--accumulate-allreduce-grads-in-fp32"})), DType::kF32);
  EXPECT_EQ(grad_dtype(tiny({"--bf16"})), DType::kF32);
  EXPECT_EQ(grad_dtype(tiny({})), DType::kF32);
}

// A gradient value for element i of parameter `name`, a few binades.
float grad_value(const std::string& name, const int64_t i, const int step) {
  const auto k = static_cast<int>((i * 7 + static_cast<int64_t>(name.size()) * 3 + step * 5) % 17) - 8;
  return static_cast<float>(k) * static_cast<float>(std::ldexp(1.0, static_cast<int>(i % 7) - 9));
}

struct Trained {
  TrainingArgs args;
  ModelAndOptimizer mo;
  LRSchedule schedule;

  explicit Trained(const Args& flags)
      : args(run_args_of(flags)),
        mo(build_model_and_optimizer(args, parallel::ParallelState::single_process())),
        schedule(lr_schedule_config(args)) {}

  void steps(const int n) {
    for (int s = 0; s < n; ++s) {
      mo.ddp->zero_grad();
      for (Param& p : mo.model->params()) {
        for (int64_t i = 0; i < p.grad.numel(); ++i) p.grad.data<float>()[i] = grad_value(p.name, i, s);
      }
      mo.ddp->finish_grad_sync();
      mo.optimizer->step(1e-3);
    }
    mo.ddp->wait_param_gather();
  }

  CheckpointTarget target() { return {*mo.model, *mo.ddp, *mo.optimizer, schedule, 250}; }

  void save() {  // into args.save
    TrainingProgress progress;
    progress.iteration = 2;
    progress.consumed_train_samples = 4;
    std::ostringstream log;
    const parallel::ParallelState single = parallel::ParallelState::single_process();  // the checkpointer keeps it
    Checkpointer checkpointer(args, single, log);
    checkpointer.save(target(), progress, false);
  }

  void load() {
    std::ostringstream log;
    const LoadPlan plan = plan_load(args, log);
    ASSERT_EQ(plan.kind, LoadPlan::Kind::kSharded) << log.str();
    TrainingProgress progress;
    load_checkpoint(plan, args, target(), progress, parallel::ParallelState::single_process(), log);
    EXPECT_EQ(progress.iteration, 2);
  }

  // Every state of every piece, unscaled.
  std::vector<std::vector<float>> states() const {
    std::vector<std::vector<float>> out;
    for (const AdamWMomentSlice& s : mo.optimizer->moment_slices()) {
      for (const Tensor* t : {&s.exp_avg, &s.exp_avg_sq, &s.main_param}) {
        if (t->defined()) out.emplace_back(t->span<float>().begin(), t->span<float>().end());
      }
    }
    return out;
  }
  std::vector<std::vector<float>> weights() const {
    std::vector<std::vector<float>> out;
    for (const Param& p : mo.model->params())
      out.emplace_back(p.value.span<float>().begin(), p.value.span<float>().end());
    return out;
  }
};

TEST(PrecisionAwareCheckpoint, Bf16AndFp8MomentsLoadIntoFp32Exactly) {
  const test::TempDir dir("pao_ckpt");
  for (const Args& formats :
       {Args{"--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"},
        Args{"--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8", "--bf16", "--main-params-dtype", "fp16"}}) {
    const std::string ckpt = dir.path(formats[1] + "_ckpt");
    const bool bf16_weights = formats.size() > 4;
    Args saving = formats;
    saving.insert(saving.end(), {"--save", ckpt, "--save-interval", "100"});
    Trained saved(pao(saving));
    saved.steps(2);
    saved.save();

    Args loading = {"--load", ckpt, "--use-distributed-optimizer"};
    if (bf16_weights) loading.push_back("--bf16");
    Trained loaded(tiny(loading));
    ASSERT_EQ(loaded.mo.optimizer->options().exp_avg_format, StateFormat::kF32);
    loaded.load();
    EXPECT_EQ(loaded.states(), saved.states()) << formats[1] << ": the stored values, unscaled";
    if (!bf16_weights) {
      EXPECT_EQ(loaded.weights(), saved.weights()) << formats[1];
      continue;
    }
    // fp32 main parameters load as moecore's 16-bit runs always do: the weights rounded from them.
    const std::vector<std::vector<float>> w = loaded.weights(), w_saved = saved.weights();
    for (const AdamWMomentSlice& s : loaded.mo.optimizer->moment_slices()) {
      const auto i = static_cast<size_t>(s.param);
      for (size_t e = 0; e < w[i].size(); ++e) {
        const float main = s.main_param.data<float>()[e];
        EXPECT_EQ(w[i][e], static_cast<float>(test::nearest_on_grid(test::bf16_grid(), main)));
        EXPECT_LE(std::fabs(w[i][e] - w_saved[i][e]), std::ldexp(std::fabs(w_saved[i][e]), -7));
      }
    }
  }
}

TEST(PrecisionAwareCheckpoint, Fp32MomentsLoadIntoReducedFormatsRounded) {
  const test::TempDir dir("pao_ckpt");
  const std::string ckpt = dir.path("fp32_ckpt");
  Trained saved(tiny({"--use-distributed-optimizer", "--bf16", "--save", ckpt, "--save-interval", "100"}));
  saved.steps(2);
  saved.save();
  const std::vector<std::vector<float>> fp32 = saved.states();  // per piece: exp_avg, exp_avg_sq, main

  Trained loaded(pao({"--bf16", "--load", ckpt, "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp16",
                      "--main-params-dtype", "fp16"}));
  loaded.load();
  const std::vector<std::vector<float>> got = loaded.states();
  ASSERT_EQ(got.size(), fp32.size());
  for (size_t i = 0; i < got.size(); i += 3) {
    EXPECT_EQ(got[i], test::reference_store(StateFormat::kFP8, fp32[i]));
    EXPECT_EQ(got[i + 1], test::reference_store(StateFormat::kF16, fp32[i + 1]));
    EXPECT_EQ(got[i + 2], test::reference_store(StateFormat::kF16, fp32[i + 2]));
  }
  // TE owns the fp16 master: the checkpoint's weights are kept (Megatron loads the model weights as saved).
  EXPECT_EQ(loaded.weights(), saved.weights());
}

// bf16 weights: the remainder run's checkpoint holds its exact fp32 main parameters; a plain --bf16 run loads them as
// they are (weights rounded to nearest even), and a remainder run loads a plain run's (weights rounded half away).
TEST(PrecisionAwareCheckpoint, ParamRemaindersSaveAndLoadTheFp32MainParams) {
  const test::TempDir dir("pao_ckpt");
  for (const bool from_remainders : {true, false}) {
    const std::string ckpt = dir.path(from_remainders ? "rem" : "plain");
    const Args save = {"--bf16", "--save", ckpt, "--save-interval", "100"};
    Trained saved(from_remainders ? pao(save) : tiny(with_distributed_optimizer(save)));
    saved.steps(2);
    saved.save();
    const Args load = {"--bf16", "--load", ckpt};
    Trained loaded(from_remainders ? tiny(with_distributed_optimizer(load)) : pao(load));
    loaded.load();
    EXPECT_EQ(loaded.states(), saved.states()) << "moments and fp32 main parameters, exactly";
    const std::vector<std::vector<float>> w = loaded.weights();
    for (const AdamWMomentSlice& s : loaded.mo.optimizer->moment_slices()) {
      const std::vector<float>& wp = w[static_cast<size_t>(s.param)];
      for (size_t e = 0; e < wp.size(); ++e) {
        const float main = s.main_param.data<float>()[e];
        ASSERT_EQ(wp[e], from_remainders ? static_cast<float>(test::nearest_on_grid(test::bf16_grid(), main))
                                         : test::bf16_nearest_ties_away(main));
      }
    }
  }
}

}  // namespace
}  // namespace moecore
