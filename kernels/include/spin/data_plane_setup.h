// Making a data plane, the one way spind, libspin_client, the torch ops, replay and the
// benchmarks do it: an arena of a geometry in host or device memory, initialised with a seed and
// a policy, under the backend for that memory (the CPU reference on host memory, the CUDA
// backend on device memory). Also the control-plane writes into either kind of arena (a policy,
// a budget table, each with a new epoch), and the per-layer budget loop of a process that runs
// its own data plane (offline replay, the torch ops' local sessions), where spind's probe thread
// is not there to run it.
//
// Control-plane code: on a device arena every call here copies synchronously. Never call it
// during an engine's step. C++17, as the CUDA sources are (gpu_bench includes it).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "spin/arena.h"
#include "spin/cuda_data_plane.h"
#include "spin/data_plane.h"

namespace spin {

class BudgetController;  // spin/budget.h (C++20)
struct BudgetTuning;

/// What a data plane is made of.
struct DataPlaneSpec {
  Geometry geometry = {};
  uint64_t seed = 0;  ///< the session seed of the exploration draws
  Policy policy = {};
  /// The arena in device memory of the calling thread's current CUDA device, run by the CUDA
  /// backend; false: host memory, run by the CPU reference.
  bool on_device = false;
  CudaDataPlaneOptions cuda = {};  ///< the CUDA backend's options (on_device only)
};

/// Writes a fresh arena for `spec` into [base, base + bytes), memory the caller owns and keeps
/// until the data plane is destroyed (spind's memfd or VMM allocation, libspin_client's device
/// window; 256-byte aligned, device memory when spec.on_device), and returns the data plane
/// over it. Errors: a bad geometry or policy, too few bytes, a device arena in a build without
/// the CUDA backend, a CUDA error.
absl::StatusOr<std::unique_ptr<DataPlane>> MakeDataPlane(void* base, uint64_t bytes,
                                                         const DataPlaneSpec& spec);

/// MakeDataPlane over an arena of its own, allocated here (host memory aligned to kArenaAlign,
/// or DeviceAlloc on the current device) and freed when the data plane is destroyed.
absl::StatusOr<std::unique_ptr<DataPlane>> NewDataPlane(const DataPlaneSpec& spec);

/// Copies `bytes` at `src`, a pointer into dp.arena(), to host memory: a memcpy, or a
/// synchronous device-to-host copy.
absl::Status ReadArena(const DataPlane& dp, void* dst, const void* src, uint64_t bytes);

/// The arena's policy block, epoch included (ReadArena).
absl::StatusOr<ArenaPolicy> ReadArenaPolicy(const DataPlane& dp);

/// Writes a policy (and, in uniform mode, the budget table) into the data plane's arena and
/// bumps the epoch: WritePolicy, or WriteDevicePolicy on `stream`, which it synchronises.
absl::Status WriteArenaPolicy(const DataPlane& dp, const Policy& policy,
                              cudaStream_t stream = nullptr);

/// Writes a budget table into the data plane's arena and bumps the epoch; the kernels read the
/// table at their next launch. WriteBudgetTable on a host arena; on a device arena the same
/// checks, then the table and then the epoch. Errors: ValidateBudgetTable's (nothing written).
absl::Status WriteArenaBudgets(const DataPlane& dp, const std::vector<double>& sparsity);

/// Per-layer budgets in the process that runs the data plane, as spind's probe thread computes
/// them for its sessions: after each probe step the arena's curves and statistics go to a
/// BudgetController, and a table it returns goes to the arena (WriteArenaBudgets). In the
/// per-layer and miss-target modes (TableFromProbes); the mode, target, miss target, exploration
/// and probe period are read from the arena's policy at every call. Not thread-safe.
class LocalBudgets {
 public:
  /// A controller for geometry `g` with `tuning` (ValidateBudgetTuning's errors), or with the
  /// default tuning.
  static absl::StatusOr<LocalBudgets> Create(const Geometry& g, const BudgetTuning& tuning);
  static absl::StatusOr<LocalBudgets> Create(const Geometry& g);
  LocalBudgets(LocalBudgets&&) noexcept;
  LocalBudgets& operator=(LocalBudgets&&) noexcept;
  ~LocalBudgets();

  /// Writes the first table of a session, with a new epoch: the uniform table at the arena's
  /// target sparsity, dense in the miss-target mode (InitialBudget, as a new arena starts).
  absl::Status WriteInitial(const DataPlane& dp);

  /// Call after step `step` (0: the first step begun) has run. On a probe step (the arena's
  /// probe period P > 0 divides it), and in the miss-target mode on every step (its sparse
  /// steps are measured too), feeds the controller and writes the table it returns, if any;
  /// true when a table was written. On a device arena each call copies the policy (and when it
  /// feeds the controller the curves and statistics) to the host: a synchronising copy.
  absl::StatusOr<bool> AfterStep(const DataPlane& dp, int64_t step);

  /// Tables the controller returned so far.
  uint64_t recomputes() const;

 private:
  LocalBudgets(const Geometry& g, const BudgetTuning& tuning);

  std::unique_ptr<BudgetController> controller_;
  std::vector<uint64_t> curves_;   // host copies of the arena's curves
  std::vector<LayerStats> stats_;  // and of its layer statistics
};

}  // namespace spin
