// The CUDA backend of ArenaStorage: the arena is a VMM allocation on the daemon's GPU, exported
// as a POSIX file descriptor; the daemon keeps a host mirror for reads (built only with
// SPIN_HAVE_CUDA).
#include <sys/mman.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "arena_storage.h"
#include "spin/cuda_data_plane.h"
#include "spin/data_plane_setup.h"
#include "spin/shared_device_memory.h"
#include "spin/status_macros.h"

namespace spin::service {
namespace {

// Device staging for remote-mode inputs, grown on demand (remote mode is a tool path, never
// the engine's hot path, so allocating here is fine).
class Staging {
 public:
  ~Staging() {
    if (p_ != nullptr) DeviceFree(p_);
  }
  absl::StatusOr<void*> Put(const void* host, uint64_t bytes) {
    if (bytes > cap_) {
      if (p_ != nullptr) DeviceFree(p_);
      p_ = nullptr;
      cap_ = 0;
      SPIN_ASSIGN_OR_RETURN(void* m, DeviceAlloc(bytes));
      p_ = m;
      cap_ = bytes;
    }
    if (bytes > 0) {
      SPIN_RETURN_IF_ERROR(CopyToDevice(p_, host, bytes));
    }
    return p_;
  }

 private:
  void* p_ = nullptr;
  uint64_t cap_ = 0;
};

class CudaArenaStorage final : public ArenaStorage {
 public:
  ~CudaArenaStorage() override {
    (void)CudaSetDevice(ordinal_);  // freed from whichever thread drops the session
    dp_.reset();
    mem_.reset();
    if (mirror_ != nullptr) munmap(mirror_, bytes_);
  }

  absl::Status Init(int ordinal, const Geometry& g, uint64_t seed, const Policy& policy) {
    ordinal_ = ordinal;
    SPIN_RETURN_IF_ERROR(CudaSetDevice(ordinal));
    SPIN_ASSIGN_OR_RETURN(std::string uuid, CudaDeviceUuid(ordinal));
    uuid_ = uuid;
    bytes_ = ArenaBytes(g);
    absl::StatusOr<std::unique_ptr<SharedDeviceMemory>> mem =
        SharedDeviceMemory::Create(ordinal, bytes_);
    if (!mem.ok()) {
      return absl::Status(mem.status().code(),
                          absl::StrCat("cannot allocate a ", bytes_, "-byte arena on GPU ", ordinal,
                                       " (", uuid_, "): ", mem.status().message()));
    }
    mem_ = std::move(*mem);
    DataPlaneSpec spec{.geometry = g, .seed = seed, .policy = policy, .on_device = true};
    // The daemon's data plane runs remote-mode steps, one RPC at a time: Observe's Probe beside
    // the EMA would save it nothing, and would cost every session a CUDA stream and two events
    // in a process that outlives its sessions.
    spec.cuda.probe_beside_ema = false;
    SPIN_ASSIGN_OR_RETURN(dp_, MakeDataPlane(mem_->ptr(), bytes_, spec));
    view_ = dp_->arena();
    // The mirror has the arena's layout but only the pages a pull touches are ever backed.
    void* m = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return absl::ResourceExhaustedError("cannot reserve the arena mirror");
    mirror_ = m;
    SPIN_RETURN_IF_ERROR(CopyToHost(mirror_, mem_->ptr(), sizeof(ArenaHeader)));
    SPIN_ASSIGN_OR_RETURN(ArenaView host, ViewArena(mirror_, bytes_));
    host_ = host;
    return PullControl();
  }

  Backend backend() const override { return Backend::kCuda; }
  uint64_t mapping_bytes() const override { return mem_->bytes(); }
  std::string device_uuid() const override { return uuid_; }
  absl::StatusOr<int> ExportFd() const override {
    SPIN_RETURN_IF_ERROR(CudaSetDevice(ordinal_));
    return mem_->ExportFd();
  }

  absl::Status PullControl() override {
    // Header, policy, budget table, statistics and curves are contiguous up to the sequences.
    return Pull(0, host_.header->off_seqs);
  }
  // Sequence records (open flags) for validating a remote step on the host.
  absl::Status PullSeqs() { return Pull(host_.header->off_seqs, host_.header->off_fresh); }
  absl::Status PullOutputs() override {
    // Batch header and entries, union counts and ids, compacted table and lengths.
    const ArenaHeader& h = *host_.header;
    return Pull(h.off_batch, h.off_scratch);
  }

  absl::Status WritePolicy(const Policy& p) override {
    SPIN_RETURN_IF_ERROR(Use());
    SPIN_RETURN_IF_ERROR(WriteArenaPolicy(*dp_, p));
    return PullControl();
  }
  absl::Status WriteBudgets(const double* sparsity) override {
    SPIN_RETURN_IF_ERROR(Use());
    SPIN_RETURN_IF_ERROR(
        WriteArenaBudgets(*dp_, std::vector<double>(sparsity, sparsity + host_.geometry.layers)));
    return PullControl();
  }

  absl::Status ResetSequence(int32_t seq, uint64_t key) override {
    SPIN_RETURN_IF_ERROR(Use());
    SPIN_RETURN_IF_ERROR(dp_->ResetSequence(seq, key));
    return CheckDeviceError("OpenSequences");
  }
  absl::Status CheckStep(const StepBatch& b) override {
    // The CPU backend's checks, on the mirror, before anything changes: same statuses.
    SPIN_RETURN_IF_ERROR(Use());
    SPIN_RETURN_IF_ERROR(PullSeqs());
    return ValidateStepBatch(host_, b);
  }
  absl::Status BeginStep(const StepBatch& b) override {
    SPIN_RETURN_IF_ERROR(CheckStep(b));
    const uint64_t n = static_cast<uint64_t>(std::max(b.n, 0));
    std::vector<int32_t> packed(3 * n);
    std::copy(b.seq, b.seq + n, packed.begin());
    std::copy(b.ctx_len, b.ctx_len + n, packed.begin() + n);
    std::copy(b.q_pos, b.q_pos + n, packed.begin() + 2 * n);
    SPIN_ASSIGN_OR_RETURN(void* d, batch_.Put(packed.data(), packed.size() * sizeof(int32_t)));
    const auto* base = static_cast<const int32_t*>(d);
    const StepBatch db{base, base + n, base + 2 * n, b.n, b.rows};
    SPIN_RETURN_IF_ERROR(dp_->BeginStep(db));
    return CheckDeviceError("BeginStep");
  }
  absl::Status Select(int32_t layer) override {
    SPIN_RETURN_IF_ERROR(Use());
    SPIN_RETURN_IF_ERROR(dp_->Select(layer));
    return CheckDeviceError("Select");
  }
  absl::Status Observe(int32_t layer, const float* logits, int64_t stride, const int32_t* accepted,
                       int32_t* topk, int32_t count) override {
    SPIN_RETURN_IF_ERROR(PullOutputs());
    if (host_.batch->selected_layer == layer) {
      // Otherwise the data plane's own call-order check answers below.
      if (absl::Status s = ValidateObserveInputs(host_, logits, stride, accepted); !s.ok()) {
        return s;
      }
    }
    const uint64_t rows = static_cast<uint64_t>(host_.batch->n) * host_.batch->rows;
    SPIN_ASSIGN_OR_RETURN(void* dl, logits_.Put(logits, rows * stride * sizeof(float)));
    const int32_t* da = nullptr;
    if (accepted != nullptr) {
      SPIN_ASSIGN_OR_RETURN(void* d, accepted_.Put(accepted, host_.batch->n * sizeof(int32_t)));
      da = static_cast<const int32_t*>(d);
    }
    if (topk == nullptr) {
      SPIN_RETURN_IF_ERROR(dp_->Observe(layer, static_cast<const float*>(dl), stride, da));
    } else {
      const uint64_t idx_bytes = rows * static_cast<uint64_t>(count) * sizeof(int32_t);
      SPIN_ASSIGN_OR_RETURN(void* dt, topk_.Put(topk, idx_bytes));
      // The mapped indices stay on the device: the caller does not read them (no copy back that
      // could fail a call whose observation already happened).
      SPIN_RETURN_IF_ERROR(dp_->RemapAndObserve(layer, static_cast<int32_t*>(dt), count,
                                                static_cast<const float*>(dl), stride, da));
    }
    return CheckDeviceError("ObserveScores");
  }

 private:
  // spind's threads (gRPC, probe, metrics, fd server) each start on device 0: every call
  // makes the arena's device current first.
  absl::Status Use() { return CudaSetDevice(ordinal_); }
  absl::Status Pull(uint64_t from, uint64_t to) {
    SPIN_RETURN_IF_ERROR(Use());
    return CopyToHost(static_cast<uint8_t*>(mirror_) + from,
                      static_cast<const uint8_t*>(mem_->ptr()) + from, to - from);
  }
  // Remote mode waits for its work anyway: a bounds error the kernels recorded becomes the
  // call's status (and the word is cleared for the next call).
  absl::Status CheckDeviceError(const char* what) {
    SPIN_ASSIGN_OR_RETURN(uint32_t e, ReadDeviceError(view_));
    if (e == kArenaOk) return absl::OkStatus();
    const uint32_t zero = 0;
    (void)CopyToDevice(view_.error, &zero, sizeof(zero));
    const char* why = e == kArenaBadBatch ? "an entry failed validation (sequence out of range, "
                                            "not open or repeated, or ctx_len / q_pos out of "
                                            "range); the step has no entries"
                      : e == kArenaBadAccepted ? "accepted outside [0, rows]"
                      : e == kArenaBadStride   ? "logits shorter than a row's compacted length"
                      : e == kArenaNoSelect    ? "no Select in this step"
                                               : "unknown device error";
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", why, " (arena error ", e, ")"));
  }

  std::unique_ptr<SharedDeviceMemory> mem_;
  int ordinal_ = 0;
  uint64_t bytes_ = 0;
  std::string uuid_;
  ArenaView view_;
  std::unique_ptr<DataPlane> dp_;
  void* mirror_ = nullptr;
  Staging batch_, logits_, accepted_, topk_;
};

}  // namespace

bool CudaBackendUsable(int ordinal, std::string* why) {
  const int n = CudaDeviceCount();
  if (n == 0) {
    *why = "no CUDA device is usable (no NVIDIA driver or no GPU visible)";
    return false;
  }
  if (ordinal < 0 || ordinal >= n) {
    *why = absl::StrCat("--device ", ordinal, " does not exist: this process sees ", n,
                        " CUDA device(s)");
    return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<ArenaStorage>> MakeCudaArenaStorage(int ordinal, const Geometry& g,
                                                                   uint64_t seed,
                                                                   const Policy& policy) {
  auto s = std::make_unique<CudaArenaStorage>();
  SPIN_RETURN_IF_ERROR(s->Init(ordinal, g, seed, policy));
  return std::unique_ptr<ArenaStorage>(std::move(s));
}

std::string CudaDeviceUuidOrEmpty(int ordinal) {
  absl::StatusOr<std::string> u = CudaDeviceUuid(ordinal);
  return u.ok() ? *u : "";
}

uint64_t CudaDeviceFreeBytesOrZero(int ordinal) {
  absl::StatusOr<uint64_t> f = CudaDeviceFreeBytes(ordinal);
  return f.ok() ? *f : 0;
}

}  // namespace spin::service
