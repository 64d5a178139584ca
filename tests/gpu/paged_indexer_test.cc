// The reference paged indexer against a float64 CPU computation, and SPIN end to end on the
// GPU: the indexer over SPIN's compacted table gives, for every selected slot, exactly the
// dense logit, and its top-K equals the dense top-K restricted to the selected blocks.
#include "spin/paged_indexer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "require_gpu.h"
#include "spin/cuda_data_plane.h"
#include "spin/data_plane_setup.h"

namespace spin::testing {
namespace {

bool HopperDevice() {
  cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0;
}

// Every test runs for both kernels; the wgmma one needs compute capability 9.0 (sm_90a). Without
// a device, or with another one for wgmma, the tests skip; under SPIN_REQUIRE_GPU=1 (a GPU run,
// scripts/gpu-check on an H200) they fail instead (require_gpu.h).
class IndexerTest : public ::testing::TestWithParam<IndexerKernel> {
 protected:
  void SetUp() override {
    SPIN_REQUIRE_GPU_OR_SKIP();
    SPIN_REQUIRE_OR_SKIP(GetParam() != IndexerKernel::kWgmma || HopperDevice(),
                         "wgmma needs an sm_90 device, this one is " << DeviceArch());
  }
};

// The variant-against-variant check needs both.
class IndexerVariantsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SPIN_REQUIRE_GPU_OR_SKIP();
    SPIN_REQUIRE_OR_SKIP(HopperDevice(),
                         "wgmma needs an sm_90 device, this one is " << DeviceArch());
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

// Bounds on a logit's magnitude for the tolerances: `mag` = sum_h |w_h| |q_h . k| scale,
// `abs_mag` = sum_h |w_h| sum_d |q_hd k_d| scale (what limits the tensor cores' accumulation).
struct Reference {
  double logit = 0, mag = 0, abs_mag = 0;
};

// Allowed error against float64. mma.sync converts fp8 to f16 exactly and accumulates in fp32.
// wgmma's fp8 path accumulates with fewer mantissa bits than fp32 (DeepSeek-V3 reports about
// 14 on Hopper), so its bound is relative to the sum of |products|: 2^-10 of it, which a wrong
// fragment or swizzle (errors of the order of the logit itself) still fails by far.
double Tolerance(IndexerKernel k, const Reference& ref) {
  return k == IndexerKernel::kWgmma ? 1e-5 * ref.mag + 0x1p-10 * ref.abs_mag + 1e-6
                                    : 1e-5 * ref.mag + 1e-6;
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
  Reference Logit(int row, int page, int s) const {
    const uint8_t* pg = kv.data() + static_cast<size_t>(page) * kPageBytes;
    const float scale = reinterpret_cast<const float*>(pg + kPageSlots * kIndexerDim)[s];
    double sum = 0, mag = 0, abs_mag = 0;
    for (int h = 0; h < kIndexerHeads; ++h) {
      double dot = 0, abs_dot = 0;
      for (int d = 0; d < kIndexerDim; ++d) {
        const double x = static_cast<double>(Fp8E4m3ToFloat(
                             q[(static_cast<size_t>(row) * kIndexerHeads + h) * kIndexerDim + d])) *
                         Fp8E4m3ToFloat(pg[s * kIndexerDim + d]);
        dot += x;
        abs_dot += std::fabs(x);
      }
      const double wv = w[static_cast<size_t>(row) * kIndexerHeads + h];
      sum += wv * std::max(dot, 0.0);
      mag += std::fabs(wv) * std::fabs(dot);
      abs_mag += std::fabs(wv) * abs_dot;
    }
    return {sum * scale, mag * scale, abs_mag * scale};
  }
};

// One dense problem on the device: rows of `pages_per_seq` table entries (a shuffled table)
// with the given per-row lengths; logits rows are padded past the table and pre-filled with a
// sentinel so writes past a row's length show.
class DenseRun {
 public:
  static constexpr float kSentinel = -12345.0f;
  DenseRun(int batch, int next_n, int pages_per_seq, std::vector<int32_t> lens, uint32_t seed)
      : batch_(batch),
        next_n_(next_n),
        pages_per_seq_(pages_per_seq),
        stride_(static_cast<int64_t>(pages_per_seq) * kPageSlots + 7),
        lens_(std::move(lens)),
        pr_(batch * pages_per_seq + 4, batch * next_n, seed),
        table_(static_cast<size_t>(batch) * pages_per_seq) {
    std::iota(table_.begin(), table_.end(), 2);
    std::shuffle(table_.begin(), table_.end(), std::mt19937(seed + 1));
    a_.q = d_q_ = Upload(pr_.q);
    a_.weights = d_w_ = Upload(pr_.w);
    a_.kv = d_kv_ = Upload(pr_.kv);
    a_.table = d_table_ = Upload(table_);
    a_.table_stride = pages_per_seq;
    a_.lens = d_lens_ = Upload(lens_);
    a_.lens_stride = next_n;
    a_.logits_stride = stride_;
    a_.batch = batch;
    a_.next_n = next_n;
    a_.max_pages = pages_per_seq;
    d_out_ = Upload(std::vector<float>(Size(), kSentinel));
    a_.logits = d_out_;
  }
  ~DenseRun() {
    for (void* p :
         {static_cast<void*>(d_q_), static_cast<void*>(d_w_), static_cast<void*>(d_kv_),
          static_cast<void*>(d_table_), static_cast<void*>(d_lens_), static_cast<void*>(d_out_)}) {
      cudaFree(p);
    }
  }
  size_t Size() const { return static_cast<size_t>(batch_) * next_n_ * stride_; }
  // Runs `kernel` (with `stages`, `chunk_pages` and `spread`) on fresh sentinel-filled logits.
  std::vector<float> Run(IndexerKernel kernel, int stages, int chunk_pages, bool spread = false,
                         bool programmatic = false) {
    EXPECT_EQ(cudaMemcpy(d_out_, std::vector<float>(Size(), kSentinel).data(),
                         Size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    PagedIndexerArgs a = a_;
    a.kernel = kernel;
    a.stages = stages;
    a.chunk_pages = chunk_pages;
    a.spread = spread;
    a.programmatic = programmatic;
    const absl::Status s = LaunchPagedIndexer(a, nullptr);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return Download(d_out_, Size());
  }
  // Checks `out` against float64: within the tolerance below each row's length, untouched past
  // it. Returns the worst error as a fraction of the tolerance.
  double Check(IndexerKernel kernel, const std::vector<float>& out) const {
    double worst = 0, worst_mag = 0, worst_abs = 0;
    const int rows = batch_ * next_n_;
    for (int row = 0; row < rows; ++row) {
      const int seq = row / next_n_;
      for (int64_t s = 0; s < stride_; ++s) {
        const float got = out[row * stride_ + s];
        if (s >= lens_[row]) {
          EXPECT_EQ(got, kSentinel) << "row " << row << " slot " << s << " past its length";
          if (got != kSentinel) return 1e30;
          continue;
        }
        const Reference ref =
            pr_.Logit(row, table_[seq * pages_per_seq_ + s / kPageSlots], s % kPageSlots);
        const double err = std::fabs(got - ref.logit), tol = Tolerance(kernel, ref);
        EXPECT_LE(err, tol) << "row " << row << " slot " << s << " got " << got << " want "
                            << ref.logit;
        if (err > tol) return err / tol;
        worst = std::max(worst, err / tol);
        worst_mag = std::max(worst_mag, err / (ref.mag + 1e-30));
        worst_abs = std::max(worst_abs, err / (ref.abs_mag + 1e-30));
      }
    }
    std::printf(
        "%s: worst error %.3g of the tolerance; %.3g of sum|w||q.k|s, %.3g of "
        "sum|w|sum|qk|s\n",
        IndexerKernelName(kernel), worst, worst_mag, worst_abs);
    return worst;
  }
  const std::vector<int32_t>& lens() const { return lens_; }
  int64_t stride() const { return stride_; }
  const Problem& problem() const { return pr_; }
  const std::vector<int32_t>& table() const { return table_; }

 private:
  int batch_, next_n_, pages_per_seq_;
  int64_t stride_;
  std::vector<int32_t> lens_;
  Problem pr_;
  std::vector<int32_t> table_;
  PagedIndexerArgs a_;
  uint8_t *d_q_ = nullptr, *d_kv_ = nullptr;
  float *d_w_ = nullptr, *d_out_ = nullptr;
  int32_t *d_table_ = nullptr, *d_lens_ = nullptr;
};

// Partial last pages, lengths not a multiple of 64, empty rows, a single slot, next_n = 2.
TEST_P(IndexerTest, MatchesFloat64Reference) {
  DenseRun run(4, 2, 6, {320, 321, 100, 101, 64 * 6 - 1, 64 * 6, 0, 1}, 1);
  for (int chunk : {0, 1, 4}) {
    for (bool spread : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "chunk " << chunk << (spread ? ", spread" : ""));
      run.Check(GetParam(), run.Run(GetParam(), 8, chunk, spread));
    }
  }
}

// Rows far longer than a CTA's chunk and than the ring (every stage reused many times), with
// each ring depth: every result equals float64 within the tolerance and the results of every
// depth and chunking, rows spread over their CTAs or not (the second row is about half of
// max_pages), are bitwise equal (a slot's logit never depends on where it was computed). Chunks
// of 13 pages run as programmatic launches.
TEST_P(IndexerTest, LongRowsEveryRingDepthAndChunk) {
  DenseRun run(2, 1, 150, {150 * 64 - 5, 77 * 64 + 13}, 7);
  const bool wg = GetParam() == IndexerKernel::kWgmma;
  const std::vector<int> depths = wg ? std::vector<int>{4, 5, 6, 7} : std::vector<int>{4, 8, 12};
  const std::vector<float> first = run.Run(GetParam(), depths[0], 64);
  run.Check(GetParam(), first);
  for (int stages : depths) {
    for (int chunk : {0, 13, 64}) {
      for (bool spread : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "stages " << stages << " chunk " << chunk << (spread ? ", spread" : ""));
        const std::vector<float> out = run.Run(GetParam(), stages, chunk, spread, chunk == 13);
        for (size_t i = 0; i < out.size(); ++i) {
          ASSERT_EQ(out[i], first[i]) << "index " << i;
        }
      }
    }
  }
}

// The two kernels agree within the wgmma tolerance on the same problem.
TEST_F(IndexerVariantsTest, WgmmaAgreesWithMmaSync) {
  DenseRun run(3, 2, 20, {1280, 1279, 700, 64, 1000, 65}, 11);
  const std::vector<float> mma = run.Run(IndexerKernel::kMmaSync, 8, 0);
  const std::vector<float> wg = run.Run(IndexerKernel::kWgmma, 7, 0);
  const Problem& pr = run.problem();
  double worst = 0;
  for (int row = 0; row < 6; ++row) {
    for (int64_t s = 0; s < run.stride(); ++s) {
      const size_t i = row * run.stride() + s;
      if (s >= run.lens()[row]) {
        ASSERT_EQ(mma[i], DenseRun::kSentinel);
        ASSERT_EQ(wg[i], DenseRun::kSentinel);
        continue;
      }
      const Reference ref =
          pr.Logit(row, run.table()[(row / 2) * 20 + s / kPageSlots], s % kPageSlots);
      const double tol =
          Tolerance(IndexerKernel::kWgmma, ref) + Tolerance(IndexerKernel::kMmaSync, ref);
      ASSERT_LE(std::fabs(mma[i] - wg[i]), tol) << "row " << row << " slot " << s;
      worst = std::max(worst, std::fabs(mma[i] - wg[i]) / tol);
    }
  }
  std::printf("wgmma vs mma.sync: worst difference %.3g of the tolerance\n", worst);
}

// SPIN selects blocks on a device arena; the indexer then runs dense (engine table) and sparse
// (SPIN's compacted table and lengths) over the same KV cache.
TEST_P(IndexerTest, SparseStageEqualsDenseRestrictedToSelectedBlocks) {
  const int batch = 4, pages_per_seq = 24, K = 256;
  Geometry g;
  g.layers = 1;
  g.max_seqs = batch;
  g.max_slots = pages_per_seq * kPageSlots;
  g.block_size = kPageSlots;
  g.topk = K;
  g.max_rows = 1;
  DataPlaneSpec spec;
  spec.geometry = g;
  spec.seed = 3;
  spec.policy.target_sparsity = 0.5;
  spec.policy.exploration = 0.1;
  spec.on_device = true;
  auto dp = NewDataPlane(spec);
  ASSERT_TRUE(dp.ok()) << dp.status();
  const ArenaView* view = &(*dp)->arena();
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
  a.kernel = GetParam();
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
    std::vector<int32_t> idx(static_cast<size_t>(batch) * K, -1);  // engine top-K, compacted
    std::vector<std::vector<int>> want_topk(batch);
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
      // The engine's top-K is taken over the compacted logits (compacted indices; ties to the
      // lower one, which is also the lower logical slot) and mapped back by the data plane's
      // Remap below; it must be the dense top-K over the selected slots, computed here from the
      // dense logits alone.
      std::vector<std::pair<float, int>> sv, dv;
      for (int c = 0; c < clen[e]; ++c) sv.push_back({sparse[e * stride + c], c});
      for (int i : logical) dv.push_back({dense[e * stride + i], i});
      const std::vector<int> compact_top = topk(sv);
      ASSERT_GT(compact_top.size(), 0u) << "entry " << e << " step " << step;
      for (size_t k = 0; k < compact_top.size(); ++k) idx[e * K + k] = compact_top[k];
      want_topk[e] = topk(dv);
    }
    int32_t* d_idx = Upload(idx);
    ASSERT_TRUE((*dp)->Remap(d_idx, K).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int32_t> remapped = Download(d_idx, idx.size());
    cudaFree(d_idx);
    for (int e = 0; e < batch; ++e) {
      std::vector<int> got;
      for (int k = 0; k < K; ++k) {
        if (remapped[e * K + k] >= 0) got.push_back(remapped[e * K + k]);
      }
      std::sort(got.begin(), got.end());
      ASSERT_EQ(got, want_topk[e]) << "remapped top-K, entry " << e << " step " << step;
    }
  }
  auto err = ReadDeviceError(*view);
  ASSERT_TRUE(err.ok());
  EXPECT_EQ(*err, 0u);
}

INSTANTIATE_TEST_SUITE_P(Kernels, IndexerTest,
                         ::testing::Values(IndexerKernel::kMmaSync, IndexerKernel::kWgmma),
                         [](const ::testing::TestParamInfo<IndexerKernel>& info) {
                           return std::string(info.param == IndexerKernel::kWgmma ? "Wgmma"
                                                                                  : "MmaSync");
                         });

}  // namespace
}  // namespace spin::testing
