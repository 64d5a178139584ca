// The step's selections, made ahead for groups of layers when the step begins (Scores/Scores64
// -> Select, which also builds each (layer, entry)'s union), and the per-layer Publish (Select)
// and Remap kernels.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "device_common.cuh"
#include "launchers.h"
#include "spin/arena.h"
#include "spin/numerics.h"
#include "top_t.cuh"

namespace spin::cuda_kernels {
namespace {

constexpr int kScoreThreads = 256;
constexpr int kBlocksPerScoreCta = 32;  // 8 warps x 4 blocks (ScoresKernel)
// Scores64Kernel: 256 blocks per CTA, each lane of a block loading two 16-byte chunks of its D
// window (4 lanes per block for bf16, 8 for fp32), so a lane group takes 4 (bf16) or 8 (fp32)
// blocks in turn and the per-CTA prologue is paid once for all of them: with one block per lane
// group the whole-step grid was issue-bound on that prologue (docs/lab/cuda-kernel-tuning.md).
constexpr int kBlocksPerScore64Cta = 256;
template <typename T>
constexpr int Score64Lanes() {
  return 64 * static_cast<int>(sizeof(T)) / 32;
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
// it is not used). Other blocks are scored slot by slot as in ScoresKernel. (Slot by slot the
// kernel is issue-bound: dozens of instructions per slot for the 64-bit addressing, conversions
// and NaN rules; docs/lab/cuda-kernel-tuning.md.)
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
  // Row 0's exploration blocks are marked in the pair's probe_lvl bytes (a sparse pair's are
  // free: ProbeRankKernel writes them for probing pairs only) for RemapTopK's exploration
  // estimate; the row's other bytes are cleared first.
  uint8_t* xmark = r == 0 && explore > 0 ? d.probe_lvl + d.Ahead(layer, e) * d.max_blocks : nullptr;
  unsigned skey[kRegs];
  ForRounds<KPT>(nb, [&](int u, int j) {
    if (j < nb) {
      if (xmark) xmark[j] = 0;
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
      [&](int u, int j) { return sel_of(u, j) == 0; },
      [&](int, int j) {
        mask[j] = 1;
        if (xmark) xmark[j] = kLevelExplored;
      });
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
  if (!Served(en)) return;  // padding: PublishKernel writes an empty union
  const bool dense = en.seq < 0 || fresh || en.probe;  // no sequence: every block
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
    PublishKernel(Dev d, int layer, const int32_t* table, int64_t table_stride, int count_stats) {
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
  const bool live = Served(en);
  const int count = live ? info.x : 0;
  if (blockIdx.x == 0) {
    if (static_cast<int>(threadIdx.x) < rows) clen[threadIdx.x] = live ? lane_len : 0;
    if (threadIdx.x == 0) {
      d.union_count[e] = count;
      if (en.seq >= 0 && count_stats) AddSelectCountsOf(d, layer, en, info, rows);
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

__global__ void RemapKernel(Dev d, int layer, int32_t* idx, int count, int probe) {
  StepKernelEntry();
  RemapShare(d, layer, idx, count, probe,
             blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
             static_cast<int64_t>(gridDim.x) * blockDim.x);
}

// Select's statistics of `layer` for the step's entries (a Select whose selection was published
// ahead launched nothing, and no Observe of the layer counted them).
__global__ void __launch_bounds__(256) CountSelectKernel(Dev d, int layer) {
  StepKernelEntry();
  const int batch_n = d.batch->n, rows = d.batch->rows;
  for (int e = static_cast<int>(threadIdx.x); e < batch_n; e += static_cast<int>(blockDim.x)) {
    CountSelectOf(d, layer, e, rows);
  }
}

}  // namespace

cudaError_t LaunchScores(const Dev& d, int l0, int layers, int n, int rows, cudaStream_t stream) {
  using ScoresFn = void (*)(Dev, int, int);
  const bool fp32 = d.dtype_bytes == 4;
  const ScoresFn scores = d.block == 64 ? (fp32 ? Scores64Kernel<float> : Scores64Kernel<uint16_t>)
                                        : (fp32 ? ScoresKernel<float> : ScoresKernel<uint16_t>);
  const unsigned chunks = static_cast<unsigned>(
      CeilDiv(d.max_blocks, d.block == 64 ? kBlocksPerScore64Cta : kBlocksPerScoreCta));
  const unsigned pairs = static_cast<unsigned>(layers * n);
  return Launch(scores, dim3(chunks, rows, pairs), kScoreThreads, stream, d, l0, n);
}

cudaError_t LaunchSelect(const Dev& d, int l0, int layers, int n, int rows, cudaStream_t stream) {
  const unsigned pairs = static_cast<unsigned>(layers * n);
  return Launch(SelectKernel, dim3(rows, pairs), kSelectThreads, stream, d, l0, n);
}

cudaError_t LaunchPublish(const Dev& d, int layer, int n, const int32_t* table,
                          int64_t table_stride, bool count_stats, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(CeilDiv(d.max_blocks, kPublishSpan)),
                  static_cast<unsigned>(n));
  return Launch(PublishKernel, grid, kPublishThreads, stream, d, layer, table, table_stride,
                count_stats ? 1 : 0);
}

cudaError_t LaunchCountSelect(const Dev& d, int layer, int n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return Launch(CountSelectKernel, 1, 256, stream, d, layer);
}

cudaError_t LaunchRemap(const Dev& d, int layer, int32_t* idx, int count, int n, int rows,
                        bool probe, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(n) * rows * count;
  if (total == 0) return cudaSuccess;
  const int grid = static_cast<int>(std::min<int64_t>(CeilDiv(total, 256), 4096));
  return Launch(RemapKernel, grid, 256, stream, d, layer, idx, count, probe ? 1 : 0);
}

}  // namespace spin::cuda_kernels
