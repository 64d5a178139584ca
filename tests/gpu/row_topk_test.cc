// The row top-k kernel (spin/row_topk.h) against its host reference, index for index: random
// rows, ties at the threshold, NaN and infinities, short, empty and clamped lengths, k from 1 to
// 8192, and the engine's shape (64 rows of 128K, k 2048). Also run under compute-sanitizer
// memcheck and racecheck by scripts/gpu-check.
#include "spin/row_topk.h"

#include <cuda_runtime.h>

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "require_gpu.h"

namespace spin {
namespace {

struct Rows {
  int64_t width = 0;
  std::vector<float> x;
  std::vector<int32_t> lens;
};

Rows MakeRows(int rows, int64_t width, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  Rows r;
  r.width = width;
  r.x.resize(rows * width);
  for (float& v : r.x) v = normal(rng);
  for (int i = 0; i < rows; ++i) {
    float* row = r.x.data() + i * width;
    switch (i % 6) {
      case 1:  // ties everywhere: halves
        for (int64_t j = 0; j < width; ++j) row[j] = std::round(row[j] * 2) / 2;
        break;
      case 2:  // one value
        for (int64_t j = 0; j < width; ++j) row[j] = 0.25f;
        break;
      case 3:  // NaN and infinities
        for (int64_t j = 0; j < width; j += 7) row[j] = NAN;
        for (int64_t j = 3; j < width; j += 11) row[j] = INFINITY;
        for (int64_t j = 5; j < width; j += 13) row[j] = -INFINITY;
        break;
      case 4:  // negative zero and zero tie
        for (int64_t j = 0; j < width; ++j) row[j] = (j % 2) ? -0.0f : 0.0f;
        break;
      default:
        break;
    }
    const int64_t choice = rng() % 5;
    r.lens.push_back(choice == 0   ? static_cast<int32_t>(width)
                     : choice == 1 ? static_cast<int32_t>(rng() % (width + 1))
                     : choice == 2 ? static_cast<int32_t>(width + 100)  // clamped
                     : choice == 3 ? -3                                 // clamped to 0
                                   : static_cast<int32_t>(width - rng() % 64));
  }
  return r;
}

// Runs both and compares; returns the host result.
std::vector<int32_t> Compare(const Rows& r, int k) {
  const int rows = static_cast<int>(r.lens.size());
  RowTopKArgs h;
  h.logits = r.x.data();
  h.logits_stride = r.width;
  h.width = r.width;
  h.lens = r.lens.data();
  h.rows = rows;
  h.k = k;
  std::vector<int32_t> want(static_cast<size_t>(rows) * k, 7), got(want.size(), 7);
  h.out = want.data();
  h.out_stride = k;
  EXPECT_TRUE(RowTopKHost(h).ok());
  float* dx = nullptr;
  int32_t *dl = nullptr, *dout = nullptr;
  EXPECT_EQ(cudaMalloc(&dx, r.x.size() * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dl, r.lens.size() * sizeof(int32_t)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&dout, got.size() * sizeof(int32_t)), cudaSuccess);
  cudaMemcpy(dx, r.x.data(), r.x.size() * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(dl, r.lens.data(), r.lens.size() * sizeof(int32_t), cudaMemcpyHostToDevice);
  RowTopKArgs d = h;
  d.logits = dx;
  d.lens = dl;
  d.out = dout;
  EXPECT_TRUE(LaunchRowTopK(d, nullptr).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaMemcpy(got.data(), dout, got.size() * sizeof(int32_t), cudaMemcpyDeviceToHost);
  cudaFree(dx);
  cudaFree(dl);
  cudaFree(dout);
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < k; ++j) {
      const size_t at = static_cast<size_t>(i) * k + j;
      if (got[at] != want[at]) {
        ADD_FAILURE() << "row " << i << " (len " << r.lens[i] << ", kind " << i % 6 << ") k " << k
                      << ": position " << j << " is " << got[at] << ", the reference has "
                      << want[at];
        return want;
      }
    }
  }
  return want;
}

TEST(RowTopK, EqualsTheHostReference) {
  SPIN_REQUIRE_GPU_OR_SKIP();
  const Rows small = MakeRows(36, 5000, 1);
  for (int k : {1, 2, 63, 256, 2048, 4999, 5000, 8192}) Compare(small, k);
}

TEST(RowTopK, TheEngineShape) {
  SPIN_REQUIRE_GPU_OR_SKIP();
  const Rows big = MakeRows(64, 131072, 2);
  const std::vector<int32_t> out = Compare(big, 2048);
  // A full-length random row gives exactly k indices, ascending.
  for (int i = 0; i < 64; ++i) {
    if (i % 6 != 0 || big.lens[i] < 2048) continue;
    for (int j = 1; j < 2048; ++j) ASSERT_LT(out[i * 2048 + j - 1], out[i * 2048 + j]);
  }
}

TEST(RowTopK, RejectsBadSizes) {
  RowTopKArgs a;
  a.rows = 1;
  a.k = 0;
  EXPECT_FALSE(ValidateRowTopK(a).ok());
  a.k = 4;
  a.width = 10;
  a.logits_stride = 8;
  EXPECT_FALSE(ValidateRowTopK(a).ok());
}

}  // namespace
}  // namespace spin
