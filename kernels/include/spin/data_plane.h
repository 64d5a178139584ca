// The SPIN data plane: the per-step operations an engine runs around its indexer (docs/design.md
// §3, §5).
//
// One interface, two backends: cpu/ (the reference, host pointers) and cuda/ (device pointers,
// launched on the caller's stream with no host synchronisation). A decode step of a batch is:
//
//   BeginStep(batch)                  once per step
//   for each indexer layer l:
//     Select(l, block_table)          -> union of selected logical blocks per batch entry,
//                                        compacted physical block table, compacted lengths
//     <engine runs its paged indexer over the compacted table and its top-K>
//     Remap(topk)                     -> compacted top-K indices back to logical slots
//                                        (RemapTopK: the same, and on a probe step the engine's
//                                        top-K is the one the miss curve counts)
//     Observe(l, logits, accepted)    -> EMA update from accepted rows, probe miss curves
//     (RemapAndObserve: RemapTopK and Observe in one call)
//
// Per-step inputs are read through pointers (fixed addresses, so CUDA graphs replay them);
// outputs are written to fixed-address buffers inside the arena (see Outputs()). A data plane's
// calls must run in the order issued (one stream, or streams ordered by events): the outputs and
// the CUDA backend's private buffers are reused layer after layer and step after step.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "spin/arena.h"

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace spin {

/// One decode step of a batch. Arrays have `n` entries; on the CUDA backend they are device
/// pointers that must stay valid until the work on the stream has run.
struct StepBatch {
  /// Sequence slot per entry, or -1: an entry without a sequence, served dense. It selects
  /// every block of its rows (ctx_len + r slots) and reads and changes no SPIN state (nothing
  /// observed, counted or advanced); ctx_len 0 makes it empty (padding). So a step whose every
  /// entry is -1, given the engine's lengths, is the dense indexer's step: what an engine
  /// begins when it decides a step is dense after a CUDA graph holding the SPIN path was
  /// captured (docs/data-plane.md, "Entries without a sequence").
  const int32_t* seq = nullptr;
  const int32_t* ctx_len = nullptr;  ///< context length of row 0 (row r has ctx_len + r)
  const int32_t* q_pos = nullptr;    ///< slot of row 0's query key (row r: q_pos + r)
  int32_t n = 0;                     ///< entries, at most max_seqs
  int32_t rows = 1;                  ///< query rows this step, 1..max_rows (1 + MTP drafts)
  /// Optional: the engine's block table for every layer of the step (entry e's at
  /// block_table + e * table_stride, indexed by logical block; table_stride >= max blocks), when
  /// it is known as the step begins (vLLM's is). A Select without a table of its own uses it.
  /// Its contents must not change until the step's last Select. On the CUDA backend it lets
  /// each layer's Observe publish the next layer's selection into the outputs while its EMA
  /// runs, so that layer's Select launches nothing (docs/cuda-backend.md, "Publish ahead"):
  /// with it, read a layer's outputs before that layer's Observe.
  const int32_t* block_table = nullptr;
  int64_t table_stride = 0;
};

/// Where the outputs of the last Select live (pointers into the arena). Entry e of the batch:
///   union_count[e]                 blocks selected (union over rows)
///   union_ids[e * max_blocks + k]  k-th selected logical block, ascending
///   phys[e * max_blocks + k]       engine physical block of union_ids[..k] (if a table was given)
///   compact_len[e * max_rows + r]  compacted context length of row r
struct Outputs {
  const int32_t* union_count;
  const int32_t* union_ids;
  const int32_t* phys;
  const int32_t* compact_len;
  int32_t max_blocks;
  int32_t max_rows;
};

/// The data-plane operations over one session arena.
class DataPlane {
 public:
  virtual ~DataPlane() = default;

  /// The arena this data plane operates on.
  virtual const ArenaView& arena() const = 0;

  /// True when the arena and every pointer argument live in device memory (CUDA backend).
  virtual bool on_device() const { return false; }

  /// Opens or reopens sequence slot `seq` with the engine's key: state unset, fresh, step 0.
  virtual absl::Status ResetSequence(int32_t seq, uint64_t key, cudaStream_t stream = nullptr) = 0;

  /// Starts a decode step: validates and records each entry, advances each sequence's step
  /// counter and decides dense/probe. Rejects the whole batch (nothing changes) on a bad entry.
  virtual absl::Status BeginStep(const StepBatch& batch, cudaStream_t stream = nullptr) = 0;

  /// Selects the blocks of layer `layer` for every entry of the current step. If
  /// `block_table` is given (entry e's table at block_table + e * table_stride, indexed by
  /// logical block), or else the step has one (StepBatch::block_table), also fills the
  /// compacted physical block table. The layer's budget and the
  /// exploration share are those in force when the step's BeginStep ran (a policy or budget
  /// written during a step applies from the next one). The CUDA backend makes every layer's
  /// selection in BeginStep and Select publishes it; called after the layer's Observe in the
  /// same step, it selects again from the updated state, as the CPU backend does.
  virtual absl::Status Select(int32_t layer, const int32_t* block_table = nullptr,
                              int64_t table_stride = 0, cudaStream_t stream = nullptr) = 0;

  /// Maps compacted slot indices (the engine's top-K over the compacted table) back to logical
  /// slots in place: idx[(e * rows + r) * count + k]. Negative indices stay -1; an index at or
  /// beyond the row's compacted length becomes -1.
  virtual absl::Status Remap(int32_t* idx, int32_t count, cudaStream_t stream = nullptr) = 0;

  /// Remap of the engine's own top-K of the selected layer (its top-K over the compacted rows,
  /// `count` per row): the same mapping, and on a probe step each probing entry's row 0, once
  /// mapped, is the dense top-K its miss curve counts (docs/design.md §5: "given by the engine"):
  /// every valid slot is counted against the curve levels of the selection's ranking, and the probe
  /// counts one step per probing entry. A selection's probe is counted once, by whichever comes
  /// first: RemapTopK with count > 0, or the layer's Observe (or a fused call without
  /// `probe_at_remap`), which computes the top-K from the logits; the later calls count nothing.
  /// So give the top-K before Observe. This default only maps, and the layer's Observe computes
  /// the top-K (the remote data plane: spind gets the logits, not the top-K).
  virtual absl::Status RemapTopK(int32_t* idx, int32_t count, cudaStream_t stream = nullptr) {
    return Remap(idx, count, stream);
  }

  /// Feeds back the indexer logits of layer `layer` for the current step. Entry e, row r,
  /// compacted slot c is logits[(e * rows + r) * logits_stride + c], for c below the row's
  /// compacted length. Rows 0..accepted[e]-1 are applied in order; accepted == nullptr applies
  /// row 0 only, the engine contract for MTP (an engine learns acceptance after every layer's
  /// Observe of the step; docs/lab/mtp-contract.md has the measurements behind it). An offline
  /// replay that knows acceptance passes it. Non-finite scores are skipped and counted. On a probe
  /// step, row 0's dense top-K (computed from the logits, unless RemapTopK gave the engine's) is
  /// scored against the layer's miss curve first.
  virtual absl::Status Observe(int32_t layer, const float* logits, int64_t logits_stride,
                               const int32_t* accepted = nullptr,
                               cudaStream_t stream = nullptr) = 0;

  /// RemapTopK(idx, count), then Observe(layer, logits, logits_stride, accepted): the same
  /// results in one call, whose host-checked arguments are all checked before anything runs (a
  /// refused call changes nothing). The CUDA backend does the remap inside Observe's Probe
  /// launch: one launch fewer per layer; what only the device can check (accepted counts, a
  /// row longer than the stride) is recorded as for Observe, that entry not applied, while the
  /// remap and the given top-K's counts still happen. The mapped indices are ready when the
  /// call's work on the stream is. This default runs the two calls (the remote data plane
  /// overrides it to check first).
  virtual absl::Status RemapAndObserve(int32_t layer, int32_t* idx, int32_t count,
                                       const float* logits, int64_t logits_stride,
                                       const int32_t* accepted = nullptr,
                                       cudaStream_t stream = nullptr) {
    if (absl::Status s = RemapTopK(idx, count, stream); !s.ok()) return s;
    return Observe(layer, logits, logits_stride, accepted, stream);
  }

  /// The output buffers of the last Select.
  Outputs outputs() const {
    const ArenaView& a = arena();
    return Outputs{a.union_count,
                   a.union_ids,
                   a.phys,
                   a.compact_len,
                   static_cast<int32_t>(a.max_blocks),
                   static_cast<int32_t>(a.geometry.max_rows)};
  }

  /// Makes this data plane the owner of the memory its arena lives in (NewDataPlane,
  /// spin/data_plane_setup.h): released when the data plane is destroyed.
  void OwnArenaMemory(std::shared_ptr<void> memory) { arena_memory_ = std::move(memory); }

 private:
  // A member of the base class: released after the backend's destructor and members, which may
  // still use the arena.
  std::shared_ptr<void> arena_memory_;
};

/// BeginStep's checks, made before anything changes (docs/design.md §7), on a host-readable view
/// whose sequence records are current: batch size and rows, then per entry the sequence range,
/// open, not repeated, ctx_len and q_pos ranges. The CPU backend runs it; spind runs it on its host
/// mirror before remote-mode steps on the CUDA backend, so both answer with the same statuses.
absl::Status ValidateStepBatch(const ArenaView& a, const StepBatch& batch);

/// The part of ValidateStepBatch that needs no sequence records or entry values (every
/// backend's, and the remote data plane's before it copies the batch): batch size and rows in
/// range, the arrays given when there are entries, and the block table's stride.
absl::Status ValidateStepShape(const ArenaView& a, const StepBatch& batch);

/// The step's block table check (part of ValidateStepBatch; every backend's): a table's stride
/// is at least the session's max blocks.
absl::Status ValidateStepTable(const ArenaView& a, const StepBatch& batch);

/// A layer index within the session's layers (every backend's).
absl::Status ValidateLayer(const ArenaView& a, int32_t layer);

/// Remap's check of its top-K buffer (every backend's): a count >= 0, and a buffer when count > 0.
absl::Status ValidateTopKBuffer(const int32_t* idx, int32_t count);

/// Observe's refusal of a step of `entries` > 0 entries given no logits buffer or a negative
/// stride (every backend's; a step of padding only included, though nothing is read there).
absl::Status LogitsRequired(int32_t entries, int64_t logits_stride);

/// Observe's checks against the current step (host-readable batch, entries and compacted
/// lengths): a logits buffer and a stride >= 0 for a step with entries (LogitsRequired),
/// `accepted` within [0, rows] for every live entry, and a logits stride that covers the widest
/// compacted row.
absl::Status ValidateObserveInputs(const ArenaView& a, const float* logits, int64_t logits_stride,
                                   const int32_t* accepted);

/// Observe's (and RemapAndObserve's) whole host check, `what` naming the call: the layer in
/// range, selected in this step, then ValidateObserveInputs. The CPU backend's, and the remote
/// data plane's on its mirror.
absl::Status ValidateObserveCall(const ArenaView& a, const char* what, int32_t layer,
                                 const float* logits, int64_t logits_stride,
                                 const int32_t* accepted);

/// The CPU reference backend over an arena in host memory.
std::unique_ptr<DataPlane> MakeCpuDataPlane(const ArenaView& arena);

}  // namespace spin
