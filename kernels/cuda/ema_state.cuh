// The raw state entries and the segment geometry of the word-access EMA kernels (EmaWordKernel,
// EmaVecKernel; ema_kernels.cu describes the layout). EmaSegments is host-and-device: the
// launcher sizes EmaWordKernel's grid with it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "spin/numerics.h"

namespace spin::cuda_kernels {

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

}  // namespace spin::cuda_kernels
