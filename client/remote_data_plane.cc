#include "remote_data_plane.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "convert.h"
#include "grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "spin/data_plane_setup.h"
#include "spin/status_macros.h"

namespace spin::client {
namespace {

namespace pb = spin::v1;

template <typename Req, typename Resp, typename Fn>
absl::Status Call(Fn fn, const Req& req, Resp* resp, const char* what) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return FromGrpc(fn(&ctx, req, resp), what);
}

}  // namespace

absl::StatusOr<std::unique_ptr<RemoteDataPlane>> RemoteDataPlane::Create(pb::Spin::Stub* stub,
                                                                         std::string session_id,
                                                                         std::string token,
                                                                         const Geometry& g) {
  std::unique_ptr<RemoteDataPlane> r(new RemoteDataPlane());
  r->stub_ = stub;
  r->id_ = std::move(session_id);
  r->token_ = std::move(token);
  SPIN_ASSIGN_OR_RETURN(r->local_, NewDataPlane({.geometry = g}));
  r->mirror_ = r->local_->arena();
  return r;
}

RemoteDataPlane::~RemoteDataPlane() = default;

pb::SessionRef RemoteDataPlane::Ref() const {
  pb::SessionRef r;
  r.set_session_id(id_);
  r.set_token(token_);
  return r;
}

absl::Status RemoteDataPlane::ResetSequence(int32_t seq, uint64_t key, cudaStream_t) {
  pb::OpenSequencesRequest req;
  *req.mutable_session() = Ref();
  pb::SequenceOpen* o = req.add_sequences();
  o->set_sequence(seq);
  o->set_key(key);
  pb::OpenSequencesResponse resp;
  return Call([this](auto* c, const auto& q, auto* p) { return stub_->OpenSequences(c, q, p); },
              req, &resp, "OpenSequences");
}

absl::Status RemoteDataPlane::BeginStep(const StepBatch& batch, cudaStream_t) {
  // The batch's shape is checked like every backend's before it is copied (spind checks the
  // entries when the step reaches it, at the first Select). spind fills no physical table for a
  // remote-mode engine (Select's tables are not sent), so the table is not used further.
  SPIN_RETURN_IF_ERROR(ValidateStepShape(mirror_, batch));
  seq_.assign(batch.seq, batch.seq + batch.n);
  ctx_.assign(batch.ctx_len, batch.ctx_len + batch.n);
  q_.assign(batch.q_pos, batch.q_pos + batch.n);
  rows_ = batch.rows;
  pending_begin_ = true;
  return absl::OkStatus();
}

absl::Status RemoteDataPlane::RefreshStats() {
  pb::GetStatsRequest req;
  *req.mutable_session() = Ref();
  pb::GetStatsResponse resp;
  SPIN_RETURN_IF_ERROR(
      Call([this](auto* c, const auto& q, auto* p) { return stub_->GetStats(c, q, p); }, req, &resp,
           "GetStats"));
  for (const pb::LayerStats& l : resp.layers()) {
    if (l.layer() >= mirror_.geometry.layers) continue;
    mirror_.stats[l.layer()] = FromProto(l);
  }
  return absl::OkStatus();
}

absl::Status RemoteDataPlane::Select(int32_t layer, const int32_t*, int64_t, cudaStream_t) {
  pb::PredictMasksRequest req;
  *req.mutable_session() = Ref();
  req.set_layer(layer);
  if (pending_begin_) {
    req.set_begin_step(true);
    req.set_rows(static_cast<uint32_t>(rows_));
    for (size_t e = 0; e < seq_.size(); ++e) {
      pb::StepEntry* en = req.add_entries();
      en->set_sequence(seq_[e]);
      en->set_ctx_len(ctx_[e]);
      en->set_q_pos(q_[e]);
    }
  }
  pb::PredictMasksResponse resp;
  SPIN_RETURN_IF_ERROR(
      Call([this](auto* c, const auto& q, auto* p) { return stub_->PredictMasks(c, q, p); }, req,
           &resp, "PredictMasks"));
  pending_begin_ = false;
  // Mirror the step and its outputs, once they are known to fit the mirror (a data plane made
  // with another geometry than the session's would write past its arrays).
  const int32_t n = resp.masks_size();
  const Geometry& g = mirror_.geometry;
  if (static_cast<uint32_t>(n) > g.max_seqs) {
    return absl::FailedPreconditionError(
        absl::StrCat("spind's selection has ", n, " entries; this data plane's geometry holds ",
                     g.max_seqs, ": create it with the session's geometry"));
  }
  for (int32_t e = 0; e < n; ++e) {
    const pb::EntryMask& m = resp.masks(e);
    if (static_cast<uint32_t>(m.blocks_size()) > mirror_.max_blocks ||
        static_cast<uint32_t>(m.compact_len_size()) > g.max_rows) {
      return absl::FailedPreconditionError(
          absl::StrCat("spind's selection of entry ", e, " (", m.blocks_size(), " blocks, ",
                       m.compact_len_size(), " rows) does not fit this data plane's geometry (",
                       mirror_.max_blocks, " blocks, ", g.max_rows,
                       " rows): create it with the session's geometry"));
    }
  }
  mirror_.batch->n = n;
  mirror_.batch->rows = rows_;
  mirror_.batch->selected_layer = layer;
  for (int32_t e = 0; e < n; ++e) {
    mirror_.entries[e].seq = e < static_cast<int32_t>(seq_.size()) ? seq_[e] : -1;
    const pb::EntryMask& m = resp.masks(e);
    mirror_.union_count[e] = m.blocks_size();
    int32_t* ids = mirror_.union_ids + static_cast<int64_t>(e) * mirror_.max_blocks;
    std::copy(m.blocks().begin(), m.blocks().end(), ids);
    int32_t* clen = mirror_.compact_len + static_cast<int64_t>(e) * mirror_.geometry.max_rows;
    std::copy(m.compact_len().begin(), m.compact_len().end(), clen);
  }
  return RefreshStats();
}

absl::Status RemoteDataPlane::Remap(int32_t* idx, int32_t count, cudaStream_t) {
  return local_->Remap(idx, count);
}

absl::Status RemoteDataPlane::RemapAndObserve(int32_t layer, int32_t* idx, int32_t count,
                                              const float* logits, int64_t stride,
                                              const int32_t* accepted, cudaStream_t) {
  SPIN_RETURN_IF_ERROR(
      ValidateObserveCall(mirror_, "RemapAndObserve", layer, logits, stride, accepted));
  SPIN_RETURN_IF_ERROR(ValidateTopKBuffer(idx, count));
  SPIN_RETURN_IF_ERROR(local_->Remap(idx, count));
  return SendScores(layer, logits, stride, accepted);
}

absl::Status RemoteDataPlane::Observe(int32_t layer, const float* logits, int64_t stride,
                                      const int32_t* accepted, cudaStream_t) {
  SPIN_RETURN_IF_ERROR(ValidateObserveCall(mirror_, "Observe", layer, logits, stride, accepted));
  return SendScores(layer, logits, stride, accepted);
}

absl::Status RemoteDataPlane::SendScores(int32_t layer, const float* logits, int64_t stride,
                                         const int32_t* accepted) {
  pb::ObserveScoresRequest req;
  *req.mutable_session() = Ref();
  req.set_layer(layer);
  const int32_t n = mirror_.batch->n, rows = mirror_.batch->rows;
  for (int32_t e = 0; e < n; ++e) {
    for (int32_t r = 0; r < rows; ++r) {
      const int32_t len =
          mirror_.compact_len[static_cast<int64_t>(e) * mirror_.geometry.max_rows + r];
      const float* z = logits + (static_cast<int64_t>(e) * rows + r) * stride;
      req.add_scores()->mutable_logits()->Add(z, z + len);
    }
    if (accepted) req.add_accepted(accepted[e]);
  }
  pb::ObserveScoresResponse resp;
  SPIN_RETURN_IF_ERROR(
      Call([this](auto* c, const auto& q, auto* p) { return stub_->ObserveScores(c, q, p); }, req,
           &resp, "ObserveScores"));
  return RefreshStats();
}

}  // namespace spin::client
