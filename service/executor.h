// Where spind's slow work runs: a fixed pool of worker threads, and per-session strands on it.
//
// gRPC's callback handlers run on threads that serve every caller (health checks, ListSessions,
// other sessions), so a handler must not allocate an arena, wait on a busy session's lock or
// run a data-plane step there. Handlers post that work here and finish their reactor from the
// worker. A strand runs one session's tasks one at a time, in order, on one worker at a time:
// a session with a slow call (or many queued calls) occupies at most one worker, and calls on
// other sessions keep running on the rest.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace spin::service {

/// A fixed pool of threads running posted tasks in FIFO order.
class Executor {
 public:
  /// Starts `threads` workers (at least 1).
  explicit Executor(size_t threads);
  /// Runs what was posted, then joins the workers.
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// Queues `task`; a worker runs it.
  void Post(std::function<void()> task);
  /// Tasks queued and not yet started.
  size_t queued() const;

 private:
  void Work();
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

/// Tasks of one session, run in order and never two at once, on an Executor.
class Strand : public std::enable_shared_from_this<Strand> {
 public:
  explicit Strand(Executor* executor) : executor_(executor) {}
  /// Queues `task` after the strand's earlier tasks; false (nothing queued) when `max_queued`
  /// tasks already wait.
  bool Post(std::function<void()> task, size_t max_queued = 64);

 private:
  void Drain();
  Executor* executor_;
  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
  bool running_ = false;
};

}  // namespace spin::service
