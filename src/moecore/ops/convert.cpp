#include "moecore/ops/convert.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "moecore/kernels/cpu/convert.h"
#include "moecore/kernels/cpu/vector_isa.h"
#include "moecore/ops/dispatch.h"

namespace moecore::ops {
namespace {

bool is_float(const DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kBF16 || dtype == DType::kF16;
}

// One device's conversions, widening and narrowing through fp32 / fp64 as the pair needs.
// fp32 <-> fp64 arrays from this size on both threads (the router's [tokens, experts] scores at many experts).
constexpr int64_t kParallelElements = 65536;

// fp32 <-> fp64 over one thread's slice, in the CPU's widest vectors (elementwise: the same values in any width).
MOECORE_VECTOR_CLONES void narrow_slice(float* out, const double* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}
MOECORE_VECTOR_CLONES void widen_slice(double* out, const float* in, const int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(in[i]);
}

// slice(out + begin, in + begin, end - begin) over one contiguous slice per thread.
template <typename Out, typename In>
void in_slices(Out* out, const In* in, const int64_t n, void (*slice)(Out*, const In*, int64_t)) {
#pragma omp parallel if (n > kParallelElements)
  {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t begin = n * thread / threads, end = n * (thread + 1) / threads;
    slice(out + begin, in + begin, end - begin);
  }
}

template <typename K>
struct Converter {
  template <typename Wide>
  static void encode(const DType dtype, uint16_t* out, const Wide* in, const int64_t n) {
    dtype == DType::kBF16 ? K::encode_bf16(out, in, n) : K::encode_fp16(out, in, n);
  }
  template <typename Wide>
  static void decode(const DType dtype, Wide* out, const uint16_t* in, const int64_t n) {
    dtype == DType::kBF16 ? K::decode_bf16(out, in, n) : K::decode_fp16(out, in, n);
  }

  static void run(Tensor& dst, const Tensor& src) {
    const int64_t n = src.numel();
    const DType from = src.dtype(), to = dst.dtype();
    const bool low_from = dtype_size(from) == 2, low_to = dtype_size(to) == 2;
    if (from == to) {
      if (n > 0) std::memcpy(dst.data<std::byte>(), src.data<std::byte>(), src.nbytes());
    } else if (from == DType::kF64 && to == DType::kF32) {
      in_slices(dst.data<float>(), src.data<double>(), n, narrow_slice);
    } else if (from == DType::kF32 && to == DType::kF64) {
      in_slices(dst.data<double>(), src.data<float>(), n, widen_slice);
    } else if (low_to && !low_from) {
      from == DType::kF32 ? encode(to, dst.data<uint16_t>(), src.data<float>(), n)
                          : encode(to, dst.data<uint16_t>(), src.data<double>(), n);
    } else if (low_from && !low_to) {
      to == DType::kF32 ? decode(from, dst.data<float>(), src.data<uint16_t>(), n)
                        : decode(from, dst.data<double>(), src.data<uint16_t>(), n);
    } else {  // bf16 <-> fp16: exact to fp32, then one rounding
      constexpr int64_t kChunk = 1 << 14;
      std::vector<float> wide(static_cast<size_t>(std::min(n, kChunk)));
      for (int64_t begin = 0; begin < n; begin += kChunk) {
        const int64_t len = std::min(kChunk, n - begin);
        decode(from, wide.data(), src.data<uint16_t>() + begin, len);
        encode(to, dst.data<uint16_t>() + begin, wide.data(), len);
      }
    }
  }
};

}  // namespace

void convert(Tensor& dst, const Tensor& src) {
  constexpr const char* op = "convert";
  if (!dst.defined() || !src.defined()) detail::fail(op, "an argument tensor is undefined");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dst, &src}) {
    if (!is_float(t->dtype())) detail::fail(op, "unsupported dtype " + std::string(dtype_name(t->dtype())));
  }
  if (dst.device() != src.device()) {
    detail::fail(op, "tensors on different devices (" + std::string(device_name(dst.device())) + ", " +
                         std::string(device_name(src.device())) + ")");
  }
  detail::check_numel(op, "dst", dst, src.numel());
  detail::with_kernels(op, dst.device(), [&](auto kernels) { Converter<decltype(kernels)>::run(dst, src); });
}

}  // namespace moecore::ops
