#include "moecore/parallel/mpi_runtime.h"

#include <cstdlib>

#define OMPI_SKIP_MPICXX 1  // the C API only: OpenMPI's deprecated C++ bindings warn under -Wextra
#include <mpi.h>

namespace moecore::parallel {

namespace {

bool finalized() {
  int flag = 0;
  MPI_Finalized(&flag);
  return flag != 0;
}

}  // namespace

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  if (finalized()) throw CommError("MPI was already finalized in this process and cannot be initialized again");
  int already = 0;
  MPI_Initialized(&already);
  if (already) return;
  // OpenMP workers never call MPI; the two lanes of the EP overlap (turn_taking.h) call it from two threads, one
  // at a time.
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    throw CommError("MPI_Init_thread failed");
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    MPI_Finalize();
    throw CommError("this MPI library does not provide MPI_THREAD_SERIALIZED, which moecore needs");
  }
  owns_mpi_ = true;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

MpiRuntime::~MpiRuntime() {
  if (owns_mpi_ && !finalized()) MPI_Finalize();
}

bool MpiRuntime::initialized() {
  int flag = 0;
  MPI_Initialized(&flag);
  return flag != 0 && !finalized();
}

void MpiRuntime::ensure_initialized() {
  if (initialized()) return;
  static const MpiRuntime process_lifetime_runtime;  // finalized at exit
  if (!initialized()) throw CommError("MPI was already finalized in this process and cannot be initialized again");
}

void abort_world(const int code) {
  if (MpiRuntime::initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

}  // namespace moecore::parallel
