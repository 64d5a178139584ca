#include "spin/arena.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "spin/numerics.h"
#include "spin/status_macros.h"

namespace spin {
namespace {

uint64_t AlignUp(uint64_t x) { return (x + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }

// Section offsets and the total size, computed one way for InitArena, ViewArena and ArenaBytes.
struct Layout {
  uint64_t off_policy, off_sparsity, off_stats, off_curves, off_seqs, off_fresh, off_state,
      off_vsum, off_batch, off_union_count, off_union, off_phys, off_compact_len, off_scratch,
      off_mask, off_error, total;
};

Layout ComputeLayout(const Geometry& g) {
  const uint64_t L = g.layers, S = g.max_seqs, N = g.max_slots, R = g.max_rows;
  const uint64_t MB = CeilDiv(g.max_slots, g.block_size);
  Layout l{};
  uint64_t at = AlignUp(sizeof(ArenaHeader));
  auto take = [&at](uint64_t bytes) {
    const uint64_t off = at;
    at = AlignUp(at + bytes);
    return off;
  };
  l.off_policy = take(sizeof(ArenaPolicy));
  l.off_sparsity = take(L * sizeof(double));
  l.off_stats = take(L * sizeof(LayerStats));
  l.off_curves = take(L * kCurvePoints * sizeof(uint64_t));
  l.off_seqs = take(S * sizeof(SeqRecord));
  l.off_fresh = take(S * L);
  l.off_state = take(S * L * 2 * N * StateBytes(g.dtype));
  l.off_vsum = take(S * L * MB * sizeof(float));
  l.off_batch = take(sizeof(BatchHeader) + S * sizeof(StepEntry));
  l.off_union_count = take(S * sizeof(int32_t));
  l.off_union = take(S * MB * sizeof(int32_t));
  l.off_phys = take(S * MB * sizeof(int32_t));
  l.off_compact_len = take(S * R * sizeof(int32_t));
  l.off_scratch = take(S * MB * sizeof(float));
  l.off_mask = take(S * MB);
  l.off_error = take(sizeof(uint32_t));
  l.total = at;
  return l;
}

bool InRange(double v, double lo, double hi_exclusive) {
  return std::isfinite(v) && v >= lo && v < hi_exclusive;
}

}  // namespace

absl::Status ValidatePolicy(const Policy& p) {
  if (!InRange(p.target_sparsity, 0.0, 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("target sparsity ", p.target_sparsity, " is out of range [0, 1)"));
  }
  if (!InRange(p.exploration, 0.0, 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("exploration share ", p.exploration, " is out of range [0, 1)"));
  }
  if (!InRange(p.alpha, 0.0, 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("EMA decay alpha ", p.alpha, " is out of range [0, 1)"));
  }
  if (p.probe_period > kMaxProbePeriod) {
    return absl::InvalidArgumentError(absl::StrCat("probe period ", p.probe_period,
                                                   " is out of range [0, ", kMaxProbePeriod,
                                                   "] (0 = no probes)"));
  }
  if (p.budget_mode != BudgetMode::kUniform && !TableFromProbes(p.budget_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget mode ", static_cast<uint32_t>(p.budget_mode), " is unknown"));
  }
  if (!InRange(p.miss_target, 0.0, 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("miss target ", p.miss_target, " is out of range [0, 1)"));
  }
  if (p.budget_mode == BudgetMode::kMissTarget && !(p.miss_target > 0)) {
    return absl::InvalidArgumentError(
        "the miss-target budget mode needs a miss target in (0, 1), e.g. 0.02 for 2%");
  }
  return absl::OkStatus();
}

absl::Status ValidateGeometry(const Geometry& g) {
  auto check = [](const char* name, uint64_t v, uint64_t lo, uint64_t hi) -> absl::Status {
    if (v < lo || v > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " ", v, " is out of range [", lo, ", ", hi, "]"));
    }
    return absl::OkStatus();
  };
  for (const absl::Status& s :
       {check("layers", g.layers, 1, kMaxLayers), check("max_seqs", g.max_seqs, 1, kMaxSequences),
        check("max_slots", g.max_slots, 1, kMaxSlots), check("block_size", g.block_size, 1, 4096),
        check("topk", g.topk, 1, kMaxSlots), check("max_rows", g.max_rows, 1, kMaxRows)}) {
    SPIN_RETURN_IF_ERROR(s);
  }
  if (g.dtype != StateDtype::kFp32 && g.dtype != StateDtype::kBf16) {
    return absl::InvalidArgumentError(
        absl::StrCat("state dtype ", static_cast<uint32_t>(g.dtype), " is unknown"));
  }
  return absl::OkStatus();
}

uint64_t ArenaBytes(const Geometry& g) { return ComputeLayout(g).total; }

namespace {

ArenaView MakeView(void* base, const ArenaHeader& h, const Geometry& g) {
  auto* b = static_cast<uint8_t*>(base);
  ArenaView v;
  v.header = reinterpret_cast<ArenaHeader*>(b);
  v.geometry = g;
  v.max_blocks = h.max_blocks;
  v.policy = reinterpret_cast<ArenaPolicy*>(b + h.off_policy);
  v.sparsity = reinterpret_cast<double*>(b + h.off_sparsity);
  v.stats = reinterpret_cast<LayerStats*>(b + h.off_stats);
  v.curves = reinterpret_cast<uint64_t*>(b + h.off_curves);
  v.seqs = reinterpret_cast<SeqRecord*>(b + h.off_seqs);
  v.fresh = b + h.off_fresh;
  v.state = b + h.off_state;
  v.vsum = reinterpret_cast<float*>(b + h.off_vsum);
  v.batch = reinterpret_cast<BatchHeader*>(b + h.off_batch);
  v.entries = reinterpret_cast<StepEntry*>(v.batch + 1);
  v.union_count = reinterpret_cast<int32_t*>(b + h.off_union_count);
  v.union_ids = reinterpret_cast<int32_t*>(b + h.off_union);
  v.phys = reinterpret_cast<int32_t*>(b + h.off_phys);
  v.compact_len = reinterpret_cast<int32_t*>(b + h.off_compact_len);
  v.scratch = reinterpret_cast<float*>(b + h.off_scratch);
  v.mask = b + h.off_mask;
  v.error = reinterpret_cast<uint32_t*>(b + h.off_error);
  return v;
}

void FillHeader(ArenaHeader* h, const Geometry& g, uint64_t seed) {
  const Layout l = ComputeLayout(g);
  std::memset(h, 0, sizeof(*h));
  h->magic = kArenaMagic;
  h->version = kArenaLayoutVersion;
  h->total_bytes = l.total;
  h->layers = g.layers;
  h->max_seqs = g.max_seqs;
  h->max_slots = g.max_slots;
  h->block_size = g.block_size;
  h->topk = g.topk;
  h->max_rows = g.max_rows;
  h->state_dtype = static_cast<uint32_t>(g.dtype);
  h->max_blocks = static_cast<uint32_t>(CeilDiv(g.max_slots, g.block_size));
  h->curve_points = kCurvePoints;
  h->header_bytes = sizeof(ArenaHeader);
  h->seed = seed;
  h->off_policy = l.off_policy;
  h->off_sparsity = l.off_sparsity;
  h->off_stats = l.off_stats;
  h->off_curves = l.off_curves;
  h->off_seqs = l.off_seqs;
  h->off_fresh = l.off_fresh;
  h->off_state = l.off_state;
  h->off_vsum = l.off_vsum;
  h->off_batch = l.off_batch;
  h->off_union_count = l.off_union_count;
  h->off_union = l.off_union;
  h->off_phys = l.off_phys;
  h->off_compact_len = l.off_compact_len;
  h->off_scratch = l.off_scratch;
  h->off_mask = l.off_mask;
  h->off_error = l.off_error;
}

}  // namespace

absl::StatusOr<ArenaView> InitArena(void* base, uint64_t bytes, const Geometry& g, uint64_t seed,
                                    const Policy& policy) {
  SPIN_RETURN_IF_ERROR(ValidateGeometry(g));
  SPIN_RETURN_IF_ERROR(ValidatePolicy(policy));
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % kArenaAlign != 0) {
    return absl::InvalidArgumentError("arena base must be non-null and 256-byte aligned");
  }
  const uint64_t need = ArenaBytes(g);
  if (bytes < need) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena of ", bytes, " bytes is too small: the geometry needs ", need));
  }
  std::memset(base, 0, need);
  FillHeader(static_cast<ArenaHeader*>(base), g, seed);
  ArenaView v = MakeView(base, *static_cast<ArenaHeader*>(base), g);
  // Unset state is NaN: 0xFFFFFFFF is a quiet NaN for fp32 and a pair of bf16 NaNs for bf16,
  // but use the canonical patterns so a reader sees exactly one unset value per dtype.
  const uint64_t elems = 2ull * g.max_seqs * g.layers * g.max_slots;
  if (g.dtype == StateDtype::kFp32) {
    auto* p = reinterpret_cast<float*>(v.state);
    for (uint64_t i = 0; i < elems; ++i) p[i] = NAN;
  } else {
    auto* p = reinterpret_cast<uint16_t*>(v.state);
    for (uint64_t i = 0; i < elems; ++i) p[i] = kBf16Unset;
  }
  std::fill_n(v.vsum, static_cast<uint64_t>(g.max_seqs) * g.layers * v.max_blocks, NAN);
  std::memset(v.fresh, 1, static_cast<size_t>(g.max_seqs) * g.layers);
  v.batch->selected_layer = -1;
  SPIN_RETURN_IF_ERROR(WritePolicy(v, policy));
  // The budget table starts at InitialBudget (as InitDeviceArena does): a per-layer session
  // selects at its target until the probe thread's first table, a miss-target session densely.
  for (uint32_t l = 0; l < g.layers; ++l) v.sparsity[l] = InitialBudget(policy);
  v.policy->epoch = 1;
  return v;
}

absl::StatusOr<ArenaHeader> MakeArenaHeader(const Geometry& g, uint64_t seed) {
  SPIN_RETURN_IF_ERROR(ValidateGeometry(g));
  ArenaHeader h;
  FillHeader(&h, g, seed);
  return h;
}

absl::StatusOr<ArenaView> ViewArena(void* base, uint64_t bytes) {
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % kArenaAlign != 0) {
    return absl::InvalidArgumentError("arena base must be non-null and 256-byte aligned");
  }
  if (bytes < sizeof(ArenaHeader)) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena of ", bytes, " bytes is smaller than its layout header"));
  }
  return ViewArenaWithHeader(base, bytes, *static_cast<const ArenaHeader*>(base));
}

absl::StatusOr<ArenaView> ViewArenaWithHeader(void* base, uint64_t bytes,
                                              const ArenaHeader& header) {
  if (base == nullptr || reinterpret_cast<uintptr_t>(base) % kArenaAlign != 0) {
    return absl::InvalidArgumentError("arena base must be non-null and 256-byte aligned");
  }
  const ArenaHeader* h = &header;
  if (h->magic != kArenaMagic) {
    return absl::InvalidArgumentError("arena has no SPIN layout header (bad magic)");
  }
  if (h->version != kArenaLayoutVersion) {
    return absl::FailedPreconditionError(absl::StrCat("arena layout version ", h->version,
                                                      " is not the supported version ",
                                                      kArenaLayoutVersion));
  }
  Geometry g;
  g.layers = h->layers;
  g.max_seqs = h->max_seqs;
  g.max_slots = h->max_slots;
  g.block_size = h->block_size;
  g.topk = h->topk;
  g.max_rows = h->max_rows;
  g.dtype = static_cast<StateDtype>(h->state_dtype);
  if (absl::Status s = ValidateGeometry(g); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("arena header: ", s.message()));
  }
  // The header must be exactly what this build would write for its geometry.
  ArenaHeader expect;
  FillHeader(&expect, g, h->seed);
  if (std::memcmp(&expect, h, sizeof(expect)) != 0) {
    return absl::InvalidArgumentError("arena header offsets do not match its geometry");
  }
  if (bytes < h->total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "arena mapping of ", bytes, " bytes is smaller than its layout's ", h->total_bytes));
  }
  return MakeView(base, *h, g);
}

absl::Status WritePolicy(const ArenaView& a, const Policy& p) {
  SPIN_RETURN_IF_ERROR(ValidatePolicy(p));
  FillArenaPolicy(p, a.policy);
  if (p.budget_mode == BudgetMode::kUniform) {
    for (uint32_t l = 0; l < a.geometry.layers; ++l) a.sparsity[l] = p.target_sparsity;
  }
  a.policy->epoch += 1;
  return absl::OkStatus();
}

double InitialBudget(const Policy& p) {
  return p.budget_mode == BudgetMode::kMissTarget ? 0.0 : p.target_sparsity;
}

void FillArenaPolicy(const Policy& p, ArenaPolicy* ap) {
  ap->target_sparsity = p.target_sparsity;
  ap->exploration = p.exploration;
  ap->alpha = p.alpha;
  ap->beta = 1.0f - p.alpha;
  ap->probe_period = p.probe_period;
  ap->budget_mode = static_cast<uint32_t>(p.budget_mode);
  ap->miss_target = p.miss_target;
}

Policy ReadPolicy(const ArenaView& a) {
  Policy p;
  p.target_sparsity = a.policy->target_sparsity;
  p.exploration = a.policy->exploration;
  p.alpha = a.policy->alpha;
  p.probe_period = a.policy->probe_period;
  p.budget_mode = static_cast<BudgetMode>(a.policy->budget_mode);
  p.miss_target = a.policy->miss_target;
  return p;
}

}  // namespace spin
