// Grouped expert MLP: the MLPs of E experts, each over its own rows of one buffer, fused (Megatron's GroupedMLP:
// fc1 -> activation -> probability -> fc2). Expert e's rows are [offsets_E1[e], offsets_E1[e + 1]); per expert
// y = W2 (act(W1 x + b1) p) + p b2, or with the probability on the input y = W2 act(W1 (x p) + b1) + b2. SwiGLU with
// the probability after it is Megatron's fused weighted SwiGLU (expert_activation.h): fc2's input h = swiglu(fc1) p
// is saved and backward recomputes swiglu. Legend: R rows, H hidden, F ffn width, F1 = 2F with SwiGLU else F.
// Every row-major; weights fc1 [F1, H], fc2 [H, F]; bias arrays (or their entries) may be null.
//
// Rounding: under --bf16 / --fp16 (ops/precision.h) the ops round each activation and activation gradient they
// write; these kernels round at exactly the points where the per-op sequence (linear, activation, scale_rows,
// add_outer) does, with the rounding kernels of convert.h, so results match that sequence bit for bit. fp32 only.
#pragma once

#include <cstdint>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/gemm_lowp.h"

namespace moecore::kernels {

enum class MlpActivation : uint8_t { kGelu, kSwiGLU, kSquaredReLU };

// The part of grouped_mlp_backward a call runs. Megatron's --delay-wgrad-compute (TE's GroupedLinear with
// delay_wgrad_compute) runs the experts' weight-gradient GEMMs after their data gradients, in a later slot: a kData
// call followed by a kWeights call on the same dfc1_RF1 workspace gives, bit for bit, what one kAll call gives.
//   kAll      both parts.
//   kData     the row-local pass only: dx_RH, dprobs_R and the dfc1_RF1 workspace (d(fc1 output) of every row); the
//             gradients are not touched (g may hold null arrays).
//   kWeights  the weight-gradient tasks only: the gradients from the dfc1_RF1 the kData call wrote, dy_RH, x_RH or
//             xs_RH, act_RF or h_RF and probs_R; dx_RH and dprobs_R are not touched (may be null), nor is fc1_RF1.
enum class GroupedMlpBackwardPart : uint8_t { kAll, kData, kWeights };

struct GroupedMlpShape {
  const int64_t* offsets_E1;  // E + 1 non-decreasing entries from 0
  int64_t E, H, F;
  MlpActivation activation;
  bool probs_on_input;
  ActivationRounding rounding;
  // fp32 only, fast kernels only: the GEMMs run on the 16-bit bits of their operands (which hold values of
  // native_type: the steps round every activation they write) through gemm_lowp's native path, with fp32 sums.
  bool native_gemm = false;
  LowpType native_type = LowpType::kBF16;
  GroupedMlpBackwardPart part = GroupedMlpBackwardPart::kAll;  // backward only: what the call computes

  int64_t F1() const { return activation == MlpActivation::kSwiGLU ? 2 * F : F; }
  // SwiGLU with the probability after it: the fused weighted SwiGLU (h saved instead of the activation).
  bool weighted_swiglu() const { return activation == MlpActivation::kSwiGLU && !probs_on_input; }
};

template <typename T>
struct GroupedMlpWeights {
  const T* const* fc1_weight_E;
  const T* const* fc1_bias_E;
  const T* const* fc2_weight_E;
  const T* const* fc2_bias_E;
  // With GroupedMlpShape::native_gemm, optionally: the weights' 16-bit bits (values of native_type) the GEMMs read,
  // made by the caller; null: the kernels cast the fp32 weights themselves.
  const uint16_t* const* fc1_weight16_E = nullptr;
  const uint16_t* const* fc2_weight16_E = nullptr;
};

template <typename T>
struct GroupedMlpGrads {  // accumulated; null arrays or entries are skipped
  T* const* fc1_weight_E;
  T* const* fc1_bias_E;
  T* const* fc2_weight_E;
  T* const* fc2_bias_E;
  // Optional, per expert: 1 where both weight gradients hold only zeros, which a kernel may then write instead of add
  // to (the same values: the fast native 16-bit path streams them out without reading them).
  const uint8_t* weights_zero_E = nullptr;
};

#define MOECORE_GROUPED_MLP_DECL                                                                                   \
  /* Overwrites y_RH and the saved activations: fc1_RF1 (fc1 output), act_RF (activation output; not with weighted \
     SwiGLU, else null), h_RF (weighted SwiGLU: fc2's input, else null), xs_RH (probs on the input: x p, else      \
     null). */                                                                                                     \
  template <typename T>                                                                                            \
  void grouped_mlp_forward(T* y_RH, T* fc1_RF1, T* act_RF, T* h_RF, T* xs_RH, const T* x_RH, const T* probs_R,     \
                           const GroupedMlpWeights<T>& w, const GroupedMlpShape& s);                               \
  /* From dy_RH and the forward's saved activations: dx_RH += d/dx, dprobs_R = d/dp (overwritten), the parameter   \
     gradients accumulate (an expert without rows keeps its own). dfc1_RF1: [R, F1] workspace (zeroed), which a    \
     kData call writes and a kWeights call reads (s.part: GroupedMlpBackwardPart). */                              \
  template <typename T>                                                                                            \
  void grouped_mlp_backward(T* dx_RH, T* dprobs_R, const GroupedMlpGrads<T>& g, T* dfc1_RF1, const T* dy_RH,       \
                            const T* x_RH, const T* xs_RH, const T* fc1_RF1, const T* act_RF, const T* h_RF,       \
                            const T* probs_R, const GroupedMlpWeights<T>& w, const GroupedMlpShape& s);

namespace cpu {
// Scheduling (cpu only): each expert's rows are cut into the fewest tiles of at most kGroupedMlpTileRows rows
// (evenly sized), so an expert with many rows gets GEMMs big enough to run near the GEMM's peak and one with few rows
// one task. Forward runs fc1, activation, probability and fc2 of a tile as one task (the tile's fc1 output stays in
// cache), backward its data gradients; tasks run largest first on a dynamic OpenMP schedule (both threads stay busy
// when the experts' loads are uneven), each tile's kernels on one thread. Weight gradients are one task per (expert,
// fc1 | fc2) over all the expert's rows, costliest first, so no two tasks write one output. Tiles depend on the row
// counts only, never on the thread count, so results are the same bit for bit whatever the threads.
// With native_gemm each expert's weights are narrowed to 16 bits once per call, and a GEMM's row count (its K in the
// weight gradients) is padded with zero rows to a multiple of kGroupedMlpNativeRowQuantum, so the expert tiles'
// varying row counts map onto a few compiled oneDNN matmuls instead of one new compilation per shape.
constexpr int64_t kGroupedMlpTileRows = 256;
constexpr int64_t kGroupedMlpNativeRowQuantum = 16;
MOECORE_GROUPED_MLP_DECL

// The grouped MLP on 16-bit activations (bits of `type`: x, y, the saved fc1, act / h and xs, dy and dx) with fp32
// weights, probabilities, dprobs, weight gradients and dfc1 workspace. Each task widens its rows into the thread's
// fp32 buffers, runs the fp32 kernel's steps on them and narrows what it wrote (round to nearest even, once), over the
// same tiles and tasks: every output equals the fp32 kernel's on the widened tensors, rounded, bit for bit, without
// an fp32 copy of any whole tensor. s.rounding must be `type`'s.
void grouped_mlp_forward16(LowpType type, uint16_t* y_RH, uint16_t* fc1_RF1, uint16_t* act_RF, uint16_t* h_RF,
                           uint16_t* xs_RH, const uint16_t* x_RH, const float* probs_R,
                           const GroupedMlpWeights<float>& w, const GroupedMlpShape& s);
void grouped_mlp_backward16(LowpType type, uint16_t* dx_RH, float* dprobs_R, const GroupedMlpGrads<float>& g,
                            float* dfc1_RF1, const uint16_t* dy_RH, const uint16_t* x_RH, const uint16_t* xs_RH,
                            const uint16_t* fc1_RF1, const uint16_t* act_RF, const uint16_t* h_RF, const float* probs_R,
                            const GroupedMlpWeights<float>& w, const GroupedMlpShape& s);
}  // namespace cpu
namespace ref {
MOECORE_GROUPED_MLP_DECL
}
#undef MOECORE_GROUPED_MLP_DECL

}  // namespace moecore::kernels
