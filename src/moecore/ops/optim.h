// Optimizer and gradient-norm ops on tensors.
#pragma once

#include "moecore/kernels/cpu/adamw.h"
#include "moecore/quant/optimizer_state.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops {

using kernels::AdamWHyper;
using quant::StateFormat;

// One torch.optim.AdamW update of param from grad * hyper.grad_scale with the moments exp_avg / exp_avg_sq
// (semantics: kernels/cpu/adamw.h). With `model` (fp32), the same pass writes each updated parameter there rounded
// to model_dtype (kBF16 / kF16; kF32 copies): the model weights from the main parameters. All tensors have the same
// number of elements. With `grad_to_zero` (grad itself, fp32) the update zeroes each gradient element it has read.
// With `model_bf16` (a bf16 tensor; model_dtype kBF16) it also writes the model weights' bf16 bits there.
void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq, const AdamWHyper& hyper,
                Tensor* model = nullptr, DType model_dtype = DType::kF32, Tensor* grad_to_zero = nullptr,
                Tensor* model_bf16 = nullptr);

// Optimizer states stored in a reduced format (quant/optimizer_state.h, TransformerEngine FusedAdam's storage).
// The tensor dtype a format is stored in: kF32, kF16, kBF16, or kU8 (E4M3 codes).
DType state_storage_dtype(StateFormat format);
// max |x| of an fp32 tensor.
float abs_max(const Tensor& x);
// stored := the encoding of the fp32 `unscaled` with `scale`; stored has dtype state_storage_dtype(format) and as
// many elements (any shapes).
void encode_state(const Tensor& unscaled, StateFormat format, float scale, Tensor& stored);
// unscaled := the fp32 values of `stored`.
void decode_state(const Tensor& stored, StateFormat format, float scale, Tensor& unscaled);

// fp32 main parameters as bf16 weights + 16-bit remainders (quant/optimizer_state.h). `remainder` holds the int16
// bits in a 16-bit tensor (dtype kBF16 as a container); main and weight are fp32, all of one element count.
void split_param_remainders(const Tensor& main, Tensor& weight, Tensor& remainder);
void join_param_remainders(const Tensor& weight, const Tensor& remainder, Tensor& main);

}  // namespace moecore::ops
