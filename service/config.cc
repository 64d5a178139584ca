#include "config.h"

#include <sstream>

#include "CLI/CLI.hpp"

namespace spin::service {

ParseResult ParseConfig(int argc, const char* const* argv) {
  ParseResult out;
  Config& c = out.config;
  CLI::App app{
      "spind: the SPIN (Shadow Predictive Indexer) sidecar. One daemon per GPU node: engines "
      "attach sessions, operators tune sparsity over gRPC (spin.v1.Spin)."};
  app.add_option("--listen", c.listen, "gRPC address: unix:///abs/path")
      ->envname("SPIND_LISTEN")
      ->capture_default_str();
  app.add_option("--tcp-listen", c.tcp_listen, "Also serve gRPC on HOST:PORT (port 0: any)")
      ->envname("SPIND_TCP_LISTEN");
  app.add_option("--metrics-address", c.metrics_address,
                 "Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any; empty: off)")
      ->envname("SPIND_METRICS_ADDRESS");
  app.add_option(
         "--metrics-layer-series", c.metrics_layer_series,
         "Per-layer series (spin_layer_*) for at most this many (session, layer) pairs a "
         "scrape, whole sessions, oldest first; every session always has its spin_session_* "
         "series (0: no per-layer series)")
      ->envname("SPIND_METRICS_LAYER_SERIES")
      ->check(CLI::Range(0u, 1u << 20))
      ->capture_default_str();
  app.add_option("--admin-token-file", c.admin_token_file,
                 "File whose content mutating calls over TCP must send as 'authorization: "
                 "Bearer <token>'")
      ->envname("SPIND_ADMIN_TOKEN_FILE")
      ->check(CLI::ExistingFile);
  app.add_option("--operators", c.operators,
                 "Who may make operator calls (a session by id without its token, the node "
                 "default policy, the session list) on the Unix socket: token (callers with the "
                 "admin token), socket (any process that can open the socket), or auto (token "
                 "when --admin-token-file is given, else socket)")
      ->envname("SPIND_OPERATORS")
      ->check(CLI::IsMember({"auto", "token", "socket"}))
      ->capture_default_str();
  app.add_option("--backend", c.backend,
                 "Where session arenas live: cuda (device memory shared with the engine by CUDA "
                 "VMM), cpu (a memfd), or auto (cuda when a GPU is usable, else cpu)")
      ->envname("SPIND_BACKEND")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--device", c.device,
                 "CUDA device ordinal of this daemon's GPU (one spind per GPU)")
      ->envname("SPIND_DEVICE")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-arena-bytes", c.max_arena_bytes,
                 "Arena bytes over all sessions; 0 (default): half the memory where arenas live "
                 "(host RAM on the cpu backend, the GPU's free memory at start on cuda)")
      ->envname("SPIND_MAX_ARENA_BYTES")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--max-sessions", c.max_sessions, "Sessions held at once")
      ->envname("SPIND_MAX_SESSIONS")
      ->check(CLI::Range(1u, 65536u))
      ->capture_default_str();
  app.add_option("--log-format", c.log_format, "Log lines on stderr: text or json")
      ->envname("SPIND_LOG_FORMAT")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  app.add_option("--client-grace-ms", c.client_grace_ms,
                 "Free a session once no fd connection holds it and no call named it for this "
                 "long (its lease; KeepAlive renews it)")
      ->envname("SPIND_CLIENT_GRACE_MS")
      ->check(CLI::Range(1u, 86400000u))
      ->capture_default_str();
  app.add_option("--allow-uid", c.allow_uids,
                 "Also hand arenas to fd-socket peers of this uid (repeat or comma-separate; "
                 "spind's own uid and root are always accepted)")
      ->envname("SPIND_ALLOW_UID")
      ->delimiter(',');
  app.add_option("--allow-gid", c.allow_gids,
                 "Also hand arenas to fd-socket peers of this gid (repeat or comma-separate)")
      ->envname("SPIND_ALLOW_GID")
      ->delimiter(',');
  app.add_flag("--tcp-allow-unauthenticated", c.tcp_allow_unauthenticated,
               "Without --admin-token-file, let anyone who reaches --tcp-listen attach, detach "
               "and change policy (refused by default; logged as a warning)")
      ->envname("SPIND_TCP_ALLOW_UNAUTHENTICATED");
  app.add_option("--workers", c.workers,
                 "Threads for slow RPC work (arena allocation, remote-mode steps); each session "
                 "uses at most one at a time")
      ->envname("SPIND_WORKERS")
      ->check(CLI::Range(1u, 256u))
      ->capture_default_str();
  app.add_option("--fd-handshake-ms", c.fd_handshake_ms,
                 "A peer of the fd socket must complete its request within this time")
      ->envname("SPIND_FD_HANDSHAKE_MS")
      ->check(CLI::Range(10u, 600000u))
      ->capture_default_str();
  app.add_option("--max-fd-connections", c.max_fd_connections,
                 "fd-socket connections one session may hold open at once")
      ->envname("SPIND_MAX_FD_CONNECTIONS")
      ->check(CLI::Range(1u, 1024u))
      ->capture_default_str();
  app.add_option("--state-dir", c.state_dir,
                 "Directory for each model's last per-layer miss curves (warm budgets: a new "
                 "per-layer session of the same model starts from them) and the node default "
                 "policy (node-defaults.json), kept across restarts; created if missing; "
                 "empty: neither is kept")
      ->envname("SPIND_STATE_DIR");
  app.add_option("--warm-max-age-hours", c.warm_max_age_hours,
                 "Warm budgets older than this are ignored (logged)")
      ->envname("SPIND_WARM_MAX_AGE_HOURS")
      ->check(CLI::Range(1u, 100000u))
      ->capture_default_str();
  app.add_option("--probe-interval-ms", c.probe_interval_ms,
                 "How often the probe thread reads per-layer sessions' miss curves and "
                 "recomputes their budgets when they drifted")
      ->envname("SPIND_PROBE_INTERVAL_MS")
      ->check(CLI::Range(1u, 3600000u))
      ->capture_default_str();
  app.add_option("--miss-target-interval-ms", c.miss_target_interval_ms,
                 "How often the probe thread reads miss-target sessions: their controller "
                 "measures every sparse step and should act before the next one, so keep it "
                 "under the decode step time (docs/budgets.md)")
      ->envname("SPIND_MISS_TARGET_INTERVAL_MS")
      ->check(CLI::Range(1u, 3600000u))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    out.exit = true;
    out.exit_code = 0;
    out.exit_text = app.help();
    return out;
  } catch (const CLI::ParseError& e) {
    out.exit = true;
    out.exit_code = 2;
    out.exit_text = std::string("spind: error: ") + e.what() + " (see --help)\n";
    return out;
  }
  if (UnixSocketPath(c.listen).empty()) {
    out.exit = true;
    out.exit_code = 2;
    out.exit_text = "spind: error: --listen must be unix:///absolute/path, got '" + c.listen +
                    "' (use --tcp-listen for TCP)\n";
  }
  return out;
}

std::string UnixSocketPath(const std::string& address) {
  const std::string prefix = "unix://";
  if (address.rfind(prefix, 0) != 0) return "";
  const std::string path = address.substr(prefix.size());
  return !path.empty() && path[0] == '/' ? path : "";
}

}  // namespace spin::service
