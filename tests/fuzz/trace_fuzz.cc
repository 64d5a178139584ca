// libFuzzer target: the whole trace reader, as every spinctl command that reads a trace runs it
// (LoadTrace, then trace-stats' ComputeTraceStats, trace-cut's CutTrace and replay's Replay on
// the loaded trace).
//
// Input: a trace directory, written from the bytes before each run:
//   byte 0      what meta.json is: bits 0-2, 0-4 a regular file, 5 missing, 6 a FIFO,
//               7 a directory; bit 6 set: replay with per-layer budgets (probe period 2);
//               bit 7 set: replay with bf16 state; bits 3-4 and 5-6: trace-cut's first step
//               and step count (0: to the end)
//   byte 1      what scores.npy is, the same way in bits 0-2; bit 3 set: a symlink to the file;
//               bit 4: trace-cut keeps layer 0 only (else all)
//   bytes 2-3   meta.json's length L (little endian; clamped to what is left)
//   L bytes     meta.json
//   the rest    scores.npy
//
// Properties checked, besides "no crash, no hang (libFuzzer's -timeout), no sanitizer report":
//  - a FIFO or a directory in place of either file is an error, never a wait;
//  - errors are one line;
//  - a trace that loads passes the data plane's ValidateGeometry, its scores can all be read,
//    trace-stats and replay run on it without error (replay is skipped above 64 MiB of arena and
//    top-K buffers);
//  - trace-cut of it writes a trace that loads with the sliced geometry and the same score bits
//    when the range is inside it, and is refused with one line otherwise.
// LLVMFuzzerInitialize also checks that trace.h's limits are exactly the data plane's: each
// limit passes ValidateGeometry and one more fails.
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "fuzz_common.h"
#include "gen_trace.h"
#include "replay.h"
#include "spin/arena.h"
#include "trace.h"

namespace {

using spin::fuzz::ScratchDir;

enum class Kind { kRegular, kMissing, kFifo, kDirectory };

Kind KindOf(uint8_t bits) {
  switch (bits & 7) {
    case 5:
      return Kind::kMissing;
    case 6:
      return Kind::kFifo;
    case 7:
      return Kind::kDirectory;
    default:
      return Kind::kRegular;
  }
}

void RemoveAny(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

// Puts `kind` at `path`, with `bytes` as the contents of a regular file.
void Place(const std::string& path, Kind kind, const uint8_t* bytes, size_t len, bool symlink) {
  RemoveAny(path);
  switch (kind) {
    case Kind::kMissing:
      return;
    case Kind::kFifo:
      FUZZ_CHECK(::mkfifo(path.c_str(), 0644) == 0, "mkfifo %s", path.c_str());
      return;
    case Kind::kDirectory:
      FUZZ_CHECK(::mkdir(path.c_str(), 0755) == 0, "mkdir %s", path.c_str());
      return;
    case Kind::kRegular:
      if (symlink) {
        const std::string target = path + ".target";
        spin::fuzz::WriteFileOrDie(target, bytes, len);
        FUZZ_CHECK(::symlink(target.c_str(), path.c_str()) == 0, "symlink %s", path.c_str());
      } else {
        spin::fuzz::WriteFileOrDie(path, bytes, len);
      }
      return;
  }
}

spin::Geometry At(uint32_t layers, uint32_t block, uint32_t topk, uint32_t slots, uint32_t rows) {
  spin::Geometry g;
  g.layers = layers;
  g.max_seqs = 1;
  g.max_slots = slots;
  g.block_size = block;
  g.topk = topk;
  g.max_rows = rows;
  g.dtype = spin::StateDtype::kFp32;
  return g;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using spin::ValidateGeometry;
  const int L = spin::kTraceMaxLayers, B = spin::kTraceMaxBlockSize, R = spin::kTraceMaxRows,
            N = spin::kTraceMaxSlots;
  FUZZ_CHECK(ValidateGeometry(At(L, B, N, N, R)).ok(), "trace.h's limits exceed the data plane's");
  FUZZ_CHECK(!ValidateGeometry(At(L + 1, 1, 1, 1, 1)).ok(), "layer limit below the data plane's");
  FUZZ_CHECK(!ValidateGeometry(At(1, B + 1, 1, 1, 1)).ok(), "block limit below the data plane's");
  FUZZ_CHECK(!ValidateGeometry(At(1, 1, N + 1, 1, 1)).ok(), "topk limit below the data plane's");
  FUZZ_CHECK(!ValidateGeometry(At(1, 1, 1, N + 1, 1)).ok(), "slot limit below the data plane's");
  FUZZ_CHECK(!ValidateGeometry(At(1, 1, 1, 1, R + 1)).ok(), "row limit below the data plane's");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = ScratchDir() + "/trace";
  static const bool made = ::mkdir(dir.c_str(), 0755) == 0;
  FUZZ_CHECK(made, "mkdir %s", dir.c_str());
  if (size < 4) return -1;  // not a trace input; keep it out of the corpus
  const uint8_t meta_bits = data[0], scores_bits = data[1];
  size_t meta_len = data[2] | (size_t{data[3]} << 8);
  data += 4;
  size -= 4;
  if (meta_len > size) meta_len = size;
  const Kind meta_kind = KindOf(meta_bits), scores_kind = KindOf(scores_bits);
  Place(dir + "/meta.json", meta_kind, data, meta_len, false);
  Place(dir + "/scores.npy", scores_kind, data + meta_len, size - meta_len, (scores_bits & 8) != 0);

  absl::StatusOr<spin::Trace> trace = spin::LoadTrace(dir);
  if (!trace.ok()) {
    FUZZ_CHECK(trace.status().message().find('\n') == absl::string_view::npos, "not one line: %s",
               trace.status().ToString().c_str());
    return 0;
  }
  FUZZ_CHECK(meta_kind == Kind::kRegular && scores_kind == Kind::kRegular,
             "a trace loaded from a missing file, a FIFO or a directory");
  const spin::TraceMeta& m = trace->meta();
  const spin::Geometry g = spin::TraceGeometry(m, trace->n_max(), spin::StateDtype::kFp32);
  const absl::Status plane = spin::ValidateGeometry(g);
  FUZZ_CHECK(plane.ok(), "LoadTrace accepted a trace the data plane rejects: %s",
             plane.ToString().c_str());

  // Every score is readable (ASan checks the mapping's bounds through the accessor).
  double sum = 0;
  for (int t = 0; t < m.steps; ++t) {
    for (int l = 0; l < m.layers; ++l) {
      for (int r = 0; r < m.rows; ++r) {
        const float* row = trace->scores(t, l, r);
        for (int64_t i = 0; i < trace->n_max(); ++i) sum += std::isfinite(row[i]) ? row[i] : 0;
      }
    }
  }
  (void)sum;

  // trace-stats.
  if (m.steps >= 2) {
    absl::StatusOr<spin::TraceStats> stats = spin::ComputeTraceStats(*trace);
    FUZZ_CHECK(stats.ok(), "trace-stats failed on a loaded trace: %s",
               stats.status().ToString().c_str());
    (void)spin::FormatTraceStats(*stats);
  }

  // trace-cut, over a range from the input's bits (bits 3-6 of meta_bits: the first step and
  // count; bit 4 of scores_bits: one layer or all): in range it writes a trace that loads with
  // the sliced geometry and the same score bits; out of range it is refused with one line.
  {
    const spin::TraceCut cut{(meta_bits >> 3) & 3, (meta_bits >> 5) & 3, 0, (scores_bits >> 4) & 1};
    const bool in_range = cut.first_step < m.steps && cut.steps <= m.steps - cut.first_step;
    static const std::string out = ScratchDir() + "/trace-cut";
    const absl::Status s = spin::CutTrace(*trace, out, cut);
    FUZZ_CHECK(s.ok() == in_range, "trace-cut of steps %d+%d of %d: %s", cut.first_step, cut.steps,
               m.steps, s.ToString().c_str());
    if (s.ok()) {
      absl::StatusOr<spin::Trace> part = spin::LoadTrace(out);
      FUZZ_CHECK(part.ok(), "a cut does not load: %s", part.status().ToString().c_str());
      const int steps = cut.steps > 0 ? cut.steps : m.steps - cut.first_step;
      const int layers = cut.layers > 0 ? cut.layers : m.layers;
      FUZZ_CHECK(part->meta().steps == steps && part->meta().layers == layers &&
                     part->meta().rows == m.rows && part->n_max() == trace->n_max(),
                 "a cut has the wrong geometry");
      for (int t = 0; t < steps; ++t) {
        FUZZ_CHECK(part->meta().ctx_len[t] == m.ctx_len[cut.first_step + t], "ctx_len not sliced");
        FUZZ_CHECK(std::memcmp(part->scores(t, 0, 0), trace->scores(cut.first_step + t, 0, 0),
                               sizeof(float) * layers * m.rows * trace->n_max()) == 0,
                   "a cut's scores differ from the trace's");
      }
    } else {
      FUZZ_CHECK(s.message().find('\n') == absl::string_view::npos, "not one line: %s",
                 s.ToString().c_str());
    }
  }

  // replay (CPU), on arenas of reasonable size.
  spin::ReplayOptions o;
  o.dtype = (meta_bits & 0x80) ? spin::StateDtype::kBf16 : spin::StateDtype::kFp32;
  if (meta_bits & 0x40) {
    o.policy.budget_mode = spin::BudgetMode::kPerLayer;
    o.policy.probe_period = 2;
  }
  const uint64_t arena = spin::ArenaBytes(spin::TraceGeometry(m, trace->n_max(), o.dtype));
  const uint64_t topk_buffers = uint64_t{4} * static_cast<uint64_t>(m.rows) * m.topk;
  if (arena + topk_buffers <= (uint64_t{64} << 20)) {
    absl::StatusOr<spin::ReplaySummary> sum_or = spin::Replay(*trace, o);
    FUZZ_CHECK(sum_or.ok(), "replay failed on a loaded trace: %s",
               sum_or.status().ToString().c_str());
    (void)spin::SummaryJson(*sum_or);
  }
  return 0;
}
