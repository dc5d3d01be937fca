#include "moecore/ops/staging.h"

#include <exception>
#include <stdexcept>
#include <string>

#include "moecore/ops/convert.h"

namespace moecore::ops::detail {
namespace {

thread_local Staging* innermost_staging = nullptr;

Staging& require_staging(const Tensor& t) {
  Staging* staging = Staging::innermost();
  if (staging == nullptr) {
    throw std::logic_error(std::string("a ") + std::string(dtype_name(t.dtype())) +
                           " tensor reached an fp32 kernel outside an op's Staging");
  }
  return *staging;
}

}  // namespace

Staging::Staging() : outer_(innermost_staging), uncaught_(std::uncaught_exceptions()) { innermost_staging = this; }

Staging::~Staging() noexcept(false) {
  innermost_staging = outer_;
  if (std::uncaught_exceptions() > uncaught_) return;
  for (const std::unique_ptr<Entry>& e : entries_) {
    if (e->written) convert(e->target, e->f32);  // rounds to nearest even, once
  }
}

Staging* Staging::innermost() { return innermost_staging; }

bool Staging::narrows(const Tensor& t, const DType dtype) const {
  const auto* begin = t.data<uint8_t>();
  const uint8_t* end = begin + t.nbytes();
  for (const Staging* s = this; s != nullptr; s = s->outer_) {
    for (const std::unique_ptr<Entry>& e : s->entries_) {
      const auto* scratch = e->f32.data<uint8_t>();
      if (e->written && e->target.dtype() == dtype && begin >= scratch && end <= scratch + e->f32.nbytes()) return true;
    }
  }
  return false;
}

Staging::Entry* Staging::find(const Tensor& t) {
  for (Staging* s = this; s != nullptr; s = s->outer_) {
    for (const std::unique_ptr<Entry>& e : s->entries_) {
      if (e->target.data<uint8_t>() == t.data<uint8_t>() && e->target.dtype() == t.dtype() &&
          e->target.numel() == t.numel()) {
        return e.get();
      }
    }
  }
  return nullptr;
}

Staging::Entry& Staging::stage(const Tensor& t, const bool copy_in) {
  if (Entry* e = find(t)) return *e;
  auto e = std::make_unique<Entry>();
  e->target = t;
  // Overwritten before it is read: by the copy, or (write_only) by the op.
  e->f32 = Tensor::uninitialized(t.shape(), DType::kF32, MemCategory::kOther, t.device());
  if (copy_in) convert(e->f32, t);  // exact
  entries_.push_back(std::move(e));
  return *entries_.back();
}

const Tensor& Staging::in(const Tensor& t) {
  if (!t.defined() || !is_16bit(t.dtype())) return t;
  return stage(t, true).f32;
}

Tensor& Staging::out(Tensor& t) {
  if (!t.defined() || !is_16bit(t.dtype())) return t;
  Entry& e = stage(t, true);
  e.written = true;
  return e.f32;
}

Tensor& Staging::write_only(Tensor& t, const std::initializer_list<const Tensor*> inputs) {
  if (!t.defined() || !is_16bit(t.dtype())) return t;
  for (const Tensor* input : inputs) {
    if (input != nullptr && input->defined() && input->data<uint8_t>() == t.data<uint8_t>()) return out(t);
  }
  Entry& e = stage(t, false);
  e.written = true;
  return e.f32;
}

const float* staged_in(const Tensor& t) { return require_staging(t).in(t).data<float>(); }

float* staged_out(Tensor& t) { return require_staging(t).out(t).data<float>(); }

}  // namespace moecore::ops::detail
