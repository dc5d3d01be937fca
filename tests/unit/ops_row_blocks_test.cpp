// The 16-bit paths that skip the whole-tensor Staging (ops/row_blocks.h; the 16-bit norm, combine and grouped-MLP
// kernels; attention one sequence at a time; the row moves on bits) against the fp32 path, on tensors large enough for
// many row blocks with a ragged last one: every op run once on fp32 tensors holding 16-bit values and once on bf16 /
// fp16 tensors, both under ScopedActivationDType(dtype), must write the same values bit for bit (the fp32 path's
// result, rounded once).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "lowp_test_values.h"
#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/ops/ops.h"
#include "moecore/ops/precision.h"

namespace moecore::ops {
namespace {

constexpr int64_t kS = 97, kB = 3, kHeads = 4, kGroups = 2, kHeadDim = 32;  // 291 token rows
constexpr int64_t kTokens = kS * kB, kHidden = 136;

// Named tensors of one side: fp32 tensors, or the activations among them as `dtype` tensors.
using Tensors = std::map<std::string, Tensor>;

using test::as_dtype;
using test::random_values;

Tensor as_fp32(const Tensor& t) { return t.dtype() == DType::kF32 ? t : as_dtype(t, DType::kF32); }

// Runs `op` on fp32 tensors and on copies whose `activations` are `dtype` tensors; every tensor must match bitwise.
void expect_same(const std::string& what, const DType dtype, const Tensors& inputs,
                 const std::vector<std::string>& activations, const std::function<void(Tensors&)>& op) {
  Tensors fp32, bits16;
  for (const auto& [name, t] : inputs) {
    fp32[name] = as_dtype(t, DType::kF32);
    const bool activation = std::find(activations.begin(), activations.end(), name) != activations.end();
    bits16[name] = as_dtype(t, activation ? dtype : DType::kF32);
  }
  {
    const ScopedActivationDType scope(dtype);
    op(fp32);
    op(bits16);
  }
  for (const auto& [name, want] : fp32) {
    const Tensor got = as_fp32(bits16.at(name));
    ASSERT_EQ(got.numel(), want.numel());
    for (int64_t i = 0; i < want.numel(); ++i) {
      ASSERT_EQ(got.data<float>()[i], want.data<float>()[i])
          << what << " in " << dtype_name(dtype) << ": " << name << "[" << i << "]";
    }
  }
}

class OpsRowBlocks : public ::testing::TestWithParam<DType> {};

TEST_P(OpsRowBlocks, NormsMatchTheFp32Path) {
  const DType dtype = GetParam();
  const Tensors inputs = {{"out", random_values({kTokens, kHidden}, dtype, 1)},
                          {"inp", random_values({kTokens, kHidden}, dtype, 2)},
                          {"dout", random_values({kTokens, kHidden}, dtype, 3)},
                          {"dinp", random_values({kTokens, kHidden}, dtype, 4)},
                          {"weight", random_values({kHidden}, dtype, 5)},
                          {"bias", random_values({kHidden}, dtype, 6)},
                          {"dweight", random_values({kHidden}, dtype, 7)},
                          {"dbias", random_values({kHidden}, dtype, 8)},
                          {"mean", Tensor({kTokens}, DType::kF32)},
                          {"rstd", Tensor({kTokens}, DType::kF32)}};
  const std::vector<std::string> activations = {"out", "inp", "dout", "dinp"};
  expect_same("rmsnorm", dtype, inputs, activations, [](Tensors& t) {
    rmsnorm_forward(t["out"], t["rstd"], t["inp"], t["weight"], 1e-5);
    rmsnorm_backward(t["dinp"], t["dweight"], t["dout"], t["inp"], t["weight"], t["rstd"]);
  });
  expect_same("layernorm", dtype, inputs, activations, [](Tensors& t) {
    layernorm_forward(t["out"], t["mean"], t["rstd"], t["inp"], t["weight"], &t["bias"], 1e-5);
    layernorm_backward(t["dinp"], t["dweight"], &t["dbias"], t["dout"], t["inp"], t["weight"], t["mean"], t["rstd"]);
  });
}

TEST_P(OpsRowBlocks, ElementwiseAndDropoutMatchTheFp32Path) {
  const DType dtype = GetParam();
  const int64_t n = 3 * 65536 + 17;  // several blocks of elements, a ragged last one
  const Tensors inputs = {{"y", random_values({n}, dtype, 11)},
                          {"x", random_values({n}, dtype, 12)},
                          {"out", random_values({n}, dtype, 13)}};
  const std::vector<std::string> activations = {"y", "x", "out"};
  expect_same("add_", dtype, inputs, activations, [](Tensors& t) { add_(t["y"], t["x"]); });
  for (const float p : {0.0f, 0.25f}) {
    const DropoutSpec spec{p, 1234, 5, 777};
    expect_same("dropout p=" + std::to_string(p), dtype, inputs, activations, [&](Tensors& t) {
      dropout_forward(t["out"], t["x"], spec);
      dropout_backward(t["y"], t["out"], spec);
    });
  }
}

TEST_P(OpsRowBlocks, RotaryEmbeddingMatchesTheFp32Path) {
  const DType dtype = GetParam();
  const Tensors inputs = {{"out", random_values({kS, kB, kHeads, kHeadDim}, dtype, 21)},
                          {"inp", random_values({kS, kB, kHeads, kHeadDim}, dtype, 22)},
                          {"dinp", random_values({kS, kB, kHeads, kHeadDim}, dtype, 23)}};
  const std::vector<std::string> activations = {"out", "inp", "dinp"};
  expect_same("rope, positions from an offset", dtype, inputs, activations, [](Tensors& t) {
    rope_forward(t["out"], t["inp"], kS, kB, kHeadDim, 24, 10000.0, 5);
    rope_backward(t["dinp"], t["out"], kS, kB, kHeadDim, 24, 10000.0, 5);
  });
  std::vector<int64_t> positions(static_cast<size_t>(kTokens));
  for (int64_t r = 0; r < kTokens; ++r) positions[static_cast<size_t>(r)] = (r * 7) % 41;  // packed documents
  expect_same("rope, positions per row", dtype, inputs, activations, [&](Tensors& t) {
    rope_forward(t["out"], t["inp"], kS, kB, kHeadDim, kHeadDim, 500000.0, positions);
    rope_backward(t["dinp"], t["out"], kS, kB, kHeadDim, kHeadDim, 500000.0, positions);
  });
}

// The 16-bit attention runs the fp32 kernel on a few sequences at a time (as many as keep q's fp32 copy within
// 1 MiB): at kS all three in one call; at kLongS (700 x 4 heads x 32 x 4 B = 358 KiB) two, then one.
constexpr int64_t kLongS = 700;

TEST_P(OpsRowBlocks, AttentionMatchesTheFp32Path) {
  const DType dtype = GetParam();
  for (const int64_t S : {kS, kLongS}) {
    const Tensors inputs = {{"q", random_values({S, kB, kHeads, kHeadDim}, dtype, 81)},
                            {"k", random_values({S, kB, kGroups, kHeadDim}, dtype, 82)},
                            {"v", random_values({S, kB, kGroups, kHeadDim}, dtype, 83)},
                            {"out", random_values({S, kB, kHeads, kHeadDim}, dtype, 84)},
                            {"lse", Tensor({kB, kHeads, S}, DType::kF32)},
                            {"dout", random_values({S, kB, kHeads, kHeadDim}, dtype, 85)},
                            {"dq", random_values({S, kB, kHeads, kHeadDim}, dtype, 86)},
                            {"dk", random_values({S, kB, kGroups, kHeadDim}, dtype, 87)},
                            {"dv", random_values({S, kB, kGroups, kHeadDim}, dtype, 88)}};
    AttentionDims dims;
    dims.S = S;
    dims.B = kB;
    dims.N = kHeads;
    dims.G = kGroups;
    dims.head_dim = kHeadDim;
    dims.scale = 0.17;
    expect_same("attention, S=" + std::to_string(S), dtype, inputs, {"q", "k", "v", "out", "dout", "dq", "dk", "dv"},
                [&](Tensors& t) {
                  attention_forward(t["out"], t["lse"], t["q"], t["k"], t["v"], dims, DropoutSpec{});
                  attention_backward(t["dq"], t["dk"], t["dv"], t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"],
                                     dims, DropoutSpec{});
                });
  }
}

TEST_P(OpsRowBlocks, RowMovesMatchTheFp32Path) {
  const DType dtype = GetParam();
  const int64_t Q = (kHeads + 2 * kGroups) * kHeadDim;
  const Tensors inputs = {{"qkv", random_values({kTokens, Q}, dtype, 31)},
                          {"q", random_values({kTokens, kHeads, kHeadDim}, dtype, 32)},
                          {"k", random_values({kTokens, kGroups, kHeadDim}, dtype, 33)},
                          {"v", random_values({kTokens, kGroups, kHeadDim}, dtype, 34)},
                          {"merged", random_values({kTokens, Q}, dtype, 35)},
                          {"permuted", random_values({2 * kTokens, kHidden}, dtype, 36)},
                          {"x", random_values({kTokens, kHidden}, dtype, 37)}};
  std::vector<int64_t> index(static_cast<size_t>(2 * kTokens));
  for (int64_t r = 0; r < 2 * kTokens; ++r) index[static_cast<size_t>(r)] = r % 5 == 4 ? -1 : (r * 13) % kTokens;
  expect_same("split / merge qkv, permute", dtype, inputs, {"qkv", "q", "k", "v", "merged", "permuted", "x"},
              [&](Tensors& t) {
                split_qkv(t["q"], t["k"], t["v"], t["qkv"], kHeads, kGroups, kHeadDim);
                merge_qkv(t["merged"], t["q"], t["k"], t["v"], kHeads, kGroups, kHeadDim);
                moe_permute(t["permuted"], t["x"], index);
              });
}

TEST_P(OpsRowBlocks, CombineAndChunkSortsMatchTheFp32Path) {
  const DType dtype = GetParam();
  const Tensors inputs = {{"expert_rows", random_values({2 * kTokens, kHidden}, dtype, 41)},
                          {"tokens", random_values({kTokens, kHidden}, dtype, 42)},
                          {"dexpert_rows", random_values({2 * kTokens, kHidden}, dtype, 43)},
                          {"probs", random_values({2 * kTokens}, dtype, 44)},
                          {"dprobs", random_values({2 * kTokens}, dtype, 45)},
                          {"sorted", random_values({2 * kTokens, kHidden}, dtype, 46)},
                          {"unsorted", random_values({2 * kTokens, kHidden}, dtype, 47)}};
  // Each token's two rows; every fifth row a padding row (no token).
  std::vector<int64_t> index(static_cast<size_t>(2 * kTokens));
  for (int64_t r = 0; r < 2 * kTokens; ++r) index[static_cast<size_t>(r)] = r % 5 == 4 ? -1 : (r * 13) % kTokens;
  const std::vector<int64_t> first_C = {300, 0, 150, 451}, rows_C = {151, 150, 150, 131};  // a permutation of chunks
  expect_same("unpermute, sort / unsort chunks", dtype, inputs,
              {"expert_rows", "tokens", "dexpert_rows", "sorted", "unsorted"}, [&](Tensors& t) {
                moe_unpermute(t["tokens"], t["expert_rows"], index, &t["probs"]);
                moe_unpermute_backward(&t["dexpert_rows"], &t["dprobs"], t["tokens"], index, &t["probs"],
                                       &t["expert_rows"]);
                sort_chunks(t["sorted"], t["expert_rows"], first_C, rows_C);
                unsort_chunks(t["unsorted"], t["sorted"], first_C, rows_C);
              });
}

// The fused grouped MLP over experts of 0, 3, 300 (two row tiles) and 517 (three) rows, on both GEMM paths, for the
// three placements of the probability (weighted SwiGLU after fc1, GELU scaled after it, SwiGLU on the input), with
// biases: forward and backward on 16-bit activations against fp32 tensors holding their values.
TEST_P(OpsRowBlocks, GroupedMlpMatchesTheFp32Path) {
  const DType dtype = GetParam();
  const kernels::LowpType type = dtype == DType::kBF16 ? kernels::LowpType::kBF16 : kernels::LowpType::kF16;
  const std::vector<int64_t> offsets_E1 = {0, 0, 3, 303, 820};
  const int64_t E = 4, R = offsets_E1.back(), H = 40, F = 24;
  for (const auto& [activation, probs_on_input] :
       {std::pair{Activation::kSwiGLU, false}, std::pair{Activation::kGelu, false},
        std::pair{Activation::kSwiGLU, true}}) {
    const GroupedMlpSpec spec{activation, probs_on_input};
    const int64_t F1 = activation_input_width(activation, F);
    Tensors inputs = {{"x", random_values({R, H}, dtype, 51)},  {"probs", random_values({R}, dtype, 52)},
                      {"dy", random_values({R, H}, dtype, 53)}, {"dx", random_values({R, H}, dtype, 54)},
                      {"y", Tensor({R, H}, DType::kF32)},       {"fc1", Tensor({R, F1}, DType::kF32)},
                      {"saved", Tensor({R, F}, DType::kF32)},   {"xs", Tensor({R, H}, DType::kF32)},
                      {"dprobs", Tensor({R}, DType::kF32)}};
    for (int64_t e = 0; e < E; ++e) {
      const auto n = std::to_string(e);
      const auto seed = static_cast<uint32_t>(60 + 10 * e);
      inputs["w1_" + n] = random_values({F1, H}, dtype, seed);
      inputs["b1_" + n] = random_values({F1}, dtype, seed + 1);
      inputs["w2_" + n] = random_values({H, F}, dtype, seed + 2);
      inputs["b2_" + n] = random_values({H}, dtype, seed + 3);
      inputs["dw1_" + n] = random_values({F1, H}, dtype, seed + 4);
      inputs["db1_" + n] = random_values({F1}, dtype, seed + 5);
      inputs["dw2_" + n] = random_values({H, F}, dtype, seed + 6);
      inputs["db2_" + n] = random_values({H}, dtype, seed + 7);
    }
    const bool weighted = activation == Activation::kSwiGLU && !probs_on_input;
    for (const auto path : {kernels::cpu::LowpGemmPath::kConvert, kernels::cpu::LowpGemmPath::kNative}) {
      if (path == kernels::cpu::LowpGemmPath::kNative && !kernels::cpu::lowp_native_available(type)) continue;
      const kernels::cpu::ScopedLowpGemmPath scoped(path);
      expect_same(std::string("grouped MLP ") +
                      (weighted         ? "weighted SwiGLU"
                       : probs_on_input ? "probs on input"
                                        : "GELU") +
                      (path == kernels::cpu::LowpGemmPath::kNative ? ", native GEMMs" : ", convert GEMMs"),
                  dtype, inputs, {"x", "dy", "dx", "y", "fc1", "saved", "xs"}, [&](Tensors& t) {
                    std::vector<const Tensor*> w1, b1, w2, b2;
                    std::vector<Tensor*> dw1, db1, dw2, db2;
                    for (int64_t e = 0; e < E; ++e) {
                      const auto n = std::to_string(e);
                      w1.push_back(&t["w1_" + n]);
                      b1.push_back(&t["b1_" + n]);
                      w2.push_back(&t["w2_" + n]);
                      b2.push_back(&t["b2_" + n]);
                      dw1.push_back(&t["dw1_" + n]);
                      db1.push_back(&t["db1_" + n]);
                      dw2.push_back(&t["dw2_" + n]);
                      db2.push_back(&t["db2_" + n]);
                    }
                    const GroupedMlpParams params{w1, b1, w2, b2};
                    Tensor* act = weighted ? nullptr : &t["saved"];
                    Tensor* h = weighted ? &t["saved"] : nullptr;
                    grouped_mlp_forward(t["y"], t["fc1"], act, h, &t["xs"], t["x"], t["probs"], params, offsets_E1,
                                        spec);
                    grouped_mlp_backward(t["dx"], t["dprobs"], {dw1, db1, dw2, db2}, t["dy"], t["x"], &t["xs"],
                                         t["fc1"], act, h, t["probs"], params, offsets_E1, spec);
                  });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OpsRowBlocks, ::testing::Values(DType::kBF16, DType::kF16),
                         [](const auto& param_info) { return std::string(dtype_name(param_info.param)); });

}  // namespace
}  // namespace moecore::ops
