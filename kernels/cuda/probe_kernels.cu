// Probe steps: ProbeRank (when the step begins, each probing (layer, entry)'s block levels for
// the miss curve) and Probe (Observe's validation, fresh flags and the dense top-K counted per
// curve level; in RemapAndObserve also the remap, and the engine's top-K counted in its place).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_radix_sort.cuh>

#include "device_common.cuh"
#include "launchers.h"
#include "spin/arena.h"
#include "spin/numerics.h"
#include "top_t.cuh"

namespace spin::cuda_kernels {
namespace {

// Probe steps. When the step begins, ProbeRankKernel gives every block of a probing (layer,
// entry) its curve level from the step's row-0 block scores: the first grid point whose kept
// blocks include it (the query block is in all), plus a bit for the step's own budget. Observe's
// ProbeKernel then only finds row 0's dense top-K and counts its slots per level. The ranking
// sorts up to kProbeCap blocks (512K slots at b = 64) with cub::BlockRadixSort; the top-K's
// candidates, at most kProbeCap, are held kProbeItems per thread for one CtaTopT. Beyond either,
// CtaTopT radix selects over global memory (the same result, slower).
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
// ProbeRankKernel<NT> ranks up to NT * kProbeItems blocks by one sort; ProbeRankThreads takes the
// smallest of 256, 512 and 1024 threads that holds the arena's blocks (a CTA per (layer, entry)
// pair, so small CTAs when contexts are short).
template <int NT>
using ProbeSort = cub::BlockRadixSort<unsigned long long, NT, kProbeItems>;
template <int NT>
union ProbeRankSmem {
  typename ProbeSort<NT>::TempStorage sort;
  TopTShared topt;
};
template <int NT>
constexpr size_t kProbeRankSmemBytes = sizeof(ProbeRankSmem<NT>);  // dynamic shared memory
constexpr int Log2(int x) { return x <= 1 ? 0 : 1 + Log2(x / 2); }

// One CTA per (entry, layer of [l0, l0 + gridDim.y)), after the step's selections: whether the
// pair probes (a probe step of a pair that is not fresh, decided with its selection as on the
// CPU; a Select of the layer after its Observe decides again), and if so the entry joins the
// layer's probe list for ProbeKernel and each block gets its level. Blocks rank as the selector
// ranks them: the query block first, then by score, ties to the lower id. Grid point p keeps the
// query block and the m_p - 1 best others; levels are the first such p (the kept sets grow with p).
template <int NT>
__global__ void __launch_bounds__(NT) ProbeRankKernel(Dev d, int l0) {
  constexpr int kCap = NT * kProbeItems, kIdBits = Log2(kCap);
  constexpr unsigned kAll = 0xFFFFFFFFu;
  StepKernelEntry();
  const int e = static_cast<int>(blockIdx.x), layer = l0 + static_cast<int>(blockIdx.y);
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  const StepEntry en = d.entries[e];
  const bool live = e < d.batch->n && en.seq >= 0;
  const bool on = live && en.probe && d.fresh[static_cast<int64_t>(en.seq) * d.layers + layer] == 0;
  if (tid == 0) d.probe_on[d.Ahead(layer, e)] = on ? 1 : 0;  // RemapTopK reads it
  if (!on) return;
  if (tid == 0) d.probe_list[d.Ahead(layer, atomicAdd(&d.probe_count[layer], 1))] = e;
  extern __shared__ __align__(16) unsigned char rank_smem[];
  ProbeRankSmem<NT>& sm = *reinterpret_cast<ProbeRankSmem<NT>*>(rank_smem);
  __shared__ int s_m[kCurvePoints + 1];
  __shared__ unsigned s_or, s_and;
  const int b = d.block, nb = BlocksOf(d, en.ctx_len);
  const int qb = min(en.q_pos / b, nb - 1);
  const float* s = d.Scores(layer, 0, e, 0);
  uint8_t* lvl = d.probe_lvl + d.Ahead(layer, e) * d.max_blocks;
  if (tid <= kCurvePoints) {
    const double rho = tid < kCurvePoints ? 1.0 - CurveKeepFraction(tid) : d.step_rho[layer];
    s_m[tid] = KeptBlocks(nb, d.topk, b, rho);
  }
  if (tid == 0) s_or = 0, s_and = 0xFFFFFFFFu;
  __syncthreads();
  if (nb <= kCap) {
    // The sort key of block j: 1 (above the padding's 0), then the bits in which the scores
    // differ, then the inverted id; a block's rank is its place in the descending order.
    uint32_t key[kProbeItems];
    unsigned o = 0, a = 0xFFFFFFFFu;
#pragma unroll
    for (int u = 0; u < kProbeItems; ++u) {
      const int j = tid * kProbeItems + u;
      key[u] = j < nb && j != qb ? FloatKey(s[j]) : 0u;
      if (j < nb && j != qb) o |= key[u], a &= key[u];
    }
    o = __reduce_or_sync(kAll, o);
    a = __reduce_and_sync(kAll, a);
    if (lane == 0) atomicOr(&s_or, o), atomicAnd(&s_and, a);
    __syncthreads();
    const unsigned vary = s_or & ~s_and;
    const int lo = vary ? __ffs(static_cast<int>(vary)) - 1 : 0;
    const int width = vary ? 32 - __clz(static_cast<int>(vary)) - lo : 0;
    unsigned long long ck[kProbeItems];
#pragma unroll
    for (int u = 0; u < kProbeItems; ++u) {
      const int j = tid * kProbeItems + u;
      const unsigned long long field =
          width ? (key[u] >> lo) & static_cast<uint32_t>((1ull << width) - 1) : 0u;
      ck[u] = j < nb && j != qb ? (1ull << (kIdBits + width)) | (field << kIdBits) |
                                      static_cast<unsigned>(kCap - 1 - j)
                                : 0ull;
    }
    ProbeSort<NT>(sm.sort).SortDescending(ck, 0, kIdBits + width + 1);
#pragma unroll
    for (int u = 0; u < kProbeItems; ++u) {
      const int rank = tid * kProbeItems + u;  // among the nb - 1 blocks other than the query's
      if (rank >= nb - 1) continue;
      int level = kCurvePoints;
      for (int p = kCurvePoints - 1; p >= 0; --p) level = rank < s_m[p] - 1 ? p : level;
      const int j = kCap - 1 - static_cast<int>(ck[u] & (kCap - 1));
      lvl[j] = static_cast<uint8_t>(level | (rank < s_m[kCurvePoints] - 1 ? kLevelNow : 0));
    }
  } else {
    for (int j = tid; j < nb; j += NT) lvl[j] = kCurvePoints;
    for (int i = tid; i < kDigitBins; i += NT) sm.topt.hist[i] = 0;  // CtaTopT needs it zero
    __syncthreads();
    // Element j belongs to thread j % NT in every CtaTopT, so each block's byte has one writer.
    for (int p = 0; p <= kCurvePoints; ++p) {
      CtaTopT<uint32_t, 0, NT>(
          sm.topt, nb, s_m[p] - 1, [&](int, int j) { return FloatKey(s[j]); },
          [&](int, int j) { return j != qb; },
          [&](int, int j) {
            if (p == kCurvePoints) {
              lvl[j] |= kLevelNow;
            } else if (lvl[j] == kCurvePoints) {
              lvl[j] = static_cast<uint8_t>(p);
            }
          });
      __syncthreads();
    }
  }
  if (tid == 0) lvl[qb] = kLevelNow;  // level 0
}

// One probing entry's share `cx` of `ctas` (ProbeKernel below): the candidates of its share of
// the row, and for the last share to finish the top-K counted per level. Every thread of the CTA
// calls it.
__device__ void ProbeTask(Dev d, int layer, const float* logits, int64_t stride, int e, int cx,
                          int ctas) {
  constexpr int NT = kProbeThreads;
  constexpr unsigned kAll = 0xFFFFFFFFu;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  const int rows = d.batch->rows;
  const StepEntry en = d.entries[e];
  __shared__ int s_probe;
  __syncthreads();  // the previous task's readers of the shared state are done
  if (tid < 32) {
    const bool fit = RowsFitWarp(LaneRowLen(d, e), rows, stride);
    if (lane == 0) s_probe = fit ? 1 : 0;  // a row past the stride: no probe (recorded)
  }
  __syncthreads();
  if (!s_probe) return;
  __shared__ TopTShared sh;
  __shared__ uint32_t s_t0;
  __shared__ int s_last, s_cand, s_finite;
  __shared__ int s_cnt[kCurvePoints + 1], s_now;
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
__global__ void __launch_bounds__(kProbeThreads)
    ProbeKernel(Dev d, int layer, const float* logits, int64_t stride, const int32_t* accepted,
                int validate, int topk, int32_t* remap_idx, int remap_count, int remap_probe,
                SelectWork sel) {
  StepKernelEntry();
  const int g = static_cast<int>(blockIdx.x), G = static_cast<int>(gridDim.x);
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
    ProbeTask(d, layer, logits, stride, d.probe_list[d.Ahead(layer, t / K)], t % K, K);
  }
}

}  // namespace

cudaError_t SetProbeRankSharedMemory() {
  SPIN_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(ProbeRankKernel<256>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(kProbeRankSmemBytes<256>)));
  SPIN_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(ProbeRankKernel<512>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(kProbeRankSmemBytes<512>)));
  return cudaFuncSetAttribute(ProbeRankKernel<1024>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(kProbeRankSmemBytes<1024>));
}

int ProbeRankThreads(int64_t max_blocks) {
  return max_blocks <= 256 * kProbeItems ? 256 : max_blocks <= 512 * kProbeItems ? 512 : 1024;
}

cudaError_t LaunchProbeRank(const Dev& d, int l0, int layers, int n, int threads,
                            cudaStream_t stream) {
  // The layers' lists of probing entries are counted from zero.
  SPIN_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(d.probe_count + l0, 0, layers * sizeof(int32_t), stream));
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(layers));
  if (threads == 256) {
    return LaunchSmem(ProbeRankKernel<256>, grid, 256, kProbeRankSmemBytes<256>, stream, d, l0);
  }
  if (threads == 512) {
    return LaunchSmem(ProbeRankKernel<512>, grid, 512, kProbeRankSmemBytes<512>, stream, d, l0);
  }
  return LaunchSmem(ProbeRankKernel<1024>, grid, 1024, kProbeRankSmemBytes<1024>, stream, d, l0);
}

cudaError_t LaunchProbe(const Dev& d, int layer, int n, int sms, const float* logits,
                        int64_t stride, const int32_t* accepted, bool validate, bool topk,
                        const RemapWork& remap, const SelectWork& sel, cudaStream_t stream) {
  // One CTA per multiprocessor, and no more than kMaxProbeShares per entry, shared out over the
  // probing entries.
  const dim3 probe_grid(static_cast<unsigned>(std::min(sms, kMaxProbeShares * n)));
  return Launch(ProbeKernel, probe_grid, kProbeThreads, stream, d, layer, logits, stride, accepted,
                validate ? 1 : 0, topk ? 1 : 0, remap.idx, remap.count, remap.probe ? 1 : 0, sel);
}

}  // namespace spin::cuda_kernels
