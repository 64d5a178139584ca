// What every kernel translation unit of the CUDA backend shares: the element access and key
// helpers, the programmatic-dependent-launch entry and launch, and the rule of which rows Observe
// applies. Device functions here are inline (or templates): there is no relocatable device code,
// so each kernel translation unit compiles its own copy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dev.h"
#include "spin/arena.h"
#include "spin/numerics.h"

namespace spin::cuda_kernels {

__device__ __forceinline__ float LoadT(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float LoadT(const uint16_t* p, int64_t i) { return Bf16ToFloat(p[i]); }
__device__ __forceinline__ void StoreT(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void StoreT(uint16_t* p, int64_t i, float v) { p[i] = FloatToBf16(v); }

// Orderable key of a float (larger float -> larger key); -0 and +0 map to one key because the
// reference compares values, not bits.
__device__ __forceinline__ uint32_t FloatKey(float f) {
  uint32_t u = FloatBits(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ inline void RecordError(uint32_t* error, uint32_t code) { atomicCAS(error, 0u, code); }

// Adds one thread's share of an EMA's counts (observed scores, non-finite scores skipped) to a
// layer's statistics: at most one 64-bit atomic each.
__device__ __forceinline__ void AddLayerCounts(LayerStats* st, unsigned obs, unsigned bad) {
  if (obs) {
    atomicAdd(reinterpret_cast<unsigned long long*>(&st->observed),
              static_cast<unsigned long long>(obs));
  }
  if (bad) {
    atomicAdd(reinterpret_cast<unsigned long long*>(&st->bad_scores),
              static_cast<unsigned long long>(bad));
  }
}

// Adds one selection's counts to a layer's statistics, as Select publishes it: a step, and the
// union of `count` blocks kept of `widest` (dense: a fresh or probing selection).
__device__ __forceinline__ void AddSelectCounts(LayerStats* st, int count, int widest, bool dense) {
  using U = unsigned long long;
  atomicAdd(reinterpret_cast<U*>(&st->steps), 1ull);
  atomicAdd(reinterpret_cast<U*>(&st->dense_steps), dense ? 1ull : 0ull);
  atomicAdd(reinterpret_cast<U*>(&st->blocks_kept), static_cast<U>(count));
  atomicAdd(reinterpret_cast<U*>(&st->blocks_total), static_cast<U>(widest));
  if (!dense) {
    atomicAdd(reinterpret_cast<U*>(&st->sparse_blocks_kept), static_cast<U>(count));
    atomicAdd(reinterpret_cast<U*>(&st->sparse_blocks_total), static_cast<U>(widest));
  }
}

// The selected layer's selection of entry e, as Observe's kernels and Remap read it: the union's
// blocks and the rows' compacted lengths, from the published outputs or, when those may hold the
// next layer's selection (Observe publishes it ahead with the engine's table given at BeginStep:
// PublishAheadEntry below), from the layer's select-ahead record (Dev::sel_ids, sel_lens).
__device__ __forceinline__ const int32_t* SelIds(const Dev& d, int e) {
  return d.sel_ids + static_cast<int64_t>(e) * d.max_blocks;
}
__device__ __forceinline__ const int32_t* SelLens(const Dev& d, int e) {
  return d.sel_lens + static_cast<int64_t>(e) * d.max_rows;
}

// Programmatic dependent launch (Hopper; Launch below). Every per-step kernel starts with
// StepKernelEntry(): it lets the next kernel of the stream be launched now (its CTAs are placed
// as this grid's CTAs make room, instead of after this grid has drained), then waits until the
// previous kernel has completed and its writes are visible, before this grid's first memory
// access. So the kernels' effects stay in stream order exactly as with ordinary launches; only
// the launch and CTA placement of each kernel overlap the end of the one before.
__device__ __forceinline__ void StepKernelEntry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// An entry whose rows get a selection: a sequence's, or one without a sequence (seq = -1)
// given ctx_len > 0 slots, served dense (data_plane.h, StepBatch::seq). A sequence reset since
// the step began left its entry at seq = -1, ctx_len = 0: not served.
__device__ __forceinline__ bool Served(const StepEntry& en) {
  return en.seq >= 0 || en.ctx_len > 0;
}

// Blocks of a row of n >= 0 slots: CeilDiv in 32 bits (numerics.h's 64-bit division is a
// long instruction sequence on the device), by shift for a power-of-two block.
__device__ __forceinline__ int BlocksOf(const Dev& d, int n) {
  return d.block_shift >= 0 ? (n + d.block - 1) >> d.block_shift : (n + d.block - 1) / d.block;
}

// Select's statistics of (layer, entry `en`, not padding) from its select-ahead record's
// {union count, dense}: PublishKernel's, and CountSelectOf's for a Select that launched nothing.
__device__ __forceinline__ void AddSelectCountsOf(const Dev& d, int layer, const StepEntry& en,
                                                  int2 info, int rows) {
  AddSelectCounts(d.stats + layer, info.x, BlocksOf(d, en.ctx_len + rows - 1), info.y != 0);
}
// The same for entry e, loading the entry and the record: nothing for padding.
__device__ __forceinline__ void CountSelectOf(const Dev& d, int layer, int e, int rows) {
  const StepEntry en = d.entries[e];
  if (en.seq < 0) return;
  AddSelectCountsOf(d, layer, en, d.ahead_info[d.Ahead(layer, e)], rows);
}

// Select's publishing of (layer, entry e < the batch's n) by the calling CTA (every thread calls
// it): the record's union into the outputs, the compacted physical table through the engine's
// `table`, the rows' lengths, the union count and the selected layer, as PublishKernel writes
// them (an entry that is padding now gets an empty union). Observe's Probe launch runs it for
// the next layer when the engine gave its table at BeginStep (publish ahead). Not the
// statistics: those count the engine's Select of the layer when it is made (CountSelectOf).
__device__ inline void PublishAheadEntry(const Dev& d, int layer, const int32_t* table,
                                         int64_t table_stride, int e, int rows) {
  const int tid = static_cast<int>(threadIdx.x);
  const bool live = Served(d.entries[e]);
  const int64_t at = d.Ahead(layer, e);
  const int count = live ? d.ahead_info[at].x : 0;
  if (tid < rows) {
    d.compact_len[static_cast<int64_t>(e) * d.max_rows + tid] =
        live ? d.ahead_len[at * d.max_rows + tid] : 0;
  }
  if (tid == 0) {
    d.union_count[e] = count;
    if (e == 0) d.batch->selected_layer = layer;
  }
  const int32_t* src = d.ahead_ids + at * d.max_blocks;
  const int32_t* row_table = table + e * table_stride;
  int32_t* ids = d.union_ids + static_cast<int64_t>(e) * d.max_blocks;
  int32_t* phys = d.phys + static_cast<int64_t>(e) * d.max_blocks;
  for (int k = tid; k < count; k += static_cast<int>(blockDim.x)) {
    const int32_t id = src[k];
    ids[k] = id;
    phys[k] = row_table[id];
  }
}

// kernel<<<grid, block, 0, stream>>>(args...) as a programmatic dependent launch: the kernel may
// be launched while the previous kernel of the stream still runs, and waits for it in
// StepKernelEntry before touching memory (so the order of effects is the stream's). Captured in
// a CUDA graph as a programmatic edge.
template <typename... Params, typename... Args>
cudaError_t LaunchSmem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cfg.dynamicSmemBytes = smem;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}
template <typename... Params, typename... Args>
cudaError_t Launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                   Args... args) {
  return LaunchSmem(kernel, grid, block, 0, stream, args...);
}

// The one rule of which rows Observe applies (every Observe kernel asks it). Warp-wide: lane rr
// holds row rr's compacted length of the entry (LaneRowLen: 0 past max_rows; rows <= kMaxRows
// <= 32), and RowsFitWarp, called by every lane, is true when no row of the step is longer than
// the logits stride (a longer row makes the whole entry unapplied; ProbeKernel records the error).
__device__ __forceinline__ int LaneRowLen(const Dev& d, int e) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  return lane < d.max_rows ? SelLens(d, e)[lane] : 0;
}
__device__ __forceinline__ bool RowsFitWarp(int lane_len, int rows, int64_t stride) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  return __all_sync(0xFFFFFFFFu, lane >= rows || lane_len <= stride);
}
// The same for one thread over an entry's row lengths `lens` (max_rows of them): it reads every
// row's length, and row r's into `len_r`.
__device__ __forceinline__ bool RowLensFitStride(const int32_t* lens, int max_rows, int rows,
                                                 int64_t stride, int r, int& len_r) {
  bool fit = true;
  len_r = 0;
  for (int rr = 0; rr < max_rows; ++rr) {  // rows <= max_rows
    const int l = lens[rr];
    fit = fit && (rr >= rows || l <= stride);
    if (rr == r) len_r = l;
  }
  return fit;
}
// The same over the lengths of the layer's selection of entry e.
__device__ __forceinline__ bool RowsFitStride(const Dev& d, int e, int rows, int64_t stride, int r,
                                              int& len_r) {
  return RowLensFitStride(SelLens(d, e), d.max_rows, rows, stride, r, len_r);
}
// Row r of entry e is applied: the entry is in the batch and not padding, its accepted count
// (`acc`; 1, row 0 only, without an accepted array) is in [0, rows] and above r, and its rows fit
// the stride.
__device__ __forceinline__ bool RowApplied(int e, int batch_n, int seq, int r, int rows, int acc,
                                           bool rows_fit) {
  return e < batch_n && seq >= 0 && r < rows && acc >= 0 && acc <= rows && r < acc && rows_fit;
}

// Remap's work (RemapKernel, and ProbeKernel in RemapAndObserve) for this thread's share of the
// n x rows x count top-K buffer: thread t of nt takes elements t, t + nt, ... Every thread of
// the CTA calls it (with probe, it ends with a barrier).
__device__ inline void RemapShare(const Dev& d, int layer, int32_t* idx, int count, int probe,
                                  int64_t t0, int64_t nt) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  const int rows = d.batch->rows, n = d.batch->n;
  const int64_t total = static_cast<int64_t>(n) * rows * count;
  // A layer's selection was published in this step (the host mirror's `layer` is the engine's
  // last Select; a step the device refused has none).
  const bool selected = d.batch->selected_layer >= 0;
  if (!selected && blockIdx.x == 0 && threadIdx.x == 0) RecordError(d.error, kArenaNoSelect);
  // RemapTopK over a layer with probing entries: each one's row 0, mapped, is the engine's dense
  // top-K, counted per curve level (as ProbeTask counts the one it computes): per CTA in shared
  // memory, then added to the layer's curve and statistics. Every sum is linear over slots and
  // entries, so the CTAs' shares add up to the reference's per-entry counts exactly.
  const bool counting = probe && selected && d.probe_count[layer] > 0;  // the same in every CTA
  // And each sparse entry's row 0: the slots in its exploration blocks (kLevelExplored, marked by
  // its row-0 selection), each weighted by ExploreHitWeight (the reference's CountExplore).
  const bool exploring = probe && selected;
  __shared__ int s_cnt[kCurvePoints + 1], s_sum[3];  // per level; {slots, kept now, entries}
  __shared__ unsigned long long s_x[3];              // {entries, slots, estimate}
  if (exploring) {
    for (int i = static_cast<int>(threadIdx.x); i <= kCurvePoints; i += blockDim.x) s_cnt[i] = 0;
    if (threadIdx.x < 3) s_sum[threadIdx.x] = 0, s_x[threadIdx.x] = 0;
    __syncthreads();
  }
  int slots = 0, now = 0, entries = 0;
  unsigned long long xent = 0, xslots = 0, xest = 0;
  const double rho = d.step_rho[layer], gamma = d.step_rho[d.layers];
  for (int64_t x = t0; x < total; x += nt) {
    const int e = static_cast<int>(x / (static_cast<int64_t>(rows) * count));
    const int r = static_cast<int>((x / count) % rows);
    const StepEntry en = d.entries[e];
    const bool live = selected && en.seq >= 0;
    const int len = selected && Served(en) ? SelLens(d, e)[r] : 0;
    const int c = idx[x];
    const int slot = (c < 0 || c >= len) ? -1 : SelIds(d, e)[c / d.block] * d.block + c % d.block;
    idx[x] = slot;
    if (!exploring || r != 0 || !live) continue;
    if (counting && d.probe_on[d.Ahead(layer, e)]) {
      if (x % count == 0) ++entries;
      if (slot >= 0) {
        const int j = d.block_shift >= 0 ? slot >> d.block_shift : slot / d.block;
        const uint8_t lv = d.probe_lvl[d.Ahead(layer, e) * d.max_blocks + j];
        atomicAdd(&s_cnt[lv & ~kLevelNow], 1);
        ++slots;
        if (lv & kLevelNow) ++now;
      }
    } else if (d.ahead_info[d.Ahead(layer, e)].y == 0) {
      const int nb = BlocksOf(d, en.ctx_len);
      const int m = KeptBlocks(nb, d.topk, d.block, rho);
      const int explore = m < nb ? ExplorationBlocks(m, gamma) : 0;
      if (explore > 0) {
        if (x % count == 0) ++xent;
        if (slot >= 0) {
          ++xslots;
          const int j = d.block_shift >= 0 ? slot >> d.block_shift : slot / d.block;
          if (d.probe_lvl[d.Ahead(layer, e) * d.max_blocks + j] & kLevelExplored) {
            xest += ExploreHitWeight(nb - (m - explore), explore);
          }
        }
      }
    }
  }
  if (!exploring) return;
  slots = __reduce_add_sync(kAll, slots);
  now = __reduce_add_sync(kAll, now);
  entries = __reduce_add_sync(kAll, entries);
  if (threadIdx.x % 32 == 0 && (slots | entries) != 0) {
    atomicAdd(&s_sum[0], slots);
    atomicAdd(&s_sum[1], now);
    atomicAdd(&s_sum[2], entries);
  }
  // The exploration sums too are per warp first: one shared 64-bit add per thread serialised
  // the CTA's threads on three words (ProbeKernel's 1024 threads: about +37 us per
  // RemapAndObserve on an H100, bench/results/gpu-vllm-fused-h100-f9320a3.md).
  for (int o = 16; o > 0; o >>= 1) {
    xent += __shfl_down_sync(kAll, xent, o);
    xslots += __shfl_down_sync(kAll, xslots, o);
    xest += __shfl_down_sync(kAll, xest, o);
  }
  if (threadIdx.x % 32 == 0 && (xent | xslots) != 0) {
    atomicAdd(&s_x[0], xent);
    atomicAdd(&s_x[1], xslots);
    atomicAdd(&s_x[2], xest);
  }
  __syncthreads();
  LayerStats* st = d.stats + layer;
  if (threadIdx.x == 0 && (s_x[0] | s_x[1]) != 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(&st->explore_steps), s_x[0]);
    atomicAdd(reinterpret_cast<unsigned long long*>(&st->explore_topk), s_x[1]);
    atomicAdd(reinterpret_cast<unsigned long long*>(&st->explore_est), s_x[2]);
  }
  if (threadIdx.x == 0 && (s_sum[0] | s_sum[2]) != 0) {
    unsigned long long* curve = d.curves + static_cast<int64_t>(layer) * kCurvePoints;
    int covered = 0;
    for (int p = 0; p < kCurvePoints; ++p) {
      covered += s_cnt[p];
      if (s_sum[0] != covered) {
        atomicAdd(&curve[p], static_cast<unsigned long long>(s_sum[0] - covered));
      }
    }
    atomicAdd(reinterpret_cast<unsigned long long*>(&st->probe_steps),
              static_cast<unsigned long long>(s_sum[2]));
    atomicAdd(reinterpret_cast<unsigned long long*>(&st->probe_topk),
              static_cast<unsigned long long>(s_sum[0]));
    atomicAdd(reinterpret_cast<unsigned long long*>(&st->probe_missed),
              static_cast<unsigned long long>(s_sum[0] - s_sum[1]));
  }
}

}  // namespace spin::cuda_kernels
