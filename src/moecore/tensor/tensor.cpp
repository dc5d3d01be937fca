#include "moecore/tensor/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>
#include <stdexcept>

#include "moecore/tensor/allocator.h"

namespace moecore {

Storage::Storage(const size_t bytes, const MemCategory category, const Device device)
    : data_(allocator_for(device).allocate(bytes)), bytes_(bytes), category_(category), device_(device) {
  owner_ = MemoryTracker::instance(device_).on_alloc(category_, bytes_);
}

Storage::Storage(const size_t bytes, const MemCategory category, const Device device, Uninitialized)
    : data_(allocator_for(device).allocate_uninitialized(bytes)), bytes_(bytes), category_(category), device_(device) {
  owner_ = MemoryTracker::instance(device_).on_alloc(category_, bytes_);
}

Storage::Storage(std::byte* borrowed, const size_t bytes, const Device device)
    : data_(borrowed), bytes_(bytes), category_(MemCategory::kOther), device_(device), owned_(false) {
  if (!host_accessible(device)) {
    throw std::runtime_error("a view of host memory cannot be on " + std::string(device_name(device)));
  }
}

Storage::~Storage() {
  if (!owned_) return;
  MemoryTracker::instance(device_).on_free(category_, owner_, bytes_);
  allocator_for(device_).deallocate(data_, bytes_);
}

Tensor::Tensor(std::vector<int64_t> shape, const DType dtype, const MemCategory category, const Device device)
    : shape_(std::move(shape)), dtype_(dtype) {
  allocate(category, device, true);
}

Tensor Tensor::uninitialized(std::vector<int64_t> shape, const DType dtype, const MemCategory category,
                             const Device device) {
  Tensor out;
  out.shape_ = std::move(shape);
  out.dtype_ = dtype;
  out.allocate(category, device, false);
  return out;
}

void Tensor::allocate(const MemCategory category, const Device device, const bool zeroed) {
  for (const int64_t d : shape_) {
    if (d < 0) throw std::invalid_argument("tensor shape has a negative dimension");
  }
  const size_t bytes = nbytes();
  try {
    storage_ = zeroed ? std::make_shared<Storage>(bytes, category, device)
                      : std::make_shared<Storage>(bytes, category, device, Storage::Uninitialized{});
  } catch (const std::bad_alloc&) {
    throw std::runtime_error("out of memory: cannot allocate " + std::to_string(bytes >> 20) + " MiB for a " +
                             shape_str() + " " + std::string(dtype_name(dtype_)) + " tensor");
  }
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape_) {
    if (__builtin_mul_overflow(n, d, &n)) {
      throw std::overflow_error("tensor shape " + shape_str() + " has more elements than 64-bit integers hold");
    }
  }
  return n;
}

size_t Tensor::nbytes() const {
  size_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<size_t>(numel()), dtype_size(dtype_), &bytes)) {
    throw std::overflow_error("tensor shape " + shape_str() + " has more bytes than 64-bit integers hold");
  }
  return bytes;
}

std::string Tensor::shape_str() const {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape_.size(); ++i) out << (i ? ", " : "") << shape_[i];
  out << ']';
  return out.str();
}

Tensor Tensor::view(std::vector<int64_t> shape) const {
  Tensor out = *this;
  out.shape_ = std::move(shape);
  if (out.numel() != numel()) {
    throw std::invalid_argument("view " + out.shape_str() + " does not match " + shape_str());
  }
  return out;
}

Tensor Tensor::slice_rows(const int64_t begin, const int64_t end) const {
  if (ndim() == 0 || begin < 0 || end < begin || end > shape_[0]) {
    throw std::out_of_range("slice_rows out of range for " + shape_str());
  }
  Tensor out = *this;
  const int64_t row = shape_[0] == 0 ? 0 : numel() / shape_[0];
  out.offset_bytes_ += static_cast<size_t>(begin * row) * dtype_size(dtype_);
  out.shape_[0] = end - begin;
  return out;
}

Tensor Tensor::clone(const MemCategory category) const {
  if (!defined()) throw std::logic_error("clone of an undefined tensor");
  Tensor out = uninitialized(shape_, dtype_, category, device());
  if (nbytes() > 0) std::memcpy(out.data<std::byte>(), data<std::byte>(), nbytes());
  return out;
}

Tensor Tensor::to(const Device device, const MemCategory category) const {
  if (!defined()) throw std::logic_error("to() of an undefined tensor");
  if (!host_accessible(device) || !host_accessible(this->device())) {
    throw std::runtime_error("cannot copy a tensor from " + std::string(device_name(this->device())) + " to " +
                             std::string(device_name(device)) + ": no transfer between them in this build");
  }
  Tensor out(shape_, dtype_, category, device);
  if (nbytes() > 0) std::memcpy(out.data<std::byte>(), data<std::byte>(), nbytes());
  return out;
}

std::string Storage::outside_writes() const {
  return owned_ ? allocator_for(device_).outside_writes(data_, bytes_) : "";
}

std::string outside_writes(const Tensor& t) { return t.defined() ? t.storage_->outside_writes() : ""; }

void Tensor::zero_() {
  if (defined() && nbytes() > 0) std::memset(data<std::byte>(), 0, nbytes());
}

void Tensor::copy_from(const Tensor& other) {
  if (!defined() || !other.defined()) throw std::logic_error("copy_from with an undefined tensor");
  if (other.dtype_ != dtype_ || other.numel() != numel()) {
    throw std::invalid_argument("copy_from: " + other.shape_str() + " into " + shape_str());
  }
  if (nbytes() > 0) std::memcpy(data<std::byte>(), other.data<std::byte>(), nbytes());
}

}  // namespace moecore
