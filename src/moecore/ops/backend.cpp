#include "moecore/ops/backend.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace moecore::ops {
namespace {

constexpr int kUnset = -1;
// Process-wide, not per thread: the OpenMP workers inside a fast kernel's caller must run the same backend.
std::atomic<int> scoped_backend{kUnset};

Backend environment_backend() {
  static const Backend backend = [] {
    const char* value = std::getenv("MOECORE_BACKEND");
    return value == nullptr || *value == '\0' ? Backend::kCpu : parse_backend(value);
  }();
  return backend;
}

}  // namespace

std::string_view backend_name(const Backend backend) { return backend == Backend::kReference ? "reference" : "cpu"; }

Backend parse_backend(const std::string_view name) {
  if (name == "cpu") return Backend::kCpu;
  if (name == "reference") return Backend::kReference;
  throw std::invalid_argument("unknown backend '" + std::string(name) + "' (expected cpu or reference)");
}

Backend active_backend() {
  const int scoped = scoped_backend.load();
  return scoped == kUnset ? environment_backend() : static_cast<Backend>(scoped);
}

ScopedBackend::ScopedBackend(const Backend backend) : previous_(scoped_backend.exchange(static_cast<int>(backend))) {}

ScopedBackend::~ScopedBackend() { scoped_backend = previous_; }

}  // namespace moecore::ops
