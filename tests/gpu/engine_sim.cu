// Test support: the part of an engine the GPU tests need inside a CUDA graph. GatherLogits
// plays the engine's indexer: it writes each row's compacted logits from a dense score array,
// reading the union that Select left in the arena, on device, with no host involvement.
#include <cuda_runtime.h>

#include <cmath>

#include "engine_sim.h"
#include "spin/numerics.h"

namespace spin::testing {
namespace {

__global__ void GatherKernel(ArenaView a, int layer, int layers, const float* dense, int64_t n_max,
                             float* logits, int64_t stride) {
  const int e = blockIdx.y, r = blockIdx.z;
  if (e >= a.batch->n || r >= a.batch->rows) return;
  const StepEntry en = a.entries[e];
  const int rows = a.batch->rows, b = static_cast<int>(a.geometry.block_size);
  float* out = logits + (static_cast<int64_t>(e) * rows + r) * stride;
  const float* z = dense + ((static_cast<int64_t>(e) * layers + layer) * rows + r) * n_max;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < stride;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = -INFINITY;
    const int k = static_cast<int>(c / b);
    if (en.seq >= 0 && k < a.union_count[e]) {
      const int64_t i =
          static_cast<int64_t>(a.union_ids[static_cast<int64_t>(e) * a.max_blocks + k]) * b + c % b;
      if (i < en.ctx_len + r) v = z[i];
    }
    out[c] = v;
  }
}

}  // namespace

cudaError_t LaunchGatherLogits(const ArenaView& a, int layer, const float* dense, int64_t n_max,
                               float* logits, int64_t stride, cudaStream_t stream) {
  const dim3 grid(16, a.geometry.max_seqs, a.geometry.max_rows);
  GatherKernel<<<grid, 256, 0, stream>>>(a, layer, static_cast<int>(a.geometry.layers), dense,
                                         n_max, logits, stride);
  return cudaGetLastError();
}

}  // namespace spin::testing
