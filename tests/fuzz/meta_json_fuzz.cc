// libFuzzer target: meta.json parsing and validation (tools/trace/trace.cc). The input is the text
// of a meta.json.
//
// Properties checked, besides "no crash, no sanitizer report":
//  - errors are one line that names the file;
//  - an accepted meta.json survives TraceMetaToJson -> ParseTraceMeta unchanged;
//  - when ValidateTraceMeta accepts it for some N_max, the data plane's ValidateGeometry accepts
//    the arena geometry replay would build for it (so trace-stats and replay agree).
#include <algorithm>
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "replay.h"
#include "spin/arena.h"
#include "trace.h"

namespace {

bool SameMeta(const spin::TraceMeta& a, const spin::TraceMeta& b) {
  return a.version == b.version && a.layers == b.layers && a.block_size == b.block_size &&
         a.topk == b.topk && a.steps == b.steps && a.rows == b.rows && a.q_pos == b.q_pos &&
         a.ctx_len == b.ctx_len && a.accepted == b.accepted;
}

void CheckOneLine(const absl::Status& s, const std::string& source) {
  FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument, "%s", s.ToString().c_str());
  FUZZ_CHECK(s.message().find('\n') == absl::string_view::npos, "not one line: %s",
             s.ToString().c_str());
  FUZZ_CHECK(s.message().substr(0, source.size()) == source, "does not name the file: %s",
             s.ToString().c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source = "t/meta.json";
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<spin::TraceMeta> meta = spin::ParseTraceMeta(text, source);
  if (!meta.ok()) {
    CheckOneLine(meta.status(), source);
    return 0;
  }
  const std::string json = spin::TraceMetaToJson(*meta);
  absl::StatusOr<spin::TraceMeta> again = spin::ParseTraceMeta(json, source);
  FUZZ_CHECK(again.ok(), "TraceMetaToJson's output is rejected: %s\n  %s",
             again.status().ToString().c_str(), json.c_str());
  FUZZ_CHECK(SameMeta(*meta, *again), "round trip changed the metadata: %s", json.c_str());

  // Validation against a few scores widths: the smallest, the one the steps need, the largest.
  int64_t needed = 1;
  for (size_t t = 0; t < meta->ctx_len.size() && t < meta->q_pos.size(); ++t) {
    needed = std::max<int64_t>(needed, int64_t{meta->ctx_len[t]} + meta->rows - 1);
    needed = std::max<int64_t>(needed, int64_t{meta->q_pos[t]} + meta->rows);
  }
  for (int64_t n_max : {int64_t{1}, needed, int64_t{spin::kTraceMaxSlots}}) {
    const absl::Status valid = spin::ValidateTraceMeta(*meta, n_max);
    if (!valid.ok()) {
      FUZZ_CHECK(valid.message().find('\n') == absl::string_view::npos, "not one line: %s",
                 valid.ToString().c_str());
      continue;
    }
    const spin::Geometry g = spin::TraceGeometry(*meta, n_max, spin::StateDtype::kFp32);
    const absl::Status plane = spin::ValidateGeometry(g);
    FUZZ_CHECK(plane.ok(), "the trace validates but the data plane rejects its geometry: %s",
               plane.ToString().c_str());
  }
  return 0;
}
