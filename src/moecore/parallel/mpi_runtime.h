// MPI process lifetime. MPI may be initialized once per process and finalized once; MpiRuntime is the RAII guard
// that does both. Run under mpirun for several ranks; a process started without mpirun is a world of one.
#pragma once

#include <stdexcept>
#include <string>

namespace moecore::parallel {

// Every failure of a collective or point-to-point operation: an MPI error (with MPI's error string), or
// arguments that are invalid or (with agreement checks, process_group.h) that disagree across the ranks of a group.
// Thrown on every rank involved when agreement checks are on; otherwise on the rank whose arguments are invalid.
class CommError : public std::runtime_error {
 public:
  explicit CommError(const std::string& message) : std::runtime_error(message) {}
};

// Ends every process of the job with `code` (MPI_Abort on the world): for a failure on one rank that would
// otherwise leave its peers waiting in a collective.
[[noreturn]] void abort_world(int code);

class MpiRuntime {
 public:
  // Initializes MPI unless it already is (then this guard does not own it and will not finalize it).
  // argc/argv may be null.
  MpiRuntime(int* argc, char*** argv);
  MpiRuntime() : MpiRuntime(nullptr, nullptr) {}
  ~MpiRuntime();  // MPI_Finalize when this guard initialized MPI
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  static bool initialized();  // MPI_Init has run and MPI_Finalize has not
  // Initializes MPI with a process-lifetime guard (finalized at exit) when no guard did it yet; throws CommError
  // once MPI has been finalized.
  static void ensure_initialized();

 private:
  bool owns_mpi_ = false;
};

}  // namespace moecore::parallel
