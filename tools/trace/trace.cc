#include "trace.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spin/status_macros.h"

namespace spin {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string JoinPath(const std::string& dir, const char* name) {
  return (fs::path(dir) / name).string();
}

// Same code, message prefixed with where the problem is.
absl::Status WithContext(const absl::Status& status, const std::string& where) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(where, ": ", status.message()));
}

const char* JsonTypeName(const json& j) {
  if (j.is_number_integer()) return "an integer";
  if (j.is_number_float()) return "a float";
  if (j.is_string()) return "a string";
  if (j.is_boolean()) return "a boolean";
  if (j.is_null()) return "null";
  if (j.is_array()) return "an array";
  if (j.is_object()) return "an object";
  return "an unknown type";
}

// An int32 from a JSON integer; `what` names the key or element in the message.
absl::Status GetInt32(const json& j, const std::string& what, int32_t* out) {
  if (!j.is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be an integer, found ", JsonTypeName(j)));
  }
  const bool in_range =
      j.is_number_unsigned()
          ? j.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int32_t>::max())
          : (j.get<int64_t>() >= std::numeric_limits<int32_t>::min() &&
             j.get<int64_t>() <= std::numeric_limits<int32_t>::max());
  if (!in_range) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "=", j.dump(), " is out of the 32-bit integer range"));
  }
  *out = static_cast<int32_t>(j.get<int64_t>());
  return absl::OkStatus();
}

absl::Status GetIntKey(const json& root, const char* key, bool required, int* out) {
  const auto it = root.find(key);
  if (it == root.end()) {
    if (!required) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("missing required key '", key, "'"));
  }
  int32_t value = 0;
  SPIN_RETURN_IF_ERROR(GetInt32(*it, absl::StrCat("'", key, "'"), &value));
  *out = value;
  return absl::OkStatus();
}

absl::Status GetIntArray(const json& root, const char* key, bool required,
                         std::vector<int32_t>* out) {
  const auto it = root.find(key);
  if (it == root.end()) {
    if (!required) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("missing required key '", key, "'"));
  }
  if (!it->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", key, "' must be an array of integers, found ", JsonTypeName(*it)));
  }
  out->clear();
  out->reserve(it->size());
  for (size_t i = 0; i < it->size(); ++i) {
    int32_t value = 0;
    if (absl::Status s = GetInt32((*it)[i], absl::StrCat(key, "[", i, "]"), &value); !s.ok()) {
      return s;
    }
    out->push_back(value);
  }
  return absl::OkStatus();
}

// The checks that do not need the scores; `check_arrays` is off while a writer is still
// collecting the per-step arrays.
absl::Status ValidateGeometry(const TraceMeta& m, bool check_arrays) {
  if (m.version != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported version ", m.version, "; this build reads version 1"));
  }
  // The upper limits are the data plane's (trace.h), so that every command that loads a trace
  // can use it; `steps` is bounded by N_max because q_pos is strictly increasing below it.
  for (const auto& [name, value, limit, what] :
       {std::tuple{"layers", m.layers, kTraceMaxLayers, "indexer layers"},
        std::tuple{"block_size", m.block_size, kTraceMaxBlockSize, "slots per KV block"},
        std::tuple{"topk", m.topk, kTraceMaxSlots, "top-K"},
        std::tuple{"steps", m.steps, kTraceMaxSlots, "decode steps"},
        std::tuple{"rows", m.rows, kTraceMaxRows, "query rows per step"}}) {
    if (value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", name, "' is ", value, "; it must be > 0"));
    }
    if (value > limit) {
      return absl::InvalidArgumentError(absl::StrCat("'", name, "' is ", value,
                                                     "; it must be at most ", limit, " (the most ",
                                                     what, " the data plane supports)"));
    }
  }
  if (!check_arrays) return absl::OkStatus();
  for (const auto& [name, array, optional] :
       {std::tuple{"q_pos", &m.q_pos, false}, std::tuple{"ctx_len", &m.ctx_len, false},
        std::tuple{"accepted", &m.accepted, true}}) {
    if (optional && array->empty()) continue;
    if (array->size() != static_cast<size_t>(m.steps)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", name, "' has ", array->size(), " entries but steps is ", m.steps));
    }
  }
  return absl::OkStatus();
}

// The per-step checks against the scores' last axis.
absl::Status ValidateSteps(const TraceMeta& m, int64_t n_max) {
  if (n_max < 1 || n_max > kTraceMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("the scores' last axis is ", n_max, "; it must be in [1, ", kTraceMaxSlots,
                     "] (the most slots per sequence the data plane supports)"));
  }
  const std::string with_rows = m.rows > 1 ? absl::StrCat(" with rows=", m.rows) : "";
  for (int t = 0; t < m.steps; ++t) {
    const int64_t ctx = m.ctx_len[t];
    const int64_t q = m.q_pos[t];
    if (ctx < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("ctx_len[", t, "]=", ctx, " must be at least 1"));
    }
    if (ctx + m.rows - 1 > n_max) {
      return absl::InvalidArgumentError(absl::StrCat("ctx_len[", t, "]=", ctx, with_rows,
                                                     " exceeds the scores' last axis ", n_max));
    }
    if (q < 0) {
      return absl::InvalidArgumentError(absl::StrCat("q_pos[", t, "]=", q, " is negative"));
    }
    if (q + m.rows - 1 >= n_max) {
      return absl::InvalidArgumentError(absl::StrCat(
          "q_pos[", t, "]=", q, with_rows, " is at or beyond the scores' last axis ", n_max));
    }
    if (t > 0 && q <= m.q_pos[t - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("q_pos must be strictly increasing: q_pos[", t,
                                                     "]=", q, " after q_pos[", t - 1,
                                                     "]=", m.q_pos[t - 1]));
    }
    if (!m.accepted.empty() && (m.accepted[t] < 0 || m.accepted[t] > m.rows)) {
      return absl::InvalidArgumentError(
          absl::StrCat("accepted[", t, "]=", m.accepted[t], " is outside [0, rows=", m.rows, "]"));
    }
  }
  return absl::OkStatus();
}

// Temporary file, fsync, rename: readers see the old file or the whole new one.
absl::Status WriteFileAtomically(const std::string& path, const std::string& contents) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", tmp));
  const char* p = contents.data();
  size_t left = contents.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::ErrnoToStatus(err, absl::StrCat("cannot write ", tmp));
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("cannot flush ", tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

// meta.json, whole: opened only as a regular file (a FIFO is refused at once rather than
// waited on) and at most kTraceMaxMetaBytes.
absl::StatusOr<std::string> ReadMetaJson(const std::string& path) {
  SPIN_ASSIGN_OR_RETURN(RegularFile file,
                        OpenRegularFile(path, "a trace directory holds meta.json and scores.npy"));
  if (file.size() > kTraceMaxMetaBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " is ", file.size(), " bytes; a trace's meta.json is at most ", kTraceMaxMetaBytes,
        " bytes (it holds a few numbers per step): check that it is the right file"));
  }
  std::string text;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(file.fd(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      return absl::ErrnoToStatus(err, absl::StrCat("error reading ", path));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    if (text.size() > kTraceMaxMetaBytes) {  // grew while we read it
      return absl::InvalidArgumentError(
          absl::StrCat(path, " grew past ", kTraceMaxMetaBytes, " bytes while it was read"));
    }
  }
  return text;
}

// A meta.json problem, with what to do about it.
absl::Status FixHint(const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(s.message(),
                                             "; fix meta.json or regenerate the trace "
                                             "(spinctl gen-trace)"));
}

}  // namespace

absl::Status ValidateTraceMeta(const TraceMeta& meta, int64_t n_max) {
  SPIN_RETURN_IF_ERROR(ValidateGeometry(meta, /*check_arrays=*/true));
  return ValidateSteps(meta, n_max);
}

absl::StatusOr<TraceMeta> ParseTraceMeta(const std::string& json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": malformed JSON at byte ", e.byte, " (", e.what(), ")"));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": malformed JSON (", e.what(), ")"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": the top level must be an object, found ", JsonTypeName(root)));
  }
  TraceMeta meta;
  absl::Status s;
  // Version first: a future version may change what the other keys mean.
  if (s.ok()) s = GetIntKey(root, "version", true, &meta.version);
  if (s.ok() && meta.version != 1) s = ValidateGeometry(meta, false);
  if (s.ok()) s = GetIntKey(root, "layers", true, &meta.layers);
  if (s.ok()) s = GetIntKey(root, "block_size", true, &meta.block_size);
  if (s.ok()) s = GetIntKey(root, "topk", true, &meta.topk);
  if (s.ok()) s = GetIntKey(root, "steps", true, &meta.steps);
  if (s.ok()) s = GetIntKey(root, "rows", false, &meta.rows);
  if (s.ok()) s = GetIntArray(root, "q_pos", true, &meta.q_pos);
  if (s.ok()) s = GetIntArray(root, "ctx_len", true, &meta.ctx_len);
  if (s.ok()) s = GetIntArray(root, "accepted", false, &meta.accepted);
  // TraceMeta spells "absent" as empty, so an explicitly empty array must be caught here.
  if (s.ok() && root.contains("accepted") && meta.accepted.empty() && meta.steps != 0) {
    s = absl::InvalidArgumentError(
        absl::StrCat("'accepted' has 0 entries but steps is ", meta.steps));
  }
  if (!s.ok()) return WithContext(s, source);
  return meta;
}

std::string TraceMetaToJson(const TraceMeta& meta) {
  nlohmann::ordered_json j;
  j["version"] = meta.version;
  j["layers"] = meta.layers;
  j["block_size"] = meta.block_size;
  j["topk"] = meta.topk;
  j["steps"] = meta.steps;
  j["rows"] = meta.rows;
  j["q_pos"] = meta.q_pos;
  j["ctx_len"] = meta.ctx_len;
  if (!meta.accepted.empty()) j["accepted"] = meta.accepted;
  return j.dump() + "\n";
}

absl::StatusOr<Trace> LoadTrace(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("trace directory ", dir, " does not exist"));
    }
    return absl::ErrnoToStatus(err, absl::StrCat("cannot access trace directory ", dir));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, " is not a directory; a trace is a directory holding meta.json and scores.npy"));
  }
  const std::string meta_path = JoinPath(dir, "meta.json");
  SPIN_ASSIGN_OR_RETURN(std::string text, ReadMetaJson(meta_path));
  absl::StatusOr<TraceMeta> meta = ParseTraceMeta(text, meta_path);
  if (!meta.ok()) return FixHint(meta.status());
  if (absl::Status s = ValidateGeometry(*meta, true); !s.ok()) {
    return FixHint(WithContext(s, meta_path));
  }

  const std::string scores_path = JoinPath(dir, "scores.npy");
  SPIN_ASSIGN_OR_RETURN(NpyArray scores, ReadNpyF32(scores_path));
  const std::vector<int64_t>& shape = scores.shape();
  if (shape.size() != 4 || shape[0] != meta->steps || shape[1] != meta->layers ||
      shape[2] != meta->rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        scores_path, " has shape [", absl::StrJoin(shape, ", "), "]; meta.json expects [",
        meta->steps, ", ", meta->layers, ", ", meta->rows,
        ", N_max] (steps, layers, rows, slots): the two files are not from the same trace, "
        "regenerate or re-copy it"));
  }
  if (shape[3] < 1 || shape[3] > kTraceMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        scores_path, ": the scores' last axis is ", shape[3], "; a trace has 1 to ", kTraceMaxSlots,
        " slots per row (the most the data plane supports): regenerate it"));
  }
  if (absl::Status s = ValidateSteps(*meta, shape[3]); !s.ok()) {
    return FixHint(WithContext(s, meta_path));
  }

  Trace trace;
  trace.meta_ = *std::move(meta);
  trace.n_max_ = shape[3];
  trace.scores_ = std::move(scores);
  trace.dir_ = dir;
  return trace;
}

absl::StatusOr<TraceWriter> TraceWriter::Open(const std::string& dir, const TraceMeta& meta,
                                              int64_t n_max) {
  const std::string where = absl::StrCat("trace ", dir);
  if (absl::Status s = ValidateGeometry(meta, false); !s.ok()) return WithContext(s, where);
  if (n_max < 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": n_max is ", n_max, "; must be >= 1"));
  }
  if (!meta.q_pos.empty() || !meta.ctx_len.empty() || !meta.accepted.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where,
        ": TraceWriter::Open takes the geometry only; pass q_pos, ctx_len and accepted "
        "to WriteStep"));
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot create trace directory ", dir, ": ", ec.message()));
  }
  SPIN_ASSIGN_OR_RETURN(
      NpyWriter scores,
      NpyWriter::Open(JoinPath(dir, "scores.npy"), {meta.steps, meta.layers, meta.rows, n_max}));
  TraceWriter writer;
  writer.dir_ = dir;
  writer.meta_ = meta;
  writer.n_max_ = n_max;
  writer.scores_ = std::move(scores);
  return writer;
}

absl::Status TraceWriter::WriteStep(const float* scores, int32_t q_pos, int32_t ctx_len,
                                    int32_t accepted) {
  if (!scores_.is_open()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "trace ", dir_, ": WriteStep on a writer that is closed or had a failed write"));
  }
  const int t = steps_written();
  if (t >= meta_.steps) {
    return absl::OutOfRangeError(
        absl::StrCat("trace ", dir_, ": all ", meta_.steps, " steps were already written"));
  }
  if (t > 0 && (accepted >= 0) != !meta_.accepted.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("trace ", dir_, ": step ", t,
                     " differs from step 0 in giving 'accepted'; give it on every step or none"));
  }
  const int64_t count = int64_t{meta_.layers} * meta_.rows * n_max_;
  SPIN_RETURN_IF_ERROR(scores_.Write(scores, count));
  meta_.q_pos.push_back(q_pos);
  meta_.ctx_len.push_back(ctx_len);
  if (accepted >= 0) meta_.accepted.push_back(accepted);
  return absl::OkStatus();
}

absl::Status TraceWriter::Close() {
  const std::string where = absl::StrCat("trace ", dir_);
  if (!scores_.is_open()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": Close on a writer that is closed or had a failed write"));
  }
  NpyWriter scores = std::move(scores_);  // whatever happens, this writer is done
  if (steps_written() != meta_.steps) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": closed after ", steps_written(), " of ", meta_.steps, " steps"));
  }
  if (absl::Status s = ValidateTraceMeta(meta_, n_max_); !s.ok()) return WithContext(s, where);
  const std::string meta_path = JoinPath(dir_, "meta.json");
  // Without meta.json the directory does not load, so no instant pairs old meta with new scores.
  if (::unlink(meta_path.c_str()) != 0 && errno != ENOENT) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot replace ", meta_path));
  }
  SPIN_RETURN_IF_ERROR(scores.Close());
  return WriteFileAtomically(meta_path, TraceMetaToJson(meta_));
}

TraceMeta TraceGeometry(TraceMeta meta) {
  meta.q_pos.clear();
  meta.ctx_len.clear();
  meta.accepted.clear();
  return meta;
}

absl::Status WriteTrace(const std::string& dir, const TraceMeta& meta, int64_t n_max,
                        const float* scores) {
  if (meta.q_pos.size() != static_cast<size_t>(meta.steps) ||
      meta.ctx_len.size() != static_cast<size_t>(meta.steps) ||
      (!meta.accepted.empty() && meta.accepted.size() != static_cast<size_t>(meta.steps))) {
    // Report the same message a loader would.
    absl::Status s = ValidateGeometry(meta, true);
    return WithContext(
        s.ok() ? absl::InvalidArgumentError("per-step arrays do not match steps") : s,
        absl::StrCat("trace ", dir));
  }
  SPIN_ASSIGN_OR_RETURN(TraceWriter writer, TraceWriter::Open(dir, TraceGeometry(meta), n_max));
  const int64_t step_floats = int64_t{meta.layers} * meta.rows * n_max;
  for (int t = 0; t < meta.steps; ++t) {
    SPIN_RETURN_IF_ERROR(writer.WriteStep(scores + t * step_floats, meta.q_pos[t], meta.ctx_len[t],
                                          meta.accepted.empty() ? -1 : meta.accepted[t]));
  }
  return writer.Close();
}

absl::Status CutTrace(const Trace& in, const std::string& out_dir, const TraceCut& cut) {
  const TraceMeta& m = in.meta();
  auto range = [](const char* what, int first, int count, int total) -> absl::Status {
    if (first < 0 || first >= total) {
      return absl::InvalidArgumentError(absl::StrCat(
          "first ", what, " ", first, " is outside the trace's ", what, "s 0-", total - 1));
    }
    if (count < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("a negative ", what, " count (", count, "); 0 keeps them to the end"));
    }
    if (count > total - first) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, "s ", first, "-", int64_t{first} + count - 1, " run past the trace's last ", what,
          ", ", total - 1, " (at most ", total - first, " from ", first, ")"));
    }
    return absl::OkStatus();
  };
  SPIN_RETURN_IF_ERROR(range("step", cut.first_step, cut.steps, m.steps));
  SPIN_RETURN_IF_ERROR(range("layer", cut.first_layer, cut.layers, m.layers));
  std::error_code ec;
  if (std::filesystem::equivalent(in.dir(), out_dir, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("the cut would replace the trace it reads (",
                                                   out_dir, "): give another directory"));
  }
  const int steps = cut.steps > 0 ? cut.steps : m.steps - cut.first_step;
  const int layers = cut.layers > 0 ? cut.layers : m.layers - cut.first_layer;
  TraceMeta geometry = TraceGeometry(m);
  geometry.steps = steps;
  geometry.layers = layers;
  SPIN_ASSIGN_OR_RETURN(TraceWriter writer, TraceWriter::Open(out_dir, geometry, in.n_max()));
  // A step's layers are contiguous in the trace: the kept ones are one run of floats.
  for (int i = 0; i < steps; ++i) {
    const int t = cut.first_step + i;
    SPIN_RETURN_IF_ERROR(writer.WriteStep(in.scores(t, cut.first_layer, 0), m.q_pos[t],
                                          m.ctx_len[t], m.accepted.empty() ? -1 : m.accepted[t]));
  }
  return writer.Close();
}

}  // namespace spin
