// Probe steps: ProbeRank (when the step begins, each probing (layer, entry)'s block levels for
// the miss curve) and Probe (Observe's validation, fresh flags and the dense top-K counted per
// curve level; in RemapAndObserve also the remap, and the engine's top-K counted in its place).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_radix_sort.cuh>

#include "device_common.cuh"
#include "launchers.h"
#include "probe_work.cuh"
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

// ProbeKernel: Observe's first launch (ProbeWork, probe_work.cuh) on a grid of its own.
__global__ void __launch_bounds__(kProbeThreads)
    ProbeKernel(Dev d, int layer, const float* logits, int64_t stride, const int32_t* accepted,
                int validate, int topk, int32_t* remap_idx, int remap_count, int remap_probe,
                SelectWork sel) {
  StepKernelEntry();
  __shared__ ProbeShared sm;
  ProbeWork(d, layer, logits, stride, accepted, validate, topk, remap_idx, remap_count, remap_probe,
            sel, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), sm);
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
