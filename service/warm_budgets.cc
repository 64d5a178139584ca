#include "warm_budgets.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace spin::service {

namespace {
constexpr int kFormatVersion = 1;
}  // namespace

absl::Status ValidateModelName(const std::string& model) {
  if (model.empty() || model.size() > 128 || model[0] == '.') {
    return absl::InvalidArgumentError(absl::StrCat(
        "model name of ", model.size(),
        " bytes: it must be 1-128 characters of A-Z a-z 0-9 . _ - and not start with '.'"));
  }
  for (char ch : model) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                    (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model name has the character (byte ", static_cast<int>(static_cast<unsigned char>(ch)),
          "); allowed: A-Z a-z 0-9 . _ - (replace the others, e.g. '/' with '_')"));
    }
  }
  return absl::OkStatus();
}

WarmBudgets::WarmBudgets(std::string dir, std::chrono::seconds max_age, LogFn log)
    : dir_(std::move(dir)), max_age_(max_age), log_(std::move(log)) {}

std::string WarmBudgets::PathOf(const std::string& model) const {
  return dir_ + "/" + model + ".budgets.json";
}

std::optional<WarmCurves> WarmBudgets::Load(const std::string& model, const Geometry& g) const {
  if (!enabled() || !ValidateModelName(model).ok()) return std::nullopt;
  const std::string path = PathOf(model);
  auto ignore = [&](const std::string& why) {
    if (log_) {
      log_("warning", absl::StrCat("warm budgets of model ", model, " (", path, ") ignored: ", why,
                                   "; the session starts uniform, and the file is rewritten "
                                   "at its first recompute"));
    }
    return std::nullopt;
  };
  absl::StatusOr<std::string> text = ReadStateFile(path, kMaxWarmFileBytes);
  if (absl::IsNotFound(text.status())) return std::nullopt;  // the usual first run of a model
  if (!text.ok()) return ignore(std::string(text.status().message()));
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded()) return ignore("not JSON");
  try {
    if (!j.is_object() || j.value("version", 0) != kFormatVersion) {
      return ignore(absl::StrCat("not a version ", kFormatVersion, " budgets file"));
    }
    if (j.at("model").get<std::string>() != model) return ignore("written for another model");
    const uint32_t layers = j.at("layers").get<uint32_t>();
    const uint32_t block = j.at("block_size").get<uint32_t>();
    const uint32_t topk = j.at("topk").get<uint32_t>();
    if (layers != g.layers || block != g.block_size || topk != g.topk) {
      return ignore(absl::StrCat("saved for ", layers, " layers, block size ", block, ", top-K ",
                                 topk, "; this session has ", g.layers, ", ", g.block_size, ", ",
                                 g.topk));
    }
    WarmCurves w;
    const nlohmann::json& saved = j.at("saved_unix");
    const int64_t now = static_cast<int64_t>(std::time(nullptr));
    if (!saved.is_number_integer() || saved.get<int64_t>() < 0 ||
        saved.get<int64_t>() > now + kMaxFutureSeconds) {
      return ignore(absl::StrCat("saved_unix ", saved.dump(), " is not a time from 1970 to now"));
    }
    w.saved_unix = saved.get<int64_t>();
    const int64_t age = now - w.saved_unix;
    if (age > max_age_.count()) {
      return ignore(absl::StrCat("saved ", age / 3600, " hours ago, past --warm-max-age-hours ",
                                 max_age_.count() / 3600));
    }
    w.num_blocks = j.at("num_blocks").get<int32_t>();
    if (w.num_blocks < 1) return ignore(absl::StrCat("num_blocks ", w.num_blocks));
    const nlohmann::json& curves = j.at("curves");
    if (!curves.is_array() || curves.size() != layers) return ignore("curves per layer missing");
    for (const nlohmann::json& c : curves) {
      if (!c.is_array() || c.size() != static_cast<size_t>(kCurvePoints)) {
        return ignore(absl::StrCat("a curve without ", kCurvePoints, " points"));
      }
      MissCurve m;
      for (int p = 0; p < kCurvePoints; ++p) {
        m[p] = c[p].get<double>();
        if (!(m[p] >= 0 && m[p] <= 1)) return ignore(absl::StrCat("a curve value ", m[p]));
      }
      w.curves.push_back(m);
    }
    return w;
  } catch (const std::exception& e) {
    return ignore(absl::StrCat("malformed (", e.what(), ")"));
  }
}

void WarmBudgets::Save(const std::string& model, const Geometry& g,
                       const std::vector<MissCurve>& curves, int32_t num_blocks) const {
  if (!enabled() || !ValidateModelName(model).ok()) return;
  nlohmann::json j;
  j["version"] = kFormatVersion;
  j["model"] = model;
  j["layers"] = g.layers;
  j["block_size"] = g.block_size;
  j["topk"] = g.topk;
  j["num_blocks"] = num_blocks;
  j["saved_unix"] = static_cast<int64_t>(std::time(nullptr));
  nlohmann::json cs = nlohmann::json::array();
  for (const MissCurve& c : curves) cs.push_back(std::vector<double>(c.begin(), c.end()));
  j["curves"] = std::move(cs);
  const std::string path = PathOf(model);
  if (absl::Status w = WriteFileAtomically(path, j.dump() + "\n"); !w.ok() && log_) {
    log_("warning",
         absl::StrCat("cannot keep warm budgets of model ", model, ": ", w.message(),
                      " (check that --state-dir ", dir_, " exists and is writable by spind)"));
  }
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot create a temporary file beside ", path, ": ", std::strerror(errno)));
  }
  auto fail = [&](const char* step) {
    const std::string why = std::strerror(errno);
    close(fd);
    unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot ", step, " ", tmp, ": ", why));
  };
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail("write");
    done += static_cast<size_t>(n);
  }
  if (fchmod(fd, 0644) != 0) return fail("set the mode of");
  if (fsync(fd) != 0) return fail("sync");
  if (close(fd) != 0) {
    const std::string why = std::strerror(errno);
    unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot close ", tmp, ": ", why));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " into ", path, ": ", why));
  }
  // The rename itself survives a crash once the directory is synced.
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadStateFile(const std::string& path, size_t max_bytes) {
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
    if (errno == ELOOP) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is a symlink; spind reads only regular files in --state-dir"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not a regular file; spind reads only regular files in --state-dir"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        path, " has ", st.st_size, " bytes, over the ", max_bytes, "-byte limit for this file"));
  }
  std::string text(max_bytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = read(fd, text.data() + got, text.size() - got);
    if (n < 0 && (errno == EINTR)) continue;
    if (n < 0) {
      const std::string why = std::strerror(errno);
      close(fd);
      return absl::FailedPreconditionError(absl::StrCat("cannot read ", path, ": ", why));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  close(fd);
  if (got > max_bytes) {  // it grew since fstat
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is over the ", max_bytes, "-byte limit for this file"));
  }
  text.resize(got);
  return text;
}

}  // namespace spin::service
