#include "session_manager.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "budget_probe.h"
#include "spin/status_macros.h"

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

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Attach(const Geometry& g, uint64_t seed,
                                                                const Policy& policy,
                                                                const std::string& client_name,
                                                                bool engine_control) {
  SPIN_RETURN_IF_ERROR(ValidateGeometry(g));
  SPIN_RETURN_IF_ERROR(ValidatePolicy(policy));
  const uint64_t bytes = ArenaBytes(g);
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Attaches in progress count: their arenas are built outside the lock, concurrently.
    if (sessions_.size() + attaching_ >= limits_.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "spind already holds ", sessions_.size(), " sessions and attaches ", attaching_,
          " (--max-sessions ", limits_.max_sessions, "): detach one first"));
    }
    if (bytes_ + bytes > limits_.max_arena_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("an arena of ", bytes, " bytes would exceed --max-arena-bytes ",
                       limits_.max_arena_bytes, " (", bytes_, " in use)"));
    }
    bytes_ += bytes;  // reserved now so concurrent attaches cannot overshoot
    attaching_ += 1;
  }
  auto release = [this, bytes] {
    std::lock_guard<std::mutex> lock(mu_);
    bytes_ -= bytes;
    attaching_ -= 1;
  };
  auto s = std::make_shared<Session>();
  s->geometry = g;
  s->client_name = client_name;
  s->created_unix_seconds = static_cast<int64_t>(std::time(nullptr));
  s->bytes = bytes;
  s->policy = policy;
  s->engine_control = engine_control;
  if (executor_ != nullptr) s->strand = std::make_shared<Strand>(executor_);
  s->budgets_written.assign(g.layers, InitialBudget(policy));  // as the arena starts
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
  attaching_ -= 1;
  if (bytes_ - bytes + s->bytes > limits_.max_arena_bytes) {
    bytes_ -= bytes;
    return absl::ResourceExhaustedError(absl::StrCat(
        "an arena of ", s->bytes, " bytes (", bytes, " rounded up to the GPU's allocation ",
        "granularity) would exceed --max-arena-bytes ", limits_.max_arena_bytes));
  }
  bytes_ += s->bytes - bytes;
  // The lease starts now: a client that never fetches the fd and never calls again is freed
  // after the grace period.
  s->last_seen = std::chrono::steady_clock::now();
  sessions_[s->id] = s;
  order_.push_back(s->id);
  return s;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Get(const std::string& id,
                                                             const std::string& token) {
  std::lock_guard<std::mutex> lock(mu_);
  absl::StatusOr<std::shared_ptr<Session>> s = FindLocked(id);
  SPIN_RETURN_IF_ERROR(s.status());
  if (!ConstantTimeEquals((*s)->token, token)) {
    return absl::PermissionDeniedError(absl::StrCat("wrong token for session '", id, "'"));
  }
  (*s)->last_seen = std::chrono::steady_clock::now();
  return s;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Find(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return FindLocked(id);
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::FindLocked(const std::string& id) const {
  if (id.size() > kMaxSessionIdBytes) {  // never echo a huge id back
    return absl::NotFoundError(
        absl::StrCat("no session has an id of ", id.size(), " bytes (ids are 18)"));
  }
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("no session '", id, "' (detached or never attached)"));
  }
  return it->second;
}

absl::Status SessionManager::Bind(Session& s, DriveMode mode) {
  std::lock_guard<std::mutex> lock(mu_);
  if (s.mode == DriveMode::kUnbound || s.mode == mode) {
    s.mode = mode;
    return absl::OkStatus();
  }
  return BindError(s, mode);
}

absl::Status SessionManager::CheckBind(const Session& s, DriveMode mode) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (s.mode == DriveMode::kUnbound || s.mode == mode) return absl::OkStatus();
  return BindError(s, mode);
}

absl::Status SessionManager::BindError(const Session& s, DriveMode mode) {
  if (mode == DriveMode::kLocal) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", s.id,
        "' is driven remotely (OpenSequences/PredictMasks/ObserveScores), so its arena is not "
        "handed out: attach another session to run the data plane in this process"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "session '", s.id,
      "' is driven locally (its arena was handed out over the fd socket), so spind does not "
      "run remote-mode calls on it: attach another session for remote mode"));
}

absl::Status SessionManager::Hold(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("no session '", id, "' (detached or never attached)"));
  }
  Session& s = *it->second;
  if (s.holders >= limits_.max_holders) {
    return absl::ResourceExhaustedError(absl::StrCat("session '", id, "' already has ", s.holders,
                                                     " fd connections (the limit per session is ",
                                                     limits_.max_holders, "): close one first"));
  }
  s.holders += 1;
  s.last_seen = std::chrono::steady_clock::now();
  return absl::OkStatus();
}

void SessionManager::Release(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  if (it->second->holders > 0) it->second->holders -= 1;
  it->second->last_seen = std::chrono::steady_clock::now();
}

void SessionManager::Touch(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sessions_.find(id);
  if (it != sessions_.end()) it->second->last_seen = std::chrono::steady_clock::now();
}

std::vector<std::string> SessionManager::ReapExpired(std::chrono::steady_clock::time_point now) {
  std::vector<std::string> lapsed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, s] : sessions_) {
      if (s->holders == 0 && now - s->last_seen >= limits_.grace) lapsed.push_back(id);
    }
  }
  for (const std::string& id : lapsed) Free(id);
  return lapsed;
}

void SessionManager::StartReaper(std::chrono::milliseconds period,
                                 std::function<void(const std::string&)> log,
                                 std::function<void()> after_pass) {
  StopReaper();
  {
    std::lock_guard<std::mutex> lock(reaper_mu_);
    reaper_stop_ = false;
  }
  reaper_ = std::thread([this, period, log = std::move(log), after_pass = std::move(after_pass)] {
    std::unique_lock<std::mutex> lock(reaper_mu_);
    while (!reaper_cv_.wait_for(lock, period, [this] { return reaper_stop_; })) {
      lock.unlock();
      for (const std::string& id : ReapExpired(std::chrono::steady_clock::now())) {
        if (log) {
          log(absl::StrCat("session ", id, " freed: no fd connection and no call for ",
                           limits_.grace.count(), " ms (its client went away)"));
        }
      }
      if (after_pass) after_pass();
      lock.lock();
    }
  });
}

void SessionManager::StopReaper() {
  {
    std::lock_guard<std::mutex> lock(reaper_mu_);
    reaper_stop_ = true;
  }
  reaper_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
}

SessionManager::~SessionManager() { StopReaper(); }

absl::Status SessionManager::Detach(const std::string& id, const std::string& token) {
  SPIN_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, Get(id, token));
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
    SaveUnsavedWarmCurves(*s);
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
