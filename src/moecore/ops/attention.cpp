#include "moecore/ops/attention.h"

#include <array>
#include <initializer_list>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moecore/kernels/cpu/attention_products.h"
#include "moecore/kernels/cpu/convert.h"
#include "moecore/ops/dispatch.h"
#include "moecore/ops/precision.h"
#include "moecore/ops/row_blocks.h"

namespace moecore::ops {
using detail::ptr;
namespace {

int64_t value_dim(const AttentionDims& dims) { return dims.v_head_dim > 0 ? dims.v_head_dim : dims.head_dim; }

// x holds the elements of the shape `dims` (named sizes, e.g. {"Sk", 6}, {"dv", 4}).
void check_shape(const char* op, const char* name, const Tensor& x,
                 const std::initializer_list<std::pair<const char*, int64_t>> dims) {
  int64_t expected = 1;
  std::string shape;
  for (const auto& [dim, n] : dims) {
    expected *= n;
    shape += (shape.empty() ? "" : ", ") + std::string(dim) + "=" + std::to_string(n);
  }
  if (x.numel() == expected) return;
  detail::fail(op, std::string(name) + " is " + x.shape_str() + " (" + std::to_string(x.numel()) +
                       " elements), expected [" + shape + "] (" + std::to_string(expected) + " elements)");
}

// q (or dq) [S, B, N, d], k / dk [Sk, B, G, d], v / dv [Sk, B, G, dv], out / dout [S, B, N, dv], lse [B, N, S].
struct AttentionTensors {
  const char *q_name, *k_name, *v_name, *out_name;
  const Tensor &q, &k, &v, &out;
};

void check_value_dim(const char* op, const AttentionDims& dims) {
  if (dims.v_head_dim < 0) {
    detail::fail(op, "v_head_dim=" + std::to_string(dims.v_head_dim) + " is negative (0: head_dim)");
  }
}

void check_attention(const char* op, const AttentionDims& dims, const AttentionTensors& t, const Tensor& lse) {
  check_value_dim(op, dims);
  const int64_t S = dims.S, Sk = dims.Sk > 0 ? dims.Sk : dims.S, B = dims.B, d = dims.head_dim, dv = value_dim(dims);
  check_shape(op, t.q_name, t.q, {{"S", S}, {"B", B}, {"N", dims.N}, {"d", d}});
  check_shape(op, t.k_name, t.k, {{"Sk", Sk}, {"B", B}, {"G", dims.G}, {"d", d}});
  check_shape(op, t.v_name, t.v, {{"Sk", Sk}, {"B", B}, {"G", dims.G}, {"dv", dv}});
  check_shape(op, t.out_name, t.out, {{"S", S}, {"B", B}, {"N", dims.N}, {"dv", dv}});
  detail::check_numel(op, "lse_BNS", lse, S * B * dims.N);
  if ((dims.q_document_SB == nullptr) != (dims.k_document_SB == nullptr)) {
    detail::fail(op, "documents given for " + std::string(dims.q_document_SB != nullptr ? "queries" : "keys") +
                         " only (give q_document_SB and k_document_SB, or neither)");
  }
}

int64_t heads_of(const char* op, const Tensor& x, const int64_t S, const int64_t B, const int64_t head_dim) {
  const int64_t per_head = S * B * head_dim;
  if (per_head <= 0 || x.numel() % per_head != 0) {
    detail::fail(op, x.shape_str() + " is not [S=" + std::to_string(S) + ", B=" + std::to_string(B) +
                         ", heads, d=" + std::to_string(head_dim) + "]");
  }
  return x.numel() / per_head;
}

void check_positions(const char* op, const std::span<const int64_t> positions_SB, const int64_t S, const int64_t B) {
  if (static_cast<int64_t>(positions_SB.size()) != S * B) {
    detail::fail(op, "positions_SB has " + std::to_string(positions_SB.size()) +
                         " entries, expected S * B = " + std::to_string(S * B));
  }
}

// Under bf16 activations the products take bf16 operands (AttentionDims::bf16_products) unless
// attention_product_path() says fp32 (no AMX tiles, or MOECORE_ATTENTION_PRODUCTS=fp32). The flag is decided here,
// once for both devices, so the reference rounds the same operands as the fast kernel.
AttentionDims with_products(const AttentionDims& dims, const DType activation) {
  AttentionDims out = dims;
  out.bf16_products =
      dims.bf16_products || (activation == DType::kBF16 &&
                             kernels::cpu::attention_product_path() == kernels::cpu::AttentionProductPath::kBF16);
  return out;
}

// 16-bit activations a few sequences of the batch at a time: those sequences' q, k, v (backward: dout, out and the
// accumulated dq, dk, dv too) widened into fp32 scratch of [S, sequences, heads, width], the fp32 kernel run on it
// with B = sequences, and what it wrote narrowed back once (round to nearest even). Each (sequence, head) is computed
// as in the whole batch, so the values are the whole-tensor Staging's bit for bit, while the fp32 copies are a few
// sequences' (in cache) instead of the batch's. Not with attention dropout (its counters number the sequences of the
// batch) or packed documents ([S, B] document ids); the CPU device only.
class BatchSlices {
 public:
  // Whether the path applies: 16-bit activations of one dtype on the CPU, fp32 log-sum-exps.
  static bool apply(std::initializer_list<const Tensor*> activations, const Tensor& lse_BNS, const AttentionDims& dims,
                    const DropoutSpec& dropout) {
    const Tensor& first = **activations.begin();
    if (first.device() != Device::kCPU || !detail::is_16bit(first.dtype()) || lse_BNS.dtype() != DType::kF32) {
      return false;
    }
    for (const Tensor* t : activations) {
      if (t->dtype() != first.dtype()) return false;
    }
    return dropout.p == 0.0f && dims.q_document_SB == nullptr && dims.k_document_SB == nullptr && dims.B > 0;
  }

  // Sequences per kernel call: as many as keep q's fp32 copy within kSliceBytes (e16, S 512 x 512 wide: one; the
  // demo model, S 256 x 192 wide: the micro-batch's four, whose B x groups tasks keep both threads busy).
  static int64_t sequences_per_call(const AttentionDims& dims) {
    constexpr int64_t kSliceBytes = int64_t{1} << 20;
    const int64_t one = dims.S * dims.N * dims.head_dim * static_cast<int64_t>(sizeof(float));
    return std::clamp<int64_t>(kSliceBytes / std::max<int64_t>(one, 1), 1, dims.B);
  }

  BatchSlices(const DType dtype, const int64_t batch) : bf16_(dtype == DType::kBF16), B_(batch) {}

  // A [rows, B, W] tensor and its scratch slot (a call's sequences, [rows, sequences, W]): read (Slice) or written
  // (OutSlice).
  template <typename T>
  struct SliceOf {
    size_t slot;
    T* t;
    int64_t rows;
  };
  using Slice = SliceOf<const Tensor>;
  using OutSlice = SliceOf<Tensor>;
  // Sequences b .. b + nb of each slice's 16-bit tensor widened into its slot; the slots' fp32 pointers in the
  // slices' order.
  template <size_t n>
  std::array<float*, n> widen(const std::array<Slice, n>& slices, const int64_t b, const int64_t nb) {
    std::array<float*, n> out{};
    for (size_t i = 0; i < n; ++i) out[i] = scratch(slices[i].slot, slices[i].t->numel() / B_ * nb);
    convert_rows(slices, [&](const size_t i, const int64_t s, const int64_t W) {
      const uint16_t* in = slices[i].t->template data<uint16_t>() + (s * B_ + b) * W;
      float* row = out[i] + s * nb * W;
      bf16_ ? kernels::cpu::decode_bf16(row, in, nb * W, isa_) : kernels::cpu::decode_fp16(row, in, nb * W, isa_);
    });
    return out;
  }
  // Scratch slot `slot` for nb sequences of t, not widened (the kernel overwrites it).
  float* uninitialized(const size_t slot, const Tensor& t, const int64_t nb) {
    return scratch(slot, t.numel() / B_ * nb);
  }
  // Each slice's slot narrowed into sequences b .. b + nb of its tensor.
  template <size_t n>
  void narrow(const std::array<OutSlice, n>& slices, const int64_t b, const int64_t nb) const {
    convert_rows(slices, [&](const size_t i, const int64_t s, const int64_t W) {
      const float* in = slots_[slices[i].slot].template data<float>() + s * nb * W;
      uint16_t* out = slices[i].t->template data<uint16_t>() + (s * B_ + b) * W;
      bf16_ ? kernels::cpu::encode_bf16(out, in, nb * W, isa_) : kernels::cpu::encode_fp16(out, in, nb * W, isa_);
    });
  }

 private:
  // fn(slice, row, W) for every row of every slice, on all threads in one parallel region: with each tensor
  // widened on one thread the e16 bf16 step (bench/moe_step_models.sh) spent 5-9 ms more in attention.
  template <typename T, size_t n, typename Fn>
  void convert_rows(const std::array<SliceOf<T>, n>& slices, Fn&& fn) const {
    std::array<int64_t, n + 1> first_row{};
    for (size_t i = 0; i < n; ++i) first_row[i + 1] = first_row[i] + slices[i].rows;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < first_row[n]; ++r) {
      size_t i = 0;
      while (r >= first_row[i + 1]) ++i;
      fn(i, r - first_row[i], slices[i].t->numel() / (slices[i].rows * B_));
    }
  }

  float* scratch(const size_t slot, const int64_t n) {
    Tensor& buffer = slots_[slot];
    if (!buffer.defined() || buffer.numel() < n) buffer = Tensor::uninitialized({n}, DType::kF32);
    return buffer.data<float>();
  }

  bool bf16_;
  int64_t B_;
  kernels::cpu::ConvertIsa isa_ = kernels::cpu::best_convert_isa();
  std::array<Tensor, 8> slots_;
};

}  // namespace

std::string attention_products(const DType activation) {
  if (!with_products({}, activation).bf16_products) return "fp32 products";
  return "bf16 products on " +
         std::string(kernels::cpu::bf16_product_unit_name(kernels::cpu::best_bf16_product_unit()));
}

void attention_forward(Tensor& out_SBNd, Tensor& lse_BNS, const Tensor& q_SBNd, const Tensor& k_SBGd,
                       const Tensor& v_SBGd, const AttentionDims& dims, const DropoutSpec& dropout) {
  constexpr const char* op = "attention_forward";
  detail::check_tensors(op, {&out_SBNd, &lse_BNS, &q_SBNd, &k_SBGd, &v_SBGd});
  check_attention(op, dims, {"q_SBNd", "k_SBGd", "v_SBGd", "out_SBNd", q_SBNd, k_SBGd, v_SBGd, out_SBNd}, lse_BNS);
  if (BatchSlices::apply({&out_SBNd, &q_SBNd, &k_SBGd, &v_SBGd}, lse_BNS, dims, dropout)) {
    const int64_t S = dims.S, Sk = dims.Sk > 0 ? dims.Sk : dims.S;
    AttentionDims some = with_products(dims, activation_dtype(q_SBNd.device()));
    const int64_t per_call = BatchSlices::sequences_per_call(dims);
    BatchSlices x(q_SBNd.dtype(), dims.B);
    for (int64_t b = 0; b < dims.B; b += per_call) {
      some.B = std::min(per_call, dims.B - b);
      const auto [q, k, v] =
          x.widen(std::array<BatchSlices::Slice, 3>{{{1, &q_SBNd, S}, {2, &k_SBGd, Sk}, {3, &v_SBGd, Sk}}}, b, some.B);
      kernels::cpu::attention_forward(x.uninitialized(0, out_SBNd, some.B), lse_BNS.data<float>() + b * dims.N * S, q,
                                      k, v, some, dropout);
      x.narrow(std::array<BatchSlices::OutSlice, 1>{{{0, &out_SBNd, S}}}, b, some.B);
    }
    return;
  }
  detail::Staging staging;
  staging.write_only(out_SBNd, {&q_SBNd, &k_SBGd, &v_SBGd});
  detail::dispatch(op, q_SBNd, [&]<typename S>(auto k) {
    k.attention_forward(ptr<S>(out_SBNd), ptr<S>(lse_BNS), ptr<S>(q_SBNd), ptr<S>(k_SBGd), ptr<S>(v_SBGd),
                        with_products(dims, activation_dtype(q_SBNd.device())), dropout);
  });
  detail::round_activations({&out_SBNd});  // lse stays fp32
}

void attention_backward(Tensor& dq_SBNd, Tensor& dk_SBGd, Tensor& dv_SBGd, const Tensor& dout_SBNd,
                        const Tensor& q_SBNd, const Tensor& k_SBGd, const Tensor& v_SBGd, const Tensor& out_SBNd,
                        const Tensor& lse_BNS, const AttentionDims& dims, const DropoutSpec& dropout) {
  constexpr const char* op = "attention_backward";
  detail::check_tensors(op, {&dq_SBNd, &dk_SBGd, &dv_SBGd, &dout_SBNd, &q_SBNd, &k_SBGd, &v_SBGd, &out_SBNd, &lse_BNS});
  check_attention(op, dims, {"q_SBNd", "k_SBGd", "v_SBGd", "out_SBNd", q_SBNd, k_SBGd, v_SBGd, out_SBNd}, lse_BNS);
  check_attention(op, dims, {"dq_SBNd", "dk_SBGd", "dv_SBGd", "dout_SBNd", dq_SBNd, dk_SBGd, dv_SBGd, dout_SBNd},
                  lse_BNS);
  if (BatchSlices::apply({&dq_SBNd, &dk_SBGd, &dv_SBGd, &dout_SBNd, &q_SBNd, &k_SBGd, &v_SBGd, &out_SBNd}, lse_BNS,
                         dims, dropout)) {
    const int64_t S = dims.S, Sk = dims.Sk > 0 ? dims.Sk : dims.S;
    AttentionDims some = with_products(dims, activation_dtype(q_SBNd.device()));
    const int64_t per_call = BatchSlices::sequences_per_call(dims);
    BatchSlices x(q_SBNd.dtype(), dims.B);
    const std::array<BatchSlices::OutSlice, 3> grads{{{0, &dq_SBNd, S}, {1, &dk_SBGd, Sk}, {2, &dv_SBGd, Sk}}};
    for (int64_t b = 0; b < dims.B; b += per_call) {
      some.B = std::min(per_call, dims.B - b);
      const auto p = x.widen(std::array<BatchSlices::Slice, 8>{{{0, &dq_SBNd, S},
                                                                {1, &dk_SBGd, Sk},
                                                                {2, &dv_SBGd, Sk},
                                                                {3, &dout_SBNd, S},
                                                                {4, &q_SBNd, S},
                                                                {5, &k_SBGd, Sk},
                                                                {6, &v_SBGd, Sk},
                                                                {7, &out_SBNd, S}}},
                             b, some.B);
      kernels::cpu::attention_backward(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7],
                                       lse_BNS.data<float>() + b * dims.N * S, some, dropout);
      x.narrow(grads, b, some.B);
    }
    return;
  }
  const detail::Staging staging;
  detail::dispatch(op, q_SBNd, [&]<typename S>(auto k) {
    k.attention_backward(ptr<S>(dq_SBNd), ptr<S>(dk_SBGd), ptr<S>(dv_SBGd), ptr<S>(dout_SBNd), ptr<S>(q_SBNd),
                         ptr<S>(k_SBGd), ptr<S>(v_SBGd), ptr<S>(out_SBNd), ptr<S>(lse_BNS),
                         with_products(dims, activation_dtype(q_SBNd.device())), dropout);
  });
  detail::round_activations({&dq_SBNd, &dk_SBGd, &dv_SBGd});
}

void attention_merge(Tensor& out_SBNd, Tensor& lse_BNS, const Tensor& part_out_SBNd, const Tensor& part_lse_BNS,
                     const AttentionDims& dims) {
  constexpr const char* op = "attention_merge";
  const detail::Staging staging;
  detail::check_tensors(op, {&out_SBNd, &lse_BNS, &part_out_SBNd, &part_lse_BNS});
  check_value_dim(op, dims);
  const int64_t rows = dims.S * dims.B * dims.N, dv = value_dim(dims);
  check_shape(op, "out_SBNd", out_SBNd, {{"S", dims.S}, {"B", dims.B}, {"N", dims.N}, {"dv", dv}});
  detail::check_numel(op, "lse_BNS", lse_BNS, rows);
  check_shape(op, "part_out_SBNd", part_out_SBNd, {{"S", dims.S}, {"B", dims.B}, {"N", dims.N}, {"dv", dv}});
  detail::check_numel(op, "part_lse_BNS", part_lse_BNS, rows);
  detail::dispatch(op, out_SBNd, [&]<typename T>(auto k) {
    k.attention_merge(ptr<T>(out_SBNd), ptr<T>(lse_BNS), ptr<T>(part_out_SBNd), ptr<T>(part_lse_BNS), dims);
  });
  detail::round_activations({&out_SBNd});
}

namespace {

// The rotary embedding ops: out = rope(inp) forward (overwrites), or dinp += the transposed rotation of dout backward;
// positions_SB, when not empty, else s + position_offset for row (s, b).
void rope(const char* op, const bool backward, Tensor& out_SBNd, const Tensor& inp_SBNd, const int64_t S,
          const int64_t B, const RopeSpec& spec, const std::span<const int64_t> positions_SB,
          const int64_t position_offset) {
  detail::check_tensors(op, {&out_SBNd, &inp_SBNd});
  const int64_t N = heads_of(op, inp_SBNd, S, B, spec.head_dim);
  detail::check_numel(op, backward ? "dinp_SBNd" : "out_SBNd", out_SBNd, inp_SBNd.numel());
  const bool by_row = !positions_SB.empty();
  if (by_row) check_positions(op, positions_SB, S, B);
  const int64_t W = N * spec.head_dim;
  const std::initializer_list<detail::RowOperand> rows = {
      {&out_SBNd, W, backward ? detail::RowUse::kInOut : detail::RowUse::kOut}, {&inp_SBNd, W, detail::RowUse::kIn}};
  if (detail::row_blocks_apply(rows)) {
    // Blocks of token rows, each as S = rows, B = 1 with its rows' positions: the kernels' cos / sin are a function
    // of the position alone, so the values are the whole call's.
    detail::run_row_blocks(S * B, rows, [&](const int64_t r0, const int64_t r1, float* const* p) {
      std::vector<int64_t> positions(static_cast<size_t>(r1 - r0));
      for (int64_t r = r0; r < r1; ++r) {
        positions[static_cast<size_t>(r - r0)] =
            by_row ? positions_SB[static_cast<size_t>(r)] : r / B + position_offset;
      }
      if (backward) {
        kernels::cpu::rope_backward(p[0], p[1], r1 - r0, 1, N, spec, positions.data());
      } else {
        kernels::cpu::rope_forward(p[0], p[1], r1 - r0, 1, N, spec, positions.data());
      }
    });
    detail::round_activations({&out_SBNd});
    return;
  }
  detail::Staging staging;
  if (!backward) staging.write_only(out_SBNd, {&inp_SBNd});
  detail::dispatch(op, inp_SBNd, [&]<typename T>(auto k) {
    if (backward && by_row) k.rope_backward(ptr<T>(out_SBNd), ptr<T>(inp_SBNd), S, B, N, spec, positions_SB.data());
    if (backward && !by_row) k.rope_backward(ptr<T>(out_SBNd), ptr<T>(inp_SBNd), S, B, N, spec, position_offset);
    if (!backward && by_row) k.rope_forward(ptr<T>(out_SBNd), ptr<T>(inp_SBNd), S, B, N, spec, positions_SB.data());
    if (!backward && !by_row) k.rope_forward(ptr<T>(out_SBNd), ptr<T>(inp_SBNd), S, B, N, spec, position_offset);
  });
  detail::round_activations({&out_SBNd});
}

}  // namespace

void rope_forward(Tensor& out_SBNd, const Tensor& inp_SBNd, const int64_t S, const int64_t B, const int64_t head_dim,
                  const int64_t rot_dim, const double base, const int64_t position_offset) {
  rope("rope_forward", false, out_SBNd, inp_SBNd, S, B, kernels::rope_spec(head_dim, rot_dim, base), {},
       position_offset);
}

void rope_backward(Tensor& dinp_SBNd, const Tensor& dout_SBNd, const int64_t S, const int64_t B, const int64_t head_dim,
                   const int64_t rot_dim, const double base, const int64_t position_offset) {
  rope("rope_backward", true, dinp_SBNd, dout_SBNd, S, B, kernels::rope_spec(head_dim, rot_dim, base), {},
       position_offset);
}

void rope_forward(Tensor& out_SBNd, const Tensor& inp_SBNd, const int64_t S, const int64_t B, const int64_t head_dim,
                  const int64_t rot_dim, const double base, const std::span<const int64_t> positions_SB) {
  check_positions("rope_forward", positions_SB, S, B);
  rope("rope_forward", false, out_SBNd, inp_SBNd, S, B, kernels::rope_spec(head_dim, rot_dim, base), positions_SB, 0);
}

void rope_backward(Tensor& dinp_SBNd, const Tensor& dout_SBNd, const int64_t S, const int64_t B, const int64_t head_dim,
                   const int64_t rot_dim, const double base, const std::span<const int64_t> positions_SB) {
  check_positions("rope_backward", positions_SB, S, B);
  rope("rope_backward", true, dinp_SBNd, dout_SBNd, S, B, kernels::rope_spec(head_dim, rot_dim, base), positions_SB, 0);
}

void rope_forward(Tensor& out_SBNd, const Tensor& inp_SBNd, const int64_t S, const int64_t B, const RopeSpec& spec,
                  const std::span<const int64_t> positions_SB) {
  check_positions("rope_forward", positions_SB, S, B);
  rope("rope_forward", false, out_SBNd, inp_SBNd, S, B, spec, positions_SB, 0);
}

void rope_backward(Tensor& dinp_SBNd, const Tensor& dout_SBNd, const int64_t S, const int64_t B, const RopeSpec& spec,
                   const std::span<const int64_t> positions_SB) {
  check_positions("rope_backward", positions_SB, S, B);
  rope("rope_backward", true, dinp_SBNd, dout_SBNd, S, B, spec, positions_SB, 0);
}

}  // namespace moecore::ops
