// The engine's top-k after the indexer: the k best logits of each row over the row's valid
// prefix only (vLLM's decode top-k reads each row's length the same way), so a compacted row
// costs what its length costs, not the buffer's width.
//
//   out[r][0..k) = the indices i < len[r] of the k largest logits[r][i], ties to the lower
//                  index, in ascending index order; -1 after them when len[r] < k.
//
// NaN ranks below every number (-inf included). Lengths are clamped to [0, width]. The CPU
// function is the reference; the CUDA kernel gives the same indices in the same order.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace spin {

/// The largest k a call takes.
inline constexpr int32_t kRowTopKMaxK = 8192;

/// Arguments of one call (device pointers for the CUDA launch, host pointers for the CPU one).
struct RowTopKArgs {
  const float* logits = nullptr;  ///< [rows][logits_stride]
  int64_t logits_stride = 0;
  int64_t width = 0;              ///< valid columns of a row at most (<= logits_stride)
  const int32_t* lens = nullptr;  ///< [rows]: the row's valid prefix
  int32_t rows = 0;
  int32_t k = 0;           ///< 1..kRowTopKMaxK
  int32_t* out = nullptr;  ///< [rows][out_stride], out_stride >= k
  int64_t out_stride = 0;
};

/// Checks the sizes (not the pointed-to values).
absl::Status ValidateRowTopK(const RowTopKArgs& a);

/// The reference, on the host.
absl::Status RowTopKHost(const RowTopKArgs& a);

/// One CTA per row on `stream` (radix select of the k-th key, then an ordered compaction); no
/// synchronisation, graph-capturable. CUDA builds only.
absl::Status LaunchRowTopK(const RowTopKArgs& a, cudaStream_t stream);

#if defined(__CUDACC__)
#define SPIN_ROW_TOPK_HD __host__ __device__
#else
#define SPIN_ROW_TOPK_HD
#endif

/// The order-preserving key of a logit's bits: larger floats give larger keys, NaN gives 0.
SPIN_ROW_TOPK_HD inline uint32_t RowTopKKey(uint32_t bits) {
  const bool nan = (bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0;
  if (nan) return 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

}  // namespace spin
