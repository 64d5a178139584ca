#include "convert.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "spin/numerics.h"
#include "spin/status_macros.h"

namespace spin {
namespace pb = spin::v1;

namespace {

double Ratio(uint64_t num, uint64_t den) {
  return den == 0 ? 0.0 : static_cast<double>(num) / static_cast<double>(den);
}

}  // namespace

absl::StatusOr<Geometry> FromProto(const pb::Geometry& p) {
  Geometry g;
  g.layers = p.layers();
  g.block_size = p.block_size();
  g.topk = p.topk();
  g.max_seqs = p.max_sequences();
  g.max_slots = p.max_slots();
  g.max_rows = p.max_rows();
  switch (p.state_dtype()) {
    case pb::STATE_DTYPE_FP32:
      g.dtype = StateDtype::kFp32;
      break;
    case pb::STATE_DTYPE_BF16:
      g.dtype = StateDtype::kBf16;
      break;
    default:
      return absl::InvalidArgumentError("geometry.state_dtype must be FP32 or BF16");
  }
  if (absl::Status s = ValidateGeometry(g); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("geometry: ", s.message()));
  }
  return g;
}

pb::Geometry ToProto(const Geometry& g) {
  pb::Geometry p;
  p.set_layers(g.layers);
  p.set_block_size(g.block_size);
  p.set_topk(g.topk);
  p.set_max_sequences(g.max_seqs);
  p.set_max_slots(g.max_slots);
  p.set_max_rows(g.max_rows);
  p.set_state_dtype(g.dtype == StateDtype::kBf16 ? pb::STATE_DTYPE_BF16 : pb::STATE_DTYPE_FP32);
  return p;
}

absl::StatusOr<BudgetMode> ModeFromProto(pb::BudgetMode m, BudgetMode keep) {
  switch (m) {
    case pb::BUDGET_MODE_UNSPECIFIED:
      return keep;
    case pb::BUDGET_MODE_UNIFORM:
      return BudgetMode::kUniform;
    case pb::BUDGET_MODE_PER_LAYER:
      return BudgetMode::kPerLayer;
    case pb::BUDGET_MODE_MISS_TARGET:
      return BudgetMode::kMissTarget;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown budget mode ", m));
  }
}

pb::BudgetMode ModeToProto(BudgetMode m) {
  switch (m) {
    case BudgetMode::kUniform:
      return pb::BUDGET_MODE_UNIFORM;
    case BudgetMode::kPerLayer:
      return pb::BUDGET_MODE_PER_LAYER;
    case BudgetMode::kMissTarget:
      return pb::BUDGET_MODE_MISS_TARGET;
  }
  return pb::BUDGET_MODE_UNSPECIFIED;
}

pb::Policy ToProto(const Policy& p) {
  pb::Policy o;
  o.set_target_sparsity(p.target_sparsity);
  o.set_exploration(p.exploration);
  o.set_alpha(p.alpha);
  o.set_probe_period(p.probe_period);
  o.set_budget_mode(ModeToProto(p.budget_mode));
  o.set_miss_target(p.miss_target);
  return o;
}

absl::StatusOr<Policy> FromProto(const pb::Policy& m) {
  Policy p;  // defaults for what the message leaves unset
  p.target_sparsity = m.target_sparsity();
  p.exploration = m.exploration();
  if (m.has_alpha()) p.alpha = m.alpha();
  p.probe_period = m.probe_period();
  SPIN_ASSIGN_OR_RETURN(p.budget_mode, ModeFromProto(m.budget_mode(), p.budget_mode));
  p.miss_target = m.miss_target();
  return p;
}

pb::LayerStats ToProto(uint32_t layer, const LayerStats& st, double sparsity_budget) {
  pb::LayerStats o;
  o.set_layer(layer);
  o.set_steps(st.steps);
  o.set_dense_steps(st.dense_steps);
  o.set_probe_steps(st.probe_steps);
  // Skipped / total blocks; 0 before any block was counted.
  o.set_realized_sparsity(st.sparse_blocks_total == 0
                              ? 0.0
                              : 1.0 - Ratio(st.sparse_blocks_kept, st.sparse_blocks_total));
  o.set_effective_sparsity(st.blocks_total == 0 ? 0.0
                                                : 1.0 - Ratio(st.blocks_kept, st.blocks_total));
  o.set_miss_rate(Ratio(st.probe_missed, st.probe_topk));
  o.set_bad_scores(st.bad_scores);
  o.set_observed(st.observed);
  o.set_sparsity_budget(sparsity_budget);
  o.set_blocks_kept(st.blocks_kept);
  o.set_blocks_total(st.blocks_total);
  o.set_sparse_blocks_kept(st.sparse_blocks_kept);
  o.set_sparse_blocks_total(st.sparse_blocks_total);
  o.set_probe_topk(st.probe_topk);
  o.set_probe_missed(st.probe_missed);
  o.set_explore_miss(ExploreMissRate(st.explore_est, st.explore_topk));
  o.set_explore_steps(st.explore_steps);
  o.set_explore_topk(st.explore_topk);
  o.set_explore_est(st.explore_est);
  return o;
}

LayerStats FromProto(const pb::LayerStats& l) {
  LayerStats m{};
  m.steps = l.steps();
  m.dense_steps = l.dense_steps();
  m.probe_steps = l.probe_steps();
  m.blocks_kept = l.blocks_kept();
  m.blocks_total = l.blocks_total();
  m.sparse_blocks_kept = l.sparse_blocks_kept();
  m.sparse_blocks_total = l.sparse_blocks_total();
  m.observed = l.observed();
  m.bad_scores = l.bad_scores();
  m.probe_topk = l.probe_topk();
  m.probe_missed = l.probe_missed();
  m.explore_steps = l.explore_steps();
  m.explore_topk = l.explore_topk();
  m.explore_est = l.explore_est();
  return m;
}

uint64_t RemoteStepMessageBytes(const Geometry& g, const StepBatch& batch) {
  // Framing per protobuf field: a 1-byte tag and a length varint of at most 5 bytes.
  constexpr uint64_t kField = 6, kVarint = 5, kFixed = 4, kSlack = 1024;
  const uint64_t max_blocks =
      (static_cast<uint64_t>(g.max_slots) + g.block_size - 1) / g.block_size;
  const uint64_t rows = static_cast<uint64_t>(std::max(batch.rows, 1));
  uint64_t masks = kSlack, scores = kSlack + kField + kVarint * std::max(batch.n, 0);
  for (int32_t e = 0; e < batch.n; ++e) {
    // The blocks an entry's rows can reach: its context plus one slot per further row.
    const int64_t ctx = std::max<int64_t>(batch.ctx_len[e], 0);
    const uint64_t reach = ctx == 0 ? 0 : static_cast<uint64_t>(ctx) + rows - 1;
    const uint64_t blocks = std::min(max_blocks, (reach + g.block_size - 1) / g.block_size);
    masks += kField + 2 * kField + kVarint * (blocks + rows);
    scores += rows * (2 * kField + kFixed * blocks * g.block_size);
  }
  return std::max(masks, scores);
}

}  // namespace spin
