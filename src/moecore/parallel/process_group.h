// ProcessGroup: a set of ranks over one MPI communicator, with blocking and non-blocking collectives and
// point-to-point transfers on fp32, bf16 and integer buffers.
//
// Element types: float (fp32), uint16_t, which always holds bf16 bits, and int32_t / int64_t (MPI_INT32_T /
// MPI_INT64_T: counts and indices travel exactly, integer reductions are exact). bf16 reductions are computed in
// fp32 (the buffer is widened, reduced, and rounded once at the end), so a bf16 sum equals the fp32 sum of the bf16
// inputs rounded to bf16. Data movement (gather, all-to-all, broadcast, send/recv) copies bf16 bits unchanged.
//
// Agreement checks (opt-in, off by default): with them on, before each collective the ranks exchange a small
// signature (operation, dtype, counts, root, and whether each rank's arguments are locally valid), so mismatched
// sizes or operations raise CommError on every rank instead of hanging or corrupting memory, and a collective that
// throws this way leaves the group usable. They cost one extra blocking all-reduce per collective (which also
// serialises the non-blocking ones), so they are for debugging: MOECORE_CHECK_COLLECTIVES=1 in the environment
// turns them on for every group (read once per process), set_agreement_checks() for one group handle. Every rank
// of a group must use the same setting. With them off, arguments that are invalid on this rank (counts that do not
// fit the buffers) still raise CommError, on this rank only.
// MPI errors are returned (MPI_ERRORS_RETURN), not fatal, and surface as CommError with MPI's error string.
// Every wait (blocking collectives run as their non-blocking MPI forms plus a wait; Work::wait) is bounded by the
// collective timeout of watchdog.h when one is set: a wait that passes it prints one line naming the operation, the
// group and the ranks that did not arrive, and ends the job (MPI_Abort). split() is not bounded (MPI has no
// non-blocking split).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moecore/parallel/mpi_runtime.h"
#include "moecore/tensor/dtype.h"
#include "moecore/tensor/tensor.h"

namespace moecore::parallel {

// uint16_t always holds bf16 bits; int32_t / int64_t are integers (counts, indices), reduced exactly; uint8_t are
// bytes (FP8 / FP4 codes), gathered and moved, reduced as unsigned integers.
template <typename T>
concept CommElement = std::same_as<T, float> || std::same_as<T, uint16_t> || std::same_as<T, int32_t> ||
    std::same_as<T, int64_t> || std::same_as<T, uint8_t>;

enum class ReduceOp : uint8_t { kSum, kMax };

// Handle of a non-blocking operation. The buffers passed to the operation must stay alive and untouched until
// wait() returns. wait() rethrows the operation's failure as CommError; the destructor waits too (and swallows
// errors), so a dropped handle never leaves MPI writing into freed memory.
class Work {
 public:
  struct State;
  Work();  // an already completed operation
  explicit Work(std::unique_ptr<State> state);
  Work(Work&&) noexcept;
  Work& operator=(Work&&) noexcept;
  ~Work();

  void wait();
  bool test();  // true once complete (finishing it as wait() does); also drives MPI progress
  bool done() const;
  // Names the operation on the timeline's "comm in flight" track (--profile), where each non-blocking operation
  // is an event from its start to the moment its completion was seen (a wait, a test or drive_progress()).
  void trace_as(std::string name);

 private:
  std::unique_ptr<State> state_;
};

// Lets the non-blocking operations in flight advance while the caller computes. Open MPI moves a non-blocking
// collective (its rounds, a rendezvous transfer) only inside MPI calls, so a collective started before a long
// computation would otherwise make no progress until its wait. Tests every operation in flight (completing those
// that are done); with none in flight it costs one load and makes no MPI call. Compute code calls it between its
// large steps (the parallel linear layers after each GEMM, the data-parallel hooks after each module's backward).
// Training thread only.
void drive_progress();
// Number of non-blocking operations started and not yet seen complete (tests).
int operations_in_flight();

class ProcessGroup {
 public:
  struct Comm;

  // All processes (a duplicate of MPI_COMM_WORLD). Initializes MPI if no MpiRuntime did.
  static ProcessGroup world();
  // A group of this process alone, without MPI (a run started without mpirun): collectives are local copies.
  static ProcessGroup self();

  // Collective over this group: ranks with equal color form a sub-group, ordered by key then by rank here.
  // color must be >= 0. The sub-group inherits this handle's agreement-check setting.
  ProcessGroup split(int color, int key) const;
  // Collective: the ranks of this group that share memory with this one (MPI_Comm_split_type SHARED), by rank here.
  ProcessGroup split_shared_memory() const;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The group's name in watchdog reports ("dp", "tp", ...), shared by every handle of the communicator: "world",
  // a split "<parent>/<color>" until named, "self" for the single-process group.
  std::string name() const;
  void set_name(std::string name) const;

  // Agreement checks of this handle (and of groups split from it afterwards); world() starts from
  // MOECORE_CHECK_COLLECTIVES, self() has nothing to check.
  bool agreement_checks() const { return checks_; }
  void set_agreement_checks(bool on) { checks_ = on; }

  void barrier() const;

  // In place: data becomes the element-wise reduction over the group.
  template <CommElement T>
  void all_reduce(std::span<T> data, ReduceOp op) const;
  // input holds size() equal chunks; rank r's output = reduction of every rank's chunk r.
  template <CommElement T>
  void reduce_scatter(std::span<const T> input, std::span<T> output, ReduceOp op) const;
  // Every rank contributes input (same count everywhere); output = concatenation in rank order.
  template <CommElement T>
  void all_gather(std::span<const T> input, std::span<T> output) const;
  // send_counts[d] elements of input (in rank order) go to rank d; recv_counts[s] elements from rank s land in
  // output in rank order. Zero counts are allowed. recv_counts must match what the peers send.
  template <CommElement T>
  void all_to_all_v(std::span<const T> input, std::span<const size_t> send_counts, std::span<T> output,
                    std::span<const size_t> recv_counts) const;
  // The recv_counts that all_to_all_v needs for these send_counts (an all-to-all of the counts).
  std::vector<size_t> exchange_counts(std::span<const size_t> send_counts) const;
  template <CommElement T>
  void broadcast(std::span<T> data, int root) const;

  // Point to point; recv throws when the message length differs from data.size().
  template <CommElement T>
  void send(std::span<const T> data, int dst, int tag = 0) const;
  template <CommElement T>
  void recv(std::span<T> data, int src, int tag = 0) const;

  // Non-blocking point to point (the pipeline's activations and gradients): the receive's wait throws when the
  // message length differs from data.size(). Messages between two ranks with one tag arrive in posting order.
  template <CommElement T>
  Work send_async(std::span<const T> data, int dst, int tag = 0) const;
  template <CommElement T>
  Work recv_async(std::span<T> data, int src, int tag = 0) const;

  // Non-blocking versions; argument checks run (and throw) before returning.
  template <CommElement T>
  Work all_reduce_async(std::span<T> data, ReduceOp op) const;
  template <CommElement T>
  Work reduce_scatter_async(std::span<const T> input, std::span<T> output, ReduceOp op) const;
  // Sums of 16-bit floats reduced in 16 bits on the wire (format kBF16 or kF16 bits in uint16_t): every partial sum
  // is rounded to the format, as NCCL reduces 16-bit buffers (Megatron's --grad-reduce-in-bf16, fp16 gradients), so
  // half the bytes of fp32 travel and the result depends on the reduction order of the MPI library.
  Work all_reduce_16bit_async(std::span<uint16_t> data, DType format) const;
  Work reduce_scatter_16bit_async(std::span<const uint16_t> input, std::span<uint16_t> output, DType format) const;
  template <CommElement T>
  Work all_gather_async(std::span<const T> input, std::span<T> output) const;
  template <CommElement T>
  Work all_to_all_v_async(std::span<const T> input, std::span<const size_t> send_counts, std::span<T> output,
                          std::span<const size_t> recv_counts) const;

  // Tensor forms of the collectives above, on a tensor's whole storage (tensors are always contiguous): the
  // element type follows the dtype (kF32 float, kBF16 bf16 bits, kI32, kI64, kU8; data movement also takes kF16
  // and kF64, moved bit for bit). The tensors of one call share a dtype and sizes as the span forms need them
  // (numel for counts); a dtype a reduction cannot sum, unequal dtypes, wrong sizes or a tensor outside host memory
  // (kCUDA: no device-aware transport in this build) raise CommError naming the operation. As with spans, an
  // async form's tensors must stay alive and untouched until its wait() returns.
  void all_reduce(Tensor& data, ReduceOp op) const;
  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op) const;
  void all_gather(const Tensor& input, Tensor& output) const;
  void all_to_all_v(const Tensor& input, std::span<const size_t> send_counts, Tensor& output,
                    std::span<const size_t> recv_counts) const;
  void broadcast(Tensor& data, int root) const;
  void send(const Tensor& data, int dst, int tag = 0) const;
  void recv(Tensor& data, int src, int tag = 0) const;
  Work send_async(const Tensor& data, int dst, int tag = 0) const;
  Work recv_async(Tensor& data, int src, int tag = 0) const;
  Work all_reduce_async(Tensor& data, ReduceOp op) const;
  Work reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) const;
  Work all_gather_async(const Tensor& input, Tensor& output) const;
  Work all_to_all_v_async(const Tensor& input, std::span<const size_t> send_counts, Tensor& output,
                          std::span<const size_t> recv_counts) const;
  // The 16-bit wire sums above on kBF16 / kF16 tensors: the format is the tensor's dtype.
  Work all_reduce_16bit_async(Tensor& data) const;
  Work reduce_scatter_16bit_async(const Tensor& input, Tensor& output) const;

 private:
  friend class SharedWindow;
  ProcessGroup(std::shared_ptr<Comm> comm, int rank, int size, bool checks);

  std::shared_ptr<Comm> comm_;
  int rank_ = 0;
  int size_ = 1;
  bool checks_ = false;
};

// MOECORE_CHECK_COLLECTIVES as read once from the environment: unset, empty or "0" is off, "1" on; any other
// value throws CommError naming the variable.
bool agreement_checks_from_environment();

// Sum over `group` of one double per rank, added in double precision in rank order, so every rank gets the same
// value (the collectives themselves reduce in fp32).
double sum_double(const ProcessGroup& group, double value);

}  // namespace moecore::parallel
