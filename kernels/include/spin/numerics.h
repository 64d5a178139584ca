// Numerics shared bit-for-bit by the CPU and CUDA backends: bf16 conversion, the counter-based
// exploration draw (Philox4x32-10) and the block-budget arithmetic of docs/design.md §5.
//
// Everything here is plain integer or IEEE arithmetic with a single fixed evaluation order, so
// a host compiler and nvcc produce identical results (bf16 narrowing uses the hardware
// conversion on the device, checked equal to the integer definition for every input). Keep it free
// of any compiler contraction: the kernels library builds with -ffp-contract=off.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#define SPIN_HD __host__ __device__ __forceinline__
#else
#define SPIN_HD inline
#endif

namespace spin {

/// Bit pattern of an unset bf16 state entry: the quiet NaN that the GPU's float -> bf16
/// conversion (cvt.rn.bf16.f32) returns for every NaN input, so that the device narrows with
/// that one instruction and no NaN test (FloatToBf16 below).
inline constexpr uint16_t kBf16Unset = 0x7FFF;

/// Reinterprets the bits of a float.
SPIN_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

/// Float with the given bits.
SPIN_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

/// Widens bf16 to float (exact).
SPIN_HD float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

/// Narrows float to bf16, rounding to nearest even; every NaN becomes kBf16Unset. The integer
/// definition, used on the host.
SPIN_HD uint16_t FloatToBf16Bits(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kBf16Unset;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

/// FloatToBf16Bits. On the device: the hardware conversion alone (cvt.rn.bf16.f32 rounds to
/// nearest even, keeps subnormals, overflows to inf and returns kBf16Unset for every NaN, as the
/// integer definition does); one instruction instead of about six (the EMA narrows two values
/// per slot). The GPU test CudaNumerics.DeviceBf16NarrowingEqualsTheReferenceForEveryFloat
/// checks all 2^32 inputs.
SPIN_HD uint16_t FloatToBf16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  return FloatToBf16Bits(f);
#endif
}

/// FloatToBf16(lo) | FloatToBf16(hi) << 16: on the device one conversion of the pair.
SPIN_HD uint32_t FloatsToBf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  return static_cast<uint32_t>(__bfloat16_as_ushort(p.x)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(p.y)) << 16);
#else
  return static_cast<uint32_t>(FloatToBf16Bits(lo)) |
         (static_cast<uint32_t>(FloatToBf16Bits(hi)) << 16);
#endif
}

/// One Philox4x32-10 block (Salmon et al., SC'11): 128-bit counter, 64-bit key.
struct Philox4 {
  uint32_t v[4];
};

SPIN_HD void MulHiLo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

SPIN_HD Philox4 Philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    MulHiLo32(kM0, ctr.v[0], &hi0, &lo0);
    MulHiLo32(kM1, ctr.v[2], &hi1, &lo1);
    ctr = Philox4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

/// The 64-bit Philox key of one sequence: the session seed mixed with the engine's sequence
/// key (an odd multiplier makes the map from sequence key to Philox key a bijection).
SPIN_HD uint64_t ExplorationKey(uint64_t session_seed, uint64_t sequence_key) {
  return session_seed ^ (sequence_key * 0x9E3779B97F4A7C15ull);
}

/// The exploration draw of one block: smaller draws are explored first (ties: lower block id).
/// Counter = (block, layer << 16 | row, step low word, step high word).
SPIN_HD uint64_t ExplorationDraw(uint64_t key, uint64_t step, uint32_t layer, uint32_t row,
                                 uint32_t block) {
  const Philox4 out =
      Philox4x32_10(Philox4{{block, (layer << 16) | (row & 0xFFFFu), static_cast<uint32_t>(step),
                             static_cast<uint32_t>(step >> 32)}},
                    static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32));
  return (static_cast<uint64_t>(out.v[0]) << 32) | out.v[1];
}

/// Integer ceiling division for non-negative operands.
SPIN_HD int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// Blocks one row keeps (docs/design.md §5):
/// m = min(B, max(ceil(K/b), ceil((1 - rho) * B - 1e-6))), evaluated in double.
SPIN_HD int32_t KeptBlocks(int32_t num_blocks, int32_t topk, int32_t block_size, double sparsity) {
  const int64_t floor_blocks = CeilDiv(topk, block_size);
  const double want = ceil((1.0 - sparsity) * static_cast<double>(num_blocks) - 1e-6);
  int64_t m = static_cast<int64_t>(want < 0.0 ? 0.0 : want);
  if (m < floor_blocks) m = floor_blocks;
  if (m > num_blocks) m = num_blocks;
  return static_cast<int32_t>(m);
}

/// Exploration blocks among m kept: floor(gamma * m + 1e-6), at most m - 1 (the query block is
/// always kept).
SPIN_HD int32_t ExplorationBlocks(int32_t kept, double exploration) {
  int64_t e = static_cast<int64_t>(floor(exploration * static_cast<double>(kept) + 1e-6));
  if (e > kept - 1) e = kept - 1;
  if (e < 0) e = 0;
  return static_cast<int32_t>(e);
}

/// Fixed-point unit of the exploration miss estimate (LayerStats::explore_est): 1/1024 slot.
inline constexpr uint64_t kExploreEstUnit = 1024;

/// The weight of one top-K slot found in a row's exploration blocks, in the exploration estimate
/// of how many top-K slots the row's selection missed (docs/budgets.md, "Measured between
/// probes"): the row ranks m - e blocks and explores e more, drawn uniformly from the
/// `unranked` = B - (m - e) blocks outside its ranked part, which hold every top-K slot it
/// misses; each top-K slot found in the explored blocks stands for (unranked - e) / e more in
/// the unexplored rest. In units of 1/kExploreEstUnit slot, rounded down (a slot's weight, so
/// sums over slots are exact in any order); 0 without exploration.
SPIN_HD uint64_t ExploreHitWeight(int32_t unranked, int32_t explored) {
  if (explored <= 0 || unranked <= explored) return 0;
  return kExploreEstUnit * static_cast<uint64_t>(unranked - explored) /
         static_cast<uint64_t>(explored);
}

/// The mean miss the exploration estimate gives for `est` (LayerStats::explore_est, or a delta of
/// it) over `topk` top-K slots (explore_topk): est / kExploreEstUnit / topk; 0 without slots.
SPIN_HD double ExploreMissRate(uint64_t est, uint64_t topk) {
  return topk == 0 ? 0.0
                   : static_cast<double>(est) / static_cast<double>(kExploreEstUnit) /
                         static_cast<double>(topk);
}

/// One EMA update of a state entry: z if unset (NaN), else fmaf(alpha, v, beta * z), where
/// beta = (float)(1 - alpha) is computed once by the caller. EmaUpdateScaled takes beta * z
/// (bz) already computed, for a caller that updates two entries with one score.
SPIN_HD float EmaUpdateScaled(float v, float z, float alpha, float bz) {
  if (v != v) return z;
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(alpha, v, bz);
#else
  return std::fma(alpha, v, bz);
#endif
}
SPIN_HD float ScaledScore(float z, float beta) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(beta, z);
#else
  return beta * z;
#endif
}
SPIN_HD float EmaUpdate(float v, float z, float alpha, float beta) {
  return EmaUpdateScaled(v, z, alpha, ScaledScore(z, beta));
}

/// NaN-ignoring max of the vertical and diagonal predictions; +inf when both are unset.
SPIN_HD float Prediction(float v, float d) {
  const float p = (v > d || d != d) ? v : d;
  return p != p ? INFINITY : p;
}

}  // namespace spin
