// The CTA-wide exact radix top-T (CtaTopT) that the selection and probe kernels share, and
// ForRounds, the element-to-thread order it and its callers agree on.
#pragma once

#include <cub/block/block_scan.cuh>

#include "device_common.cuh"

namespace spin::cuda_kernels {

// The most threads any CtaTopT caller's CTA has.
constexpr int kMaxTopTThreads = kProbeThreads > kSelectThreads ? kProbeThreads : kSelectThreads;

// ---------------------------------------------------------------------------------------------
// CTA-wide exact top-t by key, ties to the lower index, among candidates [0, n) with
// cand(u, j) true. Calls take(u, j) for each chosen j. All threads of the CTA must call it.
//
// Element j is visited in round u = j / blockDim.x by thread j % blockDim.x (ForRounds). With
// KPT > 0 the rounds are unrolled (n <= KPT * blockDim.x), so a caller can keep its per-element
// keys in registers indexed by the constant u; KPT == 0 loops over any n and the caller indexes
// memory by j. Either way each thread sees only its own elements, in increasing j.
// ---------------------------------------------------------------------------------------------
template <int KPT, typename F>
__device__ __forceinline__ void ForRounds(int n, F f) {
  const int nt = static_cast<int>(blockDim.x);
  if constexpr (KPT > 0) {
#pragma unroll
    for (int u = 0; u < KPT; ++u) {
      if (u * nt < n) f(u, u * nt + static_cast<int>(threadIdx.x));  // uniform over the CTA
    }
  } else {
    for (int u = 0; u * nt < n; ++u) f(u, u * nt + static_cast<int>(threadIdx.x));
  }
}

// Radix digits of CtaTopT: 11 bits, so a 32-bit key takes at most 3 passes and a 64-bit key
// at most 6 (8-bit digits took 4 and 8; with the early exit below, scores usually need 2 and
// exploration draws 1). With NT threads, thread t owns bins [t * kDigitBins / NT, (t + 1) *
// kDigitBins / NT) in the digit search.
constexpr int kDigitBits = 11;
constexpr int kDigitBins = 1 << kDigitBits;
static_assert(kDigitBins % kSelectThreads == 0, "whole bins per thread");

// CtaTopT's shared state, declared once per kernel so both key widths share it. hist is all
// zero between passes (each pass zeroes every bin as it reads them), so it is cleared once per
// launch, before the first CtaTopT.
struct TopTShared {
  unsigned hist[kDigitBins];
  unsigned wsum[kMaxTopTThreads / 32];
  unsigned eq[kSelectRegRounds][kMaxTopTThreads / 32];  // tie counts per round and warp
  unsigned long long prefix;
  int remaining, running, done;
};

// NT: the CTA's threads (a multiple of 32, at most kMaxTopTThreads, dividing kDigitBins).
template <typename Key, int KPT, int NT = kSelectThreads, typename KeyFn, typename CandFn,
          typename TakeFn>
__device__ void CtaTopT(TopTShared& sh, int n, int t, KeyFn key, CandFn cand, TakeFn take) {
  static_assert(NT % 32 == 0 && NT <= kMaxTopTThreads && kDigitBins % NT == 0, "CTA shape");
  constexpr int kBinsPerThread = kDigitBins / NT;
  using Scan = cub::BlockScan<int, NT>;
  __shared__ typename Scan::TempStorage scan_tmp;
  constexpr unsigned kAll = 0xFFFFFFFFu;
  if (t <= 0) return;
  if (threadIdx.x == 0) {
    sh.prefix = 0;
    sh.remaining = t;
    sh.done = 0;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int b0 = kBinsPerThread * static_cast<int>(threadIdx.x);
  // Bits [hi, 8 * sizeof(Key)) of the threshold are fixed (prefix); each pass fixes the next
  // kDigitBits below hi.
  for (int hi = static_cast<int>(sizeof(Key)) * 8; hi > 0;) {
    const int width = hi < kDigitBits ? hi : kDigitBits;
    const int shift = hi - width;
    const unsigned long long fixed = hi >= 64 ? 0ull : ~0ull << hi;
    const unsigned long long prefix = sh.prefix;
    const int dmask = (1 << width) - 1;
    // Every lane takes part in each round so a warp whose candidates all share one digit (the
    // usual case in the first pass: the top bits of nearby floats) counts them with one atomic;
    // otherwise each candidate adds its own. (Grouping equal digits with __match_any_sync
    // measured slower; docs/lab/cuda-kernel-tuning.md.)
    ForRounds<KPT>(n, [&](int u, int j) {
      int digit = kDigitBins;
      if (j < n && cand(u, j)) {
        const unsigned long long k = static_cast<unsigned long long>(key(u, j));
        if ((k & fixed) == prefix) digit = static_cast<int>(k >> shift) & dmask;
      }
      const int first = __shfl_sync(kAll, digit, 0);
      if (__all_sync(kAll, digit == first)) {
        if (lane == 0 && digit < kDigitBins) atomicAdd(&sh.hist[digit], 32u);
      } else if (digit < kDigitBins) {
        atomicAdd(&sh.hist[digit], 1u);
      }
    });
    __syncthreads();
    // Thread t's bins (zeroed for the next pass); higher warps and lanes hold higher digits.
    unsigned c[kBinsPerThread], own = 0;
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i) {
      c[i] = sh.hist[b0 + i];
      sh.hist[b0 + i] = 0;
      own += c[i];
    }
    const unsigned wtot = __reduce_add_sync(kAll, own);
    if (lane == 0) sh.wsum[warp] = wtot;
    const unsigned rem = static_cast<unsigned>(sh.remaining);  // read before anyone writes it
    __syncthreads();
    // Every warp finds the warp holding the rem-th largest key (suffix sums over warps); that
    // warp finds the lane, and the lane the digit.
    const unsigned x = lane < NT / 32 ? sh.wsum[lane] : 0u;
    unsigned above = x;  // keys in warps >= lane
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned v = __shfl_down_sync(kAll, above, o);
      if (lane + o < 32) above += v;
    }
    const unsigned hit = __ballot_sync(kAll, above >= rem);
    const int bw = hit ? 31 - __clz(hit) : 0;
    if (warp == bw) {
      const unsigned higher_warps = __shfl_sync(kAll, above, bw) - __shfl_sync(kAll, x, bw);
      unsigned mine = own;  // keys in this warp's lanes >= lane
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned v = __shfl_down_sync(kAll, mine, o);
        if (lane + o < 32) mine += v;
      }
      mine += higher_warps;
      const unsigned hit2 = __ballot_sync(kAll, mine >= rem);
      if (lane == (hit2 ? 31 - __clz(hit2) : 0)) {
        int r = static_cast<int>(rem - (mine - own));  // minus keys in higher digits
        int dsel = b0;
        unsigned cnt = c[0];
#pragma unroll
        for (int i = kBinsPerThread - 1; i > 0; --i) {
          if (static_cast<int>(c[i]) >= r) {
            dsel = b0 + i;
            cnt = c[i];
            break;
          }
          r -= static_cast<int>(c[i]);
        }
        const unsigned long long next = prefix | (static_cast<unsigned long long>(dsel) << shift);
        if (static_cast<int>(cnt) == r && next != 0) {
          // The whole bucket is taken: every key >= next, and no tie-breaking is needed.
          sh.prefix = next - 1;
          sh.remaining = 0;
          sh.done = 1;
        } else {
          sh.remaining = r;
          sh.prefix = next;
        }
      }
    }
    __syncthreads();
    hi = shift;
    if (sh.done) break;
  }
  const unsigned long long thr = sh.prefix;
  const int ties = sh.remaining;  // how many keys equal to thr to take, lowest index first
  if (ties == 0) {
    // Every key above thr and none equal to it (the usual case: the last bucket was taken
    // whole), so no ordered scan is needed.
    ForRounds<KPT>(n, [&](int u, int j) {
      if (j < n && cand(u, j) && static_cast<unsigned long long>(key(u, j)) > thr) take(u, j);
    });
    return;
  }
  if constexpr (KPT > 0) {
    // Equal keys are taken in element order: per round a ballot per warp, one barrier for the
    // warps' counts, then each element's rank among the equal keys before it (earlier rounds,
    // earlier warps of its round, lower lanes).
    unsigned eqbal[KPT];
    ForRounds<KPT>(n, [&](int u, int j) {
      const bool eq = j < n && cand(u, j) && static_cast<unsigned long long>(key(u, j)) == thr;
      eqbal[u] = __ballot_sync(kAll, eq);
      if (lane == 0) sh.eq[u][warp] = static_cast<unsigned>(__popc(eqbal[u]));
    });
    __syncthreads();
    unsigned earlier = 0;  // equal keys in earlier rounds
    const unsigned below = (1u << lane) - 1u;
    ForRounds<KPT>(n, [&](int u, int j) {
      const unsigned x = lane < NT / 32 ? sh.eq[u][lane] : 0u;
      unsigned incl = x;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned v = __shfl_up_sync(kAll, incl, o);
        if (lane >= o) incl += v;
      }
      const unsigned before = earlier + __shfl_sync(kAll, incl, warp) - __shfl_sync(kAll, x, warp) +
                              static_cast<unsigned>(__popc(eqbal[u] & below));
      if (j < n && cand(u, j)) {
        const unsigned long long k = static_cast<unsigned long long>(key(u, j));
        if (k > thr || (((eqbal[u] >> lane) & 1u) != 0 && before < static_cast<unsigned>(ties))) {
          take(u, j);
        }
      }
      earlier += __shfl_sync(kAll, incl, 31);
    });
    return;
  }
  if (threadIdx.x == 0) sh.running = 0;
  __syncthreads();
  ForRounds<KPT>(n, [&](int u, int j) {
    const bool c = j < n && cand(u, j);
    const unsigned long long k = c ? static_cast<unsigned long long>(key(u, j)) : 0;
    const int eq = (c && k == thr) ? 1 : 0;
    int before, total;
    Scan(scan_tmp).ExclusiveSum(eq, before, total);
    const int running = sh.running;
    if (c && (k > thr || (eq && running + before < ties))) take(u, j);
    __syncthreads();
    if (threadIdx.x == 0) sh.running = running + total;
    __syncthreads();
  });
}

}  // namespace spin::cuda_kernels
