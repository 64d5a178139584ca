// Where a session's arena lives (docs/design.md §3-4): host memory in a memfd (CPU backend) or
// device memory from a CUDA VMM allocation (CUDA backend). Both are handed to the client as a file
// descriptor; the daemon reads statistics and writes policy and budgets through this class, and
// runs remote mode (PredictMasks / ObserveScores) on the same arena. Not thread-safe: callers
// hold the session's mutex.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "spin/arena.h"
#include "spin/data_plane.h"

namespace spin::service {

enum class Backend { kCpu, kCuda };

/// A session's arena.
class ArenaStorage {
 public:
  virtual ~ArenaStorage() = default;

  virtual Backend backend() const = 0;
  /// Bytes the client maps (the arena rounded up to the allocation granularity on CUDA).
  virtual uint64_t mapping_bytes() const = 0;
  /// The device's UUID on CUDA ("GPU-..."), empty on the CPU backend.
  virtual std::string device_uuid() const { return ""; }
  /// A new file descriptor for the client's mapping (the caller closes it).
  virtual absl::StatusOr<int> ExportFd() const = 0;

  /// The arena in host-readable memory: the arena itself on the CPU backend; on CUDA a host
  /// mirror with the same layout whose regions are current after the Pull that names them.
  const ArenaView& host() const { return host_; }
  /// Header, policy, budget table, statistics and miss curves.
  virtual absl::Status PullControl() = 0;
  /// The current step's batch header and entries, and the last Select's outputs.
  virtual absl::Status PullOutputs() = 0;

  /// Writes a policy (and, in uniform mode, the budget table) and bumps the epoch.
  virtual absl::Status WritePolicy(const Policy& p) = 0;
  /// Writes the per-layer budget table (sparsity per layer) and bumps the epoch.
  virtual absl::Status WriteBudgets(const double* sparsity) = 0;

  /// Remote mode: the data-plane operations with host inputs (staged to the device on CUDA,
  /// where each call completes before it returns). Outputs are read with PullOutputs().
  virtual absl::Status ResetSequence(int32_t seq, uint64_t key) = 0;
  /// BeginStep's checks alone (ValidateStepBatch on current sequence records): what BeginStep
  /// would refuse, with the same status, and nothing changed.
  virtual absl::Status CheckStep(const StepBatch& host_batch) = 0;
  virtual absl::Status BeginStep(const StepBatch& host_batch) = 0;
  virtual absl::Status Select(int32_t layer) = 0;
  /// With `host_topk` (else null), the step's top-K given as the engine's
  /// (DataPlane::RemapAndObserve): `host_topk[(e * rows + r) * count + k]` are compacted indices
  /// (-1: none), a scratch buffer (mapped in place on the CPU backend, left as it was on CUDA).
  /// A probe counts that top-K, and a sparse step's exploration blocks estimate its miss (the
  /// miss-target controller's measurement between probes, docs/budgets.md).
  virtual absl::Status Observe(int32_t layer, const float* host_logits, int64_t stride,
                               const int32_t* host_accepted, int32_t* host_topk, int32_t count) = 0;

 protected:
  ArenaView host_;
};

/// An initialised arena in a memfd.
absl::StatusOr<std::unique_ptr<ArenaStorage>> MakeCpuArenaStorage(const Geometry& g, uint64_t seed,
                                                                  const Policy& policy);

/// True when this build has the CUDA backend and `ordinal` names a usable device.
bool CudaBackendUsable(int ordinal, std::string* why);

/// An initialised arena in device memory of CUDA device `ordinal` (VMM, POSIX-fd handle).
absl::StatusOr<std::unique_ptr<ArenaStorage>> MakeCudaArenaStorage(int ordinal, const Geometry& g,
                                                                   uint64_t seed,
                                                                   const Policy& policy);

/// The device UUID of `ordinal` ("" without the CUDA backend).
std::string CudaDeviceUuidOrEmpty(int ordinal);

/// Free bytes of CUDA device `ordinal` now (0 without the CUDA backend or on error).
uint64_t CudaDeviceFreeBytesOrZero(int ordinal);

/// Host memory arenas may use: physical RAM, or the cgroup's memory limit when lower (a
/// container's limit is what the kernel enforces).
uint64_t HostMemoryBytes();

}  // namespace spin::service
