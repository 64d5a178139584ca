// Reference paged indexer: fp8 e4m3 keys and queries on the tensor cores (mma.sync f16).
// (The kWgmma variant is in paged_indexer_wgmma.cu; LaunchPagedIndexer below dispatches.)
//
// One CTA per (query row, chunk of pages); each warp streams its 8-slot tiles through a
// cp.async ring of `stages` tiles and computes each: 64 heads x 8 slots
// x 128 dims as 4 m-tiles x 8 k-steps of m16n8k16, then ReLU, the head weights, the reduction
// over heads and the slot's scale. The head dimension is consumed in a permuted order (the
// same permutation for q and k, so the dot products are unchanged) that lets each lane load
// its key bytes with two 16-byte copies: a warp reads 8 whole 128-byte key rows per tile.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cp_async.cuh"
#include "spin/paged_indexer.h"
#include "spin/status_macros.h"

namespace spin {
namespace internal {
// The wgmma variant (paged_indexer_wgmma.cu, built for sm_90a).
absl::Status LaunchPagedIndexerWgmma(const PagedIndexerArgs& a, cudaStream_t stream);
}  // namespace internal

namespace {

constexpr int kWarps = 8;

// Hopper has no fp8 mma.sync: PTX's e4m3 m16n8k32 compiles to an f16 HMMA plus a conversion of
// both operands on every call (measured ALU-bound on the conversions, well below the read floor;
// docs/lab/cuda-kernel-tuning.md). So q is converted to f16 once per CTA and each key byte once
// per tile, and the product runs as f16 m16n8k16 (fp8 -> f16 is exact; accumulation stays fp32).
__device__ __forceinline__ void MmaF16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two e4m3 bytes (low byte first) -> f16x2 (low half first).
__device__ __forceinline__ uint32_t Fp8x2ToF16x2(uint32_t two_bytes) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// Per warp and stage: each lane's 32 key bytes of one 8-slot tile, and the tile's 8 scales.
struct Stage {
  uint4 k[32][2];
  float scale[8];
};

// kStages tiles per warp are in flight at once: each lane copies exactly the bytes it will
// read back (cp.async into its own slots of shared memory), so no barrier is needed and the
// registers stay free for the q fragments.
template <int kStages>
__global__ void __launch_bounds__(kWarps * 32)
    PagedIndexerKernel(PagedIndexerArgs a, int chunk_pages) {
  extern __shared__ uint4 smem_raw[];
  const int row = blockIdx.y;
  const int seq = row / a.next_n, r = row % a.next_n;
  const int len = a.lens[seq * a.lens_stride + r];
  // Never past the row's table, whatever the length says.
  const int pages = min((len + kPageSlots - 1) / kPageSlots, a.max_pages);
  // With `spread`, the row's own pages over all of its CTAs (never more than chunk_pages each).
  const int chunk = a.spread ? min(chunk_pages, (pages + gridDim.x - 1) / gridDim.x) : chunk_pages;
  const int p0 = blockIdx.x * chunk;
  if (len <= 0 || p0 >= pages) return;
  const int p1 = min(p0 + chunk, pages);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  Stage* stages = reinterpret_cast<Stage*>(smem_raw) + warp * kStages;

  // q fragments as f16 for m16n8k16. The head dimension is consumed in a permuted order, the
  // same for q and k: k-step s takes dims t*32 + s*4 + {0,1} (a0/a1, b0) and + {2,3} (a2/a3,
  // b1), so a lane's key bytes for all 8 steps are 32 contiguous bytes of its key row.
  const uint8_t* q = a.q + static_cast<int64_t>(row) * kIndexerHeads * kIndexerDim;
  uint32_t qa[4][8][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const uint32_t lo =
          *reinterpret_cast<const uint32_t*>(q + (mt * 16 + g) * kIndexerDim + t * 32 + s * 4);
      const uint32_t hi =
          *reinterpret_cast<const uint32_t*>(q + (mt * 16 + g + 8) * kIndexerDim + t * 32 + s * 4);
      qa[mt][s][0] = Fp8x2ToF16x2(lo & 0xFFFFu);
      qa[mt][s][2] = Fp8x2ToF16x2(lo >> 16);
      qa[mt][s][1] = Fp8x2ToF16x2(hi & 0xFFFFu);
      qa[mt][s][3] = Fp8x2ToF16x2(hi >> 16);
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

  // This warp's tiles: u = first + warp + kWarps * i.
  const int first = p0 * 8 + warp, last = p1 * 8;
  const int count = first < last ? (last - first + kWarps - 1) / kWarps : 0;
  auto issue = [&](int i) {
    if (i < count) {
      const int u = first + i * kWarps;
      const uint8_t* page = a.kv + static_cast<int64_t>(table[u / 8]) * kPageBytes;
      const uint8_t* krow = page + ((u % 8) * 8 + g) * kIndexerDim + t * 32;
      Stage& st = stages[i % kStages];
      CpAsync16(&st.k[lane][0], krow);
      CpAsync16(&st.k[lane][1], krow + 16);
      if (g == 0) {
        CpAsync8(&st.scale[t * 2],
                 page + kPageSlots * kIndexerDim + ((u % 8) * 8 + t * 2) * sizeof(float));
      }
    }
    CpAsyncCommit();  // an empty group past the end keeps the wait count uniform
  };
  // Two tiles per round, their MMAs interleaved: 8 independent accumulator chains per warp
  // instead of 4, which hides the MMA latency at one resident CTA per SM.
  static_assert(kStages >= 4, "two tiles computed while two more are being copied");
#pragma unroll
  for (int i = 0; i < kStages - 2; ++i) issue(i);
  for (int i = 0; i < count; i += 2) {
    issue(i + kStages - 2);
    issue(i + kStages - 1);
    CpAsyncWait<kStages - 2>();  // tiles i and i + 1 have landed
    uint32_t kb[2][8][2];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const Stage& st = stages[(i + p) % kStages];
      const uint4 k0 = st.k[lane][0], k1 = st.k[lane][1];
      const uint32_t kw[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        kb[p][s][0] = Fp8x2ToF16x2(kw[s] & 0xFFFFu);
        kb[p][s][1] = Fp8x2ToF16x2(kw[s] >> 16);
      }
    }
    float acc[2][4][4];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
        acc[p][mt][0] = acc[p][mt][1] = acc[p][mt][2] = acc[p][mt][3] = 0.0f;
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
        for (int p = 0; p < 2; ++p) MmaF16(acc[p][mt], qa[mt][s], kb[p][s][0], kb[p][s][1]);
      }
    }
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      // acc[p][mt][0..1]: head mt*16+g, slots 2t, 2t+1; [2..3]: head mt*16+g+8.
      float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        s0 += w[mt][0] * fmaxf(acc[p][mt][0], 0.0f) + w[mt][1] * fmaxf(acc[p][mt][2], 0.0f);
        s1 += w[mt][0] * fmaxf(acc[p][mt][1], 0.0f) + w[mt][1] * fmaxf(acc[p][mt][3], 0.0f);
      }
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        s0 += __shfl_xor_sync(0xFFFFFFFFu, s0, o);
        s1 += __shfl_xor_sync(0xFFFFFFFFu, s1, o);
      }
      if (g == 0 && i + p < count) {
        const Stage& st = stages[(i + p) % kStages];
        const int u = first + (i + p) * kWarps;
        const int slot = (u / 8) * kPageSlots + (u % 8) * 8 + t * 2;
        if (slot < len) out[slot] = s0 * st.scale[t * 2];
        if (slot + 1 < len) out[slot + 1] = s1 * st.scale[t * 2 + 1];
      }
    }
  }
  CpAsyncWait<0>();
}

template <int kStages>
absl::Status Launch(const PagedIndexerArgs& a, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(Stage) * kStages * kWarps;
  static const cudaError_t attr = cudaFuncSetAttribute(
      PagedIndexerKernel<kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (attr != cudaSuccess) {
    return absl::InternalError(absl::StrCat("paged indexer: ", cudaGetErrorString(attr)));
  }
  // Enough CTAs to fill the GPU twice over at small batches, at most 32 pages each.
  static const int sms = [] {
    int n = 0;
    return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess ? n : 132;
  }();
  const int64_t rows = static_cast<int64_t>(a.batch) * a.next_n;
  const int64_t want_ctas = 4LL * sms;
  const int chunk = a.chunk_pages > 0
                        ? a.chunk_pages
                        : static_cast<int>(std::clamp<int64_t>(
                              (rows * a.max_pages + want_ctas - 1) / want_ctas, 1, 32));
  const dim3 grid((a.max_pages + chunk - 1) / chunk, static_cast<unsigned>(rows));
  PagedIndexerKernel<kStages><<<grid, kWarps * 32, kSmem, stream>>>(a, chunk);
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchPagedIndexer(const PagedIndexerArgs& a, cudaStream_t stream) {
  if (a.batch <= 0 || a.next_n <= 0 || a.max_pages <= 0) return absl::OkStatus();
  if (!a.q || !a.weights || !a.kv || !a.table || !a.lens || !a.logits) {
    return absl::InvalidArgumentError("paged indexer: every pointer argument is required");
  }
  auto launch = [&] {
    if (a.kernel == IndexerKernel::kWgmma) return internal::LaunchPagedIndexerWgmma(a, stream);
    switch (a.stages) {
      case 8:
        return Launch<8>(a, stream);
      case 12:
        return Launch<12>(a, stream);
      default:
        return Launch<4>(a, stream);
    }
  };
  SPIN_RETURN_IF_ERROR(launch());
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("paged indexer launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

}  // namespace spin
