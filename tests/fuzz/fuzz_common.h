// Helpers shared by the libFuzzer targets (docs/testing.md): a private scratch directory, file
// writing, and a check that stops the fuzzer with a message (a finding, like a crash).
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

// A property the target asserts: print what broke and abort, so libFuzzer saves the input.
#define FUZZ_CHECK(cond, ...)                                                                \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n  ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                     \
      std::fprintf(stderr, "\n");                                                            \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)

namespace spin::fuzz {

// A directory of this process's own, removed at exit: in /dev/shm when it is writable (no disk
// I/O per input), else in $TMPDIR or /tmp.
inline const std::string& ScratchDir() {
  static const std::string dir = [] {
    std::string base = "/dev/shm";
    if (::access(base.c_str(), W_OK) != 0) {
      const char* t = std::getenv("TMPDIR");
      base = t != nullptr && *t != '\0' ? t : "/tmp";
    }
    std::string templ = base + "/spin-fuzz-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    static std::string to_remove;
    to_remove = templ;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(to_remove, ec);
    });
    return templ;
  }();
  return dir;
}

// Writes `size` bytes to `path` (created or truncated); aborts on failure (the harness's own
// environment broke, not the code under test).
inline void WriteFileOrDie(const std::string& path, const uint8_t* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  FUZZ_CHECK(fd >= 0, "cannot create %s", path.c_str());
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    FUZZ_CHECK(n > 0, "cannot write %s", path.c_str());
    data += n;
    size -= static_cast<size_t>(n);
  }
  ::close(fd);
}

}  // namespace spin::fuzz
