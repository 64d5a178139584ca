// The per-session arena (docs/design.md §4): one allocation holding all SPIN state of a session, a
// versioned layout header first so that a process that maps it can validate what it got.
//
// The layout is plain data with 64-bit offsets from the arena base; the same bytes are read by
// the CPU backend (host memory, a memfd in the daemon) and the CUDA backend (device memory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace spin {

/// "SPIN" in little-endian byte order.
inline constexpr uint32_t kArenaMagic = 0x4E495053u;
/// Bumped on any change of the bytes below.
inline constexpr uint32_t kArenaLayoutVersion = 4;
/// Section alignment inside the arena.
inline constexpr uint64_t kArenaAlign = 256;
/// Keep fractions of the probe-step miss curve: 5%, 10%, ..., 100%.
inline constexpr int kCurvePoints = 20;
/// Keep fraction of curve point p.
inline constexpr double CurveKeepFraction(int p) { return 0.05 * (p + 1); }

/// Limits checked by ValidateGeometry (they bound the arena and the index arithmetic).
inline constexpr uint32_t kMaxLayers = 1024;
inline constexpr uint32_t kMaxSequences = 4096;
inline constexpr uint32_t kMaxSlots = 1u << 24;
inline constexpr uint32_t kMaxRows = 16;
// The longest probe period a policy may have (every P-th step dense; 0: no probes).
inline constexpr uint32_t kMaxProbePeriod = 1u << 20;

/// Element type of the V and D statistics.
enum class StateDtype : uint32_t { kFp32 = 1, kBf16 = 2 };

/// Bytes of one state element.
inline constexpr uint32_t StateBytes(StateDtype d) { return d == StateDtype::kBf16 ? 2 : 4; }

/// The text form of a state dtype, as flags and Python spell it: "fp32", "bf16".
/// ParseStateDtype is its inverse (nullopt for any other text).
inline constexpr std::string_view StateDtypeName(StateDtype d) {
  return d == StateDtype::kBf16 ? "bf16" : "fp32";
}
inline constexpr std::optional<StateDtype> ParseStateDtype(std::string_view text) {
  for (StateDtype d : {StateDtype::kFp32, StateDtype::kBf16}) {
    if (text == StateDtypeName(d)) return d;
  }
  return std::nullopt;
}

/// Budget mode of a session (per-layer budgets come from the daemon's probe thread).
/// kMissTarget: per-layer budgets too, each layer at the highest sparsity whose predicted miss
/// stays within Policy::miss_target (docs/budgets.md), instead of a total at target_sparsity.
enum class BudgetMode : uint32_t { kUniform = 1, kPerLayer = 2, kMissTarget = 3 };
/// Every budget mode, in the order choices are listed (the Python package takes its from here).
inline constexpr BudgetMode kBudgetModes[] = {BudgetMode::kUniform, BudgetMode::kPerLayer,
                                              BudgetMode::kMissTarget};

/// The one text form of a budget mode, used by spind's logs, spinctl, replay and Python:
/// "uniform", "per-layer", "miss-target". ParseBudgetMode is its inverse (nullopt for any
/// other text; kBudgetModeChoices names the accepted ones for an error message).
inline constexpr std::string_view BudgetModeName(BudgetMode m) {
  switch (m) {
    case BudgetMode::kUniform:
      return "uniform";
    case BudgetMode::kPerLayer:
      return "per-layer";
    case BudgetMode::kMissTarget:
      return "miss-target";
  }
  return "unknown";
}
inline constexpr std::optional<BudgetMode> ParseBudgetMode(std::string_view text) {
  for (BudgetMode m : kBudgetModes) {
    if (text == BudgetModeName(m)) return m;
  }
  return std::nullopt;
}
inline constexpr std::string_view kBudgetModeChoices = "uniform, per-layer or miss-target";

/// True for the modes whose table the probe side computes (per-layer and miss-target).
inline constexpr bool TableFromProbes(BudgetMode m) {
  return m == BudgetMode::kPerLayer || m == BudgetMode::kMissTarget;
}

/// The shape of a session, fixed at attach.
struct Geometry {
  uint32_t layers = 0;       ///< indexer layers L
  uint32_t max_seqs = 0;     ///< sequences S held at once
  uint32_t max_slots = 0;    ///< slots N per sequence (compressed slots on V4)
  uint32_t block_size = 64;  ///< slots per block b
  uint32_t topk = 0;         ///< the indexer's top-K
  uint32_t max_rows = 1;     ///< query rows per step R (1 + MTP drafts)
  StateDtype dtype = StateDtype::kFp32;
};

/// The default EMA decay; docs/lab/alpha-sweep.md has the replay evidence behind it.
inline constexpr float kDefaultAlpha = 0.3f;

/// Policy knobs read by the kernels at launch time (written by the owner of the arena).
struct Policy {
  double target_sparsity = 0.5;  ///< rho: fraction of blocks to skip, [0, 1)
  double exploration = 0.05;     ///< gamma: share of kept blocks chosen at random, [0, 1)
  float alpha = kDefaultAlpha;   ///< EMA decay: weight of the old value, [0, 1)
  uint32_t probe_period = 0;     ///< P: every P-th step of a sequence is dense; 0 = never
  BudgetMode budget_mode = BudgetMode::kUniform;
  /// kMissTarget: every layer's predicted mean miss at most this, in (0, 1); else unused (0).
  double miss_target = 0;
};

/// Checks each field of a policy; the message names the field and its allowed range.
absl::Status ValidatePolicy(const Policy& p);
/// Checks a geometry against the limits above.
absl::Status ValidateGeometry(const Geometry& g);

/// Policy block as stored in the arena.
struct ArenaPolicy {
  double target_sparsity;
  double exploration;
  float alpha;
  float beta;  ///< (float)(1 - alpha), computed once on write
  uint32_t probe_period;
  uint32_t budget_mode;
  uint64_t epoch;      ///< bumped on every policy or budget-table write
  double miss_target;  ///< kMissTarget's miss target (read by the probe side, not the kernels)
};

/// Per-layer statistics counters (monotone; readers take differences).
struct LayerStats {
  uint64_t steps;                ///< (sequence, step) pairs selected
  uint64_t dense_steps;          ///< of which dense (fresh or probe)
  uint64_t probe_steps;          ///< of which probe steps with a miss-curve sample
  uint64_t blocks_kept;          ///< blocks scored, all steps
  uint64_t blocks_total;         ///< blocks in context, all steps
  uint64_t sparse_blocks_kept;   ///< blocks scored, non-dense steps
  uint64_t sparse_blocks_total;  ///< blocks in context, non-dense steps
  uint64_t observed;             ///< finite scores applied to V/D
  uint64_t bad_scores;           ///< non-finite scores skipped
  uint64_t probe_topk;           ///< dense top-K slots seen on probe steps
  uint64_t probe_missed;         ///< of which outside the layer's current budget
  /// Sparse steps whose row-0 top-K the engine gave (RemapTopK, RemapAndObserve) and whose
  /// selection explored: the exploration estimate of their miss (docs/budgets.md, "Measured
  /// between probes"; ExploreHitWeight in spin/numerics.h).
  uint64_t explore_steps;
  uint64_t explore_topk;  ///< valid top-K slots of those rows
  uint64_t explore_est;   ///< estimated missed slots of those rows, in 1/kExploreEstUnit slot
};

/// The current step of the batch, written by BeginStep.
struct BatchHeader {
  int32_t n;               ///< entries
  int32_t rows;            ///< query rows per entry
  int32_t selected_layer;  ///< layer of the last Select (its outputs are current), -1 = none
  int32_t pad;
};

/// Per-batch-entry step description written by BeginStep.
struct StepEntry {
  int32_t seq;      ///< sequence slot, or -1 for a padding entry
  int32_t ctx_len;  ///< context of row 0
  int32_t q_pos;    ///< slot of row 0's query key
  uint32_t probe;   ///< 1 if step % P == 0: every layer scores all blocks
  uint64_t step;    ///< the sequence's step number (0 = first step after reset)
};

/// Per-sequence persistent record.
struct SeqRecord {
  uint64_t key;    ///< engine key for exploration draws
  uint64_t steps;  ///< steps begun since reset
  uint32_t open;   ///< 1 after ResetSequence
  uint32_t pad;
};

/// The layout header at offset 0 of every arena.
struct ArenaHeader {
  uint32_t magic;
  uint32_t version;
  uint64_t total_bytes;
  uint32_t layers, max_seqs, max_slots, block_size, topk, max_rows;
  uint32_t state_dtype;
  uint32_t max_blocks;    ///< ceil(max_slots / block_size)
  uint32_t curve_points;  ///< kCurvePoints
  uint32_t header_bytes;  ///< sizeof(ArenaHeader)
  uint64_t seed;          ///< session seed for exploration
  // Section offsets from the arena base.
  uint64_t off_policy;    ///< ArenaPolicy
  uint64_t off_sparsity;  ///< double[L]: per-layer sparsity rho_l (the budget table)
  uint64_t off_stats;     ///< LayerStats[L]
  uint64_t off_curves;    ///< uint64[L][kCurvePoints]: missed top-K slots per keep fraction
  uint64_t off_seqs;      ///< SeqRecord[S]
  uint64_t off_fresh;     ///< uint8[S][L]: 1 until the first observation
  uint64_t off_state;     ///< per (seq, layer): V[N] then D[N], dtype elements
  /// float[S][L][max_blocks]: per block j of V (slots [j b, min((j + 1) b, N))), NaN if any
  /// entry is unset, else the largest entry (zero stored as +0). Kept equal to that function of
  /// V by every backend (reset, and observe for the blocks of its union), so block scores can
  /// take the vertical term of a block wholly inside the row from one value.
  uint64_t off_vsum;
  uint64_t off_batch;        ///< BatchHeader, then StepEntry[S]
  uint64_t off_union_count;  ///< int32[S]: selected blocks of batch entry e (union over rows)
  uint64_t off_union;        ///< int32[S][max_blocks]: selected logical block ids, ascending
  uint64_t off_phys;         ///< int32[S][max_blocks]: compacted physical block table
  uint64_t off_compact_len;  ///< int32[S][R]: compacted context length of each row
  uint64_t off_scratch;      ///< float[S][max_blocks]: row-0 block scores (probe curves; CPU
                             ///< backend, the CUDA one keeps them per layer in private memory)
  uint64_t off_mask;         ///< uint8[S][max_blocks]: union mask scratch (CPU backend)
  uint64_t off_error;        ///< uint32: first bounds-check error code seen by a kernel
};

// The layout is shared by host and device code and across processes: pin the record sizes.
static_assert(sizeof(ArenaPolicy) == 48);
static_assert(sizeof(LayerStats) == 112);
static_assert(sizeof(BatchHeader) == 16);
static_assert(sizeof(StepEntry) == 24);
static_assert(sizeof(SeqRecord) == 24);
static_assert(sizeof(ArenaHeader) % 8 == 0);

/// Bytes needed for an arena of this geometry.
uint64_t ArenaBytes(const Geometry& g);

/// Typed view of a validated arena. All pointers point into the same allocation.
struct ArenaView {
  ArenaHeader* header = nullptr;
  Geometry geometry;
  uint32_t max_blocks = 0;
  ArenaPolicy* policy = nullptr;
  double* sparsity = nullptr;
  LayerStats* stats = nullptr;
  uint64_t* curves = nullptr;
  SeqRecord* seqs = nullptr;
  uint8_t* fresh = nullptr;
  uint8_t* state = nullptr;
  float* vsum = nullptr;
  BatchHeader* batch = nullptr;
  StepEntry* entries = nullptr;
  int32_t* union_count = nullptr;
  int32_t* union_ids = nullptr;
  int32_t* phys = nullptr;
  int32_t* compact_len = nullptr;
  float* scratch = nullptr;
  uint8_t* mask = nullptr;
  uint32_t* error = nullptr;

  /// Bytes of one (sequence, layer) state record: V[N] then D[N].
  uint64_t StateRecordBytes() const {
    return 2ull * geometry.max_slots * StateBytes(geometry.dtype);
  }
  /// Start of V for (seq, layer); D follows after max_slots elements.
  uint8_t* StateRecord(int seq, int layer) const {
    return state + (static_cast<uint64_t>(seq) * geometry.layers + layer) * StateRecordBytes();
  }
  /// The block summaries of V for (seq, layer): max_blocks floats.
  float* VSummaries(int seq, int layer) const {
    return vsum + (static_cast<uint64_t>(seq) * geometry.layers + layer) * max_blocks;
  }
};

/// Writes a fresh arena into [base, base + bytes): header, policy, uniform budget table, every
/// sequence closed, all state unset, outputs zeroed. `base` must be 256-byte aligned.
absl::StatusOr<ArenaView> InitArena(void* base, uint64_t bytes, const Geometry& g, uint64_t seed,
                                    const Policy& policy);

/// The layout header an arena of this geometry has.
absl::StatusOr<ArenaHeader> MakeArenaHeader(const Geometry& g, uint64_t seed);

/// Validates the header of a mapped arena in host memory (magic, version, sizes, offsets) and
/// returns a view.
absl::StatusOr<ArenaView> ViewArena(void* base, uint64_t bytes);

/// Like ViewArena for an arena whose bytes may live in device memory: `header` is a host copy
/// of its first sizeof(ArenaHeader) bytes. The view's pointers point into `base`.
absl::StatusOr<ArenaView> ViewArenaWithHeader(void* base, uint64_t bytes,
                                              const ArenaHeader& header);

/// Error codes a device-side kernel records (first one wins) in the arena's error word, since
/// it cannot return a status without a host synchronisation.
enum ArenaError : uint32_t {
  kArenaOk = 0,
  kArenaBadBatch = 1,     ///< BeginStep: an entry failed validation; the step has no entries
  kArenaBadAccepted = 2,  ///< Observe: accepted outside [0, rows]; that entry was not applied
  kArenaBadStride = 3,    ///< Observe: logits stride below a row's compacted length; skipped
  kArenaNoSelect = 4,     ///< Remap without a Select in this step
};

/// Writes a policy into the arena's policy block (and, in uniform mode, the budget table), and
/// bumps the epoch. Host memory only; the CUDA backend has its own device-side write.
absl::Status WritePolicy(const ArenaView& a, const Policy& p);

/// The budget table (rho_l, every layer) a new arena starts with: the target sparsity, except in
/// the miss-target mode, where nothing says what a sparsity would miss before the first probe
/// curve, so it starts dense (0), as the controller's cold table; a daemon's session then misses
/// nothing in the steps before its probe thread's first pass (docs/budgets.md).
double InitialBudget(const Policy& p);

/// Fills every field of an arena policy block from `p` except the epoch (no validation).
void FillArenaPolicy(const Policy& p, ArenaPolicy* out);

/// Reads the policy block back.
Policy ReadPolicy(const ArenaView& a);

}  // namespace spin
