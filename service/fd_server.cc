#include "fd_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace spin::service {
namespace {

constexpr const char* kUsage = "expected 'ATTACH <session_id> <token>'";

// Sends one line, with `pass_fd` attached when it is >= 0. Never waits and never raises SIGPIPE:
// a peer that does not read, or went away, makes it return false.
bool SendLine(int conn, const std::string& line, int pass_fd) {
  msghdr msg{};
  iovec iov{const_cast<char*>(line.data()), line.size()};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (pass_fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = sendmsg(conn, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(line.size());
}

// Milliseconds until `t` for poll(), rounded up so that the loop does not spin; 0 if past.
int MillisUntil(std::chrono::steady_clock::time_point t,
                std::chrono::steady_clock::time_point now) {
  if (t <= now) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(t - now).count();
  return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
}

// One line of text for a reply or a log line: no control characters.
std::string OneLine(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  }
  return out;
}

}  // namespace

FdServer::FdServer(SessionManager* sessions, std::string path, FdServerOptions options,
                   std::function<void(const char* level, const std::string& line)> log)
    : sessions_(sessions),
      path_(std::move(path)),
      options_(std::move(options)),
      log_(std::move(log)) {
  if (options_.max_pending < 1) options_.max_pending = 1;
  if (options_.handshake_deadline.count() < 1) {
    options_.handshake_deadline = std::chrono::milliseconds(1);
  }
}

FdServer::~FdServer() { Stop(); }

absl::Status FdServer::Start() {
  if (thread_.joinable() || listen_fd_ >= 0) {
    return absl::FailedPreconditionError("fd socket server already started");
  }
  sockaddr_un addr{};
  if (path_.empty() || path_.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("fd socket path empty or longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes: ", path_));
  }
  own_uid_ = geteuid();
  auto fail = [this](absl::Status s) {
    for (int* fd : {&listen_fd_, &wake_[0], &wake_[1]}) {
      if (*fd >= 0) close(*fd);
      *fd = -1;
    }
    if (bound_) unlink(path_.c_str());
    bound_ = false;
    return s;
  };
  // A stale socket from an earlier run is replaced; anything else at the path is left alone.
  struct stat st {};
  if (lstat(path_.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("fd socket path ", path_, " exists and is not a socket"));
    }
    unlink(path_.c_str());
  }
  if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return fail(absl::InternalError(absl::StrCat("pipe2 failed: ", std::strerror(errno))));
  }
  listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
  if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return fail(absl::UnavailableError(
        absl::StrCat("cannot listen on fd socket ", path_, ": ", std::strerror(errno))));
  }
  bound_ = true;
  // Mode 0660 before listen(): nobody can connect while the file still has the umask's mode.
  if (chmod(path_.c_str(), 0660) != 0 || listen(listen_fd_, SOMAXCONN) != 0) {
    return fail(absl::UnavailableError(
        absl::StrCat("cannot listen on fd socket ", path_, ": ", std::strerror(errno))));
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void FdServer::Stop() {
  if (thread_.joinable()) {
    const char x = 'x';
    (void)!write(wake_[1], &x, 1);  // the pipe may be full: it is readable then anyway
    thread_.join();
  }
  for (int* fd : {&listen_fd_, &wake_[0], &wake_[1]}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
  if (bound_) unlink(path_.c_str());
  bound_ = false;
}

void FdServer::Log(const char* level, const std::string& line) const {
  if (log_) log_(level, line);
}

void FdServer::UpdateCounts() {
  holders_count_.store(holders_.size());
  pending_count_.store(pending_.size());
}

bool FdServer::PeerAllowed(const Peer& peer) const {
  if (!peer.known) return false;
  if (peer.uid == own_uid_ || peer.uid == 0) return true;
  const auto& u = options_.allow_uids;
  const auto& g = options_.allow_gids;
  return std::find(u.begin(), u.end(), peer.uid) != u.end() ||
         std::find(g.begin(), g.end(), peer.gid) != g.end();
}

std::string FdServer::PeerText(const Peer& peer) const {
  if (!peer.known) return "peer (credentials unknown)";
  return absl::StrCat("peer uid=", peer.uid, " gid=", peer.gid, " pid=", peer.pid);
}

void FdServer::Refuse(int fd, const Peer& peer, const std::string& reason) {
  const std::string text = OneLine(reason);
  Log("warn", absl::StrCat("fd socket: refused ", PeerText(peer), ": ", text));
  SendLine(fd, absl::StrCat("ERR ", text, "\n"), -1);
  close(fd);
}

std::string FdServer::DeniedReason(const Peer& peer) const {
  if (!peer.known) return "cannot read the peer's credentials (SO_PEERCRED)";
  return absl::StrCat("peer uid ", peer.uid, " gid ", peer.gid,
                      " not allowed: run the engine as spind's user (uid ", own_uid_,
                      ") or root, or start spind with --allow-uid ", peer.uid, " or --allow-gid ",
                      peer.gid);
}

void FdServer::RefuseHandshake(const Pending& p, const std::string& reason) {
  // A peer that may not attach at all is told that, whatever else went wrong.
  Refuse(p.fd, p.peer, PeerAllowed(p.peer) ? reason : DeniedReason(p.peer));
}

void FdServer::CloseHolder(int fd, const char* why) {
  auto it = holders_.find(fd);
  if (it == holders_.end()) return;
  const Holder h = std::move(it->second);
  holders_.erase(it);
  close(fd);
  UpdateCounts();
  sessions_->Release(h.session_id);
  Log("info", absl::StrCat("fd socket: session ", h.session_id, " released by ", PeerText(h.peer),
                           ": ", why));
}

bool FdServer::ReadPending(Pending& p) {
  char tmp[kMaxLine + 2];
  while (true) {
    // At most one byte past the longest line (plus its newline) is ever buffered.
    const size_t room = kMaxLine + 2 - p.buf.size();
    const ssize_t n = recv(p.fd, tmp, room, MSG_DONTWAIT);
    if (n > 0) {
      p.buf.append(tmp, static_cast<size_t>(n));
      const size_t nl = p.buf.find('\n');
      if (nl == std::string::npos) {
        if (p.buf.size() > kMaxLine) {
          RefuseHandshake(p,
                          absl::StrCat("request line longer than ", kMaxLine, " bytes: ", kUsage));
          return true;
        }
        continue;
      }
      if (nl > kMaxLine) {
        RefuseHandshake(p, absl::StrCat("request line longer than ", kMaxLine, " bytes: ", kUsage));
        return true;
      }
      if (nl + 1 != p.buf.size()) {
        RefuseHandshake(p, absl::StrCat("bytes after the request line: send one line, ", kUsage,
                                        ", then wait for the reply"));
        return true;
      }
      Finish(p, p.buf.substr(0, nl));
      return true;
    }
    if (n == 0) {
      RefuseHandshake(p, absl::StrCat("connection closed before a complete request line: ", kUsage,
                                      " ending in a newline"));
      return true;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
    RefuseHandshake(p, absl::StrCat("read failed: ", std::strerror(errno)));
    return true;
  }
}

void FdServer::Finish(Pending& p, const std::string& raw) {
  const int conn = p.fd;
  const Peer& peer = p.peer;
  if (!PeerAllowed(peer)) {
    Refuse(conn, peer, DeniedReason(peer));
    return;
  }
  std::string line = raw;
  if (!line.empty() && line.back() == '\r') line.pop_back();
  for (char c : line) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
      Refuse(conn, peer, absl::StrCat("malformed request (control or non-ASCII bytes): ", kUsage));
      return;
    }
  }
  const std::vector<std::string> parts = absl::StrSplit(line, ' ');
  if (parts[0] != "ATTACH") {
    Refuse(conn, peer, absl::StrCat("unknown request: ", kUsage));
    return;
  }
  if (parts.size() != 3 || parts[1].empty() || parts[2].empty()) {
    Refuse(conn, peer,
           absl::StrCat("malformed ATTACH: ", kUsage, " (three fields, one space apart)"));
    return;
  }
  const std::string& id = parts[1];
  const std::string& token = parts[2];
  absl::StatusOr<std::shared_ptr<Session>> s = sessions_->Get(id, token);
  if (!s.ok()) {
    Refuse(conn, peer, std::string(s.status().message()));
    return;
  }
  // A session spind drives (remote mode) is never handed out: its arena is spind's alone.
  if (absl::Status b = sessions_->Bind(**s, DriveMode::kLocal); !b.ok()) {
    Refuse(conn, peer, std::string(b.message()));
    return;
  }
  if (absl::Status h = sessions_->Hold(id); !h.ok()) {
    Refuse(conn, peer, std::string(h.message()));
    return;
  }
  absl::StatusOr<int> fd = absl::InternalError("session freed");
  bool freed = false;
  {
    std::lock_guard<std::mutex> lock((*s)->mu);
    freed = (*s)->freed;
    if (!freed) fd = (*s)->arena->ExportFd();
  }
  if (freed || !fd.ok()) {
    sessions_->Release(id);
    Refuse(conn, peer,
           freed ? absl::StrCat("session '", id, "' was freed while attaching")
                 : absl::StrCat("cannot export the arena: ", fd.status().message()));
    return;
  }
  // The connection is a holder from the moment the OK can reach the client.
  holders_[conn] = Holder{id, peer};
  UpdateCounts();
  const bool sent = SendLine(conn, absl::StrCat("OK ", (*s)->bytes, "\n"), *fd);
  close(*fd);  // the client has its own reference now (or never will)
  if (!sent) {
    CloseHolder(conn, "the OK reply could not be sent (the client went away or does not read)");
    return;
  }
  Log("info", absl::StrCat("fd socket: session ", id, " handed to ", PeerText(peer), " (",
                           holders_.size(), " holder connections open)"));
}

void FdServer::AcceptAll() {
  // Bounded so that one burst of connections cannot starve the rest of the loop.
  for (int i = 0; i < 256; ++i) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    const auto now = Clock::now();
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors: stop accepting for a moment rather than spin on the backlog.
        Log("error", absl::StrCat("fd socket: accept failed (", std::strerror(errno),
                                  "): not accepting for 100 ms; raise the open-files limit"));
        listen_paused_until_ = now + std::chrono::milliseconds(100);
        return;
      }
      Log("error", absl::StrCat("fd socket: accept failed: ", std::strerror(errno)));
      return;
    }
    Pending p;
    p.fd = fd;
    p.deadline = now + options_.handshake_deadline;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && len == sizeof(cred)) {
      p.peer = Peer{cred.uid, cred.gid, cred.pid, true};
    }
    // A client whose line is already there completes now and never takes a pending slot.
    if (ReadPending(p)) continue;
    // Past the bound, the oldest handshake goes: a real client sends its line at once.
    while (pending_.size() >= static_cast<size_t>(options_.max_pending)) {
      auto oldest = pending_.begin();
      Refuse(oldest->second.fd, oldest->second.peer,
             absl::StrCat("too many handshakes in progress (limit ", options_.max_pending,
                          "): this one was the oldest and is dropped; send the request line "
                          "right after connecting"));
      pending_.erase(oldest);
    }
    pending_.emplace(next_seq_++, std::move(p));
    UpdateCounts();
  }
}

void FdServer::Loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> pending_keys;
  std::vector<int> holder_keys;
  while (true) {
    auto now = Clock::now();
    fds.clear();
    pending_keys.clear();
    holder_keys.clear();
    fds.push_back({wake_[0], POLLIN, 0});
    const bool listening = now >= listen_paused_until_;
    fds.push_back({listening ? listen_fd_ : -1, POLLIN, 0});  // fd -1: ignored by poll
    int timeout = listening ? -1 : MillisUntil(listen_paused_until_, now);
    for (const auto& [seq, p] : pending_) {
      fds.push_back({p.fd, POLLIN, 0});
      pending_keys.push_back(seq);
      const int t = MillisUntil(p.deadline, now);
      timeout = timeout < 0 ? t : std::min(timeout, t);
    }
    for (const auto& [fd, h] : holders_) {
      fds.push_back({fd, POLLIN, 0});
      holder_keys.push_back(fd);
    }
    if (poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) {
      Log("error", absl::StrCat("fd socket: poll failed: ", std::strerror(errno)));
      // Not expected; keep the loop from spinning while still waking for Stop().
      pollfd w{wake_[0], POLLIN, 0};
      poll(&w, 1, 100);
      if (w.revents) break;
      continue;
    }
    if (fds[0].revents) break;

    // Handshakes in progress.
    for (size_t i = 0; i < pending_keys.size(); ++i) {
      if (!fds[2 + i].revents) continue;
      auto it = pending_.find(pending_keys[i]);
      if (it != pending_.end() && ReadPending(it->second)) {
        pending_.erase(it);
        UpdateCounts();
      }
    }
    // Holders: clients send nothing after the handshake, so readable means closed (or
    // misbehaving, which ends the hold too).
    const size_t first_holder = 2 + pending_keys.size();
    for (size_t i = 0; i < holder_keys.size(); ++i) {
      const short ev = fds[first_holder + i].revents;
      if (!ev) continue;
      char buf[64];
      ssize_t n;
      do {
        n = recv(holder_keys[i], buf, sizeof(buf), MSG_DONTWAIT);
      } while (n < 0 && errno == EINTR);
      if (n > 0) {
        CloseHolder(holder_keys[i], "the client sent bytes after the handshake (misbehaviour)");
      } else if (n == 0) {
        CloseHolder(holder_keys[i], "connection closed");
      } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
        CloseHolder(holder_keys[i], "connection error");
      } else if (ev & (POLLHUP | POLLERR | POLLNVAL)) {
        CloseHolder(holder_keys[i], "connection hung up");
      }
    }
    if (listening && (fds[1].revents & POLLIN)) AcceptAll();

    // Deadlines: the whole handshake, from accept.
    now = Clock::now();
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.deadline > now) {
        ++it;
        continue;
      }
      RefuseHandshake(it->second, absl::StrCat("handshake timed out after ",
                                               options_.handshake_deadline.count(), " ms: send '",
                                               "ATTACH <session_id> <token>",
                                               "\\n' right after "
                                               "connecting"));
      it = pending_.erase(it);
    }
    UpdateCounts();
  }

  // Stopping: every connection goes, every held session is released.
  for (auto& [seq, p] : pending_) Refuse(p.fd, p.peer, "spind's fd socket is stopping");
  pending_.clear();
  const size_t held = holders_.size();
  for (auto& [fd, h] : holders_) {
    close(fd);
    sessions_->Release(h.session_id);
  }
  holders_.clear();
  UpdateCounts();
  if (held > 0) {
    Log("info", absl::StrCat("fd socket: stopping, released ", held, " holder connections"));
  }
}

}  // namespace spin::service
