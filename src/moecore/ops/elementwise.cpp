#include "moecore/ops/elementwise.h"

#include <utility>

#include "moecore/ops/dispatch.h"
#include "moecore/ops/optim.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/row_blocks.h"

namespace moecore::ops {
using detail::ptr;

void add_(Tensor& y, const Tensor& x) {
  constexpr const char* op = "add_";
  detail::check_tensors(op, {&y, &x});
  detail::check_numel(op, "x", x, y.numel());
  const std::initializer_list<detail::RowOperand> elements = {{&y, 1, detail::RowUse::kInOut},
                                                              {&x, 1, detail::RowUse::kIn}};
  if (detail::row_blocks_apply(elements)) {
    detail::run_row_blocks(y.numel(), elements, [](const int64_t i0, const int64_t i1, float* const* p) {
      kernels::cpu::add_inplace(p[0], p[1], i1 - i0);
    });
    detail::round_activations({&y});
    return;
  }
  const detail::Staging staging;
  detail::dispatch(op, y, [&]<typename T>(auto k) { k.add_inplace(ptr<T>(y), ptr<T>(x), y.numel()); });
  detail::round_activations({&y});
}

void scale_(Tensor& y, const double alpha) {
  constexpr const char* op = "scale_";
  const detail::Staging staging;
  detail::check_tensors(op, {&y});
  detail::dispatch(op, y, [&]<typename T>(auto k) { k.scale_inplace(ptr<T>(y), static_cast<T>(alpha), y.numel()); });
  detail::round_activations({&y});
}

double sum_squares(const Tensor& x) {
  constexpr const char* op = "sum_squares";
  const detail::Staging staging;
  detail::check_tensors(op, {&x});
  double out = 0.0;
  detail::dispatch(op, x, [&]<typename T>(auto k) { out = k.sum_squares(ptr<T>(x), x.numel()); });
  return out;
}

std::vector<double> sum_squares_each(const std::span<const Tensor> xs) {
  constexpr const char* op = "sum_squares_each";
  std::vector<double> sums(xs.size(), 0.0);
  if (xs.empty()) return sums;
  const detail::Staging staging;
  for (const Tensor& x : xs) detail::check_tensors(op, {&xs.front(), &x});
  std::vector<int64_t> ns;
  ns.reserve(xs.size());
  for (const Tensor& x : xs) ns.push_back(x.numel());
  detail::dispatch(op, xs.front(), [&]<typename T>(auto k) {
    std::vector<const T*> data;
    data.reserve(xs.size());
    for (const Tensor& x : xs) data.push_back(ptr<T>(x));
    k.sum_squares_each(data.data(), ns.data(), static_cast<int64_t>(xs.size()), sums.data());
  });
  return sums;
}

bool all_finite(const Tensor& x) {
  constexpr const char* op = "all_finite";
  const detail::Staging staging;
  detail::check_tensors(op, {&x});
  bool out = true;
  detail::dispatch(op, x, [&]<typename T>(auto k) { out = k.all_finite(ptr<T>(x), x.numel()); });
  return out;
}

int64_t count_zeros(const Tensor& x) {
  constexpr const char* op = "count_zeros";
  const detail::Staging staging;
  detail::check_tensors(op, {&x});
  int64_t out = 0;
  detail::dispatch(op, x, [&]<typename T>(auto k) { out = k.count_zeros(ptr<T>(x), x.numel()); });
  return out;
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWHyper& hyper,
                Tensor* model, const DType model_dtype, Tensor* grad_to_zero, Tensor* model_bf16) {
  constexpr const char* op = "adamw_step";
  const detail::Staging staging;
  detail::check_tensors(op, {&param, &grad, &exp_avg, &exp_avg_sq, model});
  const int64_t n = param.numel();
  detail::check_numel(op, "grad", grad, n);
  detail::check_numel(op, "exp_avg", exp_avg, n);
  detail::check_numel(op, "exp_avg_sq", exp_avg_sq, n);
  if (model != nullptr) {
    detail::check_numel(op, "model", *model, n);
    if (model->dtype() != DType::kF32) detail::fail(op, "model weights must be float32 tensors");
  }
  const kernels::ActivationRounding rounding = model_dtype == DType::kBF16  ? kernels::ActivationRounding::kBF16
                                               : model_dtype == DType::kF16 ? kernels::ActivationRounding::kF16
                                                                            : kernels::ActivationRounding::kNone;
  if (rounding == kernels::ActivationRounding::kNone && model_dtype != DType::kF32) {
    detail::fail(op, "model weights in " + std::string(dtype_name(model_dtype)) + ": expected bf16, fp16 or fp32");
  }
  if (grad_to_zero != nullptr &&
      (grad_to_zero->dtype() != grad.dtype() || grad.dtype() != param.dtype() || grad_to_zero->numel() != n ||
       std::as_const(*grad_to_zero).data<std::byte>() != grad.data<std::byte>())) {
    detail::fail(op, "grad_to_zero must be the gradient tensor itself, of the parameters' dtype");
  }
  if (model_bf16 != nullptr &&
      (model == nullptr || model_dtype != DType::kBF16 || model_bf16->dtype() != DType::kBF16 ||
       model_bf16->numel() != n || model_bf16->device() != param.device())) {
    detail::fail(op,
                 "model_bf16 must be a bf16 tensor of the parameters' size on their device, with bf16 model weights");
  }
  detail::dispatch(op, param, [&]<typename T>(auto k) {
    k.adamw_step(ptr<T>(param), ptr<T>(grad), ptr<T>(exp_avg), ptr<T>(exp_avg_sq), n, hyper,
                 model != nullptr ? ptr<T>(*model) : nullptr, rounding,
                 grad_to_zero != nullptr ? ptr<T>(*grad_to_zero) : nullptr,
                 model_bf16 != nullptr ? model_bf16->data<uint16_t>() : nullptr);
  });
}

}  // namespace moecore::ops
