// Dev: what every kernel of the CUDA backend gets about the arena and the data plane's private
// memory, by value; and the kernel sizes that the host needs to lay that private memory out.
//
// A plain header: no device code, so host code (cuda_data_plane.cu, launchers.h) can fill a Dev
// without seeing the kernels. The accessors are host-and-device (SPIN_HD) pointer arithmetic.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "spin/arena.h"
#include "spin/numerics.h"

namespace spin::cuda_kernels {

// Threads of a Select CTA: 512 threads with up to 8 keys each, so two CTAs share an SM (64
// registers); the select-ahead grid has a CTA per (layer, entry, row). Measured faster than 1024
// threads with 4 keys (docs/lab/cuda-kernel-tuning.md).
inline constexpr int kSelectThreads = 512;
// Select keeps a row's keys in registers up to this many per thread (4096 blocks: 256K
// slots at b = 64), and in the private scratch beyond.
inline constexpr int kSelectRegRounds = 8;
// Threads of a Probe CTA (up to 16 per entry; the last of an entry takes the top-K of up to 8192
// candidates, 8 per thread), and the most any CtaTopT caller uses.
inline constexpr int kProbeThreads = 1024;
// Keys per thread of ProbeRankKernel's sort and of ProbeKernel's candidates; kProbeCap
// candidates per entry (probe_cand below), one per item of a kProbeThreads CTA.
inline constexpr int kProbeItems = 8;
inline constexpr int kProbeIdBits = 13;
inline constexpr int kProbeCap = 1 << kProbeIdBits;
static_assert(kProbeCap == kProbeThreads * kProbeItems, "a candidate or block per item");
// A probing block's level byte (probe_lvl): the first curve point whose kept blocks include it,
// and this bit when the step's own budget keeps it.
inline constexpr uint8_t kLevelNow = 0x80;
// On a sparse pair, probe_lvl marks row 0's exploration blocks instead (its Select writes the
// row's bytes: this bit, or 0), which RemapTopK counts for the exploration estimate.
inline constexpr uint8_t kLevelExplored = 0x40;

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
  // Where Observe's kernels and Remap read the selected layer's union and row lengths (entry e
  // at sel_ids + e * max_blocks, sel_lens + e * max_rows): the published outputs (union_ids,
  // compact_len; in L2 after Select's Publish), or the layer's select-ahead record when the
  // outputs may hold the next layer's selection (publish ahead). Set per launch by the host.
  const int32_t* sel_ids;
  const int32_t* sel_lens;
  uint32_t* error;
  // Private memory (allocated by the data plane). The step's selections are made ahead, when
  // the step begins, for groups of layers at once (CudaDataPlane::SelectAhead); "gl" is a
  // layer's place in its group, and the group scratch is reused by the next group.
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
  uint8_t* probe_lvl;        // [L][S][MB]: curve level of each block (ProbeRankKernel); on a
                             // sparse pair, row 0's exploration blocks (kLevelExplored)
  uint8_t* probe_on;         // [L][S]: 1 = the pair probes at this selection (ProbeRankKernel)
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

  SPIN_HD uint8_t* Record(int seq, int layer) const {
    return state + (static_cast<uint64_t>(seq) * layers + layer) * record_elems * dtype_bytes;
  }
  SPIN_HD float* VSum(int seq, int layer) const {
    return vsum + (static_cast<int64_t>(seq) * layers + layer) * max_blocks;
  }
  // Row r's block scores of (layer, entry e), the layer at place gl of its group.
  SPIN_HD float* Scores(int layer, int gl, int e, int r) const {
    return r == 0 ? row0 + (static_cast<int64_t>(layer) * max_seqs + e) * max_blocks
                  : scores_rest +
                        ((static_cast<int64_t>(gl) * max_seqs + e) * (max_rows - 1) + (r - 1)) *
                            max_blocks;
  }
  SPIN_HD uint8_t* Mask(int gl, int e) const {
    return gmask + (static_cast<int64_t>(gl) * max_seqs + e) * max_blocks;
  }
  SPIN_HD int64_t Ahead(int layer, int e) const {
    return static_cast<int64_t>(layer) * max_seqs + e;
  }
};

}  // namespace spin::cuda_kernels
