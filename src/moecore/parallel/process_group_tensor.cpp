// The Tensor forms of ProcessGroup's collectives: checks, then the span form of the tensor's element type.
#include <string>

#include "moecore/parallel/process_group.h"

namespace moecore::parallel {
namespace {

// What the tensors of one call are used for: a reduction sums or compares values, a move copies bits.
enum class Use : uint8_t { kReduce, kMove };

// The tensor's device must let the host (MPI) read and write its memory.
void check_host(const char* op, const Tensor& t, const char* name) {
  if (!t.defined()) throw CommError(std::string(op) + ": the " + name + " tensor is undefined");
  if (!host_accessible(t.device())) {
    throw CommError(std::string(op) + ": the " + name + " tensor is on device " + std::string(device_name(t.device())) +
                    ", but collectives move host memory only (no device-aware transport in this build)");
  }
}

void check_same_dtype(const char* op, const Tensor& input, const Tensor& output) {
  if (input.dtype() != output.dtype()) {
    throw CommError(std::string(op) + ": input is " + std::string(dtype_name(input.dtype())) + " but output is " +
                    std::string(dtype_name(output.dtype())));
  }
}

void check_numel(const char* op, const Tensor& t, const char* name, const int64_t expected) {
  if (t.numel() != expected) {
    throw CommError(std::string(op) + ": the " + name + " tensor has " + std::to_string(t.numel()) +
                    " elements, expected " + std::to_string(expected));
  }
}

// Calls fn(T{}) with the communication element type of `dtype`: float, bf16 bits, integers; for moves also fp16
// bits and fp64 as 8-byte integers (bit for bit).
template <typename Fn>
decltype(auto) with_element(const char* op, const DType dtype, const Use use, Fn&& fn) {
  switch (dtype) {
    case DType::kF32: return fn(float{});
    case DType::kBF16: return fn(uint16_t{});
    case DType::kI32: return fn(int32_t{});
    case DType::kI64: return fn(int64_t{});
    case DType::kU8: return fn(uint8_t{});
    case DType::kF16:
      if (use == Use::kMove) return fn(uint16_t{});
      break;
    case DType::kF64:
      if (use == Use::kMove) return fn(int64_t{});
      break;
    default: break;
  }
  throw CommError(std::string(op) + ": no " + (use == Use::kReduce ? "reduction" : "transfer") + " of " +
                  std::string(dtype_name(dtype)) + " tensors");
}

template <typename T>
std::span<T> elements(Tensor& t) {
  return {t.data<T>(), static_cast<size_t>(t.numel())};
}
template <typename T>
std::span<const T> elements(const Tensor& t) {
  return {t.data<T>(), static_cast<size_t>(t.numel())};
}

// Both on a host device, of one dtype.
void check_input_output(const char* op, const Tensor& input, const Tensor& output) {
  check_host(op, input, "input");
  check_host(op, output, "output");
  check_same_dtype(op, input, output);
}

// input.numel() == size x output.numel() (reduce-scatter) or output.numel() == size x input.numel() (all-gather).
void check_chunks(const char* op, const Tensor& whole, const char* whole_name, const Tensor& chunk, const int size) {
  check_numel(op, whole, whole_name, chunk.numel() * size);
}

}  // namespace

void ProcessGroup::all_reduce(Tensor& data, const ReduceOp op) const {
  check_host("all_reduce", data, "data");
  with_element("all_reduce", data.dtype(), Use::kReduce, [&]<typename T>(T) { all_reduce<T>(elements<T>(data), op); });
}

Work ProcessGroup::all_reduce_async(Tensor& data, const ReduceOp op) const {
  check_host("all_reduce_async", data, "data");
  return with_element("all_reduce_async", data.dtype(), Use::kReduce,
                      [&]<typename T>(T) { return all_reduce_async<T>(elements<T>(data), op); });
}

void ProcessGroup::reduce_scatter(const Tensor& input, Tensor& output, const ReduceOp op) const {
  constexpr const char* name = "reduce_scatter";
  check_input_output(name, input, output);
  check_chunks(name, input, "input", output, size_);
  with_element(name, input.dtype(), Use::kReduce,
               [&]<typename T>(T) { reduce_scatter<T>(elements<T>(input), elements<T>(output), op); });
}

Work ProcessGroup::reduce_scatter_async(const Tensor& input, Tensor& output, const ReduceOp op) const {
  constexpr const char* name = "reduce_scatter_async";
  check_input_output(name, input, output);
  check_chunks(name, input, "input", output, size_);
  return with_element(name, input.dtype(), Use::kReduce, [&]<typename T>(T) {
    return reduce_scatter_async<T>(elements<T>(input), elements<T>(output), op);
  });
}

void ProcessGroup::all_gather(const Tensor& input, Tensor& output) const {
  constexpr const char* name = "all_gather";
  check_input_output(name, input, output);
  check_chunks(name, output, "output", input, size_);
  with_element(name, input.dtype(), Use::kMove,
               [&]<typename T>(T) { all_gather<T>(elements<T>(input), elements<T>(output)); });
}

Work ProcessGroup::all_gather_async(const Tensor& input, Tensor& output) const {
  constexpr const char* name = "all_gather_async";
  check_input_output(name, input, output);
  check_chunks(name, output, "output", input, size_);
  return with_element(name, input.dtype(), Use::kMove,
                      [&]<typename T>(T) { return all_gather_async<T>(elements<T>(input), elements<T>(output)); });
}

void ProcessGroup::all_to_all_v(const Tensor& input, const std::span<const size_t> send_counts, Tensor& output,
                                const std::span<const size_t> recv_counts) const {
  constexpr const char* name = "all_to_all_v";
  check_input_output(name, input, output);
  with_element(name, input.dtype(), Use::kMove, [&]<typename T>(T) {
    all_to_all_v<T>(elements<T>(input), send_counts, elements<T>(output), recv_counts);
  });
}

Work ProcessGroup::all_to_all_v_async(const Tensor& input, const std::span<const size_t> send_counts, Tensor& output,
                                      const std::span<const size_t> recv_counts) const {
  constexpr const char* name = "all_to_all_v_async";
  check_input_output(name, input, output);
  return with_element(name, input.dtype(), Use::kMove, [&]<typename T>(T) {
    return all_to_all_v_async<T>(elements<T>(input), send_counts, elements<T>(output), recv_counts);
  });
}

void ProcessGroup::broadcast(Tensor& data, const int root) const {
  check_host("broadcast", data, "data");
  with_element("broadcast", data.dtype(), Use::kMove, [&]<typename T>(T) { broadcast<T>(elements<T>(data), root); });
}

void ProcessGroup::send(const Tensor& data, const int dst, const int tag) const {
  check_host("send", data, "data");
  with_element("send", data.dtype(), Use::kMove, [&]<typename T>(T) { send<T>(elements<T>(data), dst, tag); });
}

void ProcessGroup::recv(Tensor& data, const int src, const int tag) const {
  check_host("recv", data, "data");
  with_element("recv", data.dtype(), Use::kMove, [&]<typename T>(T) { recv<T>(elements<T>(data), src, tag); });
}

Work ProcessGroup::send_async(const Tensor& data, const int dst, const int tag) const {
  check_host("send_async", data, "data");
  return with_element("send_async", data.dtype(), Use::kMove,
                      [&]<typename T>(T) { return send_async<T>(elements<T>(data), dst, tag); });
}

Work ProcessGroup::recv_async(Tensor& data, const int src, const int tag) const {
  check_host("recv_async", data, "data");
  return with_element("recv_async", data.dtype(), Use::kMove,
                      [&]<typename T>(T) { return recv_async<T>(elements<T>(data), src, tag); });
}

namespace {

void check_16bit(const char* op, const Tensor& t) {
  if (t.dtype() != DType::kBF16 && t.dtype() != DType::kF16) {
    throw CommError(std::string(op) + ": 16-bit sums need a bfloat16 or float16 tensor, got " +
                    std::string(dtype_name(t.dtype())));
  }
}

}  // namespace

Work ProcessGroup::all_reduce_16bit_async(Tensor& data) const {
  constexpr const char* name = "all_reduce_16bit_async";
  check_host(name, data, "data");
  check_16bit(name, data);
  return all_reduce_16bit_async(elements<uint16_t>(data), data.dtype());
}

Work ProcessGroup::reduce_scatter_16bit_async(const Tensor& input, Tensor& output) const {
  constexpr const char* name = "reduce_scatter_16bit_async";
  check_input_output(name, input, output);
  check_16bit(name, input);
  check_chunks(name, input, "input", output, size_);
  return reduce_scatter_16bit_async(elements<uint16_t>(input), elements<uint16_t>(output), input.dtype());
}

}  // namespace moecore::parallel
