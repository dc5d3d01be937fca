// Internal to the grouped-MLP kernels: the per-op steps of one expert's rows [begin, end), written once over a kernel
// set K (kernels::cpu or kernels::ref, forwarded by the including file, or the fast kernel's native 16-bit GEMMs) in
// the order and with the rounding of the per-op sequence (ops::linear_forward, activation, scale_rows, add_outer, ...;
// semantics: grouped_mlp.h). The fast kernel runs them on row tiles in parallel, the reference on each expert's rows in
// turn.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>

#include "moecore/kernels/cpu/grouped_mlp.h"

namespace moecore::kernels::grouped_mlp_detail {

// A zeroed, 64-byte aligned buffer of n values (the alignment of the tensors' allocator, which the GEMMs and the
// vector loops are tuned for).
template <typename T>
class Scratch {
 public:
  explicit Scratch(const int64_t n) {
    const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
    data_ = static_cast<T*>(std::aligned_alloc(64, bytes == 0 ? 64 : bytes));
    if (data_ == nullptr) throw std::bad_alloc();
    std::memset(static_cast<void*>(data_), 0, bytes);
  }
  ~Scratch() { std::free(data_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* data() const { return data_; }

 private:
  T* data_ = nullptr;
};

template <typename K, typename T>
class Steps {
 public:
  Steps(const GroupedMlpWeights<T>& w, const GroupedMlpShape& s, K k = K()) : w_(w), s_(s), k_(std::move(k)) {}

  void forward(const int64_t e, const int64_t begin, const int64_t end, T* y_RH, T* fc1_RF1, T* act_RF, T* h_RF,
               T* xs_RH, const T* x_RH, const T* probs_R) const {
    const int64_t n = end - begin, H = s_.H, F = s_.F, F1 = s_.F1();
    const T* probs = probs_R + begin;
    const T* fc1_in = x_RH + begin * H;
    if (s_.probs_on_input) {
      T* xs = xs_RH + begin * H;
      k_.scale_rows(xs, fc1_in, probs, n, H);
      round(xs, n * H);
      fc1_in = xs;
    }
    T* fc1 = fc1_RF1 + begin * F1;
    k_.linear_forward(fc1, fc1_in, w_.fc1_weight_E[e], fc1_bias(e), n, H, F1);
    round(fc1, n * F1);
    // fc2's input: h = swiglu(fc1) p (saved), the activation itself (probs on the input), or act p in a tile-sized
    // buffer (kept in cache, not saved: backward recomputes it).
    const T* h = nullptr;
    if (s_.weighted_swiglu()) {
      T* h_saved = h_RF + begin * F;
      k_.weighted_swiglu_forward(h_saved, fc1, probs, n, F);
      round(h_saved, n * F);
      h = h_saved;
    } else {
      T* act = act_RF + begin * F;
      activation_forward(act, fc1, n);
      round(act, n * F);
      h = act;
    }
    const Scratch<T> scaled(s_.weighted_swiglu() || s_.probs_on_input ? 0 : n * F);
    if (!s_.weighted_swiglu() && !s_.probs_on_input) {
      k_.scale_rows(scaled.data(), h, probs, n, F);
      round(scaled.data(), n * F);
      h = scaled.data();
    }
    T* y = y_RH + begin * H;
    const T* b2 = fc2_bias(e);
    k_.linear_forward(y, h, w_.fc2_weight_E[e], s_.probs_on_input ? b2 : nullptr, n, F, H);
    round(y, n * H);
    if (!s_.probs_on_input && b2 != nullptr) {  // y = W2 (act p) + p b2
      k_.add_outer(y, probs, b2, n, H);
      round(y, n * H);
    }
  }

  // Row-local gradients: dx, dprobs and d(fc1 output).
  void backward_data(const int64_t e, const int64_t begin, const int64_t end, T* dx_RH, T* dprobs_R, T* dfc1_RF1,
                     const T* dy_RH, const T* x_RH, const T* fc1_RF1, const T* act_RF, const T* probs_R) const {
    const int64_t n = end - begin, H = s_.H, F = s_.F, F1 = s_.F1();
    const T* probs = probs_R + begin;
    const T* dy = dy_RH + begin * H;
    T* dprobs = dprobs_R + begin;
    T* dx = dx_RH + begin * H;
    const Scratch<T> dh(n * F);
    k_.linear_backward(dh.data(), null(), null(), dy, cnull(), w_.fc2_weight_E[e], n, F, H);
    round(dh.data(), n * F);
    T* dfc1 = dfc1_RF1 + begin * F1;
    const T* fc1 = fc1_RF1 + begin * F1;
    const T* w1 = w_.fc1_weight_E[e];
    if (!s_.probs_on_input) {
      if (s_.weighted_swiglu()) {
        k_.weighted_swiglu_backward(dfc1, dprobs, dh.data(), fc1, probs, n, F);
      } else {
        const Scratch<T> dact(n * F);
        k_.scale_rows_backward(dact.data(), dprobs, dh.data(), act_RF + begin * F, probs, n, F);
        round(dact.data(), n * F);
        activation_backward(dfc1, dact.data(), fc1, n);
      }
      round(dfc1, n * F1);
      if (const T* b2 = fc2_bias(e)) k_.add_outer_backward(dprobs, null(), dy, probs, b2, n, H);
      k_.linear_backward(dx, null(), null(), dfc1, cnull(), w1, n, H, F1);
      round(dx, n * H);
      return;
    }
    activation_backward(dfc1, dh.data(), fc1, n);
    round(dfc1, n * F1);
    // fc1 input x p: dx += d(fc1 input) p, dp = <d(fc1 input), x>.
    const Scratch<T> dxs(n * H);
    k_.linear_backward(dxs.data(), null(), null(), dfc1, cnull(), w1, n, H, F1);
    round(dxs.data(), n * H);
    k_.scale_rows_backward(dx, dprobs, dxs.data(), x_RH + begin * H, probs, n, H);
    round(dx, n * H);
  }

  // Weight (and bias) gradients of fc1 or fc2 of expert e over its rows [begin, end).
  void weight_grads(const int64_t e, const bool fc1, const int64_t begin, const int64_t end,
                    const GroupedMlpGrads<T>& g, const T* dfc1_RF1, const T* dy_RH, const T* x_RH, const T* xs_RH,
                    const T* act_RF, const T* h_RF, const T* probs_R) const {
    const int64_t n = end - begin, H = s_.H, F = s_.F, F1 = s_.F1();
    if (fc1) {
      const T* in = (s_.probs_on_input ? xs_RH : x_RH) + begin * H;
      k_.linear_backward(null(), entry(g.fc1_weight_E, e), entry(g.fc1_bias_E, e), dfc1_RF1 + begin * F1, in,
                         w_.fc1_weight_E[e], n, H, F1);
      return;
    }
    const T* dy = dy_RH + begin * H;
    const T* probs = probs_R + begin;
    T* db2 = entry(g.fc2_bias_E, e);
    // fc2's input: saved (weighted SwiGLU, or the activation itself with probs on the input), else recomputed as
    // act p in a buffer of this expert's rows.
    const bool recompute = !s_.weighted_swiglu() && !s_.probs_on_input;
    const Scratch<T> scaled(recompute ? n * F : 0);
    const T* h = s_.weighted_swiglu() ? h_RF + begin * F : act_RF + begin * F;
    if (recompute) {
      k_.scale_rows(scaled.data(), h, probs, n, F);
      round(scaled.data(), n * F);
      h = scaled.data();
    }
    k_.linear_backward(null(), entry(g.fc2_weight_E, e), s_.probs_on_input ? db2 : nullptr, dy, h, w_.fc2_weight_E[e],
                       n, F, H);
    if (!s_.probs_on_input && db2 != nullptr) k_.add_outer_backward(null(), db2, dy, probs, fc2_bias(e), n, H);
  }

 private:
  static T* null() { return nullptr; }
  static const T* cnull() { return nullptr; }
  static T* entry(T* const* array_E, const int64_t e) { return array_E == nullptr ? nullptr : array_E[e]; }
  const T* fc1_bias(const int64_t e) const { return w_.fc1_bias_E == nullptr ? nullptr : w_.fc1_bias_E[e]; }
  const T* fc2_bias(const int64_t e) const { return w_.fc2_bias_E == nullptr ? nullptr : w_.fc2_bias_E[e]; }

  void round(T* data, const int64_t count) const {
    if constexpr (std::is_same_v<T, float>) {
      if (s_.rounding == ActivationRounding::kBF16) k_.round_bf16(data, count);
      if (s_.rounding == ActivationRounding::kF16) k_.round_fp16(data, count);
    }
  }
  void activation_forward(T* act, const T* fc1, const int64_t n) const {
    switch (s_.activation) {
      case MlpActivation::kSwiGLU: k_.swiglu_forward(act, fc1, n, s_.F); break;
      case MlpActivation::kGelu: k_.gelu_forward(act, fc1, n * s_.F); break;
      case MlpActivation::kSquaredReLU: k_.squared_relu_forward(act, fc1, n * s_.F); break;
    }
  }
  void activation_backward(T* dfc1, const T* dact, const T* fc1, const int64_t n) const {
    switch (s_.activation) {
      case MlpActivation::kSwiGLU: k_.swiglu_backward(dfc1, dact, fc1, n, s_.F); break;
      case MlpActivation::kGelu: k_.gelu_backward(dfc1, dact, fc1, n * s_.F); break;
      case MlpActivation::kSquaredReLU: k_.squared_relu_backward(dfc1, dact, fc1, n * s_.F); break;
    }
  }

  const GroupedMlpWeights<T>& w_;
  const GroupedMlpShape& s_;
  K k_;
};

// A kernel set for Steps: static members forwarding to the kernels of namespace ns.
#define MOECORE_GROUPED_MLP_KERNELS(Name, ns)                 \
  struct Name {                                               \
    MOECORE_GROUPED_MLP_FORWARD(ns, linear_forward)           \
    MOECORE_GROUPED_MLP_FORWARD(ns, linear_backward)          \
    MOECORE_GROUPED_MLP_FORWARD(ns, swiglu_forward)           \
    MOECORE_GROUPED_MLP_FORWARD(ns, swiglu_backward)          \
    MOECORE_GROUPED_MLP_FORWARD(ns, gelu_forward)             \
    MOECORE_GROUPED_MLP_FORWARD(ns, gelu_backward)            \
    MOECORE_GROUPED_MLP_FORWARD(ns, squared_relu_forward)     \
    MOECORE_GROUPED_MLP_FORWARD(ns, squared_relu_backward)    \
    MOECORE_GROUPED_MLP_FORWARD(ns, weighted_swiglu_forward)  \
    MOECORE_GROUPED_MLP_FORWARD(ns, weighted_swiglu_backward) \
    MOECORE_GROUPED_MLP_FORWARD(ns, scale_rows)               \
    MOECORE_GROUPED_MLP_FORWARD(ns, scale_rows_backward)      \
    MOECORE_GROUPED_MLP_FORWARD(ns, add_outer)                \
    MOECORE_GROUPED_MLP_FORWARD(ns, add_outer_backward)       \
    MOECORE_GROUPED_MLP_FORWARD(ns, round_bf16)               \
    MOECORE_GROUPED_MLP_FORWARD(ns, round_fp16)               \
  };
#define MOECORE_GROUPED_MLP_FORWARD(ns, name)                  \
  template <typename... Args>                                  \
  static void name(Args&&... args) {                           \
    ::moecore::kernels::ns::name(std::forward<Args>(args)...); \
  }

}  // namespace moecore::kernels::grouped_mlp_detail
