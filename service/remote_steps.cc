#include "remote_steps.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "convert.h"
#include "spin/row_topk.h"
#include "spin/status_macros.h"

namespace spin::service {
namespace {

namespace pb = spin::v1;

// Remote mode: the current step's outputs as read back from the arena, checked against the
// step spind began and the session's geometry before any of them is used as a size or index.
absl::Status CheckRemoteOutputs(const Session& s) {
  const ArenaView& v = s.arena->host();
  const Geometry& g = s.geometry;
  if (v.batch->n != s.remote_n || v.batch->rows != s.remote_rows) {
    return absl::InternalError(absl::StrCat("session ", s.id, ": the arena's step (", v.batch->n,
                                            " entries x ", v.batch->rows,
                                            " rows) is not the one spind began (", s.remote_n,
                                            " x ", s.remote_rows, "); detach and attach again"));
  }
  const int64_t max_len = static_cast<int64_t>(v.max_blocks) * g.block_size;
  for (int32_t e = 0; e < s.remote_n; ++e) {
    const int64_t count = v.union_count[e];
    if (count < 0 || count > v.max_blocks) {
      return absl::InternalError(absl::StrCat("session ", s.id, ": entry ", e, " has ", count,
                                              " selected blocks, outside [0, ", v.max_blocks,
                                              "]; detach and attach again"));
    }
    const int32_t* ids = v.union_ids + static_cast<int64_t>(e) * v.max_blocks;
    for (int64_t k = 0; k < count; ++k) {
      if (ids[k] < 0 || static_cast<uint32_t>(ids[k]) >= v.max_blocks) {
        return absl::InternalError(absl::StrCat("session ", s.id, ": entry ", e, " selects block ",
                                                ids[k], ", outside [0, ", v.max_blocks,
                                                "); detach and attach again"));
      }
    }
    for (int32_t r = 0; r < s.remote_rows; ++r) {
      const int64_t len = v.compact_len[static_cast<int64_t>(e) * g.max_rows + r];
      if (len < 0 || len > max_len) {
        return absl::InternalError(absl::StrCat("session ", s.id, ": entry ", e, " row ", r,
                                                " has compacted length ", len, ", outside [0, ",
                                                max_len, "]; detach and attach again"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status OpenRemoteSequences(SessionManager& sessions, Session& s,
                                 const pb::OpenSequencesRequest& req) {
  SPIN_RETURN_IF_ERROR(sessions.CheckBind(s, DriveMode::kRemote));
  const uint32_t max = s.geometry.max_seqs;
  if (static_cast<uint64_t>(req.sequences_size()) > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(req.sequences_size(), " sequences exceed the session's max_sequences ", max));
  }
  std::vector<uint8_t> seen(max, 0);
  for (const pb::SequenceOpen& o : req.sequences()) {
    if (o.sequence() < 0 || static_cast<uint32_t>(o.sequence()) >= max) {
      return absl::OutOfRangeError(
          absl::StrCat("sequence ", o.sequence(), " is out of range [0, ", max, ")"));
    }
    if (seen[o.sequence()]++) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", o.sequence(), " appears twice in the request"));
    }
  }
  SPIN_RETURN_IF_ERROR(sessions.Bind(s, DriveMode::kRemote));
  for (const pb::SequenceOpen& o : req.sequences()) {
    SPIN_RETURN_IF_ERROR(s.arena->ResetSequence(o.sequence(), o.key()));
  }
  return absl::OkStatus();
}

absl::Status PredictRemoteMasks(SessionManager& sessions, Session& s,
                                const pb::PredictMasksRequest& req, pb::PredictMasksResponse* resp,
                                const std::function<void(Session&)>& before_step) {
  SPIN_RETURN_IF_ERROR(sessions.CheckBind(s, DriveMode::kRemote));
  const Geometry& g = s.geometry;
  if (req.layer() < 0 || static_cast<uint32_t>(req.layer()) >= g.layers) {
    return absl::OutOfRangeError(
        absl::StrCat("layer ", req.layer(), " is out of range [0, ", g.layers, ")"));
  }
  if (req.begin_step()) {
    if (static_cast<uint64_t>(req.entries_size()) > g.max_seqs) {
      return absl::InvalidArgumentError(absl::StrCat(
          req.entries_size(), " entries exceed the session's max_sequences ", g.max_seqs));
    }
    if (req.rows() < 1 || req.rows() > g.max_rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("rows ", req.rows(), " is out of range [1, ", g.max_rows, "]"));
    }
  } else if (s.remote_rows == 0) {
    return absl::FailedPreconditionError(
        "PredictMasks without begin_step needs a step begun earlier: set begin_step on the "
        "step's first call");
  }
  std::vector<int32_t> seq, ctx_len, q_pos;
  if (req.begin_step()) {
    seq.reserve(req.entries_size());
    ctx_len.reserve(req.entries_size());
    q_pos.reserve(req.entries_size());
    for (const pb::StepEntry& e : req.entries()) {
      seq.push_back(e.sequence());
      ctx_len.push_back(e.ctx_len());
      q_pos.push_back(e.q_pos());
    }
  }
  const StepBatch batch{seq.data(), ctx_len.data(), q_pos.data(), static_cast<int32_t>(seq.size()),
                        static_cast<int32_t>(req.rows())};
  if (req.begin_step()) {
    // Everything a refused step could trip on is checked before the session is bound to
    // remote mode or its arena touched: a refused call changes nothing.
    SPIN_RETURN_IF_ERROR(s.arena->CheckStep(batch));
    const uint64_t bytes = RemoteStepMessageBytes(g, batch);
    if (bytes > static_cast<uint64_t>(kMaxMessageBytes)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this step's masks or scores could take up to ", bytes, " bytes in one message (",
          batch.n, " entries x ", batch.rows, " rows), over remote mode's ", kMaxMessageBytes,
          "-byte message limit: send fewer entries per step, or map the arena (local mode)"));
    }
  }
  SPIN_RETURN_IF_ERROR(sessions.Bind(s, DriveMode::kRemote));
  if (req.begin_step()) {
    if (before_step) before_step(s);
    SPIN_RETURN_IF_ERROR(s.arena->BeginStep(batch));
    s.remote_n = batch.n;
    s.remote_rows = batch.rows;
    s.remote_selected = false;
  }
  SPIN_RETURN_IF_ERROR(s.arena->Select(req.layer()));
  SPIN_RETURN_IF_ERROR(s.arena->PullOutputs());
  SPIN_RETURN_IF_ERROR(CheckRemoteOutputs(s));
  s.remote_selected = true;
  const ArenaView& v = s.arena->host();
  for (int32_t e = 0; e < s.remote_n; ++e) {
    pb::EntryMask* m = resp->add_masks();
    const int32_t* ids = v.union_ids + static_cast<int64_t>(e) * v.max_blocks;
    m->mutable_blocks()->Add(ids, ids + v.union_count[e]);
    const int32_t* clen = v.compact_len + static_cast<int64_t>(e) * g.max_rows;
    m->mutable_compact_len()->Add(clen, clen + s.remote_rows);
  }
  return absl::OkStatus();
}

absl::Status ObserveRemoteScores(SessionManager& sessions, Session& s,
                                 const pb::ObserveScoresRequest& req,
                                 pb::ObserveScoresResponse* resp) {
  SPIN_RETURN_IF_ERROR(sessions.CheckBind(s, DriveMode::kRemote));
  const Geometry& g = s.geometry;
  if (req.layer() < 0 || static_cast<uint32_t>(req.layer()) >= g.layers) {
    return absl::OutOfRangeError(
        absl::StrCat("layer ", req.layer(), " is out of range [0, ", g.layers, ")"));
  }
  if (!s.remote_selected) {
    return absl::FailedPreconditionError(
        "ObserveScores needs a PredictMasks of the current step first");
  }
  SPIN_RETURN_IF_ERROR(sessions.Bind(s, DriveMode::kRemote));
  ArenaStorage& arena = *s.arena;
  absl::Status pulled = arena.PullOutputs();
  if (pulled.ok()) pulled = arena.PullControl();
  SPIN_RETURN_IF_ERROR(pulled);
  SPIN_RETURN_IF_ERROR(CheckRemoteOutputs(s));
  const ArenaView& v = arena.host();
  // Everything below is sized from spind's own copy of the step and the compacted lengths
  // it checked, never from the request: the request is checked against them first.
  const int64_t n = s.remote_n, rows = s.remote_rows;
  if (req.scores_size() != n * rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scores has ", req.scores_size(), " rows; the step has ", n, " entries x ", rows, " rows"));
  }
  if (req.accepted_size() != 0 && req.accepted_size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("accepted has ", req.accepted_size(), " values for ", n, " entries"));
  }
  const int64_t max_len = static_cast<int64_t>(v.max_blocks) * g.block_size;
  int64_t stride = 1;
  for (int64_t x = 0; x < n * rows; ++x) {
    const int64_t have = req.scores(static_cast<int>(x)).logits_size();
    const bool live = v.entries[x / rows].seq >= 0;
    const int64_t need = live ? v.compact_len[(x / rows) * g.max_rows + x % rows] : 0;
    if (have < need) {
      return absl::InvalidArgumentError(absl::StrCat("scores of entry ", x / rows, " row ",
                                                     x % rows, " have ", have,
                                                     " values; its compacted length is ", need));
    }
    if (have > max_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("scores of entry ", x / rows, " row ", x % rows, " have ", have,
                       " values; no compacted row of this session is longer than ", max_len));
    }
    stride = std::max(stride, need);
  }
  if (n * rows * stride > kMaxObserveFloats) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this step's logits (", n, " entries x ", rows, " rows x ", stride,
        " slots) exceed what remote mode assembles in one call (", kMaxObserveFloats,
        " floats): run the data plane locally (fetch the arena) for steps this large"));
  }
  std::vector<float> logits(static_cast<size_t>(n * rows * stride), -INFINITY);
  for (int64_t x = 0; x < n * rows; ++x) {
    const pb::RowScores& r = req.scores(static_cast<int>(x));
    const int64_t take = std::min<int64_t>(r.logits_size(), stride);
    std::copy(r.logits().begin(), r.logits().begin() + take, logits.begin() + x * stride);
  }
  std::vector<int32_t> accepted(req.accepted().begin(), req.accepted().end());
  auto bad_total = [&v, &g] {
    uint64_t b = 0;
    for (uint32_t l = 0; l < g.layers; ++l) b += v.stats[l].bad_scores;
    return b;
  };
  const uint64_t bad_before = bad_total();
  // The engine's top-K, as an engine that maps the arena gives it (RemapAndObserve): each live
  // entry's row-0 top-K over its compacted logits (RowTopKHost: ties to the lower index; a
  // non-finite score is never in it, as offline replay's TopKSlots), so a probe counts it and a
  // sparse step's exploration blocks measure the step's miss, which the miss-target controller
  // needs between probes. Remote sessions had no such measurement before 2026-12-07
  // (docs/spind.md, "Remote mode"). Above kRowTopKMaxK (no DSA model) Observe computes the
  // probe's top-K alone and sparse steps go unmeasured.
  const int32_t k = static_cast<int32_t>(g.topk);
  std::vector<int32_t> topk;
  if (k <= kRowTopKMaxK) {
    std::vector<int32_t> lens(static_cast<size_t>(n * rows), 0);
    for (int64_t e = 0; e < n; ++e) {
      if (v.entries[e].seq < 0) continue;
      lens[e * rows] = v.compact_len[e * g.max_rows];
      // RowTopKHost ranks NaN last but +inf first: every non-finite score becomes NaN, which
      // Observe skips and counts exactly as it does any non-finite score.
      float* z = logits.data() + e * rows * stride;
      for (int64_t c = 0; c < lens[e * rows]; ++c) {
        if (!std::isfinite(z[c])) z[c] = NAN;
      }
    }
    topk.assign(static_cast<size_t>(n * rows * k), -1);
    RowTopKArgs t{.logits = logits.data(),
                  .logits_stride = stride,
                  .width = stride,
                  .lens = lens.data(),
                  .rows = static_cast<int32_t>(n * rows),
                  .k = k,
                  .out = topk.data(),
                  .out_stride = k};
    SPIN_RETURN_IF_ERROR(RowTopKHost(t));
    for (int64_t x = 0; x < n * rows; x += rows) {
      for (int32_t j = 0; j < k; ++j) {
        int32_t& c = topk[x * k + j];
        if (c >= 0 && !std::isfinite(logits[x * stride + c])) c = -1;
      }
    }
  }
  if (absl::Status st = arena.Observe(req.layer(), logits.data(), stride,
                                      accepted.empty() ? nullptr : accepted.data(),
                                      topk.empty() ? nullptr : topk.data(), k);
      !st.ok()) {
    return st;
  }
  SPIN_RETURN_IF_ERROR(arena.PullControl());
  resp->set_bad_scores(bad_total() - bad_before);
  return absl::OkStatus();
}

}  // namespace spin::service
