#include "moecore/ckpt/state_dict.h"

#include <stdexcept>
#include <utility>

#include "moecore/model/gpt_model.h"

namespace moecore {
namespace {

StatePlacement replicated(const std::vector<int64_t>& shape) {
  StatePlacement p;
  p.shard.full_shape = shape;
  return p;
}

}  // namespace

int64_t shape_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

int64_t local_numel(const StatePlacement& placement) {
  if (placement.flat()) return placement.flat_end - placement.flat_begin;
  return shape_numel(shard_shape(placement.shard));
}

int64_t global_index(const StatePlacement& placement, const int64_t local_index) {
  return full_index(placement.shard, placement.flat_begin + local_index);
}

void StateDict::add(StateEntry entry) {
  if (contains(entry.key)) throw std::logic_error("state dict: key " + entry.key + " added twice");
  const StatePlacement& p = entry.placement;
  if (p.shard.full_shape != entry.global_shape) {
    throw std::logic_error("state dict: " + entry.key + " has global shape " + shape_text(entry.global_shape) +
                           " but is placed in " + shape_text(p.shard.full_shape));
  }
  if (p.flat() && (p.flat_begin < 0 || p.flat_end < p.flat_begin || p.flat_end > shape_numel(shard_shape(p.shard)))) {
    throw std::logic_error("state dict: " + entry.key + " has flat range [" + std::to_string(p.flat_begin) + ", " +
                           std::to_string(p.flat_end) + ") outside its shard");
  }
  if (!entry.local.defined() || entry.local.dtype() != entry.dtype || entry.local.numel() != local_numel(p)) {
    throw std::logic_error("state dict: the local tensor of " + entry.key + " does not match its placement");
  }
  entries_.push_back(std::move(entry));
}

void StateDict::add_tensor(std::string key, const Tensor& local, const StatePlacement& placement) {
  StateEntry e;
  e.key = std::move(key);
  e.dtype = local.dtype();
  e.global_shape = placement.shard.full_shape;
  e.placement = placement;
  e.local = local;
  add(std::move(e));
}

void StateDict::add_i64(std::string key, const int64_t value) {
  StateEntry e;
  e.key = std::move(key);
  e.dtype = DType::kI64;
  e.placement = replicated({});
  e.local = Tensor(std::vector<int64_t>{}, DType::kI64);
  *e.local.data<int64_t>() = value;
  add(std::move(e));
}

void StateDict::add_f64(std::string key, const double value) {
  StateEntry e;
  e.key = std::move(key);
  e.dtype = DType::kF64;
  e.placement = replicated({});
  e.local = Tensor(std::vector<int64_t>{}, DType::kF64);
  *e.local.data<double>() = value;
  add(std::move(e));
}

const StateEntry* StateDict::find(const std::string& key) const {
  for (const StateEntry& e : entries_) {
    if (e.key == key) return &e;
  }
  return nullptr;
}

const StateEntry& StateDict::at(const std::string& key) const {
  const StateEntry* e = find(key);
  if (e == nullptr) throw std::out_of_range("state dict has no entry " + key);
  return *e;
}

int64_t StateDict::i64(const std::string& key) const {
  const StateEntry& e = at(key);
  if (e.dtype != DType::kI64 || e.local.numel() != 1) throw std::logic_error(key + " is not an int64 scalar");
  return *e.local.data<int64_t>();
}

double StateDict::f64(const std::string& key) const {
  const StateEntry& e = at(key);
  if (e.dtype != DType::kF64 || e.local.numel() != 1) throw std::logic_error(key + " is not a float64 scalar");
  return *e.local.data<double>();
}

std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const StateEntry& e : entries_) out.push_back(e.key);
  return out;
}

void add_model_state(StateDict& state, const GPTModel& model) {
  for (const Param& p : model.params()) state.add_tensor(p.name, p.value, StatePlacement{p.shard});
  for (const Buffer& b : model.named_buffers()) state.add_tensor(b.name, b.value, StatePlacement{b.shard});
}

}  // namespace moecore
