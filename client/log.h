// Where libspin_client's messages go. The library runs inside an engine process: it never writes
// to that process's stderr by itself except through this hook, whose default writes one line
// ("spin_client: <message>") to stderr. An engine routes them into its own logging with
// SetLogHandler (or silences them with a handler that drops them).
#pragma once

#include <functional>
#include <string>

namespace spin::client {

enum class LogLevel { kInfo, kWarning, kError };

/// Receives every message of the library, one line without a trailing newline. Called from the
/// engine's threads and the library's retry thread, so it must be thread-safe.
using LogHandler = std::function<void(LogLevel level, const std::string& line)>;

/// Replaces the handler (nullptr restores the default: one line on stderr). Thread-safe.
void SetLogHandler(LogHandler handler);

/// Sends one message to the current handler.
void Log(LogLevel level, const std::string& line);

}  // namespace spin::client
