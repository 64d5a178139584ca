// Kernels that set the arena up and begin a step: FillUnset (a new arena's unset state and V
// summaries), Reset (one sequence) and BeginStep (the step's entries, counters and budgets).
#include <cuda_runtime.h>

#include <cstdint>

#include "device_common.cuh"
#include "launchers.h"
#include "spin/arena.h"
#include "spin/numerics.h"

namespace spin::cuda_kernels {
namespace {

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
        if (d.entries[e].seq == seq) d.entries[e].seq = -1, d.entries[e].ctx_len = 0;
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
    if (e >= n) continue;
    if (s[u] == -1) {  // no sequence: served dense over ctx_len slots (0: nothing)
      const int64_t cc = c[u];
      if (cc < 0 || (cc > 0 && cc + last > d.max_slots)) ok_all = false;
      continue;
    }
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
      en.ctx_len = c[u];  // served dense; q_pos, step and probe 0
      d.entries[e] = en;
    }
  }
  if (threadIdx.x == 0) {
    d.batch->n = n;
    d.batch->rows = rows;
    d.batch->selected_layer = -1;
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

}  // namespace

cudaError_t LaunchReset(const Dev& d, int seq, uint64_t key, cudaStream_t stream) {
  ResetKernel<<<256, 256, 0, stream>>>(d, seq, key);
  return cudaGetLastError();
}

cudaError_t LaunchBeginStep(const Dev& d, const int32_t* seq, const int32_t* ctx_len,
                            const int32_t* q_pos, int n, int rows, cudaStream_t stream) {
  return Launch(BeginStepKernel, 1, kBeginThreads, stream, d, seq, ctx_len, q_pos, n, rows);
}

cudaError_t LaunchFillUnset(uint8_t* state, uint64_t state_elems, int state_bytes, float* vsum,
                            uint64_t vsum_elems, cudaStream_t stream) {
  FillUnsetKernel<<<1024, 256, 0, stream>>>(state, state_elems, state_bytes);
  FillUnsetKernel<<<256, 256, 0, stream>>>(reinterpret_cast<uint8_t*>(vsum), vsum_elems, 4);
  return cudaGetLastError();
}

}  // namespace spin::cuda_kernels
