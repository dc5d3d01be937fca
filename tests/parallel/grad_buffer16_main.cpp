// Under mpirun -np 2 (DP2): the 16-bit gradient buffer against a naive re-implementation of Megatron's order
// (param_and_grad_buffer.py) on random rank-keyed data, for bf16 and fp16 buffers, all-reduce and reduce-scatter
// (distributed optimizer), with and without overlapped buckets:
//   per micro-batch   main_grad = round16(main_grad + wgrad)            (the backward hook's main_grad.add_)
//   start_grad_sync   main_grad = round16(main_grad * 1/DP)            (gradient_scaling_factor, in the buffer dtype)
//   collective        round16(rank 0's + rank 1's)                     (a 16-bit NCCL sum of two ranks)
//   optimizer         the result as fp32                               (main_grad.float())
// and an fp16 element that only overflows in a 16-bit accumulation (40000 + 40000 on rank 0, zeros on rank 1: an
// fp32 accumulation scaled by 1/2 before the 16-bit sum stays at 40000) is found by the optimizer's unscale check.
// Prints "N passed, M failed" on rank 0.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moecore/optim/ddp.h"
#include "moecore/optim/distributed_optimizer.h"
#include "moecore/parallel/mpi_runtime.h"
#include "moecore/parallel/parallel_state.h"
#include "moecore/parallel/process_group.h"
#include "moecore/tensor/dtype.h"
#include "moecore/tensor/rng.h"

namespace {

using moecore::DdpOptions;
using moecore::DistributedDataParallel;
using moecore::DType;
using moecore::Param;
using moecore::ParamStore;
namespace parallel = moecore::parallel;

int g_failures = 0;

void check(const bool ok, const std::string& what) {
  if (ok) return;
  if (++g_failures <= 10) std::fprintf(stderr, "check failed: %s\n", what.c_str());
}

ParamStore make_model() {
  ParamStore params;
  const auto add = [&](const std::string& name, const std::vector<int64_t>& shape, const int module) {
    Param p = moecore::make_param(name, shape, moecore::InitKind::kNormal);
    p.module = module;
    moecore::init_param(p, 9, 0.5, 4);
    params.push_back(std::move(p));
  };
  add("embedding.word_embeddings.weight", {37, 8}, -1);
  add("decoder.layers.0.linear_qkv.weight", {24, 8}, 0);
  add("decoder.layers.0.input_layernorm.weight", {8}, 0);
  add("decoder.layers.1.mlp.linear_fc1.weight", {31, 8}, 1);
  add("output_layer.weight", {37, 8}, 2);
  return params;
}

float round16(const float x, const DType dtype) {
  return dtype == DType::kBF16 ? moecore::bf16_to_fp32(moecore::fp32_to_bf16(x))
                               : moecore::fp16_to_fp32(moecore::fp32_to_fp16(x));
}

float wgrad(const std::string& name, const int64_t e, const int rank, const int mb) {
  const moecore::CounterRng rng(static_cast<uint64_t>(100 * rank + mb), moecore::stream_key(name));
  return static_cast<float>(rng.normal(static_cast<uint64_t>(e)) * 5.0);
}

struct Case {
  std::string name;
  DType grad_dtype;
  bool dist_opt, overlap;
};

DdpOptions options_of(const Case& c) {
  DdpOptions o;
  o.grad_dtype = c.grad_dtype;
  o.use_distributed_optimizer = c.dist_opt;
  o.overlap_grad_reduce = c.overlap;
  o.bucket_size = c.overlap ? 200 : 0;
  return o;
}

// This rank's elements of the reduced gradient: every element without the distributed optimizer, its shard with it.
bool owned(const DistributedDataParallel& ddp, const size_t param, const int64_t e) {
  if (!ddp.options().use_distributed_optimizer) return true;
  const DistributedDataParallel::Slot& slot = ddp.slots()[param];
  const DistributedDataParallel::Bucket& b = ddp.buckets()[static_cast<size_t>(slot.bucket)];
  const int64_t at = slot.offset + e;
  return at >= b.shard_begin && at < b.shard_begin + b.shard_size;
}

void run_reference_case(const Case& c, const parallel::ParallelState& ps) {
  constexpr int kMicroBatches = 3;
  ParamStore params = make_model();
  DistributedDataParallel ddp(params, ps, options_of(c));
  const int rank = ps.dp_cp.rank(), dp = ps.dp_cp.size();
  ddp.zero_grad();
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    ddp.set_last_microbatch(mb == kMicroBatches - 1);
    for (int module = 2; module >= -1; --module) {
      for (Param& p : params) {
        if (p.module != module) continue;
        for (int64_t e = 0; e < p.grad.numel(); ++e) p.grad.data<float>()[e] += wgrad(p.name, e, rank, mb);
      }
      ddp.after_backward(module);
    }
  }
  ddp.finish_grad_sync();
  int64_t compared = 0, differs_from_fp32 = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    for (int64_t e = 0; e < p.grad.numel(); ++e) {
      if (!owned(ddp, i, e)) continue;
      float sum = 0.0f;  // Megatron's order, naively
      double exact = 0.0;
      for (int r = 0; r < dp; ++r) {
        float main_grad = 0.0f;
        for (int mb = 0; mb < kMicroBatches; ++mb) {
          main_grad = round16(main_grad + wgrad(p.name, e, r, mb), c.grad_dtype);
          exact += wgrad(p.name, e, r, mb);
        }
        main_grad = round16(main_grad * static_cast<float>(1.0 / dp), c.grad_dtype);
        sum = r == 0 ? main_grad : round16(sum + main_grad, c.grad_dtype);
      }
      const float got = std::as_const(p.grad).data<float>()[e];
      ++compared;
      differs_from_fp32 += sum != round16(static_cast<float>(exact / dp), c.grad_dtype);
      check(got == sum, c.name + ": " + p.name + "[" + std::to_string(e) + "] " + std::to_string(got) +
                            " vs Megatron's order " + std::to_string(sum));
    }
  }
  check(compared > 100, c.name + ": elements compared");
  check(differs_from_fp32 > 0, c.name + ": the 16-bit rounding shows against fp32 accumulation");
}

void run_overflow_case(const Case& c, const parallel::ParallelState& ps) {
  ParamStore params = make_model();
  DistributedDataParallel ddp(params, ps, options_of(c));
  moecore::AdamWOptions adam;
  adam.params_dtype = DType::kF16;
  moecore::DistributedAdamW opt(ddp, params, adam);
  ddp.zero_grad();
  for (int mb = 0; mb < 2; ++mb) {
    ddp.set_last_microbatch(mb == 1);
    for (int module = 2; module >= -1; --module) {
      if (module == 1 && ps.dp_cp.rank() == 0) params[3].grad.data<float>()[5] += 40000.0f;
      ddp.after_backward(module);
    }
  }
  ddp.finish_grad_sync();
  check(opt.unscale_grads_and_check_for_nan(1.0f / 8.0f),
        c.name + ": the fp16 accumulation's Inf is found by the unscale check on every rank");
}

}  // namespace

int main(int argc, char** argv) {
  parallel::MpiRuntime mpi(&argc, &argv);
  const parallel::ProcessGroup world = parallel::ProcessGroup::world();
  if (world.size() != 2) {
    std::fprintf(stderr, "run under mpirun -np 2\n");
    return 2;
  }
  moecore::ParallelSizes sizes;
  sizes.world_size = 2;
  const parallel::ParallelState ps = parallel::ParallelState::create(sizes, false, world);
  const std::vector<Case> cases = {
      {"bf16 all-reduce", DType::kBF16, false, false},
      {"bf16 reduce-scatter", DType::kBF16, true, false},
      {"bf16 overlapped buckets", DType::kBF16, false, true},
      {"fp16 all-reduce", DType::kF16, false, false},
      {"fp16 reduce-scatter overlapped", DType::kF16, true, true},
  };
  int passed = 0, failed = 0;
  const auto record = [&](const std::string& name, const auto& body) {
    g_failures = 0;
    try {
      body();
    } catch (const std::exception& e) {
      check(false, name + ": exception: " + e.what());
    }
    const bool ok = parallel::sum_double(world, static_cast<double>(g_failures)) == 0.0;
    (ok ? passed : failed) += 1;
    if (world.rank() == 0) std::printf("%s %s\n", ok ? "PASS" : "FAIL", name.c_str());
  };
  for (const Case& c : cases) {
    record(c.name + " vs Megatron's order", [&] { run_reference_case(c, ps); });
    if (c.grad_dtype == DType::kF16) record(c.name + " overflow", [&] { run_overflow_case(c, ps); });
  }
  if (world.rank() == 0) std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
