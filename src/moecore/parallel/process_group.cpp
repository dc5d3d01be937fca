#include "moecore/parallel/process_group.h"

#define OMPI_SKIP_MPICXX 1  // the C API only: OpenMPI's deprecated C++ bindings warn under -Wextra
#include <mpi.h>

#include <algorithm>
#include <array>
#include <bit>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "moecore/parallel/arrival_board.h"
#include "moecore/parallel/shared_window.h"
#include "moecore/parallel/watchdog.h"
#include "moecore/tensor/dtype.h"
#include "moecore/util/trace.h"

namespace moecore::parallel {

struct ProcessGroup::Comm {
  MPI_Comm handle = MPI_COMM_NULL;
  std::string name;              // in watchdog reports
  std::vector<int> world_ranks;  // of the members, by group rank
  int board_slot = -1;           // this group's slot on the arrival board
  int64_t started = 0;           // collectives this rank started on the group
  int64_t completed = 0;         // and saw complete
  explicit Comm(MPI_Comm comm, std::string group_name) : handle(comm), name(std::move(group_name)) {
    MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
    MPI_Comm_group(comm, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int size = 0;
    MPI_Group_size(group, &size);
    std::vector<int> members(static_cast<size_t>(size));
    std::iota(members.begin(), members.end(), 0);
    world_ranks.resize(members.size());
    MPI_Group_translate_ranks(group, size, members.data(), world, world_ranks.data());
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    board_slot = arrival_board::claim_slot(comm);
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  ~Comm() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && handle != MPI_COMM_NULL) MPI_Comm_free(&handle);
  }
};

// One operation as the watchdog sees it: where it runs, which collective of the group it is (0 for point to point)
// and its flight-recorder entry.
struct Operation {
  std::shared_ptr<ProcessGroup::Comm> comm;
  const char* op = "";
  int64_t sequence = 0;
  int peer = -1;  // point to point: the other group rank
  uint64_t record = 0;
};

struct Work::State {
  MPI_Request request = MPI_REQUEST_NULL;
  Operation operation;
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

// ---------------------------------------------------------------- watchdog

// A collective on `comm`: the group's next sequence number, published on the arrival board (a store, no message).
Operation begin_collective(const std::shared_ptr<ProcessGroup::Comm>& comm, const char* op, const size_t elements) {
  const int64_t sequence = ++comm->started;
  arrival_board::publish_started(comm->board_slot, sequence);
  const uint64_t record = flight_recorder().start(
      {.op = op, .group = comm->name, .sequence = sequence, .elements = static_cast<int64_t>(elements)});
  return Operation{comm, op, sequence, -1, record};
}

// A point-to-point transfer with group rank `peer`.
Operation begin_transfer(const std::shared_ptr<ProcessGroup::Comm>& comm, const char* op, const int peer,
                         const size_t elements) {
  const uint64_t record = flight_recorder().start(
      {.op = op, .group = comm->name, .peer = peer, .elements = static_cast<int64_t>(elements)});
  return Operation{comm, op, 0, peer, record};
}

void finished(const Operation& operation) {
  flight_recorder().complete(operation.record);
  if (operation.sequence > 0) arrival_board::publish_completed(operation.comm->board_slot, ++operation.comm->completed);
}

// How long the report watches the peers' beats on the arrival board, and waits for each read of it.
constexpr double kBoardWatchSeconds = 1.0;
constexpr double kBoardReadSeconds = 5.0;

// The wait for `operation` passed the timeout: one line on stderr, then the whole job ends (a rank left waiting
// would hang, and the ranks that did not arrive may never come).
[[noreturn]] void report_timeout(const Operation& operation) {
  flight_recorder().timed_out(operation.record);
  const ProcessGroup::Comm& comm = *operation.comm;
  const std::string group = "process group " + comm.name + " (ranks " + join_ranks(comm.world_ranks) + ")";
  const std::string minutes = timeout_minutes_text(collective_timeout().value_or(0.0));
  std::string line;
  if (operation.sequence > 0) {
    const std::vector<PeerProgress> peers =
        arrival_board::read(comm.board_slot, comm.world_ranks, kBoardWatchSeconds, kBoardReadSeconds);
    line = "error: collective " + std::string(operation.op) + " on " + group + " did not complete within " + minutes +
           " minutes: " + describe_arrivals(comm.world_ranks, operation.sequence, peers);
  } else {
    const bool sends = std::string_view(operation.op) == "send";
    const std::string peer = std::to_string(comm.world_ranks[static_cast<size_t>(operation.peer)]);
    line = "error: " + std::string(operation.op) + (sends ? " to rank " : " from rank ") + peer + " on " + group +
           " did not complete within " + minutes + " minutes: rank " + peer + " did not post the matching " +
           (sends ? "receive" : "send");
  }
  line += " (last collectives: " + flight_recorder().summary(6) + ")";
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  abort_world(1);
}

// Waits for `request` (MPI_Test between yields) until it completes or the collective timeout passes (then reports
// and ends the job). MPI errors throw CommError naming `what`. The operation's record stays open: an operation may
// wait for several requests (the agreement check, then the collective).
void wait_request(MPI_Request& request, MPI_Status* status, const Operation& operation, const std::string& what) {
  int rc = MPI_SUCCESS;
  const bool complete = poll_until(
      [&] {
        int flag = 0;
        arrival_board::beat();
        rc = MPI_Test(&request, &flag, status);
        return rc != MPI_SUCCESS || flag != 0;
      },
      wait_deadline());
  if (!complete) report_timeout(operation);
  check_mpi(rc, what);
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
void verify(bool checked, const Operation& operation, int rank, int64_t op, std::initializer_list<Field> fields,
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
  const std::string what = std::string(op_name(op)) + ": agreement check";
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_INT64_T, MPI_MAX,
                           operation.comm->handle, &request),
            what);
  wait_request(request, MPI_STATUS_IGNORE, operation, what);
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
  if (state.operation.comm) finished(state.operation);
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
  arrival_board::beat();
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
  if (finalized) {
    state.done = true;
    forget(&state);
    throw CommError(state.what + ": MPI was finalized before the operation was waited on");
  }
  // Bounded by the collective timeout from the start of this wait (an operation in flight under a long
  // computation is not late until someone waits for it).
  const auto poll = [&state] {
    arrival_board::beat();
    return test_state(state);
  };
  if (!poll_until(poll, wait_deadline())) report_timeout(state.operation);
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
    arrival_board::open();
    auto comm = std::make_shared<Comm>(dup, "world");
    MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    MPI_Comm_rank(dup, &rank);
    MPI_Comm_size(dup, &size);
    return ProcessGroup(std::move(comm), rank, size, checks);
  }();
  return world_group;
}

std::string ProcessGroup::name() const { return comm_ ? comm_->name : "self"; }

void ProcessGroup::set_name(std::string name) const {
  if (comm_) comm_->name = std::move(name);
}

ProcessGroup ProcessGroup::split(int color, int key) const {
  if (!comm_) return self_check(color >= 0, "split: color is negative"), *this;
  const std::string local_error = color < 0 ? "color " + std::to_string(color) + " is negative" : "";
  const Operation operation = begin_collective(comm_, "split", 0);
  verify(checks_, operation, rank_, kSplit, {}, local_error);
  MPI_Comm sub = MPI_COMM_NULL;
  // MPI has no non-blocking split: start-up only, not bounded by the collective timeout.
  check_mpi(MPI_Comm_split(comm_->handle, color, key, &sub), "split");
  finished(operation);
  auto comm = std::make_shared<Comm>(sub, comm_->name + "/" + std::to_string(color));
  MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(sub, &rank);
  MPI_Comm_size(sub, &size);
  return ProcessGroup(std::move(comm), rank, size, checks_);
}

ProcessGroup ProcessGroup::split_shared_memory() const {
  if (!comm_) return *this;
  const Operation operation = begin_collective(comm_, "split_shared_memory", 0);
  verify(checks_, operation, rank_, kSplit, {}, "");
  MPI_Comm sub = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm_->handle, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &sub),
            "split_shared_memory");
  finished(operation);
  auto comm = std::make_shared<Comm>(sub, comm_->name + "/host");
  MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
  int rank = 0, size = 1;
  MPI_Comm_rank(sub, &rank);
  MPI_Comm_size(sub, &size);
  return ProcessGroup(std::move(comm), rank, size, checks_);
}

struct SharedWindow::Impl {
  explicit Impl(const ProcessGroup& g) : group(g) {}
  ProcessGroup group;
  MPI_Win window = MPI_WIN_NULL;
  std::vector<std::byte*> segments;
  std::vector<size_t> sizes;
  std::vector<std::byte> local;  // the single-process group
};

SharedWindow::SharedWindow(const ProcessGroup& group, const size_t bytes) : impl_(std::make_unique<Impl>(group)) {
  const int n = group.size();
  impl_->segments.assign(static_cast<size_t>(n), nullptr);
  impl_->sizes.assign(static_cast<size_t>(n), 0);
  if (!group.comm_) {
    impl_->local.resize(std::max<size_t>(bytes, 1));
    impl_->segments[0] = impl_->local.data();
    impl_->sizes[0] = bytes;
    return;
  }
  std::byte* base = nullptr;
  // Every segment a multiple of 64 bytes (at least one line), so each rank's segment starts as aligned as the window
  // (MPI places the segments one after the other).
  const size_t padded = std::max<size_t>((bytes + 63) / 64 * 64, 64);
  check_mpi(MPI_Win_allocate_shared(static_cast<MPI_Aint>(padded), 1, MPI_INFO_NULL, group.comm_->handle, &base,
                                    &impl_->window),
            "MPI_Win_allocate_shared");
  for (int r = 0; r < n; ++r) {
    MPI_Aint size = 0;
    int unit = 1;
    void* pointer = nullptr;
    check_mpi(MPI_Win_shared_query(impl_->window, r, &size, &unit, &pointer), "MPI_Win_shared_query");
    impl_->segments[static_cast<size_t>(r)] = static_cast<std::byte*>(pointer);
    impl_->sizes[static_cast<size_t>(r)] = static_cast<size_t>(size);
  }
  impl_->sizes[static_cast<size_t>(group.rank())] = bytes;
  check_mpi(MPI_Win_lock_all(MPI_MODE_NOCHECK, impl_->window), "MPI_Win_lock_all");
}

SharedWindow::~SharedWindow() {
  if (impl_->window == MPI_WIN_NULL) return;
  MPI_Win_unlock_all(impl_->window);
  MPI_Win_free(&impl_->window);
}

std::byte* SharedWindow::segment(const int rank) const { return impl_->segments.at(static_cast<size_t>(rank)); }
size_t SharedWindow::segment_bytes(const int rank) const { return impl_->sizes.at(static_cast<size_t>(rank)); }

void SharedWindow::synchronize() const {
  if (impl_->window == MPI_WIN_NULL) return;
  check_mpi(MPI_Win_sync(impl_->window), "MPI_Win_sync");
  impl_->group.barrier();
  check_mpi(MPI_Win_sync(impl_->window), "MPI_Win_sync");
}

int host_id(const ProcessGroup& world) {
  return [&] {
    const ProcessGroup host = world.split_shared_memory();
    int leader = world.rank();
    host.broadcast(std::span<int>(&leader, 1), 0);
    const char* text = std::getenv("MOECORE_PRETEND_HOSTS");
    if (text == nullptr || *text == '\0') return leader;
    char* end = nullptr;
    const long pretend = std::strtol(text, &end, 10);
    if (*end != '\0' || pretend < 1 || pretend > host.size() || host.size() % pretend != 0) {
      throw CommError(std::string("MOECORE_PRETEND_HOSTS must divide the ") + std::to_string(host.size()) +
                      " ranks of this machine into equal pretend hosts, got '" + text + "'");
    }
    const int per_host = host.size() / static_cast<int>(pretend);
    return leader * static_cast<int>(pretend) + host.rank() / per_host;
  }();
}

void ProcessGroup::barrier() const {
  if (!comm_) return;
  const Operation operation = begin_collective(comm_, "barrier", 0);
  verify(checks_, operation, rank_, kBarrier, {}, "");
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibarrier(comm_->handle, &request), "barrier");
  wait_request(request, MPI_STATUS_IGNORE, operation, "barrier");
  finished(operation);
}

template <CommElement T>
void ProcessGroup::all_reduce(std::span<T> data, ReduceOp op) const {
  if (!comm_) return;
  const std::string local_error = data.size() > INT_MAX ? too_large(data.size()) : "";
  const Operation operation = begin_collective(comm_, "all_reduce", data.size());
  verify(checks_, operation, rank_, kAllReduce,
         {{"dtype", dtype_code<T>()},
          {"reduce op", static_cast<int64_t>(op)},
          {"element count", static_cast<int64_t>(data.size())}},
         local_error);
  if (data.empty()) return finished(operation);
  const int count = static_cast<int>(data.size());
  MPI_Request request = MPI_REQUEST_NULL;
  if constexpr (kIsBf16<T>) {
    std::vector<float> values = widen(data);
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, values.data(), count, MPI_FLOAT, mpi_op(op), comm_->handle, &request),
              "all_reduce");
    wait_request(request, MPI_STATUS_IGNORE, operation, "all_reduce");
    narrow(values, data);
  } else {
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data.data(), count, mpi_type<T>(), mpi_op(op), comm_->handle, &request),
              "all_reduce");
    wait_request(request, MPI_STATUS_IGNORE, operation, "all_reduce");
  }
  finished(operation);
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
  const Operation operation = begin_collective(comm_, "reduce_scatter", input.size());
  verify(checks_, operation, rank_, kReduceScatter,
         {{"dtype", dtype_code<T>()},
          {"reduce op", static_cast<int64_t>(op)},
          {"output element count", static_cast<int64_t>(output.size())}},
         reduce_scatter_error(input.size(), output.size(), size_));
  if (output.empty()) return finished(operation);
  const int count = static_cast<int>(output.size());
  MPI_Request request = MPI_REQUEST_NULL;
  if constexpr (kIsBf16<T>) {
    const std::vector<float> values = widen(input);
    std::vector<float> reduced(output.size());
    check_mpi(
        MPI_Ireduce_scatter_block(values.data(), reduced.data(), count, MPI_FLOAT, mpi_op(op), comm_->handle, &request),
        "reduce_scatter");
    wait_request(request, MPI_STATUS_IGNORE, operation, "reduce_scatter");
    narrow(reduced, output);
  } else {
    check_mpi(MPI_Ireduce_scatter_block(input.data(), output.data(), count, mpi_type<T>(), mpi_op(op), comm_->handle,
                                        &request),
              "reduce_scatter");
    wait_request(request, MPI_STATUS_IGNORE, operation, "reduce_scatter");
  }
  finished(operation);
}

template <CommElement T>
void ProcessGroup::all_gather(std::span<const T> input, std::span<T> output) const {
  if (!comm_) return self_copy(input, output, "all_gather");
  const Operation operation = begin_collective(comm_, "all_gather", input.size());
  verify(checks_, operation, rank_, kAllGather,
         {{"dtype", dtype_code<T>()}, {"element count per rank", static_cast<int64_t>(input.size())}},
         all_gather_error(input.size(), output.size(), size_));
  if (input.empty()) return finished(operation);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallgather(input.data(), static_cast<int>(input.size()), mpi_type<T>(), output.data(),
                           static_cast<int>(input.size()), mpi_type<T>(), comm_->handle, &request),
            "all_gather");
  wait_request(request, MPI_STATUS_IGNORE, operation, "all_gather");
  finished(operation);
}

std::vector<size_t> ProcessGroup::exchange_counts(std::span<const size_t> send_counts) const {
  if (!comm_)
    return self_check(send_counts.size() == 1, "exchange_counts: send_counts must have 1 entry"),
           std::vector<size_t>(send_counts.begin(), send_counts.end());
  const std::string local_error = send_counts.size() == static_cast<size_t>(size_)
                                      ? ""
                                      : "send_counts has " + std::to_string(send_counts.size()) +
                                            " entries, expected the group size " + std::to_string(size_);
  const Operation operation = begin_collective(comm_, "exchange_counts", send_counts.size());
  verify(checks_, operation, rank_, kExchangeCounts, {}, local_error);
  std::vector<uint64_t> sent(send_counts.begin(), send_counts.end());
  std::vector<uint64_t> received(sent.size());
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ialltoall(sent.data(), 1, MPI_UINT64_T, received.data(), 1, MPI_UINT64_T, comm_->handle, &request),
            "exchange_counts");
  wait_request(request, MPI_STATUS_IGNORE, operation, "exchange_counts");
  finished(operation);
  return std::vector<size_t>(received.begin(), received.end());
}

namespace {

// Checks the splits locally, then that every rank's recv_counts match what its peers send; fills the int
// counts/displacements MPI needs. Collective; throws on every rank on any problem.
void prepare_all_to_all_v(bool checked, const Operation& operation, int rank, int size, int64_t op, int64_t dtype,
                          size_t input_size, std::span<const size_t> send_counts, size_t output_size,
                          std::span<const size_t> recv_counts, Work::State& state) {
  std::string local_error =
      check_split(send_counts, input_size, size, "send_counts", state.send_counts, state.send_displs);
  if (local_error.empty()) {
    local_error = check_split(recv_counts, output_size, size, "recv_counts", state.recv_counts, state.recv_displs);
  }
  verify(checked, operation, rank, op, {{"dtype", dtype}}, local_error);
  if (!checked) return;
  std::vector<int> peer_sends(static_cast<size_t>(size));
  const std::string what = std::string(op_name(op)) + ": count exchange";
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ialltoall(state.send_counts.data(), 1, MPI_INT, peer_sends.data(), 1, MPI_INT, operation.comm->handle,
                          &request),
            what);
  wait_request(request, MPI_STATUS_IGNORE, operation, what);
  std::string mismatch;
  for (int src = 0; src < size && mismatch.empty(); ++src) {
    if (peer_sends[static_cast<size_t>(src)] != state.recv_counts[static_cast<size_t>(src)]) {
      mismatch = "recv_counts expects " + std::to_string(state.recv_counts[static_cast<size_t>(src)]) +
                 " elements from rank " + std::to_string(src) + ", which sends " +
                 std::to_string(peer_sends[static_cast<size_t>(src)]);
    }
  }
  verify(checked, operation, rank, kAllToAllVCounts, {}, mismatch);
}

}  // namespace

template <CommElement T>
void ProcessGroup::all_to_all_v(std::span<const T> input, std::span<const size_t> send_counts, std::span<T> output,
                                std::span<const size_t> recv_counts) const {
  if (!comm_) return self_all_to_all(input, send_counts, output, recv_counts);
  Work::State state;
  const Operation operation = begin_collective(comm_, "all_to_all_v", input.size());
  prepare_all_to_all_v(checks_, operation, rank_, size_, kAllToAllV, dtype_code<T>(), input.size(), send_counts,
                       output.size(), recv_counts, state);
  check_mpi(MPI_Ialltoallv(ptr_or_dummy(input.data()), state.send_counts.data(), state.send_displs.data(),
                           mpi_type<T>(), ptr_or_dummy(output.data()), state.recv_counts.data(),
                           state.recv_displs.data(), mpi_type<T>(), comm_->handle, &state.request),
            "all_to_all_v");
  wait_request(state.request, MPI_STATUS_IGNORE, operation, "all_to_all_v");
  finished(operation);
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
  const Operation operation = begin_collective(comm_, "broadcast", data.size());
  verify(checks_, operation, rank_, kBroadcast,
         {{"dtype", dtype_code<T>()}, {"root", root}, {"element count", static_cast<int64_t>(data.size())}},
         local_error);
  if (data.empty()) return finished(operation);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibcast(data.data(), static_cast<int>(data.size()), mpi_type<T>(), root, comm_->handle, &request),
            "broadcast");
  wait_request(request, MPI_STATUS_IGNORE, operation, "broadcast");
  finished(operation);
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
  const std::string what = "send to rank " + std::to_string(dst);
  const Operation operation = begin_transfer(comm_, "send", dst, data.size());
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Isend(ptr_or_dummy(data.data()), static_cast<int>(data.size()), mpi_type<T>(), dst, tag, comm_->handle,
                      &request),
            what);
  wait_request(request, MPI_STATUS_IGNORE, operation, what);
  finished(operation);
}

template <CommElement T>
void ProcessGroup::recv(std::span<T> data, int src, int tag) const {
  if (!comm_) throw CommError("recv: a single-process group has no peer");
  std::string error = peer_error(src, rank_, size_, "source");
  if (error.empty() && data.size() > INT_MAX) error = too_large(data.size());
  if (!error.empty()) throw CommError("recv on rank " + std::to_string(rank_) + ": " + error);
  const std::string what = "recv on rank " + std::to_string(rank_) + " from rank " + std::to_string(src);
  const Operation operation = begin_transfer(comm_, "recv", src, data.size());
  MPI_Status status;
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Irecv(ptr_or_dummy(data.data()), static_cast<int>(data.size()), mpi_type<T>(), src, tag, comm_->handle,
                      &request),
            what);
  wait_request(request, &status, operation, what);
  finished(operation);
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
  state->operation = begin_transfer(comm_, "send", dst, data.size());
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
  state->operation = begin_transfer(comm_, "recv", src, data.size());
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
  const Operation operation = begin_collective(comm_, "all_reduce_async", data.size());
  verify(checks_, operation, rank_, kAllReduceAsync,
         {{"dtype", dtype_code<T>()},
          {"reduce op", static_cast<int64_t>(op)},
          {"element count", static_cast<int64_t>(data.size())}},
         local_error);
  if (data.empty()) return finished(operation), Work();
  auto state = std::make_unique<Work::State>();
  state->what = "all_reduce_async";
  state->operation = operation;
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
  const Operation operation = begin_collective(comm_, "reduce_scatter_async", input.size());
  verify(checks_, operation, rank_, kReduceScatterAsync,
         {{"dtype", dtype_code<T>()},
          {"reduce op", static_cast<int64_t>(op)},
          {"output element count", static_cast<int64_t>(output.size())}},
         reduce_scatter_error(input.size(), output.size(), size_));
  if (output.empty()) return finished(operation), Work();
  auto state = std::make_unique<Work::State>();
  state->what = "reduce_scatter_async";
  state->operation = operation;
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
  const Operation operation = begin_collective(comm_, "all_gather_async", input.size());
  verify(checks_, operation, rank_, kAllGatherAsync,
         {{"dtype", dtype_code<T>()}, {"element count per rank", static_cast<int64_t>(input.size())}},
         all_gather_error(input.size(), output.size(), size_));
  if (input.empty()) return finished(operation), Work();
  auto state = std::make_unique<Work::State>();
  state->what = "all_gather_async";
  state->operation = operation;
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
  state->operation = begin_collective(comm_, "all_to_all_v_async", input.size());
  prepare_all_to_all_v(checks_, state->operation, rank_, size_, kAllToAllVAsync, dtype_code<T>(), input.size(),
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
  const Operation operation = begin_collective(comm_, "all_reduce_16bit_async", data.size());
  verify(checks_, operation, rank_, kAllReduce16Async,
         {{"dtype", static_cast<int64_t>(format)}, {"element count", static_cast<int64_t>(data.size())}}, local_error);
  if (data.empty()) return finished(operation), Work();
  auto state = std::make_unique<Work::State>();
  state->what = "all_reduce_16bit_async";
  state->operation = operation;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data.data(), static_cast<int>(data.size()), MPI_UINT16_T, op, comm_->handle,
                           &state->request),
            state->what);
  return Work(std::move(state));
}

Work ProcessGroup::reduce_scatter_16bit_async(std::span<const uint16_t> input, std::span<uint16_t> output,
                                              const DType format) const {
  if (!comm_) return self_copy(input, output, "reduce_scatter_16bit_async"), Work();
  const MPI_Op op = sum_16bit_op(format);
  const Operation operation = begin_collective(comm_, "reduce_scatter_16bit_async", input.size());
  verify(checks_, operation, rank_, kReduceScatter16Async,
         {{"dtype", static_cast<int64_t>(format)}, {"output element count", static_cast<int64_t>(output.size())}},
         reduce_scatter_error(input.size(), output.size(), size_));
  if (output.empty()) return finished(operation), Work();
  auto state = std::make_unique<Work::State>();
  state->what = "reduce_scatter_16bit_async";
  state->operation = operation;
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
