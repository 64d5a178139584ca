// The reference paged indexer against a float64 CPU computation, and SPIN end to end on the
// GPU: the indexer over SPIN's compacted table gives, for every selected slot, exactly the
// dense logit, and its top-K equals the dense top-K restricted to the selected blocks.
#include "spin/paged_indexer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "spin/cuda_data_plane.h"

namespace spin::testing {
namespace {

class IndexerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

template <typename T>
T* Upload(const std::vector<T>& v) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(v.size() * sizeof(T), 16)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return static_cast<T*>(p);
}

template <typename T>
std::vector<T> Download(const T* p, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

uint8_t RandomFp8(std::mt19937& rng) {
  const uint32_t x = rng();
  const uint32_t exp = 3 + x % 7, man = (x >> 8) & 7, sign = (x >> 12) & 1;
  return static_cast<uint8_t>((sign << 7) | (exp << 3) | man);
}

// A KV cache of `pages` random pages, q and weights for `rows` query rows.
struct Problem {
  std::vector<uint8_t> kv, q;
  std::vector<float> w;
  Problem(int pages, int rows, uint32_t seed) {
    std::mt19937 rng(seed);
    kv.resize(static_cast<size_t>(pages) * kPageBytes);
    for (int p = 0; p < pages; ++p) {
      uint8_t* page = kv.data() + static_cast<size_t>(p) * kPageBytes;
      for (int i = 0; i < kPageSlots * kIndexerDim; ++i) page[i] = RandomFp8(rng);
      float* scale = reinterpret_cast<float*>(page + kPageSlots * kIndexerDim);
      for (int s = 0; s < kPageSlots; ++s) scale[s] = 0.5f + (rng() % 1000) / 1000.0f;
    }
    q.resize(static_cast<size_t>(rows) * kIndexerHeads * kIndexerDim);
    for (uint8_t& x : q) x = RandomFp8(rng);
    w.resize(static_cast<size_t>(rows) * kIndexerHeads);
    for (float& x : w) x = ((rng() % 2000) / 1000.0f - 1.0f) / 8.0f;
  }
  // float64 logit of query row `row` against the key at `page`, slot `s`.
  double Logit(int row, int page, int s, double* magnitude) const {
    const uint8_t* pg = kv.data() + static_cast<size_t>(page) * kPageBytes;
    const float scale = reinterpret_cast<const float*>(pg + kPageSlots * kIndexerDim)[s];
    double sum = 0, mag = 0;
    for (int h = 0; h < kIndexerHeads; ++h) {
      double dot = 0;
      for (int d = 0; d < kIndexerDim; ++d) {
        dot += static_cast<double>(Fp8E4m3ToFloat(
                   q[(static_cast<size_t>(row) * kIndexerHeads + h) * kIndexerDim + d])) *
               Fp8E4m3ToFloat(pg[s * kIndexerDim + d]);
      }
      const double wv = w[static_cast<size_t>(row) * kIndexerHeads + h];
      sum += wv * std::max(dot, 0.0);
      mag += std::fabs(wv) * std::fabs(dot);
    }
    *magnitude = mag * scale;
    return sum * scale;
  }
};

TEST_F(IndexerTest, MatchesFloat64Reference) {
  const int batch = 3, next_n = 2, pages_per_seq = 6, pages = batch * pages_per_seq + 4;
  Problem pr(pages, batch * next_n, 1);
  // A shuffled page table and per-row lengths with partial last pages.
  std::vector<int32_t> table(batch * pages_per_seq);
  std::iota(table.begin(), table.end(), 2);
  std::shuffle(table.begin(), table.end(), std::mt19937(2));
  const std::vector<int32_t> lens = {320, 321, 100, 101, 64 * 6 - 1, 64 * 6};
  const int64_t stride = pages_per_seq * kPageSlots + 7;
  std::vector<float> init(batch * next_n * stride, -12345.0f);
  PagedIndexerArgs a;
  a.q = Upload(pr.q);
  a.weights = Upload(pr.w);
  a.kv = Upload(pr.kv);
  a.table = Upload(table);
  a.table_stride = pages_per_seq;
  a.lens = Upload(lens);
  a.lens_stride = next_n;
  float* d_out = Upload(init);
  a.logits = d_out;
  a.logits_stride = stride;
  a.batch = batch;
  a.next_n = next_n;
  a.max_pages = pages_per_seq;
  ASSERT_TRUE(LaunchPagedIndexer(a, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> out = Download(d_out, init.size());
  for (int row = 0; row < batch * next_n; ++row) {
    const int seq = row / next_n;
    for (int s = 0; s < stride; ++s) {
      const float got = out[row * stride + s];
      if (s >= lens[row]) {
        ASSERT_EQ(got, -12345.0f) << "row " << row << " slot " << s << " written past its length";
        continue;
      }
      double mag = 0;
      const double want = pr.Logit(row, table[seq * pages_per_seq + s / 64], s % 64, &mag);
      ASSERT_NEAR(got, want, 1e-5 * mag + 1e-6) << "row " << row << " slot " << s;
    }
  }
  for (const void* p : {static_cast<const void*>(a.q), static_cast<const void*>(a.weights),
                        static_cast<const void*>(a.kv), static_cast<const void*>(a.table),
                        static_cast<const void*>(a.lens), static_cast<const void*>(d_out)}) {
    cudaFree(const_cast<void*>(p));
  }
}

// SPIN selects blocks on a device arena; the indexer then runs dense (engine table) and sparse
// (SPIN's compacted table and lengths) over the same KV cache.
TEST_F(IndexerTest, SparseStageEqualsDenseRestrictedToSelectedBlocks) {
  const int batch = 4, pages_per_seq = 24, K = 256;
  Geometry g;
  g.layers = 1;
  g.max_seqs = batch;
  g.max_slots = pages_per_seq * kPageSlots;
  g.block_size = kPageSlots;
  g.topk = K;
  g.max_rows = 1;
  Policy p;
  p.target_sparsity = 0.5;
  p.exploration = 0.1;
  const uint64_t bytes = ArenaBytes(g);
  void* arena = nullptr;
  ASSERT_EQ(cudaMalloc(&arena, bytes), cudaSuccess);
  auto view = InitDeviceArena(arena, bytes, g, 3, p);
  ASSERT_TRUE(view.ok()) << view.status();
  auto dp = MakeCudaDataPlane(*view);
  ASSERT_TRUE(dp.ok()) << dp.status();
  const int pages = batch * pages_per_seq;
  Problem pr(pages, batch, 4);
  std::vector<int32_t> table(pages);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(5));
  const std::vector<int32_t> seqs = {0, 1, 2, 3}, ctx = {1500, 700, 1536, 1000};
  std::vector<int32_t> qpos(batch);
  for (int e = 0; e < batch; ++e) qpos[e] = ctx[e] - 1;
  const int64_t stride = static_cast<int64_t>(pages_per_seq) * kPageSlots;
  int32_t *d_seq = Upload(seqs), *d_ctx = Upload(ctx), *d_q = Upload(qpos);
  int32_t* d_table = Upload(table);
  float* d_dense = Upload(std::vector<float>(batch * stride, 0.0f));
  float* d_sparse = Upload(std::vector<float>(batch * stride, 0.0f));
  PagedIndexerArgs a;
  a.q = Upload(pr.q);
  a.weights = Upload(pr.w);
  a.kv = Upload(pr.kv);
  a.batch = batch;
  a.next_n = 1;
  a.max_pages = pages_per_seq;
  a.logits_stride = stride;
  for (int e = 0; e < batch; ++e) ASSERT_TRUE((*dp)->ResetSequence(e, 10 + e).ok());
  // Step 0 is dense (fresh); steps 1.. select. The same q each step: the indexer's scores are
  // perfectly predictable, so what this checks is the plumbing, not the prediction.
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE((*dp)->BeginStep(StepBatch{d_seq, d_ctx, d_q, batch, 1}).ok());
    ASSERT_TRUE((*dp)->Select(0, d_table, pages_per_seq).ok());
    // Dense: the engine's table and lengths.
    a.table = d_table;
    a.table_stride = pages_per_seq;
    a.lens = d_ctx;
    a.lens_stride = 1;
    a.logits = d_dense;
    ASSERT_TRUE(LaunchPagedIndexer(a, nullptr).ok());
    // Sparse: SPIN's compacted table and lengths.
    a.table = view->phys;
    a.table_stride = view->max_blocks;
    a.lens = view->compact_len;
    a.lens_stride = g.max_rows;
    a.logits = d_sparse;
    ASSERT_TRUE(LaunchPagedIndexer(a, nullptr).ok());
    ASSERT_TRUE((*dp)->Observe(0, d_sparse, stride).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto dense = Download(d_dense, batch * stride);
    const auto sparse = Download(d_sparse, batch * stride);
    const auto count = Download(view->union_count, batch);
    const auto ids = Download(view->union_ids, static_cast<size_t>(batch) * view->max_blocks);
    const auto clen = Download(view->compact_len, batch);
    for (int e = 0; e < batch; ++e) {
      const int nb = (ctx[e] + 63) / 64;
      if (step == 0) {
        ASSERT_EQ(count[e], nb);
      } else {
        ASSERT_LT(count[e], nb) << "step " << step << " entry " << e << " kept everything";
      }
      // Every compacted slot's logit is bitwise the dense logit of its logical slot.
      std::vector<int> logical;
      for (int c = 0; c < clen[e]; ++c) {
        const int i = ids[e * view->max_blocks + c / 64] * 64 + c % 64;
        logical.push_back(i);
        ASSERT_EQ(sparse[e * stride + c], dense[e * stride + i]) << "entry " << e << " c " << c;
      }
      // Top-K of the sparse logits (remapped) = dense top-K over the selected blocks only.
      auto topk = [&](std::vector<std::pair<float, int>> v) {
        std::sort(v.begin(), v.end(), [](auto x, auto y) {
          return x.first != y.first ? x.first > y.first : x.second < y.second;
        });
        v.resize(std::min<size_t>(v.size(), K));
        std::vector<int> out;
        for (auto& x : v) out.push_back(x.second);
        std::sort(out.begin(), out.end());
        return out;
      };
      std::vector<std::pair<float, int>> sv, dv;
      for (int c = 0; c < clen[e]; ++c) sv.push_back({sparse[e * stride + c], logical[c]});
      for (int i : logical) dv.push_back({dense[e * stride + i], i});
      ASSERT_EQ(topk(sv), topk(dv)) << "entry " << e << " step " << step;
    }
  }
  auto err = ReadDeviceError(*view);
  ASSERT_TRUE(err.ok());
  EXPECT_EQ(*err, 0u);
  cudaFree(arena);
}

}  // namespace
}  // namespace spin::testing
