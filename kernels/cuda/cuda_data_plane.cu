// The CUDA backend: the semantics of kernels/cpu/cpu_data_plane.cc, bit for bit, on device
// arenas. Every shared formula comes from spin/numerics.h; this file compiles with
// --fmad=false so no other arithmetic is contracted differently from the host.
//
// Per step: BeginStep (1 CTA: entries, step counters, the step's budgets) and then every layer's
// selection at once ("select ahead", in groups of layers that fit the group scratch): Scores
// (block scores of every (layer, entry, row); Scores64 for b = 64 reads D alone for blocks whose
// V summary is set) -> Select (one CTA per (layer, entry, row): radix selects; the last CTA of
// a (layer, entry) builds its union and compacted lengths into the layer's record) -> ProbeRank
// (each probing (layer, entry)'s block levels for the miss curve). Per layer: Select(l) =
// Publish (the record into the outputs, the compacted table through the engine's block table,
// stats); Observe(l) = Probe (validation, fresh flag, on probe steps row 0's dense top-K counted
// per curve level), then the EMA, one launch per row in row order. EmaVec for the
// engine's layout (b = 64, max_slots % 8 == 0, 16-byte aligned logits rows; it also refreshes
// the V summaries of its blocks, and its grid shares out the segments of the whole batch),
// EmaWord for other even block sizes >= 64 and Ema otherwise (both followed by VSummary, with
// a grid row per entry).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "spin/arena.h"
#include "spin/cuda_data_plane.h"
#include "spin/data_plane.h"
#include "spin/numerics.h"

namespace spin {
namespace {

// Threads of a Select CTA. 512 threads with up to 8 keys each, so two CTAs
// share an SM (64 registers): the select-ahead grid has a CTA per (layer, entry, row), and on the
// H200 512 measured faster than 1024 with 4 keys at every point (64 x 128K x 50% bf16: SPIN 33.9
// -> 31.9 us; 128 x 32K: 24.5 -> 20.9).
constexpr int kSelectThreads = 512;
// Threads of a Probe CTA (up to 16 per entry; the last of an entry takes the top-K of up to 8192
// candidates, 8 per thread), and the most any CtaTopT caller uses.
constexpr int kProbeThreads = 1024;
constexpr int kMaxTopTThreads = kProbeThreads > kSelectThreads ? kProbeThreads : kSelectThreads;
// Select keeps a row's keys in registers up to this many per thread (4096 blocks: 256K
// slots at b = 64), and in the private scratch beyond.
constexpr int kSelectRegRounds = 8;
constexpr int kScoreThreads = 256;
// Select-ahead group scratch (scores of rows >= 1, union masks, and the keys of rows beyond
// 4096 blocks), reused group after group.
constexpr int64_t kAheadGroupBytes = int64_t{64} << 20;
constexpr int kBlocksPerScoreCta = 32;  // 8 warps x 4 blocks (ScoresKernel)
// Scores64Kernel: 256 blocks per CTA, each lane of a block loading two 16-byte chunks of its D
// window (4 lanes per block for bf16, 8 for fp32), so a lane group takes 4 (bf16) or 8 (fp32)
// blocks in turn. ncu on the H200 (64 x 128K x 50% bf16, the step's 61 layers in one grid) had
// shown the earlier shape (8 lanes, one block per lane group) issue-bound on the per-CTA
// prologue: 490 us, 87% SM throughput, 46% DRAM. Same-run A/B of SPIN at 64 x 128K x 50% (us):
// bf16 30.7 -> 28.3 (8 lanes, 8 rounds) and 26.4 (4 lanes, 4 rounds); fp32 39.7 -> 39.5 (8
// lanes, 8 rounds) and 40.8 (4 lanes); 128 x 256K bf16 109 -> 104 and 93.4.
constexpr int kBlocksPerScore64Cta = 256;
template <typename T>
constexpr int Score64Lanes() {
  return 64 * static_cast<int>(sizeof(T)) / 32;
}
constexpr int kEmaThreads = 256;
constexpr int kEmaSlots = 8;  // compacted slots per thread per round (EmaKernel)
// 64-slot segments per warp per round (EmaWordKernel). Measured on the H200 (batch 64 x 128K,
// bf16, 50%): 4 -> 78 registers, 3 CTAs/SM, EMA 43 us; 2 -> 48 registers, 34 us; 1 -> 39
// registers, the whole SPIN step 71 us against 74 with 2: more resident warps beat more
// segments in flight per warp.
constexpr int kEmaSegs = 1;

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

// Everything a kernel needs about the arena, passed by value (fixed for the data plane's life).
struct Dev {
  ArenaPolicy* policy;
  const double* sparsity;
  LayerStats* stats;
  unsigned long long* curves;
  SeqRecord* seqs;
  uint8_t* fresh;
  uint8_t* state;
  float* vsum;  // block summaries of V (arena.h)
  BatchHeader* batch;
  StepEntry* entries;
  int32_t* union_count;
  int32_t* union_ids;
  int32_t* phys;
  int32_t* compact_len;
  uint32_t* error;
  // Private memory (allocated by the data plane). The step's selections are made ahead, when
  // the step begins, for groups of layers at once (SelectAhead below); "gl" is a layer's place
  // in its group, and the group scratch is reused by the next group.
  float* row0;               // [L][S][MB]: row-0 block scores per layer (probe curves)
  float* scores_rest;        // rows >= 1: [G][S][R-1][MB]
  uint8_t* sel;              // [G][S][R][MB]: 1 = chosen or excluded (rows beyond 4096 blocks)
  unsigned long long* keys;  // [G][S][R][MB] (rows beyond 4096 blocks)
  uint8_t* gmask;            // [G][S][MB]: union mask
  unsigned* arrive;          // [G][S]: SelectKernel CTAs of the entry done (0 between launches)
  int32_t* ahead_ids;        // [L][S][MB]: the union per layer, ascending
  int2* ahead_info;          // [L][S]: {union count, dense}
  int32_t* ahead_len;        // [L][S][R]: compacted length per row
  int32_t* probe_list;       // [L][S]: the entries that probe at the layer's Observe
  int32_t* probe_count;      // [L]: how many (ProbeRankKernel; zeroed before it runs)
  uint8_t* probe_lvl;        // [L][S][MB]: curve level of each block (ProbeRankKernel)
  unsigned long long* probe_cand;  // [S][kProbeCap]: top-K candidates (ProbeKernel)
  int32_t* probe_cnt;              // [S][2]: candidates and finite logits (0 between launches)
  unsigned* probe_arrive;          // [S]: ProbeKernel CTAs of the entry done (0 between launches)
  uint64_t* xkeys;   // [S]: the entry's exploration (Philox) key, written by BeginStep
  double* step_rho;  // [L + 1]: the budget table and (last) the exploration share as
                     // the step began (BeginStep copies them; the selections read them)
  // Geometry.
  int32_t layers, max_seqs, max_slots, block, topk, max_rows, max_blocks;
  int32_t dtype_bytes;
  int32_t block_shift;  // log2(block) when it is a power of two, else -1
  uint64_t seed;
  uint64_t record_elems;  // 2 * max_slots

  __device__ uint8_t* Record(int seq, int layer) const {
    return state + (static_cast<uint64_t>(seq) * layers + layer) * record_elems * dtype_bytes;
  }
  __device__ float* VSum(int seq, int layer) const {
    return vsum + (static_cast<int64_t>(seq) * layers + layer) * max_blocks;
  }
  // Row r's block scores of (layer, entry e), the layer at place gl of its group.
  __device__ float* Scores(int layer, int gl, int e, int r) const {
    return r == 0 ? row0 + (static_cast<int64_t>(layer) * max_seqs + e) * max_blocks
                  : scores_rest +
                        ((static_cast<int64_t>(gl) * max_seqs + e) * (max_rows - 1) + (r - 1)) *
                            max_blocks;
  }
  __device__ uint8_t* Mask(int gl, int e) const {
    return gmask + (static_cast<int64_t>(gl) * max_seqs + e) * max_blocks;
  }
  __device__ int64_t Ahead(int layer, int e) const {
    return static_cast<int64_t>(layer) * max_seqs + e;
  }
};

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

__device__ void RecordError(uint32_t* error, uint32_t code) { atomicCAS(error, 0u, code); }

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

// Blocks of a row of n >= 0 slots: CeilDiv in 32 bits (numerics.h's 64-bit division is a
// long instruction sequence on the device), by shift for a power-of-two block.
__device__ __forceinline__ int BlocksOf(const Dev& d, int n) {
  return d.block_shift >= 0 ? (n + d.block - 1) >> d.block_shift : (n + d.block - 1) / d.block;
}

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
    // otherwise each candidate adds its own. (__match_any_sync grouping measured slower on the
    // H200: Select 22.6 -> 19.7 us at batch 64 x 128K without it.)
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

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

__global__ void ResetKernel(Dev d, int seq, uint64_t key) {
  const uint64_t elems = d.record_elems * d.layers;
  uint8_t* base = d.Record(seq, 0);
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < elems;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    if (d.dtype_bytes == 4) {
      reinterpret_cast<float*>(base)[i] = __int_as_float(0x7FC00000);
    } else {
      reinterpret_cast<uint16_t*>(base)[i] = kBf16Unset;
    }
  }
  float* vs = d.VSum(seq, 0);  // the sequence's layers are consecutive
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       i < static_cast<int64_t>(d.layers) * d.max_blocks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    vs[i] = __int_as_float(0x7FC00000);
  }
  if (blockIdx.x == 0) {
    for (int l = threadIdx.x; l < d.layers; l += blockDim.x) {
      d.fresh[static_cast<int64_t>(seq) * d.layers + l] = 1;
    }
    if (threadIdx.x == 0) {
      d.seqs[seq].key = key;
      d.seqs[seq].steps = 0;
      d.seqs[seq].open = 1;
      for (int e = 0; e < d.batch->n; ++e) {
        if (d.entries[e].seq == seq) d.entries[e].seq = -1;
      }
    }
  }
}

// One CTA of kBeginThreads; every entry is read once into registers (n <= kMaxSequences), with
// its sequence record, and checked (duplicates through a shared bitmap) before anything is
// written, so a refused batch changes nothing but the header.
constexpr int kBeginThreads = 1024;
constexpr int kBeginRounds = (kMaxSequences + kBeginThreads - 1) / kBeginThreads;
__global__ void __launch_bounds__(kBeginThreads)
    BeginStepKernel(Dev d, const int32_t* seq, const int32_t* ctx, const int32_t* qp, int n,
                    int rows) {
  StepKernelEntry();
  __shared__ int bad;
  __shared__ unsigned seen[(kMaxSequences + 31) / 32];
  const uint32_t period = d.policy->probe_period;
  if (threadIdx.x == 0) bad = 0;
  for (int w = threadIdx.x; w < (kMaxSequences + 31) / 32; w += blockDim.x) seen[w] = 0;
  int s[kBeginRounds], c[kBeginRounds], q[kBeginRounds];
  uint64_t steps[kBeginRounds], keys[kBeginRounds];
  uint32_t open[kBeginRounds];
#pragma unroll
  for (int u = 0; u < kBeginRounds; ++u) {
    const int e = u * kBeginThreads + static_cast<int>(threadIdx.x);
    s[u] = -1;
    c[u] = q[u] = 0;
    steps[u] = keys[u] = 0;
    open[u] = 0;
    if (e < n) {
      s[u] = seq[e];
      c[u] = ctx[e];
      q[u] = qp[e];
    }
  }
#pragma unroll
  for (int u = 0; u < kBeginRounds; ++u) {
    if (s[u] >= 0 && s[u] < d.max_seqs) {
      open[u] = d.seqs[s[u]].open;
      steps[u] = d.seqs[s[u]].steps;
      keys[u] = d.seqs[s[u]].key;
    }
  }
  __syncthreads();  // the bitmap is clear
  const int64_t last = rows - 1;
  bool ok_all = true;
#pragma unroll
  for (int u = 0; u < kBeginRounds; ++u) {
    const int e = u * kBeginThreads + static_cast<int>(threadIdx.x);
    if (e >= n || s[u] == -1) continue;
    bool ok = s[u] >= 0 && s[u] < d.max_seqs && open[u];
    if (ok) {
      const unsigned bit = 1u << (s[u] % 32);
      ok = (atomicOr(&seen[s[u] / 32], bit) & bit) == 0;
    }
    const int64_t cc = c[u], qq = q[u];
    ok = ok && cc >= 1 && cc + last <= d.max_slots && qq >= 0 && qq + last < d.max_slots;
    if (!ok) ok_all = false;
  }
  if (!ok_all) bad = 1;
  __syncthreads();
  if (bad) {
    if (threadIdx.x == 0) {
      RecordError(d.error, kArenaBadBatch);
      d.batch->n = 0;
      d.batch->rows = rows;
      d.batch->selected_layer = -1;
    }
    return;
  }
  // The step's budgets and exploration share, read once as the CPU reference reads them.
  for (int l = threadIdx.x; l < d.layers; l += blockDim.x) d.step_rho[l] = d.sparsity[l];
  if (threadIdx.x == 0) d.step_rho[d.layers] = d.policy->exploration;
#pragma unroll
  for (int u = 0; u < kBeginRounds; ++u) {
    const int e = u * kBeginThreads + static_cast<int>(threadIdx.x);
    if (e >= n) continue;
    StepEntry en{};
    en.seq = s[u];
    if (en.seq >= 0) {
      en.ctx_len = c[u];
      en.q_pos = q[u];
      en.step = steps[u];
      en.probe = period > 0 && steps[u] % period == 0 ? 1u : 0u;
      d.seqs[en.seq].steps = steps[u] + 1;
      d.entries[e] = en;
      d.xkeys[e] = ExplorationKey(d.seed, keys[u]);
    } else {
      d.entries[e].seq = en.seq;
    }
  }
  if (threadIdx.x == 0) {
    d.batch->n = n;
    d.batch->rows = rows;
    d.batch->selected_layer = -1;
  }
}

// Block scores of one (layer, entry, row) over a chunk of blocks, for the layers l0 .. of a
// select-ahead group (blockIdx.z = gl * n + e, n the host's batch size); eight lanes per block.
// Row 0 CTAs also clear the chunk's union mask.
template <typename T>
__global__ void ScoresKernel(Dev d, int l0, int n_grid) {
  StepKernelEntry();
  const int e = blockIdx.z % n_grid, gl = blockIdx.z / n_grid, layer = l0 + gl, r = blockIdx.y;
  // Independent loads first (e < the host's n <= max_seqs, so the entry is in bounds).
  const int batch_n = d.batch->n, batch_rows = d.batch->rows;
  const StepEntry en = d.entries[e];
  if (e >= batch_n || r >= batch_rows) return;
  const int j0 = blockIdx.x * kBlocksPerScoreCta;
  if (r == 0) {
    uint8_t* mask = d.Mask(gl, e);
    for (int j = j0 + threadIdx.x; j < min(j0 + kBlocksPerScoreCta, d.max_blocks);
         j += blockDim.x) {
      mask[j] = 0;
    }
  }
  if (en.seq < 0) return;
  const bool fresh = d.fresh[static_cast<int64_t>(en.seq) * d.layers + layer] != 0;
  const bool dense = fresh || en.probe;
  if (dense && (fresh || r != 0)) return;  // dense steps need row 0's scores on probes only
  const int n = en.ctx_len + r, q = en.q_pos + r, b = d.block;
  const int nb = BlocksOf(d, n);
  const T* rec = reinterpret_cast<const T*>(d.Record(en.seq, layer));
  const T* dst = rec + d.max_slots;
  float* out = d.Scores(layer, gl, e, r);
  // Eight lanes per block, so each lane has b/8 independent loads of V and D in flight.
  const int j = j0 + threadIdx.x / 8, sub = threadIdx.x % 8;
  float best = -INFINITY;
  if (j < nb) {
    const int lo = j * b, hi = min(lo + b, n);
#pragma unroll 8
    for (int i = lo + sub; i < hi; i += 8) {
      const int off = i <= q ? q - i : 0;
      const float p = Prediction(LoadT(rec, i), LoadT(dst, off));
      best = p > best ? p : best;
    }
  }
  for (int o = 4; o > 0; o /= 2) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, best, o);
    best = other > best ? other : best;
  }
  if (j < nb && sub == 0) out[j] = best;
}

// Largest non-NaN entry of the 64-entry window [wlo, wlo + 63] of D (max_slots % 8 == 0, so
// every 16-byte chunk touching it lies in D), -inf if none, over the block's kLanes lanes (lane
// sub returns its share). The window covers chunks c0 .. c0 + 64 / kC, the last one only when
// it is unaligned (s = wlo % kC > 0), and then the first chunk's entries s .. kC - 1 and the last
// chunk's 0 .. s - 1 are the window's: lane 0 merges the two into one chunk, so every lane
// takes whole chunks (c0 + sub, c0 + sub + kLanes, ...) with no per-entry bounds, and the
// maximum is taken with NaN-ignoring packed max instructions.
__device__ __forceinline__ uint4 MergeTail(uint4 head, uint4 tail, int bits) {
  // Bits [bits, 128) from head, [0, bits) from tail; 0 < bits < 128.
  const unsigned long long lo = bits >= 64 ? 0ull : ~0ull << bits;
  const unsigned long long hi = bits <= 64 ? ~0ull : ~0ull << (bits - 64);
  const uint32_t m[4] = {static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                         static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32)};
  return make_uint4((head.x & m[0]) | (tail.x & ~m[0]), (head.y & m[1]) | (tail.y & ~m[1]),
                    (head.z & m[2]) | (tail.z & ~m[2]), (head.w & m[3]) | (tail.w & ~m[3]));
}
__device__ __forceinline__ float ChunkMax(uint4 w, const float*) {
  return fmaxf(fmaxf(__uint_as_float(w.x), __uint_as_float(w.y)),
               fmaxf(__uint_as_float(w.z), __uint_as_float(w.w)));
}
__device__ __forceinline__ float ChunkMax(uint4 w, const uint16_t*) {
  const auto as2 = [](uint32_t x) { return *reinterpret_cast<const __nv_bfloat162*>(&x); };
  const __nv_bfloat162 m = __hmax2(__hmax2(as2(w.x), as2(w.y)), __hmax2(as2(w.z), as2(w.w)));
  return fmaxf(__low2float(m), __high2float(m));
}
template <typename T, int kLanes>
__device__ __forceinline__ float WindowMax(const T* dst, int wlo, int sub) {
  constexpr int kC = 16 / static_cast<int>(sizeof(T));  // entries per chunk
  constexpr int kPer = 64 / kC / kLanes;                // whole chunks per lane
  static_assert(kPer >= 1 && kPer * kC * kLanes == 64, "lanes per block");
  const int c0 = wlo / kC, sh = wlo - c0 * kC;
  const uint4* chunk = reinterpret_cast<const uint4*>(dst) + c0;
  uint4 w[kPer];
#pragma unroll
  for (int p = 0; p < kPer; ++p) w[p] = chunk[sub + kLanes * p];
  if (sub == 0 && sh > 0)
    w[0] = MergeTail(w[0], chunk[64 / kC], sh * 8 * static_cast<int>(sizeof(T)));
  float best = ChunkMax(w[0], dst);
#pragma unroll
  for (int p = 1; p < kPer; ++p) best = fmaxf(best, ChunkMax(w[p], dst));
  return best == best ? best : -INFINITY;  // NaN: every entry unset
}

// ScoresKernel for b = 64 (the engine's block): the same scores with far fewer instructions for
// the usual block, one wholly inside the row and at or before the query (hi - 1 <= q) whose V
// summary is set (no unset V entry). For it max_i Prediction(V[i], D[q - i]) =
// Prediction(vmax, max of the non-NaN D entries of the window [q - hi + 1, q - lo]): the order
// of a maximum does not matter, so the window is read as the aligned 16-byte chunks covering it
// (when max_slots % 8 == 0, so they lie inside D; WindowMax), and V is not read at all. The
// window is loaded together with the summary, before knowing whether the summary is set (then
// it is not used). Other blocks are scored slot by slot as in ScoresKernel. (ncu on the H200
// showed the slot-by-slot kernel issue-bound, 58% SM throughput and 21% DRAM at batch 64 x 128K:
// about 38 instructions per slot for the 64-bit addressing, conversions and NaN rules.)
template <typename T>
__global__ void __launch_bounds__(kScoreThreads) Scores64Kernel(Dev d, int l0, int n_grid) {
  constexpr int kScore64Lanes = Score64Lanes<T>();
  constexpr int kGroups = kScoreThreads / kScore64Lanes;  // blocks per round
  constexpr int kScore64Rounds = kBlocksPerScore64Cta / kGroups;
  StepKernelEntry();
  const int e = blockIdx.z % n_grid, gl = blockIdx.z / n_grid, layer = l0 + gl, r = blockIdx.y;
  // Independent loads first (e < the host's n <= max_seqs, so the entry is in bounds).
  const int batch_n = d.batch->n, batch_rows = d.batch->rows;
  const StepEntry en = d.entries[e];
  if (e >= batch_n || r >= batch_rows) return;
  const int j0 = blockIdx.x * kBlocksPerScore64Cta;
  if (r == 0) {
    uint8_t* mask = d.Mask(gl, e);
    for (int j = j0 + threadIdx.x; j < min(j0 + kBlocksPerScore64Cta, d.max_blocks);
         j += blockDim.x) {
      mask[j] = 0;
    }
  }
  if (en.seq < 0 || (en.probe && r != 0)) return;  // probe steps need row 0's scores only
  // The fresh flag (the step is dense: no scores) is read alongside the state; only the stores
  // wait for it. Every load below is in bounds either way.
  const bool fresh = d.fresh[static_cast<int64_t>(en.seq) * d.layers + layer] != 0;
  const int n = en.ctx_len + r, q = en.q_pos + r;
  const int nb = static_cast<int>(CeilDiv(n, 64));
  const T* rec = reinterpret_cast<const T*>(d.Record(en.seq, layer));
  const T* dst = rec + d.max_slots;
  const float* vsum = d.VSum(en.seq, layer);
  float* out = d.Scores(layer, gl, e, r);
  const bool chunked = d.max_slots % 8 == 0;
  const int g = static_cast<int>(threadIdx.x) / kScore64Lanes;
  const int sub = static_cast<int>(threadIdx.x) % kScore64Lanes;
  // kScore64Rounds blocks per lane group: the prologue above is paid once for all of them (the
  // whole-step grid is issue-bound). The round loop's bound is uniform over the CTA.
  for (int u = 0; u < kScore64Rounds && j0 + u * kGroups < nb; ++u) {
    const int j = j0 + u * kGroups + g;
    float best = -INFINITY, vs = NAN;
    bool by_sum = false;  // uniform over the block's lanes
    if (j < nb) {
      const int lo = j * 64, hi = min(lo + 64, n);
      float wmax = -INFINITY;
      if (hi - lo == 64 && hi - 1 <= q && chunked) {
        vs = vsum[j];
        wmax = WindowMax<T, kScore64Lanes>(dst, q - hi + 1, sub);  // loads go out with vs's
        by_sum = vs == vs;
      }
      if (by_sum) {
        best = wmax;
      } else {
#pragma unroll 8
        for (int i = lo + sub; i < hi; i += kScore64Lanes) {
          const float p = Prediction(LoadT(rec, i), LoadT(dst, i <= q ? q - i : 0));
          best = p > best ? p : best;
        }
      }
    }
    for (int o = kScore64Lanes / 2; o > 0; o /= 2) {
      const float other = __shfl_xor_sync(0xFFFFFFFFu, best, o);
      best = other > best ? other : best;
    }
    if (by_sum) best = Prediction(vs, best);  // -inf when every D entry is unset: then vmax
    if (j < nb && sub == 0 && !fresh) out[j] = best;
  }
}

// One (entry, row) selection: the query block, top by score, then exploration by draw. Per
// block a key and a state (0 = candidate, 1 = query block, 2 = chosen by score). With KPT > 0
// (nb <= KPT * kSelectThreads) they live in registers, element u * blockDim.x + tid in slot u,
// so the radix passes never go back to memory; KPT == 0 keeps them in the private scratch (any
// nb). Both visit the same elements in the same order, so they choose the same set.
//
// The CTA is a chain of latencies, so the loads that do not depend on each other go out
// together: the scores, then (KPT > 0, exploration on) every block's Philox draw is computed
// while they are in flight (the entry's Philox key comes from BeginStep, so no load waits for
// the sequence record), and only then the fresh flag, loaded by the caller alongside, decides
// whether anything is selected.
template <int KPT>
__device__ __forceinline__ void SelectRow(const Dev& d, TopTShared& sh, int layer, int gl, int e,
                                          int r, const StepEntry& en, uint64_t xkey, bool fresh,
                                          int nb, int m, int explore, uint8_t* mask) {
  constexpr int kRegs = KPT > 0 ? KPT : 1;
  const float* s = d.Scores(layer, gl, e, r);
  float score[kRegs];
  unsigned long long rkey[kRegs];
  uint8_t rsel[kRegs];
#pragma unroll
  for (int u = 0; u < kRegs; ++u) {
    score[u] = 0.0f;
    rkey[u] = 0;
    rsel[u] = 1;
  }
  if constexpr (KPT > 0) {
    if (m < nb) {
      ForRounds<KPT>(nb, [&](int u, int j) {
        if (j < nb) score[u] = s[j];
      });
      if (explore > 0) {
        ForRounds<KPT>(nb, [&](int u, int j) {
          if (j < nb) {
            rkey[u] = ~ExplorationDraw(xkey, en.step, static_cast<uint32_t>(layer),
                                       static_cast<uint32_t>(r), static_cast<uint32_t>(j));
          }
        });
      }
    }
  }
  if (fresh) return;  // dense: the union keeps every block
  if (m >= nb) {
    for (int j = threadIdx.x; j < nb; j += blockDim.x) mask[j] = 1;
    return;
  }
  const int qb = min((en.q_pos + r) / d.block, nb - 1);
  const int top = m - 1 - explore;
  const int64_t row_off =
      ((static_cast<int64_t>(gl) * d.max_seqs + e) * d.max_rows + r) * d.max_blocks;
  uint8_t* gsel = d.sel + row_off;
  unsigned long long* gkey = d.keys + row_off;
  auto sel_of = [&](int u, int j) -> uint8_t& {
    if constexpr (KPT > 0) {
      return rsel[u];
    } else {
      return gsel[j];
    }
  };
  unsigned skey[kRegs];
  ForRounds<KPT>(nb, [&](int u, int j) {
    if (j < nb) {
      sel_of(u, j) = j == qb ? 1 : 0;
      if constexpr (KPT > 0) {
        skey[u] = FloatKey(score[u]);
      } else {
        gkey[j] = FloatKey(s[j]);
      }
    }
  });
  if (threadIdx.x == 0) mask[qb] = 1;
  __syncthreads();
  CtaTopT<uint32_t, KPT>(
      sh, nb, top,
      [&](int u, int j) {
        if constexpr (KPT > 0) {
          return skey[u];
        } else {
          return static_cast<uint32_t>(gkey[j]);
        }
      },
      [&](int u, int j) { return sel_of(u, j) == 0; },
      [&](int u, int j) {
        sel_of(u, j) = 2;  // no longer an exploration candidate
        mask[j] = 1;
      });
  __syncthreads();
  if (explore <= 0) return;
  if constexpr (KPT == 0) {
    ForRounds<KPT>(nb, [&](int, int j) {
      if (j < nb && gsel[j] == 0) {
        gkey[j] = ~ExplorationDraw(xkey, en.step, static_cast<uint32_t>(layer),
                                   static_cast<uint32_t>(r), static_cast<uint32_t>(j));
      }
    });
    __syncthreads();
  }
  CtaTopT<unsigned long long, KPT>(
      sh, nb, explore,
      [&](int u, int j) {
        if constexpr (KPT > 0) {
          return rkey[u];
        } else {
          return gkey[j];
        }
      },
      [&](int u, int j) { return sel_of(u, j) == 0; }, [&](int, int j) { mask[j] = 1; });
}

// One (entry, row) selection unless the step is dense for the entry (padding, probe, fresh).
// All threads of the CTA call it.
__device__ void SelectRowOf(const Dev& d, TopTShared& sh, int layer, int gl, int e, int r,
                            const StepEntry& en, uint64_t xkey, bool fresh, double rho,
                            double gamma) {
  if (en.seq < 0 || en.probe) return;  // padding, or dense: the union keeps every block
  const int nb = BlocksOf(d, en.ctx_len + r);
  const int m = KeptBlocks(nb, d.topk, d.block, rho);
  const int explore = ExplorationBlocks(m, gamma);
  uint8_t* mask = d.Mask(gl, e);
  // The smallest register variant that holds the row (fewer unrolled rounds: less code for the
  // instruction cache, which ncu showed missing in this kernel).
  if (nb <= kSelectRegRounds / 2 * kSelectThreads) {
    SelectRow<kSelectRegRounds / 2>(d, sh, layer, gl, e, r, en, xkey, fresh, nb, m, explore, mask);
  } else if (nb <= kSelectRegRounds * kSelectThreads) {
    SelectRow<kSelectRegRounds>(d, sh, layer, gl, e, r, en, xkey, fresh, nb, m, explore, mask);
  } else {
    SelectRow<0>(d, sh, layer, gl, e, r, en, xkey, fresh, nb, m, explore, mask);
  }
}

// The entry's union of its rows' masks, ascending, and its rows' compacted lengths, into the
// layer's select-ahead record (ahead_ids, ahead_info, ahead_len; PublishKernel turns it into the
// outputs, the compacted table and the statistics when the engine calls Select). Run by one CTA
// per (layer, entry) after every row's selection is visible; mask entries written by other CTAs
// of this launch are read through L2 (__ldcg). Thread t takes kUnionRun consecutive blocks per
// round (a round covers kUnionRun * kSelectThreads blocks: 128K slots at b = 64): a warp scan
// of the threads' counts, one barrier for the warp totals, then every thread writes its blocks
// at their places.
constexpr int kUnionRun = 4;
__device__ void UnionOf(const Dev& d, int layer, int gl, int e, const StepEntry& en, bool fresh,
                        int rows) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  constexpr int kWarps = kSelectThreads / 32;
  __shared__ unsigned s_wt[2][kWarps];  // warp totals, by round parity
  // Per row r: union blocks with id < B_r, and whether block B_r - 1 is one of them.
  __shared__ int s_below[kMaxRows], s_last_in[kMaxRows];
  const int64_t at_le = d.Ahead(layer, e);
  if (en.seq < 0) return;  // padding: PublishKernel writes an empty union
  const bool dense = fresh || en.probe;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int widest = BlocksOf(d, en.ctx_len + rows - 1);
  uint8_t* mask = d.Mask(gl, e);
  int32_t* ids = d.ahead_ids + at_le * d.max_blocks;
  int base = 0;  // union blocks in earlier rounds
  for (int round = 0; round * kUnionRun * kSelectThreads < widest; ++round) {
    const int j0 = (round * kSelectThreads + static_cast<int>(threadIdx.x)) * kUnionRun;
    bool on[kUnionRun];
    int c = 0;
#pragma unroll
    for (int i = 0; i < kUnionRun; ++i) {
      const int j = j0 + i;
      on[i] = j < widest && (dense || __ldcg(mask + j));
      c += on[i] ? 1 : 0;
    }
    int incl = c;  // this warp's blocks up to this thread's
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kAll, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) s_wt[round & 1][warp] = static_cast<unsigned>(incl);
    __syncthreads();
    int wincl = lane < kWarps ? static_cast<int>(s_wt[round & 1][lane]) : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kAll, wincl, o);
      if (lane >= o) wincl += v;
    }
    const int round_total = __shfl_sync(kAll, wincl, 31);
    const int earlier_warps = __shfl_sync(kAll, wincl, warp) -
                              static_cast<int>(s_wt[round & 1][warp]);  // lane warp: its own
    int at = base + earlier_warps + incl - c;
#pragma unroll
    for (int i = 0; i < kUnionRun; ++i) {
      const int j = j0 + i;
      if (on[i]) ids[at] = j;
      at += on[i] ? 1 : 0;
      // Row r's last block B_r - 1 < widest is visited by exactly one thread.
      for (int r = 0; r < rows; ++r) {
        if (j == BlocksOf(d, en.ctx_len + r) - 1) {
          s_below[r] = at;
          s_last_in[r] = on[i] ? 1 : 0;
        }
      }
    }
    base += round_total;
  }
  __syncthreads();  // s_below, s_last_in
  if (threadIdx.x == 0) d.ahead_info[at_le] = make_int2(base, dense ? 1 : 0);
  // Row r's compacted length: union blocks below B_r, the last one possibly partial.
  int32_t* clen = d.ahead_len + at_le * d.max_rows;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const int n = en.ctx_len + r;
    const int nb = BlocksOf(d, n);
    clen[r] = s_below[r] * d.block - (s_last_in[r] ? nb * d.block - n : 0);
  }
}

// The selections of the layers l0 .. of a select-ahead group: one CTA per (row, layer, entry)
// (blockIdx.y = gl * n + e) selects its row; the last CTA of a (layer, entry) to finish (a
// per-entry arrival counter that wraps to 0 on the last arrival) builds the union. With one row
// per entry the CTA is its entry's only one and needs no counter.
__global__ void __launch_bounds__(kSelectThreads, 1024 / kSelectThreads)
    SelectKernel(Dev d, int l0, int n_grid) {
  StepKernelEntry();
  __shared__ TopTShared sh;
  __shared__ int s_last;
  const int e = blockIdx.y % n_grid, gl = blockIdx.y / n_grid, layer = l0 + gl;
  const int r = blockIdx.x;
  // Independent loads first (e < the host's n <= max_seqs, so the entry is in bounds).
  const int batch_n = d.batch->n, rows = d.batch->rows;
  const StepEntry en = d.entries[e];
  const double rho = d.step_rho[layer], gamma = d.step_rho[d.layers];
  const uint64_t xkey = d.xkeys[e];
  // Uniform over the entry's CTAs: either all of them arrive or none. rows is the host's
  // (the grid) unless the batch was refused, and then batch_n is 0.
  if (e >= batch_n) return;
  // CtaTopT's precondition; the next barrier publishes it.
  for (int i = threadIdx.x; i < kDigitBins; i += blockDim.x) sh.hist[i] = 0;
  // Read with the scores; nothing writes the entry or the fresh flag during Select.
  const bool fresh = en.seq >= 0 && d.fresh[static_cast<int64_t>(en.seq) * d.layers + layer] != 0;
  if (r < rows) SelectRowOf(d, sh, layer, gl, e, r, en, xkey, fresh, rho, gamma);
  // The CTA's mask writes, ordered before its arrival by the barrier and thread 0's (cumulative)
  // fence; the last CTA's fence orders the arrivals before its reads of the other rows' masks.
  // With one CTA per entry the barrier alone makes its writes visible to its own union.
  __syncthreads();
  if (gridDim.x > 1) {
    if (threadIdx.x == 0) {
      __threadfence();
      // Counts 0 .. gridDim.x - 1 and wraps to 0 on the last arrival, ready for the next launch.
      unsigned* arrive = d.arrive + static_cast<int64_t>(gl) * d.max_seqs + e;
      s_last = atomicInc(arrive, gridDim.x - 1) == gridDim.x - 1 ? 1 : 0;
      if (s_last) __threadfence();
    }
    __syncthreads();
    if (!s_last) return;
  }
  UnionOf(d, layer, gl, e, en, fresh, rows);
}

// Select(l): the layer's select-ahead record into the outputs: the union (and through the
// engine's table the compacted table), the rows' compacted lengths and the layer's statistics.
// (Row 0's block scores stay in the private per-layer array, where the Probe reads them; the
// arena's scratch section is the CPU backend's. ReadDeviceBlockScores reads them for tests.) An
// entry that became padding since the step began (its sequence was reset) gets an empty union, as
// in the reference. Grid: chunks of kPublishThreads * kPublishPer union places x entries; a thread
// loads its places' ids together with the entry (the record is read whole-width: places
// beyond the count are loaded but not used), so it waits for two memory latencies: those loads,
// then the engine's table at the ids.
constexpr int kPublishThreads = 256;
constexpr int kPublishPer = 4;
constexpr int kPublishSpan = kPublishThreads * kPublishPer;
__global__ void __launch_bounds__(kPublishThreads)
    PublishKernel(Dev d, int layer, const int32_t* table, int64_t table_stride) {
  StepKernelEntry();
  const int e = blockIdx.y;
  const int k0 = blockIdx.x * kPublishSpan + static_cast<int>(threadIdx.x);
  // Independent loads first (e < the host's n <= max_seqs, so everything is in bounds).
  const int batch_n = d.batch->n, rows = d.batch->rows;
  const StepEntry en = d.entries[e];
  const int64_t at_le = d.Ahead(layer, e);
  const int2 info = d.ahead_info[at_le];
  const int32_t* src = d.ahead_ids + at_le * d.max_blocks;
  int32_t id[kPublishPer];
#pragma unroll
  for (int u = 0; u < kPublishPer; ++u) {
    const int k = k0 + u * kPublishThreads;
    id[u] = k < d.max_blocks ? src[k] : 0;
  }
  const bool head = blockIdx.x == 0 && static_cast<int>(threadIdx.x) < d.max_rows;
  const int lane_len = head ? d.ahead_len[at_le * d.max_rows + threadIdx.x] : 0;
  if (e >= batch_n) return;
  if (e == 0 && blockIdx.x == 0 && threadIdx.x == 0) d.batch->selected_layer = layer;
  int32_t* clen = d.compact_len + static_cast<int64_t>(e) * d.max_rows;
  const bool live = en.seq >= 0;
  const int count = live ? info.x : 0;
  const bool dense = info.y != 0;
  if (blockIdx.x == 0) {
    if (static_cast<int>(threadIdx.x) < rows) clen[threadIdx.x] = live ? lane_len : 0;
    if (threadIdx.x == 0) {
      d.union_count[e] = count;
      if (live) {
        const int widest = BlocksOf(d, en.ctx_len + rows - 1);
        LayerStats* st = d.stats + layer;
        atomicAdd(reinterpret_cast<unsigned long long*>(&st->steps), 1ull);
        atomicAdd(reinterpret_cast<unsigned long long*>(&st->dense_steps), dense ? 1ull : 0ull);
        atomicAdd(reinterpret_cast<unsigned long long*>(&st->blocks_kept),
                  static_cast<unsigned long long>(count));
        atomicAdd(reinterpret_cast<unsigned long long*>(&st->blocks_total),
                  static_cast<unsigned long long>(widest));
        if (!dense) {
          atomicAdd(reinterpret_cast<unsigned long long*>(&st->sparse_blocks_kept),
                    static_cast<unsigned long long>(count));
          atomicAdd(reinterpret_cast<unsigned long long*>(&st->sparse_blocks_total),
                    static_cast<unsigned long long>(widest));
        }
      }
    }
  }
  if (!live) return;
  const int32_t* row_table = table ? table + e * table_stride : nullptr;
  int32_t ph[kPublishPer];
#pragma unroll
  for (int u = 0; u < kPublishPer; ++u) {
    const int k = k0 + u * kPublishThreads;
    ph[u] = row_table && k < count ? row_table[id[u]] : 0;
  }
  int32_t* ids = d.union_ids + static_cast<int64_t>(e) * d.max_blocks;
  int32_t* phys = d.phys + static_cast<int64_t>(e) * d.max_blocks;
#pragma unroll
  for (int u = 0; u < kPublishPer; ++u) {
    const int k = k0 + u * kPublishThreads;
    if (k < count) {
      ids[k] = id[u];
      if (row_table) phys[k] = ph[u];
    }
  }
}

__global__ void RemapKernel(Dev d, int32_t* idx, int count) {
  StepKernelEntry();
  const int rows = d.batch->rows, n = d.batch->n;
  const int64_t total = static_cast<int64_t>(n) * rows * count;
  const bool selected = d.batch->selected_layer >= 0;
  if (!selected && blockIdx.x == 0 && threadIdx.x == 0) RecordError(d.error, kArenaNoSelect);
  for (int64_t x = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; x < total;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>(x / (static_cast<int64_t>(rows) * count));
    const int r = static_cast<int>((x / count) % rows);
    const int len = (!selected || d.entries[e].seq < 0)
                        ? 0
                        : d.compact_len[static_cast<int64_t>(e) * d.max_rows + r];
    const int c = idx[x];
    idx[x] = (c < 0 || c >= len)
                 ? -1
                 : d.union_ids[static_cast<int64_t>(e) * d.max_blocks + c / d.block] * d.block +
                       c % d.block;
  }
}

// Probe steps. When the step begins, ProbeRankKernel gives every block of a probing (layer,
// entry) its curve level from the step's row-0 block scores: the first grid point whose kept
// blocks include it (the query block is in all), plus a bit for the step's own budget. Observe's
// ProbeKernel then only finds row 0's dense top-K and counts its slots per level. The ranking
// sorts up to kProbeCap blocks (512K slots at b = 64) with cub::BlockRadixSort; the top-K's
// candidates, at most kProbeCap, are held kProbeItems per thread for one CtaTopT. Beyond either,
// CtaTopT radix selects over global memory (the same result, slower).
constexpr int kProbeItems = 8;
constexpr int kProbeIdBits = 13;
constexpr int kProbeCap = 1 << kProbeIdBits;
static_assert(kProbeCap == kProbeThreads * kProbeItems, "a candidate or block per item");
static_assert(kProbeItems <= kSelectRegRounds, "TopTShared's tie counts per round");
static_assert(kCurvePoints < 0x80, "a level and the budget bit in a byte");
constexpr uint8_t kLevelNow = 0x80;  // the block is kept at the step's own budget
// Logits sampled for the candidates' threshold (2 per thread), and logits each thread has in flight
// in the candidate pass.
constexpr int kProbeSampleBits = 11;
constexpr int kProbeSample = 1 << kProbeSampleBits;
constexpr int kProbeLoads = 16;
// At most this many CTAs share one probing entry's row (ProbeKernel): on the H200 66 CTAs per
// entry (batch 16, two probing) were slower than 8 (33.6 against 29.3 us per layer), as were
// 132 against 16 at batch 1 (28.0 against 23.2).
constexpr int kMaxProbeShares = 16;
// ProbeRankKernel<NT> ranks up to NT * kProbeItems blocks by one sort; the host takes the
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

// The one rule of which rows Observe applies (every Observe kernel asks it). Warp-wide: lane rr
// holds row rr's compacted length of the entry (LaneRowLen: 0 past max_rows; rows <= kMaxRows
// <= 32), and RowsFitWarp, called by every lane, is true when no row of the step is longer than
// the logits stride (a longer row makes the whole entry unapplied; ProbeKernel records the error).
__device__ __forceinline__ int LaneRowLen(const Dev& d, int e) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  return lane < d.max_rows ? d.compact_len[static_cast<int64_t>(e) * d.max_rows + lane] : 0;
}
__device__ __forceinline__ bool RowsFitWarp(int lane_len, int rows, int64_t stride) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  return __all_sync(0xFFFFFFFFu, lane >= rows || lane_len <= stride);
}
// The same for one thread: it reads every row's length, and row r's into `len_r`.
__device__ __forceinline__ bool RowsFitStride(const Dev& d, int e, int rows, int64_t stride, int r,
                                              int& len_r) {
  const int32_t* lens = d.compact_len + static_cast<int64_t>(e) * d.max_rows;
  bool fit = true;
  len_r = 0;
  for (int rr = 0; rr < d.max_rows; ++rr) {  // rows <= max_rows
    const int l = lens[rr];
    fit = fit && (rr >= rows || l <= stride);
    if (rr == r) len_r = l;
  }
  return fit;
}
// Row r of entry e is applied: the entry is in the batch and not padding, its accepted count
// (`acc`, rows without an accepted array) is in [0, rows] and above r, and its rows fit the stride.
__device__ __forceinline__ bool RowApplied(int e, int batch_n, int seq, int r, int rows, int acc,
                                           bool rows_fit) {
  return e < batch_n && seq >= 0 && r < rows && acc >= 0 && acc <= rows && r < acc && rows_fit;
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

// Observe's first launch, before the EMA launches, one CTA per multiprocessor (at most
// kMaxProbeShares per entry): CTA g validates accepted and the logits stride of entries g, g + G,
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
// in one CTA took about 390 us per layer on the H200 at 64 x 128K with every sequence probing:
// one load in flight per thread per pass, and the first pass's histogram contended on the few
// bins the logits' top bits fall in.)
__global__ void __launch_bounds__(kProbeThreads)
    ProbeKernel(Dev d, int layer, const float* logits, int64_t stride, const int32_t* accepted) {
  StepKernelEntry();
  const int g = static_cast<int>(blockIdx.x), G = static_cast<int>(gridDim.x);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int batch_n = d.batch->n, rows = d.batch->rows;
  // Validation of entries g, g + G, ... (warp 0): every load of an entry's at once (e < batch n
  // <= max_seqs, and the lengths and accepted count are the entry's own).
  if (threadIdx.x < 32) {
    for (int e = g; e < batch_n; e += G) {
      const StepEntry en = d.entries[e];
      const int acc = accepted ? accepted[e] : rows;
      const bool fit = RowsFitWarp(LaneRowLen(d, e), rows, stride);
      if (lane == 0 && en.seq >= 0) {
        uint8_t* fresh = d.fresh + static_cast<int64_t>(en.seq) * d.layers + layer;
        if (accepted && (acc < 0 || acc > rows)) RecordError(d.error, kArenaBadAccepted);
        if (!fit) RecordError(d.error, kArenaBadStride);
        // Row 0 is applied: the pair is no longer fresh.
        if (RowApplied(e, batch_n, en.seq, 0, rows, acc, fit) && *fresh != 0) *fresh = 0;
      }
    }
  }
  // The probing entries' work (ProbeRankKernel's list): K CTAs per entry, task t being the
  // share t % K of entry t / K.
  const int count = d.probe_count[layer];
  if (count == 0) return;
  const int K = min(kMaxProbeShares, max(1, G / count));
  for (int t = g; t < count * K; t += G) {
    ProbeTask(d, layer, logits, stride, d.probe_list[d.Ahead(layer, t / K)], t % K, K);
  }
}

// What every EMA kernel reads first for row r of entry blockIdx.y. Every warp reads the entry
// itself with independent loads (e < the host's n <= max_seqs, so they are in bounds), so the
// CTA waits for one memory latency and no barrier; rows <= kMaxRows <= 32, so lane rr checks
// row rr's compacted length against the stride. `active` (uniform over the CTA) is false when
// the row is not applied: padding, r >= accepted, accepted out of range, or a stride below a
// compacted row. (The fresh flag is ProbeKernel's.)
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
  w.active = RowApplied(e, batch_n, w.en.seq, r, w.rows, accepted ? acc_in : w.rows, fit);
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
    if (lane == 0) {
      LayerStats* st = d.stats + layer;
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
  const int32_t* ids = d.union_ids + static_cast<int64_t>(blockIdx.y) * d.max_blocks;
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
constexpr int kEmaSegSlots = 64;

// Segments of a compacted row of len slots (b even, >= 64): ceil(b / 64) per whole block, and
// the ones that start below len in the last (partial) block.
SPIN_HD int EmaSegments(int len, int b) {
  const int parts = (b + kEmaSegSlots - 1) / kEmaSegSlots;
  const int whole = len / b, rest = len - whole * b;
  return whole * parts + (rest + kEmaSegSlots - 1) / kEmaSegSlots;
}

// Segment s < EmaSegments(len, b): its compacted block k, its first compacted slot x0, its
// offset in the block off (even) and its slot count cnt in [1, 64].
struct EmaSeg {
  int k, x0, off, cnt;
};
SPIN_HD EmaSeg EmaSegAt(int s, int len, int b) {
  const int parts = (b + kEmaSegSlots - 1) / kEmaSegSlots;
  EmaSeg g;
  g.k = s / parts;
  g.off = (s - g.k * parts) * kEmaSegSlots;
  g.x0 = g.k * b + g.off;
  const int in_block = b - g.off < kEmaSegSlots ? b - g.off : kEmaSegSlots;
  g.cnt = len - g.x0 < in_block ? len - g.x0 : in_block;
  return g;
}

// The segment's D range: slots t <= tmax have i = base + t <= q; entries [jlo, jhi]; wlo the
// even-aligned (by the address parity dpar of D) word start at or below jlo. Empty (tmax < 0,
// jlo > jhi) when the segment starts past the query.
struct EmaDRange {
  int tmax, jlo, jhi, wlo;
};
SPIN_HD EmaDRange EmaDRangeOf(int base, int cnt, int q, int dpar) {
  EmaDRange r;
  r.tmax = q - base < cnt - 1 ? q - base : cnt - 1;
  if (r.tmax < 0) {
    r.tmax = -1;
    r.jlo = 0;
    r.jhi = -1;
    r.wlo = 0;
    return r;
  }
  r.jhi = q - base;
  r.jlo = r.jhi - r.tmax;
  r.wlo = r.jlo - ((dpar + r.jlo) & 1);
  return r;
}
SPIN_HD bool EmaInD(const EmaDRange& r, int j) { return j >= r.jlo && j <= r.jhi; }

// The larger of a and b, NaN if either is NaN.
__device__ __forceinline__ float MaxNaN(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? __int_as_float(0x7FC00000) : fmaxf(a, b);
#endif
}

// Raw state entries (fp32 bits or bf16) and their word loads and stores; the lower address is
// the low half.
template <typename T>
struct StateBits;
template <>
struct StateBits<float> {
  using E = uint32_t;
  static __device__ __forceinline__ float Get(E e) { return __uint_as_float(e); }
  static __device__ __forceinline__ E Put(float f) { return __float_as_uint(f); }
  static __device__ __forceinline__ E Load(const float* p) {
    return *reinterpret_cast<const uint32_t*>(p);
  }
  static __device__ __forceinline__ void Store(float* p, E e) {
    *reinterpret_cast<uint32_t*>(p) = e;
  }
  static __device__ __forceinline__ void LoadWord(const float* p, E& lo, E& hi) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    lo = w.x;
    hi = w.y;
  }
  static __device__ __forceinline__ void StoreWord(float* p, E lo, E hi) {
    *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
  }
};
template <>
struct StateBits<uint16_t> {
  using E = uint16_t;
  static __device__ __forceinline__ float Get(E e) { return Bf16ToFloat(e); }
  static __device__ __forceinline__ E Put(float f) { return FloatToBf16(f); }
  static __device__ __forceinline__ E Load(const uint16_t* p) { return *p; }
  static __device__ __forceinline__ void Store(uint16_t* p, E e) { *p = e; }
  static __device__ __forceinline__ void LoadWord(const uint16_t* p, E& lo, E& hi) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    lo = static_cast<E>(w & 0xFFFFu);
    hi = static_cast<E>(w >> 16);
  }
  static __device__ __forceinline__ void StoreWord(uint16_t* p, E lo, E hi) {
    *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
};

// Entries j (if lo) and j + 1 (if hi) of p: one word access when both (j is then the start of
// an aligned word), else one scalar access per wanted entry. No address is formed for an entry
// that is not wanted.
template <typename T, typename E>
__device__ __forceinline__ void LoadEntries(const T* p, int j, bool lo, bool hi, E& a, E& b) {
  if (lo && hi) {
    StateBits<T>::LoadWord(p + j, a, b);
  } else {
    if (lo) a = StateBits<T>::Load(p + j);
    if (hi) b = StateBits<T>::Load(p + (j + 1));
  }
}
template <typename T, typename E>
__device__ __forceinline__ void StoreEntries(T* p, int j, bool lo, bool hi, E a, E b) {
  if (lo && hi) {
    StateBits<T>::StoreWord(p + j, a, b);
  } else {
    if (lo) StateBits<T>::Store(p + j, a);
    if (hi) StateBits<T>::Store(p + (j + 1), b);
  }
}

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
  const int32_t* ids = d.union_ids + static_cast<int64_t>(blockIdx.y) * d.max_blocks;
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
      const bool ok = RowApplied(e, batch_n, en.seq, r, rows, accepted ? acc_in : rows, fit);
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
    const int32_t* ids = d.union_ids + static_cast<int64_t>(e) * d.max_blocks;
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
  const int32_t* ids = d.union_ids + static_cast<int64_t>(e) * d.max_blocks;
  const int count = d.union_count[e];
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

__global__ void FillUnsetKernel(uint8_t* state, uint64_t elems, int bytes) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < elems;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    if (bytes == 4) {
      reinterpret_cast<float*>(state)[i] = __int_as_float(0x7FC00000);
    } else {
      reinterpret_cast<uint16_t*>(state)[i] = kBf16Unset;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The data plane
// ---------------------------------------------------------------------------------------------

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

class CudaDataPlane final : public DataPlane {
 public:
  CudaDataPlane(const ArenaView& a, const ArenaHeader& h, const CudaDataPlaneOptions& o)
      : a_(a), header_(h), options_(o) {}

  ~CudaDataPlane() override {
    for (void* p : owned_) cudaFree(p);
  }

  absl::Status Init() {
    const Geometry& g = a_.geometry;
    const int64_t S = g.max_seqs, R = g.max_rows, MB = a_.max_blocks;
    d_.policy = a_.policy;
    d_.sparsity = a_.sparsity;
    d_.stats = a_.stats;
    d_.curves = reinterpret_cast<unsigned long long*>(a_.curves);
    d_.seqs = a_.seqs;
    d_.fresh = a_.fresh;
    d_.state = a_.state;
    d_.vsum = a_.vsum;
    d_.batch = a_.batch;
    d_.entries = a_.entries;
    d_.union_count = a_.union_count;
    d_.union_ids = a_.union_ids;
    d_.phys = a_.phys;
    d_.compact_len = a_.compact_len;
    d_.error = a_.error;
    d_.layers = static_cast<int32_t>(g.layers);
    d_.max_seqs = static_cast<int32_t>(g.max_seqs);
    d_.max_slots = static_cast<int32_t>(g.max_slots);
    d_.block = static_cast<int32_t>(g.block_size);
    d_.topk = static_cast<int32_t>(g.topk);
    d_.max_rows = static_cast<int32_t>(g.max_rows);
    d_.max_blocks = static_cast<int32_t>(MB);
    d_.dtype_bytes = static_cast<int32_t>(StateBytes(g.dtype));
    d_.block_shift = -1;
    for (int sh = 0; sh < 31; ++sh) {
      if ((1u << sh) == g.block_size) d_.block_shift = sh;
    }
    d_.seed = header_.seed;
    d_.record_elems = 2ull * g.max_slots;
    void* p = nullptr;
    auto alloc = [&](size_t bytes, void** out) -> absl::Status {
      if (bytes == 0) bytes = 256;
      if (absl::Status s = CudaStatus(cudaMalloc(out, bytes), "cudaMalloc scratch"); !s.ok()) {
        return s;
      }
      owned_.push_back(*out);
      return absl::OkStatus();
    };
    const int64_t L = g.layers;
    observed_.assign(g.layers, 0);
    // Select-ahead groups: as many layers at once as keep the group scratch within
    // kAheadGroupBytes (every layer at once for the usual geometry; 64 x 128K slots needs
    // 128 KB per layer), and no more than the grid's 65535 (layer, entry) pairs allow.
    const bool scratch_keys = MB > static_cast<int64_t>(kSelectRegRounds) * kSelectThreads;
    const int64_t group_bytes_per_layer =
        S * (MB * (1 + (R - 1) * 4 + (scratch_keys ? R * 9 : 0)) + 4);
    const int64_t by_memory = options_.ahead_group_layers > 0
                                  ? options_.ahead_group_layers
                                  : kAheadGroupBytes / group_bytes_per_layer;
    group_ =
        static_cast<int32_t>(std::clamp<int64_t>(std::min<int64_t>(by_memory, 65535 / S), 1, L));
    const int64_t G = group_;
    if (auto s = alloc(L * S * MB * sizeof(float), &p); !s.ok()) return s;
    d_.row0 = static_cast<float*>(p);
    if (auto s = alloc(G * S * (R - 1) * MB * sizeof(float), &p); !s.ok()) return s;
    d_.scores_rest = static_cast<float*>(p);
    if (auto s = alloc(scratch_keys ? G * S * R * MB : 0, &p); !s.ok()) return s;
    d_.sel = static_cast<uint8_t*>(p);
    if (auto s = alloc(scratch_keys ? G * S * R * MB * sizeof(unsigned long long) : 0, &p);
        !s.ok()) {
      return s;
    }
    d_.keys = static_cast<unsigned long long*>(p);
    if (auto s = alloc(G * S * MB, &p); !s.ok()) return s;
    d_.gmask = static_cast<uint8_t*>(p);
    if (auto s = alloc(L * S * MB * sizeof(int32_t), &p); !s.ok()) return s;
    d_.ahead_ids = static_cast<int32_t*>(p);
    if (auto s = alloc(L * S * sizeof(int2), &p); !s.ok()) return s;
    d_.ahead_info = static_cast<int2*>(p);
    if (auto s = alloc(L * S * R * sizeof(int32_t), &p); !s.ok()) return s;
    d_.ahead_len = static_cast<int32_t*>(p);
    if (auto s = alloc(L * S * sizeof(int32_t), &p); !s.ok()) return s;
    d_.probe_list = static_cast<int32_t*>(p);
    if (auto s = alloc(L * sizeof(int32_t), &p); !s.ok()) return s;
    d_.probe_count = static_cast<int32_t*>(p);
    if (auto s = CudaStatus(cudaMemset(p, 0, L * sizeof(int32_t)), "clear probe lists"); !s.ok()) {
      return s;
    }
    if (auto s = alloc(L * S * MB, &p); !s.ok()) return s;
    d_.probe_lvl = static_cast<uint8_t*>(p);
    if (auto s = alloc(S * kProbeCap * sizeof(unsigned long long), &p); !s.ok()) return s;
    d_.probe_cand = static_cast<unsigned long long*>(p);
    if (auto s = alloc(S * 2 * sizeof(int32_t), &p); !s.ok()) return s;
    d_.probe_cnt = static_cast<int32_t*>(p);
    if (auto s = CudaStatus(cudaMemset(p, 0, S * 2 * sizeof(int32_t)), "clear probe counts");
        !s.ok()) {
      return s;
    }
    if (auto s = alloc(S * sizeof(unsigned), &p); !s.ok()) return s;
    d_.probe_arrive = static_cast<unsigned*>(p);
    if (auto s = CudaStatus(cudaMemset(p, 0, S * sizeof(unsigned)), "clear probe arrivals");
        !s.ok()) {
      return s;
    }
    if (auto s = alloc(S * sizeof(uint64_t), &p); !s.ok()) return s;
    d_.xkeys = static_cast<uint64_t*>(p);
    if (auto s = alloc((L + 1) * sizeof(double), &p); !s.ok()) return s;
    d_.step_rho = static_cast<double*>(p);
    if (auto s = alloc(G * S * sizeof(unsigned), &p); !s.ok()) return s;
    d_.arrive = static_cast<unsigned*>(p);
    if (auto s = CudaStatus(cudaMemset(p, 0, G * S * sizeof(unsigned)), "clear arrival counters");
        !s.ok()) {
      return s;
    }
    // ProbeRankKernel: the CTA size that holds the arena's blocks, and its shared memory.
    rank_threads_ = a_.max_blocks <= 256 * kProbeItems   ? 256
                    : a_.max_blocks <= 512 * kProbeItems ? 512
                                                         : 1024;
    cudaError_t ra =
        cudaFuncSetAttribute(ProbeRankKernel<256>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kProbeRankSmemBytes<256>));
    if (ra == cudaSuccess) {
      ra = cudaFuncSetAttribute(ProbeRankKernel<512>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kProbeRankSmemBytes<512>));
    }
    if (ra == cudaSuccess) {
      ra = cudaFuncSetAttribute(ProbeRankKernel<1024>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kProbeRankSmemBytes<1024>));
    }
    if (absl::Status s = CudaStatus(ra, "ProbeRank shared memory"); !s.ok()) return s;
    // EmaWordKernel CTAs resident on the device at once, for its persistent grid.
    int dev = 0, sms = 0, per_sm = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess) {
      e = d_.dtype_bytes == 4 ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                    &per_sm, EmaWordKernel<float>, kEmaThreads, 0)
                              : cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                    &per_sm, EmaWordKernel<uint16_t>, kEmaThreads, 0);
    }
    if (absl::Status s = CudaStatus(e, "EMA occupancy"); !s.ok()) return s;
    ema_resident_ = std::max(1, sms * per_sm);
    sms_ = std::max(1, sms);
    // The 16-byte EMA kernel needs b = 64 and every 16-byte chunk of V and D inside its array.
    ema_vec_ = g.block_size == 64 && g.max_slots % 8 == 0;
    e = d_.dtype_bytes == 4 ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                  &per_sm, EmaVecKernel<float>, kEmaThreads, 0)
                            : cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                  &per_sm, EmaVecKernel<uint16_t>, kEmaThreads, 0);
    if (absl::Status s = CudaStatus(e, "EMA occupancy"); !s.ok()) return s;
    ema_vec_resident_ = std::max(1, sms * per_sm);
    return absl::OkStatus();
  }

  const ArenaView& arena() const override { return a_; }
  bool on_device() const override { return true; }

  // Row 0's block scores of `layer` for entries [0, entries), from the step's selection.
  absl::StatusOr<std::vector<float>> BlockScores(int32_t layer, int32_t entries) const {
    if (absl::Status s = CheckLayer(layer); !s.ok()) return s;
    if (entries < 0 || static_cast<uint32_t>(entries) > a_.geometry.max_seqs) {
      return absl::OutOfRangeError(absl::StrCat("entries ", entries, " out of range"));
    }
    std::vector<float> out(static_cast<size_t>(entries) * a_.max_blocks);
    const float* src = d_.row0 + static_cast<int64_t>(layer) * a_.geometry.max_seqs * a_.max_blocks;
    if (absl::Status s = CudaStatus(
            cudaMemcpy(out.data(), src, out.size() * sizeof(float), cudaMemcpyDeviceToHost),
            "read block scores");
        !s.ok()) {
      return s;
    }
    return out;
  }

  absl::Status ResetSequence(int32_t seq, uint64_t key, cudaStream_t stream) override {
    if (seq < 0 || static_cast<uint32_t>(seq) >= a_.geometry.max_seqs) {
      return absl::OutOfRangeError(
          absl::StrCat("sequence ", seq, " is out of range [0, ", a_.geometry.max_seqs, ")"));
    }
    ResetKernel<<<256, 256, 0, stream>>>(d_, seq, key);
    return CudaStatus(cudaGetLastError(), "ResetSequence launch");
  }

  absl::Status BeginStep(const StepBatch& batch, cudaStream_t stream) override {
    const Geometry& g = a_.geometry;
    if (batch.n < 0 || static_cast<uint32_t>(batch.n) > g.max_seqs) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch of ", batch.n, " entries is out of range [0, ", g.max_seqs, "]"));
    }
    if (batch.rows < 1 || static_cast<uint32_t>(batch.rows) > g.max_rows) {
      return absl::InvalidArgumentError(
          absl::StrCat("rows ", batch.rows, " is out of range [1, ", g.max_rows, "]"));
    }
    if (batch.n > 0 && (!batch.seq || !batch.ctx_len || !batch.q_pos)) {
      return absl::InvalidArgumentError("batch arrays seq, ctx_len and q_pos are required");
    }
    cudaError_t e = Launch(BeginStepKernel, 1, kBeginThreads, stream, d_, batch.seq, batch.ctx_len,
                           batch.q_pos, batch.n, batch.rows);
    n_ = batch.n;
    rows_ = batch.rows;
    selected_layer_ = -1;
    observed_.assign(a_.geometry.layers, 0);
    // Every layer's selection of the step, made now: a layer's selection depends only on its
    // own state (which only its Observe changes), the step's entries and the policy, so the
    // selections of all layers are independent and run as a few wide grids instead of two
    // narrow launches per layer.
    if (e == cudaSuccess) e = SelectAhead(0, static_cast<int32_t>(a_.geometry.layers), stream);
    return CudaStatus(e, "BeginStep launch");
  }

  absl::Status Select(int32_t layer, const int32_t* block_table, int64_t table_stride,
                      cudaStream_t stream) override {
    if (absl::Status s = CheckLayer(layer); !s.ok()) return s;
    if (block_table && table_stride < a_.max_blocks) {
      return absl::InvalidArgumentError(absl::StrCat("block table stride ", table_stride,
                                                     " is below the session's max blocks ",
                                                     a_.max_blocks));
    }
    cudaError_t e = cudaSuccess;
    if (n_ > 0) {
      // The layer's Observe already ran in this step and changed its state: select it again
      // from the state as it is now, as the reference does.
      if (observed_[layer]) {
        e = SelectAhead(layer, 1, stream);
        observed_[layer] = 0;
      }
      if (e == cudaSuccess) {
        const dim3 grid(static_cast<unsigned>(CeilDiv(a_.max_blocks, kPublishSpan)),
                        static_cast<unsigned>(n_));
        e = Launch(PublishKernel, grid, kPublishThreads, stream, d_, layer, block_table,
                   table_stride);
      }
    }
    selected_layer_ = layer;
    return CudaStatus(e, "Select launch");
  }

  absl::Status Remap(int32_t* idx, int32_t count, cudaStream_t stream) override {
    if (selected_layer_ < 0) {
      return absl::FailedPreconditionError("Remap needs a Select of the current step first");
    }
    if (count < 0 || (count > 0 && idx == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat("bad top-K buffer (count ", count, ")"));
    }
    const int64_t total = static_cast<int64_t>(n_) * rows_ * count;
    if (total == 0) return absl::OkStatus();
    const int grid = static_cast<int>(std::min<int64_t>(CeilDiv(total, 256), 4096));
    return CudaStatus(Launch(RemapKernel, grid, 256, stream, d_, idx, count), "Remap launch");
  }

  absl::Status Observe(int32_t layer, const float* logits, int64_t logits_stride,
                       const int32_t* accepted, cudaStream_t stream) override {
    if (absl::Status s = CheckLayer(layer); !s.ok()) return s;
    if (selected_layer_ != layer) {
      return absl::FailedPreconditionError(
          absl::StrCat("Observe of layer ", layer,
                       " without its Select in this step (last: ", selected_layer_, ")"));
    }
    if (n_ == 0) return absl::OkStatus();
    if (logits == nullptr || logits_stride < 0) {
      return absl::InvalidArgumentError("logits are required");
    }
    observed_[layer] = 1;
    // The entries' bookkeeping (validation, fresh flag, probe miss curve), then one EMA launch
    // per row, in row order (the prefix-valid replay), of the kernel for the arena's state type.
    // One CTA per multiprocessor, and no more than kMaxProbeShares per entry, shared out over
    // the probing entries (ProbeKernel).
    const dim3 probe_grid(static_cast<unsigned>(std::min(sms_, kMaxProbeShares * n_)));
    cudaError_t e = Launch(ProbeKernel, probe_grid, kProbeThreads, stream, d_, layer, logits,
                           logits_stride, accepted);
    using EmaFn = void (*)(Dev, int, int, const float*, int64_t, const int32_t*);
    auto per_row = [&](EmaFn fp32, EmaFn bf16, int64_t chunks) {
      const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(chunks, 1, 65535)),
                      static_cast<unsigned>(n_));
      for (int r = 0; r < rows_ && e == cudaSuccess; ++r) {
        e = Launch(d_.dtype_bytes == 4 ? fp32 : bf16, grid, kEmaThreads, stream, d_, layer, r,
                   logits, logits_stride, accepted);
      }
    };
    const int64_t max_len = static_cast<int64_t>(a_.max_blocks) * d_.block;
    if (ema_vec_ && reinterpret_cast<uintptr_t>(logits) % 16 == 0 && logits_stride % 4 == 0) {
      // Persistent as below, a warp taking four segments (blocks) per round: the resident CTAs
      // share out the segments of every entry, or above kEmaFlatMaxEntries those of one entry
      // per grid row.
      const int64_t warp_rounds = CeilDiv(a_.max_blocks, (kEmaThreads / 32) * 4);
      const int flat = n_ <= kEmaFlatMaxEntries ? 1 : 0;
      const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(
                          flat ? std::min<int64_t>(ema_vec_resident_, warp_rounds * n_)
                               : std::min<int64_t>(warp_rounds, ema_vec_resident_ / n_),
                          1, 65535)),
                      static_cast<unsigned>(flat ? 1 : n_));
      for (int r = 0; r < rows_ && e == cudaSuccess; ++r) {
        e = Launch(d_.dtype_bytes == 4 ? EmaVecKernel<float> : EmaVecKernel<uint16_t>, grid,
                   kEmaThreads, stream, d_, layer, r, logits, logits_stride, accepted, n_);
      }
    } else if (d_.block % 2 == 0 && d_.block >= kEmaSegSlots) {
      // Persistent: as many CTAs per entry as are resident on the device in one wave (at least
      // one), and no more than one round of segments per warp needs when the whole context is
      // kept.
      const int64_t rounds =
          CeilDiv(EmaSegments(static_cast<int>(max_len), d_.block), (kEmaThreads / 32) * kEmaSegs);
      per_row(EmaWordKernel<float>, EmaWordKernel<uint16_t>,
              std::min<int64_t>(rounds, ema_resident_ / n_));
      if (e == cudaSuccess) e = LaunchVSummaries(layer, stream);
    } else {
      // Other block sizes: one round of kEmaSlots slots per thread when the whole context is
      // kept (up to 128K slots; beyond, the CTAs stride).
      per_row(EmaKernel<float>, EmaKernel<uint16_t>,
              std::min<int64_t>(CeilDiv(max_len, kEmaThreads * kEmaSlots), 64));
      if (e == cudaSuccess) e = LaunchVSummaries(layer, stream);
    }
    return CudaStatus(e, "Observe launch");
  }

 private:
  // Scores and selections of layers [l0, l0 + count) into their select-ahead records, in
  // groups of group_ layers: per group one Scores grid (chunks x rows x (layer, entry)) and one
  // Select grid (rows x (layer, entry)).
  cudaError_t SelectAhead(int32_t l0, int32_t count, cudaStream_t stream) {
    if (n_ == 0) return cudaSuccess;
    using ScoresFn = void (*)(Dev, int, int);
    const bool fp32 = d_.dtype_bytes == 4;
    const ScoresFn scores = d_.block == 64
                                ? (fp32 ? Scores64Kernel<float> : Scores64Kernel<uint16_t>)
                                : (fp32 ? ScoresKernel<float> : ScoresKernel<uint16_t>);
    const unsigned chunks = static_cast<unsigned>(
        CeilDiv(a_.max_blocks, d_.block == 64 ? kBlocksPerScore64Cta : kBlocksPerScoreCta));
    cudaError_t e = cudaSuccess;
    for (int32_t g0 = l0; g0 < l0 + count && e == cudaSuccess; g0 += group_) {
      const unsigned pairs = static_cast<unsigned>(std::min(group_, l0 + count - g0) * n_);
      e = Launch(scores, dim3(chunks, rows_, pairs), kScoreThreads, stream, d_, g0, n_);
      if (e == cudaSuccess) {
        e = Launch(SelectKernel, dim3(rows_, pairs), kSelectThreads, stream, d_, g0, n_);
      }
    }
    // Probing pairs' curve levels, from the row-0 scores just made, and the layers' lists of
    // probing entries (counted from zero).
    if (e == cudaSuccess) {
      e = cudaMemsetAsync(d_.probe_count + l0, 0, count * sizeof(int32_t), stream);
    }
    if (e == cudaSuccess) {
      const dim3 grid(static_cast<unsigned>(n_), static_cast<unsigned>(count));
      e = rank_threads_ == 256   ? LaunchSmem(ProbeRankKernel<256>, grid, 256,
                                              kProbeRankSmemBytes<256>, stream, d_, l0)
          : rank_threads_ == 512 ? LaunchSmem(ProbeRankKernel<512>, grid, 512,
                                              kProbeRankSmemBytes<512>, stream, d_, l0)
                                 : LaunchSmem(ProbeRankKernel<1024>, grid, 1024,
                                              kProbeRankSmemBytes<1024>, stream, d_, l0);
    }
    return e;
  }

  cudaError_t LaunchVSummaries(int32_t layer, cudaStream_t stream) {
    const unsigned chunks =
        static_cast<unsigned>(std::clamp<int64_t>(CeilDiv(a_.max_blocks, kEmaThreads / 32), 1, 64));
    return Launch(d_.dtype_bytes == 4 ? VSummaryKernel<float> : VSummaryKernel<uint16_t>,
                  dim3(chunks, n_), kEmaThreads, stream, d_, layer);
  }

  absl::Status CheckLayer(int32_t layer) const {
    if (layer < 0 || static_cast<uint32_t>(layer) >= a_.geometry.layers) {
      return absl::OutOfRangeError(
          absl::StrCat("layer ", layer, " is out of range [0, ", a_.geometry.layers, ")"));
    }
    return absl::OkStatus();
  }

  ArenaView a_;
  ArenaHeader header_;
  CudaDataPlaneOptions options_;
  Dev d_{};
  std::vector<void*> owned_;
  // Host mirror of the call sequence (BeginStep/Select), so call-order errors need no sync.
  int32_t n_ = 0, rows_ = 1, selected_layer_ = -1;
  std::vector<uint8_t> observed_;  // per layer: Observe ran in this step (since its selection)
  int32_t group_ = 1;              // layers per select-ahead group
  int ema_resident_ = 1;           // EmaWordKernel CTAs resident on the device at once
  bool ema_vec_ = false;           // EmaVecKernel applies (b = 64, max_slots % 8 == 0) when the
                                   // logits rows are 16-byte aligned
  int sms_ = 1;                    // multiprocessors of the device (ProbeKernel's grid)
  int rank_threads_ = 1024;        // ProbeRankKernel's CTA size
  int ema_vec_resident_ = 1;       // EmaVecKernel CTAs resident on the device at once
};

}  // namespace

bool CudaAvailable() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

absl::StatusOr<ArenaView> InitDeviceArena(void* device_base, uint64_t bytes, const Geometry& g,
                                          uint64_t seed, const Policy& policy,
                                          cudaStream_t stream) {
  if (absl::Status s = ValidatePolicy(policy); !s.ok()) return s;
  absl::StatusOr<ArenaHeader> h = MakeArenaHeader(g, seed);
  if (!h.ok()) return h.status();
  if (bytes < h->total_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device arena of ", bytes, " bytes is too small: the geometry needs ", h->total_bytes));
  }
  absl::StatusOr<ArenaView> v = ViewArenaWithHeader(device_base, bytes, *h);
  if (!v.ok()) return v.status();
  // Small sections are built in host memory and copied; the state is filled on the device.
  ArenaPolicy ap{};
  FillArenaPolicy(policy, &ap);
  ap.epoch = 1;
  std::vector<double> sparsity(g.layers, policy.target_sparsity);
  std::vector<uint8_t> fresh(static_cast<size_t>(g.max_seqs) * g.layers, 1);
  BatchHeader bh{0, 0, -1, 0};  // as InitArena leaves it
  // The copies read host memory that lives only until return: synchronise before returning.
  cudaError_t e = cudaMemsetAsync(device_base, 0, h->total_bytes, stream);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(device_base, &*h, sizeof(ArenaHeader), cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(v->policy, &ap, sizeof(ap), cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(v->sparsity, sparsity.data(), sparsity.size() * sizeof(double),
                        cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(v->fresh, fresh.data(), fresh.size(), cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(v->batch, &bh, sizeof(bh), cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) {
    FillUnsetKernel<<<1024, 256, 0, stream>>>(v->state, 2ull * g.max_seqs * g.layers * g.max_slots,
                                              static_cast<int>(StateBytes(g.dtype)));
    FillUnsetKernel<<<256, 256, 0, stream>>>(
        reinterpret_cast<uint8_t*>(v->vsum),
        static_cast<uint64_t>(g.max_seqs) * g.layers * v->max_blocks, 4);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (absl::Status s = CudaStatus(e, "InitDeviceArena"); !s.ok()) return s;
  return v;
}

absl::Status WriteDevicePolicy(const ArenaView& view, const Policy& policy, cudaStream_t stream) {
  if (absl::Status s = ValidatePolicy(policy); !s.ok()) return s;
  ArenaPolicy ap{};
  cudaError_t e = cudaMemcpyAsync(&ap, view.policy, sizeof(ap), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (absl::Status s = CudaStatus(e, "read policy"); !s.ok()) return s;
  const uint64_t epoch = ap.epoch + 1;
  FillArenaPolicy(policy, &ap);
  ap.epoch = epoch;
  std::vector<double> sparsity(view.geometry.layers, policy.target_sparsity);
  if (policy.budget_mode == BudgetMode::kUniform) {
    e = cudaMemcpyAsync(view.sparsity, sparsity.data(), sparsity.size() * sizeof(double),
                        cudaMemcpyHostToDevice, stream);
  }
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(view.policy, &ap, sizeof(ap), cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  return CudaStatus(e, "write policy");
}

absl::StatusOr<std::unique_ptr<DataPlane>> MakeCudaDataPlane(const ArenaView& view,
                                                             const CudaDataPlaneOptions& options) {
  if (options.ahead_group_layers < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ahead_group_layers ", options.ahead_group_layers, " is negative"));
  }
  ArenaHeader h;
  if (absl::Status s = CudaStatus(cudaMemcpy(&h, view.header, sizeof(h), cudaMemcpyDeviceToHost),
                                  "read arena header");
      !s.ok()) {
    return s;
  }
  absl::StatusOr<ArenaView> checked = ViewArenaWithHeader(view.header, h.total_bytes, h);
  if (!checked.ok()) return checked.status();
  auto dp = std::make_unique<CudaDataPlane>(*checked, h, options);
  if (absl::Status s = dp->Init(); !s.ok()) return s;
  return std::unique_ptr<DataPlane>(std::move(dp));
}

absl::StatusOr<std::vector<float>> ReadDeviceBlockScores(const DataPlane& dp, int32_t layer,
                                                         int32_t entries) {
  const auto* cuda = dynamic_cast<const CudaDataPlane*>(&dp);
  if (cuda == nullptr) return absl::InvalidArgumentError("not a CUDA data plane");
  return cuda->BlockScores(layer, entries);
}

absl::StatusOr<uint32_t> ReadDeviceError(const ArenaView& view) {
  uint32_t err = 0;
  if (absl::Status s = CudaStatus(cudaMemcpy(&err, view.error, sizeof(err), cudaMemcpyDeviceToHost),
                                  "read arena error");
      !s.ok()) {
    return s;
  }
  return err;
}

}  // namespace spin
