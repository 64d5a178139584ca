#include "spin/numerics.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace spin {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties go to the even mantissa.
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3F808000u)), 0x3F80);
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3F818000u)), 0x3F82);
  // Just above halfway rounds up.
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3F808001u)), 0x3F81);
  EXPECT_EQ(FloatToBf16(-2.5f), 0xC020);
  EXPECT_EQ(FloatToBf16(INFINITY), 0x7F80);
  // The largest float rounds to infinity (it is above bf16's largest finite value).
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7F80);
}

TEST(Bf16, NanBecomesCanonicalUnset) {
  EXPECT_EQ(FloatToBf16(NAN), kBf16Unset);
  EXPECT_EQ(FloatToBf16(BitsFloat(0x7F800001u)), kBf16Unset);  // signalling NaN
  EXPECT_EQ(FloatToBf16(BitsFloat(0xFFC00000u)), kBf16Unset);  // negative NaN
  EXPECT_TRUE(std::isnan(Bf16ToFloat(kBf16Unset)));
}

TEST(Bf16, WidenIsExact) {
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      EXPECT_EQ(FloatToBf16(f), h);
    }
  }
}

// Known-answer vectors of Philox4x32-10 published with the Random123 library.
TEST(Philox, KnownAnswers) {
  Philox4 out = Philox4x32_10(Philox4{{0, 0, 0, 0}}, 0, 0);
  EXPECT_EQ(out.v[0], 0x6627e8d5u);
  EXPECT_EQ(out.v[1], 0xe169c58du);
  EXPECT_EQ(out.v[2], 0xbc57ac4cu);
  EXPECT_EQ(out.v[3], 0x9b00dbd8u);
  out = Philox4x32_10(Philox4{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu,
                      0xffffffffu);
  EXPECT_EQ(out.v[0], 0x408f276du);
  EXPECT_EQ(out.v[1], 0x41c83b0eu);
  EXPECT_EQ(out.v[2], 0xa20bc7c6u);
  EXPECT_EQ(out.v[3], 0x6d5451fdu);
  out = Philox4x32_10(Philox4{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u,
                      0x299f31d0u);
  EXPECT_EQ(out.v[0], 0xd16cfe09u);
  EXPECT_EQ(out.v[1], 0x94fdccebu);
  EXPECT_EQ(out.v[2], 0x5001e420u);
  EXPECT_EQ(out.v[3], 0x24126ea1u);
}

// The key and counter layout by known answers: the key is seed ^ key * 0x9E3779B97F4A7C15
// (mod 2^64), and a draw is Philox of (block, layer << 16 | row, step low, step high) under
// (key low, key high), read as out[0] : out[1]; with the words of the published vectors above.
TEST(Exploration, KeyAndCounterLayoutKnownAnswers) {
  EXPECT_EQ(ExplorationKey(0, 1), 0x9E3779B97F4A7C15ull);
  EXPECT_EQ(ExplorationKey(1, 1), 0x9E3779B97F4A7C14ull);
  EXPECT_EQ(ExplorationKey(0, 2), 0x3C6EF372FE94F82Aull);
  EXPECT_EQ(ExplorationKey(0xFF, 0), 0xFFull);
  EXPECT_EQ(ExplorationDraw(0, 0, 0, 0, 0), 0x6627e8d5e169c58dull);
  EXPECT_EQ(ExplorationDraw(~0ull, ~0ull, 0xFFFFu, 0xFFFFu, 0xffffffffu), 0x408f276d41c83b0eull);
  EXPECT_EQ(
      ExplorationDraw(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a3u, 0x08d3u, 0x243f6a88u),
      0xd16cfe0994fdccebull);
}

TEST(Exploration, DrawDependsOnEveryCounterField) {
  const uint64_t key = ExplorationKey(1, 2);
  const uint64_t base = ExplorationDraw(key, 5, 3, 0, 9);
  EXPECT_NE(base, ExplorationDraw(ExplorationKey(1, 3), 5, 3, 0, 9));
  EXPECT_NE(base, ExplorationDraw(ExplorationKey(2, 2), 5, 3, 0, 9));
  EXPECT_NE(base, ExplorationDraw(key, 6, 3, 0, 9));
  EXPECT_NE(base, ExplorationDraw(key, 5, 4, 0, 9));
  EXPECT_NE(base, ExplorationDraw(key, 5, 3, 1, 9));
  EXPECT_NE(base, ExplorationDraw(key, 5, 3, 0, 10));
  EXPECT_NE(base, ExplorationDraw(key, 5ull | (1ull << 32), 3, 0, 9));
}

TEST(Budget, RoundingOfKeptBlocks) {
  // (1 - 0.4) * 100 is 60.000000000000007 in double; the 1e-6 keeps it at 60, not 61.
  EXPECT_EQ(KeptBlocks(100, 64, 64, 0.4), 60);
  EXPECT_EQ(KeptBlocks(100, 64, 64, 0.3), 70);
  EXPECT_EQ(KeptBlocks(100, 64, 64, 0.35), 65);
  EXPECT_EQ(KeptBlocks(4000, 64, 64, 0.35), 2600);
  // A fractional keep rounds up: 0.5 * 7 = 3.5 -> 4.
  EXPECT_EQ(KeptBlocks(7, 64, 64, 0.5), 4);
  EXPECT_EQ(KeptBlocks(100, 64, 64, 0.0), 100);
  EXPECT_EQ(KeptBlocks(100, 64, 64, 0.999), 1);
}

TEST(Budget, TopKFloorAndCap) {
  // ceil(2048 / 64) = 32 blocks at least, never more than the context has.
  EXPECT_EQ(KeptBlocks(40, 2048, 64, 0.5), 32);
  EXPECT_EQ(KeptBlocks(20, 2048, 64, 0.5), 20);
  EXPECT_EQ(KeptBlocks(1000, 2048, 64, 0.99), 32);
  EXPECT_EQ(KeptBlocks(1000, 2049, 64, 0.99), 33);
}

TEST(Budget, ExplorationCount) {
  EXPECT_EQ(ExplorationBlocks(60, 0.05), 3);
  EXPECT_EQ(ExplorationBlocks(100, 0.05), 5);  // 0.05 * 100 = 5.000000000000001 in double
  EXPECT_EQ(ExplorationBlocks(19, 0.05), 0);
  EXPECT_EQ(ExplorationBlocks(20, 0.05), 1);
  EXPECT_EQ(ExplorationBlocks(1, 0.5), 0);  // the query block is never replaced
  EXPECT_EQ(ExplorationBlocks(10, 0.0), 0);
}

TEST(Ema, UnsetTakesScoreElseFusedUpdate) {
  EXPECT_EQ(EmaUpdate(NAN, 3.0f, 0.75f, 0.25f), 3.0f);
  EXPECT_EQ(EmaUpdate(1.0f, 3.0f, 0.75f, 0.25f), 1.5f);
  // One rounding of alpha v + round(beta z), worked out in exact rational arithmetic: alpha
  // 0.9f, beta (float)(1 - 0.9f) = 0x3DCCCCD0, v = 0x3F3C5FD7, z = 0x3EFDA9AA; beta z rounds to
  // 0x3D4AEE25 and the fused sum to 0x3F363857, where rounding alpha v first gives 0x3F363856.
  const float a = 0.9f, b = BitsFloat(0x3DCCCCD0u);
  EXPECT_EQ(FloatBits(EmaUpdate(BitsFloat(0x3F3C5FD7u), BitsFloat(0x3EFDA9AAu), a, b)),
            0x3F363857u);
}

TEST(Prediction, NanIgnoringMaxAndUnsetIsInfinite) {
  EXPECT_EQ(Prediction(1.0f, 2.0f), 2.0f);
  EXPECT_EQ(Prediction(3.0f, 2.0f), 3.0f);
  EXPECT_EQ(Prediction(NAN, 2.0f), 2.0f);
  EXPECT_EQ(Prediction(-1.0f, NAN), -1.0f);
  EXPECT_EQ(Prediction(NAN, NAN), INFINITY);
}

}  // namespace
}  // namespace spin
