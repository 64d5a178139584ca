// Hands session arenas to clients as file descriptors over a Unix socket (SCM_RIGHTS), and
// frees sessions whose clients went away.
//
// Protocol: the client connects and sends one line "ATTACH <session_id> <token>\n". The server
// checks the peer's credentials (same uid as spind, or root), the session and the token, then
// replies "OK <arena_bytes>\n" with the arena's fd attached, or "ERR <reason>\n". The
// connection stays open: when the last connection holding a session closes (the client exited
// or crashed), the session is freed after the grace period unless a client reconnects.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "session_manager.h"

namespace spin::service {

/// The fd socket server and session reaper (one thread).
class FdServer {
 public:
  FdServer(SessionManager* sessions, std::string path, std::chrono::milliseconds grace);
  ~FdServer();

  /// Binds and listens (mode 0660) and starts the thread.
  absl::Status Start();
  /// Stops the thread and closes every connection.
  void Stop();
  /// The socket path.
  const std::string& path() const { return path_; }

 private:
  void Loop();
  void Handshake(int conn);

  SessionManager* sessions_;
  std::string path_;
  std::chrono::milliseconds grace_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  std::thread thread_;
  // Open client connections -> the session each holds.
  std::map<int, std::string> holders_;
  // Sessions whose last holder left, and when.
  std::map<std::string, std::chrono::steady_clock::time_point> orphaned_;
};

}  // namespace spin::service
