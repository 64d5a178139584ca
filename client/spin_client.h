// libspin_client: attach a session in spind, map its arena into this process, and run the data
// plane on it locally (docs/design.md §3). The daemon keeps owning the arena: it writes the policy
// and budget table the kernels read and serves statistics from the same memory.
//
// The library an engine links, whole: this header (Session: attach, map, policy, budgets, stats,
// lease), spin/data_plane.h (the DataPlane calls of a decode step), resilient_data_plane.h (what
// an engine should hold: fail-open, dense without a daemon), remote_data_plane.h (the data plane
// run inside spind over RPC) and log.h (where the library's log lines go). Every call reports
// failure as an absl::Status with the daemon's code; none throws or raises SIGPIPE.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "spin/arena.h"
#include "spin/data_plane.h"
#if SPIN_HAVE_CUDA
#include "spin/shared_device_memory.h"
#endif
#include "spin/v1/spin.grpc.pb.h"

namespace spin::client {

/// What to attach with.
struct AttachOptions {
  Geometry geometry;
  Policy policy;
  uint64_t seed = 1;
  std::string client_name;
  std::string admin_token;  ///< spind's admin token, needed for Attach/Detach over TCP
  /// CUDA sessions: keep the arena's fd instead of mapping it, for MapInto (ResilientDataPlane
  /// maps every session at one fixed address so the engine's CUDA graphs stay valid).
  bool defer_device_map = false;
  /// Fetch and map the arena (local mode, the default). False for remote mode: spind runs the
  /// data plane (RemoteDataPlane) and the arena is never handed out; a session is driven one
  /// way or the other, never both, and data_plane() is unavailable.
  bool fetch_arena = true;
  /// Refuse a daemon whose arenas live elsewhere (checked right after Attach, before any fd
  /// is fetched or memory imported): 0 = either, 1 = host memory only, 2 = GPU only.
  int require_backend = 0;
  /// The engine adopts policy and budget changes itself (Session::GetControl, then a write into
  /// the arena at a step boundary): spind only proposes them. For tensor-parallel groups, whose
  /// ranks must switch at the same step (docs/vllm.md).
  bool engine_control = false;
  /// The served model's name (1-128 of A-Z a-z 0-9 . _ -; empty: none): a per-layer session
  /// of a model spind has seen starts from its last per-layer curves (warm budgets).
  std::string model;
  /// CUDA sessions: the data plane's EMA runs beside the engine's next layer
  /// (CudaDataPlaneOptions::defer_ema; the engine keeps each layer's logits unwritten until the
  /// next Observe). Ignored on the CPU backend.
  bool defer_ema = false;
};

/// A policy change (Session::SetPolicy): the fields that are set change, the rest stay. Takes
/// effect at the next step of every sequence; out-of-range values change nothing.
struct PolicyChange {
  std::optional<double> target_sparsity;
  std::optional<double> exploration;
  std::optional<float> alpha;
  std::optional<uint32_t> probe_period;
  std::optional<BudgetMode> budget_mode;
  std::optional<double> miss_target;  ///< the miss-target mode's target, (0, 1)
};

/// The session's per-layer budget table as spind keeps it.
struct Budgets {
  std::vector<double> layer_sparsity;  ///< per layer, the sparsity the kernels use
  uint64_t epoch = 0;                  ///< bumped by every policy or budget change
  BudgetMode mode = BudgetMode::kUniform;
  uint64_t recomputes = 0;  ///< per-layer mode: tables written so far
  std::string reason;       ///< why the last one was written (docs/budgets.md)
};

/// A session's control as spind keeps it: the policy and the per-layer budget table, with a
/// version bumped by every change of either. An engine_control session's engine adopts it.
struct Control {
  Policy policy;
  std::vector<double> layer_sparsity;
  uint64_t version = 0;
  bool engine_control = false;
};

/// The fd-socket handshake (docs/spind.md): connects to `path`, asks for session `id`'s arena
/// and receives its fd (`*fd_out`, the caller closes it) and size; the connection (`*conn_out`)
/// stays open as the session's liveness signal. Never raises SIGPIPE; gives up after 10 s.
absl::Status FetchArenaFd(const std::string& path, const std::string& id, const std::string& token,
                          int* conn_out, int* fd_out, uint64_t* bytes_out);

/// An attached session with its arena mapped here: the daemon's memfd (CPU backend), or its
/// CUDA VMM allocation imported and mapped on the same GPU (CUDA backend; that GPU becomes the
/// calling thread's current device, and the data plane then takes device pointers).
class Session {
 public:
  /// Attaches over gRPC at `target` (e.g. "unix:///run/spin/spind.sock"), fetches the arena fd
  /// over the fd socket, maps it and validates it against the layout header the daemon sent.
  static absl::StatusOr<std::unique_ptr<Session>> Attach(const std::string& target,
                                                         const AttachOptions& options);
  ~Session();

  /// The local data plane over the shared arena (local mode only: see fetch_arena).
  DataPlane& data_plane() { return *dp_; }
  /// True when the arena is mapped here and data_plane() can be used.
  bool has_data_plane() const { return dp_ != nullptr; }
  /// The mapped arena.
  const ArenaView& arena() const { return view_; }
  /// Session id and token (for control calls).
  const std::string& id() const { return id_; }
  const std::string& token() const { return token_; }
  /// The control-plane stub on the same channel.
  spin::v1::Spin::Stub& stub() { return *stub_; }
  /// Frees the session in the daemon (the mapping here stays valid until destruction).
  absl::Status Detach();
  /// Renews the session's lease (remote mode: a session no call names for the daemon's grace
  /// period is freed; local mode holds it through the fd connection).
  absl::Status KeepAlive();
  /// The policy in force.
  absl::StatusOr<Policy> GetPolicy();
  /// Changes the policy (see PolicyChange) and returns the one now in force.
  absl::StatusOr<Policy> SetPolicy(const PolicyChange& change);
  /// The per-layer budget table.
  absl::StatusOr<Budgets> GetBudgets();
  /// The policy and budget table together, with their version (one call, one snapshot).
  absl::StatusOr<Control> GetControl();
  /// Per-layer statistics since attach, indexed by layer.
  absl::StatusOr<std::vector<LayerStats>> GetStats();
  /// False once spind closed the session's fd connection (it exited or freed the session).
  bool alive() const;
  /// True when the arena is in GPU memory (spind runs the CUDA backend).
  bool on_device() const { return !device_uuid_.empty(); }
  /// False for a CUDA session attached with defer_device_map until MapInto.
  bool mapped() const { return pending_fd_ < 0; }
  /// The arena's layout header as spind sent it.
  const ArenaHeader& header() const { return header_; }
#if SPIN_HAVE_CUDA
  /// A deferred CUDA session: maps its arena into `window` (replacing the memory there; the
  /// window's size must be the arena's mapping size and its GPU the arena's). Everything that
  /// can be checked is checked before the window changes. With `build_data_plane` false the
  /// caller keeps driving the window with its own data plane (same layout, so the same
  /// addresses and scratch: what a captured graph needs). Synchronises the device.
  absl::Status MapInto(DeviceWindow& window, bool build_data_plane = true);
#endif
  /// The GPU's UUID on the CUDA backend, else empty.
  const std::string& device_uuid() const { return device_uuid_; }

 private:
  Session() = default;
  absl::StatusOr<ArenaView> MapHost(int fd, uint64_t bytes, const ArenaHeader& header);
  absl::StatusOr<ArenaView> MapDevice(int fd, uint64_t bytes, const std::string& uuid,
                                      const ArenaHeader& header);
  std::string id_, token_, admin_token_, device_uuid_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<spin::v1::Spin::Stub> stub_;
  int conn_ = -1;  // fd-socket connection: held open as the liveness signal
  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  std::shared_ptr<void> device_;  // the imported VMM mapping (CUDA backend)
  int pending_fd_ = -1;           // deferred CUDA session: the arena's fd until MapInto
  uint64_t arena_bytes_ = 0;
  ArenaHeader header_{};
  ArenaView view_;
  std::unique_ptr<DataPlane> dp_;
  bool defer_ema_ = false;  // AttachOptions::defer_ema, for the CUDA data planes it builds
};

}  // namespace spin::client
