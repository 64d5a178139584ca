// A reference paged indexer with the semantics of DeepGEMM's fp8_paged_mqa_logits, used as
// the dense baseline in benchmarks and by end-to-end tests (CUDA only).
//
//   logits[row][s] = sum_h w[row][h] * ReLU(q[row][h] . k[s]) * scale[s]
//
// over the slots s < len(row) of the row's block table. One kernel serves the dense stage
// (full table) and the sparse stage (SPIN's compacted table and compacted lengths).
#pragma once

#include <cstdint>

#include "absl/status/status.h"

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace spin {

/// Heads and head dimension of the DSA indexer (DeepSeek-V3.2 / V4).
inline constexpr int kIndexerHeads = 64;
inline constexpr int kIndexerDim = 128;
/// Slots per KV page and bytes per slot: 128 fp8 e4m3 key bytes + one fp32 scale.
inline constexpr int kPageSlots = 64;
inline constexpr int kSlotBytes = kIndexerDim + 4;
/// Bytes of one page: 64 key rows of 128 bytes, then 64 fp32 scales.
inline constexpr int kPageBytes = kPageSlots * kSlotBytes;

/// Which kernel computes the logits. Both give the same logits up to the accumulation order and
/// precision of the tensor cores (see docs/cuda-backend.md); each is deterministic, so a slot's
/// logit depends only on its key, scale, q and weights, never on where its page sits.
enum class IndexerKernel {
  /// mma.sync f16 m16n8k16 on fp8 converted to f16 (exact products, fp32 accumulation).
  kMmaSync,
  /// Hopper wgmma with native fp8 e4m3 operands from shared memory (sm_90a only).
  kWgmma,
};

/// Arguments of one launch (device pointers).
struct PagedIndexerArgs {
  const uint8_t* q = nullptr;      ///< [batch * next_n][64][128] fp8 e4m3
  const float* weights = nullptr;  ///< [batch * next_n][64]
  const uint8_t* kv = nullptr;     ///< pages of kPageBytes
  const int32_t* table = nullptr;  ///< [batch][table_stride] physical page of each position
  int64_t table_stride = 0;
  const int32_t* lens = nullptr;  ///< row r of sequence b has lens[b * lens_stride + r] slots
  int64_t lens_stride = 0;
  float* logits = nullptr;  ///< [batch * next_n][logits_stride]; slots >= len untouched
  int64_t logits_stride = 0;
  int32_t batch = 0;
  int32_t next_n = 1;
  int32_t max_pages = 0;  ///< upper bound on pages per row (fixes the grid)
  /// Loads in flight. kMmaSync: 8-slot tiles per warp, 4, 8 or 12. kWgmma: pages in each
  /// CTA's ring, clamped to [4, 7] (4 and 5 fit 4 CTAs per SM, 6 and 7 fit 3).
  int32_t stages = 8;
  IndexerKernel kernel = IndexerKernel::kMmaSync;
  /// Pages per CTA; 0 chooses from the problem size and the GPU (tests set it to exercise
  /// long rings). kWgmma takes at most 64.
  int32_t chunk_pages = 0;
  /// Share each row's own pages out over all of the grid's CTAs of that row (chunks of
  /// ceil(pages / CTAs per row)) instead of chunks sized for max_pages. The grid is the same
  /// (sized for max_pages); a row shorter than max_pages, such as a sparse stage's compacted
  /// row, then still uses every CTA, each with fewer pages. The logits are the same bit for bit.
  bool spread = false;
  /// kWgmma: launch as a programmatic dependent launch (Hopper): the kernel may be launched
  /// while the previous kernel of the stream finishes and waits for it before its first memory
  /// access, and lets the next kernel of the stream be launched early the same way (if that one
  /// was launched so). The order of effects is the stream's either way.
  bool programmatic = false;
};

/// Launches the indexer on `stream` (no synchronisation; graph-capturable).
absl::Status LaunchPagedIndexer(const PagedIndexerArgs& args, cudaStream_t stream);

/// Name of a kernel variant ("mma.sync", "wgmma").
const char* IndexerKernelName(IndexerKernel k);

/// Decodes one fp8 e4m3 byte (for host-side references).
float Fp8E4m3ToFloat(uint8_t v);

}  // namespace spin
