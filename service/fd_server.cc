#include "fd_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"

namespace spin::service {

FdServer::FdServer(SessionManager* sessions, std::string path, std::chrono::milliseconds grace)
    : sessions_(sessions), path_(std::move(path)), grace_(grace) {}

FdServer::~FdServer() { Stop(); }

absl::Status FdServer::Start() {
  sockaddr_un addr{};
  if (path_.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("fd socket path too long: ", path_));
  }
  unlink(path_.c_str());
  listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, path_.c_str());
  if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listen_fd_, 64) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on fd socket ", path_, ": ", std::strerror(errno)));
  }
  chmod(path_.c_str(), 0660);
  if (pipe2(wake_, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void FdServer::Stop() {
  if (thread_.joinable()) {
    const char x = 'x';
    (void)!write(wake_[1], &x, 1);
    thread_.join();
  }
  for (auto& [fd, id] : holders_) close(fd);
  holders_.clear();
  for (int* fd : {&listen_fd_, &wake_[0], &wake_[1]}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
  unlink(path_.c_str());
}

void FdServer::Handshake(int conn) {
  auto reply = [conn](const std::string& line, int fd = -1) {
    msghdr msg{};
    iovec iov{const_cast<char*>(line.data()), line.size()};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (fd >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    return sendmsg(conn, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(line.size());
  };
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
      (cred.uid != getuid() && cred.uid != 0)) {
    reply("ERR peer uid not allowed: run the engine as spind's user or root\n");
    close(conn);
    return;
  }
  // One short request line; a client that sends nothing for 2 s is dropped.
  std::string line;
  char ch = 0;
  pollfd p{conn, POLLIN, 0};
  while (line.size() < 256 && poll(&p, 1, 2000) == 1 && read(conn, &ch, 1) == 1 && ch != '\n') {
    line.push_back(ch);
  }
  std::istringstream in(line);
  std::string verb, id, token;
  in >> verb >> id >> token;
  if (verb != "ATTACH" || id.empty() || token.empty()) {
    reply("ERR expected 'ATTACH <session_id> <token>'\n");
    close(conn);
    return;
  }
  absl::StatusOr<std::shared_ptr<Session>> s = sessions_->Get(id, token);
  if (!s.ok()) {
    reply(absl::StrCat("ERR ", s.status().message(), "\n"));
    close(conn);
    return;
  }
  absl::StatusOr<int> fd;
  {
    std::lock_guard<std::mutex> lock((*s)->mu);
    fd = (*s)->arena->ExportFd();
  }
  if (!fd.ok()) {
    reply(absl::StrCat("ERR cannot export the arena: ", fd.status().message(), "\n"));
    close(conn);
    return;
  }
  const bool sent = reply(absl::StrCat("OK ", (*s)->bytes, "\n"), *fd);
  close(*fd);  // the client holds its own reference now
  if (!sent) {
    close(conn);
    return;
  }
  holders_[conn] = id;
  orphaned_.erase(id);
}

void FdServer::Loop() {
  while (true) {
    std::vector<pollfd> fds = {{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (const auto& [fd, id] : holders_) fds.push_back({fd, POLLIN, 0});
    poll(fds.data(), fds.size(), 100);
    if (fds[0].revents) return;
    if (fds[1].revents & POLLIN) {
      const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn >= 0) Handshake(conn);
    }
    const auto now = std::chrono::steady_clock::now();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      char buf[64];
      // Clients send nothing after the handshake: readable means closed (or misbehaving).
      if (read(fds[i].fd, buf, sizeof(buf)) > 0) continue;
      const std::string id = holders_[fds[i].fd];
      close(fds[i].fd);
      holders_.erase(fds[i].fd);
      bool held = false;
      for (const auto& [fd, other] : holders_) held = held || other == id;
      if (!held) orphaned_[id] = now;
    }
    for (auto it = orphaned_.begin(); it != orphaned_.end();) {
      if (now - it->second < grace_) {
        ++it;
        continue;
      }
      sessions_->Free(it->first);
      it = orphaned_.erase(it);
    }
  }
}

}  // namespace spin::service
