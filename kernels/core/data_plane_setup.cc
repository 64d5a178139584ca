#include "spin/data_plane_setup.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "spin/budget.h"
#include "spin/status_macros.h"

namespace spin {
#if !SPIN_HAVE_CUDA
namespace {

absl::Status NoCudaBackend() {
  return absl::FailedPreconditionError(
      "a device arena needs the CUDA backend, which this build does not have");
}

}  // namespace
#endif

absl::StatusOr<std::unique_ptr<DataPlane>> MakeDataPlane(void* base, uint64_t bytes,
                                                         const DataPlaneSpec& spec) {
  if (!spec.on_device) {
    SPIN_ASSIGN_OR_RETURN(ArenaView view,
                          InitArena(base, bytes, spec.geometry, spec.seed, spec.policy));
    return MakeCpuDataPlane(view);
  }
#if SPIN_HAVE_CUDA
  SPIN_ASSIGN_OR_RETURN(ArenaView view,
                        InitDeviceArena(base, bytes, spec.geometry, spec.seed, spec.policy));
  return MakeCudaDataPlane(view, spec.cuda);
#else
  return NoCudaBackend();
#endif
}

absl::StatusOr<std::unique_ptr<DataPlane>> NewDataPlane(const DataPlaneSpec& spec) {
  // Checked first: ArenaBytes of a geometry out of range could overflow.
  SPIN_RETURN_IF_ERROR(ValidateGeometry(spec.geometry));
  const uint64_t bytes = ArenaBytes(spec.geometry);
  std::shared_ptr<void> memory;
  if (!spec.on_device) {
    // ArenaBytes is a multiple of kArenaAlign, as aligned_alloc needs.
    void* p = std::aligned_alloc(kArenaAlign, bytes);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate a ", bytes, "-byte arena"));
    }
    memory = std::shared_ptr<void>(p, std::free);
  } else {
#if SPIN_HAVE_CUDA
    SPIN_ASSIGN_OR_RETURN(void* p, DeviceAlloc(bytes));
    memory = std::shared_ptr<void>(p, DeviceFree);
#else
    return NoCudaBackend();
#endif
  }
  SPIN_ASSIGN_OR_RETURN(std::unique_ptr<DataPlane> dp, MakeDataPlane(memory.get(), bytes, spec));
  dp->OwnArenaMemory(std::move(memory));
  return dp;
}

absl::Status ReadArena(const DataPlane& dp, void* dst, const void* src, uint64_t bytes) {
  if (!dp.on_device()) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
#if SPIN_HAVE_CUDA
  return CopyToHost(dst, src, bytes);
#else
  return NoCudaBackend();
#endif
}

absl::StatusOr<ArenaPolicy> ReadArenaPolicy(const DataPlane& dp) {
  ArenaPolicy p;
  SPIN_RETURN_IF_ERROR(ReadArena(dp, &p, dp.arena().policy, sizeof(p)));
  return p;
}

absl::Status WriteArenaPolicy(const DataPlane& dp, const Policy& policy, cudaStream_t stream) {
  if (!dp.on_device()) return WritePolicy(dp.arena(), policy);
#if SPIN_HAVE_CUDA
  return WriteDevicePolicy(dp.arena(), policy, stream);
#else
  return NoCudaBackend();
#endif
}

absl::Status WriteArenaBudgets(const DataPlane& dp, const std::vector<double>& sparsity) {
  const ArenaView& a = dp.arena();
  if (!dp.on_device()) return WriteBudgetTable(a, sparsity);
#if SPIN_HAVE_CUDA
  SPIN_RETURN_IF_ERROR(ValidateBudgetTable(a.geometry, sparsity));
  // The table before its epoch: a reader that sees the new epoch sees the new table.
  SPIN_RETURN_IF_ERROR(CopyToDevice(a.sparsity, sparsity.data(), sparsity.size() * sizeof(double)));
  SPIN_ASSIGN_OR_RETURN(ArenaPolicy p, ReadArenaPolicy(dp));
  p.epoch += 1;
  return CopyToDevice(&a.policy->epoch, &p.epoch, sizeof(p.epoch));
#else
  return NoCudaBackend();
#endif
}

LocalBudgets::LocalBudgets(const Geometry& g, const BudgetTuning& tuning)
    : controller_(std::make_unique<BudgetController>(g, tuning)),
      curves_(static_cast<size_t>(g.layers) * kCurvePoints),
      stats_(g.layers) {}
LocalBudgets::LocalBudgets(LocalBudgets&&) noexcept = default;
LocalBudgets& LocalBudgets::operator=(LocalBudgets&&) noexcept = default;
LocalBudgets::~LocalBudgets() = default;

absl::StatusOr<LocalBudgets> LocalBudgets::Create(const Geometry& g, const BudgetTuning& tuning) {
  SPIN_RETURN_IF_ERROR(ValidateBudgetTuning(tuning));
  return LocalBudgets(g, tuning);
}

absl::StatusOr<LocalBudgets> LocalBudgets::Create(const Geometry& g) {
  return Create(g, BudgetTuning{});
}

uint64_t LocalBudgets::recomputes() const { return controller_->recomputes(); }

absl::Status LocalBudgets::WriteInitial(const DataPlane& dp) {
  SPIN_ASSIGN_OR_RETURN(const ArenaPolicy p, ReadArenaPolicy(dp));
  Policy mode;  // only the fields InitialBudget reads
  mode.target_sparsity = p.target_sparsity;
  mode.budget_mode = static_cast<BudgetMode>(p.budget_mode);
  const std::vector<double> table(dp.arena().geometry.layers, InitialBudget(mode));
  return WriteArenaBudgets(dp, table);
}

absl::StatusOr<bool> LocalBudgets::AfterStep(const DataPlane& dp, int64_t step) {
  SPIN_ASSIGN_OR_RETURN(const ArenaPolicy p, ReadArenaPolicy(dp));
  // A miss-target session's controller also measures every sparse step (the exploration
  // estimate), so it reads the counters after every step; the other modes after probe steps.
  const bool every = p.budget_mode == static_cast<uint32_t>(BudgetMode::kMissTarget);
  if (p.probe_period == 0 || step < 0 || (!every && step % p.probe_period != 0)) return false;
  const ArenaView& a = dp.arena();
  SPIN_RETURN_IF_ERROR(ReadArena(dp, curves_.data(), a.curves, curves_.size() * sizeof(uint64_t)));
  SPIN_RETURN_IF_ERROR(ReadArena(dp, stats_.data(), a.stats, stats_.size() * sizeof(LayerStats)));
  const bool miss_target = p.budget_mode == static_cast<uint32_t>(BudgetMode::kMissTarget);
  SPIN_ASSIGN_OR_RETURN(std::optional<BudgetUpdate> u,
                        controller_->Update(ProbeSnapshot{curves_, stats_}, p.target_sparsity,
                                            miss_target ? p.miss_target : 0.0, p.exploration));
  if (!u.has_value()) return false;
  SPIN_RETURN_IF_ERROR(WriteArenaBudgets(dp, u->sparsity));
  return true;
}

#if !SPIN_HAVE_CUDA
// Without the CUDA backend there is never a device (spin/cuda_data_plane.h); the CUDA build
// defines it in kernels/cuda/.
bool CudaAvailable() { return false; }
#endif

}  // namespace spin
