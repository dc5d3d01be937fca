#include "moecore/ops/norm.h"

#include <atomic>
#include <optional>

#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/row_blocks.h"

namespace moecore::ops {
using detail::opt;
using detail::ptr;
namespace {

int64_t rows_of(const char* op, const Tensor& inp_RD, const Tensor& weight_D) {
  const int64_t D = weight_D.numel();
  if (D == 0 || inp_RD.numel() % D != 0) {
    detail::fail(op, "inp_RD " + inp_RD.shape_str() + " is not rows of width " + std::to_string(D));
  }
  return inp_RD.numel() / D;
}

// The 16-bit backward kernels apply: on the CPU, 16-bit activations of one dtype, fp32 parameters and statistics.
std::optional<kernels::LowpType> backward16(std::initializer_list<const Tensor*> activations,
                                            std::initializer_list<const Tensor*> fp32) {
  const Tensor& first = **activations.begin();
  if (first.device() != Device::kCPU || !detail::is_16bit(first.dtype())) return std::nullopt;
  for (const Tensor* t : activations) {
    if (t->dtype() != first.dtype()) return std::nullopt;
  }
  for (const Tensor* t : fp32) {
    if (t != nullptr && t->dtype() != DType::kF32) return std::nullopt;
  }
  return first.dtype() == DType::kBF16 ? kernels::LowpType::kBF16 : kernels::LowpType::kF16;
}

}  // namespace

int64_t rmsnorm_forward(Tensor& out_RD, Tensor& rstd_R, const Tensor& inp_RD, const Tensor& weight_D,
                        const double eps) {
  constexpr const char* op = "rmsnorm_forward";
  detail::check_tensors(op, {&out_RD, &rstd_R, &inp_RD, &weight_D});
  const int64_t D = weight_D.numel(), R = rows_of(op, inp_RD, weight_D);
  detail::check_numel(op, "out_RD", out_RD, R * D);
  detail::check_numel(op, "rstd_R", rstd_R, R);
  const std::initializer_list<detail::RowOperand> rows = {
      {&out_RD, D, detail::RowUse::kOut}, {&rstd_R, 1, detail::RowUse::kOut}, {&inp_RD, D, detail::RowUse::kIn}};
  if (detail::row_blocks_apply(rows) && weight_D.dtype() == DType::kF32) {
    std::atomic<int64_t> nonfinite_rows = 0;
    detail::run_row_blocks(R, rows, [&](const int64_t r0, const int64_t r1, float* const* p) {
      nonfinite_rows += kernels::cpu::rmsnorm_forward(p[0], p[1], p[2], weight_D.data<float>(), r1 - r0, D, eps);
    });
    detail::round_activations({&out_RD});
    return nonfinite_rows;
  }
  detail::Staging staging;
  staging.write_only(out_RD, {&inp_RD});
  int64_t nonfinite_rows = 0;
  detail::dispatch(op, inp_RD, [&]<typename S>(auto k) {
    nonfinite_rows = k.rmsnorm_forward(ptr<S>(out_RD), ptr<S>(rstd_R), ptr<S>(inp_RD), ptr<S>(weight_D), R, D, eps);
  });
  detail::round_activations({&out_RD});
  return nonfinite_rows;
}

void rmsnorm_backward(Tensor& dinp_RD, Tensor& dweight_D, const Tensor& dout_RD, const Tensor& inp_RD,
                      const Tensor& weight_D, const Tensor& rstd_R) {
  constexpr const char* op = "rmsnorm_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dinp_RD, &dweight_D, &dout_RD, &inp_RD, &weight_D, &rstd_R});
  const int64_t D = weight_D.numel(), R = rows_of(op, inp_RD, weight_D);
  detail::check_numel(op, "dinp_RD", dinp_RD, R * D);
  detail::check_numel(op, "dout_RD", dout_RD, R * D);
  detail::check_numel(op, "dweight_D", dweight_D, D);
  detail::check_numel(op, "rstd_R", rstd_R, R);
  if (const auto type = backward16({&dout_RD, &inp_RD, &dinp_RD}, {&dweight_D, &weight_D, &rstd_R})) {
    kernels::cpu::rmsnorm_backward16(*type, dinp_RD.data<uint16_t>(), dweight_D.data<float>(), dout_RD.data<uint16_t>(),
                                     inp_RD.data<uint16_t>(), weight_D.data<float>(), rstd_R.data<float>(), R, D);
    return;
  }
  detail::dispatch(op, inp_RD, [&]<typename S>(auto k) {
    k.rmsnorm_backward(ptr<S>(dinp_RD), ptr<S>(dweight_D), ptr<S>(dout_RD), ptr<S>(inp_RD), ptr<S>(weight_D),
                       ptr<S>(rstd_R), R, D);
  });
  detail::round_activations({&dinp_RD});
}

int64_t layernorm_forward(Tensor& out_RD, Tensor& mean_R, Tensor& rstd_R, const Tensor& inp_RD, const Tensor& weight_D,
                          const Tensor* bias_D, const double eps) {
  constexpr const char* op = "layernorm_forward";
  detail::check_tensors(op, {&out_RD, &mean_R, &rstd_R, &inp_RD, &weight_D, bias_D});
  const int64_t D = weight_D.numel(), R = rows_of(op, inp_RD, weight_D);
  detail::check_numel(op, "out_RD", out_RD, R * D);
  detail::check_numel(op, "mean_R", mean_R, R);
  detail::check_numel(op, "rstd_R", rstd_R, R);
  if (bias_D != nullptr) detail::check_numel(op, "bias_D", *bias_D, D);
  const std::initializer_list<detail::RowOperand> rows = {{&out_RD, D, detail::RowUse::kOut},
                                                          {&mean_R, 1, detail::RowUse::kOut},
                                                          {&rstd_R, 1, detail::RowUse::kOut},
                                                          {&inp_RD, D, detail::RowUse::kIn}};
  if (detail::row_blocks_apply(rows) && weight_D.dtype() == DType::kF32 &&
      (bias_D == nullptr || bias_D->dtype() == DType::kF32)) {
    std::atomic<int64_t> nonfinite_rows = 0;
    detail::run_row_blocks(R, rows, [&](const int64_t r0, const int64_t r1, float* const* p) {
      nonfinite_rows +=
          kernels::cpu::layernorm_forward(p[0], p[1], p[2], p[3], weight_D.data<float>(),
                                          bias_D != nullptr ? bias_D->data<float>() : nullptr, r1 - r0, D, eps);
    });
    detail::round_activations({&out_RD});
    return nonfinite_rows;
  }
  detail::Staging staging;
  staging.write_only(out_RD, {&inp_RD});
  int64_t nonfinite_rows = 0;
  detail::dispatch(op, inp_RD, [&]<typename S>(auto k) {
    nonfinite_rows = k.layernorm_forward(ptr<S>(out_RD), ptr<S>(mean_R), ptr<S>(rstd_R), ptr<S>(inp_RD),
                                         ptr<S>(weight_D), opt<S>(bias_D), R, D, eps);
  });
  detail::round_activations({&out_RD});
  return nonfinite_rows;
}

void layernorm_backward(Tensor& dinp_RD, Tensor& dweight_D, Tensor* dbias_D, const Tensor& dout_RD,
                        const Tensor& inp_RD, const Tensor& weight_D, const Tensor& mean_R, const Tensor& rstd_R) {
  constexpr const char* op = "layernorm_backward";
  const detail::Staging staging;
  detail::check_tensors(op, {&dinp_RD, &dweight_D, dbias_D, &dout_RD, &inp_RD, &weight_D, &mean_R, &rstd_R});
  const int64_t D = weight_D.numel(), R = rows_of(op, inp_RD, weight_D);
  detail::check_numel(op, "dinp_RD", dinp_RD, R * D);
  detail::check_numel(op, "dout_RD", dout_RD, R * D);
  detail::check_numel(op, "dweight_D", dweight_D, D);
  if (dbias_D != nullptr) detail::check_numel(op, "dbias_D", *dbias_D, D);
  detail::check_numel(op, "mean_R", mean_R, R);
  detail::check_numel(op, "rstd_R", rstd_R, R);
  if (const auto type = backward16({&dout_RD, &inp_RD, &dinp_RD}, {&dweight_D, dbias_D, &weight_D, &mean_R, &rstd_R})) {
    kernels::cpu::layernorm_backward16(*type, dinp_RD.data<uint16_t>(), dweight_D.data<float>(),
                                       dbias_D != nullptr ? dbias_D->data<float>() : nullptr, dout_RD.data<uint16_t>(),
                                       inp_RD.data<uint16_t>(), weight_D.data<float>(), mean_R.data<float>(),
                                       rstd_R.data<float>(), R, D);
    return;
  }
  detail::dispatch(op, inp_RD, [&]<typename S>(auto k) {
    k.layernorm_backward(ptr<S>(dinp_RD), ptr<S>(dweight_D), opt<S>(dbias_D), ptr<S>(dout_RD), ptr<S>(inp_RD),
                         ptr<S>(weight_D), ptr<S>(mean_R), ptr<S>(rstd_R), R, D);
  });
  detail::round_activations({&dinp_RD});
}

}  // namespace moecore::ops
