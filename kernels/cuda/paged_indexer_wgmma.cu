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
// Each compacted page is one block of the union. The warpgroup hands each page's 64 logits to a
// fifth warp (the EMA warp) through a ring of four shared-memory buffers (mbarriers); the EMA
// warp applies each page's EMA at its own pace, up to four pages behind: lane l updates
// V[base + 2l + k] and, at or before the query, D[q - base - 2l - k] (k = 0, 1) from state it
// loaded four pages ahead, writes the block's V summary, and adds the observed and non-finite
// counts to the layer's statistics once per CTA. Rows r > 0 only compute logits, and their EMA
// warp leaves at once.
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

// What the fused mode needs beyond the indexer's arguments.
struct FusedEma {
  Dev d;
  int layer = 0;
  // Select's publication in the same kernel (SelectIndexAndObserve): the table is the engine's
  // block table, the union and the compacted lengths are read from the layer's select-ahead
  // record, and the kernel writes Select's outputs (union, compacted table and lengths, count)
  // and statistics as PublishKernel does.
  bool publish = false;
};

constexpr int kThreads = 128;                         // one warpgroup (the MMA's threads)
constexpr int kTileBytes = kPageSlots * kIndexerDim;  // 8 KB: 64 rows of 128 bytes
constexpr int kScaleBytes = kPageSlots * 4;           // 256 B
constexpr int kMaxChunk = 64;                         // pages per CTA (the table copy in smem)
constexpr int kChunkTarget = 48;                      // automatic chunks stay at or below this
constexpr int64_t kMaxGridRows = 65535;               // rows are the grid's y dimension

template <int kStages>
constexpr size_t SmemBytes() {
  // q tile, key tiles, scales, the chunk's page ids, and up to 1 KB to align the tiles.
  return kTileBytes * (1 + kStages) + kScaleBytes * kStages + kMaxChunk * 4 + 1024;
}

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
  int max_slots = 0;
  T* v = nullptr;
  T* dd = nullptr;
  float* vsum = nullptr;
  float alpha = 0, beta = 0;
};

// Whether slot i has a V entry (below the array's end) and a D entry (also at or before the
// query: D[q - i]).
template <typename T>
__device__ __forceinline__ bool HasV(const EmaTarget<T>& x, int i) {
  return i < x.max_slots;
}
template <typename T>
__device__ __forceinline__ bool HasD(const EmaTarget<T>& x, int i) {
  return i < x.max_slots && i <= x.q;
}

// The EMA warp's two slots of a page's block (slots 2 lane + k): V[i] and, at or before the
// query, D[q - i] (i = base + 2 lane + k), loaded kEmaAhead pages before the warp applies that
// page (under a saturated memory system a load's latency is longer than one page of the CTA's
// loop). Blocks differ from page to page and the D offsets q - i of a row are distinct, so a
// load for a later page never reads what an earlier page writes. Entries that do not exist are
// not loaded (PageEma asks HasV and HasD again rather than keeping flags in the ring).
template <typename T>
struct PairState {
  typename cuda_kernels::StateBits<T>::E v[2]{}, dv[2]{};
};
template <typename T>
__device__ __forceinline__ PairState<T> LoadPair(const EmaTarget<T>& x, bool page, int block,
                                                 int lane) {
  using B = cuda_kernels::StateBits<T>;
  PairState<T> st;
  if (!page) return st;  // past the chunk's last page
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int i = block * kPageSlots + 2 * lane + k;
    if (HasV(x, i)) st.v[k] = B::Load(x.v + i);
    if (HasD(x, i)) st.dv[k] = B::Load(x.dd + (x.q - i));
  }
  return st;
}

// Folds a V entry into the block summary's running key (`unset` once any entry is NaN).
__device__ __forceinline__ void SummaryKey(float v, unsigned& key, unsigned& unset) {
  if (v != v) {
    unset = 1;
  } else {
    const unsigned kk = cuda_kernels::FloatKey(v);  // above 0 for every float
    key = kk > key ? kk : key;
  }
}

// The EMA warp's work for one page (compacted block sg, logical block `block`): its two slots'
// updates from the page's logits z (its slots 2 lane and 2 lane + 1), then the block's V
// summary (NaN if any entry is unset, else the largest; FloatKey maps -0 to +0, as
// VSummaryKernel writes it). A whole page (64 slots of the row, every one before the array's end
// and at or before the query: every page but a row's last and the query's) takes a path with
// only the finiteness test per slot; the other path asks every condition per slot. Both apply
// the same updates.
template <typename T>
__device__ __forceinline__ void PageEma(const EmaTarget<T>& x, int sg, int block, int len, int lane,
                                        float2 z, const PairState<T>& st, unsigned& obs,
                                        unsigned& bad) {
  using B = cuda_kernels::StateBits<T>;
  const int cnt = min(kPageSlots, len - sg * kPageSlots);
  const int last = block * kPageSlots + kPageSlots - 1;
  unsigned key = 0, unset = 0;
  if (cnt == kPageSlots && HasD(x, last)) {  // warp-uniform
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int i = block * kPageSlots + 2 * lane + k;
      const float zk = k == 0 ? z.x : z.y;
      float cur = B::Get(st.v[k]);
      if (isfinite(zk)) {
        ++obs;
        const float bz = ScaledScore(zk, x.beta);
        const auto nv = B::Put(EmaUpdateScaled(cur, zk, x.alpha, bz));
        B::Store(x.v + i, nv);
        cur = B::Get(nv);
        B::Store(x.dd + (x.q - i), B::Put(EmaUpdateScaled(B::Get(st.dv[k]), zk, x.alpha, bz)));
      } else {
        ++bad;
      }
      SummaryKey(cur, key, unset);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int kr = 2 * lane + k, i = block * kPageSlots + kr;
      if (!HasV(x, i)) continue;
      float cur = B::Get(st.v[k]);
      if (kr < cnt) {
        const float zk = k == 0 ? z.x : z.y;
        if (!isfinite(zk)) {
          ++bad;
        } else {
          ++obs;
          const float bz = ScaledScore(zk, x.beta);
          const auto nv = B::Put(EmaUpdateScaled(cur, zk, x.alpha, bz));
          B::Store(x.v + i, nv);
          cur = B::Get(nv);
          if (HasD(x, i)) {  // D[q - i]: the slot is at or before the query
            B::Store(x.dd + (x.q - i), B::Put(EmaUpdateScaled(B::Get(st.dv[k]), zk, x.alpha, bz)));
          }
        }
      }
      SummaryKey(cur, key, unset);
    }
  }
  key = __reduce_max_sync(0xFFFFFFFFu, key);
  unset = __reduce_or_sync(0xFFFFFFFFu, unset);
  if (lane == 0) {
    const uint32_t bits = (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
    x.vsum[block] = unset      ? __int_as_float(0x7FC00000)
                    : key == 0 ? -INFINITY
                               : __uint_as_float(bits);
  }
}

// One warpgroup computes the logits; in the fused mode a fifth warp (the EMA warp) applies the
// EMA from the logits the warpgroup leaves in a ring of kZBufs shared-memory buffers, at its own
// pace: the two sides are coupled only through that ring, a full and an empty mbarrier per
// buffer, so the warpgroup waits for the EMA warp only when it is kZBufs pages behind, and the
// EMA warp takes no part in the warpgroup's per-page barrier. (Measured on the H200 for issue 20,
// bench/results/fused-h200-e1fbb70.md: the warpgroup applying the EMA in its own epilogue, its
// state copied with the keys, was slower, 200 us against 178-184 at 64 x 128K; so were two EMA
// warps taking alternate pages at batch 16, and word accesses to the bf16 pairs.)
template <bool kFused>
constexpr int CtaThreads() {
  return kFused ? kThreads + 32 : kThreads;
}
constexpr int kZBufs = 4;     // page i's logits are in buffer i % 4 (the use's parity: (i / 4) % 2)
constexpr int kEmaAhead = 4;  // pages whose state the EMA warp has loaded before it applies them
static_assert(kEmaAhead == kZBufs, "the EMA warp's loop takes the ring and the buffers together");
// The warpgroup's own per-page barrier in the fused mode (0 is __syncthreads).
constexpr int kBarWarpgroup = 1;

// mbarrier operations on shared memory (CTA scope): arrive releases this thread's earlier
// accesses, and a completed wait acquires those of every thread that arrived in that phase.
__device__ __forceinline__ void MbarInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SharedAddress(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SharedAddress(bar)) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(SharedAddress(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// The fused mode keeps four CTAs per SM, as many as the shared memory of 4 or 5 stages allows:
// at most 102 registers a thread in its 160-thread CTA (the plain kernel, 128 threads at 64
// registers, needs no bound; giving it one changes its register allocation).
template <bool kFused>
constexpr int MinCtasPerSm() {
  return kFused ? 4 : 1;
}

template <int kStages, bool kFused, typename T>
__global__ void __launch_bounds__(CtaThreads<kFused>(), MinCtasPerSm<kFused>())
    PagedIndexerWgmmaKernel(PagedIndexerArgs a, int chunk, FusedEma f) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  // A programmatic launch (PagedIndexerArgs::programmatic): the next kernel may be launched now;
  // wait for the previous one before the first memory access.
  if (a.programmatic) cuda_kernels::StepKernelEntry();
  const int row = blockIdx.y;
  const int seq = row / a.next_n, r = row % a.next_n;  // seq: the entry (batch place)
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  int len = 0;
  int64_t at = 0;  // publish: the (layer, entry)'s select-ahead record
  if constexpr (kFused) {
    if (f.publish) {
      // PublishKernel's rules: nothing for an entry past the device's batch (a refused batch),
      // an empty union for padding (or a sequence reset since the step began).
      const Dev& d = f.d;
      // The batch size, the entry and the record's length load together (seq < the host's batch
      // <= max_seqs: in bounds whatever the device's batch says).
      at = d.Ahead(f.layer, seq);
      const int batch_n = d.batch->n;
      const StepEntry en = d.entries[seq];
      const int rec_len = d.ahead_len[at * d.max_rows + r];
      if (seq >= batch_n) return;
      const bool live = cuda_kernels::Served(en);
      len = live ? rec_len : 0;
      if (blockIdx.x == 0 && tid == 0) {
        d.compact_len[static_cast<int64_t>(seq) * d.max_rows + r] = len;
        if (r == 0) {
          const int2 info = d.ahead_info[at];
          d.union_count[seq] = live ? info.x : 0;
          if (seq == 0) d.batch->selected_layer = f.layer;
          if (en.seq >= 0) {  // a sequence-less entry (dense or padding) counts nothing
            cuda_kernels::AddSelectCounts(d.stats + f.layer, info.x,
                                          cuda_kernels::BlocksOf(d, en.ctx_len + d.batch->rows - 1),
                                          info.y != 0);
          }
        }
      }
    } else {
      len = a.lens[seq * a.lens_stride + r];
    }
  } else {
    len = a.lens[seq * a.lens_stride + r];
  }
  if constexpr (kFused) {
    // Observe's validation of the entry, which the Probe launch after this kernel then skips
    // (ProbeKernel's rule, row 0 only): a live entry with a compacted row longer than the logits
    // stride records the error and is not applied; an applied one is no longer fresh. Before any
    // early return, so it is done whatever the chunk's pages.
    if (blockIdx.x == 0 && r == 0 && tid == 0) {
      const Dev& d = f.d;
      const int batch_n = d.batch->n;
      const StepEntry en = d.entries[seq];
      if (seq < batch_n && en.seq >= 0) {
        const int32_t* lens = f.publish ? d.ahead_len + at * d.max_rows
                                        : d.compact_len + static_cast<int64_t>(seq) * d.max_rows;
        int len0 = 0;
        if (!cuda_kernels::RowLensFitStride(lens, d.max_rows, d.batch->rows, a.logits_stride, 0,
                                            len0)) {
          cuda_kernels::RecordError(d.error, kArenaBadStride);
        } else {
          uint8_t* fresh = d.fresh + static_cast<int64_t>(en.seq) * d.layers + f.layer;
          if (*fresh != 0) *fresh = 0;
        }
      }
    }
  }
  // Never past the row's table, whatever the length says.
  const int pages = min((len + kPageSlots - 1) / kPageSlots, a.max_pages);
  // With `spread`, the row's own pages over all of its CTAs (never more than `chunk` each).
  const int cr =
      a.spread ? min(chunk, (pages + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x))
               : chunk;
  const int p0 = blockIdx.x * cr;
  if (len <= 0 || p0 >= pages) return;
  const int n = min(p0 + cr, pages) - p0;
  // The warpgroup (in the fused mode warp 4 is the EMA warp; the plain kernel has no other).
  const bool mma = !kFused || tid < kThreads;

  // Layout: [q tile][kStages key tiles] (1024-aligned), [kStages x 64 scales], [chunk page ids].
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t q_s = (raw + 1023u) & ~1023u;
  const uint32_t k_s = q_s + kTileBytes;
  uint8_t* const base = smem_raw + (q_s - raw);
  float* const scale_s = reinterpret_cast<float*>(base + kTileBytes * (1 + kStages));
  int32_t* const page_s = reinterpret_cast<int32_t*>(scale_s + kStages * kPageSlots);
  const uint32_t scale_a = q_s + kTileBytes * (1 + kStages);

  __shared__ int32_t s_block[kFused ? kMaxChunk : 1];  // fused: the chunk's logical blocks
  if constexpr (kFused) {
    if (f.publish) {
      // The chunk's union blocks and their pages through the engine's block table; the CTAs of
      // the widest row (the last: its pages are the whole union) publish them.
      const Dev& d = f.d;
      if (tid < n) {
        const int k = p0 + tid;
        const int32_t id = d.ahead_ids[at * d.max_blocks + k];
        const int32_t ph = a.table[seq * a.table_stride + id];
        page_s[tid] = ph;
        s_block[tid] = id;
        if (r == a.next_n - 1) {
          d.union_ids[static_cast<int64_t>(seq) * d.max_blocks + k] = id;
          d.phys[static_cast<int64_t>(seq) * d.max_blocks + k] = ph;
        }
      }
    } else if (tid < n) {
      page_s[tid] = a.table[seq * a.table_stride + p0 + tid];
    }
  } else if (tid < n) {
    page_s[tid] = a.table[seq * a.table_stride + p0 + tid];
  }
  // q: 512 chunks of 16 bytes, 4 per thread, into the swizzled layout (head h = chunk / 8).
  const uint8_t* q = a.q + static_cast<int64_t>(row) * kIndexerHeads * kIndexerDim;
  if (mma) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int x = tid + j * kThreads, h = x / 8, c = x % 8;
      CpAsync16(q_s + h * 128 + ((c ^ (h % 8)) << 4), q + x * 16);
    }
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
  __shared__ __align__(8) float s_z[kZBufs][kPageSlots];  // fused mode: page i's in i % kZBufs
  __shared__ uint64_t s_full[kZBufs], s_empty[kZBufs];    // fused mode: the ring's mbarriers
  unsigned obs = 0, bad = 0;
  if constexpr (kFused) {
    const Dev& d = f.d;
    if (r == 0) {
      const StepEntry en = d.entries[seq];
      int len0 = 0;
      const int32_t* lens = f.publish ? d.ahead_len + at * d.max_rows
                                      : d.compact_len + static_cast<int64_t>(seq) * d.max_rows;
      const bool fit =
          cuda_kernels::RowLensFitStride(lens, d.max_rows, d.batch->rows, a.logits_stride, 0, len0);
      x.on = cuda_kernels::RowApplied(seq, d.batch->n, en.seq, 0, d.batch->rows, 1, fit);
      if (x.on) {
        x.q = en.q_pos;
        x.max_slots = d.max_slots;
        x.v = reinterpret_cast<T*>(d.Record(en.seq, f.layer));
        x.dd = x.v + d.max_slots;
        x.vsum = d.VSum(en.seq, f.layer);
        x.alpha = d.policy->alpha;
        x.beta = d.policy->beta;
        const int32_t* ids = d.union_ids + static_cast<int64_t>(seq) * d.max_blocks;
        if (!f.publish && tid < n) s_block[tid] = ids[p0 + tid];
      }
    }
    if (tid < kZBufs) {
      MbarInit(&s_full[tid], kThreads);  // the warpgroup's threads arrive
      MbarInit(&s_empty[tid], 32);       // the lanes of the EMA warp that read it arrive
    }
  }
  __syncthreads();  // page ids and the mbarriers visible
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
    }
    CpAsyncCommit();  // an empty group past the end keeps the wait count uniform
  };

  // The warpgroup and the EMA warp run loops of their own, so that neither's registers are live
  // in the other's: the EMA warp's ring of state loads never raises the warpgroup's register
  // count (the CTAs per SM).
  if (kFused && !mma) {
    if (!x.on) return;  // a row whose Observe applies no EMA: the warpgroup alone
    // The state entries of its pages to come, a register ring: page i's are in
    // ahead[i % kEmaAhead], loaded kEmaAhead pages before; the loop is unrolled by the ring's
    // depth so that every index is a constant and nothing is shifted.
    PairState<T> ahead[kEmaAhead];
#pragma unroll
    for (int j = 0; j < kEmaAhead; ++j) {
      ahead[j] = LoadPair(x, j < n, s_block[min(j, n - 1)], lane);
    }
    for (int i0 = 0; i0 < n; i0 += kEmaAhead) {
#pragma unroll
      for (int u = 0; u < kEmaAhead; ++u) {
        const int i = i0 + u;
        if (i >= n) break;
        const int zb = u;  // i % kZBufs: i0 is a multiple of kZBufs (= kEmaAhead)
        MbarWait(&s_full[zb], (i0 / kZBufs) & 1);  // page i's logits are in s_z[zb]
        const float2 z = *reinterpret_cast<const float2*>(&s_z[zb][2 * lane]);
        MbarArrive(&s_empty[zb]);  // the warpgroup may write page i + kZBufs's there
        const PairState<T> cur = ahead[u];
        const int nx = i + kEmaAhead;  // its loads are used kEmaAhead pages from now
        ahead[u] = LoadPair(x, nx < n, s_block[min(nx, n - 1)], lane);
        PageEma(x, p0 + i, s_block[i], len, lane, z, cur, obs, bad);
      }
    }
    obs = __reduce_add_sync(0xFFFFFFFFu, obs);
    bad = __reduce_add_sync(0xFFFFFFFFu, bad);
    if (lane == 0 && (obs | bad)) cuda_kernels::AddLayerCounts(f.d.stats + f.layer, obs, bad);
    return;
  }
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i);
  const uint64_t desc_q = Desc(q_s);
  const int r0 = warp * 16 + g;  // this thread's slots in the page: r0 and r0 + 8
  for (int i = 0; i < n; ++i) {
    CpAsyncWait<kStages - 2>();  // this thread's copies of q and page i have landed
    // cp.async writes are generic-proxy; wgmma reads shared memory through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    // Everyone's copies of page i are visible, and everyone is done with page i - 1 (whose
    // stage the next copy reuses).
    if constexpr (kFused) {
      asm volatile("bar.sync %0, %1;\n" ::"n"(kBarWarpgroup), "n"(kThreads) : "memory");
    } else {
      __syncthreads();
    }
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
    const float z = t < 2 ? (t == 0 ? s0 : s1) * scale_s[s * kPageSlots + kr] : 0.0f;
    if (t < 2) {
      const int slot = (p0 + i) * kPageSlots + kr;
      // Fused mode: the lengths are SPIN's, the stride the caller's; a row longer than the
      // stride is not written past it (the entry is not applied and its error is recorded above).
      if (slot < len && (!kFused || slot < a.logits_stride)) out[slot] = z;
    }
    if (kFused && x.on) {  // hand page i's logits to the EMA warp
      const int zb = i % kZBufs;
      // The EMA warp is done with page i - kZBufs (that use of the buffer had parity
      // (i / kZBufs - 1) & 1).
      if (i >= kZBufs) MbarWait(&s_empty[zb], ((i / kZBufs) & 1) ^ 1);
      if (t < 2) s_z[zb][kr] = z;
      MbarArrive(&s_full[zb]);
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
  constexpr size_t kSmem = SmemBytes<kStages>();
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
          &per_sm, PagedIndexerWgmmaKernel<kStages, kFused, T>, CtaThreads<kFused>(), kSmem);
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
  if (a.programmatic) {
    // cudaLaunchKernelEx returns this launch's own error; a failure is also the runtime's last
    // error, taken here so that it is not reported again by a later launch.
    const cudaError_t e = cuda_kernels::LaunchSmem(PagedIndexerWgmmaKernel<kStages, kFused, T>,
                                                   grid, dim3(CtaThreads<kFused>()), kSmem, stream,
                                                   a, static_cast<int>(chunk), f);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(
          absl::StrCat("paged indexer (wgmma) launch: ", cudaGetErrorString(e)));
    }
    return absl::OkStatus();
  }
  PagedIndexerWgmmaKernel<kStages, kFused, T>
      <<<grid, CtaThreads<kFused>(), kSmem, stream>>>(a, static_cast<int>(chunk), f);
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

absl::Status CheckIndexerEma(int64_t rows) {
  if (absl::Status s = CheckSm90(); !s.ok()) return s;
  if (rows > kMaxGridRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("the fused mode takes at most ", kMaxGridRows,
                     " rows (entries x rows) a launch; this step has ", rows));
  }
  return absl::OkStatus();
}

// The caller has checked CheckIndexerEma (the data plane does, before any launch of the call).
absl::Status LaunchIndexerEma(const cuda_kernels::Dev& d, int layer, const PagedIndexerArgs& a,
                              bool publish, cudaStream_t stream) {
  FusedEma f;
  f.d = d;
  f.layer = layer;
  f.publish = publish;
  return d.dtype_bytes == 2 ? LaunchStages<true, uint16_t>(a, f, stream)
                            : LaunchStages<true, float>(a, f, stream);
}

}  // namespace spin::internal
