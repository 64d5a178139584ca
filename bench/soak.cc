// A soak run of spind (a benchmark, not a CI test): starts its own spind child (CPU backend, a
// temporary socket, a short --client-grace-ms) and for a given time runs well-behaved clients
// (attach, replay a small trace through the mapped arena or in remote mode, detach, in a loop;
// every call timed, every error a failure) next to hostile ones: client processes SIGKILLed at
// random points of attach / fetch / step, raw connections to the fd socket that stay silent,
// drip bytes or send garbage, gRPC calls with garbage, oversize or out-of-range requests, and
// raw garbage bytes to the gRPC socket and the metrics port. A sampler reads spind's RSS, open
// fds, threads and session count every second. At the end the load stops and, after the grace
// period and a margin, sessions and fds must be back at their baseline (taken the same way
// after a warm-up) and RSS within a tolerance. bench/run-soak runs it; docs/spind.md "Soak
// run" says what it checks.
//
// Usage: soak --spind PATH [--seconds N | --minutes M] [--out FILE] [--warmup-s 60]
//             [--well 3] [--grace-ms 2000] [--hostile kill,fd,rpc,raw] [--seed 1]
//             [--commit TEXT] [--command TEXT] [--timeline FILE] [--spind-arg ARG]...
//             [--only TEXT] [--skip TEXT]... [--rss-tolerance-mib 8] [--rss-tolerance-frac 0.1]
// Exit status: 0 pass, 1 a check failed, 2 spind died, 3 usage or set-up error.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "convert.h"
#include "gen_trace.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "remote_data_plane.h"
#include "replay.h"
#include "spin/arena.h"
#include "spin/data_plane.h"
#include "spin/v1/spin.grpc.pb.h"
#include "spin_client.h"
#include "trace.h"

extern char** environ;

namespace {

namespace pb = spin::v1;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

double Secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
void SleepMs(double ms) {
  std::this_thread::sleep_for(std::chrono::microseconds(int64_t(ms * 1e3)));
}

std::string CodeName(grpc::StatusCode c) {
  static const char* names[] = {"OK",
                                "CANCELLED",
                                "UNKNOWN",
                                "INVALID_ARGUMENT",
                                "DEADLINE_EXCEEDED",
                                "NOT_FOUND",
                                "ALREADY_EXISTS",
                                "PERMISSION_DENIED",
                                "RESOURCE_EXHAUSTED",
                                "FAILED_PRECONDITION",
                                "ABORTED",
                                "OUT_OF_RANGE",
                                "UNIMPLEMENTED",
                                "INTERNAL",
                                "UNAVAILABLE",
                                "DATA_LOSS",
                                "UNAUTHENTICATED"};
  const int i = static_cast<int>(c);
  return i >= 0 && i < 17 ? names[i] : absl::StrCat("code ", i);
}
std::string CodeName(absl::StatusCode c) { return CodeName(static_cast<grpc::StatusCode>(c)); }

// ---------------------------------------------------------------------------------------------
// Options

struct Options {
  std::string spind;
  double seconds = 600;
  double warmup_s = 60;
  std::string out, timeline, commit;
  std::string command;  // how the run was started (bench/run-soak passes its own command line)
  int well = 3;
  int grace_ms = 2000;
  uint64_t seed = 1;
  std::set<std::string> hostile = {"kill", "fd", "rpc", "raw"};
  std::vector<std::string> spind_args;
  std::string only;               // perform only the hostile actions whose kind contains this
  std::vector<std::string> skip;  // and none whose kind contains one of these
  double well_pause_ms = 10;
  double rss_tol_frac = 0.10;
  double rss_tol_mib = 8;
};

// ---------------------------------------------------------------------------------------------
// Latency histogram: log buckets 2% wide from 1 us, exact count, sum and max.

class Hist {
 public:
  void Add(double us) {
    const int i = us <= 1.0 ? 0 : std::min<int>(kBuckets - 1, int(std::log(us) / kLogGrowth) + 1);
    ++b_[i];
    ++n_;
    max_ = std::max(max_, us);
    sum_ += us;
  }
  uint64_t n() const { return n_; }
  double max() const { return max_; }
  double mean() const { return n_ ? sum_ / n_ : 0; }
  // The upper edge of the bucket holding the q-quantile (at most 2% above the true value).
  double Quantile(double q) const {
    if (n_ == 0) return 0;
    const uint64_t want = std::max<uint64_t>(1, uint64_t(std::ceil(q * n_)));
    uint64_t c = 0;
    for (int i = 0; i < kBuckets; ++i) {
      c += b_[i];
      if (c >= want) return std::min(max_, std::exp(i * kLogGrowth));
    }
    return max_;
  }

 private:
  static constexpr int kBuckets = 1400;                     // 1.02^1400 us ~ 10 days
  static constexpr double kLogGrowth = 0.0198026272961797;  // ln(1.02)
  std::vector<uint64_t> b_ = std::vector<uint64_t>(kBuckets);
  uint64_t n_ = 0;
  double max_ = 0, sum_ = 0;
};

// Well-behaved operations: latency of each, failures with their first messages.
class Ops {
 public:
  struct Op {
    Hist h;
    uint64_t fail = 0, slow = 0;
    std::vector<std::string> errors;
  };
  void Ok(const std::string& kind, double ms) {
    std::lock_guard<std::mutex> l(mu_);
    Op& o = m_[kind];
    o.h.Add(ms * 1e3);
    if (ms > 1000) ++o.slow;
  }
  /// Sees every failure message (set before the load starts).
  std::function<void(const std::string&)> watch;
  void Fail(const std::string& kind, double ms, const std::string& msg, double at_s) {
    if (watch) watch(msg);
    std::lock_guard<std::mutex> l(mu_);
    Op& o = m_[kind];
    o.h.Add(ms * 1e3);
    ++o.fail;
    ++failures_;
    if (o.errors.size() < 5) o.errors.push_back(absl::StrCat("t=", int(at_s), "s: ", msg));
  }
  uint64_t failures() const { return failures_; }
  uint64_t total() const {
    std::lock_guard<std::mutex> l(mu_);
    uint64_t t = 0;
    for (const auto& [k, o] : m_) t += o.h.n();
    return t;
  }
  std::map<std::string, Op> Snapshot() const {
    std::lock_guard<std::mutex> l(mu_);
    return m_;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, Op> m_;
  std::atomic<uint64_t> failures_{0};
};

// Hostile actions: per kind, the outcomes seen; violations (a hostile call that succeeded where
// it must not); the last actions started (printed if spind dies).
class Hostile {
 public:
  void Start(const std::string& kind, double t) {
    std::lock_guard<std::mutex> l(mu_);
    recent_.push_back(absl::StrCat("t=", Fixed(t), "s ", kind));
    if (recent_.size() > 40) recent_.pop_front();
  }
  void Note(const std::string& kind, const std::string& outcome) {
    // Session ids out of the outcome, so that equal outcomes count together.
    std::string o = outcome.substr(0, 80);
    for (size_t p = o.find("s-"); p != std::string::npos; p = o.find("s-", p + 4)) {
      if (p > 0 && std::isalnum(static_cast<unsigned char>(o[p - 1]))) continue;
      size_t e = p + 2;
      while (e < o.size() && std::isxdigit(static_cast<unsigned char>(o[e]))) ++e;
      if (e - p > 6) o.replace(p, e - p, "s-<id>");
    }
    std::lock_guard<std::mutex> l(mu_);
    ++m_[kind][o];
    ++total_;
  }
  void Violation(const std::string& kind, const std::string& what) {
    std::lock_guard<std::mutex> l(mu_);
    ++violations_;
    if (vlist_.size() < 20) vlist_.push_back(kind + ": " + what);
  }
  uint64_t total() const { return total_; }
  uint64_t violations() const { return violations_; }
  std::map<std::string, std::map<std::string, uint64_t>> Snapshot() const {
    std::lock_guard<std::mutex> l(mu_);
    return m_;
  }
  std::vector<std::string> ViolationList() const {
    std::lock_guard<std::mutex> l(mu_);
    return vlist_;
  }
  std::deque<std::string> Recent() const {
    std::lock_guard<std::mutex> l(mu_);
    return recent_;
  }
  static std::string Fixed(double t) {
    char b[32];
    std::snprintf(b, sizeof(b), "%.1f", t);
    return b;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::map<std::string, uint64_t>> m_;
  std::deque<std::string> recent_;
  std::vector<std::string> vlist_;
  std::atomic<uint64_t> total_{0}, violations_{0};
};

struct Sample {
  double t = 0;
  long rss_kb = -1, fds = -1, threads = -1, sessions = -1;
};

// ---------------------------------------------------------------------------------------------
// The shared state of one run.

struct Run {
  Options opt;
  std::string dir, sock, target, fd_sock, log_path, trace_dir, self_exe;
  pid_t spind = -1;
  int metrics_port = -1;
  Clock::time_point t0 = Clock::now();
  spin::Trace trace;
  spin::Geometry geometry;
  spin::ReplayOptions replay;
  spin::ReplaySummary expected;

  std::atomic<bool> stop{false};  // everything ends (end of run, or spind died)
  std::atomic<bool> load{false};  // workers may start actions
  std::atomic<int> busy{0};       // workers inside an action
  std::atomic<bool> dead{false};
  std::atomic<double> dead_at{-1};
  std::string death;  // how spind ended (set once by the sampler before `dead`)

  Ops ops;
  Hostile hostile;
  std::mutex samples_mu;
  std::vector<Sample> samples;
  std::atomic<uint64_t> replays{0}, cycles{0};
  long max_sessions = 64;          // spind's --max-sessions (its default unless passed)
  bool overcommit_always = false;  // vm.overcommit_memory = 1: no allocation is refused

  double now() const { return Secs(t0, Clock::now()); }
};

// Holds `busy` while a worker runs an action; false when the worker must wait (load off).
class Action {
 public:
  explicit Action(Run& r) : r_(r) {
    r_.busy.fetch_add(1);
    on_ = r_.load.load() && !r_.stop.load();
    if (!on_) r_.busy.fetch_sub(1);
  }
  ~Action() {
    if (on_) r_.busy.fetch_sub(1);
  }
  bool on() const { return on_; }

 private:
  Run& r_;
  bool on_;
};

// --only: hostile actions whose kind does not contain the text are not performed.
// --skip: those whose kind contains any of the texts are not.
bool Skip(Run& r, const std::string& kind) {
  bool skip = !r.opt.only.empty() && kind.find(r.opt.only) == std::string::npos;
  for (const std::string& x : r.opt.skip) skip = skip || kind.find(x) != std::string::npos;
  if (skip) SleepMs(1);
  return skip;
}

// Waits until load is on (true) or the run stops (false).
bool WaitForLoad(Run& r) {
  while (!r.stop.load()) {
    if (r.load.load()) return true;
    SleepMs(20);
  }
  return false;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, bool big_receive) {
  grpc::ChannelArguments args;
  if (big_receive) args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // A fresh connection per channel (not one shared subchannel), as separate processes would.
  args.SetInt("grpc.use_local_subchannel_pool", 1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

template <typename Req, typename Resp, typename Fn>
grpc::Status Call(Fn fn, const Req& req, Resp* resp, double deadline_s = 10) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(int64_t(deadline_s * 1e3)));
  return fn(&ctx, req, resp);
}
#define RPC(stub, Method, req, resp, ...)                                                      \
  Call([&](grpc::ClientContext* c, const auto& q, auto* p) { return (stub).Method(c, q, p); }, \
       req, resp __VA_OPT__(, ) __VA_ARGS__)

pb::SessionRef Ref(const std::string& id, const std::string& token) {
  pb::SessionRef r;
  r.set_session_id(id);
  r.set_token(token);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Raw sockets

int UnixConnect(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return -1;
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, path.c_str());
  if (connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(s);
    return -1;
  }
  return s;
}

int TcpConnect(int port) {
  const int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(s);
    return -1;
  }
  return s;
}

bool SendAll(int s, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    pollfd p{s, POLLOUT, 0};
    if (poll(&p, 1, 3000) != 1) return false;
    const ssize_t n = send(s, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// Reads what arrives within `timeout_ms` (until EOF or `max` bytes). Sets *eof when the peer
// closed. Any SCM_RIGHTS fd received goes to *fd (else -1).
std::string RecvFor(int s, int timeout_ms, bool* eof, int* fd = nullptr, size_t max = 1 << 20) {
  std::string out;
  *eof = false;
  if (fd) *fd = -1;
  const auto end = Clock::now() + milliseconds(timeout_ms);
  while (out.size() < max) {
    const int left = static_cast<int>(
        std::max<int64_t>(0, std::chrono::duration_cast<milliseconds>(end - Clock::now()).count()));
    pollfd p{s, POLLIN, 0};
    if (poll(&p, 1, left) != 1) break;
    char buf[65536];
    iovec iov{buf, sizeof(buf)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; ++i) {
          int got;
          std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          if (fd && *fd < 0) {
            *fd = got;
          } else {
            close(got);
          }
        }
      }
    }
    if (n <= 0) {
      *eof = true;
      break;
    }
    out.append(buf, static_cast<size_t>(n));
    if (fd && out.find('\n') != std::string::npos) break;  // the fd socket's one reply line
  }
  return out;
}

// The fd socket handshake: "ATTACH id token\n" -> "OK <bytes>\n" + fd, or "ERR ...".
struct Fetched {
  int conn = -1, fd = -1;
  uint64_t bytes = 0;
  std::string reply;
};
bool FetchFd(const std::string& path, const std::string& id, const std::string& token, Fetched* f,
             int timeout_ms = 10000) {
  f->conn = UnixConnect(path);
  if (f->conn < 0) {
    f->reply = absl::StrCat("connect: ", std::strerror(errno));
    return false;
  }
  if (!SendAll(f->conn, absl::StrCat("ATTACH ", id, " ", token, "\n"))) {
    f->reply = "send failed";
    return false;
  }
  bool eof = false;
  f->reply = RecvFor(f->conn, timeout_ms, &eof, &f->fd, 4096);
  unsigned long long b = 0;
  if (f->reply.rfind("OK ", 0) == 0 && f->fd >= 0 &&
      std::sscanf(f->reply.c_str() + 3, "%llu", &b) == 1) {
    f->bytes = b;
    return true;
  }
  if (f->reply.empty()) f->reply = eof ? "closed without a reply" : "no reply in time";
  return false;
}
void CloseFetched(Fetched& f) {
  if (f.fd >= 0) close(f.fd);
  if (f.conn >= 0) close(f.conn);
  f.fd = f.conn = -1;
}

// An HTTP GET of /metrics: the status line's code, or -1.
int ScrapeMetrics(int port, std::string* body, int timeout_ms) {
  const int s = TcpConnect(port);
  if (s < 0) return -1;
  if (!SendAll(s, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")) {
    close(s);
    return -1;
  }
  bool eof = false;
  *body = RecvFor(s, timeout_ms, &eof, nullptr, 64 << 20);
  close(s);
  int code = -1;
  if (!eof || std::sscanf(body->c_str(), "HTTP/1.%*d %d", &code) != 1) return -1;
  return code;
}

// ---------------------------------------------------------------------------------------------
// /proc readings

Sample ReadProc(pid_t pid) {
  Sample s;
  std::ifstream st(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(st, line)) {
    if (line.rfind("VmRSS:", 0) == 0) s.rss_kb = std::atol(line.c_str() + 6);
    if (line.rfind("Threads:", 0) == 0) s.threads = std::atol(line.c_str() + 8);
  }
  if (DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str())) {
    long n = 0;
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') ++n;
    }
    closedir(d);
    s.fds = n;
  }
  return s;
}

std::string TailLog(const std::string& path, int lines) {
  std::ifstream f(path);
  std::deque<std::string> q;
  std::string l;
  while (std::getline(f, l)) {
    q.push_back(l.size() > 400 ? l.substr(0, 400) + "..." : l);
    if (static_cast<int>(q.size()) > lines) q.pop_front();
  }
  std::string out;
  for (const std::string& x : q) out += x + "\n";
  return out;
}

// ---------------------------------------------------------------------------------------------
// A data plane that times every call of the one it wraps (remote mode: each call is RPCs).

class TimedPlane final : public spin::DataPlane {
 public:
  TimedPlane(spin::DataPlane& in, Run& r, std::string prefix, bool remote)
      : in_(in), r_(r), prefix_(std::move(prefix)), remote_(remote) {}
  const spin::ArenaView& arena() const override { return in_.arena(); }
  bool on_device() const override { return in_.on_device(); }
  absl::Status ResetSequence(int32_t seq, uint64_t key, cudaStream_t st) override {
    return Time(remote_ ? "OpenSequences" : "ResetSequence",
                [&] { return in_.ResetSequence(seq, key, st); });
  }
  absl::Status BeginStep(const spin::StepBatch& b, cudaStream_t st) override {
    if (remote_) return in_.BeginStep(b, st);  // deferred to the next PredictMasks
    return Time("BeginStep", [&] { return in_.BeginStep(b, st); });
  }
  absl::Status Select(int32_t layer, const int32_t* table, int64_t stride,
                      cudaStream_t st) override {
    return Time(remote_ ? "Select (PredictMasks+GetStats)" : "Select",
                [&] { return in_.Select(layer, table, stride, st); });
  }
  absl::Status Remap(int32_t* idx, int32_t count, cudaStream_t st) override {
    if (remote_) return in_.Remap(idx, count, st);  // local on the mirror
    return Time("Remap", [&] { return in_.Remap(idx, count, st); });
  }
  absl::Status Observe(int32_t layer, const float* logits, int64_t stride, const int32_t* acc,
                       cudaStream_t st) override {
    return Time(remote_ ? "Observe (ObserveScores+GetStats)" : "Observe",
                [&] { return in_.Observe(layer, logits, stride, acc, st); });
  }
  bool failed() const { return failed_; }

 private:
  absl::Status Time(const char* what, const std::function<absl::Status()>& f) {
    const auto a = Clock::now();
    absl::Status s = f();
    const double ms = Ms(a, Clock::now());
    if (s.ok()) {
      r_.ops.Ok(prefix_ + what, ms);
    } else {
      failed_ = true;
      r_.ops.Fail(prefix_ + what, ms, std::string(s.ToString()), r_.now());
    }
    return s;
  }
  spin::DataPlane& in_;
  Run& r_;
  std::string prefix_;
  bool remote_;
  bool failed_ = false;
};

// Same replay results as the offline replay of the same trace and options.
std::string CompareSummary(const spin::ReplaySummary& want, const spin::ReplaySummary& got) {
  std::string d;
  auto cmp = [&](const char* name, double a, double b) {
    if (a != b) absl::StrAppend(&d, name, " ", b, " (offline ", a, ") ");
  };
  cmp("steps", want.steps, got.steps);
  cmp("mean_miss", want.mean_miss, got.mean_miss);
  cmp("p99_miss", want.p99_miss, got.p99_miss);
  cmp("realized_sparsity", want.realized_sparsity, got.realized_sparsity);
  cmp("effective_sparsity", want.effective_sparsity, got.effective_sparsity);
  cmp("sparse_steps", want.sparse_steps, got.sparse_steps);
  cmp("dense_steps", want.dense_steps, got.dense_steps);
  cmp("bad_scores", want.bad_scores, got.bad_scores);
  return d;
}

pb::AttachRequest AttachReqFor(const spin::Geometry& g, const spin::Policy& p, uint64_t seed,
                               const std::string& name) {
  pb::AttachRequest req;
  *req.mutable_geometry() = spin::ToProto(g);
  *req.mutable_policy() = spin::ToProto(p);
  req.set_seed(seed);
  req.set_client_name(name);
  return req;
}

// ---------------------------------------------------------------------------------------------
// Well-behaved clients

void LocalCycle(Run& r, int worker) {
  spin::client::AttachOptions ao;
  ao.geometry = r.geometry;
  ao.policy = r.replay.policy;
  ao.seed = r.replay.seed;
  ao.client_name = absl::StrCat("soak-well-", worker, "-local");
  auto a = Clock::now();
  auto s = spin::client::Session::Attach(r.target, ao);
  if (!s.ok()) {
    r.ops.Fail("local: Attach+fetch+map", Ms(a, Clock::now()), s.status().ToString(), r.now());
    return;
  }
  r.ops.Ok("local: Attach+fetch+map", Ms(a, Clock::now()));
  spin::client::Session& session = **s;
  TimedPlane tp(session.data_plane(), r, "local: ", false);
  a = Clock::now();
  absl::StatusOr<spin::ReplaySummary> out = spin::ReplayOn(tp, r.trace, r.replay);
  const double ms = Ms(a, Clock::now());
  r.replays.fetch_add(1);
  if (!out.ok()) {
    if (!tp.failed())
      r.ops.Fail("local: replay (whole trace)", ms, out.status().ToString(), r.now());
  } else if (std::string d = CompareSummary(r.expected, *out); !d.empty()) {
    r.ops.Fail("local: replay (whole trace)", ms, "results differ from offline replay: " + d,
               r.now());
  } else {
    r.ops.Ok("local: replay (whole trace)", ms);
  }
  pb::GetPolicyRequest gp;
  *gp.mutable_session() = Ref(session.id(), session.token());
  pb::GetPolicyResponse gpr;
  a = Clock::now();
  grpc::Status g = RPC(session.stub(), GetPolicy, gp, &gpr);
  if (g.ok()) {
    r.ops.Ok("control: GetPolicy", Ms(a, Clock::now()));
  } else {
    r.ops.Fail("control: GetPolicy", Ms(a, Clock::now()),
               CodeName(g.error_code()) + ": " + g.error_message(), r.now());
  }
  a = Clock::now();
  absl::Status d = session.Detach();
  if (d.ok()) {
    r.ops.Ok("local: Detach", Ms(a, Clock::now()));
  } else {
    r.ops.Fail("local: Detach", Ms(a, Clock::now()), d.ToString(), r.now());
  }
}

// Remote mode never fetches the fd (a session is driven locally or remotely, not both):
// libspin_client with AttachOptions::fetch_arena = false where the library has it, else a raw
// Attach over gRPC; then RemoteDataPlane.
template <typename O>
constexpr bool kHasFetchArena = requires(O o) {
  o.fetch_arena = false;
};
template <typename O>
void NoFetch(O& o) {
  if constexpr (kHasFetchArena<O>) o.fetch_arena = false;
}

void RemoteCycle(Run& r, int worker) {
  std::unique_ptr<spin::client::Session> session;  // the library's, without the fd
  std::unique_ptr<pb::Spin::Stub> raw;             // or a raw stub
  pb::Spin::Stub* stub = nullptr;
  std::string id, token;
  auto a = Clock::now();
  if constexpr (kHasFetchArena<spin::client::AttachOptions>) {
    spin::client::AttachOptions ao;
    ao.geometry = r.geometry;
    ao.policy = r.replay.policy;
    ao.seed = r.replay.seed;
    ao.client_name = absl::StrCat("soak-well-", worker, "-remote");
    NoFetch(ao);
    auto s = spin::client::Session::Attach(r.target, ao);
    if (!s.ok()) {
      r.ops.Fail("remote: Attach", Ms(a, Clock::now()), s.status().ToString(), r.now());
      return;
    }
    session = std::move(*s);
    stub = &session->stub();
    id = session->id();
    token = session->token();
  } else {
    raw = pb::Spin::NewStub(MakeChannel(r.target, false));
    stub = raw.get();
    pb::AttachResponse ar;
    grpc::Status g = RPC(*stub, Attach,
                         AttachReqFor(r.geometry, r.replay.policy, r.replay.seed,
                                      absl::StrCat("soak-well-", worker, "-remote")),
                         &ar);
    if (!g.ok()) {
      r.ops.Fail("remote: Attach", Ms(a, Clock::now()),
                 CodeName(g.error_code()) + ": " + g.error_message(), r.now());
      return;
    }
    id = ar.session_id();
    token = ar.token();
  }
  r.ops.Ok("remote: Attach", Ms(a, Clock::now()));
  {
    auto rdp = spin::client::RemoteDataPlane::Create(stub, id, token, r.geometry);
    if (!rdp.ok()) {
      r.ops.Fail("remote: replay (whole trace)", 0, rdp.status().ToString(), r.now());
    } else {
      TimedPlane tp(**rdp, r, "remote: ", true);
      a = Clock::now();
      absl::StatusOr<spin::ReplaySummary> out = spin::ReplayOn(tp, r.trace, r.replay);
      const double ms = Ms(a, Clock::now());
      r.replays.fetch_add(1);
      if (!out.ok()) {
        if (!tp.failed()) {
          r.ops.Fail("remote: replay (whole trace)", ms, out.status().ToString(), r.now());
        }
      } else if (std::string d = CompareSummary(r.expected, *out); !d.empty()) {
        r.ops.Fail("remote: replay (whole trace)", ms, "results differ from offline replay: " + d,
                   r.now());
      } else {
        r.ops.Ok("remote: replay (whole trace)", ms);
      }
    }
  }
  pb::GetBudgetsRequest gb;
  *gb.mutable_session() = Ref(id, token);
  pb::GetBudgetsResponse gbr;
  a = Clock::now();
  grpc::Status g = RPC(*stub, GetBudgets, gb, &gbr);
  if (g.ok()) {
    r.ops.Ok("control: GetBudgets", Ms(a, Clock::now()));
  } else {
    r.ops.Fail("control: GetBudgets", Ms(a, Clock::now()),
               CodeName(g.error_code()) + ": " + g.error_message(), r.now());
  }
  pb::DetachRequest dr;
  *dr.mutable_session() = Ref(id, token);
  pb::DetachResponse drr;
  a = Clock::now();
  g = RPC(*stub, Detach, dr, &drr);
  if (g.ok()) {
    r.ops.Ok("remote: Detach", Ms(a, Clock::now()));
  } else {
    r.ops.Fail("remote: Detach", Ms(a, Clock::now()),
               CodeName(g.error_code()) + ": " + g.error_message(), r.now());
  }
}

void WellBehaved(Run& r, int worker) {
  uint64_t cycle = static_cast<uint64_t>(worker);
  while (WaitForLoad(r)) {
    const uint64_t fails_before = r.ops.failures();
    {
      Action act(r);
      if (!act.on()) continue;
      if (cycle % 2 == 0) {
        LocalCycle(r, worker);
      } else {
        RemoteCycle(r, worker);
      }
      r.cycles.fetch_add(1);
    }
    ++cycle;
    // A failed cycle backs off, as a client would, instead of spinning on the error.
    SleepMs(r.ops.failures() != fails_before ? 200 : r.opt.well_pause_ms);
  }
}

// ---------------------------------------------------------------------------------------------
// (a) client processes SIGKILLed at random points of attach / fetch / steps. The child is this
// binary run as `soak --child MODE TARGET TRACE_DIR SEED`; it reports its progress on stdout
// ("A <id>" after Attach, "F" after the fd fetch, "S <n>" after each step, "E <msg>" on error).

int ChildMain(const std::string& mode, const std::string& target, const std::string& trace_dir,
              uint64_t seed) {
  auto say = [](const std::string& s) {
    std::printf("%s\n", s.c_str());
    std::fflush(stdout);
  };
  absl::StatusOr<spin::Trace> trace = spin::LoadTrace(trace_dir);
  if (!trace.ok()) {
    say("E load trace: " + trace.status().ToString());
    return 1;
  }
  spin::ReplayOptions ro;
  ro.seed = seed;
  ro.policy.probe_period = 8;
  ro.progress = [&](int done, int) { say(absl::StrCat("S ", done)); };
  const spin::Geometry g = spin::TraceGeometry(trace->meta(), trace->n_max(), ro.dtype);
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto stub = pb::Spin::NewStub(channel);
  pb::AttachResponse ar;
  grpc::Status st =
      RPC(*stub, Attach, AttachReqFor(g, ro.policy, seed, "soak-hostile-child-" + mode), &ar);
  if (!st.ok()) {
    say("E Attach " + CodeName(st.error_code()) + ": " + st.error_message());
    return 1;
  }
  say("A " + ar.session_id());
  if (mode == "attach") {
    while (true) pause();
  }
  SleepMs(30);  // so that a kill on "A" lands before the fetch
  if (mode == "local") {
    Fetched f;
    const std::string fd_sock = ar.fd_socket();
    if (!FetchFd(fd_sock, ar.session_id(), ar.token(), &f)) {
      say("E fetch: " + f.reply.substr(0, 60));
      return 1;
    }
    say("F");
    SleepMs(30);  // so that a kill on "F" lands before the first step
    void* base = mmap(nullptr, f.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f.fd, 0);
    if (base == MAP_FAILED) {
      say("E mmap");
      return 1;
    }
    absl::StatusOr<spin::ArenaView> v = spin::ViewArena(base, f.bytes);
    if (!v.ok()) {
      say("E view: " + v.status().ToString());
      return 1;
    }
    std::unique_ptr<spin::DataPlane> dp = spin::MakeCpuDataPlane(*v);
    while (true) {
      absl::StatusOr<spin::ReplaySummary> out = spin::ReplayOn(*dp, *trace, ro);
      if (!out.ok()) {
        say("E replay: " + out.status().ToString());
        return 1;
      }
    }
  }
  auto rdp = spin::client::RemoteDataPlane::Create(stub.get(), ar.session_id(), ar.token(), g);
  if (!rdp.ok()) {
    say("E remote: " + rdp.status().ToString());
    return 1;
  }
  while (true) {
    absl::StatusOr<spin::ReplaySummary> out = spin::ReplayOn(**rdp, *trace, ro);
    if (!out.ok()) {
      say("E replay: " + out.status().ToString());
      return 1;
    }
  }
}

struct Child {
  pid_t pid = -1;
  int out = -1;  // its stdout
  std::string buf;
};

bool SpawnChild(Run& r, const std::string& mode, uint64_t seed, Child* c) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return false;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p[1], 1);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  const std::string seed_s = std::to_string(seed);
  std::vector<std::string> args = {r.self_exe, "--child", mode, r.target, r.trace_dir, seed_s};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int rc = posix_spawn(&c->pid, r.self_exe.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(p[1]);
  if (rc != 0) {
    close(p[0]);
    return false;
  }
  c->out = p[0];
  return true;
}

// Reads the child's lines until one starts with `want` (or "E"), or the timeout. Returns the
// line, or "" on timeout / EOF.
std::string WaitLine(Child& c, const std::string& want, int timeout_ms) {
  const auto end = Clock::now() + milliseconds(timeout_ms);
  while (true) {
    size_t nl;
    while ((nl = c.buf.find('\n')) != std::string::npos) {
      std::string line = c.buf.substr(0, nl);
      c.buf.erase(0, nl + 1);
      if (line.rfind(want, 0) == 0 || line.rfind("E ", 0) == 0) return line;
    }
    const int64_t left = std::chrono::duration_cast<milliseconds>(end - Clock::now()).count();
    if (left <= 0) return "";
    pollfd p{c.out, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) != 1) return "";
    char b[4096];
    const ssize_t n = read(c.out, b, sizeof(b));
    if (n <= 0) return "";
    c.buf.append(b, static_cast<size_t>(n));
  }
}

void KillChildren(Run& r, int index) {
  std::mt19937_64 rng(r.opt.seed * 1000 + 100 + index);
  const int steps = r.trace.meta().steps;
  while (WaitForLoad(r)) {
    {
      Action act(r);
      if (!act.on()) continue;
      static const char* kModes[] = {"attach", "local", "remote"};
      const std::string mode = kModes[rng() % 3];
      // Kill points per mode.
      std::vector<std::string> points = {"during-attach", "after-attach"};
      if (mode == "local") {
        points = {"during-attach", "before-fetch", "after-fetch", "mid-local-steps"};
      } else if (mode == "remote") {
        points = {"during-attach", "after-attach", "mid-remote-step"};
      }
      const std::string point = points[rng() % points.size()];
      const std::string kind = "kill: " + mode + " / " + point;
      if (Skip(r, kind)) continue;
      r.hostile.Start(kind, r.now());
      Child c;
      if (!SpawnChild(r, mode, rng(), &c)) {
        r.hostile.Note(kind, "spawn failed");
        continue;
      }
      std::string outcome = "killed";
      if (point == "during-attach") {
        // exec + gRPC start-up take tens of ms here: anywhere from before to after the RPC.
        SleepMs(std::uniform_real_distribution<double>(5, 120)(rng));
      } else {
        std::string want = "A";
        if (point == "after-fetch") want = "F";
        if (point.rfind("mid-", 0) == 0) want = absl::StrCat("S ", 1 + rng() % (steps - 1));
        const std::string line = WaitLine(c, want, 15000);
        if (line.empty()) {
          outcome = "killed without reaching " + want + " in 15 s";
        } else if (line[0] == 'E') {
          outcome = "child error: " + line.substr(2);
          if (r.ops.watch) r.ops.watch(line);
        } else if (point.rfind("mid-", 0) == 0) {
          SleepMs(std::uniform_real_distribution<double>(0, 3)(rng));  // into the next call
        }
      }
      kill(c.pid, SIGKILL);
      waitpid(c.pid, nullptr, 0);
      close(c.out);
      r.hostile.Note(kind, outcome);
    }
    SleepMs(std::uniform_real_distribution<double>(100, 400)(rng));
  }
}

// ---------------------------------------------------------------------------------------------
// (b) raw connections to the fd socket.

std::vector<std::string> SessionIds(pb::Spin::Stub& stub) {
  pb::ListSessionsResponse ls;
  std::vector<std::string> ids;
  if (RPC(stub, ListSessions, pb::ListSessionsRequest(), &ls, 5).ok()) {
    for (const auto& s : ls.sessions()) ids.push_back(s.session_id());
  }
  return ids;
}

std::string RandomBytes(std::mt19937_64& rng, size_t n, bool newline_ok = true) {
  std::string s(n, '\0');
  for (char& c : s) {
    c = static_cast<char>(rng() & 0xff);
    if (!newline_ok && c == '\n') c = 'x';
  }
  return s;
}

std::string Token(std::mt19937_64& rng) {
  static const char* hex = "0123456789abcdef";
  std::string t;
  for (int i = 0; i < 32; ++i) t.push_back(hex[rng() % 16]);
  return t;
}

void FdHostile(Run& r, int index) {
  std::mt19937_64 rng(r.opt.seed * 1000 + 200 + index);
  auto stub = pb::Spin::NewStub(MakeChannel(r.target, true));
  while (WaitForLoad(r)) {
    {
      Action act(r);
      if (!act.on()) continue;
      const int what = static_cast<int>(rng() % 11);
      static const char* kNames[] = {"silent",
                                     "drip",
                                     "garbage line",
                                     "long line",
                                     "wrong token",
                                     "unknown id",
                                     "connect-close",
                                     "fetch, garbage after, close (no detach)",
                                     "fetch twice",
                                     "burst 100 conns",
                                     "half line then close"};
      const std::string kind = std::string("fd: ") + kNames[what];
      if (Skip(r, kind)) continue;
      r.hostile.Start(kind, r.now());
      std::string outcome;
      bool eof = false;
      int fd = -1;
      if (what == 0) {  // connect and say nothing
        const int s = UnixConnect(r.fd_sock);
        const std::string got = s < 0 ? "" : RecvFor(s, 1000 + rng() % 3000, &eof);
        outcome = s < 0 ? "connect failed" : eof ? "server closed: " + got.substr(0, 40) : "held";
        if (s >= 0) close(s);
      } else if (what == 1) {  // one byte at a time, slowly
        const int s = UnixConnect(r.fd_sock);
        if (s < 0) {
          outcome = "connect failed";
        } else {
          const std::string line = "ATTACH s-0000 " + Token(rng);
          const auto end = Clock::now() + milliseconds(1000 + rng() % 4000);
          size_t i = 0;
          while (Clock::now() < end && i < line.size()) {
            if (!SendAll(s, line.substr(i++, 1))) break;
            RecvFor(s, 300 + rng() % 600, &eof);
            if (eof) break;
          }
          outcome = eof ? absl::StrCat("server closed after ", i, " bytes") : "dripped, closed";
          close(s);
        }
      } else if (what == 2 || what == 3 || what == 10) {
        const int s = UnixConnect(r.fd_sock);
        if (s < 0) {
          outcome = "connect failed";
        } else {
          std::string data = what == 2   ? RandomBytes(rng, 1 + rng() % 300) + "\n"
                             : what == 3 ? std::string(64 << 10, 'A')
                                         : std::string("ATTACH s-");
          SendAll(s, data);
          const std::string got = what == 10 ? "" : RecvFor(s, 3000, &eof, &fd, 4096);
          if (fd >= 0) {
            r.hostile.Violation(kind, "an fd was handed out for garbage");
            close(fd);
          }
          outcome = what == 10    ? "sent, closed"
                    : got.empty() ? (eof ? "closed, no reply" : "no reply in 3 s")
                                  : got.substr(0, 30);
          close(s);
        }
      } else if (what == 4 || what == 5) {  // a real session with a wrong token; an unknown id
        std::vector<std::string> ids = SessionIds(*stub);
        const std::string id =
            what == 5 || ids.empty() ? absl::StrCat("s-", Token(rng)) : ids[rng() % ids.size()];
        Fetched f;
        if (FetchFd(r.fd_sock, id, Token(rng), &f, 5000)) {
          r.hostile.Violation(kind,
                              "spind handed out an arena for a wrong token (session " + id + ")");
          outcome = "OK (violation)";
        } else {
          outcome = f.reply.substr(0, 40);
        }
        CloseFetched(f);
      } else if (what == 6) {
        const int s = UnixConnect(r.fd_sock);
        outcome = s < 0 ? "connect failed" : "closed";
        if (s >= 0) close(s);
      } else if (what == 7 || what == 8) {
        // A session of our own: fetched (twice for 8), garbage written on the held connection,
        // then every connection closed without Detach: spind must free it after the grace.
        pb::AttachResponse ar;
        spin::Geometry g = r.geometry;
        grpc::Status st =
            RPC(*stub, Attach, AttachReqFor(g, r.replay.policy, 9, "soak-hostile-fd"), &ar);
        if (!st.ok()) {
          outcome = "Attach " + CodeName(st.error_code());
        } else {
          Fetched f1, f2;
          const bool ok1 = FetchFd(r.fd_sock, ar.session_id(), ar.token(), &f1, 10000);
          const bool ok2 = what == 8 && FetchFd(r.fd_sock, ar.session_id(), ar.token(), &f2, 10000);
          if (!ok1) {
            outcome = "fetch failed: " + f1.reply.substr(0, 40);
          } else {
            if (what == 7) SendAll(f1.conn, RandomBytes(rng, 1 + rng() % 4096));
            SleepMs(rng() % 500);
            outcome = what == 8 ? (ok2 ? "fetched twice, closed"
                                       : "second fetch: " + f2.reply.substr(0, 30))
                                : "fetched, garbage sent, closed";
          }
          CloseFetched(f1);
          SleepMs(rng() % 300);
          CloseFetched(f2);
          // ok1 false: nobody ever held it; detach so that it cannot linger.
          if (!ok1) {
            pb::DetachRequest dr;
            *dr.mutable_session() = Ref(ar.session_id(), ar.token());
            pb::DetachResponse drr;
            RPC(*stub, Detach, dr, &drr);
          }
        }
      } else {  // 9: many connections at once, held silent for a second
        std::vector<int> conns;
        for (int i = 0; i < 100; ++i) {
          const int s = UnixConnect(r.fd_sock);
          if (s >= 0) conns.push_back(s);
        }
        SleepMs(1000);
        for (int s : conns) close(s);
        outcome = absl::StrCat(conns.size(), " connected");
      }
      r.hostile.Note(kind, outcome);
    }
    SleepMs(std::uniform_real_distribution<double>(50, 300)(rng));
  }
}

// ---------------------------------------------------------------------------------------------
// (c) gRPC calls with garbage, oversize and out-of-range requests.

// Sends raw bytes as the request of `method` (not a valid message in general).
grpc::Status GenericCall(grpc::GenericStub& g, const std::string& method, const std::string& bytes,
                         std::string* reply = nullptr) {
  grpc::Slice slice(bytes);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  g.UnaryCall(&ctx, method, grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
    std::lock_guard<std::mutex> l(mu);
    status = s;
    done = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> l(mu);
  if (!cv.wait_for(l, std::chrono::seconds(20), [&] { return done; })) {
    ctx.TryCancel();
    cv.wait(l, [&] { return done; });
  }
  if (reply != nullptr && status.ok()) {
    std::vector<grpc::Slice> slices;
    if (resp.Dump(&slices).ok()) {
      for (const grpc::Slice& x : slices)
        reply->append(reinterpret_cast<const char*>(x.begin()), x.size());
    }
  }
  return status;
}

void RpcHostile(Run& r, int index) {
  std::mt19937_64 rng(r.opt.seed * 1000 + 300 + index);
  auto channel = MakeChannel(r.target, true);
  auto stub = pb::Spin::NewStub(channel);
  grpc::GenericStub generic(channel);
  const spin::Geometry small{2, 4, 1024, 64, 128, 2, spin::StateDtype::kFp32};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();

  // A session of our own with sequences 0..3 open and, with `step`, one step begun and layer 0
  // selected (4 entries x 2 rows).
  auto own = [&](bool step, pb::AttachResponse* ar) -> bool {
    if (!RPC(*stub, Attach, AttachReqFor(small, r.replay.policy, 5, "soak-hostile-rpc"), ar).ok()) {
      return false;
    }
    pb::OpenSequencesRequest os;
    *os.mutable_session() = Ref(ar->session_id(), ar->token());
    for (int i = 0; i < 4; ++i) os.add_sequences()->set_sequence(i);
    pb::OpenSequencesResponse osr;
    RPC(*stub, OpenSequences, os, &osr);
    if (step) {
      pb::PredictMasksRequest pm;
      *pm.mutable_session() = os.session();
      pm.set_begin_step(true);
      pm.set_rows(2);
      for (int i = 0; i < 4; ++i) {
        pb::StepEntry* e = pm.add_entries();
        e->set_sequence(i);
        e->set_ctx_len(900);
        e->set_q_pos(899);
      }
      pb::PredictMasksResponse pmr;
      RPC(*stub, PredictMasks, pm, &pmr);
    }
    return true;
  };
  auto detach = [&](const pb::AttachResponse& ar) {
    pb::DetachRequest dr;
    *dr.mutable_session() = Ref(ar.session_id(), ar.token());
    pb::DetachResponse drr;
    return RPC(*stub, Detach, dr, &drr);
  };
  // `st` must not be OK: a violation when it is.
  auto must_fail = [&](const std::string& kind, const grpc::Status& st, const std::string& what) {
    if (st.ok()) r.hostile.Violation(kind, what + " succeeded");
    return CodeName(st.error_code());
  };

  while (WaitForLoad(r)) {
    {
      Action act(r);
      if (!act.on()) continue;
      const int what = static_cast<int>(rng() % 16);
      static const char* kNames[] = {"Attach client_name 1-3 MiB",
                                     "Attach client_name 5 MiB (over the 4 MiB limit)",
                                     "Attach geometry/policy out of range or NaN",
                                     "wrong token on a live session (every method)",
                                     "unknown / empty / 1 MiB session id",
                                     "OpenSequences 200k entries",
                                     "PredictMasks out of range",
                                     "ObserveScores 1M empty rows",
                                     "ObserveScores one row of 1M floats (x8 rows)",
                                     "ObserveScores NaN/inf scores and bad accepted",
                                     "ObserveScores out-of-range layer / before a step",
                                     "garbage protobuf bytes to every method",
                                     "WatchBudgets abandoned / session detached under it",
                                     "fd fetched, then driven remotely",
                                     "unknown method",
                                     "ObserveScores amplification: 4096 entries x 16 rows, one "
                                     "row of 900k floats (a 236 GB buffer)"};
      const std::string kind = std::string("rpc: ") + kNames[what];
      if (Skip(r, kind)) continue;
      r.hostile.Start(kind, r.now());
      std::string outcome;
      pb::AttachResponse ar;
      if (what == 0 || what == 1) {
        const size_t mib = what == 0 ? 1 + rng() % 3 : 5;
        pb::AttachRequest req = AttachReqFor(small, r.replay.policy, 1, "");
        req.set_client_name(std::string(mib << 20, 'n'));
        grpc::Status st = RPC(*stub, Attach, req, &ar, 30);
        outcome = CodeName(st.error_code());
        if (st.ok()) {
          // The name is stored; ListSessions now carries it. Hold the session a little.
          pb::ListSessionsResponse ls;
          grpc::Status l = RPC(*stub, ListSessions, pb::ListSessionsRequest(), &ls, 30);
          outcome += absl::StrCat(", ListSessions ", CodeName(l.error_code()));
          SleepMs(rng() % 1000);
          detach(ar);
        }
        if (what == 1 && st.ok()) r.hostile.Violation(kind, "a 5 MiB Attach was accepted");
      } else if (what == 2) {
        pb::AttachRequest req = AttachReqFor(small, r.replay.policy, 1, "soak-hostile-bad");
        pb::Geometry* g = req.mutable_geometry();
        pb::Policy* p = req.mutable_policy();
        // Each field just past its range (docs: layers 1..1024, sequences and block size
        // 1..4096, slots 1..2^24, rows 1..16), or 0, or huge.
        auto bad = [&](uint32_t past) {
          const uint32_t v[] = {0u, past, 1u << 31, 0xffffffffu};
          return v[rng() % 4];
        };
        switch (rng() % 10) {
          case 0:
            g->set_layers(bad(1025));
            break;
          case 1:
            g->set_max_sequences(bad(4097));
            break;
          case 2:
            g->set_max_slots(bad((1u << 24) + 1));
            break;
          case 3:
            g->set_block_size(bad(4097));
            break;
          case 4:
            g->set_max_rows(bad(17));
            break;
          case 5:
            g->set_state_dtype(static_cast<pb::StateDtype>(77));
            break;
          case 6:
            p->set_target_sparsity(rng() % 2 ? std::nan("") : -0.5);
            break;
          case 7:
            p->set_alpha(rng() % 2 ? nan : inf);
            break;
          case 8:
            p->set_budget_mode(static_cast<pb::BudgetMode>(99));
            break;
          default:  // every limit at its maximum at once: too large for the arena limit
            g->set_layers(1024);
            g->set_max_sequences(4096);
            g->set_max_slots(1u << 24);
            g->set_max_rows(16);
            g->set_block_size(1);
            g->set_topk(0xffffffffu);
        }
        grpc::Status st = RPC(*stub, Attach, req, &ar);
        outcome = must_fail(kind, st,
                            "Attach with " + req.geometry().ShortDebugString() + " " +
                                req.policy().ShortDebugString());
        if (st.ok()) detach(ar);
      } else if (what == 3 || what == 4) {
        std::vector<std::string> ids = SessionIds(*stub);
        std::string id;
        if (what == 3) {
          if (ids.empty()) {
            r.hostile.Note(kind, "no live session");
            continue;
          }
          id = ids[rng() % ids.size()];
        } else {
          const int k = static_cast<int>(rng() % 3);
          id = k == 0 ? absl::StrCat("s-", Token(rng)) : k == 1 ? "" : std::string(1 << 20, 's');
        }
        const pb::SessionRef ref = Ref(id, Token(rng));
        std::map<std::string, int> codes;
        auto note = [&](const char* m, const grpc::Status& st) {
          ++codes[CodeName(st.error_code())];
          if (st.ok()) r.hostile.Violation(kind, std::string(m) + " with a wrong token succeeded");
        };
        {
          pb::GetPolicyRequest q;
          *q.mutable_session() = ref;
          pb::GetPolicyResponse p;
          note("GetPolicy", RPC(*stub, GetPolicy, q, &p));
        }
        {
          pb::SetPolicyRequest q;
          *q.mutable_session() = ref;
          q.set_target_sparsity(0.9);
          pb::SetPolicyResponse p;
          note("SetPolicy", RPC(*stub, SetPolicy, q, &p));
        }
        {
          pb::GetBudgetsRequest q;
          *q.mutable_session() = ref;
          pb::GetBudgetsResponse p;
          note("GetBudgets", RPC(*stub, GetBudgets, q, &p));
        }
        {
          pb::GetStatsRequest q;
          *q.mutable_session() = ref;
          pb::GetStatsResponse p;
          note("GetStats", RPC(*stub, GetStats, q, &p));
        }
        {
          pb::OpenSequencesRequest q;
          *q.mutable_session() = ref;
          q.add_sequences()->set_sequence(0);
          pb::OpenSequencesResponse p;
          note("OpenSequences", RPC(*stub, OpenSequences, q, &p));
        }
        {
          pb::PredictMasksRequest q;
          *q.mutable_session() = ref;
          q.set_layer(0);
          pb::PredictMasksResponse p;
          note("PredictMasks", RPC(*stub, PredictMasks, q, &p));
        }
        {
          pb::ObserveScoresRequest q;
          *q.mutable_session() = ref;
          pb::ObserveScoresResponse p;
          note("ObserveScores", RPC(*stub, ObserveScores, q, &p));
        }
        {
          pb::DetachRequest q;
          *q.mutable_session() = ref;
          pb::DetachResponse p;
          note("Detach", RPC(*stub, Detach, q, &p));
        }
        {
          // KeepAlive (newer daemons) through the generic stub: its request has the same wire
          // form as GetPolicyRequest (field 1, the SessionRef).
          pb::GetPolicyRequest q;
          *q.mutable_session() = ref;
          grpc::Status st = GenericCall(generic, "/spin.v1.Spin/KeepAlive", q.SerializeAsString());
          if (st.error_code() != grpc::StatusCode::UNIMPLEMENTED) note("KeepAlive", st);
        }
        for (const auto& [c, n] : codes) absl::StrAppend(&outcome, outcome.empty() ? "" : " ", c);
      } else if (what == 5) {
        if (!own(false, &ar)) {
          outcome = "own Attach failed";
        } else {
          pb::OpenSequencesRequest q;
          *q.mutable_session() = Ref(ar.session_id(), ar.token());
          const bool bad_last = rng() % 2;
          for (int i = 0; i < 200000; ++i) {
            pb::SequenceOpen* o = q.add_sequences();
            o->set_sequence(i % 4);
            o->set_key(rng());
          }
          if (bad_last) q.mutable_sequences(199999)->set_sequence(4);
          pb::OpenSequencesResponse p;
          grpc::Status st = RPC(*stub, OpenSequences, q, &p, 30);
          outcome =
              (bad_last ? "last out of range: " : "all in range: ") + CodeName(st.error_code());
          if (bad_last && st.ok()) r.hostile.Violation(kind, "an out-of-range slot was accepted");
          detach(ar);
        }
      } else if (what == 6) {
        if (!own(false, &ar)) {
          outcome = "own Attach failed";
        } else {
          pb::PredictMasksRequest q;
          *q.mutable_session() = Ref(ar.session_id(), ar.token());
          q.set_begin_step(true);
          q.set_rows(2);
          for (int i = 0; i < 4; ++i) {
            pb::StepEntry* e = q.add_entries();
            e->set_sequence(i);
            e->set_ctx_len(900);
            e->set_q_pos(899);
          }
          const int c = static_cast<int>(rng() % 9);
          std::string desc;
          switch (c) {
            case 0:
              q.set_layer(rng() % 2 ? -1 : 1 << 30);
              desc = "layer";
              break;
            case 1:
              q.set_rows(rng() % 2 ? 0 : 1000);
              desc = "rows";
              break;
            case 2:
              q.mutable_entries(1)->set_sequence(rng() % 2 ? -7 : 4);
              desc = "sequence";
              break;
            case 3:
              q.mutable_entries(2)->set_ctx_len(rng() % 2 ? -5 : 1 << 30);
              desc = "ctx_len";
              break;
            case 4:
              q.mutable_entries(3)->set_q_pos(rng() % 2 ? -1 : 5000);
              desc = "q_pos";
              break;
            case 5:
              q.mutable_entries(3)->set_sequence(0);
              desc = "repeated sequence";
              break;
            case 6:
              for (int i = 0; i < 100000; ++i) q.add_entries()->set_sequence(0);
              desc = "100k entries";
              break;
            case 7:
              q.set_begin_step(false);
              q.clear_entries();
              desc = "no step begun";
              break;
            default:
              q.set_layer(2);
              desc = "layer == layers";
              break;
          }
          pb::PredictMasksResponse p;
          grpc::Status st = RPC(*stub, PredictMasks, q, &p, 30);
          outcome = desc + ": " + CodeName(st.error_code());
          // A missing step is not an error for every daemon version (an empty batch); the
          // others are.
          if (c != 7 && st.ok())
            r.hostile.Violation(kind, "PredictMasks with a bad " + desc + " succeeded");
          detach(ar);
        }
      } else if (what >= 7 && what <= 10) {
        if (!own(what != 10 || rng() % 2, &ar)) {
          outcome = "own Attach failed";
        } else {
          pb::ObserveScoresRequest q;
          *q.mutable_session() = Ref(ar.session_id(), ar.token());
          q.set_layer(0);
          bool expect_fail = true;
          if (what == 7) {
            for (int i = 0; i < 1000000; ++i) q.add_scores();
          } else if (what == 8) {
            // Rows of the right count; one of them 1M floats wide (the daemon sizes its buffer
            // by the widest row: 8 rows x 1M floats = 32 MiB for one 4 MiB request).
            for (int i = 0; i < 8; ++i) {
              pb::RowScores* rs = q.add_scores();
              const int n = i == 0 ? 1000000 : 1024;
              rs->mutable_logits()->Resize(n, 0.5f);
            }
            expect_fail = false;
          } else if (what == 9) {
            for (int i = 0; i < 8; ++i) {
              pb::RowScores* rs = q.add_scores();
              for (int k = 0; k < 1024; ++k)
                rs->add_logits(k % 3 == 0 ? nan : k % 3 == 1 ? inf : -inf);
            }
            if (rng() % 2) {
              for (int e = 0; e < 4; ++e) q.add_accepted(rng() % 2 ? -5 : 1000);
            } else {
              expect_fail = false;
            }
          } else {
            q.set_layer(rng() % 2 ? -3 : 1 << 30);
            for (int i = 0; i < 8; ++i) q.add_scores()->mutable_logits()->Resize(1024, 1.0f);
          }
          pb::ObserveScoresResponse p;
          grpc::Status st = RPC(*stub, ObserveScores, q, &p, 30);
          outcome = CodeName(st.error_code());
          if (what == 9 && st.ok()) absl::StrAppend(&outcome, ", bad_scores ", p.bad_scores());
          if (expect_fail && st.ok()) r.hostile.Violation(kind, "accepted");
          detach(ar);
        }
      } else if (what == 15) {
        // A small session (1 layer x 4096 sequences x 64 slots, 16 rows): one real entry and
        // 4095 padding entries, then 65536 rows of scores of which one is 900k floats wide: a
        // 3.7 MB request. spind at ed90177 sizes its buffer rows x widest row = 236 GB; with
        // overcommit off (mode 0) the allocation fails at once, touching nothing. With
        // overcommit_memory = 1 it would be touched: not run then.
        if (r.overcommit_always) {
          r.hostile.Note(kind, "not run: vm.overcommit_memory = 1");
          continue;
        }
        const spin::Geometry wide{1, 4096, 64, 64, 16, 16, spin::StateDtype::kFp32};
        if (!RPC(*stub, Attach, AttachReqFor(wide, r.replay.policy, 5, "soak-hostile-amp"), &ar)
                 .ok()) {
          outcome = "own Attach failed";
        } else {
          const pb::SessionRef ref = Ref(ar.session_id(), ar.token());
          pb::OpenSequencesRequest os;
          *os.mutable_session() = ref;
          os.add_sequences()->set_sequence(0);
          pb::OpenSequencesResponse osr;
          RPC(*stub, OpenSequences, os, &osr);
          pb::ObserveScoresRequest q;
          *q.mutable_session() = ref;
          q.set_layer(0);
          for (int i = 0; i < 4096 * 16; ++i) {
            pb::RowScores* rs = q.add_scores();
            if (i < 16) rs->mutable_logits()->Resize(i == 0 ? 900000 : 64, 0.25f);
          }
          pb::ObserveScoresResponse p;
          // The same request before any step (row count wrong): shows that it parses.
          grpc::Status before = RPC(*stub, ObserveScores, q, &p, 30);
          pb::PredictMasksRequest pm;
          *pm.mutable_session() = ref;
          pm.set_begin_step(true);
          pm.set_rows(16);
          for (int i = 0; i < 4096; ++i) {
            pb::StepEntry* e = pm.add_entries();
            e->set_sequence(i == 0 ? 0 : -1);
            e->set_ctx_len(40);
            e->set_q_pos(39);
          }
          pb::PredictMasksResponse pmr;
          grpc::Status pst = RPC(*stub, PredictMasks, pm, &pmr, 30);
          grpc::Status st = RPC(*stub, ObserveScores, q, &p, 30);
          outcome = "before the step " + CodeName(before.error_code()) + "; PredictMasks " +
                    CodeName(pst.error_code()) + ", ObserveScores " + CodeName(st.error_code());
          detach(ar);
        }
      } else if (what == 11) {
        static const char* kMethods[] = {
            "Attach",        "Detach",       "GetPolicy",     "SetPolicy", "GetBudgets",
            "OpenSequences", "PredictMasks", "ObserveScores", "GetStats",  "ListSessions"};
        std::map<std::string, int> codes;
        for (const char* m : kMethods) {
          const std::string bytes = RandomBytes(rng, 1 + rng() % 2048);
          std::string reply;
          const grpc::Status st =
              GenericCall(generic, std::string("/spin.v1.Spin/") + m, bytes, &reply);
          ++codes[CodeName(st.error_code())];
          // Garbage that happens to parse as a valid Attach made a session: free it.
          pb::AttachResponse made;
          if (st.ok() && std::strcmp(m, "Attach") == 0 && made.ParseFromString(reply)) detach(made);
        }
        for (const auto& [c, n] : codes)
          absl::StrAppend(&outcome, outcome.empty() ? "" : " ", c, "x", n);
      } else if (what == 12) {
        if (!own(false, &ar)) {
          outcome = "own Attach failed";
        } else {
          const int how = static_cast<int>(rng() % 3);
          auto ctx = std::make_unique<grpc::ClientContext>();
          pb::GetBudgetsRequest q;
          *q.mutable_session() = Ref(ar.session_id(), ar.token());
          auto reader = stub->WatchBudgets(ctx.get(), q);
          pb::GetBudgetsResponse m;
          const bool first = reader->Read(&m);
          if (how == 0) {  // detach under the stream: it must end with OK
            detach(ar);
            while (reader->Read(&m)) {
            }
            outcome = "detached under it: " + CodeName(reader->Finish().error_code());
          } else if (how == 1) {  // cancel
            ctx->TryCancel();
            while (reader->Read(&m)) {
            }
            reader->Finish();
            detach(ar);
            outcome = "cancelled";
          } else {  // a SetPolicy storm, then drop the stream
            for (int i = 0; i < 50; ++i) {
              pb::SetPolicyRequest sp;
              *sp.mutable_session() = q.session();
              sp.set_target_sparsity(0.1 + 0.01 * i);
              pb::SetPolicyResponse spr;
              RPC(*stub, SetPolicy, sp, &spr);
            }
            ctx->TryCancel();
            while (reader->Read(&m)) {
            }
            reader->Finish();
            detach(ar);
            outcome = "50 SetPolicy, then cancelled";
          }
          if (!first) outcome += " (no first message)";
        }
      } else if (what == 13) {
        spin::client::AttachOptions ao;
        ao.geometry = small;
        ao.client_name = "soak-hostile-mixed";
        auto s = spin::client::Session::Attach(r.target, ao);
        if (!s.ok()) {
          outcome = "Attach: " + CodeName(s.status().code());
        } else {
          pb::OpenSequencesRequest q;
          *q.mutable_session() = Ref((*s)->id(), (*s)->token());
          q.add_sequences()->set_sequence(0);
          pb::OpenSequencesResponse p;
          grpc::Status st = RPC(*stub, OpenSequences, q, &p);
          outcome = "remote call on a fetched session: " + CodeName(st.error_code());
          (void)(*s)->Detach();
        }
      } else {
        std::map<std::string, int> codes;
        for (const char* m : {"/spin.v1.Spin/Nope", "/spin.v2.Spin/Attach", "/x", "/"}) {
          ++codes[CodeName(GenericCall(generic, m, RandomBytes(rng, 16)).error_code())];
        }
        for (const auto& [c, n] : codes)
          absl::StrAppend(&outcome, outcome.empty() ? "" : " ", c, "x", n);
      }
      r.hostile.Note(kind, outcome);
    }
    SleepMs(std::uniform_real_distribution<double>(50, 250)(rng));
  }
}

// ---------------------------------------------------------------------------------------------
// (d) raw garbage to the gRPC Unix socket and the metrics HTTP port.

void RawHostile(Run& r, int index) {
  std::mt19937_64 rng(r.opt.seed * 1000 + 400 + index);
  const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  while (WaitForLoad(r)) {
    {
      Action act(r);
      if (!act.on()) continue;
      const bool http = r.metrics_port > 0 && rng() % 2;
      const int what = static_cast<int>(rng() % 6);
      std::string kind;
      std::string outcome;
      bool eof = false;
      if (!http) {
        static const char* kNames[] = {"random bytes",
                                       "preface + random frames",
                                       "preface + frame header claiming 16 MiB, then silence",
                                       "silent connection",
                                       "HTTP/1.1 request",
                                       "half a preface, then close"};
        kind = std::string("grpc socket: ") + kNames[what];
        if (Skip(r, kind)) continue;
        r.hostile.Start(kind, r.now());
        const int s = UnixConnect(r.sock);
        if (s < 0) {
          r.hostile.Note(kind, "connect failed");
          continue;
        }
        std::string data;
        int wait = 500;
        if (what == 0) data = RandomBytes(rng, 1 + rng() % 65536);
        if (what == 1) data = preface + RandomBytes(rng, 9 + rng() % 16384);
        if (what == 2) {
          data = preface + std::string("\xff\xff\xff\x00\x00\x00\x00\x00\x01", 9);
          wait = 1000 + rng() % 3000;
        }
        if (what == 3) wait = 1000 + rng() % 4000;
        if (what == 4) data = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        if (what == 5) data = preface.substr(0, 10);
        SendAll(s, data);
        const std::string got = RecvFor(s, wait, &eof);
        outcome = eof           ? "server closed"
                  : got.empty() ? "held, closed by us"
                                : "replied, closed by us";
        close(s);
      } else {
        static const char* kNames[] = {"random bytes",
                                       "slowloris (header bytes dripped, 3 connections)",
                                       "64 KiB header line",
                                       "odd paths and methods",
                                       "burst of 40 connections",
                                       "request, then close before reading"};
        kind = std::string("metrics port: ") + kNames[what];
        if (Skip(r, kind)) continue;
        r.hostile.Start(kind, r.now());
        if (what == 1) {
          std::vector<int> conns;
          for (int i = 0; i < 3; ++i) {
            const int s = TcpConnect(r.metrics_port);
            if (s >= 0 && SendAll(s, "GET /metrics HTTP/1.1\r\n")) conns.push_back(s);
          }
          const auto end = Clock::now() + milliseconds(2000 + rng() % 3000);
          while (Clock::now() < end) {
            for (int s : conns) SendAll(s, "X");
            SleepMs(400);
          }
          for (int s : conns) close(s);
          outcome = absl::StrCat(conns.size(), " held");
        } else if (what == 4) {
          std::vector<int> conns;
          for (int i = 0; i < 40; ++i) {
            const int s = TcpConnect(r.metrics_port);
            if (s >= 0) conns.push_back(s);
          }
          SleepMs(500);
          for (int s : conns) close(s);
          outcome = absl::StrCat(conns.size(), " connected");
        } else {
          const int s = TcpConnect(r.metrics_port);
          if (s < 0) {
            r.hostile.Note(kind, "connect failed");
            continue;
          }
          std::string data;
          if (what == 0) data = RandomBytes(rng, 1 + rng() % 8192);
          if (what == 2)
            data = "GET /metrics HTTP/1.1\r\nX-A: " + std::string(64 << 10, 'a') + "\r\n\r\n";
          if (what == 3) {
            static const char* kReq[] = {
                "GET /../../../../etc/passwd HTTP/1.1\r\n\r\n", "DELETE /metrics HTTP/1.1\r\n\r\n",
                "GET /metrics?x=%00%ff HTTP/1.1\r\n\r\n",
                "POST /metrics HTTP/1.1\r\nContent-Length: 99999999\r\n\r\nab",
                "GET /metrics HTTP/9.9\r\n\r\n"};
            data = kReq[rng() % 5];
          }
          if (what == 5) data = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
          SendAll(s, data);
          std::string got;
          if (what != 5) got = RecvFor(s, 2000, &eof, nullptr, 1 << 16);
          int code = -1;
          std::sscanf(got.c_str(), "HTTP/1.%*d %d", &code);
          outcome = what == 5  ? "closed unread"
                    : code > 0 ? absl::StrCat("HTTP ", code)
                    : eof      ? "closed"
                               : "no reply in 2 s";
          close(s);
        }
      }
      r.hostile.Note(kind, outcome);
    }
    SleepMs(std::uniform_real_distribution<double>(50, 300)(rng));
  }
}

// ---------------------------------------------------------------------------------------------
// Sampler (every second), scraper (every 2 s), spind start and death.

void Sampler(Run& r) {
  auto stub = pb::Spin::NewStub(MakeChannel(r.target, true));
  auto next = Clock::now();
  while (!r.stop.load()) {
    int status = 0;
    if (waitpid(r.spind, &status, WNOHANG) == r.spind) {
      r.death = WIFSIGNALED(status) ? absl::StrCat("killed by signal ", WTERMSIG(status), " (",
                                                   strsignal(WTERMSIG(status)), ")")
                                    : absl::StrCat("exited with status ", WEXITSTATUS(status));
      r.dead_at = r.now();
      r.spind = -1;
      r.dead = true;
      r.stop = true;
      return;
    }
    if (Clock::now() >= next) {
      next += std::chrono::seconds(1);
      Sample s = ReadProc(r.spind);
      s.t = r.now();
      pb::ListSessionsResponse ls;
      const auto a = Clock::now();
      grpc::Status st = RPC(*stub, ListSessions, pb::ListSessionsRequest(), &ls, 5);
      if (st.ok()) {
        s.sessions = ls.sessions_size();
        if (s.sessions > r.max_sessions) {
          r.hostile.Violation(
              "limits", absl::StrCat("spind held ", s.sessions, " sessions, over --max-sessions ",
                                     r.max_sessions, " (t=", int(r.now()), "s)"));
        }
        r.ops.Ok("control: ListSessions (sampler)", Ms(a, Clock::now()));
      } else {
        r.ops.Fail("control: ListSessions (sampler)", Ms(a, Clock::now()),
                   CodeName(st.error_code()) + ": " + st.error_message(), r.now());
      }
      std::lock_guard<std::mutex> l(r.samples_mu);
      r.samples.push_back(s);
    }
    SleepMs(100);
  }
}

void Scraper(Run& r) {
  while (!r.stop.load()) {
    std::string body;
    const auto a = Clock::now();
    const int code = ScrapeMetrics(r.metrics_port, &body, 10000);
    const double ms = Ms(a, Clock::now());
    if (code == 200 && body.find("spin_sessions") != std::string::npos) {
      r.ops.Ok("metrics: GET /metrics", ms);
    } else if (!r.stop.load()) {
      r.ops.Fail("metrics: GET /metrics", ms,
                 code < 0 ? "no complete reply in 10 s" : absl::StrCat("HTTP ", code), r.now());
    }
    for (int i = 0; i < 20 && !r.stop.load(); ++i) SleepMs(100);
  }
}

Sample Latest(Run& r) {
  std::lock_guard<std::mutex> l(r.samples_mu);
  return r.samples.empty() ? Sample{} : r.samples.back();
}

bool StartSpind(Run& r) {
  r.sock = r.dir + "/spind.sock";
  r.fd_sock = r.sock + ".fd";
  r.target = "unix://" + r.sock;
  r.log_path = r.dir + "/spind.log";
  std::vector<std::string> args = {r.opt.spind,
                                   "--listen",
                                   r.target,
                                   "--backend",
                                   "cpu",
                                   "--client-grace-ms",
                                   std::to_string(r.opt.grace_ms),
                                   "--metrics-address",
                                   "127.0.0.1:0"};
  args.insert(args.end(), r.opt.spind_args.begin(), r.opt.spind_args.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, r.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  const int rc = posix_spawn(&r.spind, r.opt.spind.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    std::fprintf(stderr, "soak: cannot start %s: %s\n", r.opt.spind.c_str(), std::strerror(rc));
    return false;
  }
  auto ch = MakeChannel(r.target, true);
  if (!ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20))) {
    std::fprintf(stderr, "soak: spind did not come up in 20 s; its log:\n%s",
                 TailLog(r.log_path, 20).c_str());
    return false;
  }
  for (int i = 0; i < 100 && r.metrics_port < 0; ++i) {
    std::ifstream f(r.log_path);
    std::string line;
    while (std::getline(f, line)) {
      const size_t p = line.find("metrics on http://127.0.0.1:");
      if (p != std::string::npos) r.metrics_port = std::atoi(line.c_str() + p + 28);
    }
    if (r.metrics_port < 0) SleepMs(100);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Phases, checks and the report.

void Progress(Run& r, const char* phase) {
  const Sample s = Latest(r);
  std::fprintf(stderr,
               "soak: %6.0fs %-9s sessions %3ld  rss %6.1f MiB  fds %4ld  threads %3ld  "
               "ok-ops %8llu  failures %llu  hostile %7llu  violations %llu\n",
               r.now(), phase, s.sessions, s.rss_kb / 1024.0, s.fds, s.threads,
               static_cast<unsigned long long>(r.ops.total()),
               static_cast<unsigned long long>(r.ops.failures()),
               static_cast<unsigned long long>(r.hostile.total()),
               static_cast<unsigned long long>(r.hostile.violations()));
}

// Runs the load for `secs` (progress every 10 s). False if spind died.
bool RunLoad(Run& r, double secs, const char* phase) {
  r.load = true;
  const auto end = Clock::now() + std::chrono::milliseconds(int64_t(secs * 1e3));
  auto next = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < end && !r.dead.load()) {
    SleepMs(100);
    if (Clock::now() >= next) {
      next += std::chrono::seconds(10);
      Progress(r, phase);
    }
  }
  return !r.dead.load();
}

// Stops the load and waits for every worker to finish its action. Returns the seconds it took
// (a worker stuck in a call shows up here).
double Quiesce(Run& r) {
  const auto a = Clock::now();
  r.load = false;
  while (r.busy.load() > 0 && !r.dead.load()) SleepMs(20);
  return Secs(a, Clock::now());
}

// After quiescing: the grace period and a margin, then samples until sessions and fds stop
// changing (at most `max_s`). Returns the state settled on.
Sample Settle(Run& r, double max_s) {
  const double start = r.now();
  SleepMs(r.opt.grace_ms + 3000);
  Sample last = Latest(r);
  int stable = 0;
  while (!r.dead.load() && r.now() - start < max_s) {
    SleepMs(1000);
    const Sample s = Latest(r);
    stable = s.sessions == last.sessions && s.fds == last.fds ? stable + 1 : 0;
    last = s;
    if (stable >= 3) break;
  }
  return last;
}

std::string Fmt(double v, int prec = 2) {
  char b[64];
  std::snprintf(b, sizeof(b), "%.*f", prec, v);
  return b;
}

struct Verdict {
  std::vector<std::string> fails;
};

std::string Report(Run& r, const Sample& base, const Sample& fin, const Verdict& v, double main_s,
                   double quiesce_s) {
  std::ostringstream o;
  const bool pass = v.fails.empty();
  o << "# spind soak run\n\n";
  o << "Result: **" << (pass ? "PASS" : "FAIL") << "**";
  for (const std::string& f : v.fails) o << "\n- " << f;
  o << "\n\n";
  utsname u{};
  uname(&u);
  o << "Commit measured: `" << (r.opt.commit.empty() ? "(not given)" : r.opt.commit)
    << "`. spind: `" << r.opt.spind << "` (CPU backend, `--client-grace-ms " << r.opt.grace_ms
    << "`, `--metrics-address 127.0.0.1:0`";
  for (const std::string& a : r.opt.spind_args) o << " `" << a << "`";
  o << "). Machine: " << std::thread::hardware_concurrency() << " cores, " << u.machine << ".\n";
  if (!r.opt.command.empty()) o << "Command: `" << r.opt.command << "`.\n";
  o << "Load: " << Fmt(r.opt.warmup_s, 0) << " s warm-up, then " << Fmt(main_s, 0)
    << " s measured; " << r.opt.well
    << " well-behaved client threads (local and remote cycles alternating); hostile: ";
  bool first = true;
  for (const std::string& h : r.opt.hostile) o << (first ? "" : ", ") << h, first = false;
  if (r.opt.hostile.empty()) o << "none";
  if (!r.opt.only.empty()) o << " (only actions matching \"" << r.opt.only << "\")";
  for (const std::string& x : r.opt.skip) o << " (skipping \"" << x << "\")";
  o << ". Seed " << r.opt.seed << ". Trace: " << r.trace.meta().layers << " layers x "
    << r.trace.meta().steps << " steps x " << r.trace.meta().rows << " rows, " << r.trace.n_max()
    << " slots, top-K " << r.trace.meta().topk << ", probe period " << r.replay.policy.probe_period
    << ".\n\n";

  o << "## Well-behaved operations\n\n";
  o << "Latencies over the whole run (warm-up included), in ms; histogram buckets are 2% wide. "
       "Every replay's results must equal the offline replay of the same trace.\n\n";
  o << "| operation | count | failures | p50 | p99 | max | > 1 s "
       "|\n|---|---|---|---|---|---|---|\n";
  const auto ops = r.ops.Snapshot();
  for (const auto& [k, op] : ops) {
    o << "| " << k << " | " << op.h.n() << " | " << op.fail << " | "
      << Fmt(op.h.Quantile(0.5) / 1e3, 3) << " | " << Fmt(op.h.Quantile(0.99) / 1e3, 3) << " | "
      << Fmt(op.h.max() / 1e3, 3) << " | " << op.slow << " |\n";
  }
  o << "\nCycles: " << r.cycles.load() << ", replays: " << r.replays.load()
    << ", well-behaved failures: " << r.ops.failures() << ".\n";
  bool any_err = false;
  for (const auto& [k, op] : ops) {
    for (const std::string& e : op.errors) {
      if (!any_err) o << "\nFirst failures per operation:\n\n";
      any_err = true;
      o << "- " << k << ": " << (e.size() > 300 ? e.substr(0, 300) + "..." : e) << "\n";
    }
  }

  o << "\n## Hostile actions\n\n| kind | count | outcomes |\n|---|---|---|\n";
  uint64_t htotal = 0;
  for (const auto& [k, outs] : r.hostile.Snapshot()) {
    uint64_t n = 0;
    std::string desc;
    std::vector<std::pair<uint64_t, std::string>> sorted;
    for (const auto& [oc, c] : outs) sorted.push_back({c, oc}), n += c;
    std::sort(sorted.rbegin(), sorted.rend());
    for (size_t i = 0; i < sorted.size() && i < 6; ++i) {
      std::string oc = sorted[i].second;
      for (char& ch : oc) {
        if (ch == '|' || ch == '\n' || static_cast<unsigned char>(ch) < 32) ch = ' ';
      }
      absl::StrAppend(&desc, i ? "; " : "", oc, " x", sorted[i].first);
    }
    if (sorted.size() > 6) absl::StrAppend(&desc, "; ...");
    htotal += n;
    o << "| " << k << " | " << n << " | " << desc << " |\n";
  }
  o << "\nHostile actions in all: " << htotal
    << ". Violations (a hostile request that succeeded "
       "where it must not, or a limit spind exceeded): "
    << r.hostile.violations() << ".\n";
  for (const std::string& x : r.hostile.ViolationList()) o << "- " << x << "\n";

  o << "\n## spind's resources\n\n";
  Sample peak;
  std::vector<Sample> samples;
  {
    std::lock_guard<std::mutex> l(r.samples_mu);
    samples = r.samples;
  }
  for (const Sample& s : samples) {
    peak.rss_kb = std::max(peak.rss_kb, s.rss_kb);
    peak.fds = std::max(peak.fds, s.fds);
    peak.threads = std::max(peak.threads, s.threads);
    peak.sessions = std::max(peak.sessions, s.sessions);
  }
  const double tol_kb = std::max(r.opt.rss_tol_mib * 1024, r.opt.rss_tol_frac * base.rss_kb);
  o << "Start: spind just started, before any load. Baseline: after the warm-up, load stopped, "
       "grace + 3 s, settled. Final: the same after the measured load. Sessions must be 0 at "
       "baseline and at the end (every client is gone or detached by then); fds must return "
       "exactly to the baseline; RSS within max("
    << Fmt(r.opt.rss_tol_mib, 0) << " MiB, " << Fmt(r.opt.rss_tol_frac * 100, 0)
    << "% of baseline) = " << Fmt(tol_kb / 1024, 1) << " MiB.\n\n";
  const Sample start = samples.empty() ? Sample{} : samples.front();
  o << "| | start | baseline | peak | final | check |\n|---|---|---|---|---|---|\n";
  o << "| RSS, MiB | " << Fmt(start.rss_kb / 1024.0, 1) << " | " << Fmt(base.rss_kb / 1024.0, 1)
    << " | " << Fmt(peak.rss_kb / 1024.0, 1) << " | " << Fmt(fin.rss_kb / 1024.0, 1) << " | "
    << (fin.rss_kb - base.rss_kb <= tol_kb ? "ok" : "FAIL") << " ("
    << Fmt((fin.rss_kb - base.rss_kb) / 1024.0, 1) << " MiB) |\n";
  o << "| open fds | " << start.fds << " | " << base.fds << " | " << peak.fds << " | " << fin.fds
    << " | " << (fin.fds == base.fds ? "ok" : "FAIL") << " |\n";
  o << "| sessions | " << start.sessions << " | " << base.sessions << " | " << peak.sessions
    << " | " << fin.sessions << " | "
    << (fin.sessions == base.sessions && base.sessions == 0 ? "ok" : "FAIL") << " |\n";
  o << "| threads | " << start.threads << " | " << base.threads << " | " << peak.threads << " | "
    << fin.threads << " | (reported) |\n";
  o << "\nStopping the load took " << Fmt(quiesce_s, 1)
    << " s (the longest hostile action in "
       "flight).\n\nTimeline (every 30 s):\n\n| t, s | sessions | RSS, MiB | fds | threads |\n"
       "|---|---|---|---|---|\n";
  double next = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    const Sample& s = samples[i];
    if (s.t >= next || i + 1 == samples.size()) {
      o << "| " << Fmt(s.t, 0) << " | " << s.sessions << " | " << Fmt(s.rss_kb / 1024.0, 1) << " | "
        << s.fds << " | " << s.threads << " |\n";
      next = s.t + 30;
    }
  }
  if (r.dead.load()) {
    o << "\n## spind died\n\nAt t = " << Fmt(r.dead_at.load(), 1) << " s: " << r.death
      << ".\n\nLast hostile actions started:\n\n```\n";
    for (const std::string& x : r.hostile.Recent()) o << x << "\n";
    o << "```\n\nLast lines of spind's log:\n\n```\n" << TailLog(r.log_path, 30) << "```\n";
  }
  return o.str();
}

int Usage() {
  std::fprintf(
      stderr,
      "usage: soak --spind PATH [--seconds N | --minutes M] [--out FILE] [--warmup-s 60]\n"
      "            [--well 3] [--grace-ms 2000] [--hostile kill,fd,rpc,raw|none] [--seed 1]\n"
      "            [--commit TEXT] [--command TEXT] [--timeline FILE] [--spind-arg ARG]...\n"
      "            [--only TEXT] [--skip TEXT]...\n"
      "            [--rss-tolerance-mib 8] [--rss-tolerance-frac 0.10]\n");
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 6 && std::strcmp(argv[1], "--child") == 0) {
    return ChildMain(argv[2], argv[3], argv[4], std::strtoull(argv[5], nullptr, 10));
  }
  signal(SIGPIPE, SIG_IGN);
  Run r;
  Options& o = r.opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "soak: %s needs a value\n", a.c_str());
        std::exit(Usage());
      }
      return argv[++i];
    };
    if (a == "--spind")
      o.spind = val();
    else if (a == "--seconds")
      o.seconds = std::atof(val().c_str());
    else if (a == "--minutes")
      o.seconds = 60 * std::atof(val().c_str());
    else if (a == "--warmup-s")
      o.warmup_s = std::atof(val().c_str());
    else if (a == "--out")
      o.out = val();
    else if (a == "--timeline")
      o.timeline = val();
    else if (a == "--command")
      o.command = val();
    else if (a == "--commit")
      o.commit = val();
    else if (a == "--well")
      o.well = std::atoi(val().c_str());
    else if (a == "--grace-ms")
      o.grace_ms = std::atoi(val().c_str());
    else if (a == "--seed")
      o.seed = std::strtoull(val().c_str(), nullptr, 10);
    else if (a == "--spind-arg")
      o.spind_args.push_back(val());
    else if (a == "--only")
      o.only = val();
    else if (a == "--skip")
      o.skip.push_back(val());
    else if (a == "--rss-tolerance-mib")
      o.rss_tol_mib = std::atof(val().c_str());
    else if (a == "--rss-tolerance-frac")
      o.rss_tol_frac = std::atof(val().c_str());
    else if (a == "--hostile") {
      o.hostile.clear();
      for (absl::string_view kv : absl::StrSplit(val(), ',')) {
        const std::string k(kv);
        if (k == "none" || k.empty()) continue;
        if (k != "kill" && k != "fd" && k != "rpc" && k != "raw") {
          std::fprintf(stderr, "soak: unknown hostile kind '%s' (kill, fd, rpc, raw, none)\n",
                       k.c_str());
          return Usage();
        }
        o.hostile.insert(k);
      }
    } else if (a == "-h" || a == "--help") {
      Usage();
      return 0;
    } else {
      std::fprintf(stderr, "soak: unknown argument %s\n", a.c_str());
      return Usage();
    }
  }
  if (o.spind.empty() || o.seconds <= 0 || o.well < 0) return Usage();
  for (size_t i = 0; i + 1 < o.spind_args.size(); ++i) {
    if (o.spind_args[i] == "--max-sessions")
      r.max_sessions = std::atol(o.spind_args[i + 1].c_str());
  }
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 3;
  r.self_exe.assign(self, static_cast<size_t>(n));

  {
    std::ifstream oc("/proc/sys/vm/overcommit_memory");
    int mode = 0;
    if (oc >> mode) r.overcommit_always = mode == 1;
  }
  char tmpl[] = "/tmp/spind-soak-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 3;
  r.dir = tmpl;
  // The trace every well-behaved client replays, and its offline result.
  r.trace_dir = r.dir + "/trace";
  spin::GenTraceOptions gt;
  gt.layers = 4;
  gt.slots = 4096;
  gt.steps = 24;
  gt.rows = 2;
  gt.topk = 256;
  gt.seed = o.seed;
  gt.nonfinite_rate = 0.001;
  if (absl::Status s = spin::GenerateTrace(r.trace_dir, gt); !s.ok()) {
    std::fprintf(stderr, "soak: %s\n", s.ToString().c_str());
    return 3;
  }
  absl::StatusOr<spin::Trace> t = spin::LoadTrace(r.trace_dir);
  if (!t.ok()) return 3;
  r.trace = std::move(*t);
  r.replay.seed = 11;
  r.replay.policy.target_sparsity = 0.5;
  r.replay.policy.probe_period = 8;
  r.geometry = spin::TraceGeometry(r.trace.meta(), r.trace.n_max(), r.replay.dtype);
  absl::StatusOr<spin::ReplaySummary> expected = spin::Replay(r.trace, r.replay);
  if (!expected.ok()) {
    std::fprintf(stderr, "soak: offline replay: %s\n", expected.status().ToString().c_str());
    return 3;
  }
  r.expected = *expected;

  // spind's RESOURCE_EXHAUSTED message names how many sessions it holds: more than
  // --max-sessions is a limit overshot by concurrent attaches.
  r.ops.watch = [&r](const std::string& msg) {
    const size_t p = msg.find("already holds ");
    if (p == std::string::npos) return;
    const long n = std::atol(msg.c_str() + p + 14);
    if (n > r.max_sessions) {
      r.hostile.Violation("limits",
                          absl::StrCat("spind held ", n, " sessions, over --max-sessions ",
                                       r.max_sessions, " (t=", int(r.now()), "s)"));
    }
  };
  if (!StartSpind(r)) return 3;
  std::fprintf(stderr, "soak: spind pid %d on %s, metrics port %d, log %s\n", r.spind,
               r.target.c_str(), r.metrics_port, r.log_path.c_str());

  std::vector<std::thread> threads;
  threads.emplace_back(Sampler, std::ref(r));
  for (int i = 0; i < 100; ++i) {  // the "start" sample: before any client
    {
      std::lock_guard<std::mutex> l(r.samples_mu);
      if (!r.samples.empty()) break;
    }
    SleepMs(20);
  }
  if (r.metrics_port > 0) threads.emplace_back(Scraper, std::ref(r));
  for (int i = 0; i < o.well; ++i) threads.emplace_back(WellBehaved, std::ref(r), i);
  if (o.hostile.count("kill")) threads.emplace_back(KillChildren, std::ref(r), 0);
  if (o.hostile.count("fd")) {
    threads.emplace_back(FdHostile, std::ref(r), 0);
    threads.emplace_back(FdHostile, std::ref(r), 1);
  }
  if (o.hostile.count("rpc")) threads.emplace_back(RpcHostile, std::ref(r), 0);
  if (o.hostile.count("raw")) threads.emplace_back(RawHostile, std::ref(r), 0);

  // Warm-up (everything), quiet, baseline; the measured load; quiet, final.
  Sample base, fin;
  double main_s = 0, quiesce_s = 0;
  if (RunLoad(r, o.warmup_s, "warm-up")) {
    Quiesce(r);
    std::fprintf(stderr, "soak: warm-up done; settling for the baseline\n");
    base = Settle(r, 60);
    Progress(r, "baseline");
    const double a = r.now();
    if (!r.dead.load() && RunLoad(r, o.seconds, "load")) {
      main_s = r.now() - a;
      quiesce_s = Quiesce(r);
      std::fprintf(stderr, "soak: load stopped (%.1f s to quiesce); settling\n", quiesce_s);
      fin = Settle(r, 60);
      Progress(r, "final");
    } else {
      main_s = r.now() - a;
    }
  }
  if (r.dead.load()) {  // say so at once; the workers may take a few seconds to notice
    std::fprintf(
        stderr, "soak: FAIL: spind died at t = %.1f s (%s). Last lines of its log (%s):\n%s",
        r.dead_at.load(), r.death.c_str(), r.log_path.c_str(), TailLog(r.log_path, 30).c_str());
  }
  r.stop = true;
  for (std::thread& th : threads) th.join();

  Verdict v;
  if (r.dead.load()) {
    v.fails.push_back(
        absl::StrCat("spind died at t = ", Fmt(r.dead_at.load(), 1), " s: ", r.death));
  }
  if (r.ops.failures() > 0) {
    v.fails.push_back(absl::StrCat(r.ops.failures(), " well-behaved operations failed"));
  }
  if (r.hostile.violations() > 0) {
    v.fails.push_back(absl::StrCat(r.hostile.violations(),
                                   " violations (hostile requests that "
                                   "succeeded where they must not, or limits exceeded)"));
  }
  if (!r.dead.load()) {
    const double tol_kb = std::max(o.rss_tol_mib * 1024, o.rss_tol_frac * base.rss_kb);
    if (base.sessions != 0) {
      v.fails.push_back(absl::StrCat(base.sessions,
                                     " sessions left after the warm-up (every "
                                     "client was gone or detached; grace ",
                                     o.grace_ms, " ms)"));
    }
    if (fin.sessions != base.sessions) {
      v.fails.push_back(absl::StrCat("sessions did not return: ", base.sessions, " at baseline, ",
                                     fin.sessions, " at the end"));
    }
    if (fin.fds != base.fds) {
      v.fails.push_back(absl::StrCat("open fds did not return: ", base.fds, " at baseline, ",
                                     fin.fds, " at the end"));
    }
    if (fin.rss_kb - base.rss_kb > tol_kb) {
      v.fails.push_back(absl::StrCat("RSS grew by ", Fmt((fin.rss_kb - base.rss_kb) / 1024.0, 1),
                                     " MiB (tolerance ", Fmt(tol_kb / 1024, 1), " MiB)"));
    }
  }
  const std::string report = Report(r, base, fin, v, main_s, quiesce_s);
  std::printf("%s", report.c_str());
  if (!o.out.empty()) std::ofstream(o.out) << report;
  if (!o.timeline.empty()) {
    std::ofstream f(o.timeline);
    f << "t_s,sessions,rss_kb,fds,threads\n";
    std::lock_guard<std::mutex> l(r.samples_mu);
    for (const Sample& s : r.samples) {
      f << Fmt(s.t, 1) << "," << s.sessions << "," << s.rss_kb << "," << s.fds << "," << s.threads
        << "\n";
    }
  }
  if (!r.dead.load()) {
    kill(r.spind, SIGTERM);
    waitpid(r.spind, nullptr, 0);
  }
  std::fprintf(stderr, "soak: %s%s\n",
               v.fails.empty() ? "PASS" : "FAIL: ", v.fails.empty() ? "" : v.fails[0].c_str());
  if (v.fails.empty()) std::filesystem::remove_all(r.dir);
  return r.dead.load() ? 2 : v.fails.empty() ? 0 : 1;
}
