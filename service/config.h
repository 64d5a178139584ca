// spind's configuration: flags with environment mirrors (flag > environment > default).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace spin::service {

/// Everything spind is started with.
struct Config {
  std::string listen = "unix:///run/spin/spind.sock";  ///< gRPC on a Unix socket
  std::string tcp_listen;                              ///< optional HOST:PORT
  std::string admin_token_file;          ///< its content is required by mutating calls over TCP
  std::string operators = "auto";        ///< auto | token | socket: operators on the socket
  std::string metrics_address;           ///< Prometheus /metrics on HOST:PORT; empty = off
  uint32_t metrics_layer_series = 4096;  ///< (session, layer) pairs with per-layer series
  std::string backend = "auto";          ///< auto | cpu | cuda
  int device = 0;                        ///< CUDA device ordinal for the cuda backend
  uint64_t max_arena_bytes = 0;          ///< over all sessions; 0 = from the memory there
  uint32_t max_sessions = 64;
  std::string log_format = "text";        ///< text | json
  uint32_t client_grace_ms = 30000;       ///< a session outlives its last client by this much
  uint32_t probe_interval_ms = 100;       ///< per-layer budgets: how often the probe thread runs
  uint32_t miss_target_interval_ms = 10;  ///< miss-target sessions: how often it reads them
  std::vector<uint32_t> allow_uids;       ///< fd socket peers accepted besides spind's uid and root
  std::vector<uint32_t> allow_gids;       ///< fd socket peers accepted by group
  bool tcp_allow_unauthenticated = false;  ///< state-changing calls over TCP without a token
  uint32_t workers = 4;                    ///< threads for slow RPC work
  uint32_t fd_handshake_ms = 2000;         ///< whole fd-socket handshake deadline
  uint32_t max_fd_connections = 8;         ///< fd connections one session may hold
  std::string state_dir;                   ///< warm budgets' files; empty = off
  uint32_t warm_max_age_hours = 168;       ///< older warm budgets are ignored
};

/// Parses argv. On --help (or a usage error) returns the text to print in `exit_text` with
/// `exit_code` set; otherwise the config.
struct ParseResult {
  Config config;
  bool exit = false;
  int exit_code = 0;
  std::string exit_text;
};
ParseResult ParseConfig(int argc, const char* const* argv);

/// The arena fd socket that goes with a gRPC Unix socket path.
inline std::string FdSocketPath(const std::string& grpc_socket) { return grpc_socket + ".fd"; }

/// The Unix socket path of a "unix:///abs/path" address, or "" for other schemes.
std::string UnixSocketPath(const std::string& address);

}  // namespace spin::service
