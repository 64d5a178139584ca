// The engine-facing data plane of libspin_client: it never blocks on, or fails because of,
// spind (docs/design.md §7).
//
// - Daemon unreachable at start: selections are dense (a private arena at 0% sparsity), one log
//   line, and attach is retried in the background.
// - Daemon gone mid-run: the mapped arena stays valid (the memfd lives while mapped), so the
//   data plane keeps selecting with the last policy and budgets; attach is retried.
// - Once a new session is ready it is switched in at the next BeginStep, and the sequences the
//   engine had opened are reopened there with their keys (their history starts fresh).
// Host engines (CPU backend) must read outputs through arena()/outputs() after each Select, as
// they move when the session changes. GPU engines (CreateOnDevice) keep one address range for
// the arena: the dense fallback lives there first, and each session spind hands out is mapped at
// the same addresses (DeviceWindow), so outputs never move and captured CUDA graphs stay valid
// across daemon restarts. A graph-replaying engine calls Refresh() between replays (BeginStep
// does it for eager engines); a switch synchronises the device (to remap the arena) and then
// waits for the sequences it reopens.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "spin/data_plane.h"
#include "spin_client.h"

namespace spin::client {

/// A DataPlane that attaches to spind when it can and degrades to dense when it cannot.
class ResilientDataPlane final : public DataPlane {
 public:
  /// Starts trying to attach to `target` every `retry` (the first try happens at once).
  ResilientDataPlane(std::string target, AttachOptions options, std::chrono::milliseconds retry);
#if SPIN_HAVE_CUDA
  /// The GPU engine's variant: arena in device memory on the calling thread's current device,
  /// at fixed addresses; spind must run the CUDA backend on that GPU.
  static absl::StatusOr<std::unique_ptr<ResilientDataPlane>> CreateOnDevice(
      std::string target, AttachOptions options, std::chrono::milliseconds retry);
#endif
  ~ResilientDataPlane() override;

  /// Between steps: notices a lost daemon and switches in a session the retry thread attached.
  /// Called by BeginStep; call it before each replay of a captured graph.
  absl::Status Refresh();
  bool on_device() const override { return on_device_; }

  /// True while the steps run on a daemon session's arena.
  bool attached() const;
  /// Sessions switched in so far (0 until the first); each one starts with fresh state.
  uint64_t generation() const { return generation_; }

  /// The current session's control as spind keeps it (an RPC; between steps). UNAVAILABLE
  /// without a session.
  absl::StatusOr<Control> GetControl();
  /// Asks spind to change the current session's policy (Session::SetPolicy; an RPC, between
  /// steps). UNAVAILABLE without a session. In an engine_control session it changes the
  /// proposal, which takes effect once the engine adopts it.
  absl::StatusOr<Policy> SetPolicy(const PolicyChange& change);
  /// Writes a policy and budget table into the arena the steps run on, so the next BeginStep
  /// uses them (engine_control sessions: the engine's step-boundary switch, the same step on
  /// every tensor-parallel rank). The control is kept and written again into every session
  /// switched in later; while no session is attached it waits (the dense fallback stays
  /// dense). Checks everything before writing; on the GPU it synchronises `stream`.
  absl::Status AdoptControl(const Policy& policy, std::span<const double> layer_sparsity,
                            cudaStream_t stream = nullptr);
  /// The current session's id ("" when degraded).
  std::string session_id() const;

  const ArenaView& arena() const override;
  absl::Status ResetSequence(int32_t seq, uint64_t key, cudaStream_t stream = nullptr) override;
  absl::Status BeginStep(const StepBatch& batch, cudaStream_t stream = nullptr) override;
  absl::Status Select(int32_t layer, const int32_t* block_table = nullptr, int64_t table_stride = 0,
                      cudaStream_t stream = nullptr) override;
  absl::Status Remap(int32_t* idx, int32_t count, cudaStream_t stream = nullptr) override;
  absl::Status RemapTopK(int32_t* idx, int32_t count, cudaStream_t stream = nullptr) override;
  absl::Status RemapAndObserve(int32_t layer, int32_t* idx, int32_t count, const float* logits,
                               int64_t logits_stride, const int32_t* accepted = nullptr,
                               cudaStream_t stream = nullptr) override;
  absl::Status Observe(int32_t layer, const float* logits, int64_t logits_stride,
                       const int32_t* accepted = nullptr, cudaStream_t stream = nullptr) override;

 private:
  struct DeviceTag {};
  ResilientDataPlane(std::string target, AttachOptions options, std::chrono::milliseconds retry,
                     DeviceTag);
  void Retry();
  DataPlane& current() const;
  absl::Status WriteAdopted(cudaStream_t stream);

  std::string target_;
  AttachOptions options_;
  std::chrono::milliseconds retry_;
  // Dense fallback: a private arena at 0% sparsity (GPU engines: the data plane over the window).
  std::unique_ptr<DataPlane> fallback_;
  bool on_device_ = false;
  std::shared_ptr<void> window_;  // GPU engines: the DeviceWindow every arena is mapped into
  ArenaHeader window_header_{};   // GPU engines: the layout every session must have
  std::vector<std::unique_ptr<Session>> to_detach_;  // refused sessions, detached off-thread
  std::unique_ptr<Session> session_;                 // in use (engine thread only)
  std::unique_ptr<Session> ready_;        // attached by the retry thread, switched in at BeginStep
  std::map<int32_t, uint64_t> open_;      // sequences the engine opened, with their keys
  bool lost_ = false;                     // the current session's daemon went away (logged)
  uint64_t generation_ = 0;               // sessions switched in
  std::optional<Policy> adopted_policy_;  // the engine's last AdoptControl
  std::vector<double> adopted_table_;
  std::atomic<bool> has_session_{false};  // session_ != nullptr, for the retry thread's log
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool want_session_ = true;
  std::thread thread_;
};

}  // namespace spin::client
