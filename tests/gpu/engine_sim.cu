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

// Every 32-bit pattern once (grid-stride over 2^32); counts differences per warp, then one
// atomic per warp.
__global__ void Bf16CheckKernel(unsigned long long* mismatches, uint32_t* first) {
  constexpr uint64_t kAll = 1ull << 32;
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < kAll;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const float f = __uint_as_float(static_cast<uint32_t>(i));
    // The pair conversion too, f with its neighbour pattern (every input in both halves).
    const float g = __uint_as_float(static_cast<uint32_t>(i) ^ 1u);
    const uint32_t pair = FloatsToBf16x2(f, g);
    if (FloatToBf16(f) != FloatToBf16Bits(f) || (pair & 0xFFFFu) != FloatToBf16Bits(f) ||
        (pair >> 16) != FloatToBf16Bits(g)) {
      ++local;
      atomicMin(first, static_cast<uint32_t>(i));
    }
  }
  for (int o = 16; o > 0; o /= 2) local += __shfl_xor_sync(0xFFFFFFFFu, local, o);
  if (threadIdx.x % 32 == 0 && local) atomicAdd(mismatches, local);
}

}  // namespace

cudaError_t CountBf16Mismatches(uint64_t* mismatches, uint32_t* first) {
  unsigned long long* d_count = nullptr;
  uint32_t* d_first = nullptr;
  cudaError_t e = cudaMalloc(&d_count, sizeof(*d_count));
  if (e == cudaSuccess) e = cudaMalloc(&d_first, sizeof(*d_first));
  if (e == cudaSuccess) e = cudaMemset(d_count, 0, sizeof(*d_count));
  if (e == cudaSuccess) e = cudaMemset(d_first, 0xFF, sizeof(*d_first));
  if (e == cudaSuccess) {
    Bf16CheckKernel<<<4096, 256>>>(d_count, d_first);
    e = cudaGetLastError();
  }
  unsigned long long count = 0;
  if (e == cudaSuccess) e = cudaMemcpy(&count, d_count, sizeof(count), cudaMemcpyDeviceToHost);
  if (e == cudaSuccess) e = cudaMemcpy(first, d_first, sizeof(*first), cudaMemcpyDeviceToHost);
  *mismatches = count;
  cudaFree(d_count);
  cudaFree(d_first);
  return e;
}

cudaError_t LaunchGatherLogits(const ArenaView& a, int layer, const float* dense, int64_t n_max,
                               float* logits, int64_t stride, cudaStream_t stream) {
  const dim3 grid(16, a.geometry.max_seqs, a.geometry.max_rows);
  GatherKernel<<<grid, 256, 0, stream>>>(a, layer, static_cast<int>(a.geometry.layers), dense,
                                         n_max, logits, stride);
  return cudaGetLastError();
}

}  // namespace spin::testing
