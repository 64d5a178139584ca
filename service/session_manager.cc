#include "session_manager.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>

#include "absl/strings/str_cat.h"

namespace spin::service {
namespace {

// Hex of `bytes` bytes from the kernel's CSPRNG.
absl::StatusOr<std::string> RandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = getrandom(raw.data() + got, bytes - got, 0);
    if (n < 0) return absl::InternalError("getrandom failed");
    got += static_cast<size_t>(n);
  }
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Attach(const Geometry& g, uint64_t seed,
                                                                const Policy& policy,
                                                                const std::string& client_name) {
  if (absl::Status s = ValidateGeometry(g); !s.ok()) return s;
  if (absl::Status s = ValidatePolicy(policy); !s.ok()) return s;
  const uint64_t bytes = ArenaBytes(g);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sessions_.size() >= limits_.max_sessions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("spind already holds ", sessions_.size(), " sessions (--max-sessions ",
                       limits_.max_sessions, "): detach one first"));
    }
    if (bytes_ + bytes > limits_.max_arena_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("an arena of ", bytes, " bytes would exceed --max-arena-bytes ",
                       limits_.max_arena_bytes, " (", bytes_, " in use)"));
    }
    bytes_ += bytes;  // reserved now so concurrent attaches cannot overshoot
  }
  auto release = [this, bytes] {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_ -= bytes;
  };
  auto s = std::make_shared<Session>();
  s->geometry = g;
  s->client_name = client_name;
  s->created_unix_seconds = static_cast<int64_t>(std::time(nullptr));
  s->bytes = bytes;
  absl::StatusOr<std::string> id = RandomHex(8), token = RandomHex(16);
  if (!id.ok() || !token.ok()) {
    release();
    return absl::InternalError("cannot draw a session id and token");
  }
  s->id = "s-" + *id;
  s->token = *token;
  absl::StatusOr<std::unique_ptr<ArenaStorage>> arena =
      limits_.backend == Backend::kCuda ? MakeCudaArenaStorage(limits_.device, g, seed, policy)
                                        : MakeCpuArenaStorage(g, seed, policy);
  if (!arena.ok()) {
    release();
    return arena.status();
  }
  s->arena = std::move(*arena);
  // A CUDA allocation is rounded up to the allocation granularity: hold what was mapped, and
  // stay within the limit with it.
  s->bytes = s->arena->mapping_bytes();
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes_ - bytes + s->bytes > limits_.max_arena_bytes) {
    bytes_ -= bytes;
    return absl::ResourceExhaustedError(absl::StrCat(
        "an arena of ", s->bytes, " bytes (", bytes, " rounded up to the GPU's allocation ",
        "granularity) would exceed --max-arena-bytes ", limits_.max_arena_bytes));
  }
  bytes_ += s->bytes - bytes;
  sessions_[s->id] = s;
  order_.push_back(s->id);
  return s;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Get(const std::string& id,
                                                             const std::string& token) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("no session '", id, "' (detached or never attached)"));
  }
  if (it->second->token != token) {
    return absl::PermissionDeniedError(absl::StrCat("wrong token for session '", id, "'"));
  }
  return it->second;
}

absl::Status SessionManager::Detach(const std::string& id, const std::string& token) {
  absl::StatusOr<std::shared_ptr<Session>> s = Get(id, token);
  if (!s.ok()) return s.status();
  Free(id);
  return absl::OkStatus();
}

void SessionManager::Free(const std::string& id) {
  std::shared_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return;
    s = it->second;
    bytes_ -= it->second->bytes;
    sessions_.erase(it);
    order_.erase(std::remove(order_.begin(), order_.end(), id), order_.end());
  }
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->freed = true;
  }
  if (on_free_) on_free_(id);
}

std::vector<std::shared_ptr<Session>> SessionManager::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (const std::string& id : order_) out.push_back(sessions_.at(id));
  return out;
}

uint64_t SessionManager::arena_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

}  // namespace spin::service
