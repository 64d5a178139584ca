// The fd socket server in process (service/fd_server.h): a SessionManager on the CPU backend,
// one small session, an FdServer on a temporary socket, and raw client sockets that play good
// clients, idle and slow peers, malformed requests and peers of another uid.
#include "fd_server.h"

#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "session_manager.h"

namespace spin::service {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// `text` starts with `prefix` (gmock is not linked here).
::testing::AssertionResult StartsWith(const std::string& text, const std::string& prefix) {
  if (text.compare(0, prefix.size(), prefix) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "\"" << text << "\" does not start with \"" << prefix << "\"";
}
::testing::AssertionResult HasSubstr(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

int64_t MsSince(Clock::time_point t0) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count();
}

// One "[ timing ]" line (microseconds) for the record.
void Timing(const char* what, Clock::time_point t0) {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0);
  std::printf("[ timing ] %s: %.3f ms\n", what, static_cast<double>(us.count()) / 1000.0);
}

// Polls `f` every 5 ms for up to `ms`.
bool WaitFor(const std::function<bool()>& f, int ms = 2000) {
  const auto end = Clock::now() + milliseconds(ms);
  while (Clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return f();
}

// A file descriptor closed on destruction.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

Fd ConnectTo(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (fd >= 0) close(fd);
    return Fd();
  }
  return Fd(fd);
}

bool SendAll(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

struct Reply {
  std::string text;  // what arrived, up to and including the first newline
  Fd fd;             // an SCM_RIGHTS descriptor that came with it
  bool eof = false;  // the server closed the connection before a newline
};

// Reads the server's reply line (and any fd passed with it) for up to `ms`.
Reply ReadReply(int conn, int ms = 2000) {
  Reply r;
  const auto end = Clock::now() + milliseconds(ms);
  while (r.text.find('\n') == std::string::npos) {
    const auto left = std::chrono::duration_cast<milliseconds>(end - Clock::now()).count();
    if (left <= 0) break;
    pollfd p{conn, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) != 1) break;
    char buf[512];
    iovec iov{buf, sizeof(buf)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0) {
      r.eof = true;
      break;
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
        r.fd = Fd(fd);
      }
    }
    r.text.append(buf, static_cast<size_t>(n));
  }
  return r;
}

// True when the server closed `conn` (EOF or reset) within `ms`, with nothing more to read.
bool ClosedByServer(int conn, int ms = 2000) {
  pollfd p{conn, POLLIN, 0};
  if (poll(&p, 1, ms) != 1) return false;
  char c;
  return recv(conn, &c, 1, MSG_DONTWAIT) <= 0;
}

// Nothing to read on `conn` right now (the server has not answered or closed it).
bool Quiet(int conn) {
  pollfd p{conn, POLLIN, 0};
  return poll(&p, 1, 0) == 0;
}

std::string UniquePath(const std::string& dir) {
  static std::atomic<int> counter{0};
  std::string d = dir;
  if (!d.empty() && d.back() != '/') d.push_back('/');
  std::string p = d + "fds" + std::to_string(getpid()) + "_" + std::to_string(counter++) + ".sock";
  if (p.size() >= 100) p = "/tmp/fds" + std::to_string(getpid()) + "_" + std::to_string(counter++);
  return p;
}

class FdServerTest : public ::testing::Test {
 protected:
  void StartServer(FdServerOptions options = {}, int max_holders = 8,
                   const std::string& dir = ::testing::TempDir()) {
    Limits limits;
    limits.max_holders = max_holders;
    sessions_ = std::make_unique<SessionManager>(limits);
    Geometry g;
    g.layers = 2;
    g.max_seqs = 2;
    g.max_slots = 1024;
    g.block_size = 64;
    g.topk = 128;
    g.max_rows = 1;
    g.dtype = StateDtype::kFp32;
    auto s = sessions_->Attach(g, 7, Policy{}, "fd_server_test");
    ASSERT_TRUE(s.ok()) << s.status();
    session_ = *s;
    path_ = UniquePath(dir);
    ASSERT_LT(path_.size(), 100u);
    server_ = std::make_unique<FdServer>(sessions_.get(), path_, std::move(options),
                                         [this](const char* level, const std::string& line) {
                                           std::lock_guard<std::mutex> lock(log_mu_);
                                           log_.push_back(std::string(level) + ": " + line);
                                         });
    ASSERT_TRUE(server_->Start().ok());
  }

  void TearDown() override {
    server_.reset();
    session_.reset();
    sessions_.reset();
  }

  std::string Line() const { return "ATTACH " + session_->id + " " + session_->token + "\n"; }
  std::string OkLine() const { return "OK " + std::to_string(session_->bytes) + "\n"; }

  // Connects, sends `line` and reads the reply.
  Reply Ask(const std::string& line, Fd* keep = nullptr, int ms = 2000) {
    Fd c = ConnectTo(path_);
    if (c.get() < 0) return Reply{"connect failed", Fd(), true};
    if (!SendAll(c.get(), line)) return Reply{"send failed", Fd(), true};
    Reply r = ReadReply(c.get(), ms);
    if (keep != nullptr) *keep = std::move(c);
    return r;
  }

  std::vector<std::string> Logs() {
    std::lock_guard<std::mutex> lock(log_mu_);
    return log_;
  }
  size_t CountLogs(const std::string& needle) {
    size_t n = 0;
    for (const std::string& l : Logs()) n += l.find(needle) != std::string::npos;
    return n;
  }
  // Log lines with `needle` once the count reached `want` (up to 2 s), or the count then.
  size_t WaitLogs(const std::string& needle, size_t want) {
    WaitFor([&] { return CountLogs(needle) >= want; });
    std::this_thread::sleep_for(milliseconds(20));  // and no more arrive
    return CountLogs(needle);
  }

  // Frees the session if nobody holds it, whatever its lease: the ids freed.
  std::vector<std::string> ReapIgnoringLease() {
    return sessions_->ReapExpired(Clock::now() + std::chrono::hours(24));
  }

  std::unique_ptr<SessionManager> sessions_;
  std::shared_ptr<Session> session_;
  std::string path_;
  std::unique_ptr<FdServer> server_;
  std::mutex log_mu_;
  std::vector<std::string> log_;
};

TEST_F(FdServerTest, GoodFetchHandsOutTheArenaAndClosingReleasesTheHold) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  struct stat sock {};
  ASSERT_EQ(stat(path_.c_str(), &sock), 0);
  EXPECT_TRUE(S_ISSOCK(sock.st_mode));
  EXPECT_EQ(sock.st_mode & 0777, 0660u);

  Fd conn;
  const auto t0 = Clock::now();
  Reply r = Ask(Line(), &conn);
  const int64_t ms = MsSince(t0);
  Timing("good fetch", t0);
  EXPECT_LT(ms, 500);
  ASSERT_EQ(r.text, OkLine());
  ASSERT_GE(r.fd.get(), 0) << "no fd with the OK";
  struct stat st {};
  ASSERT_EQ(fstat(r.fd.get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), session_->bytes);
  EXPECT_GT(session_->bytes, 0u);
  EXPECT_EQ(server_->holders(), 1u);
  // The loop drops the handshake from its table just after replying.
  EXPECT_TRUE(WaitFor([&] { return server_->pending() == 0; }));
  // The arena went out for local driving: remote mode is refused now.
  EXPECT_EQ(sessions_->Bind(*session_, DriveMode::kRemote).code(),
            absl::StatusCode::kFailedPrecondition);
  // Held: the reaper cannot free it whatever the lease says.
  EXPECT_TRUE(ReapIgnoringLease().empty());
  EXPECT_EQ(WaitLogs("handed to peer uid=" + std::to_string(getuid()), 1u), 1u);

  conn.reset();
  const auto t1 = Clock::now();
  EXPECT_TRUE(WaitFor([&] { return server_->holders() == 0; }));
  Timing("holder close noticed after", t1);
  // Released: the lease runs again, so a lapsed one is reaped.
  EXPECT_EQ(ReapIgnoringLease(), std::vector<std::string>{session_->id});
}

TEST_F(FdServerTest, IdleAndDripFeedingPeersDoNotDelayAFetch) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  std::vector<Fd> idle;
  for (int i = 0; i < 10; ++i) {
    idle.push_back(ConnectTo(path_));
    ASSERT_GE(idle.back().get(), 0);
  }
  // One byte of a valid line every 300 ms.
  Fd drip = ConnectTo(path_);
  ASSERT_GE(drip.get(), 0);
  std::atomic<bool> stop{false};
  const std::string line = Line();
  std::thread dripper([&] {
    for (size_t i = 0; i < line.size() && !stop.load(); ++i) {
      if (send(drip.get(), &line[i], 1, MSG_NOSIGNAL) != 1) return;
      for (int k = 0; k < 30 && !stop.load(); ++k) std::this_thread::sleep_for(milliseconds(10));
    }
  });
  ASSERT_TRUE(WaitFor([&] { return server_->pending() == 11; }));
  std::this_thread::sleep_for(milliseconds(700));  // the drip is a few bytes in
  ASSERT_EQ(server_->pending(), 11u);

  Fd conn;
  const auto t0 = Clock::now();
  Reply r = Ask(Line(), &conn);
  const int64_t ms = MsSince(t0);
  Timing("fetch beside 10 idle peers and a drip", t0);
  EXPECT_EQ(r.text, OkLine());
  EXPECT_GE(r.fd.get(), 0);
  EXPECT_LT(ms, 500);
  EXPECT_EQ(server_->holders(), 1u);
  stop.store(true);
  dripper.join();
}

TEST_F(FdServerTest, SilentPeerIsClosedAtTheDeadline) {
  FdServerOptions o;
  o.handshake_deadline = milliseconds(300);
  ASSERT_NO_FATAL_FAILURE(StartServer(o));
  const auto t0 = Clock::now();
  Fd c = ConnectTo(path_);
  ASSERT_GE(c.get(), 0);
  Reply r = ReadReply(c.get(), 3000);
  const int64_t ms = MsSince(t0);
  Timing("silent peer closed after (deadline 300 ms)", t0);
  EXPECT_TRUE(StartsWith(r.text, "ERR handshake timed out after 300 ms"));
  EXPECT_LT(r.fd.get(), 0);
  EXPECT_GE(ms, 280);
  EXPECT_LT(ms, 800);
  EXPECT_TRUE(ClosedByServer(c.get()));
  // The loop drops the handshake from its table just after replying.
  EXPECT_TRUE(WaitFor([&] { return server_->pending() == 0; }));
  EXPECT_EQ(WaitLogs("warn: fd socket: refused peer uid=" + std::to_string(getuid()) +
                         " gid=" + std::to_string(getgid()) + " pid=" + std::to_string(getpid()) +
                         ": handshake timed out",
                     1u),
            1u);
}

TEST_F(FdServerTest, DripFeedingPeerIsCutAtTheWholeHandshakeDeadline) {
  FdServerOptions o;
  o.handshake_deadline = milliseconds(300);
  ASSERT_NO_FATAL_FAILURE(StartServer(o));
  Fd c = ConnectTo(path_);
  ASSERT_GE(c.get(), 0);
  const auto t0 = Clock::now();
  const std::string line = Line();
  // A byte every 50 ms: never idle for long, but the line takes far more than 300 ms.
  std::thread dripper([&] {
    for (size_t i = 0; i < line.size(); ++i) {
      if (send(c.get(), &line[i], 1, MSG_NOSIGNAL) != 1) return;
      std::this_thread::sleep_for(milliseconds(50));
    }
  });
  Reply r = ReadReply(c.get(), 3000);
  const int64_t ms = MsSince(t0);
  Timing("drip-feeding peer cut after (deadline 300 ms)", t0);
  dripper.join();
  EXPECT_TRUE(StartsWith(r.text, "ERR handshake timed out after 300 ms"));
  EXPECT_LT(ms, 800);
  EXPECT_EQ(server_->holders(), 0u);
}

TEST_F(FdServerTest, BadRequestsGetPreciseErrors) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  const std::string id = session_->id;
  const std::string usage = "expected 'ATTACH <session_id> <token>'";
  // A line of exactly 256 bytes is read and judged (here: a wrong token); 257 is refused.
  std::string at_limit = "ATTACH " + id + " ";
  at_limit += std::string(256 - at_limit.size(), 'z');
  ASSERT_EQ(at_limit.size(), 256u);
  struct Case {
    std::string send;
    std::string reply_prefix;
  };
  const std::vector<Case> cases = {
      {"hello\n", "ERR unknown request: " + usage + "\n"},
      {"\n", "ERR unknown request: " + usage + "\n"},
      {"DETACH " + id + " " + session_->token + "\n", "ERR unknown request: " + usage + "\n"},
      {"attach " + id + " " + session_->token + "\n", "ERR unknown request: " + usage + "\n"},
      {"ATTACH " + id + "\n", "ERR malformed ATTACH: " + usage},
      {"ATTACH " + id + " " + session_->token + " extra\n", "ERR malformed ATTACH: " + usage},
      {"ATTACH  " + id + " " + session_->token + "\n", "ERR malformed ATTACH: " + usage},
      {"ATTACH " + id + "\t" + session_->token + "\n", "ERR malformed request (control"},
      {std::string("ATTACH \x01\x02 \xff\n"), "ERR malformed request (control"},
      {std::string(300, 'A'), "ERR request line longer than 256 bytes"},
      {std::string(300, 'A') + "\n", "ERR request line longer than 256 bytes"},
      {at_limit + "z\n", "ERR request line longer than 256 bytes"},
      {at_limit + "\n", "ERR wrong token for session '" + id + "'"},
      {"ATTACH nosuch-session tok\n", "ERR no session 'nosuch-session'"},
      {"ATTACH " + id + " wrong-token\n", "ERR wrong token for session '" + id + "'"},
      {Line() + "X", "ERR bytes after the request line"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("sent: " + c.send.substr(0, 60));
    Fd conn;
    Reply r = Ask(c.send, &conn);
    EXPECT_TRUE(StartsWith(r.text, c.reply_prefix));
    EXPECT_EQ(r.text.back(), '\n');
    EXPECT_LT(r.fd.get(), 0) << "an fd came with an ERR";
    EXPECT_TRUE(ClosedByServer(conn.get())) << "the connection stayed open after ERR";
  }
  // A peer that hangs up half way.
  {
    Fd conn = ConnectTo(path_);
    ASSERT_TRUE(SendAll(conn.get(), "ATTACH " + id));
    shutdown(conn.get(), SHUT_WR);
    Reply r = ReadReply(conn.get());
    EXPECT_TRUE(StartsWith(r.text, "ERR connection closed before a complete request line"));
  }
  EXPECT_EQ(server_->holders(), 0u);
  EXPECT_TRUE(WaitFor([&] { return server_->pending() == 0; }));
  // Every refusal was logged with the peer's credentials.
  EXPECT_EQ(WaitLogs("warn: fd socket: refused peer uid=" + std::to_string(getuid()) +
                         " gid=" + std::to_string(getgid()) + " pid=" + std::to_string(getpid()),
                     cases.size() + 1),
            cases.size() + 1);
  // The token never reaches the log.
  EXPECT_EQ(WaitLogs(session_->token, 0u), 0u);
  // Nothing held: a good fetch still works and is the only holder.
  Fd good;
  EXPECT_EQ(Ask(Line(), &good).text, OkLine());
  EXPECT_EQ(server_->holders(), 1u);
}

TEST_F(FdServerTest, HolderLimitRefusesTheThirdHolder) {
  ASSERT_NO_FATAL_FAILURE(StartServer({}, /*max_holders=*/2));
  Fd a, b, c;
  Reply ra = Ask(Line(), &a);
  Reply rb = Ask(Line(), &b);
  EXPECT_EQ(ra.text, OkLine());
  EXPECT_EQ(rb.text, OkLine());
  EXPECT_GE(ra.fd.get(), 0);
  EXPECT_GE(rb.fd.get(), 0);
  EXPECT_EQ(server_->holders(), 2u);
  Reply rc = Ask(Line(), &c);
  EXPECT_TRUE(StartsWith(rc.text, "ERR session '" + session_->id + "' already has 2 fd"));
  EXPECT_TRUE(HasSubstr(rc.text, "the limit per session is 2"));
  EXPECT_LT(rc.fd.get(), 0);
  EXPECT_TRUE(ClosedByServer(c.get()));
  EXPECT_EQ(server_->holders(), 2u);
  EXPECT_EQ(WaitLogs("limit per session is 2", 1u), 1u);
  // One holder leaves: there is room again.
  a.reset();
  ASSERT_TRUE(WaitFor([&] { return server_->holders() == 1; }));
  Fd d;
  EXPECT_EQ(Ask(Line(), &d).text, OkLine());
  EXPECT_EQ(server_->holders(), 2u);
}

TEST_F(FdServerTest, RemotelyDrivenSessionIsNotHandedOut) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  ASSERT_TRUE(sessions_->Bind(*session_, DriveMode::kRemote).ok());
  Fd conn;
  Reply r = Ask(Line(), &conn);
  EXPECT_TRUE(StartsWith(r.text, "ERR session '" + session_->id + "' is driven remotely"));
  EXPECT_LT(r.fd.get(), 0);
  EXPECT_TRUE(ClosedByServer(conn.get()));
  EXPECT_EQ(server_->holders(), 0u);
  EXPECT_EQ(WaitLogs("is driven remotely", 1u), 1u);
}

TEST_F(FdServerTest, HolderThatSendsBytesIsClosed) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  Fd conn;
  ASSERT_EQ(Ask(Line(), &conn).text, OkLine());
  ASSERT_EQ(server_->holders(), 1u);
  ASSERT_TRUE(SendAll(conn.get(), "x"));
  EXPECT_TRUE(ClosedByServer(conn.get()));
  EXPECT_TRUE(WaitFor([&] { return server_->holders() == 0; }));
  EXPECT_EQ(WaitLogs("sent bytes after the handshake", 1u), 1u);
  EXPECT_EQ(ReapIgnoringLease(), std::vector<std::string>{session_->id});
}

TEST_F(FdServerTest, StopIsPromptWithIdlePeersAndHolders) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  std::vector<Fd> idle;
  for (int i = 0; i < 20; ++i) {
    idle.push_back(ConnectTo(path_));
    ASSERT_GE(idle.back().get(), 0);
  }
  Fd h1, h2;
  ASSERT_EQ(Ask(Line(), &h1).text, OkLine());
  ASSERT_EQ(Ask(Line(), &h2).text, OkLine());
  ASSERT_TRUE(WaitFor([&] { return server_->pending() == 20; }));
  EXPECT_EQ(server_->holders(), 2u);
  EXPECT_TRUE(ReapIgnoringLease().empty());

  const auto t0 = Clock::now();
  server_->Stop();
  const int64_t ms = MsSince(t0);
  Timing("Stop() with 20 idle peers and 2 holders", t0);
  EXPECT_LT(ms, 1000);
  EXPECT_EQ(server_->holders(), 0u);
  EXPECT_EQ(server_->pending(), 0u);
  for (Fd& c : idle) {
    Reply r = ReadReply(c.get(), 500);
    EXPECT_TRUE(StartsWith(r.text, "ERR spind's fd socket is stopping"));
  }
  EXPECT_TRUE(ClosedByServer(h1.get(), 500));
  EXPECT_TRUE(ClosedByServer(h2.get(), 500));
  // Both holds were released.
  EXPECT_EQ(ReapIgnoringLease(), std::vector<std::string>{session_->id});
  // The socket file is gone and nobody listens.
  struct stat st {};
  EXPECT_NE(stat(path_.c_str(), &st), 0);
  EXPECT_LT(ConnectTo(path_).get(), 0);
  server_->Stop();  // idempotent
}

TEST_F(FdServerTest, PendingLimitDropsTheOldestHandshake) {
  // Policy: past max_pending the OLDEST handshake in progress is dropped with an ERR, never the
  // new connection (a real client sends its line at once, so it is the newest; refusing new
  // connections would let four idle peers lock every client out).
  FdServerOptions o;
  o.max_pending = 4;
  ASSERT_NO_FATAL_FAILURE(StartServer(o));
  std::vector<Fd> silent;
  for (int i = 0; i < 10; ++i) {
    silent.push_back(ConnectTo(path_));
    ASSERT_GE(silent.back().get(), 0);
    // Accepted (and, past 4, the oldest dropped) before the next one connects.
    if (i < 4) {
      ASSERT_TRUE(WaitFor([&] { return server_->pending() == static_cast<size_t>(i + 1); }));
    } else {
      Reply r = ReadReply(silent[static_cast<size_t>(i - 4)].get(), 2000);
      ASSERT_TRUE(StartsWith(r.text,
                             "ERR too many handshakes in progress (limit 4): this one was "
                             "the oldest"))
          << "connection " << i - 4;
    }
  }
  EXPECT_EQ(server_->pending(), 4u);
  for (size_t i = 6; i < 10; ++i) EXPECT_TRUE(Quiet(silent[i].get())) << "connection " << i;

  Fd conn;
  const auto t0 = Clock::now();
  Reply r = Ask(Line(), &conn);
  const int64_t ms = MsSince(t0);
  Timing("fetch with 10 silent peers, max_pending 4", t0);
  EXPECT_EQ(r.text, OkLine());
  EXPECT_GE(r.fd.get(), 0);
  EXPECT_LT(ms, 500);
  EXPECT_LE(server_->pending(), 4u);
  EXPECT_GE(WaitLogs("too many handshakes in progress", 6), 6u);
}

// Runs a client as uid/gid 65534 (nobody/nogroup) in a child process; returns its reply (or
// what went wrong) and its pid.
std::string AskAsNobody(const std::string& path, const std::string& line, pid_t* pid_out) {
  int pipefd[2];
  if (pipe(pipefd) != 0) return "pipe failed";
  const pid_t pid = fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    close(pipefd[0]);
    alarm(10);
    auto report = [&](const char* s, size_t n) {
      (void)!write(pipefd[1], s, n);
      _exit(0);
    };
    if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) {
      report("SETUID FAILED", 13);
    }
    const int c = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    if (c < 0 || connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      report("CONNECT FAILED", 14);
    }
    if (send(c, line.data(), line.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(line.size())) {
      report("SEND FAILED", 11);
    }
    char buf[512];
    const ssize_t n = read(c, buf, sizeof(buf));
    report(buf, n > 0 ? static_cast<size_t>(n) : 0);
  }
  close(pipefd[1]);
  *pid_out = pid;
  std::string out;
  char buf[512];
  pollfd p{pipefd[0], POLLIN, 0};
  while (poll(&p, 1, 5000) == 1) {
    const ssize_t n = read(pipefd[0], buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return out;
}

class FdServerPeerTest : public FdServerTest {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid (65534)";
  }
  // The server in /tmp with the socket opened to everyone, so that only FdServer's own peer
  // check stands between uid 65534 and the arena (deployments keep mode 0660).
  void StartOpenServer(FdServerOptions o) {
    ASSERT_NO_FATAL_FAILURE(StartServer(std::move(o), 8, "/tmp"));
    ASSERT_EQ(chmod(path_.c_str(), 0666), 0);
  }
};

TEST_F(FdServerPeerTest, OtherUidIsRefusedAndLogged) {
  FdServerOptions o;
  o.handshake_deadline = milliseconds(300);
  o.allow_uids = {65533};  // lists that do not name the peer change nothing
  o.allow_gids = {65533};
  ASSERT_NO_FATAL_FAILURE(StartOpenServer(o));
  pid_t pid = 0;
  const std::string reply = AskAsNobody(path_, Line(), &pid);
  EXPECT_TRUE(StartsWith(reply, "ERR peer uid 65534 gid 65534 not allowed: "));
  EXPECT_TRUE(HasSubstr(reply, "--allow-uid 65534"));
  EXPECT_TRUE(HasSubstr(reply, "--allow-gid 65534"));
  EXPECT_EQ(server_->holders(), 0u);
  EXPECT_EQ(WaitLogs("warn: fd socket: refused peer uid=65534 gid=65534 pid=" +
                         std::to_string(pid) + ": peer uid 65534 gid 65534 not allowed",
                     1u),
            1u);
  // A refused peer that sends nothing is told why it may not attach, not just "timed out".
  pid_t silent = 0;
  EXPECT_TRUE(
      StartsWith(AskAsNobody(path_, "", &silent), "ERR peer uid 65534 gid 65534 not allowed: "));
  EXPECT_EQ(WaitLogs("refused peer uid=65534 gid=65534 pid=" + std::to_string(silent), 1u), 1u);
}

TEST_F(FdServerPeerTest, AllowedUidIsAccepted) {
  FdServerOptions o;
  o.allow_uids = {65534};
  ASSERT_NO_FATAL_FAILURE(StartOpenServer(o));
  pid_t pid = 0;
  EXPECT_EQ(AskAsNobody(path_, Line(), &pid), OkLine());
  EXPECT_EQ(WaitLogs("handed to peer uid=65534 gid=65534 pid=" + std::to_string(pid), 1u), 1u);
  // The child exited: its hold ends.
  EXPECT_TRUE(WaitFor([&] { return server_->holders() == 0; }));
}

TEST_F(FdServerPeerTest, AllowedGidIsAccepted) {
  FdServerOptions o;
  o.allow_gids = {65534};
  ASSERT_NO_FATAL_FAILURE(StartOpenServer(o));
  pid_t pid = 0;
  EXPECT_EQ(AskAsNobody(path_, Line(), &pid), OkLine());
  EXPECT_EQ(WaitLogs("handed to peer uid=65534 gid=65534 pid=" + std::to_string(pid), 1u), 1u);
}

TEST(FdServerStart, RefusesAPathThatIsNotASocketAndASecondStart) {
  SessionManager sessions(Limits{});
  const std::string file = UniquePath(::testing::TempDir()) + ".file";
  {
    FILE* f = std::fopen(file.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
  }
  FdServer bad(&sessions, file, {});
  EXPECT_EQ(bad.Start().code(), absl::StatusCode::kFailedPrecondition);
  struct stat st {};
  EXPECT_EQ(stat(file.c_str(), &st), 0) << "a regular file was removed";
  unlink(file.c_str());

  FdServer good(&sessions, UniquePath(::testing::TempDir()), {});
  ASSERT_TRUE(good.Start().ok());
  EXPECT_EQ(good.Start().code(), absl::StatusCode::kFailedPrecondition);
  good.Stop();
}

}  // namespace
}  // namespace spin::service
