// spind: wiring only. Flags -> Config -> session manager + gRPC server; SIGTERM/SIGINT drain.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "budget_probe.h"
#include "config.h"
#include "fd_server.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "metrics.h"
#include "session_manager.h"
#include "spin_service.h"

namespace {

// One log line on stderr: JSON object or text.
void Log(const spin::service::Config& c, const char* level, const std::string& msg) {
  if (c.log_format == "json") {
    std::string escaped;
    for (char ch : msg) {
      if (ch == '"' || ch == '\\') escaped.push_back('\\');
      escaped.push_back(ch);
    }
    std::fprintf(stderr, "{\"ts\":%lld,\"level\":\"%s\",\"msg\":\"%s\"}\n",
                 static_cast<long long>(std::time(nullptr)), level, escaped.c_str());
  } else {
    std::fprintf(stderr, "spind: %s: %s\n", level, msg.c_str());
  }
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
  SessionManager sessions(limits);
  FdServer fds(&sessions, FdSocketPath(socket_path), std::chrono::milliseconds(c.client_grace_ms));
  if (absl::Status s = fds.Start(); !s.ok()) {
    Log(c, "error", std::string(s.message()) + ": check that the directory exists and is writable");
    return 1;
  }
  Metrics metrics(&sessions, limits.backend == Backend::kCuda ? std::to_string(c.device) : "",
                  uuid);
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
    if (admin_token.empty()) {
      Log(c, "error", "--admin-token-file " + c.admin_token_file + " is empty");
      return 1;
    }
  }
  SpinService service(&sessions, fds.path(), &metrics, admin_token);
  service.SetLogger([&c](const char* level, const std::string& msg) { Log(c, level, msg); });
  BudgetProbe probe(
      &sessions, std::chrono::milliseconds(c.probe_interval_ms),
      [&service](Session& s) { service.PublishBudgets(s); },
      [&c](const char* level, const std::string& msg) { Log(c, level, msg); });
  probe.Start();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
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
  server->GetHealthCheckService()->SetServingStatus(true);
  std::string where = c.listen;
  if (!c.tcp_listen.empty()) where += " and tcp port " + std::to_string(tcp_port);
  Log(c, "info", "serving spin.v1.Spin on " + where + " (" + backend_text + ")");

  std::thread waiter([&] {
    int sig = 0;
    sigwait(&stop, &sig);
    Log(c, "info",
        std::string("received ") + (sig == SIGTERM ? "SIGTERM" : "SIGINT") +
            ": not serving, draining");
    server->GetHealthCheckService()->SetServingStatus(false);
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  });
  server->Wait();
  waiter.join();
  probe.Stop();
  fds.Stop();
  unlink(socket_path.c_str());
  Log(c, "info", "stopped; " + std::to_string(sessions.List().size()) + " sessions freed");
  return 0;
}
