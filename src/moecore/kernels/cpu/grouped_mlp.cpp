// Grouped expert MLP over row tiles of all experts at once (scheduling: grouped_mlp.h). Each tile's steps
// (grouped_mlp_steps.h) run inside the parallel loop, where the kernels they call run on one thread.
#include "moecore/kernels/cpu/grouped_mlp.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "moecore/kernels/cpu/activation.h"
#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/elementwise.h"
#include "moecore/kernels/cpu/expert_activation.h"
#include "moecore/kernels/cpu/gemm.h"
#include "moecore/kernels/cpu/gemm_lowp.h"
#include "moecore/kernels/cpu/grouped_mlp_steps.h"
#include "moecore/kernels/cpu/rank_update.h"
#include "moecore/kernels/cpu/rows.h"
#include "moecore/kernels/cpu/small_rows_bf16.h"

namespace moecore::kernels::cpu {
namespace {

MOECORE_GROUPED_MLP_KERNELS(Kernels, cpu)

template <typename T>
using Steps = grouped_mlp_detail::Steps<Kernels, T>;

// The steps' linear layers on the native 16-bit GEMMs (GroupedMlpShape::native_gemm): each operand's values are
// narrowed to 16 bits (exact: the steps round what they write, and the weights hold values of the format), the
// products are summed in fp32 into fp32 outputs, which the steps then round as on the fp32 path. Runs inside the
// tile loop: each call is one thread's, with thread-local operand buffers.
class NativeKernels : public Kernels {
 public:
  NativeKernels(const LowpType type, const GroupedMlpWeights<float>& w, const GroupedMlpShape& s,
                const GroupedMlpGrads<float>* g = nullptr)
      : type_(type) {
    if (g != nullptr && g->weights_zero_E != nullptr && s.part != GroupedMlpBackwardPart::kData) {
      for (int64_t e = 0; e < s.E; ++e) {
        if (!g->weights_zero_E[e] || s.offsets_E1[e + 1] == s.offsets_E1[e]) continue;
        if (g->fc1_weight_E != nullptr && g->fc1_weight_E[e] != nullptr) zero_weights_.insert(g->fc1_weight_E[e]);
        if (g->fc2_weight_E != nullptr && g->fc2_weight_E[e] != nullptr) zero_weights_.insert(g->fc2_weight_E[e]);
      }
    }
    // The weight gradients (dweight += dout^T inp, dbias) read no weight: a kWeights backward casts none.
    if (s.part == GroupedMlpBackwardPart::kWeights) return;
    const int64_t F1 = s.F1(), w1 = F1 * s.H, w2 = s.H * s.F;
    by_weight_.reserve(static_cast<size_t>(2 * s.E));
    if (w.fc1_weight16_E != nullptr && w.fc2_weight16_E != nullptr) {  // the caller's casts
      for (int64_t e = 0; e < s.E; ++e) {
        by_weight_.emplace(w.fc1_weight_E[e], w.fc1_weight16_E[e]);
        by_weight_.emplace(w.fc2_weight_E[e], w.fc2_weight16_E[e]);
      }
      return;
    }
    weights16_.resize(static_cast<size_t>(s.E * (w1 + w2)));
    for (int64_t e = 0; e < s.E; ++e) {
      by_weight_.emplace(w.fc1_weight_E[e], weights16_.data() + e * (w1 + w2));
      by_weight_.emplace(w.fc2_weight_E[e], weights16_.data() + e * (w1 + w2) + w1);
    }
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < s.E; ++e) {
      encode(weights16_.data() + e * (w1 + w2), w.fc1_weight_E[e], w1);
      encode(weights16_.data() + e * (w1 + w2) + w1, w.fc2_weight_E[e], w2);
    }
  }

  // out = in W^T (+ bias).
  void linear_forward(float* out_TO, const float* inp_TI, const float* weight_OI, const float* bias_O, const int64_t n,
                      const int64_t I, const int64_t O) const {
    if (n == 0) return;
    Buffers& buf = buffers();
    if (small_rows(n, small_rows_forward_max())) {
      small_rows_forward_bf16(out_TO, encode_rows(buf.a, inp_TI, n, I, n), weight16(weight_OI), n, I, O);
      if (bias_O != nullptr) cpu::add_bias_rows(out_TO, bias_O, n, O);
      return;
    }
    const int64_t np = padded(n);
    const uint16_t* x = encode_rows(buf.a, inp_TI, n, I, np);
    float* y = np == n ? out_TO : sized(buf.c, np * O);
    cpu::gemm_lowp<float>(type_, false, true, np, O, I, 1.0f, x, I, weight16(weight_OI), I, 0.0f, y, O);
    if (y != out_TO) std::copy_n(y, n * O, out_TO);
    if (bias_O != nullptr) cpu::add_bias_rows(out_TO, bias_O, n, O);
  }

  // dinp += dout W; dweight += dout^T inp; dbias += column sums of dout (fp32). A weight gradient over a few rows
  // is a rank update on the fp32 values (products of 16-bit values are exact in fp32, summed in fp32 as the GEMM).
  void linear_backward(float* dinp_TI, float* dweight_OI, float* dbias_O, const float* dout_TO, const float* inp_TI,
                       const float* weight_OI, const int64_t n, const int64_t I, const int64_t O) const {
    if (n == 0) return;
    const bool rank_update_weights = n <= kRankUpdateMaxRows;
    // A gradient known to be zero (this task is its only writer in the call) is written, not added to.
    const bool overwrite = dweight_OI != nullptr && zero_weights_.contains(dweight_OI);
    if (dweight_OI != nullptr && rank_update_weights) {
      (overwrite ? cpu::rank_update_overwrite : cpu::rank_update)(dweight_OI, dout_TO, inp_TI, n, O, I);
    }
    if (dbias_O != nullptr) {
      cpu::linear_backward<float>(nullptr, nullptr, dbias_O, dout_TO, nullptr, weight_OI, n, I, O);
    }
    if (dinp_TI != nullptr && small_rows(n, small_rows_data_max())) {
      (small_rows_data_pairs() ? small_rows_data_bf16 : small_rows_data_widened)(dinp_TI, dout_TO, weight16(weight_OI),
                                                                                 n, I, O);
      dinp_TI = nullptr;
    }
    if (dinp_TI == nullptr && (dweight_OI == nullptr || rank_update_weights)) return;
    Buffers& buf = buffers();
    const int64_t np = padded(n);
    const uint16_t* dy = encode_rows(buf.a, dout_TO, n, O, np);
    if (dinp_TI != nullptr) {
      const uint16_t* w = weight16(weight_OI);
      float* dx = sized(buf.c, np * I);
      cpu::gemm_lowp<float>(type_, false, false, np, I, O, 1.0f, dy, O, w, I, 0.0f, dx, I);
      cpu::add_inplace(dinp_TI, dx, n * I);
    }
    if (dweight_OI != nullptr && !rank_update_weights) {
      const uint16_t* x = encode_rows(buf.b, inp_TI, n, I, np);
      if (overwrite) {
        cpu::gemm_lowp<float>(type_, true, false, O, I, np, 1.0f, dy, O, x, I, 0.0f, dweight_OI, I);
      } else {
        float* product = sized(buf.c, O * I);
        cpu::gemm_lowp<float>(type_, true, false, O, I, np, 1.0f, dy, O, x, I, 0.0f, product, I);
        cpu::add_inplace(dweight_OI, product, O * I);
      }
    }
  }

 private:
  struct Buffers {
    std::vector<uint16_t> a, b;
    std::vector<float> c;
  };
  static Buffers& buffers() {
    thread_local Buffers buffers;
    return buffers;
  }
  static bool amx() {
    static const bool tiles = cpu_has_lowp_amx(LowpType::kBF16);
    return tiles;
  }
  static int64_t small_rows_forward_max() { return amx() ? kSmallRowsForwardMaxAmx : kSmallRowsForwardMax; }
  static int64_t small_rows_data_max() { return amx() ? kSmallRowsDataMaxAmx : kSmallRowsDataMax; }
  // A tile of a few rows on the bf16 weight in place (small_rows_bf16.h), where the CPU runs those kernels.
  bool small_rows(const int64_t n, const int64_t max_rows) const {
    return type_ == LowpType::kBF16 && n <= max_rows && small_rows_bf16_usable();
  }
  static int64_t padded(const int64_t n) {
    return (n + kGroupedMlpNativeRowQuantum - 1) / kGroupedMlpNativeRowQuantum * kGroupedMlpNativeRowQuantum;
  }
  template <typename V>
  static V* sized(std::vector<V>& v, const int64_t n) {
    if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
    return v.data();
  }
  void encode(uint16_t* out, const float* in, const int64_t n) const {
    const ConvertIsa isa = best_convert_isa();
    type_ == LowpType::kBF16 ? cpu::encode_bf16(out, in, n, isa) : cpu::encode_fp16(out, in, n, isa);
  }
  // [np, cols] 16-bit bits of the [n, cols] rows, zero rows after them.
  const uint16_t* encode_rows(std::vector<uint16_t>& buf, const float* rows, const int64_t n, const int64_t cols,
                              const int64_t np) const {
    uint16_t* out = sized(buf, np * cols);
    encode(out, rows, n * cols);
    std::fill(out + n * cols, out + np * cols, uint16_t{0});
    return out;
  }
  const uint16_t* weight16(const float* weight) const { return by_weight_.at(weight); }

  LowpType type_;
  std::vector<uint16_t> weights16_;
  std::unordered_map<const float*, const uint16_t*> by_weight_;
  std::unordered_set<const float*> zero_weights_;
};

struct RowTile {
  int64_t expert, begin, end;
};

// Every expert's rows in the fewest even tiles of at most kGroupedMlpTileRows, largest first (ties in expert
// order): the dynamic schedule then ends with the small tasks.
std::vector<RowTile> row_tiles(const GroupedMlpShape& s) {
  std::vector<RowTile> tiles;
  for (int64_t e = 0; e < s.E; ++e) {
    const int64_t first = s.offsets_E1[e], rows = s.offsets_E1[e + 1] - first;
    const int64_t n = (rows + kGroupedMlpTileRows - 1) / kGroupedMlpTileRows;
    for (int64_t i = 0; i < n; ++i) tiles.push_back({e, first + rows * i / n, first + rows * (i + 1) / n});
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const RowTile& a, const RowTile& b) { return a.end - a.begin > b.end - b.begin; });
  return tiles;
}

// One weight-gradient task per (expert, fc1 | fc2), experts with rows only (the others keep their gradients),
// costliest first: rows x F1 x H for fc1, rows x H x F for fc2.
std::vector<std::pair<int64_t, bool>> weight_grad_tasks(const GroupedMlpShape& s) {
  std::vector<std::pair<int64_t, bool>> tasks;
  for (int64_t e = 0; e < s.E; ++e) {
    if (s.offsets_E1[e + 1] == s.offsets_E1[e]) continue;
    tasks.emplace_back(e, true);
    tasks.emplace_back(e, false);
  }
  const auto cost = [&](const std::pair<int64_t, bool>& t) {
    return (s.offsets_E1[t.first + 1] - s.offsets_E1[t.first]) * (t.second ? s.F1() : s.F);
  };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const auto& a, const auto& b) { return cost(a) > cost(b); });
  return tasks;
}

template <typename St, typename T>
void forward_tiles(const St& steps, const GroupedMlpShape& s, T* y_RH, T* fc1_RF1, T* act_RF, T* h_RF, T* xs_RH,
                   const T* x_RH, const T* probs_R) {
  const std::vector<RowTile> tiles = row_tiles(s);
  const auto n_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n_tiles; ++i) {
    const RowTile& tile = tiles[static_cast<size_t>(i)];
    steps.forward(tile.expert, tile.begin, tile.end, y_RH, fc1_RF1, act_RF, h_RF, xs_RH, x_RH, probs_R);
  }
}

template <typename St, typename T>
void backward_tiles(const St& steps, const GroupedMlpShape& s, T* dx_RH, T* dprobs_R, const GroupedMlpGrads<T>& g,
                    T* dfc1_RF1, const T* dy_RH, const T* x_RH, const T* xs_RH, const T* fc1_RF1, const T* act_RF,
                    const T* h_RF, const T* probs_R) {
  if (s.part != GroupedMlpBackwardPart::kWeights) {
    const std::vector<RowTile> tiles = row_tiles(s);
    const auto n_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tiles; ++i) {
      const RowTile& tile = tiles[static_cast<size_t>(i)];
      steps.backward_data(tile.expert, tile.begin, tile.end, dx_RH, dprobs_R, dfc1_RF1, dy_RH, x_RH, fc1_RF1, act_RF,
                          probs_R);
    }
  }
  if (s.part == GroupedMlpBackwardPart::kData) return;
  const std::vector<std::pair<int64_t, bool>> tasks = weight_grad_tasks(s);
  const auto n_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n_tasks; ++i) {
    const auto [e, fc1] = tasks[static_cast<size_t>(i)];
    steps.weight_grads(e, fc1, s.offsets_E1[e], s.offsets_E1[e + 1], g, dfc1_RF1, dy_RH, x_RH, xs_RH, act_RF, h_RF,
                       probs_R);
  }
}

// ---- 16-bit activations

// Widens and narrows 16-bit rows (round to nearest even).
class Codec16 {
 public:
  explicit Codec16(const LowpType type) : type_(type), isa_(best_convert_isa()) {}
  void widen(float* out, const uint16_t* in, const int64_t n) const {
    type_ == LowpType::kBF16 ? decode_bf16(out, in, n, isa_) : decode_fp16(out, in, n, isa_);
  }
  void narrow(uint16_t* out, const float* in, const int64_t n) const {
    type_ == LowpType::kBF16 ? encode_bf16(out, in, n, isa_) : encode_fp16(out, in, n, isa_);
  }

 private:
  LowpType type_;
  ConvertIsa isa_;
};

// A thread's fp32 buffers for the 16-bit tasks. Rows [begin, begin + n) of a [R, width] tensor sit at the offset from a
// 64-byte boundary they have in a 64-byte aligned fp32 copy of the whole tensor, so the steps' vector loops group
// their sums as on the staged copy.
class RowSlots {
 public:
  float* rows(const size_t slot, const int64_t begin, const int64_t n, const int64_t width) {
    constexpr int64_t kAlign = 16;  // floats in 64 bytes
    std::vector<float>& v = slots_[slot];
    const auto need = static_cast<size_t>(n * width + 2 * kAlign);
    if (v.size() < need) v.resize(need);
    auto* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
    return base + (begin * width) % kAlign;
  }

 private:
  std::array<std::vector<float>, 5> slots_;
};

template <typename St>
void forward_tiles16(const St& steps, const GroupedMlpShape& s, const Codec16& c, uint16_t* y_RH, uint16_t* fc1_RF1,
                     uint16_t* act_RF, uint16_t* h_RF, uint16_t* xs_RH, const uint16_t* x_RH, const float* probs_R) {
  const std::vector<RowTile> tiles = row_tiles(s);
  const auto n_tiles = static_cast<int64_t>(tiles.size());
  const int64_t H = s.H, F = s.F, F1 = s.F1();
  const bool wsw = s.weighted_swiglu();
  uint16_t* saved_RF = wsw ? h_RF : act_RF;  // fc2's input (h) or the activation
#pragma omp parallel
  {
    RowSlots slots;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tiles; ++i) {
      const RowTile& tile = tiles[static_cast<size_t>(i)];
      const int64_t b = tile.begin, n = tile.end - tile.begin;
      float* x = slots.rows(0, b, n, H);
      c.widen(x, x_RH + b * H, n * H);
      float* y = slots.rows(1, b, n, H);
      float* fc1 = slots.rows(2, b, n, F1);
      float* saved = slots.rows(3, b, n, F);
      float* xs = s.probs_on_input ? slots.rows(4, b, n, H) : nullptr;
      steps.forward(tile.expert, 0, n, y, fc1, wsw ? nullptr : saved, wsw ? saved : nullptr, xs, x, probs_R + b);
      c.narrow(y_RH + b * H, y, n * H);
      c.narrow(fc1_RF1 + b * F1, fc1, n * F1);
      c.narrow(saved_RF + b * F, saved, n * F);
      if (xs != nullptr) c.narrow(xs_RH + b * H, xs, n * H);
    }
  }
}

// The row-local pass of backward_tiles16: dx, dprobs and d(fc1 output), tile by tile.
template <typename St>
void backward_data_tiles16(const St& steps, const GroupedMlpShape& s, const Codec16& c, uint16_t* dx_RH,
                           float* dprobs_R, float* dfc1_RF1, const uint16_t* dy_RH, const uint16_t* x_RH,
                           const uint16_t* fc1_RF1, const uint16_t* act_RF, const float* probs_R) {
  const std::vector<RowTile> tiles = row_tiles(s);
  const auto n_tiles = static_cast<int64_t>(tiles.size());
  const int64_t H = s.H, F = s.F, F1 = s.F1();
  // What the row-local pass reads besides dy, fc1 and dx: x with the probability on the input, the activation when
  // the probability scales it after fc1 (not fused).
  const bool reads_x = s.probs_on_input, reads_act = !s.weighted_swiglu() && !s.probs_on_input;
#pragma omp parallel
  {
    RowSlots slots;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tiles; ++i) {
      const RowTile& tile = tiles[static_cast<size_t>(i)];
      const int64_t b = tile.begin, n = tile.end - tile.begin;
      float* dy = slots.rows(0, b, n, H);
      c.widen(dy, dy_RH + b * H, n * H);
      float* fc1 = slots.rows(1, b, n, F1);
      c.widen(fc1, fc1_RF1 + b * F1, n * F1);
      float* dx = slots.rows(2, b, n, H);  // accumulated into
      c.widen(dx, dx_RH + b * H, n * H);
      float* x = reads_x ? slots.rows(3, b, n, H) : nullptr;
      if (x != nullptr) c.widen(x, x_RH + b * H, n * H);
      float* act = reads_act ? slots.rows(4, b, n, F) : nullptr;
      if (act != nullptr) c.widen(act, act_RF + b * F, n * F);
      steps.backward_data(tile.expert, 0, n, dx, dprobs_R + b, dfc1_RF1 + b * F1, dy, x, fc1, act, probs_R + b);
      c.narrow(dx_RH + b * H, dx, n * H);
    }
  }
}

template <typename St>
void backward_tiles16(const St& steps, const GroupedMlpShape& s, const Codec16& c, uint16_t* dx_RH, float* dprobs_R,
                      const GroupedMlpGrads<float>& g, float* dfc1_RF1, const uint16_t* dy_RH, const uint16_t* x_RH,
                      const uint16_t* xs_RH, const uint16_t* fc1_RF1, const uint16_t* act_RF, const uint16_t* h_RF,
                      const float* probs_R) {
  const int64_t H = s.H, F = s.F, F1 = s.F1();
  const bool wsw = s.weighted_swiglu();
  if (s.part != GroupedMlpBackwardPart::kWeights) {
    backward_data_tiles16(steps, s, c, dx_RH, dprobs_R, dfc1_RF1, dy_RH, x_RH, fc1_RF1, act_RF, probs_R);
  }
  if (s.part == GroupedMlpBackwardPart::kData) return;
  const std::vector<std::pair<int64_t, bool>> tasks = weight_grad_tasks(s);
  const auto n_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel
  {
    RowSlots slots;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tasks; ++i) {
      const auto [e, fc1] = tasks[static_cast<size_t>(i)];
      const int64_t b = s.offsets_E1[e], n = s.offsets_E1[e + 1] - b;
      if (fc1) {  // fc1's input: x p with the probability on the input, else x
        float* in = slots.rows(0, b, n, H);
        c.widen(in, (s.probs_on_input ? xs_RH : x_RH) + b * H, n * H);
        steps.weight_grads(e, true, 0, n, g, dfc1_RF1 + b * F1, nullptr, in, in, nullptr, nullptr, probs_R + b);
        continue;
      }
      float* dy = slots.rows(1, b, n, H);
      c.widen(dy, dy_RH + b * H, n * H);
      float* saved = slots.rows(2, b, n, F);  // fc2's input h, or the activation
      c.widen(saved, (wsw ? h_RF : act_RF) + b * F, n * F);
      steps.weight_grads(e, false, 0, n, g, nullptr, dy, nullptr, nullptr, wsw ? nullptr : saved, wsw ? saved : nullptr,
                         probs_R + b);
    }
  }
}

}  // namespace

void grouped_mlp_forward16(const LowpType type, uint16_t* y_RH, uint16_t* fc1_RF1, uint16_t* act_RF, uint16_t* h_RF,
                           uint16_t* xs_RH, const uint16_t* x_RH, const float* probs_R,
                           const GroupedMlpWeights<float>& w, const GroupedMlpShape& s) {
  const Codec16 c(type);
  if (s.native_gemm) {
    const grouped_mlp_detail::Steps<NativeKernels, float> steps(w, s, NativeKernels(s.native_type, w, s));
    forward_tiles16(steps, s, c, y_RH, fc1_RF1, act_RF, h_RF, xs_RH, x_RH, probs_R);
    return;
  }
  forward_tiles16(Steps<float>(w, s), s, c, y_RH, fc1_RF1, act_RF, h_RF, xs_RH, x_RH, probs_R);
}

void grouped_mlp_backward16(const LowpType type, uint16_t* dx_RH, float* dprobs_R, const GroupedMlpGrads<float>& g,
                            float* dfc1_RF1, const uint16_t* dy_RH, const uint16_t* x_RH, const uint16_t* xs_RH,
                            const uint16_t* fc1_RF1, const uint16_t* act_RF, const uint16_t* h_RF, const float* probs_R,
                            const GroupedMlpWeights<float>& w, const GroupedMlpShape& s) {
  const Codec16 c(type);
  if (s.native_gemm) {
    const grouped_mlp_detail::Steps<NativeKernels, float> steps(w, s, NativeKernels(s.native_type, w, s, &g));
    backward_tiles16(steps, s, c, dx_RH, dprobs_R, g, dfc1_RF1, dy_RH, x_RH, xs_RH, fc1_RF1, act_RF, h_RF, probs_R);
    return;
  }
  backward_tiles16(Steps<float>(w, s), s, c, dx_RH, dprobs_R, g, dfc1_RF1, dy_RH, x_RH, xs_RH, fc1_RF1, act_RF, h_RF,
                   probs_R);
}

template <typename T>
void grouped_mlp_forward(T* y_RH, T* fc1_RF1, T* act_RF, T* h_RF, T* xs_RH, const T* x_RH, const T* probs_R,
                         const GroupedMlpWeights<T>& w, const GroupedMlpShape& s) {
  if constexpr (std::is_same_v<T, float>) {
    if (s.native_gemm) {
      const grouped_mlp_detail::Steps<NativeKernels, float> steps(w, s, NativeKernels(s.native_type, w, s));
      forward_tiles(steps, s, y_RH, fc1_RF1, act_RF, h_RF, xs_RH, x_RH, probs_R);
      return;
    }
  }
  forward_tiles(Steps<T>(w, s), s, y_RH, fc1_RF1, act_RF, h_RF, xs_RH, x_RH, probs_R);
}

template <typename T>
void grouped_mlp_backward(T* dx_RH, T* dprobs_R, const GroupedMlpGrads<T>& g, T* dfc1_RF1, const T* dy_RH,
                          const T* x_RH, const T* xs_RH, const T* fc1_RF1, const T* act_RF, const T* h_RF,
                          const T* probs_R, const GroupedMlpWeights<T>& w, const GroupedMlpShape& s) {
  if constexpr (std::is_same_v<T, float>) {
    if (s.native_gemm) {
      const grouped_mlp_detail::Steps<NativeKernels, float> steps(w, s, NativeKernels(s.native_type, w, s, &g));
      backward_tiles(steps, s, dx_RH, dprobs_R, g, dfc1_RF1, dy_RH, x_RH, xs_RH, fc1_RF1, act_RF, h_RF, probs_R);
      return;
    }
  }
  backward_tiles(Steps<T>(w, s), s, dx_RH, dprobs_R, g, dfc1_RF1, dy_RH, x_RH, xs_RH, fc1_RF1, act_RF, h_RF, probs_R);
}

#define MOECORE_INSTANTIATE(T)                                                                                         \
  template void grouped_mlp_forward<T>(T*, T*, T*, T*, T*, const T*, const T*, const GroupedMlpWeights<T>&,            \
                                       const GroupedMlpShape&);                                                        \
  template void grouped_mlp_backward<T>(T*, T*, const GroupedMlpGrads<T>&, T*, const T*, const T*, const T*, const T*, \
                                        const T*, const T*, const T*, const GroupedMlpWeights<T>&,                     \
                                        const GroupedMlpShape&);
MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(double)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::kernels::cpu
