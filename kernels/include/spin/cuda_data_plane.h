// The CUDA backend of the data plane (H100/H200), for arenas in device memory.
//
// Host code includes this plain header; the kernels live in kernels/cuda/ and build only when
// the CUDA toolkit is found (SPIN_HAVE_CUDA). Every per-step operation is asynchronous on the
// caller's stream, allocates nothing and never synchronises, so a step can be captured in a
// CUDA graph and replayed. Checks that need device data (entry ranges, accepted counts) run on
// the device and record an ArenaError in the arena's error word instead of returning a status.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "spin/arena.h"
#include "spin/data_plane.h"

namespace spin {

/// True when the CUDA backend was built and a CUDA device is usable.
bool CudaAvailable();

/// Writes a fresh arena (header, policy, unset state, ...) into device memory at `device_base`
/// (cudaMalloc'd or VMM-mapped, 256-byte aligned) on `stream`, and returns its view.
absl::StatusOr<ArenaView> InitDeviceArena(void* device_base, uint64_t bytes, const Geometry& g,
                                          uint64_t seed, const Policy& policy,
                                          cudaStream_t stream = nullptr);

/// Writes a policy (and, in uniform mode, the budget table) into a device arena and bumps its
/// epoch. A control-plane call: it synchronises `stream`.
absl::Status WriteDevicePolicy(const ArenaView& view, const Policy& policy,
                               cudaStream_t stream = nullptr);

/// Options of a CUDA data plane.
struct CudaDataPlaneOptions {
  /// Layers whose selections share one grid when a step begins (BeginStep selects every layer
  /// ahead, docs/cuda-backend.md). 0: as many as fit a 64 MB group scratch (all layers for the
  /// usual geometries). Tests set it to exercise several groups.
  int32_t ahead_group_layers = 0;
  /// Observe runs its Probe launch on a second stream of the data plane, beside the EMA launches
  /// on the caller's stream (forked from and joined back to it through events: in a captured
  /// graph two parallel branches, so a small batch waits for one kernel's latency instead of
  /// two). false: Probe then the EMA, on the caller's stream. The results are the same.
  bool probe_beside_ema = true;
  /// Observe's EMA launches leave the caller's stream: they run on the data plane's second
  /// stream, forked where Observe is called, and are joined back to the caller's stream by the
  /// next call that needs them: the next Observe (or a fused call), a Select that selects a layer
  /// again, BeginStep, ResetSequence; the session's last layer's Observe joins its own at once.
  /// So the EMA of layer l runs beside what the engine does up to layer l + 1's Observe (its
  /// attention, the next layer's indexer) instead of before it; the Probe launch (validation,
  /// the remap, the next layer's publish) stays on the caller's stream. The results are the
  /// same. The caller must leave layer l's logits unwritten until the next call of the data
  /// plane that joins (the Python op keeps the tensor alive until then), and a captured graph
  /// must end after such a call (the last layer's Observe, as an engine's step does). A call
  /// captured while an eager Observe's EMA is pending is refused (FailedPrecondition).
  bool defer_ema = false;
};

/// A CUDA data plane over a device arena. The view's pointers are device pointers; `view.header`
/// is read through a host copy taken here (one synchronous copy at construction). Besides the
/// arena it allocates private device memory, dominated by the per-layer selections and row-0
/// block scores: `8 * L * S * ceil(N / b)` bytes (61 layers x 64 sequences x 128K slots: 64 MB,
/// 3% of the bf16 arena).
absl::StatusOr<std::unique_ptr<DataPlane>> MakeCudaDataPlane(
    const ArenaView& view, const CudaDataPlaneOptions& options = {});

/// The engine's indexer inputs for the fused mode (device pointers; the layouts of
/// PagedIndexerArgs, spin/paged_indexer.h). The table, lengths, batch and rows are the data
/// plane's: the compacted table and lengths the layer's Select published.
struct FusedIndexerArgs {
  const uint8_t* q = nullptr;      ///< [batch * rows][64][128] fp8 e4m3
  const float* weights = nullptr;  ///< [batch * rows][64]
  const uint8_t* kv = nullptr;     ///< the KV pages (the engine's block table points into them)
  float* logits = nullptr;         ///< [batch * rows][logits_stride], compacted positions
  int64_t logits_stride = 0;
  int32_t stages = 5;       ///< pages in each CTA's ring, [4, 7]
  int32_t chunk_pages = 0;  ///< pages per CTA; 0 chooses
  /// PagedIndexerArgs::spread: each row's pages over all of its CTAs (a compacted row is shorter
  /// than max_pages), and PagedIndexerArgs::programmatic: a programmatic launch. Both on by
  /// default: the fastest fused configuration measured (docs/cuda-backend.md, "Fused mode").
  bool spread = true;
  bool programmatic = true;
  /// The engine gives its top-K to RemapTopK after the call (docs/design.md §5, "given by the
  /// engine"): the call then launches no Probe, and on a probe step the miss curves are counted
  /// there. A promise: nothing else counts that probe, so a layer whose selection gets no RemapTopK
  /// with count > 0 (a plain Remap, or none) has no curve sample on that step, where the
  /// reference's Select and Observe would have computed one. Off: the Probe launch after the kernel
  /// computes each probing entry's dense top-K from the logits.
  bool probe_at_remap = false;
};

/// The fused mode (docs/cuda-backend.md, "Fused mode"; sm_90a): in place of the engine's indexer
/// over layer's compacted table followed by Observe(layer) without accepted counts. Runs spind's
/// sparse paged indexer (the wgmma reference kernel) over the compacted table the layer's Select
/// published, writing the logits as LaunchPagedIndexer does, and applies row 0's EMA to the
/// layer's state beside the indexer from the logits it holds, with Observe's validation (the
/// stride rule, fresh flags); then the probing entries' curves from those logits. The state,
/// statistics and curves it leaves are Observe's, bit for bit. Same call-order errors as
/// Observe; needs 64-slot blocks (one KV page per block), sm_90a and a CUDA data plane; refused
/// calls launch nothing. Asynchronous on `stream`, graph-capturable. Faster than the unfused path
/// at batch 1-16 and with probe steps, slower at batch 64 and above (docs/cuda-backend.md,
/// "Fused mode").
absl::Status IndexAndObserve(DataPlane& dp, int32_t layer, const FusedIndexerArgs& args,
                             cudaStream_t stream = nullptr);

/// Select(layer, block_table, table_stride) and IndexAndObserve(layer, args) in one: the fused
/// kernel reads the layer's selection (made when the step began) and the engine's block table
/// itself, and publishes Select's outputs (union, compacted table and lengths, statistics), so
/// Remap works after it as after Select; one kernel and the Probe launch (none with
/// probe_at_remap) per layer instead of three launches. The block table is required (stride >=
/// the session's max blocks). Same results, bit for bit, as the two calls; same call-order rules
/// as Select (it is the layer's Select).
absl::Status SelectIndexAndObserve(DataPlane& dp, int32_t layer, const int32_t* block_table,
                                   int64_t table_stride, const FusedIndexerArgs& args,
                                   cudaStream_t stream = nullptr);

/// Device memory for tools and tests (synchronous; never on the engine's hot path).
absl::StatusOr<void*> DeviceAlloc(uint64_t bytes);
/// Frees memory from DeviceAlloc.
void DeviceFree(void* p);
/// Copies host -> device.
absl::Status CopyToDevice(void* dst, const void* src, uint64_t bytes);
/// Copies device -> host.
absl::Status CopyToHost(void* dst, const void* src, uint64_t bytes);

/// Row 0's block scores of `layer` that the current step's selection ranked, entries x max_blocks
/// floats (blocks of a row below its block count are set unless the pair was fresh). The CUDA
/// backend keeps them per layer in private memory, not in the arena's scratch section as the CPU
/// backend does. Synchronous; for tests and tools.
absl::StatusOr<std::vector<float>> ReadDeviceBlockScores(const DataPlane& dp, int32_t layer,
                                                         int32_t entries);

/// Reads the arena's error word (synchronous; for tests and tools).
absl::StatusOr<uint32_t> ReadDeviceError(const ArenaView& view);

}  // namespace spin
