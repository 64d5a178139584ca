// cp.async (sm_80+): 16-byte copies from global to shared memory that complete asynchronously,
// in groups. A thread sees its own copies after CpAsyncWait<N>() (at most N of its committed
// groups still pending); other threads see them after that and a barrier they share
// (__syncthreads, or __syncwarp within a warp).
#pragma once

#include <cstdint>

namespace spin {

__device__ __forceinline__ uint32_t SharedAddress(const void* smem) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(smem));
}
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  CpAsync16(SharedAddress(smem), gmem);
}
// The first src_bytes (0..16) of the 16 at gmem, the rest of the 16 shared bytes zero; no byte
// past gmem + src_bytes is read.
__device__ __forceinline__ void CpAsync16Prefix(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsync8(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(SharedAddress(smem)), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace spin
