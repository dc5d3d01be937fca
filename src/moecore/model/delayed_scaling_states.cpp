#include "moecore/model/delayed_scaling_states.h"

#include <algorithm>
#include <span>
#include <stdexcept>

#include "moecore/parallel/comm_stats.h"

namespace moecore {
namespace {

constexpr std::string_view kWeightSuffix = ".weight";

// decoder.layers.{i}.... -> i.
int64_t layer_of(const std::string& name) {
  constexpr std::string_view prefix = "decoder.layers.";
  return std::stoll(name.substr(prefix.size(), name.find('.', prefix.size()) - prefix.size()));
}

}  // namespace

DelayedScalingStates::DelayedScalingStates(ParamStore& params, const parallel::ProcessGroup& amax_group)
    : amax_group_(amax_group) {
  for (Param& p : params) {
    if (!p.delayed_scaling) continue;
    std::string name = p.name;
    if (name.ends_with(kWeightSuffix)) name.resize(name.size() - kWeightSuffix.size());
    entries_.push_back({name, layer_of(p.name), p.delayed_scaling.get()});
  }
}

void DelayedScalingStates::set_first_microbatch(const int64_t first_layer, const int64_t end_layer) {
  for (const DelayedScalingEntry& e : entries_) {
    if (e.layer >= first_layer && e.layer < end_layer) e.state->set_first_microbatch();
  }
}

void DelayedScalingStates::reduce(const bool forward, const bool backward) {
  if (entries_.empty() || amax_group_.size() == 1) return;
  const auto pending = [&](quant::DelayedLinearScaling& s, const bool fwd) {
    return fwd ? s.pending_forward_amaxes() : s.pending_backward_amaxes();
  };
  std::vector<float> amax;
  for (const bool fwd : {true, false}) {
    if (fwd ? !forward : !backward) continue;
    for (const DelayedScalingEntry& e : entries_) {
      const std::span<const float> row0 = pending(*e.state, fwd);
      amax.insert(amax.end(), row0.begin(), row0.end());
    }
  }
  {
    const parallel::CommTimer timer(parallel::CommKind::kOther);
    amax_group_.all_reduce(std::span<float>(amax), parallel::ReduceOp::kMax);
  }
  size_t i = 0;
  for (const bool fwd : {true, false}) {
    if (fwd ? !forward : !backward) continue;
    for (const DelayedScalingEntry& e : entries_) {
      for (float& a : pending(*e.state, fwd)) a = amax[i++];
    }
  }
}

void DelayedScalingStates::after_forward() {
  reduce(true, false);
  for (const DelayedScalingEntry& e : entries_) e.state->update_forward();
}

void DelayedScalingStates::after_backward() {
  reduce(false, true);
  for (const DelayedScalingEntry& e : entries_) e.state->update_backward();
}

void DelayedScalingStates::reduce_pending() { reduce(true, true); }

namespace {

template <typename Fn>
void for_each_tensor(const std::vector<DelayedScalingEntry>& entries, Fn&& fn) {
  for (const DelayedScalingEntry& e : entries) {
    for (const std::span<float> t :
         {e.state->scale_fwd(), e.state->amax_history_fwd(), e.state->scale_bwd(), e.state->amax_history_bwd()}) {
      fn(t);
    }
  }
}

}  // namespace

std::vector<float> DelayedScalingStates::snapshot() const {
  std::vector<float> values;
  for_each_tensor(entries_, [&](const std::span<float> t) { values.insert(values.end(), t.begin(), t.end()); });
  return values;
}

void DelayedScalingStates::restore(const std::vector<float>& values) {
  size_t i = 0;
  for_each_tensor(entries_, [&](const std::span<float> t) {
    if (i + t.size() > values.size()) throw std::logic_error("DelayedScalingStates::restore: snapshot too short");
    std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(i), t.size(), t.begin());
    i += t.size();
  });
  if (i != values.size()) throw std::logic_error("DelayedScalingStates::restore: snapshot of another model");
}

}  // namespace moecore
