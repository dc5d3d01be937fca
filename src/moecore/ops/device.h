// What a device offers the ops. Every op runs on the kernel table of its tensors' device (all on one device):
//   Device::kCPU        the fast kernels (kernels/cpu, the cpu:: namespace)
//   Device::kReference  the naive kernels they are tested against (ref::, *_ref.cpp), on guarded memory
// A backend for a new device brings one folder of kernels, their table in ops/dispatch.h, its allocator
// (tensor/allocator.h) and a run of the op-test harness (tests/unit/ops_backend_test.cpp) on it.
#pragma once

#include <string_view>

#include "moecore/tensor/device.h"
#include "moecore/tensor/dtype.h"

namespace moecore::ops {

// Whether `op` (a function of ops/) runs on tensors of `dtype` on `device`: fp32 / fp64 for every op on the CPU and
// reference devices; bf16 / fp16 too for linear_forward, linear_backward (16-bit weights), convert and
// round_to_dtype_; nothing on a device without kernels (kCUDA in this build). The op-test harness skips what this
// says is not there.
bool supports(std::string_view op, DType dtype, Device device);

// Returns once every op issued on `device` has finished and its results are visible to the host. Host devices run
// ops synchronously, so this is where an asynchronous backend would wait; callers put it before reading a device's
// results on the host (the loss, statistics, collectives on host buffers).
void synchronize(Device device);

}  // namespace moecore::ops
