// The row top-k of spin/row_topk.h on the GPU: one CTA per row. Four radix passes of 8 bits
// find the key of the k-th largest logit among the row's first `len` (a 256-bin histogram per
// pass, warp-aggregated shared atomics), then one ordered pass writes the indices of every key
// above it and of the first ties, in ascending index order (two block scans per tile), so the
// output equals the CPU reference's exactly.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "absl/strings/str_cat.h"
#include "spin/row_topk.h"

namespace spin {
namespace {

constexpr int kThreads = 1024;
constexpr int kItems = 8;  // consecutive logits per thread per compaction tile
constexpr unsigned kAll = 0xFFFFFFFFu;

__device__ __forceinline__ uint32_t KeyAt(const float* x, int64_t i) {
  return RowTopKKey(__float_as_uint(x[i]));
}

__global__ void __launch_bounds__(kThreads) RowTopKKernel(RowTopKArgs a) {
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  const float* x = a.logits + static_cast<int64_t>(blockIdx.x) * a.logits_stride;
  int32_t* o = a.out + static_cast<int64_t>(blockIdx.x) * a.out_stride;
  const int64_t len64 = a.lens[blockIdx.x];
  const int len = static_cast<int>(len64 < 0 ? 0 : (len64 > a.width ? a.width : len64));
  const int k = a.k;
  if (len <= k) {
    for (int j = tid; j < k; j += kThreads) o[j] = j < len ? j : -1;
    return;
  }
  __shared__ uint32_t hist[256];
  __shared__ uint32_t s_prefix, s_remaining;
  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(k);
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int b = tid; b < 256; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int i0 = 0; i0 < len; i0 += kThreads) {  // uniform trip count: whole warps vote
      const int i = i0 + tid;
      const uint32_t key = i < len ? KeyAt(x, i) : 0;
      const bool in = i < len && (key & mask) == prefix;
      const unsigned active = __ballot_sync(kAll, in);
      if (in) {
        const uint32_t bin = (key >> shift) & 255u;
        const unsigned peers = __match_any_sync(active, bin);
        if (lane == __ffs(peers) - 1) atomicAdd(&hist[bin], static_cast<uint32_t>(__popc(peers)));
      }
    }
    __syncthreads();
    if (tid < 32) {
      // Lane l holds bins 255 - 8l .. 248 - 8l (descending): where does the remaining-th
      // largest key of the prefix group fall?
      uint32_t c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = hist[255 - (lane * 8 + j)];
        sum += c[j];
      }
      uint32_t incl = sum;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const uint32_t t = __shfl_up_sync(kAll, incl, d);
        if (lane >= d) incl += t;
      }
      const uint32_t excl = incl - sum;
      if (excl < remaining && remaining <= incl) {
        uint32_t cum = excl;
        for (int j = 0; j < 8; ++j) {
          if (remaining <= cum + c[j]) {
            s_prefix = prefix | (static_cast<uint32_t>(255 - (lane * 8 + j)) << shift);
            s_remaining = remaining - cum;
            break;
          }
          cum += c[j];
        }
      }
    }
    __syncthreads();
    prefix = s_prefix;
    remaining = s_remaining;
    mask |= 255u << shift;
    __syncthreads();  // every thread read s_prefix before the next pass may write it
  }
  // The k-th largest key is `prefix`: every larger key is taken, and the first `remaining`
  // equal ones in index order.
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  int out_base = 0, eq_seen = 0;
  for (int base = 0; base < len; base += kThreads * kItems) {
    int gt[kItems], eq[kItems], rank[kItems], take[kItems], pos[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = base + tid * kItems + j;
      const uint32_t key = i < len ? KeyAt(x, i) : 0;
      gt[j] = i < len && key > prefix;
      eq[j] = i < len && key == prefix;
    }
    int eq_total = 0, take_total = 0;
    Scan(scan).ExclusiveSum(eq, rank, eq_total);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      take[j] = gt[j] || (eq[j] && eq_seen + rank[j] < static_cast<int>(remaining));
    }
    Scan(scan).ExclusiveSum(take, pos, take_total);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (take[j]) o[out_base + pos[j]] = base + tid * kItems + j;
    }
    out_base += take_total;  // block aggregates: the same in every thread
    eq_seen += eq_total;
    if (out_base >= k) break;
  }
}

}  // namespace

absl::Status LaunchRowTopK(const RowTopKArgs& a, cudaStream_t stream) {
  if (absl::Status s = ValidateRowTopK(a); !s.ok()) return s;
  if (a.width > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("width ", a.width, " above 2^31 - 1"));
  }
  if (a.rows == 0) return absl::OkStatus();
  RowTopKKernel<<<static_cast<unsigned>(a.rows), kThreads, 0, stream>>>(a);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("row top-k launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace spin
