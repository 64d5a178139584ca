// Reference paged indexer on Hopper's warpgroup MMA: native fp8 e4m3 operands from shared memory.
//
// One CTA (one warpgroup, 128 threads) per (query row, chunk of pages). q for the row is copied
// to shared memory once; the chunk's pages stream through a cp.async ring of `kStages` pages.
// Per page the warpgroup computes D[64 slots][64 heads] = K_page (64 x 128, K-major) x q^T
// (128 x 64, q stored as 64 heads x 128 dims, K-major) with four wgmma m64n64k32 e4m3 steps into
// fp32 registers, then ReLU, the head weights, the reduction over heads and the slot's scale.
//
// Both tiles use the 128-byte swizzle: a 128-byte row (one key or one head) is one swizzle row,
// and its 16-byte chunk c lives at chunk c ^ (row % 8) of that row; tiles start 1024-aligned.
//
// Fused mode (kFused, LaunchIndexerEma; docs/cuda-backend.md, "Fused mode"): the same kernel
// over a layer's compacted table, which also applies Observe's EMA of row 0 (the engine
// contract) to the layer's state from the logits it holds, so the EMA never reads them back.
// Each compacted page is one block of the union. The warpgroup leaves each page's 64 logits in
// shared memory; a fifth warp (the EMA warp) applies page i - 1's EMA while the warpgroup
// computes page i: lane l updates V[base + 2l + k] and, at or before the query, D[q - base - 2l -
// k] (k = 0, 1), as EmaVecKernel does, writes the block's V summary, and adds the observed and
// non-finite counts to the layer's statistics once per CTA. Rows r > 0 only compute logits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "cp_async.cuh"
#include "device_common.cuh"
#include "ema_state.cuh"
#include "spin/paged_indexer.h"

namespace spin::internal {
namespace {

using cuda_kernels::Dev;

// What the fused kernel needs beyond the indexer's arguments.
struct FusedEma {
  Dev d;
  int layer = 0;
};


constexpr int kThreads = 128;                         // one warpgroup (the MMA's threads)
constexpr int kTileBytes = kPageSlots * kIndexerDim;  // 8 KB: 64 rows of 128 bytes
constexpr int kScaleBytes = kPageSlots * 4;           // 256 B
constexpr int kMaxChunk = 64;                         // pages per CTA (the table copy in smem)
constexpr int kChunkTarget = 48;                      // automatic chunks stay at or below this

// Shared-memory matrix descriptor for a K-major tile with the 128-byte swizzle: start address
// (bits 0-13, in 16-byte units), leading byte offset (bits 16-29; not used by this layout, 1),
// stride byte offset (bits 32-45: 1024 bytes between groups of 8 rows), layout 1 = 128B swizzle
// (bits 62-63), base offset 0 (the tiles are 1024-aligned).
__device__ __forceinline__ uint64_t Desc(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// d (+)= A x B for m64n64k32, e4m3 x e4m3 -> f32. kAccumulate = 0 overwrites d.
template <int kAccumulate>
__device__ __forceinline__ void WgmmaM64N64K32(float (&d)[32], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
      "%32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "n"(kAccumulate));
}

// Keeps the compiler from moving reads or writes of the accumulators across the asynchronous
// MMA's fence and wait (the registers are the MMA's until wait_group returns).
__device__ __forceinline__ void FenceOperands(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The fused mode's target for this CTA: whether it applies the EMA, and where.
template <typename T>
struct EmaTarget {
  bool on = false;
  int q = 0;
  int dpar = 0;  // the parity of D's first entry in 4-byte words (bf16: max_slots odd)
  T* v = nullptr;
  T* dd = nullptr;
  float* vsum = nullptr;
  float alpha = 0, beta = 0;
};

// The fused mode's state ring: per stage, the page's 64 V entries and the 4-byte words covering
// its D range, copied with the page's keys (the same cp.async group), so the state's latency is
// hidden like the keys'. 512 bytes a stage (fp32: 256 + 256; bf16: 128 + 33 words).
constexpr int kStateStageBytes = 512;
constexpr int kStateDOffset = 256;  // D words' offset in a stage

template <int kStages, bool kFused>
constexpr size_t SmemBytes() {
  // q tile, key tiles, scales, the chunk's page ids, the fused mode's state ring, and up to
  // 1 KB to align the tiles.
  return kTileBytes * (1 + kStages) + kScaleBytes * kStages + kMaxChunk * 4 +
         (kFused ? kStateStageBytes * kStages : 0) + 1024;
}

// A 4-byte cp.async of which the first src_bytes (2 or 4) are read, the rest zero.
__device__ __forceinline__ void CpAsync4(uint32_t dst, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

// A page's D range: the offsets q - i of its slots i = base + t (t < 64) at or before the query,
// [jhi - tmax, jhi], and the first entry `wlo` of the 4-byte words covering it (jlo, or
// jlo - 1 for bf16 when jlo does not start a word). Empty (tmax < 0) past the query.
struct PageDRange {
  int jhi, tmax, wlo;
};
template <typename T>
__device__ __forceinline__ PageDRange PageDRangeOf(int base, int q, int dpar) {
  PageDRange r;
  r.jhi = q - base;
  r.tmax = min(r.jhi, kPageSlots - 1);
  const int jlo = r.jhi - r.tmax;
  r.wlo = sizeof(T) == 2 ? jlo - ((dpar + jlo) & 1) : jlo;
  return r;
}

// The fused mode's copies of page `block`'s state into stage `st`: V[base .. base + 63] as
// 4-byte words (bf16 pairs or fp32 entries), threads 0-63, and D's words over the page's D
// range, threads 64-127; no entry at or past max_slots is read (a word's second bf16 half past
// it is not read).
template <typename T>
__device__ __forceinline__ void CopyPageState(const EmaTarget<T>& x, const Dev& d, int block,
                                              uint32_t st, int tid) {
  constexpr int kPer = 4 / static_cast<int>(sizeof(T));  // entries per word
  const int base = block * kPageSlots;
  if (tid < kPageSlots / kPer) {
    const int j = base + kPer * tid;
    if (j < d.max_slots) {
      CpAsync4(st + 4 * tid, x.v + j, kPer == 2 && j + 1 >= d.max_slots ? 2 : 4);
    }
  } else if (tid >= 64) {
    const PageDRange r = PageDRangeOf<T>(base, x.q, x.dpar);
    const int w = tid - 64, j = r.wlo + kPer * w;  // the word's first entry
    if (r.tmax >= 0 && j <= r.jhi) {
      // bf16: a word may start at -1 (V's last entry, in the record) and end at max_slots.
      CpAsync4(st + kStateDOffset + 4 * w, x.dd + j, kPer == 2 && j + 1 >= d.max_slots ? 2 : 4);
    }
  }
}

// The fused mode's EMA of one slot (compacted page i of the chunk, logical block `block`, slot
// kr of the page) from its logit z and the state the ring holds for it; updates the V summary's
// key and unset flag of this thread, and the observed and non-finite counts.
template <typename T>
__device__ __forceinline__ void SlotEma(const EmaTarget<T>& x, const Dev& d, const uint8_t* st,
                                        int block, int kr, bool scored, float z, unsigned& key,
                                        unsigned& unset, unsigned& obs, unsigned& bad) {
  using B = cuda_kernels::StateBits<T>;
  using E = typename B::E;
  const int base = block * kPageSlots, i = base + kr;
  if (i >= d.max_slots) return;  // past the state: not part of the block
  float cur = B::Get(reinterpret_cast<const E*>(st)[kr]);
  if (scored) {
    if (!isfinite(z)) {
      ++bad;
    } else {
      ++obs;
      const float bz = ScaledScore(z, x.beta);
      const E nv = B::Put(EmaUpdateScaled(cur, z, x.alpha, bz));
      B::Store(x.v + i, nv);
      cur = B::Get(nv);
      if (i <= x.q) {  // D[q - i]: the slot is at or before the query
        const PageDRange r = PageDRangeOf<T>(base, x.q, x.dpar);
        const E dv = reinterpret_cast<const E*>(st + kStateDOffset)[x.q - i - r.wlo];
        B::Store(x.dd + (x.q - i), B::Put(EmaUpdateScaled(B::Get(dv), z, x.alpha, bz)));
      }
    }
  }
  if (cur != cur) {
    unset = 1;
  } else {
    const unsigned kk = cuda_kernels::FloatKey(cur);  // above 0 for every float
    key = kk > key ? kk : key;
  }
}

// The V summary of a block from its largest key and unset flag (NaN if any entry is unset, else
// the largest; FloatKey maps -0 to +0, as VSummaryKernel writes it).
__device__ __forceinline__ float SummaryOf(unsigned key, unsigned unset) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
  return unset ? __int_as_float(0x7FC00000) : key == 0 ? -INFINITY : __uint_as_float(bits);
}

// The fused mode keeps four CTAs per SM, as many as the shared memory of 4 or 5 stages allows
// (the plain kernel, at 64 registers, needs no bound; giving it one changes its allocation).
template <bool kFused>
constexpr int MinCtasPerSm() {
  return kFused ? 4 : 1;
}

// One warpgroup per CTA. In the fused mode (row 0 of an applied entry) the same threads apply
// the EMA in the epilogue: each page's state arrives in the ring with its keys, the thread that
// holds slot kr's logit updates V and D from it and stores them, the warps' V summary keys meet
// in shared memory, and thread 0 writes the block's summary after the next barrier.
template <int kStages, bool kFused, typename T>
__global__ void __launch_bounds__(kThreads, MinCtasPerSm<kFused>())
    PagedIndexerWgmmaKernel(PagedIndexerArgs a, int chunk, FusedEma f) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  const int row = blockIdx.y;
  const int seq = row / a.next_n, r = row % a.next_n;
  const int len = a.lens[seq * a.lens_stride + r];
  // Never past the row's table, whatever the length says.
  const int pages = min((len + kPageSlots - 1) / kPageSlots, a.max_pages);
  const int p0 = blockIdx.x * chunk;
  if (len <= 0 || p0 >= pages) return;
  const int n = min(p0 + chunk, pages) - p0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

  // Layout: [q tile][kStages key tiles] (1024-aligned), [kStages x 64 scales], [chunk page ids],
  // fused mode: [kStages state stages].
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t q_s = (raw + 1023u) & ~1023u;
  const uint32_t k_s = q_s + kTileBytes;
  uint8_t* const base = smem_raw + (q_s - raw);
  float* const scale_s = reinterpret_cast<float*>(base + kTileBytes * (1 + kStages));
  int32_t* const page_s = reinterpret_cast<int32_t*>(scale_s + kStages * kPageSlots);
  uint8_t* const state_s = reinterpret_cast<uint8_t*>(page_s + kMaxChunk);
  const uint32_t scale_a = q_s + kTileBytes * (1 + kStages);
  const uint32_t state_a = scale_a + kScaleBytes * kStages + kMaxChunk * 4;

  const int32_t* table = a.table + seq * a.table_stride + p0;
  if (tid < n) page_s[tid] = table[tid];
  // q: 512 chunks of 16 bytes, 4 per thread, into the swizzled layout (head h = chunk / 8).
  const uint8_t* q = a.q + static_cast<int64_t>(row) * kIndexerHeads * kIndexerDim;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int x = tid + j * kThreads, h = x / 8, c = x % 8;
    CpAsync16(q_s + h * 128 + ((c ^ (h % 8)) << 4), q + x * 16);
  }
  CpAsyncCommit();
  // This thread's 16 head weights: heads 8j + 2t + {0, 1} (its accumulator columns).
  float w[8][2];
  const float* wr = a.weights + static_cast<int64_t>(row) * kIndexerHeads;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 v = *reinterpret_cast<const float2*>(wr + 8 * j + 2 * t);
    w[j][0] = v.x;
    w[j][1] = v.y;
  }
  float* out = a.logits + static_cast<int64_t>(row) * a.logits_stride;
  // Fused mode: row 0 of an entry whose row 0 Observe applies (the rule of every Observe kernel).
  EmaTarget<T> x;
  __shared__ int32_t s_block[kMaxChunk];           // fused mode: the chunk's logical blocks
  __shared__ unsigned s_key[kStages], s_unset[kStages];  // fused mode: page summaries, by stage
  unsigned obs = 0, bad = 0;
  if constexpr (kFused) {
    const Dev& d = f.d;
    if (r == 0) {
      const StepEntry en = d.entries[seq];
      int len0 = 0;
      const bool fit = cuda_kernels::RowsFitStride(d, seq, d.batch->rows, a.logits_stride, 0, len0);
      x.on = cuda_kernels::RowApplied(seq, d.batch->n, en.seq, 0, d.batch->rows, 1, fit);
      if (x.on) {
        x.q = en.q_pos;
        x.dpar = sizeof(T) == 2 ? (d.max_slots & 1) : 0;
        x.v = reinterpret_cast<T*>(d.Record(en.seq, f.layer));
        x.dd = x.v + d.max_slots;
        x.vsum = d.VSum(en.seq, f.layer);
        x.alpha = d.policy->alpha;
        x.beta = d.policy->beta;
        const int32_t* ids = d.union_ids + static_cast<int64_t>(seq) * d.max_blocks;
        if (tid < n) s_block[tid] = ids[p0 + tid];
      }
    }
    if (tid < kStages) s_key[tid] = s_unset[tid] = 0;
  }
  __syncthreads();  // page ids (and the fused mode's blocks) visible

  auto issue = [&](int i) {
    if (i < n) {
      const uint8_t* page = a.kv + static_cast<int64_t>(page_s[i]) * kPageBytes;
      const int s = i % kStages;
      const uint32_t dst = k_s + s * kTileBytes;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int x = tid + j * kThreads, kr = x / 8, c = x % 8;
        CpAsync16(dst + kr * 128 + ((c ^ (kr % 8)) << 4), page + x * 16);
      }
      if (tid < kScaleBytes / 16) {
        CpAsync16(scale_a + s * kScaleBytes + tid * 16, page + kTileBytes + tid * 16);
      }
      if (kFused && x.on) CopyPageState(x, f.d, s_block[i], state_a + s * kStateStageBytes, tid);
    }
    CpAsyncCommit();  // an empty group past the end keeps the wait count uniform
  };
  // The fused mode's summary of page j (stage j % kStages), by thread 0 after the barrier that
  // follows every warp's contribution; the stage's key is cleared for its next page.
  auto summary = [&](int j) {
    if (kFused && x.on && tid == 0) {
      const int s = j % kStages;
      x.vsum[s_block[j]] = SummaryOf(s_key[s], s_unset[s]);
      s_key[s] = 0;
      s_unset[s] = 0;
    }
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  const uint64_t desc_q = Desc(q_s);
  const int r0 = warp * 16 + g;  // this thread's slots in the page: r0 and r0 + 8
  for (int i = 0; i < n; ++i) {
    CpAsyncWait<kStages - 2>();  // this thread's copies of q and page i have landed
    // cp.async writes are generic-proxy; wgmma reads shared memory through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    // Everyone's copies of page i are visible, and everyone is done with page i - 1 (whose
    // stage the next copy reuses; in the fused mode its summary key is complete).
    __syncthreads();
    if (i > 0) summary(i - 1);
    issue(i + kStages - 1);
    const int s = i % kStages;
    const uint64_t desc_k = Desc(k_s + s * kTileBytes);
    float d[32];
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    // k-step j: 32 bytes further along each 128-byte row (start address + 2 x 16 bytes).
    WgmmaM64N64K32<0>(d, desc_k, desc_q);
    WgmmaM64N64K32<1>(d, desc_k + 2, desc_q + 2);
    WgmmaM64N64K32<1>(d, desc_k + 4, desc_q + 4);
    WgmmaM64N64K32<1>(d, desc_k + 6, desc_q + 6);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    FenceOperands(d);
    // d[4j + 2i + c]: slot r0 + 8i, head 8j + 2t + c.
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s0 = __fmaf_rn(w[j][0], fmaxf(d[4 * j + 0], 0.0f), s0);
      s0 = __fmaf_rn(w[j][1], fmaxf(d[4 * j + 1], 0.0f), s0);
      s1 = __fmaf_rn(w[j][0], fmaxf(d[4 * j + 2], 0.0f), s1);
      s1 = __fmaf_rn(w[j][1], fmaxf(d[4 * j + 3], 0.0f), s1);
    }
    // The quad (t = 0..3) holds all 64 heads of slots r0 and r0 + 8.
    s0 += __shfl_xor_sync(0xFFFFFFFFu, s0, 1);
    s1 += __shfl_xor_sync(0xFFFFFFFFu, s1, 1);
    s0 += __shfl_xor_sync(0xFFFFFFFFu, s0, 2);
    s1 += __shfl_xor_sync(0xFFFFFFFFu, s1, 2);
    const int kr = r0 + 8 * t;
    if (t < 2) {
      const int slot = (p0 + i) * kPageSlots + kr;
      const float z = (t == 0 ? s0 : s1) * scale_s[s * kPageSlots + kr];
      // Fused mode: the lengths are SPIN's, the stride the caller's; a row longer than the
      // stride is not written past it (Probe records the error, and the row is not applied).
      if (slot < len && (!kFused || slot < a.logits_stride)) out[slot] = z;
      if constexpr (kFused) {
        if (x.on) {
          unsigned key = 0, unset = 0;
          SlotEma(x, f.d, state_s + s * kStateStageBytes, s_block[i], kr, slot < len, z, key,
                  unset, obs, bad);
          // The page's summary: every thread with a slot (t < 2) of every warp.
          key = __reduce_max_sync(0x33333333u, key);
          unset = __reduce_or_sync(0x33333333u, unset);
          if (lane == 0) {
            atomicMax(&s_key[s], key);
            atomicOr(&s_unset[s], unset);
          }
        }
      }
    }
  }
  if constexpr (kFused) {
    if (x.on) {
      __syncthreads();  // the last page's summary key is complete
      summary(n - 1);
      obs = __reduce_add_sync(0xFFFFFFFFu, obs);
      bad = __reduce_add_sync(0xFFFFFFFFu, bad);
      if (lane == 0 && (obs | bad)) {
        LayerStats* st = f.d.stats + f.layer;
        if (obs) {
          atomicAdd(reinterpret_cast<unsigned long long*>(&st->observed),
                    static_cast<unsigned long long>(obs));
        }
        if (bad) {
          atomicAdd(reinterpret_cast<unsigned long long*>(&st->bad_scores),
                    static_cast<unsigned long long>(bad));
        }
      }
    }
  }
  CpAsyncWait<0>();
#else
  // Built without sm_90a (kernels/CMakeLists.txt builds this file for 90a only).
  __trap();
#endif
}

template <int kStages, bool kFused, typename T>
absl::Status Launch(const PagedIndexerArgs& a, const FusedEma& f, cudaStream_t stream) {
  constexpr size_t kSmem = SmemBytes<kStages, kFused>();
  struct Config {
    cudaError_t err;
    int resident;  // CTAs resident on the whole GPU
  };
  static const Config cfg = [] {
    Config c{cudaSuccess, 0};
    c.err = cudaFuncSetAttribute(PagedIndexerWgmmaKernel<kStages, kFused, T>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (c.err == cudaSuccess) {
      c.err = cudaFuncSetAttribute(PagedIndexerWgmmaKernel<kStages, kFused, T>,
                                   cudaFuncAttributePreferredSharedMemoryCarveout,
                                   cudaSharedmemCarveoutMaxShared);
    }
    int sms = 0, per_sm = 0;
    if (c.err == cudaSuccess)
      c.err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    if (c.err == cudaSuccess) {
      c.err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &per_sm, PagedIndexerWgmmaKernel<kStages, kFused, T>, kThreads, kSmem);
    }
    c.resident = std::max(1, sms * per_sm);
    return c;
  }();
  if (cfg.err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("paged indexer (wgmma): ", cudaGetErrorString(cfg.err)));
  }
  const int64_t rows = static_cast<int64_t>(a.batch) * a.next_n;
  const int64_t P = a.max_pages;
  int64_t chunk = a.chunk_pages;
  if (chunk <= 0) {
    // CTAs per row: enough that chunks stay at most kChunkTarget pages, then rounded up so the
    // grid is close to a whole number of waves of resident CTAs.
    int64_t per_row = (P + kChunkTarget - 1) / kChunkTarget;
    const int64_t waves = std::max<int64_t>(1, (rows * per_row + cfg.resident - 1) / cfg.resident);
    per_row = std::clamp<int64_t>(waves * cfg.resident / rows, per_row, P);
    chunk = (P + per_row - 1) / per_row;
  }
  chunk = std::clamp<int64_t>(chunk, 1, kMaxChunk);
  const dim3 grid(static_cast<unsigned>((P + chunk - 1) / chunk), static_cast<unsigned>(rows));
  PagedIndexerWgmmaKernel<kStages, kFused, T>
      <<<grid, kThreads, kSmem, stream>>>(a, static_cast<int>(chunk), f);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("paged indexer (wgmma) launch: ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

// Compute capability 9.0 (sm_90a), or why not.
absl::Status CheckSm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    return absl::InternalError("paged indexer (wgmma): no CUDA device");
  }
  if (major != 9 || minor != 0) {
    return absl::UnimplementedError(
        absl::StrCat("paged indexer (wgmma): needs compute capability 9.0 (sm_90a), device is ",
                     major, ".", minor));
  }
  return absl::OkStatus();
}

template <bool kFused, typename T>
absl::Status LaunchStages(const PagedIndexerArgs& a, const FusedEma& f, cudaStream_t stream) {
  switch (std::clamp(a.stages, 4, 7)) {
    case 4:
      return Launch<4, kFused, T>(a, f, stream);
    case 5:
      return Launch<5, kFused, T>(a, f, stream);
    case 6:
      return Launch<6, kFused, T>(a, f, stream);
    default:
      return Launch<7, kFused, T>(a, f, stream);
  }
}

}  // namespace

absl::Status LaunchPagedIndexerWgmma(const PagedIndexerArgs& a, cudaStream_t stream) {
  if (absl::Status s = CheckSm90(); !s.ok()) return s;
  return LaunchStages<false, float>(a, FusedEma{}, stream);
}

absl::Status LaunchIndexerEma(const cuda_kernels::Dev& d, int layer, const PagedIndexerArgs& a,
                              cudaStream_t stream) {
  if (absl::Status s = CheckSm90(); !s.ok()) return s;
  FusedEma f;
  f.d = d;
  f.layer = layer;
  return d.dtype_bytes == 2 ? LaunchStages<true, uint16_t>(a, f, stream)
                            : LaunchStages<true, float>(a, f, stream);
}

}  // namespace spin::internal
