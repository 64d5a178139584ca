// Observe's Probe work (validation, fresh flags, the Select statistics and publish ahead of the
// engine's Selects, the remap of RemapAndObserve, and the probing entries' dense top-K counted per
// curve level), as device functions over an explicit share of a grid: ProbeKernel
// (probe_kernels.cu) runs it on its whole grid, ObserveVecKernel (ema_kernels.cu) on the CTAs of
// its launch that do not run the EMA. Without relocatable device code each of the two
// translation units compiles its own copy.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device_common.cuh"
#include "launchers.h"
#include "spin/arena.h"
#include "spin/numerics.h"
#include "top_t.cuh"

namespace spin::cuda_kernels {

static_assert(kProbeItems <= kSelectRegRounds, "TopTShared's tie counts per round");
static_assert(kCurvePoints < 0x80, "a level and the budget bit in a byte");
// Logits sampled for the candidates' threshold (2 per thread), and logits each thread has in flight
// in the candidate pass.
constexpr int kProbeSampleBits = 11;
constexpr int kProbeSample = 1 << kProbeSampleBits;
constexpr int kProbeLoads = 16;
// At most this many CTAs share one probing entry's row (ProbeKernel): more CTAs per entry
// measured slower, at batch 16 and at batch 1 (docs/lab/cuda-kernel-tuning.md).
constexpr int kMaxProbeShares = 16;

// A Probe CTA's shared state (one per CTA; ObserveVecKernel overlays it on the EMA's).
struct ProbeShared {
  TopTShared topt;
  uint32_t t0;
  int probe, last, cand, finite, now;
  int cnt[kCurvePoints + 1];
};

// One probing entry's share `cx` of `ctas` (ProbeWork below): the candidates of its share of
// the row, and for the last share to finish the top-K counted per level. Every thread of the CTA
// calls it.
__device__ inline void ProbeTask(const Dev& d, int layer, const float* logits, int64_t stride,
                                 int e, int cx, int ctas, ProbeShared& sm) {
  constexpr int NT = kProbeThreads;
  constexpr unsigned kAll = 0xFFFFFFFFu;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  const int rows = d.batch->rows;
  const StepEntry en = d.entries[e];
  int& s_probe = sm.probe;
  __syncthreads();  // the previous task's readers of the shared state are done
  if (tid < 32) {
    const bool fit = RowsFitWarp(LaneRowLen(d, e), rows, stride);
    if (lane == 0) s_probe = fit ? 1 : 0;  // a row past the stride: no probe (recorded)
  }
  __syncthreads();
  if (!s_probe) return;
  TopTShared& sh = sm.topt;
  uint32_t& s_t0 = sm.t0;
  int &s_last = sm.last, &s_cand = sm.cand, &s_finite = sm.finite, &s_now = sm.now;
  int* s_cnt = sm.cnt;
  const int b = d.block, n = en.ctx_len;
  const float* z = logits + static_cast<int64_t>(e) * rows * stride;
  const uint8_t* lvl = d.probe_lvl + d.Ahead(layer, e) * d.max_blocks;
  unsigned long long* cand = d.probe_cand + static_cast<int64_t>(e) * kProbeCap;
  int* cnt = d.probe_cnt + 2 * e;  // {candidates, finite logits}, zero between launches
  auto block_of = [&](int i) { return d.block_shift >= 0 ? i >> d.block_shift : i / b; };
  for (int i = tid; i < kDigitBins; i += NT) sh.hist[i] = 0;  // CtaTopT needs it zero
  if (tid <= kCurvePoints) s_cnt[tid] = 0;
  if (tid == 0) s_t0 = n > kProbeCap ? 0xFFFFFFFFu : 0u, s_now = 0;
  __syncthreads();
  // The threshold t0 from an evenly spread sample (0: every finite logit is a candidate).
  if (n > kProbeCap) {
    constexpr int kPer = kProbeSample / NT;
    uint32_t key[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const float x = z[(static_cast<int64_t>(u * NT + tid) * n) >> kProbeSampleBits];
      key[u] = isfinite(x) ? FloatKey(x) : 0u;
    }
    // The r-th largest sample, r = 2K / (slots per sample).
    const long long want = (2ll * d.topk * kProbeSample + n - 1) / n;
    const int r = want < 1 ? 1 : want > kProbeSample ? kProbeSample : static_cast<int>(want);
    CtaTopT<uint32_t, kPer, NT>(
        sh, kProbeSample, r, [&](int u, int) { return key[u]; }, [&](int, int) { return true; },
        [&](int u, int) { atomicMin(&s_t0, key[u]); });
  }
  __syncthreads();
  const uint32_t t0 = s_t0;
  // Slots [lo, hi) into the entry's candidates: the finite logits with key >= t0 (the count
  // goes on past kProbeCap, the entries do not), and the finite count.
  auto gather = [&](int lo, int hi, uint32_t thr) {
    int fin = 0;
    for (int i0 = lo; i0 < hi; i0 += NT * kProbeLoads) {
      float x[kProbeLoads];
#pragma unroll
      for (int u = 0; u < kProbeLoads; ++u) {
        const int i = i0 + u * NT + tid;
        x[u] = i < hi ? z[i] : NAN;
      }
      int mine = 0;
#pragma unroll
      for (int u = 0; u < kProbeLoads; ++u) {
        const bool f = isfinite(x[u]);
        fin += f ? 1 : 0;
        mine += f && FloatKey(x[u]) >= thr ? 1 : 0;
      }
      int incl = mine;  // inclusive prefix over the warp's lanes
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(kAll, incl, o);
        if (lane >= o) incl += v;
      }
      const int total = __shfl_sync(kAll, incl, 31);
      int base = 0;
      if (total > 0) {
        if (lane == 31) base = atomicAdd(&cnt[0], total);
        base = __shfl_sync(kAll, base, 31);
      }
      int at = base + incl - mine;
#pragma unroll
      for (int u = 0; u < kProbeLoads; ++u) {
        if (isfinite(x[u])) {
          const uint32_t k = FloatKey(x[u]);
          if (k >= thr) {
            const uint32_t slot = static_cast<uint32_t>(i0 + u * NT + tid);
            if (at < kProbeCap) {
              cand[at] = (static_cast<unsigned long long>(k) << 32) | (0xFFFFFFFFu - slot);
            }
            ++at;
          }
        }
      }
    }
    fin = __reduce_add_sync(kAll, fin);
    if (lane == 0 && fin != 0) atomicAdd(&cnt[1], fin);
  };
  const int share = (n + ctas - 1) / ctas;
  gather(min(n, cx * share), min(n, (cx + 1) * share), t0);
  // The last CTA of the entry goes on; its reads of the others' candidates follow their fences.
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&d.probe_arrive[e], 1u) == static_cast<unsigned>(ctas - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (tid == 0) {
    s_cand = atomicAdd(&cnt[0], 0);
    s_finite = atomicAdd(&cnt[1], 0);
  }
  __syncthreads();
  const int k = min(d.topk, s_finite);
  bool fits = s_cand >= k && s_cand <= kProbeCap;
  if (k > 0 && !fits && t0 != 0 && s_finite <= kProbeCap) {
    if (tid == 0) cnt[0] = 0, cnt[1] = 0;
    __syncthreads();
    gather(0, n, 0);
    __syncthreads();
    if (tid == 0) s_cand = atomicAdd(&cnt[0], 0);
    __syncthreads();
    fits = true;  // every finite logit: between k and kProbeCap of them
  }
  if (k > 0 && fits) {
    const int c0 = s_cand;
    unsigned long long ck[kProbeItems];
#pragma unroll
    for (int u = 0; u < kProbeItems; ++u) {
      const int j = u * NT + tid;
      ck[u] = j < c0 ? __ldcg(cand + j) : 0ull;
    }
    unsigned chosen = 0;
    CtaTopT<unsigned long long, kProbeItems, NT>(
        sh, c0, k, [&](int u, int) { return ck[u]; }, [&](int, int) { return true; },
        [&](int u, int) { chosen |= 1u << u; });
    // Per item, the level of the chosen slot's block; one shared atomic per warp and level.
#pragma unroll
    for (int u = 0; u < kProbeItems; ++u) {
      int lv = -1, now = 0;
      if ((chosen >> u) & 1u) {
        const int slot = static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(ck[u]));
        const uint8_t x = lvl[block_of(slot)];
        lv = x & ~kLevelNow;
        now = (x & kLevelNow) ? 1 : 0;
      }
      const unsigned peers = __match_any_sync(kAll, lv);
      if (lv >= 0 && lane == __ffs(static_cast<int>(peers)) - 1) {
        atomicAdd(&s_cnt[lv], __popc(peers));
      }
      now = __reduce_add_sync(kAll, now);
      if (lane == 0 && now != 0) atomicAdd(&s_now, now);
    }
  } else if (k > 0) {
    // Dense top-K of row 0 (ties to the lower slot), counted per level.
    CtaTopT<uint32_t, 0, NT>(
        sh, n, k, [&](int, int i) { return FloatKey(z[i]); },
        [&](int, int i) { return isfinite(z[i]) != 0; },
        [&](int, int i) {
          const uint8_t x = lvl[block_of(i)];
          atomicAdd(&s_cnt[x & ~kLevelNow], 1);
          if (x & kLevelNow) atomicAdd(&s_now, 1);
        });
  }
  __syncthreads();
  if (tid == 0) {
    // Zero between launches: the next Observe's CTAs count from here.
    cnt[0] = 0;
    cnt[1] = 0;
    d.probe_arrive[e] = 0;
    if (k > 0) {
      unsigned long long* curve = d.curves + static_cast<int64_t>(layer) * kCurvePoints;
      int covered = 0;
      for (int p = 0; p < kCurvePoints; ++p) {
        covered += s_cnt[p];
        atomicAdd(&curve[p], static_cast<unsigned long long>(k - covered));
      }
      LayerStats* st = d.stats + layer;
      atomicAdd(reinterpret_cast<unsigned long long*>(&st->probe_steps), 1ull);
      atomicAdd(reinterpret_cast<unsigned long long*>(&st->probe_topk),
                static_cast<unsigned long long>(k));
      atomicAdd(reinterpret_cast<unsigned long long*>(&st->probe_missed),
                static_cast<unsigned long long>(k - s_now));
    }
  }
}
// Observe's first launch, before the EMA launches (or beside them), one CTA per multiprocessor
// (at most kMaxProbeShares per entry): in RemapAndObserve the whole grid first does the remap
// (RemapShare); CTA g validates accepted and the logits stride of entries g, g + G,
// ... (recording errors) and clears their fresh flags when row 0 is applied (nothing else reads
// them during Observe); then the CTAs are shared out over the layer's probing entries (those
// ProbeRankKernel listed), up to kMaxProbeShares each, and count row 0's dense top-K per curve
// level (ProbeTask).
//
// The top-K: the r-th largest of kProbeSample evenly spread logits (CtaTopT over registers, in
// every CTA of the entry) is a threshold t0 above which about 2K logits are expected; each CTA
// takes its share of the row (kProbeLoads loads in flight per thread, one global atomic per warp
// and round) and appends the finite logits with key >= t0 as (key, inverted slot) candidates to
// the entry's buffer. The last CTA to finish (an arrival count) takes the top-K by one CtaTopT
// over the candidates, kProbeItems per thread in registers (the keys are distinct, so ties go to
// the lower slot by the key itself). When the candidates number fewer than K or more than
// kProbeCap, it gathers again alone with every finite logit a candidate if those fit, and
// otherwise CtaTopT takes the top-K from global memory. (The top-K as one CtaTopT over the row
// in one CTA was many times slower: one load in flight per thread per pass, and the first pass's
// histogram contended on the few bins the logits' top bits fall in;
// docs/lab/cuda-kernel-tuning.md.)
__device__ inline void ProbeWork(const Dev& d, int layer, const float* logits, int64_t stride,
                                 const int32_t* accepted, int validate, int topk,
                                 int32_t* remap_idx, int remap_count, int remap_probe,
                                 const SelectWork& sel, int g, int G, ProbeShared& sm) {
  // RemapAndObserve: Remap's (or RemapTopK's) work first, shared over the whole grid.
  if (remap_idx) {
    RemapShare(d, layer, remap_idx, remap_count, remap_probe,
               static_cast<int64_t>(g) * blockDim.x + threadIdx.x,
               static_cast<int64_t>(G) * blockDim.x);
  }
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int batch_n = d.batch->n, rows = d.batch->rows;
  // Loaded with the batch (the fresh flags written below may alias it for the compiler).
  const int count = d.probe_count[layer];
  // Validation of entries g, g + G, ... (warp 0): every load of an entry's at once (e < batch n
  // <= max_seqs, and the lengths and accepted count are the entry's own). The fused mode's
  // kernel has done it (validate = 0).
  if (validate && threadIdx.x < 32) {
    for (int e = g; e < batch_n; e += G) {
      const StepEntry en = d.entries[e];
      const int acc = accepted ? accepted[e] : 1;
      const bool fit = RowsFitWarp(LaneRowLen(d, e), rows, stride);
      if (lane == 0 && en.seq >= 0) {
        uint8_t* fresh = d.fresh + static_cast<int64_t>(en.seq) * d.layers + layer;
        if (accepted && (acc < 0 || acc > rows)) RecordError(d.error, kArenaBadAccepted);
        if (!fit) RecordError(d.error, kArenaBadStride);
        // Row 0 is applied: the pair is no longer fresh.
        if (RowApplied(e, batch_n, en.seq, 0, rows, acc, fit) && *fresh != 0) *fresh = 0;
      }
      if (lane == 0 && sel.count_select) CountSelectOf(d, layer, e, rows);
    }
  }
  // Publish ahead: the next layer's selection into the outputs, entries G - 1 - g, 2G - 1 - g,
  // ... (every kernel of this Observe reads the observed layer's record, not the outputs). From
  // the grid's last CTA down: the probing entries' tasks below go to the first ones.
  if (validate && sel.publish_layer >= 0) {
    for (int e = G - 1 - g; e < batch_n; e += G) {
      PublishAheadEntry(d, sel.publish_layer, sel.table, sel.table_stride, e, rows);
    }
  }
  // The probing entries' work (ProbeRankKernel's list): K CTAs per entry, task t being the
  // share t % K of entry t / K. None when RemapTopK counted the engine's top-K (topk = 0).
  if (count == 0 || !topk) return;
  const int K = min(kMaxProbeShares, max(1, G / count));
  for (int t = g; t < count * K; t += G) {
    ProbeTask(d, layer, logits, stride, d.probe_list[d.Ahead(layer, t / K)], t % K, K, sm);
  }
}

}  // namespace spin::cuda_kernels
