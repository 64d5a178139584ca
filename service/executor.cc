#include "executor.h"

#include <algorithm>

namespace spin::service {

Executor::Executor(size_t threads) {
  threads = std::max<size_t>(threads, 1);
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void Executor::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

size_t Executor::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tasks_.size();
}

void Executor::Work() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and everything posted has run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

bool Strand::Post(std::function<void()> task, size_t max_queued) {
  bool start = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (tasks_.size() >= max_queued) return false;
    tasks_.push_back(std::move(task));
    if (!running_) running_ = start = true;
  }
  if (start) executor_->Post([self = shared_from_this()] { self->Drain(); });
  return true;
}

void Strand::Drain() {
  // Runs a bounded batch, then yields the worker to other strands' work.
  for (int i = 0; i < 16; ++i) {
    std::function<void()> task;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (tasks_.empty()) {
        running_ = false;
        return;
      }
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
  executor_->Post([self = shared_from_this()] { self->Drain(); });
}

}  // namespace spin::service
