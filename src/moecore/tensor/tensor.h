// Tensor: a dtype, a device, a row-major shape and a view into shared, tracked storage. Deliberately small:
// kernels work on raw pointers; ops (src/moecore/ops) dispatch on a tensor's device and dtype; Tensor owns
// memory, knows its shape and reports to the MemoryTracker.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "moecore/tensor/device.h"
#include "moecore/tensor/dtype.h"
#include "moecore/tensor/memory_tracker.h"

namespace moecore {

// 64-byte aligned, zero-initialised bytes from the device's allocator, counted under one MemCategory for their
// lifetime.
class Storage {
 public:
  // Throws std::runtime_error for a device this build cannot allocate on (allocator.h).
  Storage(size_t bytes, MemCategory category, Device device = Device::kCPU);
  // Not zero-initialised (Allocator::allocate_uninitialized): for memory overwritten before it is read.
  struct Uninitialized {};
  Storage(size_t bytes, MemCategory category, Device device, Uninitialized);
  ~Storage();
  // Borrowed: memory owned elsewhere; neither freed nor counted by the MemoryTracker.
  // `device` must be host-accessible (the CPU or the reference device; no guards around borrowed memory).
  Storage(std::byte* borrowed, size_t bytes, Device device = Device::kCPU);
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }
  Device device() const { return device_; }
  // "" unless something wrote outside the allocation (the reference device's guard bytes).
  std::string outside_writes() const;

 private:
  std::byte* data_;  // owned (freed in the destructor) unless borrowed
  size_t bytes_;
  MemCategory category_;
  ActivationOwner owner_ = ActivationOwner::kOther;
  Device device_;
  bool owned_ = true;
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::vector<int64_t> shape, DType dtype, MemCategory category = MemCategory::kOther,
         Device device = Device::kCPU);

  // A tensor whose elements the caller overwrites before reading them (not zeroed: a conversion's or a GEMM's
  // output, a staged copy).
  static Tensor uninitialized(std::vector<int64_t> shape, DType dtype, MemCategory category = MemCategory::kOther,
                              Device device = Device::kCPU);

  static Tensor zeros(std::vector<int64_t> shape, DType dtype = DType::kF32,
                      MemCategory category = MemCategory::kOther) {
    return Tensor(std::move(shape), dtype, category);
  }

  // A view of host memory owned by the caller (like torch::from_blob), on a host-accessible device: valid only
  // while that memory lives.
  template <typename T>
  static Tensor from_blob(T* data, std::vector<int64_t> shape, Device device = Device::kCPU);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::kCPU; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(static_cast<size_t>(i < 0 ? i + ndim() : i)); }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const;  // throws std::overflow_error where the shape's product overflows
  size_t nbytes() const;
  std::string shape_str() const;

  template <typename T>
  T* data() {
    return reinterpret_cast<T*>(storage_->data() + offset_bytes_);
  }
  template <typename T>
  const T* data() const {
    return reinterpret_cast<const T*>(storage_->data() + offset_bytes_);
  }
  template <typename T>
  std::span<T> span() {
    return {data<T>(), static_cast<size_t>(numel())};
  }
  template <typename T>
  std::span<const T> span() const {
    return {data<T>(), static_cast<size_t>(numel())};
  }

  // Same storage, new shape with the same element count.
  Tensor view(std::vector<int64_t> shape) const;
  // Rows [begin, end) of the first dimension, sharing storage.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  Tensor clone(MemCategory category = MemCategory::kOther) const;
  // A copy on `device` (between host-accessible devices).
  Tensor to(Device device, MemCategory category = MemCategory::kOther) const;
  void zero_();
  void copy_from(const Tensor& other);  // same dtype and numel
  // The memory category its storage is counted under (kOther when undefined).
  MemCategory category() const { return storage_ ? storage_->category() : MemCategory::kOther; }
  // Whether both are views of one storage (a tensor kept under two names holds its bytes once).
  bool shares_storage(const Tensor& other) const { return storage_ != nullptr && storage_ == other.storage_; }

 private:
  friend std::string outside_writes(const Tensor& t);
  // New storage for shape_ / dtype_, zeroed or not.
  void allocate(MemCategory category, Device device, bool zeroed);

  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;
  std::vector<int64_t> shape_;
  DType dtype_ = DType::kF32;
};

template <typename T>
Tensor Tensor::from_blob(T* data, std::vector<int64_t> shape, const Device device) {
  Tensor out;
  out.shape_ = std::move(shape);
  out.dtype_ = dtype_of<std::remove_const_t<T>>();
  out.storage_ = std::make_shared<Storage>(reinterpret_cast<std::byte*>(const_cast<std::remove_const_t<T>*>(data)),
                                           out.nbytes(), device);
  return out;
}

// "" unless a kernel wrote outside the tensor's storage (detected on the reference device).
std::string outside_writes(const Tensor& t);

}  // namespace moecore
