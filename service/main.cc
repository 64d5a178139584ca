// spind: wiring only. Flags -> Config -> session manager + gRPC server; SIGTERM/SIGINT drain.
#include <malloc.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "budget_probe.h"
#include "call_counter.h"
#include "config.h"
#include "convert.h"
#include "fd_server.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "metrics.h"
#include "nlohmann/json.hpp"
#include "session_manager.h"
#include "spin/v1/spin.grpc.pb.h"
#include "spin_service.h"
#include "warm_budgets.h"

namespace {

// One log line on stderr: a JSON object (nlohmann::json escapes every control character and
// replaces invalid UTF-8, so client-supplied text cannot break the line) or text.
void Log(const spin::service::Config& c, const char* level, const std::string& msg) {
  static std::mutex mu;  // one whole line at a time from every thread
  std::string line;
  if (c.log_format == "json") {
    const nlohmann::json j = {
        {"ts", static_cast<long long>(std::time(nullptr))}, {"level", level}, {"msg", msg}};
    line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  } else {
    line = std::string("spind: ") + level + ": ";
    for (char ch : msg) {  // one line per message: control characters shown, not obeyed
      const auto u = static_cast<unsigned char>(ch);
      if (u < 0x20 || u == 0x7f) {
        char hex[8];
        std::snprintf(hex, sizeof(hex), "\\x%02x", u);
        line += hex;
      } else {
        line.push_back(ch);
      }
    }
    line += "\n";
  }
  std::lock_guard<std::mutex> lock(mu);
  std::fwrite(line.data(), 1, line.size(), stderr);
}

// protobuf's own log lines (e.g. a request whose string fields are not UTF-8, which any client
// can send) go through Log, so a JSON log stays JSON, and at most one a second: the rest are
// counted and reported with the next one, so clients cannot flood the log.
const spin::service::Config* protobuf_log_config = nullptr;

void ProtobufLog(google::protobuf::LogLevel level, const char* file, int line,
                 const std::string& message) {
  static std::mutex mu;
  static std::chrono::steady_clock::time_point last{};
  static uint64_t suppressed = 0;
  std::string text = "protobuf: " + message;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto now = std::chrono::steady_clock::now();
    if (level < google::protobuf::LOGLEVEL_FATAL && last.time_since_epoch().count() != 0 &&
        now - last < std::chrono::seconds(1)) {
      ++suppressed;
      return;
    }
    last = now;
    if (suppressed > 0) {
      text += " (and " + std::to_string(suppressed) + " protobuf messages in the last second)";
    }
    suppressed = 0;
  }
  Log(*protobuf_log_config, level >= google::protobuf::LOGLEVEL_ERROR ? "warning" : "info", text);
}

// What --max-arena-bytes 0 means: half of the memory where arenas live.
uint64_t DefaultArenaBytes(spin::service::Backend backend, int device) {
  const uint64_t there = backend == spin::service::Backend::kCuda
                             ? spin::service::CudaDeviceFreeBytesOrZero(device)
                             : spin::service::HostMemoryBytes();
  return there > 0 ? there / 2 : (1ull << 30);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace spin::service;
  const ParseResult parsed = ParseConfig(argc, argv);
  if (parsed.exit) {
    std::fputs(parsed.exit_text.c_str(), parsed.exit_code == 0 ? stdout : stderr);
    return parsed.exit_code;
  }
  const Config& c = parsed.config;
  protobuf_log_config = &c;
  google::protobuf::SetLogHandler(&ProtobufLog);
  // A fixed mmap threshold (glibc raises it after each large free otherwise): blocks of 256 KiB
  // and more, such as the 1 MiB blocks of the request arenas, are mapped and unmapped whole.
  mallopt(M_MMAP_THRESHOLD, 256 << 10);
  // Signals go to a dedicated thread (sigwait), never to a gRPC thread.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  const std::string socket_path = UnixSocketPath(c.listen);
  unlink(socket_path.c_str());  // a stale socket from a previous run
  // Where arenas live: a GPU when asked for (or, with auto, when one is usable), else host memory.
  Limits limits{c.max_sessions, c.max_arena_bytes, Backend::kCpu, c.device};
  limits.grace = std::chrono::milliseconds(c.client_grace_ms);
  limits.max_holders = static_cast<int>(c.max_fd_connections);
  std::string why_not_cuda;
  const bool cuda = CudaBackendUsable(c.device, &why_not_cuda);
  if (c.backend == "cuda" && !cuda) {
    Log(c, "error", "--backend cuda: " + why_not_cuda + " (use --backend cpu or auto)");
    return 1;
  }
  if (c.backend == "cuda" || (c.backend == "auto" && cuda)) limits.backend = Backend::kCuda;
  const std::string uuid =
      limits.backend == Backend::kCuda ? CudaDeviceUuidOrEmpty(c.device) : std::string();
  const std::string backend_text =
      limits.backend == Backend::kCuda
          ? "backend cuda, device " + std::to_string(c.device) + " " + uuid
          : "backend cpu" + (c.backend == "auto" ? " (" + why_not_cuda + ")" : std::string());
  if (limits.max_arena_bytes == 0) {
    limits.max_arena_bytes = DefaultArenaBytes(limits.backend, c.device);
    Log(c, "info",
        "--max-arena-bytes " + std::to_string(limits.max_arena_bytes) + " (half of the " +
            (limits.backend == Backend::kCuda ? "GPU's free memory" : "host's memory") +
            "; set it to change)");
  }
  auto log = [&c](const char* level, const std::string& msg) { Log(c, level, msg); };
  SessionManager sessions(limits);
  FdServerOptions fd_options;
  fd_options.allow_uids = c.allow_uids;
  fd_options.allow_gids = c.allow_gids;
  fd_options.handshake_deadline = std::chrono::milliseconds(c.fd_handshake_ms);
  FdServer fds(&sessions, FdSocketPath(socket_path), fd_options, log);
  if (absl::Status s = fds.Start(); !s.ok()) {
    Log(c, "error", std::string(s.message()) + ": check that the directory exists and is writable");
    return 1;
  }
  // Leases are checked four times per grace period (at least every second).
  // Each pass also hands freed heap memory back to the kernel: a hostile request that protobuf
  // parses into tens of MB of objects (refused right after) would otherwise stay in spind's
  // RSS, kept by glibc for reuse (bench/results/soak-794dbca.md).
  sessions.StartReaper(
      std::chrono::milliseconds(std::clamp<uint32_t>(c.client_grace_ms / 4, 10, 1000)),
      [&c](const std::string& line) { Log(c, "info", line); }, [] { malloc_trim(0); });
  Metrics metrics(&sessions, limits.backend == Backend::kCuda ? std::to_string(c.device) : "", uuid,
                  c.metrics_layer_series);
  if (!c.metrics_address.empty()) {
    if (absl::Status s = metrics.Start(c.metrics_address); !s.ok()) {
      Log(c, "error", std::string(s.message()) + ": pick a free port with --metrics-address");
      return 1;
    }
    const std::string host = c.metrics_address.substr(0, c.metrics_address.rfind(':'));
    Log(c, "info", "metrics on http://" + host + ":" + std::to_string(metrics.port()) + "/metrics");
  }
  std::string admin_token;
  if (!c.admin_token_file.empty()) {
    std::ifstream f(c.admin_token_file);
    std::getline(f, admin_token);
    while (!admin_token.empty() && std::isspace(static_cast<unsigned char>(admin_token.back()))) {
      admin_token.pop_back();  // a trailing newline or \r from an editor or a Secret
    }
    if (admin_token.empty()) {
      Log(c, "error", "--admin-token-file " + c.admin_token_file + " is empty");
      return 1;
    }
  }
  if (!c.tcp_listen.empty() && admin_token.empty()) {
    Log(c, "warning",
        c.tcp_allow_unauthenticated
            ? "--tcp-allow-unauthenticated: anyone who reaches " + c.tcp_listen +
                  " can attach, detach and change policy"
            : "--tcp-listen without --admin-token-file: state-changing and operator calls over "
              "TCP are refused (a session's own read-only calls are served)");
  }
  if (c.operators == "token" && admin_token.empty()) {
    Log(c, "error",
        "--operators token needs --admin-token-file (the token operators must send on the Unix "
        "socket)");
    return 2;
  }
  const bool unix_operators_need_token =
      c.operators == "token" || (c.operators == "auto" && !admin_token.empty());
  Log(c, "info",
      unix_operators_need_token
          ? "operator calls need the admin token, on the Unix socket too"
          : "operator calls on the Unix socket need no token: any process that can open it may "
            "read and retune every session (give --admin-token-file on a shared node)");
  ServiceOptions service_options;
  service_options.unix_operators_need_token = unix_operators_need_token;
  if (!c.state_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(c.state_dir, ec);
    if (ec || access(c.state_dir.c_str(), W_OK | X_OK) != 0) {
      Log(c, "error",
          "--state-dir " + c.state_dir + " is not a writable directory" +
              (ec ? " (" + ec.message() + ")" : "") +
              ": create it for spind's user, or leave --state-dir out (no warm budgets)");
      return 2;
    }
    Log(c, "info", "warm budgets and the node default policy kept in " + c.state_dir);
  }
  service_options.warm = std::make_shared<WarmBudgets>(
      c.state_dir, std::chrono::hours(c.warm_max_age_hours),
      [&c](const char* level, const std::string& msg) { Log(c, level, msg); });
  if (!c.state_dir.empty()) {
    service_options.defaults_file =
        (std::filesystem::path(c.state_dir) / "node-defaults.json").string();
  }
  service_options.admin_token = admin_token;
  service_options.allow_unauthenticated_tcp = c.tcp_allow_unauthenticated;
  service_options.workers = c.workers;
  SpinService service(&sessions, fds.path(), &metrics, service_options);
  service.SetLogger([&c](const char* level, const std::string& msg) { Log(c, level, msg); });
  service.RestoreDefaults();
  BudgetProbe probe(
      &sessions, std::chrono::milliseconds(c.probe_interval_ms),
      std::chrono::milliseconds(c.miss_target_interval_ms),
      [&service](Session& s) { service.PublishBudgets(s); },
      [&c](const char* level, const std::string& msg) { Log(c, level, msg); });
  probe.Start();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC's default, stated: PredictMasks refuses up front a step whose messages could not fit.
  builder.SetMaxReceiveMessageSize(spin::kMaxMessageBytes);
  {
    // Counts the calls in flight: what SIGTERM waits for.
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(CallCounter::Factory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
  }
  builder.AddListeningPort(c.listen, grpc::InsecureServerCredentials());
  int tcp_port = 0;
  if (!c.tcp_listen.empty()) {
    builder.AddListeningPort(c.tcp_listen, grpc::InsecureServerCredentials(), &tcp_port);
  }
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) {
    Log(c, "error",
        "cannot listen on " + c.listen + (c.tcp_listen.empty() ? "" : " / " + c.tcp_listen) +
            ": check that the directory exists and is writable, and that the port is free");
    return 1;
  }
  chmod(socket_path.c_str(), 0660);
  // On the CUDA backend, <socket dir>/<GPU UUID>.sock (GPU-xxxxxxxx-...) also leads to this socket,
  // so an engine finds its GPU's spind by the UUID it sees, whatever order its container numbers
  // GPUs in.
  std::string gpu_link;
  if (!uuid.empty()) {
    const std::filesystem::path sock(socket_path);
    gpu_link = (sock.parent_path() / (uuid + ".sock")).string();
    const std::string tmp = gpu_link + ".tmp." + std::to_string(getpid());
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    std::filesystem::create_symlink(sock.filename(), tmp, ec);
    if (!ec) std::filesystem::rename(tmp, gpu_link, ec);
    if (ec) {
      std::filesystem::remove(tmp, ec);
      Log(c, "warning", "cannot link " + gpu_link + " to the socket: " + ec.message());
      gpu_link.clear();
    }
  }
  // grpc.health.v1: "" (spind as a whole) and spin.v1.Spin, both NOT_SERVING once draining.
  server->GetHealthCheckService()->SetServingStatus(spin::v1::Spin::service_full_name(), true);
  server->GetHealthCheckService()->SetServingStatus(true);
  std::string where = c.listen;
  if (!c.tcp_listen.empty()) where += " and tcp port " + std::to_string(tcp_port);
  if (!gpu_link.empty()) where += " (also " + gpu_link + ")";
  Log(c, "info", "serving spin.v1.Spin on " + where + " (" + backend_text + ")");

  std::thread waiter([&] {
    int sig = 0;
    sigwait(&stop, &sig);
    Log(c, "info",
        std::string("received ") + (sig == SIGTERM ? "SIGTERM" : "SIGINT") +
            ": not serving, draining");
    server->GetHealthCheckService()->SetServingStatus(false);
    // Open WatchBudgets streams end now; calls in flight get up to 5 s to finish, and the
    // server then shuts down at once (its own Shutdown deadline would also wait out every
    // idle client connection, call_counter.h).
    service.Drain();
    const auto drain_end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (CallCounter::in_flight() > 0 && std::chrono::steady_clock::now() < drain_end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (CallCounter::in_flight() > 0) {
      Log(c, "warning",
          std::to_string(CallCounter::in_flight()) + " calls still in flight after 5 s: cancelled");
    }
    server->Shutdown(std::chrono::system_clock::now());
  });
  server->Wait();
  waiter.join();
  probe.Stop();
  fds.Stop();
  sessions.StopReaper();
  // The newest warm curves of sessions still attached (the model's next sessions start there).
  for (const std::shared_ptr<spin::service::Session>& s : sessions.List()) {
    std::lock_guard<std::mutex> lock(s->mu);
    spin::service::SaveUnsavedWarmCurves(*s);
  }
  unlink(socket_path.c_str());
  if (!gpu_link.empty()) {
    // Only our own link: another spind of this GPU may have replaced it since.
    std::error_code ec;
    if (std::filesystem::read_symlink(gpu_link, ec) ==
        std::filesystem::path(socket_path).filename()) {
      std::filesystem::remove(gpu_link, ec);
    }
  }
  Log(c, "info", "stopped; " + std::to_string(sessions.List().size()) + " sessions freed");
  return 0;
}
