#include "resilient_data_plane.h"

#include <poll.h>

#include <cstdio>
#include <cstdlib>

namespace spin::client {

ResilientDataPlane::ResilientDataPlane(std::string target, AttachOptions options,
                                       std::chrono::milliseconds retry)
    : target_(std::move(target)), options_(std::move(options)), retry_(retry) {
  Policy dense = options_.policy;
  dense.target_sparsity = 0.0;
  dense.exploration = 0.0;
  dense.budget_mode = BudgetMode::kUniform;
  const uint64_t bytes = ArenaBytes(options_.geometry);
  fallback_mem_ =
      std::aligned_alloc(kArenaAlign, (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign);
  absl::StatusOr<ArenaView> v =
      fallback_mem_ ? InitArena(fallback_mem_, bytes, options_.geometry, options_.seed, dense)
                    : absl::ResourceExhaustedError("no memory for the fallback arena");
  if (v.ok()) fallback_ = MakeCpuDataPlane(*v);
  thread_ = std::thread([this] { Retry(); });
}

ResilientDataPlane::~ResilientDataPlane() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  session_.reset();
  ready_.reset();
  fallback_.reset();
  std::free(fallback_mem_);
}

void ResilientDataPlane::Retry() {
  bool logged = false;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (want_session_ && !ready_) {
      lock.unlock();
      absl::StatusOr<std::unique_ptr<Session>> s = Session::Attach(target_, options_);
      lock.lock();
      if (s.ok()) {
        ready_ = std::move(*s);
        want_session_ = false;
        logged = false;
      } else if (!logged) {
        std::fprintf(stderr,
                     "spin_client: cannot attach to spind at %s (%s); retrying every %lld ms%s\n",
                     target_.c_str(), std::string(s.status().message()).c_str(),
                     static_cast<long long>(retry_.count()),
                     has_session_ ? "" : ", selections dense until then");
        logged = true;
      }
    }
    cv_.wait_for(lock, retry_, [this] { return stop_; });
  }
}

bool ResilientDataPlane::attached() const { return session_ != nullptr; }

std::string ResilientDataPlane::session_id() const { return session_ ? session_->id() : ""; }

DataPlane& ResilientDataPlane::current() const {
  return session_ ? session_->data_plane() : *fallback_;
}

const ArenaView& ResilientDataPlane::arena() const { return current().arena(); }

absl::Status ResilientDataPlane::ResetSequence(int32_t seq, uint64_t key, cudaStream_t stream) {
  absl::Status s = current().ResetSequence(seq, key, stream);
  if (s.ok()) open_[seq] = key;
  return s;
}

absl::Status ResilientDataPlane::BeginStep(const StepBatch& batch, cudaStream_t stream) {
  // Between steps: notice a dead daemon, switch in a session the retry thread attached.
  if (session_ && !lost_ && !session_->alive()) {
    std::fprintf(stderr,
                 "spin_client: lost spind session %s: keeping the mapped arena, reattaching\n",
                 session_->id().c_str());
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
  if (next) {
    for (const auto& [seq, key] : open_) {
      if (absl::Status s = next->data_plane().ResetSequence(seq, key); !s.ok()) return s;
    }
    session_ = std::move(next);
    has_session_ = true;
    lost_ = false;
  }
  return current().BeginStep(batch, stream);
}

absl::Status ResilientDataPlane::Select(int32_t layer, const int32_t* block_table,
                                        int64_t table_stride, cudaStream_t stream) {
  return current().Select(layer, block_table, table_stride, stream);
}

absl::Status ResilientDataPlane::Remap(int32_t* idx, int32_t count, cudaStream_t stream) {
  return current().Remap(idx, count, stream);
}

absl::Status ResilientDataPlane::Observe(int32_t layer, const float* logits, int64_t stride,
                                         const int32_t* accepted, cudaStream_t stream) {
  return current().Observe(layer, logits, stride, accepted, stream);
}

}  // namespace spin::client
