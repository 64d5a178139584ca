#include "warm_budgets.h"

#include <unistd.h>

#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

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
  std::ifstream in(path);
  if (!in) return std::nullopt;  // none yet: the usual first run of a model
  auto ignore = [&](const std::string& why) {
    if (log_) {
      log_("warning", absl::StrCat("warm budgets of model ", model, " (", path, ") ignored: ", why,
                                   "; the session starts uniform, and the file is rewritten "
                                   "at its first recompute"));
    }
    return std::nullopt;
  };
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    return ignore(absl::StrCat("not JSON (", e.what(), ")"));
  }
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
    w.saved_unix = j.at("saved_unix").get<int64_t>();
    const int64_t age = static_cast<int64_t>(std::time(nullptr)) - w.saved_unix;
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
  std::ostringstream tmp_name;
  tmp_name << path << ".tmp." << getpid() << "."
           << std::hash<std::thread::id>{}(std::this_thread::get_id());
  const std::string tmp = tmp_name.str();
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    std::filesystem::remove(tmp, ec);
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " into ", path, ": ", why));
  }
  return absl::OkStatus();
}

}  // namespace spin::service
