// Dense layers on tensors. Legend: T rows (tokens), I in features, O out features; T = inp.numel() / I, so
// inputs may carry extra leading dimensions ([S, B, N, d] is read as [S*B, N*d]).
// Low precision (Megatron's --bf16 / --fp16): with a bf16 or fp16 weight, the GEMM inputs (inp, weight, dout) share
// the weight's dtype, products are summed in fp32, and each output (out, dinp, dweight, dbias) and the bias may be
// fp32 or that low dtype (fp32 dweight / dbias: the fp32 main_grad that Megatron's
// LinearWithGradAccumulationAndAsyncCommunication accumulates into under gradient_accumulation_fusion,
// megatron/core/tensor_parallel/layers.py); a low-precision output is rounded once.
#pragma once

#include <string>

#include "moecore/quant/delayed_linear_scaling.h"
#include "moecore/quant/packed_quantized_tensor.h"
#include "moecore/tensor/tensor.h"

namespace moecore::ops {

// FP8 delayed scaling (ops/quantization.h, under a ScopedLinearQuantization with quant::Recipe::kDelayed): `delayed`
// is the layer's scaling state (Param::delayed_scaling of the weight) and `forward_scales` the micro-batch's record
// of the scales its forward quantized x and W with: linear_forward fills it, linear_backward reads it. Other
// recipes and high precision ignore both.

// Saving the input quantized (TransformerEngine's Linear under an FP8 / FP4 recipe saves inputmat quantized for the
// column-wise usage, module/linear.py): with `saved_input`, a quantized forward (ops/quantization.h, a config with
// save_quantized_input) also fills it with the input quantized as the weight gradient's operand, in
// MemCategory::kActivations (1 byte an element under FP8, half a byte under NVFP4, plus the block scales); any other
// forward leaves it empty. A backward given a defined `saved_input` computes dweight_OI from it (inp_TI may then be
// null), bit for bit the gradient it computes from inp_TI.

// out_TO = inp_TI @ weight_OI^T (+ bias_O). Overwrites out.
void linear_forward(Tensor& out_TO, const Tensor& inp_TI, const Tensor& weight_OI, const Tensor* bias_O = nullptr,
                    quant::DelayedLinearScaling* delayed = nullptr,
                    quant::DelayedForwardScales* forward_scales = nullptr,
                    quant::PackedQuantizedTensor* saved_input = nullptr);
// dinp_TI += dout_TO @ weight_OI; dweight_OI += dout_TO^T @ inp_TI; dbias_O += column sums of dout_TO.
// Null outputs are skipped; inp_TI may be null when dweight_OI is, or when saved_input is defined.
void linear_backward(Tensor* dinp_TI, Tensor* dweight_OI, Tensor* dbias_O, const Tensor& dout_TO, const Tensor* inp_TI,
                     const Tensor& weight_OI, quant::DelayedLinearScaling* delayed = nullptr,
                     const quant::DelayedForwardScales* forward_scales = nullptr,
                     const quant::PackedQuantizedTensor* saved_input = nullptr);

// The fp32 GEMM library of a device's kernels and, on the CPU, the kernel family it picked (the training log's first
// lines name it), e.g. "oneDNN 2.6.3 sgemm, AVX-512 kernels".
std::string gemm_library(Device device = Device::kCPU);
// The same for bf16 or fp16 GEMMs: the path MOECORE_LOWP_GEMM or the CPU chose, e.g. "oneDNN 2.6.3 bf16 matmul,
// brg:avx512_core_bf16 kernels" or "fp16 -> fp32 conversion (AVX-512 BF16) + oneDNN 2.6.3 sgemm, ...".
std::string gemm_lowp_library(DType dtype, Device device = Device::kCPU);
// Whether bf16 / fp16 GEMMs of fp32 weights run on the device's 16-bit kernels, whose operands are encoded to their
// 16-bit bits first (MemCategory::kOther for the GEMM's duration), rather than on the fp32 GEMM.
bool gemm_lowp_native(DType dtype, Device device = Device::kCPU);

}  // namespace moecore::ops
