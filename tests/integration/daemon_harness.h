// spind as a child process for integration tests: start it on a temporary Unix socket, drive it
// over gRPC, read its log, count its sessions, fds and resident pages.
#pragma once

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "spin/v1/spin.grpc.pb.h"

namespace spin::testing {

namespace pb = spin::v1;

// A spind child process on its own socket.
class Daemon {
 public:
  explicit Daemon(std::vector<std::string> extra = {}, std::string socket = "") {
    static int counter = 0;
    socket_ = !socket.empty() ? socket
                              : ::testing::TempDir() + "/spind-" + std::to_string(getpid()) + "-" +
                                    std::to_string(counter++) + ".sock";
    std::vector<std::string> args = {SPIND_PATH, "--listen", "unix://" + socket_};
    args.insert(args.end(), extra.begin(), extra.end());
    log_ = socket_ + ".log";
    pid_ = fork();
    if (pid_ == 0) {
      FILE* log = std::fopen(log_.c_str(), "w");
      if (log) dup2(fileno(log), 2);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    channel_ = grpc::CreateChannel("unix://" + socket_, grpc::InsecureChannelCredentials());
    ready_ =
        channel_->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20));
    stub_ = pb::Spin::NewStub(channel_);
  }
  ~Daemon() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  // Sends SIGTERM and returns the exit status (or -1 on timeout).
  int Terminate() {
    kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -2;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return -1;
  }
  bool ready() const { return ready_; }
  pid_t pid() const { return pid_; }
  // What spind printed on stderr so far.
  std::string log() const {
    std::ifstream f(log_);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  // SIGKILL: a crash, no cleanup.
  void Kill() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  pb::Spin::Stub& stub() { return *stub_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  const std::string& socket() const { return socket_; }

 private:
  std::string socket_, log_;
  pid_t pid_ = -1;
  bool ready_ = false;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Spin::Stub> stub_;
};

inline pb::AttachRequest AttachReq(uint32_t layers = 2, uint32_t slots = 1024, uint32_t seqs = 2) {
  pb::AttachRequest r;
  pb::Geometry* g = r.mutable_geometry();
  g->set_layers(layers);
  g->set_block_size(64);
  g->set_topk(128);
  g->set_max_sequences(seqs);
  g->set_max_slots(slots);
  g->set_max_rows(1);
  g->set_state_dtype(pb::STATE_DTYPE_FP32);
  r.set_seed(7);
  r.mutable_policy()->set_target_sparsity(0.5);
  r.mutable_policy()->set_exploration(0.05);
  r.mutable_policy()->set_alpha(0.3f);
  r.set_client_name("test");
  return r;
}

template <typename Req, typename Resp, typename Call>
grpc::Status Rpc(Call call, const Req& req, Resp* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return call(&ctx, req, resp);
}

#define CALL(d, Method, req, resp)                                                                \
  Rpc([&](grpc::ClientContext* c, const auto& q, auto* p) { return (d).stub().Method(c, q, p); }, \
      req, resp)

inline pb::SessionRef Ref(const pb::AttachResponse& a) {
  pb::SessionRef r;
  r.set_session_id(a.session_id());
  r.set_token(a.token());
  return r;
}

// Open file descriptors of a process, or -1 if they cannot be listed (callers assert a
// positive baseline, so a failed count cannot pass a leak check).
inline int FdCount(pid_t pid) {
  DIR* dir = opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (const dirent* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

// Resident set of a process in pages, or -1 (callers assert a positive baseline).
inline long RssPages(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/statm");
  long size = 0, rss = -1;
  f >> size >> rss;
  return rss;
}

// The metrics port of a daemon started with --metrics-address HOST:0 (from its log), or -1.
inline int MetricsPort(Daemon& d) {
  const std::string log = d.log();
  const size_t at = log.find("metrics on http://");
  if (at == std::string::npos) return -1;
  return std::atoi(log.c_str() + log.find(':', at + 18) + 1);
}

// One scrape of its /metrics (headers and body), or "" without a metrics port.
inline std::string ScrapeMetrics(Daemon& d) {
  const int port = MetricsPort(d);
  if (port <= 0) return "";
  const std::string cmd = "exec 3<>/dev/tcp/127.0.0.1/" + std::to_string(port) +
                          " && printf 'GET /metrics HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3";
  FILE* p = popen(("bash -c \"" + cmd + "\" 2>/dev/null").c_str(), "r");
  std::string scraped;
  char buf[4096];
  for (size_t n; p && (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) scraped.append(buf, n);
  if (p) pclose(p);
  return scraped;
}

inline int SessionCount(Daemon& d) {
  pb::ListSessionsResponse ls;
  if (!CALL(d, ListSessions, pb::ListSessionsRequest(), &ls).ok()) return -1;
  return ls.sessions_size();
}

#ifdef ATTACH_HELPER_PATH
// Starts attach_helper against `d` in `mode` ("fetch", "attach", "step", "remote"; see
// attach_helper.cc) and waits until it printed its session id (into *id). Returns its pid, or -1
// if it failed before getting there.
inline pid_t StartAttachHelper(const Daemon& d, const char* mode, std::string* id = nullptr) {
  int out[2];
  if (pipe(out) != 0) return -1;
  const pid_t child = fork();
  if (child == 0) {
    dup2(out[1], 1);
    close(out[0]);
    const std::string target = "unix://" + d.socket();
    execl(ATTACH_HELPER_PATH, ATTACH_HELPER_PATH, target.c_str(), mode, nullptr);
    _exit(127);
  }
  close(out[1]);
  char line[64] = {};
  FILE* f = fdopen(out[0], "r");
  const bool got = std::fgets(line, sizeof(line), f) != nullptr;
  std::fclose(f);
  if (!got) {
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    return -1;
  }
  if (id != nullptr) *id = std::string(line, std::strcspn(line, "\n"));
  return child;
}
#endif

}  // namespace spin::testing
