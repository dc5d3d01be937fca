// Storage formats of the precision-aware optimizer's states (Megatron's --exp-avg-dtype, --exp-avg-sq-dtype,
// --main-params-dtype), bit-exact with TransformerEngine's FusedAdam (transformer_engine/pytorch/optimizers/
// fused_adam.py: _apply_scale, get_unscaled_state). One fp32 scale per state tensor:
//   fp32  stored as is (scale 1)
//   bf16  a plain cast, round to nearest even (scale 1)
//   fp16  scale = absmax / 32752 (fp16 max / 2), stored fp16(x * r) with r = 1 / scale (0 when scale is 0);
//         unscaled = float(stored) * scale
//   fp8   E4M3 with scale = absmax / 448: stored e4m3(x * q) with q = 1 / scale (Float8Quantizer.scale), saturating;
//         unscaled = float(stored) * (1 / q) (Float8Tensor's scale_inv, the cast kernel's reciprocal of q)
// All arithmetic is fp32 (torch.div / mul_ on fp32 tensors). A scale of 0 (an all-zero state) or one whose reciprocal
// overflows fp32 stores zeros, as TE's fp16 path does for scale 0 (TE's fp8 path would quantize 0 * (1 / 0) = NaN).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace moecore::quant {

enum class StateFormat : uint8_t { kF32, kF16, kBF16, kFP8 };

// Megatron's names: "fp32", "fp16", "bf16", "fp8". parse throws std::invalid_argument for anything else.
std::string_view state_format_name(StateFormat format);
StateFormat parse_state_format(std::string_view name);
size_t state_format_bytes(StateFormat format);  // bytes per stored element: 4, 2, 2, 1
// The magnitude the largest stored value maps to: 32752 (fp16), 448 (fp8); 0 for the unscaled fp32 / bf16.
float state_format_range(StateFormat format);

// The scale of a state whose largest magnitude is absmax: absmax / range (fp16, fp8), 1 (fp32, bf16).
float state_scale(StateFormat format, float absmax);
// max |x| (NaN propagates, as torch.aminmax).
float abs_max(std::span<const float> x);

// stored[i] = the encoding of x[i] with `scale` (stored holds x.size() elements of state_format_bytes).
void encode_state(StateFormat format, float scale, std::span<const float> x, std::span<std::byte> stored);
// x[i] = the unscaled fp32 value of stored[i].
void decode_state(StateFormat format, float scale, std::span<const std::byte> stored, std::span<float> x);

// fp32 main parameters stored as bf16 weights plus 16-bit remainders (TE's store_param_remainders, Megatron's
// default with bf16 weights and fp32 main parameters; transformer_engine/common/multi_tensor/adam.cu): the weight is
// the main value's high 16 bits, plus one when the low 16 bits, read as int16, are negative (round half away from
// zero), and the remainder is those low 16 bits; joining undoes the increment and glues the halves back, exactly.
// `weight` holds bf16 values in fp32.
void split_param_remainders(std::span<const float> main, std::span<float> weight, std::span<int16_t> remainder);
void join_param_remainders(std::span<const float> weight, std::span<const int16_t> remainder, std::span<float> main);

}  // namespace moecore::quant
