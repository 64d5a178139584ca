#include "log.h"

#include <cstdio>
#include <memory>
#include <mutex>

namespace spin::client {
namespace {

std::mutex& HandlerMutex() {
  static std::mutex mu;
  return mu;
}

std::shared_ptr<const LogHandler>& Handler() {
  static std::shared_ptr<const LogHandler> handler;
  return handler;
}

}  // namespace

void SetLogHandler(LogHandler handler) {
  std::lock_guard<std::mutex> lock(HandlerMutex());
  Handler() = handler ? std::make_shared<const LogHandler>(std::move(handler)) : nullptr;
}

void Log(LogLevel level, const std::string& line) {
  std::shared_ptr<const LogHandler> h;
  {
    std::lock_guard<std::mutex> lock(HandlerMutex());
    h = Handler();
  }
  if (h) {
    (*h)(level, line);
    return;
  }
  const char* tag = level == LogLevel::kError     ? "error: "
                    : level == LogLevel::kWarning ? "warning: "
                                                  : "";
  std::fprintf(stderr, "spin_client: %s%s\n", tag, line.c_str());
}

}  // namespace spin::client
