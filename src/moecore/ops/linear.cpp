#include "moecore/ops/linear.h"

#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"

namespace moecore::ops {
using detail::opt;
using detail::ptr;

void linear_forward(Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI, const Tensor* bias_O) {
  constexpr const char* op = "linear_forward";
  detail::check_tensors(op, {&out_TO, &inp_TI, &weight_OI, bias_O});
  const int64_t O = weight_OI.dim(0), I = weight_OI.numel() / O, T = inp_TI.numel() / I;
  detail::check_numel(op, "inp_TI", inp_TI, T * I);
  detail::check_numel(op, "out_TO", out_TO, T * O);
  if (bias_O != nullptr) detail::check_numel(op, "bias_O", *bias_O, O);
  detail::dispatch(op, out_TO, [&]<typename S>(auto k) {
    k.linear_forward(ptr<S>(out_TO), ptr<S>(inp_TI), ptr<S>(weight_OI), opt<S>(bias_O), T, I, O);
  });
  detail::round_activations({&out_TO});
}

void linear_backward(Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O, const Tensor& dout_TO, const Tensor* inp_TI,
                     const Tensor& weight_OI) {
  constexpr const char* op = "linear_backward";
  detail::check_tensors(op, {dinp_TI, dweight_OI, dbias_O, &dout_TO, inp_TI, &weight_OI});
  if (dweight_OI != nullptr && inp_TI == nullptr) detail::fail(op, "dweight_OI needs inp_TI");
  const int64_t O = weight_OI.dim(0), I = weight_OI.numel() / O, T = dout_TO.numel() / O;
  detail::check_numel(op, "dout_TO", dout_TO, T * O);
  if (dinp_TI != nullptr) detail::check_numel(op, "dinp_TI", *dinp_TI, T * I);
  if (inp_TI != nullptr) detail::check_numel(op, "inp_TI", *inp_TI, T * I);
  if (dweight_OI != nullptr) detail::check_numel(op, "dweight_OI", *dweight_OI, O * I);
  if (dbias_O != nullptr) detail::check_numel(op, "dbias_O", *dbias_O, O);
  detail::dispatch(op, dout_TO, [&]<typename S>(auto k) {
    k.linear_backward(opt<S>(dinp_TI), opt<S>(dweight_OI), opt<S>(dbias_O), ptr<S>(dout_TO), opt<S>(inp_TI),
                      ptr<S>(weight_OI), T, I, O);
  });
  detail::round_activations({dinp_TI});  // weight and bias gradients stay fp32 (main grads)
}

std::string gemm_library() { return kernels::cpu::gemm_library(); }

}  // namespace moecore::ops
