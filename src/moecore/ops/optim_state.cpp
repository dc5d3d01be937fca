#include <span>
#include <string>

#include "moecore/ops/dispatch.h"
#include "moecore/ops/optim.h"

namespace moecore::ops {
namespace {

void check_state(const char* op, const Tensor& stored, const StateFormat format, const Tensor& unscaled) {
  if (!stored.defined() || !unscaled.defined()) detail::fail(op, "undefined tensor");
  if (stored.device() != Device::kCPU || unscaled.device() != Device::kCPU) detail::fail(op, "CPU tensors only");
  if (unscaled.dtype() != DType::kF32) detail::fail(op, "the unscaled state must be fp32");
  if (stored.dtype() != state_storage_dtype(format)) {
    detail::fail(op, "a " + std::string(quant::state_format_name(format)) + " state is stored as " +
                         std::string(dtype_name(state_storage_dtype(format))) + ", got " +
                         std::string(dtype_name(stored.dtype())));
  }
  detail::check_numel(op, "stored", stored, unscaled.numel());
}

}  // namespace

DType state_storage_dtype(const StateFormat format) {
  switch (format) {
    case StateFormat::kF32: return DType::kF32;
    case StateFormat::kF16: return DType::kF16;
    case StateFormat::kBF16: return DType::kBF16;
    case StateFormat::kFP8: return DType::kU8;
  }
  return DType::kF32;
}

float abs_max(const Tensor& x) {
  if (!x.defined() || x.dtype() != DType::kF32 || x.device() != Device::kCPU) {
    detail::fail("abs_max", "needs a CPU fp32 tensor");
  }
  return quant::abs_max(x.span<float>());
}

void encode_state(const Tensor& unscaled, const StateFormat format, const float scale, Tensor& stored) {
  check_state("encode_state", stored, format, unscaled);
  quant::encode_state(format, scale, unscaled.span<float>(),
                      std::span<std::byte>(stored.data<std::byte>(), stored.nbytes()));
}

void decode_state(const Tensor& stored, const StateFormat format, const float scale, Tensor& unscaled) {
  check_state("decode_state", stored, format, unscaled);
  quant::decode_state(format, scale, std::span<const std::byte>(stored.data<std::byte>(), stored.nbytes()),
                      unscaled.span<float>());
}

namespace {

void check_remainders(const char* op, const Tensor& main, const Tensor& weight, const Tensor& remainder) {
  for (const Tensor* t : {&main, &weight, &remainder}) {
    if (!t->defined() || t->device() != Device::kCPU) detail::fail(op, "needs defined CPU tensors");
  }
  if (main.dtype() != DType::kF32 || weight.dtype() != DType::kF32) detail::fail(op, "main and weight must be fp32");
  if (dtype_size(remainder.dtype()) != 2) detail::fail(op, "remainders are 16-bit");
  detail::check_numel(op, "weight", weight, main.numel());
  detail::check_numel(op, "remainder", remainder, main.numel());
}

}  // namespace

void split_param_remainders(const Tensor& main, Tensor& weight, Tensor& remainder) {
  check_remainders("split_param_remainders", main, weight, remainder);
  quant::split_param_remainders(main.span<float>(), weight.span<float>(),
                                std::span<int16_t>(remainder.data<int16_t>(), static_cast<size_t>(remainder.numel())));
}

void join_param_remainders(const Tensor& weight, const Tensor& remainder, Tensor& main) {
  check_remainders("join_param_remainders", main, weight, remainder);
  quant::join_param_remainders(
      weight.span<float>(), std::span<const int16_t>(remainder.data<int16_t>(), static_cast<size_t>(remainder.numel())),
      main.span<float>());
}

}  // namespace moecore::ops
