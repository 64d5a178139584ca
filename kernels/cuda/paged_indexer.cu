// Reference paged indexer: fp8 e4m3 tensor-core MMA (mma.sync m16n8k32, sm_89+).
//
// One CTA per (query row, chunk of pages); each warp computes 8-slot tiles: 64 heads x 8 slots
// x 128 dims as 4 m-tiles x 4 k-steps of m16n8k32, then ReLU, the head weights, the reduction
// over heads and the slot's scale. The head dimension is consumed in a permuted order (the
// same permutation for q and k, so the dot products are unchanged) that lets each lane load
// its key bytes with two 16-byte loads: a warp reads 8 whole 128-byte key rows per tile.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "spin/paged_indexer.h"

namespace spin {
namespace {

constexpr int kWarps = 8;
constexpr int kChunkPages = 32;

__device__ __forceinline__ void MmaE4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // built for an architecture without fp8 MMA
#endif
}

template <int kTilesPerIter>
__global__ void __launch_bounds__(kWarps * 32) PagedIndexerKernel(PagedIndexerArgs a) {
  const int row = blockIdx.y;
  const int seq = row / a.next_n, r = row % a.next_n;
  const int len = a.lens[seq * a.lens_stride + r];
  const int pages = (len + kPageSlots - 1) / kPageSlots;
  const int p0 = blockIdx.x * kChunkPages;
  if (len <= 0 || p0 >= pages) return;
  const int p1 = min(p0 + kChunkPages, pages);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  // q fragments: m-tile mt (heads mt*16 ..), k-step s covers head dims t*32 + s*8 + [0, 8).
  const uint8_t* q = a.q + static_cast<int64_t>(row) * kIndexerHeads * kIndexerDim;
  uint32_t qa[4][4][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint2 lo = *reinterpret_cast<const uint2*>(q + (mt * 16 + g) * kIndexerDim + t * 32 + s * 8);
      const uint2 hi =
          *reinterpret_cast<const uint2*>(q + (mt * 16 + g + 8) * kIndexerDim + t * 32 + s * 8);
      qa[mt][s][0] = lo.x;
      qa[mt][s][2] = lo.y;
      qa[mt][s][1] = hi.x;
      qa[mt][s][3] = hi.y;
    }
  }
  float w[4][2];
  const float* wr = a.weights + static_cast<int64_t>(row) * kIndexerHeads;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    w[mt][0] = wr[mt * 16 + g];
    w[mt][1] = wr[mt * 16 + g + 8];
  }
  const int32_t* table = a.table + seq * a.table_stride;
  float* out = a.logits + static_cast<int64_t>(row) * a.logits_stride;

  // Tiles of 8 slots; warp w takes tiles u = first + w + 8*i, kTilesPerIter at a time so their
  // loads are in flight together.
  const int first = p0 * 8, last = p1 * 8;
  for (int u0 = first + warp; u0 < last; u0 += kWarps * kTilesPerIter) {
    uint4 kb[kTilesPerIter][2];
    const uint8_t* page[kTilesPerIter];
#pragma unroll
    for (int i = 0; i < kTilesPerIter; ++i) {
      const int u = u0 + i * kWarps;
      page[i] = nullptr;
      if (u < last) {
        page[i] = a.kv + static_cast<int64_t>(table[u / 8]) * kPageBytes;
        const uint8_t* krow = page[i] + ((u % 8) * 8 + g) * kIndexerDim + t * 32;
        kb[i][0] = *reinterpret_cast<const uint4*>(krow);
        kb[i][1] = *reinterpret_cast<const uint4*>(krow + 16);
      }
    }
#pragma unroll
    for (int i = 0; i < kTilesPerIter; ++i) {
      const int u = u0 + i * kWarps;
      if (u >= last) break;
      float acc[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
        MmaE4m3(acc[mt], qa[mt][0], kb[i][0].x, kb[i][0].y);
        MmaE4m3(acc[mt], qa[mt][1], kb[i][0].z, kb[i][0].w);
        MmaE4m3(acc[mt], qa[mt][2], kb[i][1].x, kb[i][1].y);
        MmaE4m3(acc[mt], qa[mt][3], kb[i][1].z, kb[i][1].w);
      }
      // acc[mt][0..1]: head mt*16+g, slots 2t, 2t+1; acc[mt][2..3]: head mt*16+g+8.
      float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        s0 += w[mt][0] * fmaxf(acc[mt][0], 0.0f) + w[mt][1] * fmaxf(acc[mt][2], 0.0f);
        s1 += w[mt][0] * fmaxf(acc[mt][1], 0.0f) + w[mt][1] * fmaxf(acc[mt][3], 0.0f);
      }
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        s0 += __shfl_xor_sync(0xFFFFFFFFu, s0, o);
        s1 += __shfl_xor_sync(0xFFFFFFFFu, s1, o);
      }
      if (g == 0) {
        const int in_page = (u % 8) * 8 + t * 2;
        const float* scale =
            reinterpret_cast<const float*>(page[i] + kPageSlots * kIndexerDim) + in_page;
        const int slot = (u / 8) * kPageSlots + in_page;
        if (slot < len) out[slot] = s0 * scale[0];
        if (slot + 1 < len) out[slot + 1] = s1 * scale[1];
      }
    }
  }
}

}  // namespace

absl::Status LaunchPagedIndexer(const PagedIndexerArgs& a, cudaStream_t stream) {
  if (a.batch <= 0 || a.next_n <= 0 || a.max_pages <= 0) return absl::OkStatus();
  if (!a.q || !a.weights || !a.kv || !a.table || !a.lens || !a.logits) {
    return absl::InvalidArgumentError("paged indexer: every pointer argument is required");
  }
  const dim3 grid((a.max_pages + kChunkPages - 1) / kChunkPages, a.batch * a.next_n);
  switch (a.tiles_per_iter) {
    case 1:
      PagedIndexerKernel<1><<<grid, kWarps * 32, 0, stream>>>(a);
      break;
    case 4:
      PagedIndexerKernel<4><<<grid, kWarps * 32, 0, stream>>>(a);
      break;
    default:
      PagedIndexerKernel<2><<<grid, kWarps * 32, 0, stream>>>(a);
      break;
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("paged indexer launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

float Fp8E4m3ToFloat(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xF, man = v & 7;
  if (exp == 0xF && man == 7) return NAN;
  const float mag = exp == 0 ? std::ldexp(static_cast<float>(man) / 8.0f, -6)
                             : std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
  return sign ? -mag : mag;
}

}  // namespace spin
