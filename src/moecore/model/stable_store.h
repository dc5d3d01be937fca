// The model's registry of parameters (ParamStore) and buffers (BufferStore): elements in registration order that
// never move once added, so a module keeps a reference to what it registered from its constructor on (as torch's
// nn.Module holds its parameters). Backed by std::deque: appending never invalidates references to the elements
// already there; there is no erase or insert in the middle. Moving the store keeps its elements where they are.
#pragma once

#include <cstddef>
#include <deque>
#include <utility>

namespace moecore {

template <typename T>
class StableStore {
 public:
  using value_type = T;
  using iterator = typename std::deque<T>::iterator;
  using const_iterator = typename std::deque<T>::const_iterator;

  StableStore() = default;
  StableStore(StableStore&&) noexcept = default;
  StableStore& operator=(StableStore&&) noexcept = default;
  StableStore(const StableStore&) = delete;
  StableStore& operator=(const StableStore&) = delete;

  // Appends `item` and returns it where it stays.
  T& push_back(T item) { return items_.emplace_back(std::move(item)); }
  template <typename... Args>
  T& emplace_back(Args&&... args) {
    return items_.emplace_back(std::forward<Args>(args)...);
  }

  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  T& operator[](const size_t i) { return items_[i]; }
  const T& operator[](const size_t i) const { return items_[i]; }
  T& at(const size_t i) { return items_.at(i); }
  const T& at(const size_t i) const { return items_.at(i); }
  T& front() { return items_.front(); }
  const T& front() const { return items_.front(); }
  T& back() { return items_.back(); }
  const T& back() const { return items_.back(); }

  iterator begin() { return items_.begin(); }
  iterator end() { return items_.end(); }
  const_iterator begin() const { return items_.begin(); }
  const_iterator end() const { return items_.end(); }
  const_iterator cbegin() const { return items_.cbegin(); }
  const_iterator cend() const { return items_.cend(); }

 private:
  std::deque<T> items_;
};

}  // namespace moecore
