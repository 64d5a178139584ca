#include "resilient_data_plane.h"

#include <poll.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "log.h"
#include "spin/budget.h"
#include "spin/data_plane_setup.h"
#include "spin/status_macros.h"

#if SPIN_HAVE_CUDA
#include <cuda_runtime.h>

#include "spin/shared_device_memory.h"
#endif

namespace spin::client {
namespace {

// The dense fallback's arena: the session's geometry and seed at 0% sparsity, no exploration.
DataPlaneSpec DenseSpec(const AttachOptions& o) {
  DataPlaneSpec spec{.geometry = o.geometry, .seed = o.seed, .policy = o.policy};
  spec.policy.target_sparsity = 0.0;
  spec.policy.exploration = 0.0;
  spec.policy.budget_mode = BudgetMode::kUniform;
  return spec;
}

}  // namespace

ResilientDataPlane::ResilientDataPlane(std::string target, AttachOptions options,
                                       std::chrono::milliseconds retry)
    : target_(std::move(target)), options_(std::move(options)), retry_(retry) {
  options_.require_backend = 1;
  absl::StatusOr<std::unique_ptr<DataPlane>> dp = NewDataPlane(DenseSpec(options_));
  if (dp.ok()) fallback_ = std::move(*dp);
  thread_ = std::thread([this] { Retry(); });
}

#if SPIN_HAVE_CUDA
ResilientDataPlane::ResilientDataPlane(std::string target, AttachOptions options,
                                       std::chrono::milliseconds retry, DeviceTag)
    : target_(std::move(target)), options_(std::move(options)), retry_(retry), on_device_(true) {
  options_.defer_device_map = true;
  options_.require_backend = 2;
}

absl::StatusOr<std::unique_ptr<ResilientDataPlane>> ResilientDataPlane::CreateOnDevice(
    std::string target, AttachOptions options, std::chrono::milliseconds retry) {
  std::unique_ptr<ResilientDataPlane> r(
      new ResilientDataPlane(std::move(target), std::move(options), retry, DeviceTag{}));
  SPIN_ASSIGN_OR_RETURN(int dev, CudaCurrentDevice());
  const uint64_t bytes = ArenaBytes(r->options_.geometry);
  SPIN_ASSIGN_OR_RETURN(std::unique_ptr<DeviceWindow> w, DeviceWindow::Create(dev, bytes));
  DataPlaneSpec spec = DenseSpec(r->options_);
  spec.on_device = true;
  spec.cuda.defer_ema = r->options_.defer_ema;
  // One data plane drives the window for the engine's lifetime: its scratch buffers and the
  // arena's addresses are what the engine's captured graphs hold.
  SPIN_ASSIGN_OR_RETURN(r->fallback_, MakeDataPlane(w->ptr(), bytes, spec));
  SPIN_ASSIGN_OR_RETURN(ArenaHeader h, MakeArenaHeader(r->options_.geometry, r->options_.seed));
  r->window_header_ = h;
  r->window_ = std::shared_ptr<DeviceWindow>(std::move(w));
  r->thread_ = std::thread([p = r.get()] { p->Retry(); });
  return r;
}
#endif

ResilientDataPlane::~ResilientDataPlane() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  session_.reset();
  ready_.reset();
  fallback_.reset();
  window_.reset();
}

void ResilientDataPlane::Retry() {
  bool logged = false;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (!to_detach_.empty()) {
      std::vector<std::unique_ptr<Session>> refused = std::move(to_detach_);
      to_detach_.clear();
      lock.unlock();
      for (auto& r : refused) (void)r->Detach();
      lock.lock();
    }
    if (want_session_ && !ready_) {
      lock.unlock();
      absl::StatusOr<std::unique_ptr<Session>> s = Session::Attach(target_, options_);
      lock.lock();
      if (s.ok()) {
        ready_ = std::move(*s);
        want_session_ = false;
        logged = false;
      } else if (!logged) {
        Log(LogLevel::kWarning,
            absl::StrCat("cannot attach to spind at ", target_, " (", s.status().message(),
                         "); retrying every ", retry_.count(), " ms",
                         has_session_ ? "" : ", selections dense until then"));
        logged = true;
      }
    }
    cv_.wait_for(lock, retry_, [this] { return stop_; });
  }
}

bool ResilientDataPlane::attached() const { return session_ != nullptr; }

std::string ResilientDataPlane::session_id() const { return session_ ? session_->id() : ""; }

DataPlane& ResilientDataPlane::current() const {
  // GPU engines: one data plane over the fixed window, whichever arena is mapped there.
  if (on_device_) return *fallback_;
  return session_ ? session_->data_plane() : *fallback_;
}

const ArenaView& ResilientDataPlane::arena() const { return current().arena(); }

absl::Status ResilientDataPlane::ResetSequence(int32_t seq, uint64_t key, cudaStream_t stream) {
  absl::Status s = current().ResetSequence(seq, key, stream);
  if (s.ok()) open_[seq] = key;
  return s;
}

absl::Status ResilientDataPlane::BeginStep(const StepBatch& batch, cudaStream_t stream) {
  bool capturing = false;
#if SPIN_HAVE_CUDA
  // A switch synchronises the device, which a stream capture forbids: not while capturing.
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (on_device_ && cudaStreamIsCapturing(stream, &cs) == cudaSuccess) {
    capturing = cs != cudaStreamCaptureStatusNone;
  }
#endif
  if (!capturing) (void)Refresh();
  return current().BeginStep(batch, stream);
}

absl::Status ResilientDataPlane::Refresh() {
  // Between steps: notice a dead daemon, switch in a session the retry thread attached.
  if (session_ && !lost_ && !session_->alive()) {
    Log(LogLevel::kWarning, absl::StrCat("lost spind session ", session_->id(),
                                         ": keeping the mapped arena, reattaching"));
    lost_ = true;
    std::lock_guard<std::mutex> lock(mu_);
    want_session_ = true;
    cv_.notify_all();
  }
  std::unique_ptr<Session> next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    next = std::move(ready_);
  }
  if (next && !next->mapped()) {
#if SPIN_HAVE_CUDA
    // Same addresses as before: the old arena (fallback or previous session) is replaced, and
    // the one data plane keeps driving the window (no new scratch, no new pointers).
    absl::Status s = std::memcmp(&next->header(), &window_header_, sizeof(window_header_)) == 0
                         ? next->MapInto(*std::static_pointer_cast<DeviceWindow>(window_), false)
                         : absl::FailedPreconditionError(
                               "the session's arena layout differs from the "
                               "engine's (geometry or seed)");
    if (!s.ok()) {
      Log(LogLevel::kWarning,
          absl::StrCat("cannot use spind session ", next->id(), ": ", s.message(), "; retrying"));
      std::lock_guard<std::mutex> lock(mu_);
      to_detach_.push_back(std::move(next));  // detached by the retry thread, not here
      want_session_ = true;
      cv_.notify_all();
    }
#endif
  }
  if (next) {
    DataPlane& dp = on_device_ ? *fallback_ : next->data_plane();
    for (const auto& [seq, key] : open_) {
      // Never fail the engine over SPIN (docs/design.md §7): a sequence that cannot be reopened is
      // logged; its steps are then rejected by the data plane's own checks.
      if (absl::Status s = dp.ResetSequence(seq, key); !s.ok()) {
        Log(LogLevel::kError, absl::StrCat("cannot reopen sequence ", seq, " in session ",
                                           next->id(), ": ", s.message()));
      }
    }
#if SPIN_HAVE_CUDA
    // The resets ran on the legacy default stream, which an engine stream created non-blocking
    // does not wait for: finish them before the next step can begin on it. (A switch is rare and
    // has synchronised the device already to remap the arena.)
    if (on_device_) {
      if (const cudaError_t e = cudaStreamSynchronize(nullptr); e != cudaSuccess) {
        Log(LogLevel::kError, absl::StrCat("reopening sequences in session ", next->id(), ": ",
                                           cudaGetErrorString(e)));
      }
    }
#endif
    session_ = std::move(next);
    has_session_ = true;
    lost_ = false;
    generation_ += 1;
    if (adopted_policy_) {
      if (absl::Status s = WriteAdopted(nullptr); !s.ok()) {
        Log(LogLevel::kError, absl::StrCat("cannot write the adopted control into session ",
                                           session_->id(), ": ", s.message()));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Control> ResilientDataPlane::GetControl() {
  if (!session_) return absl::UnavailableError("no spind session (running dense)");
  return session_->GetControl();
}

absl::StatusOr<Policy> ResilientDataPlane::SetPolicy(const PolicyChange& change) {
  if (!session_) return absl::UnavailableError("no spind session (running dense)");
  return session_->SetPolicy(change);
}

absl::Status ResilientDataPlane::AdoptControl(const Policy& policy,
                                              std::span<const double> layer_sparsity,
                                              cudaStream_t stream) {
  SPIN_RETURN_IF_ERROR(ValidatePolicy(policy));
  SPIN_RETURN_IF_ERROR(ValidateBudgetTable(options_.geometry, layer_sparsity));
  adopted_policy_ = policy;
  adopted_table_.assign(layer_sparsity.begin(), layer_sparsity.end());
  if (!session_) return absl::OkStatus();  // written into the first session switched in
  return WriteAdopted(stream);
}

// The adopted policy, then (per-layer mode) the table, into the arena the steps run on.
absl::Status ResilientDataPlane::WriteAdopted(cudaStream_t stream) {
  const DataPlane& dp = current();
  SPIN_RETURN_IF_ERROR(WriteArenaPolicy(dp, *adopted_policy_, stream));
  if (!TableFromProbes(adopted_policy_->budget_mode)) return absl::OkStatus();
  return WriteArenaBudgets(dp, adopted_table_);
}

absl::Status ResilientDataPlane::Select(int32_t layer, const int32_t* block_table,
                                        int64_t table_stride, cudaStream_t stream) {
  return current().Select(layer, block_table, table_stride, stream);
}

absl::Status ResilientDataPlane::Remap(int32_t* idx, int32_t count, cudaStream_t stream) {
  return current().Remap(idx, count, stream);
}

absl::Status ResilientDataPlane::RemapTopK(int32_t* idx, int32_t count, cudaStream_t stream) {
  return current().RemapTopK(idx, count, stream);
}

absl::Status ResilientDataPlane::RemapAndObserve(int32_t layer, int32_t* idx, int32_t count,
                                                 const float* logits, int64_t stride,
                                                 const int32_t* accepted, cudaStream_t stream) {
  return current().RemapAndObserve(layer, idx, count, logits, stride, accepted, stream);
}

absl::Status ResilientDataPlane::Observe(int32_t layer, const float* logits, int64_t stride,
                                         const int32_t* accepted, cudaStream_t stream) {
  return current().Observe(layer, logits, stride, accepted, stream);
}

}  // namespace spin::client
