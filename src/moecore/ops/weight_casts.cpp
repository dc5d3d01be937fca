#include "moecore/ops/weight_casts.h"

#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

#include "moecore/ops/convert.h"

namespace moecore::ops {
namespace {

struct Key {
  const void* data;
  int64_t numel;
  DType dtype;
  bool operator<(const Key& other) const {
    return std::tie(data, numel, dtype) < std::tie(other.data, other.numel, other.dtype);
  }
};

struct Entry {
  Tensor weight;  // keeps the parameter's storage alive, so no other tensor can take its address in the scope
  Tensor cast_n;
};

using Entries = std::map<Key, Entry>;

struct Casts {
  int depth = 0;
  Entries entries;
};

// The training loop's thread only: the ops that read the copies run there (their kernels fork below them).
Casts& casts() {
  static Casts instance;
  return instance;
}

}  // namespace

struct WeightCastCarry::State {
  Entries stale, fresh;
};

WeightCastCarry::WeightCastCarry() : state_(std::make_unique<State>()) {}

WeightCastCarry::~WeightCastCarry() = default;

Tensor WeightCastCarry::refresh(const Tensor& weight, const DType dtype) {
  if (!weight.defined() || weight.dtype() != DType::kF32) return Tensor();
  const auto it = state_->stale.find(Key{weight.data<float>(), weight.numel(), dtype});
  if (it == state_->stale.end()) return Tensor();
  Tensor cast_n = it->second.cast_n;
  state_->fresh.insert(state_->stale.extract(it));
  return cast_n;
}

void WeightCastCarry::drop_stale() { state_->stale.clear(); }

int64_t WeightCastCarry::fresh() const { return static_cast<int64_t>(state_->fresh.size()); }

int64_t WeightCastCarry::stale() const { return static_cast<int64_t>(state_->stale.size()); }

ScopedWeightCasts::ScopedWeightCasts(WeightCastCarry* carry) : carry_(casts().depth == 0 ? carry : nullptr) {
  ++casts().depth;
  if (carry_ == nullptr) return;
  casts().entries = std::move(carry_->state_->fresh);
  carry_->state_->fresh.clear();
  carry_->state_->stale.clear();
}

ScopedWeightCasts::~ScopedWeightCasts() {
  if (--casts().depth != 0) return;
  if (carry_ != nullptr) {
    carry_->state_->stale = std::move(casts().entries);
  }
  casts().entries.clear();
}

bool weight_casts_live() { return casts().depth > 0; }

int64_t weight_casts_kept() { return static_cast<int64_t>(casts().entries.size()); }

Tensor cached_weight_cast(const Tensor& weight, const DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    throw std::invalid_argument("cached_weight_cast: expected bf16 or fp16, got " + std::string(dtype_name(dtype)));
  }
  if (!weight_casts_live() || !weight.defined() || weight.dtype() != DType::kF32 ||
      weight.category() != MemCategory::kParams) {
    return Tensor();
  }
  const Key key{weight.data<float>(), weight.numel(), dtype};
  auto it = casts().entries.find(key);
  if (it == casts().entries.end()) {
    // Counted with the parameters (the planner's params at the step, plan/moecore_engine_memory.cpp).
    Tensor cast_n = Tensor::uninitialized({weight.numel()}, dtype, MemCategory::kParams, weight.device());
    convert(cast_n, weight.view({weight.numel()}));
    it = casts().entries.emplace(key, Entry{weight, std::move(cast_n)}).first;
  }
  return it->second.cast_n;
}

}  // namespace moecore::ops
