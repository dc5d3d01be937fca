// Tensor storage, views and slices, and the MemoryTracker's current/peak bytes per category.
#include "moecore/tensor/tensor.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <thread>
#include <vector>

#include "moecore/tensor/memory_tracker.h"

namespace moecore {
namespace {

MemoryTracker& tracker() { return MemoryTracker::instance(); }

TEST(TensorTest, ShapeSizeAndZeroInitialisation) {
  Tensor t({3, 5, 7}, DType::kF32);
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.ndim(), 3);
  EXPECT_EQ(t.numel(), 105);
  EXPECT_EQ(t.nbytes(), 420u);
  EXPECT_EQ(t.dim(0), 3);
  EXPECT_EQ(t.dim(-1), 7);
  EXPECT_EQ(t.shape_str(), "[3, 5, 7]");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data<float>()) % 64, 0u);
  for (const float v : t.span<float>()) ASSERT_EQ(v, 0.0f);
  EXPECT_EQ(Tensor::zeros({4}, DType::kBF16).nbytes(), 8u);
  EXPECT_FALSE(Tensor().defined());
  EXPECT_THROW(Tensor({2, -1}, DType::kF32), std::invalid_argument);
  EXPECT_THROW(t.dim(3), std::out_of_range);
}

TEST(TensorTest, ViewSharesStorage) {
  Tensor t({4, 6}, DType::kF64);
  Tensor v = t.view({2, 3, 4});
  EXPECT_EQ(v.shape(), (std::vector<int64_t>{2, 3, 4}));
  v.data<double>()[13] = 2.5;
  EXPECT_EQ(t.data<double>()[13], 2.5);
  EXPECT_THROW(t.view({5, 5}), std::invalid_argument);
}

TEST(TensorTest, SliceRowsIsAnOffsetView) {
  Tensor t({5, 3}, DType::kI32);
  for (int64_t i = 0; i < 15; ++i) t.data<int32_t>()[i] = static_cast<int32_t>(i);
  Tensor rows = t.slice_rows(1, 4);
  EXPECT_EQ(rows.shape(), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(rows.data<int32_t>()[0], 3);
  EXPECT_EQ(rows.data<int32_t>()[8], 11);
  rows.data<int32_t>()[0] = -1;  // writes through to the parent
  EXPECT_EQ(t.data<int32_t>()[3], -1);
  // A slice of a slice, and a view of a slice, keep the accumulated offset.
  Tensor inner = rows.slice_rows(1, 2);
  EXPECT_EQ(inner.data<int32_t>()[0], 6);
  EXPECT_EQ(rows.view({9}).data<int32_t>()[8], 11);
  EXPECT_EQ(t.slice_rows(5, 5).numel(), 0);
  EXPECT_THROW(t.slice_rows(2, 6), std::out_of_range);
  EXPECT_THROW(t.slice_rows(3, 2), std::out_of_range);
  EXPECT_THROW(t.slice_rows(-1, 2), std::out_of_range);
}

TEST(TensorTest, CloneIsDeepAndCopyFromChecksShape) {
  Tensor t({2, 3}, DType::kF32);
  for (int i = 0; i < 6; ++i) t.data<float>()[i] = static_cast<float>(i) + 0.5f;
  Tensor c = t.slice_rows(1, 2).clone();
  EXPECT_EQ(c.shape(), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(c.data<float>()[0], 3.5f);
  c.data<float>()[0] = 100.0f;
  EXPECT_EQ(t.data<float>()[3], 3.5f);  // the original is untouched

  Tensor dst({6}, DType::kF32);
  dst.copy_from(t);
  EXPECT_EQ(dst.data<float>()[5], 5.5f);
  dst.zero_();
  EXPECT_EQ(dst.data<float>()[5], 0.0f);
  EXPECT_EQ(t.data<float>()[5], 5.5f);
  EXPECT_THROW(dst.copy_from(Tensor({5}, DType::kF32)), std::invalid_argument);
  EXPECT_THROW(dst.copy_from(Tensor({6}, DType::kF64)), std::invalid_argument);
}

TEST(MemoryTrackerTest, CountsCurrentAndPeakPerCategory) {
  const int64_t act0 = tracker().current(MemCategory::kActivations);
  const int64_t grads0 = tracker().current(MemCategory::kGrads);
  const int64_t total0 = tracker().current_total();
  tracker().reset_peaks();
  EXPECT_EQ(tracker().peak(MemCategory::kActivations), act0);
  {
    Tensor a({10, 10}, DType::kF32, MemCategory::kActivations);  // 400 bytes
    {
      Tensor b({25}, DType::kF64, MemCategory::kActivations);  // 200 bytes
      Tensor g({3}, DType::kBF16, MemCategory::kGrads);        // 6 bytes
      EXPECT_EQ(tracker().current(MemCategory::kActivations), act0 + 600);
      EXPECT_EQ(tracker().current(MemCategory::kGrads), grads0 + 6);
      EXPECT_EQ(tracker().current_total(), total0 + 606);
      // Views and slices share storage: nothing new is counted.
      Tensor v = a.view({100});
      Tensor s = a.slice_rows(2, 5);
      EXPECT_EQ(tracker().current(MemCategory::kActivations), act0 + 600);
    }
    EXPECT_EQ(tracker().current(MemCategory::kActivations), act0 + 400);
    EXPECT_EQ(tracker().peak(MemCategory::kActivations), act0 + 600);
    EXPECT_EQ(tracker().peak(MemCategory::kGrads), grads0 + 6);
    EXPECT_EQ(tracker().peak_total(), total0 + 606);
    // A clone is counted under the category it is given.
    Tensor c = a.clone(MemCategory::kGrads);
    EXPECT_EQ(tracker().current(MemCategory::kGrads), grads0 + 400);
    EXPECT_EQ(tracker().peak(MemCategory::kGrads), grads0 + 400);
  }
  EXPECT_EQ(tracker().current(MemCategory::kActivations), act0);
  EXPECT_EQ(tracker().current(MemCategory::kGrads), grads0);
  EXPECT_EQ(tracker().current_total(), total0);
  EXPECT_EQ(tracker().peak(MemCategory::kActivations), act0 + 600);
  tracker().reset_peaks();
  EXPECT_EQ(tracker().peak(MemCategory::kActivations), act0);
  EXPECT_EQ(tracker().peak_total(), total0);
}

TEST(MemoryTrackerTest, StorageOutlivesTheTensorThatMadeIt) {
  const int64_t params0 = tracker().current(MemCategory::kParams);
  Tensor view;
  {
    Tensor owner({8}, DType::kF32, MemCategory::kParams);
    view = owner.view({2, 4});
  }
  EXPECT_EQ(tracker().current(MemCategory::kParams), params0 + 32);  // still alive through the view
  view = Tensor();
  EXPECT_EQ(tracker().current(MemCategory::kParams), params0);
}

TEST(MemoryTrackerTest, ConcurrentAllocationsBalance) {
  const int64_t comm0 = tracker().current(MemCategory::kComm);
  tracker().reset_peaks();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < 500; ++i) Tensor tmp({16}, DType::kF32, MemCategory::kComm);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(tracker().current(MemCategory::kComm), comm0);
  EXPECT_GE(tracker().peak(MemCategory::kComm), comm0 + 64);
  EXPECT_LE(tracker().peak(MemCategory::kComm), comm0 + 4 * 64);
}

// Activations count under the owner whose scope allocated them (freed under that owner wherever they die); the
// per-owner snapshot is taken when the activation total reaches a new peak.
TEST(MemoryTrackerTest, ActivationsPerOwnerAtThePeak) {
  const auto owner_bytes = [](const ActivationOwner o) {
    return tracker().activations_at_peak()[static_cast<size_t>(o)];
  };
  tracker().reset_peaks();
  const int64_t attention0 = owner_bytes(ActivationOwner::kAttention);
  const int64_t output0 = owner_bytes(ActivationOwner::kOutputLoss);
  const int64_t mlp0 = owner_bytes(ActivationOwner::kMlp);
  Tensor kept;
  {
    const ActivationOwnerScope attention(ActivationOwner::kAttention);
    kept = Tensor({100}, DType::kF32, MemCategory::kActivations);  // 400 bytes, lives on
    Tensor not_activation({100}, DType::kF32, MemCategory::kGrads);
    {
      const ActivationOwnerScope output(ActivationOwner::kOutputLoss);
      EXPECT_EQ(tracker().owner(), ActivationOwner::kOutputLoss);
      Tensor logits({250}, DType::kF32, MemCategory::kActivations);  // 1000 bytes, freed at once: the peak
    }
    EXPECT_EQ(tracker().owner(), ActivationOwner::kAttention);
  }
  EXPECT_EQ(owner_bytes(ActivationOwner::kAttention), attention0 + 400);
  EXPECT_EQ(owner_bytes(ActivationOwner::kOutputLoss), output0 + 1000);
  {
    // Freed under the owner that allocated it, though another scope is active: the next peak (2200 + 20000 bytes,
    // above the 1400 before) sees it gone.
    const ActivationOwnerScope mlp(ActivationOwner::kMlp);
    kept = Tensor();
    Tensor big({550}, DType::kF32, MemCategory::kActivations);
    Tensor bigger({5000}, DType::kF32, MemCategory::kActivations);
  }
  EXPECT_EQ(owner_bytes(ActivationOwner::kAttention), attention0);
  EXPECT_EQ(owner_bytes(ActivationOwner::kOutputLoss), output0);
  EXPECT_EQ(owner_bytes(ActivationOwner::kMlp), mlp0 + 22200);
  EXPECT_EQ(activation_owner_name(ActivationOwner::kOutputLoss), "output layer + loss");
}

TEST(MemoryTrackerTest, CategoryNames) {
  EXPECT_EQ(mem_category_name(MemCategory::kParams), "params");
  EXPECT_EQ(mem_category_name(MemCategory::kOptimizer), "optimizer");
  EXPECT_EQ(mem_category_name(MemCategory::kActivations), "activations");
}

}  // namespace
}  // namespace moecore
