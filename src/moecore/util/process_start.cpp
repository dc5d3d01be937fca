#include "moecore/util/process_start.h"

#include <chrono>

namespace moecore {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Initialized before main() runs (static initialization of this translation unit).
const double g_process_start = now_seconds();

}  // namespace

double process_start_seconds() { return g_process_start; }

}  // namespace moecore
