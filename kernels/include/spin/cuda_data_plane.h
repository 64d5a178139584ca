// The CUDA backend of the data plane (H100/H200), for arenas in device memory.
//
// Host code includes this plain header; the kernels live in kernels/cuda/ and build only when
// the CUDA toolkit is found (SPIN_HAVE_CUDA). Every per-step operation is asynchronous on the
// caller's stream, allocates nothing and never synchronises, so a step can be captured in a
// CUDA graph and replayed. Checks that need device data (entry ranges, accepted counts) run on
// the device and record an ArenaError in the arena's error word instead of returning a status.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "spin/arena.h"
#include "spin/data_plane.h"

namespace spin {

/// True when the CUDA backend was built and a CUDA device is usable.
bool CudaAvailable();

/// Writes a fresh arena (header, policy, unset state, ...) into device memory at `device_base`
/// (cudaMalloc'd or VMM-mapped, 256-byte aligned) on `stream`, and returns its view.
absl::StatusOr<ArenaView> InitDeviceArena(void* device_base, uint64_t bytes, const Geometry& g,
                                          uint64_t seed, const Policy& policy,
                                          cudaStream_t stream = nullptr);

/// Writes a policy (and, in uniform mode, the budget table) into a device arena and bumps its
/// epoch. A control-plane call: it synchronises `stream`.
absl::Status WriteDevicePolicy(const ArenaView& view, const Policy& policy,
                               cudaStream_t stream = nullptr);

/// A CUDA data plane over a device arena. The view's pointers are device pointers; `view.header`
/// is read through a host copy taken here (one synchronous copy at construction).
absl::StatusOr<std::unique_ptr<DataPlane>> MakeCudaDataPlane(const ArenaView& view);

/// Device memory for tools and tests (synchronous; never on the engine's hot path).
absl::StatusOr<void*> DeviceAlloc(uint64_t bytes);
/// Frees memory from DeviceAlloc.
void DeviceFree(void* p);
/// Copies host -> device.
absl::Status CopyToDevice(void* dst, const void* src, uint64_t bytes);
/// Copies device -> host.
absl::Status CopyToHost(void* dst, const void* src, uint64_t bytes);

/// Reads the arena's error word (synchronous; for tests and tools).
absl::StatusOr<uint32_t> ReadDeviceError(const ArenaView& view);

}  // namespace spin
