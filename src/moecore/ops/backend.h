// Which implementation runs an op. Ops (this folder) take Tensors and dispatch on the tensor's device and dtype to a
// backend's kernels; model, MoE and optimizer code never name a backend. CPU tensors have two backends: kCpu, the
// fast kernels (OpenMP, OpenBLAS, vector paths), and kReference, the naive kernels the fast ones are tested against.
// A CUDA backend would add an entry for Device::kCUDA.
#pragma once

#include <cstdint>
#include <string_view>

#include "moecore/tensor/device.h"

namespace moecore::ops {

enum class Backend : uint8_t { kCpu, kReference };

std::string_view backend_name(Backend backend);
// Parses "cpu" / "reference"; throws std::invalid_argument naming the value otherwise.
Backend parse_backend(std::string_view name);

// The backend that runs CPU ops: the innermost live ScopedBackend, else MOECORE_BACKEND from the environment (read
// once: "cpu" or "reference"), else kCpu.
Backend active_backend();

// Runs every op on `backend` until destroyed (process-wide, so OpenMP workers agree; nests and restores the
// previous choice; create and destroy it on one thread, outside parallel regions).
class ScopedBackend {
 public:
  explicit ScopedBackend(Backend backend);
  ~ScopedBackend();
  ScopedBackend(const ScopedBackend&) = delete;
  ScopedBackend& operator=(const ScopedBackend&) = delete;

 private:
  int previous_;
};

}  // namespace moecore::ops
