// The parameter store never moves a registered Param: a module keeps the reference its constructor took while the
// store grows and when the store itself is moved, so modules are ready to run as soon as they are constructed.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "moecore/model/buffer.h"
#include "moecore/model/norm_module.h"
#include "moecore/model/parallel_linear.h"
#include "moecore/model/param.h"

namespace moecore {
namespace {

constexpr int kMany = 4096;  // enough appends to make any contiguous storage reallocate

void fill(Tensor& t, const float value) {
  for (float& v : t.span<float>()) v = value;
}

void register_many(ParamStore& params) {
  for (int i = 0; i < kMany; ++i) params.push_back(make_param("filler." + std::to_string(i), {1}, InitKind::kZeros));
}

TEST(StableStore, ElementsStayPutWhileTheStoreGrowsAndMoves) {
  ParamStore params;
  Param& first = params.push_back(make_param("first", {2, 3}, InitKind::kOnes));
  const float* first_values = first.value.data<float>();
  register_many(params);
  EXPECT_EQ(&params[0], &first);
  ParamStore moved = std::move(params);
  EXPECT_EQ(&moved[0], &first);
  EXPECT_EQ(moved[0].name, "first");
  EXPECT_EQ(moved[0].value.data<float>(), first_values);
  EXPECT_EQ(moved.size(), static_cast<size_t>(kMany + 1));
  EXPECT_EQ(moved.back().name, "filler." + std::to_string(kMany - 1));

  BufferStore buffers;
  Buffer& bias = buffers.push_back(make_buffer("bias", {4}));
  for (int i = 0; i < kMany; ++i) buffers.push_back(make_buffer("filler." + std::to_string(i), {1}));
  EXPECT_EQ(&buffers.front(), &bias);
}

// A linear layer and a norm run right after their constructors, with many parameters registered after them: the
// weights they use and the gradients they write are the store's elements.
TEST(StableStore, ModulesAreReadyFromTheirConstructor) {
  ParamStore params;
  const ColumnParallelLinear linear("fc", 3, 2, TensorParallel(), LinearOptions{}, params);
  NormOptions norm;
  norm.kind = Normalization::kRMSNorm;
  const NormModule rmsnorm("norm", 2, norm, params);
  register_many(params);
  ASSERT_EQ(&linear.weight(), &params[0]);
  fill(params[0].value, 1.0f);  // a [2, 3] weight of ones
  fill(params[1].value, 2.0f);  // the norm's weight

  Tensor x_TI({1, 3}, DType::kF32);
  fill(x_TI, 1.0f);
  LinearActivations saved;
  const Tensor y_TO = linear.forward(x_TI, saved);
  EXPECT_EQ(y_TO.data<float>()[0], 3.0f);
  EXPECT_EQ(y_TO.data<float>()[1], 3.0f);
  Tensor dy_TO({1, 2}, DType::kF32);
  fill(dy_TO, 1.0f);
  linear.backward_weights(dy_TO, saved);
  EXPECT_EQ(params[0].grad.data<float>()[0], 1.0f);

  Tensor out_TD({1, 2}, DType::kF32);
  rmsnorm.forward(out_TD, y_TO);
  EXPECT_NEAR(out_TD.data<float>()[0], 2.0f, 1e-5);  // rms(y) = 3: y / 3 * 2
}

}  // namespace
}  // namespace moecore
