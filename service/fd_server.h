// Hands session arenas to engine processes as file descriptors over a Unix socket (SCM_RIGHTS),
// and turns each open connection into a hold on its session's lease.
//
// Protocol (one request per connection):
//   1. The client connects and sends one line "ATTACH <session_id> <token>\n" (at most 256 bytes
//      before the newline), within the handshake deadline (FdServerOptions::handshake_deadline,
//      2 s by default, counted from accept for the whole line).
//   2. The server checks the peer's credentials (SO_PEERCRED: spind's own uid, root, a uid in
//      FdServerOptions::allow_uids or a primary gid in allow_gids), the session and its token,
//      that the session is not driven remotely (SessionManager::Bind(kLocal)) and that it has
//      room for one more holder (SessionManager::Hold, Limits::max_holders). It replies
//      "OK <arena_bytes>\n" with the arena's fd attached (SCM_RIGHTS), or "ERR <reason>\n" and
//      closes the connection. Every refusal is logged with the peer's uid, gid and pid.
//   3. After OK the connection stays open as the client's liveness signal and the client sends
//      nothing more. When it closes (EOF or error), or the client sends anything (misbehaviour),
//      the server closes it and calls SessionManager::Release: the session's lease runs from
//      then, and the SessionManager's reaper frees it if it lapses (no holder, no call for
//      Limits::grace). FdServer frees nothing itself.
//
// One thread serves everything with one poll loop: the listening socket, the handshakes in
// progress (non-blocking sockets, each with its own buffer and deadline) and the holders. No
// peer can block it: reads and sends never wait (MSG_DONTWAIT, MSG_NOSIGNAL), a handshake that
// does not complete by its deadline is closed with "ERR handshake timed out ...", and at most
// FdServerOptions::max_pending handshakes are in progress at once: past that, the oldest pending
// handshake is dropped with an ERR line (a real client sends its line right after connecting,
// so the oldest is the one most likely to be an idle or slow peer; a connection whose line is
// already there when it is accepted completes at once and never takes a slot). Stop() wakes the
// loop through a pipe and returns promptly whatever the peers do.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "session_manager.h"

namespace spin::service {

/// Options of the fd socket.
struct FdServerOptions {
  std::vector<uint32_t> allow_uids;  ///< accepted besides spind's uid and root
  std::vector<uint32_t> allow_gids;  ///< a peer whose (primary) gid is listed is accepted
  /// Time from accept to the complete request line.
  std::chrono::milliseconds handshake_deadline{2000};
  int max_pending = 64;  ///< handshakes in progress at once
};

/// The fd socket server (one thread).
class FdServer {
 public:
  /// `log` (optional) gets one line per refusal ("warn"), per handout and holder close ("info")
  /// and per server error ("error"); it is called from the server's thread.
  FdServer(SessionManager* sessions, std::string path, FdServerOptions options,
           std::function<void(const char* level, const std::string& line)> log = nullptr);
  ~FdServer();
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;

  /// Binds (replacing a stale socket file), sets mode 0660, listens and starts the thread.
  absl::Status Start();
  /// Stops the thread promptly, closes every connection and releases every held session.
  /// Idempotent; also done by the destructor.
  void Stop();
  /// The socket path.
  const std::string& path() const { return path_; }
  /// Open holder connections (thread-safe).
  size_t holders() const { return holders_count_.load(); }
  /// Handshakes in progress (thread-safe).
  size_t pending() const { return pending_count_.load(); }

  /// Longest request line accepted (bytes before the newline).
  static constexpr size_t kMaxLine = 256;

 private:
  using Clock = std::chrono::steady_clock;
  struct Peer {
    uint32_t uid = 0, gid = 0;
    int32_t pid = 0;
    bool known = false;  ///< SO_PEERCRED answered
  };
  struct Pending {
    int fd = -1;
    Peer peer;
    Clock::time_point deadline;
    std::string buf;
  };
  struct Holder {
    std::string session_id;
    Peer peer;
  };

  void Loop();
  void AcceptAll();
  // Reads what a pending handshake has; finishes it once the line is complete (or refuses it).
  // Returns true when the handshake is over (the entry must be erased by the caller).
  bool ReadPending(Pending& p);
  // Decides a complete request line: OK with the fd (the connection becomes a holder) or ERR.
  void Finish(Pending& p, const std::string& line);
  // Sends "ERR <reason>\n", logs the refusal and closes the connection.
  void Refuse(int fd, const Peer& peer, const std::string& reason);
  // Refuse() for a handshake in progress: a peer that is not allowed gets DeniedReason instead.
  void RefuseHandshake(const Pending& p, const std::string& reason);
  std::string DeniedReason(const Peer& peer) const;
  void CloseHolder(int fd, const char* why);
  bool PeerAllowed(const Peer& peer) const;
  std::string PeerText(const Peer& peer) const;
  void Log(const char* level, const std::string& line) const;
  void UpdateCounts();

  SessionManager* sessions_;
  std::string path_;
  FdServerOptions options_;
  std::function<void(const char*, const std::string&)> log_;
  uint32_t own_uid_ = 0;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  bool bound_ = false;
  std::thread thread_;
  std::atomic<size_t> holders_count_{0};
  std::atomic<size_t> pending_count_{0};

  // Loop thread only.
  uint64_t next_seq_ = 0;
  std::map<uint64_t, Pending> pending_;  ///< by accept order: begin() is the oldest
  std::map<int, Holder> holders_;        ///< by connection fd
  Clock::time_point listen_paused_until_{};
};

}  // namespace spin::service
