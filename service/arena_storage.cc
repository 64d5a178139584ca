#include "arena_storage.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "spin/data_plane_setup.h"
#include "spin/status_macros.h"

namespace spin::service {

namespace {

// The CPU backend: the arena is a memfd mapped here and in the client; the daemon's view is
// the arena itself, so pulls are no-ops.
class CpuArenaStorage final : public ArenaStorage {
 public:
  ~CpuArenaStorage() override {
    dp_.reset();
    if (base_ != nullptr) munmap(base_, bytes_);
    if (memfd_ >= 0) close(memfd_);
  }

  absl::Status Init(const Geometry& g, uint64_t seed, const Policy& policy) {
    bytes_ = ArenaBytes(g);
    // A memfd so that a client can map the same pages (fd passing over a Unix socket); it
    // lives as long as a mapping or descriptor holds it.
    memfd_ = memfd_create("spin-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (memfd_ < 0 || ftruncate(memfd_, static_cast<off_t>(bytes_)) != 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot create a ", bytes_, "-byte arena (memfd): out of memory?"));
    }
    // Sealed at its size before anyone else can hold it: a client holding the fd cannot shrink
    // it (spind would then die of SIGBUS reading the lost pages), grow it, or change the seals.
    if (fcntl(memfd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      return absl::InternalError(
          absl::StrCat("cannot seal the arena's memfd: ", std::strerror(errno)));
    }
    void* base = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, memfd_, 0);
    if (base == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot map a ", bytes_, "-byte arena"));
    }
    base_ = base;
    SPIN_ASSIGN_OR_RETURN(
        dp_, MakeDataPlane(base_, bytes_, {.geometry = g, .seed = seed, .policy = policy}));
    host_ = dp_->arena();
    return absl::OkStatus();
  }

  Backend backend() const override { return Backend::kCpu; }
  uint64_t mapping_bytes() const override { return bytes_; }
  absl::StatusOr<int> ExportFd() const override {
    const int fd = fcntl(memfd_, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return absl::ResourceExhaustedError("cannot duplicate the arena's memfd");
    return fd;
  }
  absl::Status PullControl() override { return absl::OkStatus(); }
  absl::Status PullOutputs() override { return absl::OkStatus(); }
  absl::Status WritePolicy(const Policy& p) override { return WriteArenaPolicy(*dp_, p); }
  absl::Status WriteBudgets(const double* sparsity) override {
    return WriteArenaBudgets(*dp_, std::vector<double>(sparsity, sparsity + host_.geometry.layers));
  }
  absl::Status ResetSequence(int32_t seq, uint64_t key) override {
    return dp_->ResetSequence(seq, key);
  }
  absl::Status CheckStep(const StepBatch& b) override { return ValidateStepBatch(host_, b); }
  absl::Status BeginStep(const StepBatch& b) override { return dp_->BeginStep(b); }
  absl::Status Select(int32_t layer) override { return dp_->Select(layer); }
  absl::Status Observe(int32_t layer, const float* logits, int64_t stride, const int32_t* accepted,
                       int32_t* topk, int32_t count) override {
    if (topk == nullptr) return dp_->Observe(layer, logits, stride, accepted);
    return dp_->RemapAndObserve(layer, topk, count, logits, stride, accepted);
  }

 private:
  int memfd_ = -1;
  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  std::unique_ptr<DataPlane> dp_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ArenaStorage>> MakeCpuArenaStorage(const Geometry& g, uint64_t seed,
                                                                  const Policy& policy) {
  auto s = std::make_unique<CpuArenaStorage>();
  SPIN_RETURN_IF_ERROR(s->Init(g, seed, policy));
  return std::unique_ptr<ArenaStorage>(std::move(s));
}

uint64_t HostMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  uint64_t bytes = pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * page : 0;
  // cgroup v2, then v1: "max" or an absurd v1 value means no limit.
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    unsigned long long limit = 0;
    if (f >> limit && limit > 0 && (bytes == 0 || limit < bytes)) bytes = limit;
  }
  return bytes;
}

#ifndef SPIN_HAVE_CUDA
uint64_t CudaDeviceFreeBytesOrZero(int) { return 0; }
bool CudaBackendUsable(int, std::string* why) {
  *why = "this spind was built without the CUDA backend (the CUDA toolkit was not found)";
  return false;
}
absl::StatusOr<std::unique_ptr<ArenaStorage>> MakeCudaArenaStorage(int, const Geometry&, uint64_t,
                                                                   const Policy&) {
  return absl::FailedPreconditionError("this spind was built without the CUDA backend");
}
std::string CudaDeviceUuidOrEmpty(int) { return ""; }
#endif

}  // namespace spin::service
