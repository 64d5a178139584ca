// Observe's EMA of the state: EmaVec (the engine's layout, 16-byte accesses, keeps the V
// summaries), EmaWord (other even block sizes >= 64) and Ema (any block size), one launch per
// row in row order; VSummary after the last two.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "device_common.cuh"
#include "ema_state.cuh"
#include "launchers.h"
#include "spin/arena.h"
#include "spin/numerics.h"

namespace spin::cuda_kernels {
namespace {

constexpr int kEmaThreads = 256;
constexpr int kEmaSlots = 8;  // compacted slots per thread per round (EmaKernel)
// 64-slot segments per warp per round (EmaWordKernel). One: fewer registers and more resident
// warps measured faster than more segments in flight per warp (docs/lab/cuda-kernel-tuning.md).
constexpr int kEmaSegs = 1;

// What every EMA kernel reads first for row r of entry blockIdx.y. Every warp reads the entry
// itself with independent loads (e < the host's n <= max_seqs, so they are in bounds), so the
// CTA waits for one memory latency and no barrier; rows <= kMaxRows <= 32, so lane rr checks
// row rr's compacted length against the stride. `active` (uniform over the CTA) is false when
// the row is not applied: padding, r >= accepted (1 without an accepted array), accepted out of
// range, or a stride below a compacted row. (The fresh flag is ProbeKernel's.)
struct EmaRow {
  StepEntry en;
  int rows, len;
  float alpha, beta;
  bool active;
};
__device__ __forceinline__ EmaRow EmaRowOf(const Dev& d, int layer, int r, int64_t stride,
                                           const int32_t* accepted) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  const int e = blockIdx.y;
  EmaRow w;
  const int batch_n = d.batch->n;
  w.rows = d.batch->rows;
  w.en = d.entries[e];
  const int acc_in = accepted ? accepted[e] : 0;
  const int lane_len = LaneRowLen(d, e);
  const bool fit = RowsFitWarp(lane_len, w.rows, stride);
  w.alpha = d.policy->alpha;
  w.beta = d.policy->beta;
  w.len = __shfl_sync(kAll, lane_len, r % 32);
  w.active = RowApplied(e, batch_n, w.en.seq, r, w.rows, accepted ? acc_in : 1, fit);
  return w;
}

// The CTA's observed and non-finite counts: warp sums, then one global atomic per CTA and
// counter (none when zero). Every thread of the CTA calls it.
__device__ __forceinline__ void AddEmaCounts(const Dev& d, int layer, unsigned obs, unsigned bad) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  constexpr int kWarps = kEmaThreads / 32;
  __shared__ unsigned s_obs[kWarps], s_bad[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  obs = __reduce_add_sync(kAll, obs);
  bad = __reduce_add_sync(kAll, bad);
  if (lane == 0) {
    s_obs[warp] = obs;
    s_bad[warp] = bad;
  }
  __syncthreads();
  if (warp == 0) {
    obs = __reduce_add_sync(kAll, lane < kWarps ? s_obs[lane] : 0u);
    bad = __reduce_add_sync(kAll, lane < kWarps ? s_bad[lane] : 0u);
    if (lane == 0) AddLayerCounts(d.stats + layer, obs, bad);
  }
}

// EMA update of row r for every entry; one launch per row, in row order (the prefix-valid
// replay). Within a row the compacted slots x < len_r are exactly the union's slots i < N_r,
// each once, so every V[i] and D[q - i] belongs to one thread and any schedule gives the
// reference result. Each warp takes 32 * kEmaSlots consecutive compacted slots, lane l the
// slots l, l + 32, ...: every load and store instruction of a warp covers 32 consecutive
// elements (logits 128 bytes, V and D 64 or 128), and a thread issues all its loads (block ids
// and logits, then V and D) before its first store, so kEmaSlots slots are in flight per thread.
template <typename T>
__global__ void __launch_bounds__(kEmaThreads)
    EmaKernel(Dev d, int layer, int r, const float* logits, int64_t stride,
              const int32_t* accepted) {
  StepKernelEntry();
  const int ctas = static_cast<int>(gridDim.x);
  constexpr int kWarps = kEmaThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const EmaRow w = EmaRowOf(d, layer, r, stride, accepted);
  if (!w.active) return;  // uniform over the CTA
  const StepEntry& en = w.en;
  const int len = w.len;
  const float alpha = w.alpha, beta = w.beta;
  const int b = d.block, shift = d.block_shift, q = en.q_pos + r;
  const int32_t* ids = SelIds(d, blockIdx.y);
  const float* z = logits + (static_cast<int64_t>(blockIdx.y) * w.rows + r) * stride;
  T* v = reinterpret_cast<T*>(d.Record(en.seq, layer));
  T* dd = v + d.max_slots;
  unsigned obs = 0, bad = 0;
  const int step = ctas * kEmaThreads * kEmaSlots;
  for (int x0 = (blockIdx.x * kWarps + warp) * (32 * kEmaSlots) + lane; x0 < len; x0 += step) {
    int slot[kEmaSlots];
    float zv[kEmaSlots], vv[kEmaSlots], dv[kEmaSlots];
#pragma unroll
    for (int u = 0; u < kEmaSlots; ++u) {
      const int x = x0 + u * 32;
      slot[u] = -1;
      zv[u] = 0.0f;
      if (x < len) {  // x < len_r <=> its slot is below N_r
        const int k = shift >= 0 ? x >> shift : x / b;
        slot[u] = ids[k] * b + (x - k * b);
        zv[u] = z[x];
      }
    }
#pragma unroll
    for (int u = 0; u < kEmaSlots; ++u) {
      const int i = slot[u];
      vv[u] = 0.0f;
      dv[u] = 0.0f;
      if (i >= 0) {
        vv[u] = LoadT(v, i);
        if (i <= q) dv[u] = LoadT(dd, q - i);
      }
    }
#pragma unroll
    for (int u = 0; u < kEmaSlots; ++u) {
      const int i = slot[u];
      if (i < 0) continue;
      if (!isfinite(zv[u])) {
        ++bad;
        continue;
      }
      ++obs;
      StoreT(v, i, EmaUpdate(vv[u], zv[u], alpha, beta));
      if (i <= q) StoreT(dd, q - i, EmaUpdate(dv[u], zv[u], alpha, beta));
    }
  }
  // Counts: warp sums, then one global atomic per CTA and counter (only when non-zero).
  AddEmaCounts(d, layer, obs, bad);
}

// ---------------------------------------------------------------------------------------------
// Word-access EMA (even block sizes of at least 64). Same contract and result as EmaKernel; the
// state is read and written two entries at a time (bf16x2 / float2) wherever both entries
// belong to the row's update.
//
// A block of the compacted row is cut into segments of 64 slots (the last one of each block
// and of the row may be shorter). A warp updates one segment: lane l the slots t = 2l, 2l + 1
// of it, i = base + t, where base (even) is the segment's first slot. V[base + 2l] starts an
// aligned word. The D entries of the segment, D[q - i] for the slots i <= q, are the
// contiguous range [jlo, jhi] = [q - base - tmax, q - base], mirrored and in either word
// parity; the warp stages them through shared memory by offset from the even-aligned wlo <= jlo
// so that lane l moves the word (wlo + 2l, wlo + 2l + 1) and lane 0 also the entry wlo + 64:
// a word whose two entries both lie in [jlo, jhi] moves whole, otherwise only its entry in the
// range moves (2 or 4 bytes): the entries next to the range belong to other segments' slots.
// Every address is formed only for an entry in the range (so within [0, max_slots)) or a slot
// below the row's compacted length.
//
// Within a row every V[i] and D[q - i] has one owner, so a whole-word store may write an entry
// whose score is not finite: it writes back the raw bits it read (never re-encoded).
// ---------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kEmaThreads)
    EmaWordKernel(Dev d, int layer, int r, const float* logits, int64_t stride,
                  const int32_t* accepted) {
  StepKernelEntry();
  const int ctas = static_cast<int>(gridDim.x);
  using B = StateBits<T>;
  using E = typename B::E;
  constexpr int kWarps = kEmaThreads / 32;
  __shared__ E s_d[kWarps][kEmaSegs][kEmaSegSlots + 2];  // a segment's D words, from wlo
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const EmaRow w = EmaRowOf(d, layer, r, stride, accepted);
  if (!w.active) return;  // uniform over the CTA
  const StepEntry& en = w.en;
  const int len = w.len;
  const float alpha = w.alpha, beta = w.beta;
  const int b = d.block, q = en.q_pos + r;
  const int32_t* ids = SelIds(d, blockIdx.y);
  const float* z = logits + (static_cast<int64_t>(blockIdx.y) * w.rows + r) * stride;
  T* v = reinterpret_cast<T*>(d.Record(en.seq, layer));
  T* dd = v + d.max_slots;
  // Word alignment, uniform over the row: logits and V words start at even offsets from z and
  // v; D's start parity dpar picks wlo.
  const bool z_words = (reinterpret_cast<uintptr_t>(z) & 7u) == 0;
  const bool v_words = ((reinterpret_cast<uintptr_t>(v) / sizeof(T)) & 1u) == 0;
  const int dpar = static_cast<int>((reinterpret_cast<uintptr_t>(dd) / sizeof(T)) & 1u);
  const int t = 2 * lane;  // this lane's first slot in a segment
  const int segs = EmaSegments(len, b);
  unsigned obs = 0, bad = 0;
  for (int s0 = (blockIdx.x * kWarps + warp) * kEmaSegs; s0 < segs;
       s0 += ctas * kWarps * kEmaSegs) {
    int base[kEmaSegs], cnt[kEmaSegs];
    float z0[kEmaSegs], z1[kEmaSegs];
    E v0[kEmaSegs], v1[kEmaSegs], d0[kEmaSegs], d1[kEmaSegs], d2[kEmaSegs];
    // Block ids and logits (independent).
#pragma unroll
    for (int u = 0; u < kEmaSegs; ++u) {
      base[u] = 0;
      cnt[u] = 0;
      z0[u] = 0.0f;
      z1[u] = 0.0f;
      if (s0 + u < segs) {  // uniform over the warp
        const EmaSeg g = EmaSegAt(s0 + u, len, b);
        base[u] = ids[g.k] * b + g.off;
        cnt[u] = g.cnt;
        if (t + 1 < g.cnt && z_words) {
          const float2 w = *reinterpret_cast<const float2*>(z + (g.x0 + t));
          z0[u] = w.x;
          z1[u] = w.y;
        } else {
          if (t < g.cnt) z0[u] = z[g.x0 + t];
          if (t + 1 < g.cnt) z1[u] = z[g.x0 + t + 1];
        }
      }
    }
    // V and D, all loads before the first store.
#pragma unroll
    for (int u = 0; u < kEmaSegs; ++u) {
      v0[u] = v1[u] = d0[u] = d1[u] = d2[u] = 0;
      const bool in0 = t < cnt[u], in1 = t + 1 < cnt[u];
      if (in0 && in1 && v_words) {
        B::LoadWord(v + (base[u] + t), v0[u], v1[u]);
      } else {
        if (in0) v0[u] = B::Load(v + (base[u] + t));
        if (in1) v1[u] = B::Load(v + (base[u] + t + 1));
      }
      const EmaDRange g = EmaDRangeOf(base[u], cnt[u], q, dpar);
      const int j = g.wlo + t;  // this lane's word
      const bool lo = EmaInD(g, j), hi = EmaInD(g, j + 1);
      LoadEntries(dd, j, lo, hi, d0[u], d1[u]);
      if (lane == 0 && EmaInD(g, g.wlo + 2 * 32)) d2[u] = B::Load(dd + (g.wlo + 2 * 32));
    }
    // D updates in shared memory: entry j of a segment sits at s_d[..][j - wlo].
    __syncwarp();  // the previous round's readers are done
#pragma unroll
    for (int u = 0; u < kEmaSegs; ++u) {
      s_d[warp][u][t] = d0[u];
      s_d[warp][u][t + 1] = d1[u];
      if (lane == 0) s_d[warp][u][2 * 32] = d2[u];
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kEmaSegs; ++u) {
      const EmaDRange g = EmaDRangeOf(base[u], cnt[u], q, dpar);
      // Slot t + h <= tmax: D[q - i] = D[jhi - t - h].
      if (t <= g.tmax && isfinite(z0[u])) {
        E& x = s_d[warp][u][g.jhi - t - g.wlo];
        x = B::Put(EmaUpdate(B::Get(x), z0[u], alpha, beta));
      }
      if (t + 1 <= g.tmax && isfinite(z1[u])) {
        E& x = s_d[warp][u][g.jhi - t - 1 - g.wlo];
        x = B::Put(EmaUpdate(B::Get(x), z1[u], alpha, beta));
      }
    }
    __syncwarp();
    // Stores: V, then D (the same words as loaded).
#pragma unroll
    for (int u = 0; u < kEmaSegs; ++u) {
      const bool in0 = t < cnt[u], in1 = t + 1 < cnt[u];
      const bool f0 = isfinite(z0[u]), f1 = isfinite(z1[u]);
      obs += (in0 && f0 ? 1u : 0u) + (in1 && f1 ? 1u : 0u);
      bad += (in0 && !f0 ? 1u : 0u) + (in1 && !f1 ? 1u : 0u);
      const E n0 = f0 ? B::Put(EmaUpdate(B::Get(v0[u]), z0[u], alpha, beta)) : v0[u];
      const E n1 = f1 ? B::Put(EmaUpdate(B::Get(v1[u]), z1[u], alpha, beta)) : v1[u];
      if (in0 && in1 && v_words) {
        B::StoreWord(v + (base[u] + t), n0, n1);
      } else {
        if (in0 && f0) B::Store(v + (base[u] + t), n0);
        if (in1 && f1) B::Store(v + (base[u] + t + 1), n1);
      }
      const EmaDRange g = EmaDRangeOf(base[u], cnt[u], q, dpar);
      const int j = g.wlo + t;
      const bool lo = EmaInD(g, j), hi = EmaInD(g, j + 1);
      const E a = s_d[warp][u][t], c = s_d[warp][u][t + 1];
      StoreEntries(dd, j, lo, hi, a, c);
      if (lane == 0 && EmaInD(g, g.wlo + 2 * 32)) {
        B::Store(dd + (g.wlo + 2 * 32), s_d[warp][u][2 * 32]);
      }
    }
  }
  AddEmaCounts(d, layer, obs, bad);
}

// Most entries whose segments one EMA grid shares out (EmaVecKernel with flat = 1); a larger
// batch gets a grid per entry.
constexpr int kEmaFlatMaxEntries = 512;

// The EMA for the engine's layout (b = 64, max_slots a multiple of 8, logits rows 16-byte
// aligned): EmaWordKernel's contract and result from 16-byte accesses. A segment is one
// compacted block (64 slots, fewer at the row's end); eight lanes take a segment, lane s its
// slots t = 8s .. 8s + 7: the logits as two float4 (scalars past the row's end), V as one (bf16)
// or two (fp32) aligned 16-byte words loaded and stored whole (a slot of the block past the
// row's end, or one whose score is not finite, is written back with the raw bits it read: within
// a row each V[i] has one owner). The segment's D entries, the contiguous range [jlo, jhi] of
// offsets q - i, are staged through shared memory as the aligned 16-byte chunks covering it and
// stored back whole where a chunk lies inside the range, entry by entry in the two edge chunks
// (their other entries belong to other segments). No address outside [0, max_slots) of V or D.
//
// The work is shared out by segment, not by entry: every CTA first lists the segments of the
// entries whose row r is applied (an exclusive prefix over the entries, in shared memory), and
// warp w of the grid takes the w-th contiguous run of them, four per round. So a batch whose
// rows differ in length (mixed contexts, or the dense rows of probing sequences) costs what its
// segments cost, not its longest row times the batch. With flat = 0 (batches above
// kEmaFlatMaxEntries) the list is the one entry blockIdx.y, shared out over gridDim.x CTAs.
template <typename T>
__global__ void __launch_bounds__(kEmaThreads)
    EmaVecKernel(Dev d, int layer, int r, const float* logits, int64_t stride,
                 const int32_t* accepted, int listed) {
  StepKernelEntry();
  using B = StateBits<T>;
  using E = typename B::E;
  constexpr int kWarps = kEmaThreads / 32;
  constexpr unsigned kAll = 0xFFFFFFFFu;
  constexpr int kChunk = 16 / static_cast<int>(sizeof(T));  // entries per 16-byte chunk
  constexpr int kVWords = 8 / kChunk;                       // 16-byte V words per lane
  constexpr int kMaxChunks = 64 / kChunk + 1;               // chunks covering 64 entries
  constexpr int kDWords = (kMaxChunks + 7) / 8;             // D chunks per lane
  constexpr int kWin = kMaxChunks * kChunk;
  constexpr int kPerThread = kEmaFlatMaxEntries / kEmaThreads;
  using Scan = cub::BlockScan<int, kEmaThreads>;
  __shared__ __align__(16) E s_d[kWarps][4][kWin];
  __shared__ typename Scan::TempStorage s_scan;
  // Per listed entry i: its first segment in the list (s_start[ne] = all of them), its row's
  // compacted length, its query slot and its sequence.
  __shared__ int s_start[kEmaFlatMaxEntries + 1], s_len[kEmaFlatMaxEntries];
  __shared__ int s_q[kEmaFlatMaxEntries], s_seq[kEmaFlatMaxEntries];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Every load of the plan is issued at once: none waits for another (`listed` is the batch
  // size the grid was made for, so the entries' loads need not wait for the batch header).
  const float alpha = d.policy->alpha, beta = d.policy->beta;
  const int batch_n = d.batch->n, rows = d.batch->rows;
  const bool flat = gridDim.y == 1;  // the launch gives a row per entry above kEmaFlatMaxEntries
  const int e0 = flat ? 0 : static_cast<int>(blockIdx.y);
  const int ne = flat ? min(listed, kEmaFlatMaxEntries) : 1;
  // The entries' segments: none unless the row is applied (padding, r >= accepted, accepted
  // out of range, or a stride below one of the entry's compacted rows: not applied).
  {
    int cnt[kPerThread];
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int i = static_cast<int>(threadIdx.x) + u * kEmaThreads;  // striped: every warp loads
      cnt[u] = 0;
      if (i >= ne) continue;
      const int e = e0 + i;
      const StepEntry en = d.entries[e];
      const int acc_in = accepted ? accepted[e] : 0;
      int len;
      const bool fit = RowsFitStride(d, e, rows, stride, r, len);
      const bool ok = RowApplied(e, batch_n, en.seq, r, rows, accepted ? acc_in : 1, fit);
      cnt[u] = ok ? (len + 63) / 64 : 0;
      s_len[i] = len;
      s_q[i] = en.q_pos + r;
      s_seq[i] = en.seq;
    }
    // One block scan per kEmaThreads entries (the second only for a batch above that).
    int total = 0;
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      if (u * kEmaThreads >= ne) break;  // uniform over the CTA
      if (u > 0) __syncthreads();        // the scan's storage is reused
      int start, sum;
      Scan(s_scan).ExclusiveSum(cnt[u], start, sum);
      const int i = static_cast<int>(threadIdx.x) + u * kEmaThreads;
      if (i < ne) s_start[i] = total + start;
      total += sum;
    }
    if (threadIdx.x == 0) s_start[ne] = total;
  }
  __syncthreads();
  const int total = s_start[ne];
  if (total == 0) return;  // uniform over the CTA
  // This warp's run [lo, hi) of the list: a multiple of four segments.
  const int warps = static_cast<int>(gridDim.x) * kWarps;
  const int per = (total + 4 * warps - 1) / (4 * warps) * 4;
  const int lo = (static_cast<int>(blockIdx.x) * kWarps + warp) * per;
  const int hi = min(lo + per, total);
  const int gq = lane / 8, t0 = 8 * (lane % 8), s8 = lane % 8;
  E* win = s_d[warp][gq];
  // The listed entry of this lane group's first segment: the last i with s_start[i] <= lo + gq
  // (entries without segments have s_start[i] = s_start[i + 1]).
  int li = 0;
  {
    int a = 0, c = ne;  // s_start[a] <= x < s_start[c] (s_start[ne] = total > x)
    const int x = min(lo + gq, total - 1);
    while (c - a > 1) {
      const int m = (a + c) / 2;
      if (s_start[m] <= x) {
        a = m;
      } else {
        c = m;
      }
    }
    li = a;
  }
  // The entry of the lane group's segment, kept while its segments stay in it.
  int first = 0, len = 0, q = 0, seq = 0, e = e0;
  int held = -1;  // the listed entry those are for
  unsigned obs = 0, bad = 0;
  for (int x0 = lo; x0 < hi; x0 += 4) {  // uniform over the warp
    const int gx = x0 + gq;              // this lane group's segment of the list
    const bool valid = gx < hi;
    if (valid) {
      while (s_start[li + 1] <= gx) ++li;  // the entry holding it (s_start[ne] > gx)
      if (li != held) {
        held = li;
        e = e0 + li;
        seq = s_seq[li];
        first = s_start[li];
        len = s_len[li];
        q = s_q[li];
      }
    }
    const int32_t* ids = SelIds(d, e);
    const float* z = logits + (static_cast<int64_t>(e) * rows + r) * stride;
    T* v = reinterpret_cast<T*>(d.Record(seq, layer));
    T* dd = v + d.max_slots;
    float* vsum_row = d.VSum(seq, layer);
    const int sg = gx - first;
    int base = 0, cnt = 0, jlo = 0, jhi = -1, cb = 0, nch = 0, tmax = -1;
    float zv[8];
    uint4 vw[kVWords], dw[kDWords];
#pragma unroll
    for (int k = 0; k < 8; ++k) zv[k] = 0.0f;
    if (valid) {
      const int x0s = sg * 64;
      cnt = min(64, len - x0s);
      if (t0 + 8 <= cnt) {
        const float4 a = *reinterpret_cast<const float4*>(z + x0s + t0);
        const float4 c = *reinterpret_cast<const float4*>(z + x0s + t0 + 4);
        zv[0] = a.x, zv[1] = a.y, zv[2] = a.z, zv[3] = a.w;
        zv[4] = c.x, zv[5] = c.y, zv[6] = c.z, zv[7] = c.w;
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          if (t0 + k < cnt) zv[k] = z[x0s + t0 + k];
        }
      }
      base = ids[sg] * 64;
      if (base + t0 < d.max_slots) {  // the whole block, for its summary; t0 < cnt implies it
        const uint4* vp = reinterpret_cast<const uint4*>(v + base + t0);
#pragma unroll
        for (int w = 0; w < kVWords; ++w) vw[w] = vp[w];
      }
      tmax = min(q - base, cnt - 1);
      if (tmax >= 0) {
        jhi = q - base;
        jlo = jhi - tmax;
        cb = jlo - jlo % kChunk;
        nch = (jhi - cb) / kChunk + 1;
        const uint4* dp = reinterpret_cast<const uint4*>(dd + cb);
#pragma unroll
        for (int w = 0; w < kDWords; ++w) {
          if (s8 + 8 * w < nch) dw[w] = dp[s8 + 8 * w];
        }
      } else {
        tmax = -1;
      }
    }
    __syncwarp();  // the previous round's readers of the window are done
#pragma unroll
    for (int w = 0; w < kDWords; ++w) {
      if (s8 + 8 * w < nch) *reinterpret_cast<uint4*>(win + (s8 + 8 * w) * kChunk) = dw[w];
    }
    __syncwarp();
    E* ve = reinterpret_cast<E*>(vw);
    bool finite = true;
#pragma unroll
    for (int k = 0; k < 8; ++k) finite = finite && isfinite(zv[k]);
    const bool fast = finite && t0 + 7 <= tmax && t0 + 8 <= cnt;
    float vmax = NAN;  // fast lanes: the largest new V entry (NaN if any is NaN), unrounded
    if (fast) {
      // The usual lane: eight slots in the segment, at or before the query, finite scores. Slot
      // t0 + k's D entry is xd[-k].
      obs += 8;
      E* xd = win + (jhi - t0 - cb);
      float nv[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float bz = ScaledScore(zv[k], beta);
        nv[k] = EmaUpdateScaled(B::Get(ve[k]), zv[k], alpha, bz);
        vmax = k == 0 ? nv[k] : MaxNaN(vmax, nv[k]);
        xd[-k] = B::Put(EmaUpdateScaled(B::Get(xd[-k]), zv[k], alpha, bz));
      }
      if constexpr (sizeof(T) == 2) {  // V narrowed a pair at a time
        uint32_t* vp = reinterpret_cast<uint32_t*>(vw);
#pragma unroll
        for (int k = 0; k < 4; ++k) vp[k] = FloatsToBf16x2(nv[2 * k], nv[2 * k + 1]);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) ve[k] = B::Put(nv[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int t = t0 + k;
        if (t >= cnt) continue;
        if (!isfinite(zv[k])) {
          ++bad;
          continue;
        }
        ++obs;
        const float bz = ScaledScore(zv[k], beta);
        ve[k] = B::Put(EmaUpdateScaled(B::Get(ve[k]), zv[k], alpha, bz));
        if (t <= tmax) {
          E& x = win[jhi - t - cb];
          x = B::Put(EmaUpdateScaled(B::Get(x), zv[k], alpha, bz));
        }
      }
    }
    __syncwarp();
    if (t0 < cnt) {
      uint4* vp = reinterpret_cast<uint4*>(v + base + t0);
#pragma unroll
      for (int w = 0; w < kVWords; ++w) vp[w] = vw[w];
    }
#pragma unroll
    for (int w = 0; w < kDWords; ++w) {
      const int c = s8 + 8 * w;
      if (c >= nch) continue;
      const int j0 = cb + c * kChunk;
      if (j0 >= jlo && j0 + kChunk - 1 <= jhi) {
        *reinterpret_cast<uint4*>(dd + j0) = *reinterpret_cast<const uint4*>(win + c * kChunk);
      } else {
        for (int k = 0; k < kChunk; ++k) {
          if (j0 + k >= jlo && j0 + k <= jhi) B::Store(dd + (j0 + k), win[c * kChunk + k]);
        }
      }
    }
    // The block's V summary from its updated entries below max_slots (every lane of the group
    // loaded its eight).
    float m = -INFINITY;
    int unset = 0;
    if (fast) {
      // Rounding is monotone, so the largest stored entry is the rounded largest new value.
      if (vmax != vmax) {
        unset = 1;
      } else {
        m = B::Get(B::Put(vmax));
      }
    } else if (valid && base + t0 < d.max_slots) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float x = B::Get(ve[k]);
        if (x != x) {
          unset = 1;
        } else {
          m = x > m ? x : m;
        }
      }
    }
    for (int o = 1; o < 8; o <<= 1) {
      const float om = __shfl_xor_sync(kAll, m, o);
      m = om > m ? om : m;
      unset |= __shfl_xor_sync(kAll, unset, o);
    }
    if (s8 == 0 && valid) {
      vsum_row[base / 64] = unset ? __int_as_float(0x7FC00000) : (m == 0.0f ? 0.0f : m);
    }
  }
  AddEmaCounts(d, layer, obs, bad);
}

// After EmaWordKernel / EmaKernel (EmaVecKernel keeps the summaries itself): the V summary of
// every block of each entry's union, one warp per block. Entries the EMA did not apply keep
// their V, so recomputing theirs changes nothing.
template <typename T>
__global__ void __launch_bounds__(kEmaThreads) VSummaryKernel(Dev d, int layer) {
  StepKernelEntry();
  const int e = blockIdx.y;
  const int lane = threadIdx.x % 32;
  if (e >= d.batch->n) return;
  const StepEntry en = d.entries[e];
  if (en.seq < 0) return;
  const T* v = reinterpret_cast<const T*>(d.Record(en.seq, layer));
  float* vs = d.VSum(en.seq, layer);
  const int32_t* ids = SelIds(d, e);
  const int count = d.ahead_info[d.Ahead(layer, e)].x;
  const int warps = kEmaThreads / 32;
  for (int k = blockIdx.x * warps + static_cast<int>(threadIdx.x) / 32; k < count;
       k += gridDim.x * warps) {
    const int lo = ids[k] * d.block, hi = min(lo + d.block, d.max_slots);
    float m = -INFINITY;
    int unset = 0;
    for (int i = lo + lane; i < hi; i += 32) {
      const float x = LoadT(v, i);
      if (x != x) {
        unset = 1;
      } else {
        m = x > m ? x : m;
      }
    }
    for (int o = 16; o > 0; o /= 2) {
      const float om = __shfl_xor_sync(0xFFFFFFFFu, m, o);
      m = om > m ? om : m;
      unset |= __shfl_xor_sync(0xFFFFFFFFu, unset, o);
    }
    if (lane == 0) vs[ids[k]] = unset ? __int_as_float(0x7FC00000) : (m == 0.0f ? 0.0f : m);
  }
}

using EmaFn = void (*)(Dev, int, int, const float*, int64_t, const int32_t*);

// EmaKernel / EmaWordKernel over `chunks` CTAs per entry, one launch per row.
cudaError_t EmaPerRow(EmaFn fp32, EmaFn bf16, int64_t chunks, const Dev& d, int layer, int n,
                      int rows, const float* logits, int64_t stride, const int32_t* accepted,
                      cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(chunks, 1, 65535)),
                  static_cast<unsigned>(n));
  for (int r = 0; r < rows; ++r) {
    SPIN_CUDA_RETURN_IF_ERROR(Launch(d.dtype_bytes == 4 ? fp32 : bf16, grid, kEmaThreads, stream, d,
                                     layer, r, logits, stride, accepted));
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t EmaWordBlocksPerSm(const Dev& d, int* per_sm) {
  return d.dtype_bytes == 4 ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                  per_sm, EmaWordKernel<float>, kEmaThreads, 0)
                            : cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                  per_sm, EmaWordKernel<uint16_t>, kEmaThreads, 0);
}

cudaError_t EmaVecBlocksPerSm(const Dev& d, int* per_sm) {
  return d.dtype_bytes == 4 ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                  per_sm, EmaVecKernel<float>, kEmaThreads, 0)
                            : cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                  per_sm, EmaVecKernel<uint16_t>, kEmaThreads, 0);
}

bool EmaVecFits(const Dev& d, const float* logits, int64_t stride) {
  // b = 64 and every 16-byte chunk of V and D inside its array, and 16-byte logits rows.
  return d.block == 64 && d.max_slots % 8 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0 &&
         stride % 4 == 0;
}

bool EmaWordFits(const Dev& d) { return d.block % 2 == 0 && d.block >= kEmaSegSlots; }

cudaError_t LaunchEmaVec(const Dev& d, int layer, int n, int rows, const float* logits,
                         int64_t stride, const int32_t* accepted, int resident,
                         cudaStream_t stream) {
  // Persistent as EmaWord's, a warp taking four segments (blocks) per round: the resident CTAs
  // share out the segments of every entry, or above kEmaFlatMaxEntries those of one entry per
  // grid row.
  const int64_t warp_rounds = CeilDiv(d.max_blocks, (kEmaThreads / 32) * 4);
  const int flat = n <= kEmaFlatMaxEntries ? 1 : 0;
  const dim3 grid(
      static_cast<unsigned>(std::clamp<int64_t>(flat ? std::min<int64_t>(resident, warp_rounds * n)
                                                     : std::min<int64_t>(warp_rounds, resident / n),
                                                1, 65535)),
      static_cast<unsigned>(flat ? 1 : n));
  for (int r = 0; r < rows; ++r) {
    SPIN_CUDA_RETURN_IF_ERROR(
        Launch(d.dtype_bytes == 4 ? EmaVecKernel<float> : EmaVecKernel<uint16_t>, grid, kEmaThreads,
               stream, d, layer, r, logits, stride, accepted, n));
  }
  return cudaSuccess;
}

cudaError_t LaunchEmaWord(const Dev& d, int layer, int n, int rows, const float* logits,
                          int64_t stride, const int32_t* accepted, int resident,
                          cudaStream_t stream) {
  // Persistent: as many CTAs per entry as are resident on the device in one wave (at least one),
  // and no more than one round of segments per warp needs when the whole context is kept.
  const int64_t max_len = static_cast<int64_t>(d.max_blocks) * d.block;
  const int64_t rounds =
      CeilDiv(EmaSegments(static_cast<int>(max_len), d.block), (kEmaThreads / 32) * kEmaSegs);
  return EmaPerRow(EmaWordKernel<float>, EmaWordKernel<uint16_t>,
                   std::min<int64_t>(rounds, resident / n), d, layer, n, rows, logits, stride,
                   accepted, stream);
}

cudaError_t LaunchEma(const Dev& d, int layer, int n, int rows, const float* logits, int64_t stride,
                      const int32_t* accepted, cudaStream_t stream) {
  // One round of kEmaSlots slots per thread when the whole context is kept (up to 128K slots;
  // beyond, the CTAs stride).
  const int64_t max_len = static_cast<int64_t>(d.max_blocks) * d.block;
  return EmaPerRow(EmaKernel<float>, EmaKernel<uint16_t>,
                   std::min<int64_t>(CeilDiv(max_len, kEmaThreads * kEmaSlots), 64), d, layer, n,
                   rows, logits, stride, accepted, stream);
}

cudaError_t LaunchVSummary(const Dev& d, int layer, int n, cudaStream_t stream) {
  const unsigned chunks =
      static_cast<unsigned>(std::clamp<int64_t>(CeilDiv(d.max_blocks, kEmaThreads / 32), 1, 64));
  return Launch(d.dtype_bytes == 4 ? VSummaryKernel<float> : VSummaryKernel<uint16_t>,
                dim3(chunks, n), kEmaThreads, stream, d, layer);
}

}  // namespace spin::cuda_kernels
