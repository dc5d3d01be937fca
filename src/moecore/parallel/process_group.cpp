#include "moecore/parallel/process_group.h"

#define OMPI_SKIP_MPICXX 1  // the C API only: OpenMPI's deprecated C++ bindings warn under -Wextra
#include <mpi.h>

#include <algorithm>
#include <array>
#include <bit>
#include <climits>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>

#include "moecore/tensor/dtype.h"
#include "moecore/util/trace.h"

namespace moecore::parallel {

struct ProcessGroup::Comm {
  MPI_Comm handle = MPI_COMM_NULL;
  explicit Comm(MPI_Comm comm) : handle(comm) {}
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  ~Comm() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && handle != MPI_COMM_NULL) MPI_Comm_free(&handle);
  }
};

struct Work::State {
  MPI_Request request = MPI_REQUEST_NULL;
  std::string what;                // operation name for error messages
  std::vector<float> staging_in;   // bf16 widened to fp32
  std::vector<float> staging_out;  // fp32 result to round into the bf16 output
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
  std::function<void()> finish;  // runs once the request completed
  bool done = false;
  std::string trace_name;     // the timeline's name for it; `what` when empty
  bool track_status = false;  // keep the completion status (a receive's length check)
  MPI_Status status{};
  trace::Clock::time_point started = trace::Clock::now();
};

namespace {

// Operation codes exchanged in the agreement check; blocking and non-blocking collectives do not match in MPI, so
// they get distinct codes.
enum OpCode : int64_t {
  kAllReduce = 1,
  kReduceScatter,
  kAllGather,
  kAllToAllV,
  kAllToAllVCounts,
  kExchangeCounts,
  kBroadcast,
  kBarrier,
  kSplit,
  kAllReduceAsync,
  kReduceScatterAsync,
  kAllGatherAsync,
  kAllToAllVAsync,
  kAllReduce16Async,
  kReduceScatter16Async,
};

const char* op_name(int64_t code) {
  switch (code) {
    case kAllReduce: return "all_reduce";
    case kReduceScatter: return "reduce_scatter";
    case kAllGather: return "all_gather";
    case kAllToAllV: return "all_to_all_v";
    case kAllToAllVCounts: return "all_to_all_v";
    case kExchangeCounts: return "exchange_counts";
    case kBroadcast: return "broadcast";
    case kBarrier: return "barrier";
    case kSplit: return "split";
    case kAllReduceAsync: return "all_reduce_async";
    case kReduceScatterAsync: return "reduce_scatter_async";
    case kAllGatherAsync: return "all_gather_async";
    case kAllToAllVAsync: return "all_to_all_v_async";
    case kAllReduce16Async: return "all_reduce_16bit_async";
    case kReduceScatter16Async: return "reduce_scatter_16bit_async";
    default: return "unknown operation";
  }
}

void check_mpi(int rc, const std::string& what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, text, &length);
  throw CommError(what + ": MPI error: " + std::string(text, static_cast<size_t>(length)));
}

template <typename T>
constexpr bool kIsBf16 = std::is_same_v<T, uint16_t>;

template <typename T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, float>) {
    return MPI_FLOAT;
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    return MPI_UINT16_T;
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return MPI_INT32_T;
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    return MPI_UINT8_T;
  } else {
    static_assert(std::is_same_v<T, int64_t>);
    return MPI_INT64_T;
  }
}

template <typename T>
int64_t dtype_code() {
  if constexpr (std::is_same_v<T, float>) {
    return 1;
  } else if constexpr (std::is_same_v<T, uint16_t>) {
    return 2;
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return 3;
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    return 5;
  } else {
    return 4;
  }
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::kSum ? MPI_SUM : MPI_MAX; }

std::vector<float> widen(std::span<const uint16_t> bits) {
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = bf16_to_fp32(bits[i]);
  return values;
}

void narrow(std::span<const float> values, std::span<uint16_t> bits) {
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = fp32_to_bf16(values[i]);
}

// MPI counts are int; an empty buffer may have a null data pointer, which some MPI paths reject.
float g_dummy_element = 0.0f;
template <typename T>
void* ptr_or_dummy(T* data) {
  return data != nullptr ? static_cast<void*>(data) : static_cast<void*>(&g_dummy_element);
}
template <typename T>
const void* ptr_or_dummy(const T* data) {
  return data != nullptr ? static_cast<const void*>(data) : static_cast<const void*>(&g_dummy_element);
}

std::string too_large(size_t n) {
  return "count " + std::to_string(n) + " exceeds MPI's int limit " + std::to_string(INT_MAX);
}

struct Field {
  const char* name;
  int64_t value;
};

// The agreement check: one MAX all-reduce of each field and its negation (so max == -min means agreement), plus
// the highest group rank whose arguments failed local validation. Throws the same kind of error on every rank.
// Without checks (`checked` false) only this rank's local error is raised, on this rank.
void verify(bool checked, MPI_Comm comm, int rank, int64_t op, std::initializer_list<Field> fields,
            const std::string& local_error) {
  if (!checked) {
    if (!local_error.empty())
      throw CommError(std::string(op_name(op)) + " on rank " + std::to_string(rank) + ": " + local_error);
    return;
  }
  std::vector<int64_t> values;
  values.reserve(2 * fields.size() + 3);
  values.push_back(op);
  values.push_back(-op);
  for (const Field& field : fields) {
    values.push_back(field.value);
    values.push_back(-field.value);
  }
  values.push_back(local_error.empty() ? 0 : rank + 1);
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_INT64_T, MPI_MAX, comm),
            std::string(op_name(op)) + ": agreement check");
  const std::string name = op_name(op);
  if (values[0] != -values[1]) {
    throw CommError(name + ": ranks called different collectives (" + op_name(-values[1]) + " vs " +
                    op_name(values[0]) + ") on the same group");
  }
  if (!local_error.empty()) throw CommError(name + " on rank " + std::to_string(rank) + ": " + local_error);
  if (values.back() > 0) {
    throw CommError(name + ": rank " + std::to_string(values.back() - 1) + " passed invalid arguments (see its error)");
  }
  size_t index = 2;
  for (const Field& field : fields) {
    const int64_t max = values[index], min = -values[index + 1];
    if (min != max) {
      throw CommError(name + ": ranks disagree on " + field.name + " (min " + std::to_string(min) + ", max " +
                      std::to_string(max) + ")");
    }
    index += 2;
  }
}

// Validates that counts sized group_size sum to buffer_size and fit MPI's int; returns an error or "".
std::string check_split(std::span<const size_t> counts, size_t buffer_size, int group_size, const char* which,
                        std::vector<int>& counts_out, std::vector<int>& displs_out) {
  if (counts.size() != static_cast<size_t>(group_size)) {
    return std::string(which) + " has " + std::to_string(counts.size()) + " entries, expected the group size " +
           std::to_string(group_size);
  }
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  if (total != buffer_size) {
    return std::string(which) + " sum to " + std::to_string(total) + " but the buffer has " +
           std::to_string(buffer_size) + " elements";
  }
  if (total > static_cast<size_t>(INT_MAX)) return too_large(total);
  counts_out.resize(counts.size());
  displs_out.resize(counts.size());
  int offset = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    counts_out[i] = static_cast<int>(counts[i]);
    displs_out[i] = offset;
    offset += counts_out[i];
  }
  return "";
}

}  // namespace

// ---------------------------------------------------------------- Work

namespace {

// The operations started and not yet seen complete, in start order (non-owning: a Work removes its state when it
// completes, and completes before its state is destroyed).
std::vector<Work::State*>& in_flight() {
  static std::vector<Work::State*> states;
  return states;
}

void forget(const Work::State* state) {
  auto& states = in_flight();
  const auto it = std::find(states.begin(), states.end(), state);
  if (it != states.end()) states.erase(it);
}

// Marks the state complete: leaves the in-flight list, runs its finish step, records it on the timeline.
void complete(Work::State& state) {
  state.done = true;
  forget(&state);
  if (state.finish) state.finish();
  if (trace::enabled()) {
    trace::record_on_track("comm in flight", state.trace_name.empty() ? state.what : state.trace_name, "comm",
                           state.started, trace::Clock::now());
  }
}

// MPI_Test on the state; true when it completed (finished by complete()).
bool test_state(Work::State& state) {
  int complete_flag = 0;
  const int rc = MPI_Test(&state.request, &complete_flag, state.track_status ? &state.status : MPI_STATUS_IGNORE);
  if (rc != MPI_SUCCESS) {
    state.done = true;
    forget(&state);
  }
  check_mpi(rc, state.what);
  if (!complete_flag) return false;
  complete(state);
  return true;
}

}  // namespace

void drive_progress() {
  auto& states = in_flight();
  if (states.empty()) return;
  const std::vector<Work::State*> snapshot = states;  // completing one removes it from the list
  for (Work::State* state : snapshot) test_state(*state);
}

int operations_in_flight() { return static_cast<int>(in_flight().size()); }

Work::Work() = default;
Work::Work(std::unique_ptr<State> state) : state_(std::move(state)) {
  if (state_ && !state_->done) in_flight().push_back(state_.get());
}
Work::Work(Work&&) noexcept = default;
Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    try {
      wait();
    } catch (const CommError&) {
    }
    state_ = std::move(other.state_);
  }
  return *this;
}
Work::~Work() {
  try {
    wait();
  } catch (...) {  // a destructor must not throw; call wait() to see errors
  }
  if (state_) forget(state_.get());
}

bool Work::done() const { return !state_ || state_->done; }

void Work::trace_as(std::string name) {
  if (state_) state_->trace_name = std::move(name);
}

void Work::wait() {
  if (done()) return;
  State& state = *state_;
  int finalized = 0;
  MPI_Finalized(&finalized);
  const int rc =
      finalized ? MPI_SUCCESS : MPI_Wait(&state.request, state.track_status ? &state.status : MPI_STATUS_IGNORE);
  if (finalized || rc != MPI_SUCCESS) {
    state.done = true;
    forget(&state);
  }
  if (finalized) throw CommError(state.what + ": MPI was finalized before the operation was waited on");
  check_mpi(rc, state.what);
  complete(state);
}

bool Work::test() {
  if (done()) return true;
  return test_state(*state_);
}

// ---------------------------------------------------------------- ProcessGroup

namespace {

// The single-process group (no communicator): collectives are copies, checked like the MPI ones.
void self_check(const bool ok, const char* what) {
  if (!ok) throw CommError(what);
}

template <typename T>
void self_copy(std::span<const T> input, std::span<T> output, const char* what) {
  if (input.size() != output.size()) {
    throw CommError(std::string(what) + ": input has " + std::to_string(input.size()) + " elements, output " +
                    std::to_string(output.size()) + " (group of 1)");
  }
  std::copy(input.begin(), input.end(), output.begin());
}

template <typename T>
void self_all_to_all(std::span<const T> input, std::span<const size_t> send_counts, std::span<T> output,
                     std::span<const size_t> recv_counts) {
  if (send_counts.size() != 1 || recv_counts.size() != 1 || send_counts[0] != input.size() ||
      recv_counts[0] != send_counts[0]) {
    throw CommError("all_to_all_v: counts disagree with the buffers in a group of 1");
  }
  self_copy(input, output, "all_to_all_v");
}

}  // namespace

ProcessGroup ProcessGroup::self() { return ProcessGroup(nullptr, 0, 1, false); }

ProcessGroup::ProcessGroup(std::shared_ptr<Comm> comm, int rank, int size, bool checks)
    : comm_(std::move(comm)), rank_(rank), size_(size), checks_(checks) {}

bool agreement_checks_from_environment() {
  static const bool enabled = [] {
    const char* value = std::getenv("MOECORE_CHECK_COLLECTIVES");
    const std::string text = value == nullptr ? "" : value;
    if (text.empty() || text == "0") return false;
    if (text == "1") return true;
    throw CommError("MOECORE_CHECK_COLLECTIVES must be 0 or 1, got '" + text + "'");
  }();
  return enabled;
}

ProcessGroup ProcessGroup::world() {
  MpiRuntime::ensure_initialized();
  const bool checks = agreement_checks_from_environment();
  static const ProcessGroup world_group = [checks] {
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm dup = MPI_COMM_NULL;
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "world: MPI_Comm_dup");
    auto comm = std::make_shared<Comm>(dup);
    MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    MPI_Comm_rank(dup, &rank);
    MPI_Comm_size(dup, &size);
    return ProcessGroup(std::move(comm), rank, size, checks);
  }();
  return world_group;
}

ProcessGroup ProcessGroup::split(int color, int key) const {
  if (!comm_) return self_check(color >= 0, "split: color is negative"), *this;
  const std::string local_error = color < 0 ? "color " + std::to_string(color) + " is negative" : "";
  verify(checks_, comm_->handle, rank_, kSplit, {}, local_error);
  MPI_Comm sub = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(comm_->handle, color, key, &sub), "split");
  auto comm = std::make_shared<Comm>(sub);
  MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(sub, &rank);
  MPI_Comm_size(sub, &size);
  return ProcessGroup(std::move(comm), rank, size, checks_);
}

void ProcessGroup::barrier() const {
  if (!comm_) return;
  verify(checks_, comm_->handle, rank_, kBarrier, {}, "");
  check_mpi(MPI_Barrier(comm_->handle), "barrier");
}

template <CommElement T>
void ProcessGroup::all_reduce(std::span<T> data, ReduceOp op) const {
  if (!comm_) return;
  const std::string local_error = data.size() > INT_MAX ? too_large(data.size()) : "";
  verify(checks_, comm_->handle, rank_, kAllReduce,
         {{"dtype", dtype_code<T>()},
          {"reduce op", static_cast<int64_t>(op)},
          {"element count", static_cast<int64_t>(data.size())}},
         local_error);
  if (data.empty()) return;
  const int count = static_cast<int>(data.size());
  if constexpr (kIsBf16<T>) {
    std::vector<float> values = widen(data);
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, values.data(), count, MPI_FLOAT, mpi_op(op), comm_->handle), "all_reduce");
    narrow(values, data);
  } else {
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, data.data(), count, mpi_type<T>(), mpi_op(op), comm_->handle), "all_reduce");
  }
}

namespace {

std::string reduce_scatter_error(size_t input_size, size_t output_size, int group_size) {
  if (input_size != output_size * static_cast<size_t>(group_size)) {
    return "input has " + std::to_string(input_size) + " elements, expected output " + std::to_string(output_size) +
           " x group size " + std::to_string(group_size);
  }
  return input_size > INT_MAX ? too_large(input_size) : "";
}

std::string all_gather_error(size_t input_size, size_t output_size, int group_size) {
  if (output_size != input_size * static_cast<size_t>(group_size)) {
    return "output has " + std::to_string(output_size) + " elements, expected input " + std::to_string(input_size) +
           " x group size " + std::to_string(group_size);
  }
  return output_size > INT_MAX ? too_large(output_size) : "";
}

}  // namespace

template <CommElement T>
void ProcessGroup::reduce_scatter(std::span<const T> input, std::span<T> output, ReduceOp op) const {
  if (!comm_) return self_copy(input, output, "reduce_scatter");
  verify(checks_, comm_->handle, rank_, kReduceScatter,
         {{"dtype", dtype_code<T>()},
          {"reduce op", static_cast<int64_t>(op)},
          {"output element count", static_cast<int64_t>(output.size())}},
         reduce_scatter_error(input.size(), output.size(), size_));
  if (output.empty()) return;
  const int count = static_cast<int>(output.size());
  if constexpr (kIsBf16<T>) {
    const std::vector<float> values = widen(input);
    std::vector<float> reduced(output.size());
    check_mpi(MPI_Reduce_scatter_block(values.data(), reduced.data(), count, MPI_FLOAT, mpi_op(op), comm_->handle),
              "reduce_scatter");
    narrow(reduced, output);
  } else {
    check_mpi(MPI_Reduce_scatter_block(input.data(), output.data(), count, mpi_type<T>(), mpi_op(op), comm_->handle),
              "reduce_scatter");
  }
}

template <CommElement T>
void ProcessGroup::all_gather(std::span<const T> input, std::span<T> output) const {
  if (!comm_) return self_copy(input, output, "all_gather");
  verify(checks_, comm_->handle, rank_, kAllGather,
         {{"dtype", dtype_code<T>()}, {"element count per rank", static_cast<int64_t>(input.size())}},
         all_gather_error(input.size(), output.size(), size_));
  if (input.empty()) return;
  check_mpi(MPI_Allgather(input.data(), static_cast<int>(input.size()), mpi_type<T>(), output.data(),
                          static_cast<int>(input.size()), mpi_type<T>(), comm_->handle),
            "all_gather");
}

std::vector<size_t> ProcessGroup::exchange_counts(std::span<const size_t> send_counts) const {
  if (!comm_)
    return self_check(send_counts.size() == 1, "exchange_counts: send_counts must have 1 entry"),
           std::vector<size_t>(send_counts.begin(), send_counts.end());
  const std::string local_error = send_counts.size() == static_cast<size_t>(size_)
                                      ? ""
                                      : "send_counts has " + std::to_string(send_counts.size()) +
                                            " entries, expected the group size " + std::to_string(size_);
  verify(checks_, comm_->handle, rank_, kExchangeCounts, {}, local_error);
  std::vector<uint64_t> sent(send_counts.begin(), send_counts.end());
  std::vector<uint64_t> received(sent.size());
  check_mpi(MPI_Alltoall(sent.data(), 1, MPI_UINT64_T, received.data(), 1, MPI_UINT64_T, comm_->handle),
            "exchange_counts");
  return std::vector<size_t>(received.begin(), received.end());
}

namespace {

// Checks the splits locally, then that every rank's recv_counts match what its peers send; fills the int
// counts/displacements MPI needs. Collective; throws on every rank on any problem.
void prepare_all_to_all_v(bool checked, MPI_Comm comm, int rank, int size, int64_t op, int64_t dtype, size_t input_size,
                          std::span<const size_t> send_counts, size_t output_size, std::span<const size_t> recv_counts,
                          Work::State& state) {
  std::string local_error =
      check_split(send_counts, input_size, size, "send_counts", state.send_counts, state.send_displs);
  if (local_error.empty()) {
    local_error = check_split(recv_counts, output_size, size, "recv_counts", state.recv_counts, state.recv_displs);
  }
  verify(checked, comm, rank, op, {{"dtype", dtype}}, local_error);
  if (!checked) return;
  std::vector<int> peer_sends(static_cast<size_t>(size));
  check_mpi(MPI_Alltoall(state.send_counts.data(), 1, MPI_INT, peer_sends.data(), 1, MPI_INT, comm),
            std::string(op_name(op)) + ": count exchange");
  std::string mismatch;
  for (int src = 0; src < size && mismatch.empty(); ++src) {
    if (peer_sends[static_cast<size_t>(src)] != state.recv_counts[static_cast<size_t>(src)]) {
      mismatch = "recv_counts expects " + std::to_string(state.recv_counts[static_cast<size_t>(src)]) +
                 " elements from rank " + std::to_string(src) + ", which sends " +
                 std::to_string(peer_sends[static_cast<size_t>(src)]);
    }
  }
  verify(checked, comm, rank, kAllToAllVCounts, {}, mismatch);
}

}  // namespace

template <CommElement T>
void ProcessGroup::all_to_all_v(std::span<const T> input, std::span<const size_t> send_counts, std::span<T> output,
                                std::span<const size_t> recv_counts) const {
  if (!comm_) return self_all_to_all(input, send_counts, output, recv_counts);
  Work::State state;
  prepare_all_to_all_v(checks_, comm_->handle, rank_, size_, kAllToAllV, dtype_code<T>(), input.size(), send_counts,
                       output.size(), recv_counts, state);
  check_mpi(MPI_Alltoallv(ptr_or_dummy(input.data()), state.send_counts.data(), state.send_displs.data(), mpi_type<T>(),
                          ptr_or_dummy(output.data()), state.recv_counts.data(), state.recv_displs.data(),
                          mpi_type<T>(), comm_->handle),
            "all_to_all_v");
}

template <CommElement T>
void ProcessGroup::broadcast(std::span<T> data, int root) const {
  if (!comm_) return self_check(root == 0, "broadcast: root must be 0 in a single-process group");
  std::string local_error;
  if (root < 0 || root >= size_) {
    local_error = "root " + std::to_string(root) + " is outside the group of " + std::to_string(size_) + " ranks";
  } else if (data.size() > INT_MAX) {
    local_error = too_large(data.size());
  }
  verify(checks_, comm_->handle, rank_, kBroadcast,
         {{"dtype", dtype_code<T>()}, {"root", root}, {"element count", static_cast<int64_t>(data.size())}},
         local_error);
  if (data.empty()) return;
  check_mpi(MPI_Bcast(data.data(), static_cast<int>(data.size()), mpi_type<T>(), root, comm_->handle), "broadcast");
}

namespace {

std::string peer_error(int peer, int self, int size, const char* role) {
  if (peer < 0 || peer >= size) {
    return std::string(role) + " rank " + std::to_string(peer) + " is outside the group of " + std::to_string(size) +
           " ranks";
  }
  if (peer == self) return std::string(role) + " rank " + std::to_string(peer) + " is this rank (would deadlock)";
  return "";
}

}  // namespace

template <CommElement T>
void ProcessGroup::send(std::span<const T> data, int dst, int tag) const {
  if (!comm_) throw CommError("send: a single-process group has no peer");
  std::string error = peer_error(dst, rank_, size_, "destination");
  if (error.empty() && data.size() > INT_MAX) error = too_large(data.size());
  if (!error.empty()) throw CommError("send on rank " + std::to_string(rank_) + ": " + error);
  check_mpi(MPI_Send(ptr_or_dummy(data.data()), static_cast<int>(data.size()), mpi_type<T>(), dst, tag, comm_->handle),
            "send to rank " + std::to_string(dst));
}

template <CommElement T>
void ProcessGroup::recv(std::span<T> data, int src, int tag) const {
  if (!comm_) throw CommError("recv: a single-process group has no peer");
  std::string error = peer_error(src, rank_, size_, "source");
  if (error.empty() && data.size() > INT_MAX) error = too_large(data.size());
  if (!error.empty()) throw CommError("recv on rank " + std::to_string(rank_) + ": " + error);
  const std::string what = "recv on rank " + std::to_string(rank_) + " from rank " + std::to_string(src);
  MPI_Status status;
  check_mpi(MPI_Recv(ptr_or_dummy(data.data()), static_cast<int>(data.size()), mpi_type<T>(), src, tag, comm_->handle,
                     &status),
            what);
  int received = 0;
  check_mpi(MPI_Get_count(&status, mpi_type<T>(), &received), what);
  if (static_cast<size_t>(received) != data.size()) {
    throw CommError(what + ": message has " + std::to_string(received) + " elements, the buffer expects " +
                    std::to_string(data.size()));
  }
}

// ---------------------------------------------------------------- non-blocking

template <CommElement T>
Work ProcessGroup::send_async(std::span<const T> data, int dst, int tag) const {
  if (!comm_) throw CommError("send_async: a single-process group has no peer");
  std::string error = peer_error(dst, rank_, size_, "destination");
  if (error.empty() && data.size() > INT_MAX) error = too_large(data.size());
  if (!error.empty()) throw CommError("send_async on rank " + std::to_string(rank_) + ": " + error);
  auto state = std::make_unique<Work::State>();
  state->what = "send to rank " + std::to_string(dst);
  check_mpi(MPI_Isend(ptr_or_dummy(data.data()), static_cast<int>(data.size()), mpi_type<T>(), dst, tag, comm_->handle,
                      &state->request),
            state->what);
  return Work(std::move(state));
}

template <CommElement T>
Work ProcessGroup::recv_async(std::span<T> data, int src, int tag) const {
  if (!comm_) throw CommError("recv_async: a single-process group has no peer");
  std::string error = peer_error(src, rank_, size_, "source");
  if (error.empty() && data.size() > INT_MAX) error = too_large(data.size());
  if (!error.empty()) throw CommError("recv_async on rank " + std::to_string(rank_) + ": " + error);
  auto state = std::make_unique<Work::State>();
  state->what = "recv on rank " + std::to_string(rank_) + " from rank " + std::to_string(src);
  check_mpi(MPI_Irecv(ptr_or_dummy(data.data()), static_cast<int>(data.size()), mpi_type<T>(), src, tag, comm_->handle,
                      &state->request),
            state->what);
  state->track_status = true;
  state->finish = [what = state->what, expected = data.size(), status = &state->status] {
    int received = 0;
    check_mpi(MPI_Get_count(status, mpi_type<T>(), &received), what);
    if (static_cast<size_t>(received) != expected) {
      throw CommError(what + ": message has " + std::to_string(received) + " elements, the buffer expects " +
                      std::to_string(expected));
    }
  };
  return Work(std::move(state));
}

template <CommElement T>
Work ProcessGroup::all_reduce_async(std::span<T> data, ReduceOp op) const {
  if (!comm_) return Work();
  const std::string local_error = data.size() > INT_MAX ? too_large(data.size()) : "";
  verify(checks_, comm_->handle, rank_, kAllReduceAsync,
         {{"dtype", dtype_code<T>()},
          {"reduce op", static_cast<int64_t>(op)},
          {"element count", static_cast<int64_t>(data.size())}},
         local_error);
  if (data.empty()) return Work();
  auto state = std::make_unique<Work::State>();
  state->what = "all_reduce_async";
  const int count = static_cast<int>(data.size());
  if constexpr (kIsBf16<T>) {
    state->staging_in = widen(data);
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, state->staging_in.data(), count, MPI_FLOAT, mpi_op(op), comm_->handle,
                             &state->request),
              state->what);
    state->finish = [values = std::span<const float>(state->staging_in), data] { narrow(values, data); };
  } else {
    check_mpi(
        MPI_Iallreduce(MPI_IN_PLACE, data.data(), count, mpi_type<T>(), mpi_op(op), comm_->handle, &state->request),
        state->what);
  }
  return Work(std::move(state));
}

template <CommElement T>
Work ProcessGroup::reduce_scatter_async(std::span<const T> input, std::span<T> output, ReduceOp op) const {
  if (!comm_) return self_copy(input, output, "reduce_scatter_async"), Work();
  verify(checks_, comm_->handle, rank_, kReduceScatterAsync,
         {{"dtype", dtype_code<T>()},
          {"reduce op", static_cast<int64_t>(op)},
          {"output element count", static_cast<int64_t>(output.size())}},
         reduce_scatter_error(input.size(), output.size(), size_));
  if (output.empty()) return Work();
  auto state = std::make_unique<Work::State>();
  state->what = "reduce_scatter_async";
  const int count = static_cast<int>(output.size());
  if constexpr (kIsBf16<T>) {
    state->staging_in = widen(input);
    state->staging_out.resize(output.size());
    check_mpi(MPI_Ireduce_scatter_block(state->staging_in.data(), state->staging_out.data(), count, MPI_FLOAT,
                                        mpi_op(op), comm_->handle, &state->request),
              state->what);
    state->finish = [values = std::span<const float>(state->staging_out), output] { narrow(values, output); };
  } else {
    check_mpi(MPI_Ireduce_scatter_block(input.data(), output.data(), count, mpi_type<T>(), mpi_op(op), comm_->handle,
                                        &state->request),
              state->what);
  }
  return Work(std::move(state));
}

template <CommElement T>
Work ProcessGroup::all_gather_async(std::span<const T> input, std::span<T> output) const {
  if (!comm_) return self_copy(input, output, "all_gather_async"), Work();
  verify(checks_, comm_->handle, rank_, kAllGatherAsync,
         {{"dtype", dtype_code<T>()}, {"element count per rank", static_cast<int64_t>(input.size())}},
         all_gather_error(input.size(), output.size(), size_));
  if (input.empty()) return Work();
  auto state = std::make_unique<Work::State>();
  state->what = "all_gather_async";
  check_mpi(MPI_Iallgather(input.data(), static_cast<int>(input.size()), mpi_type<T>(), output.data(),
                           static_cast<int>(input.size()), mpi_type<T>(), comm_->handle, &state->request),
            state->what);
  return Work(std::move(state));
}

template <CommElement T>
Work ProcessGroup::all_to_all_v_async(std::span<const T> input, std::span<const size_t> send_counts,
                                      std::span<T> output, std::span<const size_t> recv_counts) const {
  if (!comm_) return self_all_to_all(input, send_counts, output, recv_counts), Work();
  auto state = std::make_unique<Work::State>();
  state->what = "all_to_all_v_async";
  prepare_all_to_all_v(checks_, comm_->handle, rank_, size_, kAllToAllVAsync, dtype_code<T>(), input.size(),
                       send_counts, output.size(), recv_counts, *state);
  check_mpi(MPI_Ialltoallv(ptr_or_dummy(input.data()), state->send_counts.data(), state->send_displs.data(),
                           mpi_type<T>(), ptr_or_dummy(output.data()), state->recv_counts.data(),
                           state->recv_displs.data(), mpi_type<T>(), comm_->handle, &state->request),
            state->what);
  return Work(std::move(state));
}

double sum_double(const ProcessGroup& group, const double value) {
  if (group.size() == 1) return value;
  const auto local = std::bit_cast<std::array<float, 2>>(value);
  std::vector<float> all(2 * static_cast<size_t>(group.size()));
  group.all_gather(std::span<const float>(local), std::span<float>(all));
  double sum = 0.0;
  for (size_t r = 0; r < static_cast<size_t>(group.size()); ++r) {
    sum += std::bit_cast<double>(std::array<float, 2>{all[2 * r], all[2 * r + 1]});
  }
  return sum;
}

namespace {

// MPI user reductions on 16-bit floats: widen, add in fp32, round back (each partial sum rounded).
template <uint16_t (*Encode)(float), float (*Decode)(uint16_t)>
void sum_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Encode(Decode(a[i]) + Decode(b[i]));
}

MPI_Op sum_16bit_op(const DType format) {
  static MPI_Op bf16 = MPI_OP_NULL, fp16 = MPI_OP_NULL;
  if (format == DType::kBF16) {
    if (bf16 == MPI_OP_NULL)
      check_mpi(MPI_Op_create(&sum_16bit<fp32_to_bf16, bf16_to_fp32>, 1, &bf16), "MPI_Op_create");
    return bf16;
  }
  if (format == DType::kF16) {
    if (fp16 == MPI_OP_NULL)
      check_mpi(MPI_Op_create(&sum_16bit<fp32_to_fp16, fp16_to_fp32>, 1, &fp16), "MPI_Op_create");
    return fp16;
  }
  throw CommError("16-bit reduction of " + std::string(dtype_name(format)) + ": expected bfloat16 or float16");
}

}  // namespace

Work ProcessGroup::all_reduce_16bit_async(std::span<uint16_t> data, const DType format) const {
  if (!comm_) return Work();
  const MPI_Op op = sum_16bit_op(format);
  const std::string local_error = data.size() > INT_MAX ? too_large(data.size()) : "";
  verify(checks_, comm_->handle, rank_, kAllReduce16Async,
         {{"dtype", static_cast<int64_t>(format)}, {"element count", static_cast<int64_t>(data.size())}}, local_error);
  if (data.empty()) return Work();
  auto state = std::make_unique<Work::State>();
  state->what = "all_reduce_16bit_async";
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data.data(), static_cast<int>(data.size()), MPI_UINT16_T, op, comm_->handle,
                           &state->request),
            state->what);
  return Work(std::move(state));
}

Work ProcessGroup::reduce_scatter_16bit_async(std::span<const uint16_t> input, std::span<uint16_t> output,
                                              const DType format) const {
  if (!comm_) return self_copy(input, output, "reduce_scatter_16bit_async"), Work();
  const MPI_Op op = sum_16bit_op(format);
  verify(checks_, comm_->handle, rank_, kReduceScatter16Async,
         {{"dtype", static_cast<int64_t>(format)}, {"output element count", static_cast<int64_t>(output.size())}},
         reduce_scatter_error(input.size(), output.size(), size_));
  if (output.empty()) return Work();
  auto state = std::make_unique<Work::State>();
  state->what = "reduce_scatter_16bit_async";
  check_mpi(MPI_Ireduce_scatter_block(input.data(), output.data(), static_cast<int>(output.size()), MPI_UINT16_T, op,
                                      comm_->handle, &state->request),
            state->what);
  return Work(std::move(state));
}

#define MOECORE_INSTANTIATE(T)                                                                                 \
  template void ProcessGroup::all_reduce<T>(std::span<T>, ReduceOp) const;                                     \
  template void ProcessGroup::reduce_scatter<T>(std::span<const T>, std::span<T>, ReduceOp) const;             \
  template void ProcessGroup::all_gather<T>(std::span<const T>, std::span<T>) const;                           \
  template void ProcessGroup::all_to_all_v<T>(std::span<const T>, std::span<const size_t>, std::span<T>,       \
                                              std::span<const size_t>) const;                                  \
  template void ProcessGroup::broadcast<T>(std::span<T>, int) const;                                           \
  template void ProcessGroup::send<T>(std::span<const T>, int, int) const;                                     \
  template void ProcessGroup::recv<T>(std::span<T>, int, int) const;                                           \
  template Work ProcessGroup::send_async<T>(std::span<const T>, int, int) const;                               \
  template Work ProcessGroup::recv_async<T>(std::span<T>, int, int) const;                                     \
  template Work ProcessGroup::all_reduce_async<T>(std::span<T>, ReduceOp) const;                               \
  template Work ProcessGroup::reduce_scatter_async<T>(std::span<const T>, std::span<T>, ReduceOp) const;       \
  template Work ProcessGroup::all_gather_async<T>(std::span<const T>, std::span<T>) const;                     \
  template Work ProcessGroup::all_to_all_v_async<T>(std::span<const T>, std::span<const size_t>, std::span<T>, \
                                                    std::span<const size_t>) const;

MOECORE_INSTANTIATE(float)
MOECORE_INSTANTIATE(uint16_t)
MOECORE_INSTANTIATE(int32_t)
MOECORE_INSTANTIATE(int64_t)
MOECORE_INSTANTIATE(uint8_t)
#undef MOECORE_INSTANTIATE

}  // namespace moecore::parallel
