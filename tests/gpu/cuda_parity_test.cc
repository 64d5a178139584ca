// The CUDA backend against the CPU reference on the same inputs: every selection, every
// compacted table and length, every remapped index, and at the end every byte of state,
// statistics and miss curves must be identical (fp32 and bf16). Skips without a device (fails
// instead under SPIN_REQUIRE_GPU=1, require_gpu.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine_sim.h"
#include "gtest/gtest.h"
#include "require_gpu.h"
#include "spin/budget.h"
#include "spin/cuda_data_plane.h"
#include "spin/data_plane_setup.h"
#include "spin/paged_indexer.h"
#include "test_arena.h"

namespace spin::testing {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x << ": " << cudaGetErrorString(x)

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override { SPIN_REQUIRE_GPU_OR_SKIP(); }
};

// A device buffer that frees itself.
struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes ? bytes : 16), cudaSuccess); }
  ~DevBuf() { cudaFree(p); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// What a CUDA data plane over a device arena of this geometry, seed and policy is made of.
DataPlaneSpec DeviceSpec(const Geometry& g, uint64_t seed, const Policy& p,
                         const CudaDataPlaneOptions& options = {}) {
  DataPlaneSpec spec;
  spec.geometry = g;
  spec.seed = seed;
  spec.policy = p;
  spec.on_device = true;
  spec.cuda = options;
  return spec;
}

// A one-layer geometry of two sequences of 512 slots, and a step of two entries on it: the
// host arrays copied to the device (kept alive with the object), as the CUDA BeginStep reads them.
Geometry TwoSequences() {
  Geometry g;
  g.layers = 1;
  g.max_seqs = 2;
  g.max_slots = 512;
  g.topk = 64;
  return g;
}
struct DevStep {
  DevBuf s{8}, c{8}, q{8};
  DevStep(const int32_t (&seq)[2], const int32_t (&ctx)[2], const int32_t (&qp)[2]) {
    EXPECT_EQ(cudaMemcpy(s.p, seq, 8, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(c.p, ctx, 8, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(q.p, qp, 8, cudaMemcpyHostToDevice), cudaSuccess);
  }
  StepBatch batch() const {
    return StepBatch{s.as<int32_t>(), c.as<int32_t>(), q.as<int32_t>(), 2, 1};
  }
};

template <typename T>
std::vector<T> ToHost(const T* dev, size_t n) {
  std::vector<T> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// Deterministic structured scores: persistent per-slot weight, a recency band, per-step noise,
// and a sprinkle of NaN/inf.
float Score(int seq, int layer, int step, int row, int slot, int q) {
  uint32_t h = static_cast<uint32_t>(seq * 7919 + layer * 104729 + slot * 2654435761u);
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  uint32_t n = h ^ static_cast<uint32_t>(step * 0x9E3779B9u + row * 0x85EBCA6Bu);
  n *= 0xC2B2AE35u;
  n ^= n >> 16;
  if ((n & 0x3FF) == 7) return NAN;
  if ((n & 0x3FF) == 8) return INFINITY;
  const float base = static_cast<float>(h % 1000) / 250.0f + ((h >> 10) % 50 == 0 ? 6.0f : 0.0f);
  const float band = (q - slot >= 0 && q - slot < 40) ? 3.0f : 0.0f;
  return base + band + static_cast<float>(n % 997) / 997.0f;
}

// The engine's indexer inputs for the fused mode: random fp8 q and keys (magnitudes about 2^-3 ..
// 2^3, never NaN), head weights in [-1, 1], per-slot scales in [0.5, 1.5] with a sprinkle of NaN
// and inf (non-finite logits), in S * MB pages, and a block table that permutes them.
struct FusedInputs {
  std::unique_ptr<DevBuf> kv, q, w;
  std::vector<int32_t> table;
  FusedInputs(size_t S, size_t R, size_t MB) {
    const size_t pages = S * MB;
    std::mt19937 rng(17);
    auto fp8 = [&] { return static_cast<uint8_t>((rng() % 0x30 + 0x28) | ((rng() & 1) << 7)); };
    std::vector<uint8_t> hkv(pages * kPageBytes);
    for (size_t pg = 0; pg < pages; ++pg) {
      uint8_t* page = hkv.data() + pg * kPageBytes;
      for (int x = 0; x < kPageSlots * kIndexerDim; ++x) page[x] = fp8();
      for (int x = 0; x < kPageSlots; ++x) {
        const uint32_t u = static_cast<uint32_t>(rng());
        float scale = 0.5f + static_cast<float>(u % 1000) / 1000.0f;
        if (u % 251 == 0) scale = NAN;
        if (u % 257 == 0) scale = INFINITY;
        std::memcpy(page + kPageSlots * kIndexerDim + 4 * x, &scale, 4);
      }
    }
    std::vector<uint8_t> hq(S * R * kIndexerHeads * kIndexerDim);
    for (uint8_t& b : hq) b = fp8();
    std::vector<float> hw(S * R * kIndexerHeads);
    for (float& x : hw) x = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
    kv = std::make_unique<DevBuf>(hkv.size());
    q = std::make_unique<DevBuf>(hq.size());
    w = std::make_unique<DevBuf>(hw.size() * 4);
    EXPECT_EQ(cudaMemcpy(kv->p, hkv.data(), hkv.size(), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(q->p, hq.data(), hq.size(), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(w->p, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    // A permutation of the pages (37 is coprime with the page counts of these tests).
    table.resize(S * MB);
    for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>((i * 37) % pages);
  }
  FusedIndexerArgs Args(float* logits) const {
    FusedIndexerArgs f;
    f.q = q->as<uint8_t>();
    f.weights = w->as<float>();
    f.kv = kv->as<uint8_t>();
    f.logits = logits;
    return f;
  }
};

bool Sm90() {
  cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0;
}

// Runs the same random multi-sequence decode through both backends and compares everything.
class Twin {
 public:
  // stride_pad > 0 makes the logits rows stride_pad floats longer than the compacted maximum
  // (an odd pad leaves rows unaligned for 16-byte loads, so the word-access EMA runs).
  Twin(const Geometry& g, const Policy& p, uint64_t seed, int stride_pad = 0,
       CudaDataPlaneOptions options = {})
      : cpu_(g, p, seed), g_(g) {
    bytes_ = ArenaBytes(g);
    dev_ = std::make_unique<DevBuf>(bytes_);
    auto dp = MakeDataPlane(dev_->p, bytes_, DeviceSpec(g, seed, p, options));
    EXPECT_TRUE(dp.ok()) << dp.status();
    gpu_ = std::move(*dp);
    dview_ = gpu_->arena();
    const size_t S = g.max_seqs, R = g.max_rows, MB = cpu_.view().max_blocks;
    stride_ = static_cast<int64_t>(MB) * g.block_size + stride_pad;
    d_seq_ = std::make_unique<DevBuf>(S * 4);
    d_ctx_ = std::make_unique<DevBuf>(S * 4);
    d_q_ = std::make_unique<DevBuf>(S * 4);
    d_acc_ = std::make_unique<DevBuf>(S * 4);
    d_table_ = std::make_unique<DevBuf>(S * MB * 4);
    d_logits_ = std::make_unique<DevBuf>(S * R * stride_ * 4);
    // A deferred EMA reads a layer's logits until a later call: each layer its own buffer, as
    // the option asks of an engine.
    if (options.defer_ema) {
      for (uint32_t l = 0; l < g.layers; ++l) {
        layer_logits_.push_back(std::make_unique<DevBuf>(S * R * stride_ * 4));
      }
    }
    d_idx_ = std::make_unique<DevBuf>(S * R * kTopK * 4);
    table_.resize(S * MB);
    for (size_t i = 0; i < table_.size(); ++i) table_[i] = static_cast<int32_t>((i * 37) % 100003);
    EXPECT_EQ(cudaMemcpy(d_table_->p, table_.data(), table_.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
  }

  void Reset(int seq, uint64_t key) {
    ASSERT_TRUE(cpu_.dp().ResetSequence(seq, key).ok());
    ASSERT_TRUE(gpu_->ResetSequence(seq, key).ok());
  }

  // One decode step for the given entries (seq -1 = padding).
  void Step(const std::vector<int32_t>& seq, const std::vector<int32_t>& ctx,
            const std::vector<int32_t>& q, int rows, const std::vector<int32_t>& acc, int step) {
    const int n = static_cast<int>(seq.size());
    CUDA_OK(cudaMemcpy(d_seq_->p, seq.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_ctx_->p, ctx.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_q_->p, q.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_acc_->p, acc.data(), n * 4, cudaMemcpyHostToDevice));
    const ArenaView& c = cpu_.view();
    const int MB = static_cast<int>(c.max_blocks), R = static_cast<int>(g_.max_rows);
    StepBatch cb{seq.data(), ctx.data(), q.data(), n, rows};
    StepBatch gb{d_seq_->as<int32_t>(), d_ctx_->as<int32_t>(), d_q_->as<int32_t>(), n, rows};
    if (step_table_) {  // the engine's table for every layer, given as the step begins
      cb.block_table = table_.data(), cb.table_stride = MB;
      gb.block_table = d_table_->as<int32_t>(), gb.table_stride = MB;
    }
    ASSERT_TRUE(cpu_.dp().BeginStep(cb).ok());
    ASSERT_TRUE(gpu_->BeginStep(gb).ok());
    const int b = static_cast<int>(g_.block_size);
    for (int l = 0; l < static_cast<int>(g_.layers); ++l) {
      std::vector<uint8_t> fresh(n, 1);  // before Select: a fresh pair writes no block scores
      for (int e = 0; e < n; ++e) {
        if (seq[e] >= 0) fresh[e] = c.fresh[static_cast<size_t>(seq[e]) * g_.layers + l];
      }
      // With the step's table: Select without one (both use the step's), except layer 1 every
      // fifth step, given the same table at another address on the GPU (Select publishes).
      const bool own_table = !step_table_ || (l == 1 && step % 5 == 1);
      if (own_table) {
        ASSERT_TRUE(cpu_.dp().Select(l, table_.data(), MB).ok());
      } else {
        ASSERT_TRUE(cpu_.dp().Select(l).ok());
      }
      // The fused mode's logits (the GPU's own indexer writes them).
      std::vector<float> fused_logits;
      if (one_call_) {
        // Select and the fused indexer in one call: the outputs compared below are the ones
        // the fused kernel published.
        const absl::Status st =
            SelectIndexAndObserve(*gpu_, l, d_table_->as<int32_t>(), MB, FusedArgs(step));
        ASSERT_TRUE(st.ok()) << st;
        fused_logits = ToHost(d_logits_->as<float>(), static_cast<size_t>(n) * rows * stride_);
      } else if (!step_table_) {
        ASSERT_TRUE(gpu_->Select(l, d_table_->as<int32_t>(), MB).ok());
      } else if (own_table) {
        ASSERT_TRUE(gpu_->Select(l, d_table2_->as<int32_t>(), MB).ok());
      } else {
        ASSERT_TRUE(gpu_->Select(l).ok());
      }
      // Row 0's block scores (what the selection ranked) are equal, not just the selections.
      const auto scores_or = ReadDeviceBlockScores(*gpu_, l, n);
      ASSERT_TRUE(scores_or.ok()) << scores_or.status();
      const std::vector<float>& scores = *scores_or;
      for (int e = 0; e < n; ++e) {
        if (fresh[e]) continue;
        for (int j = 0; j < static_cast<int>(CeilDiv(ctx[e], b)); ++j) {
          ASSERT_EQ(scores[e * MB + j], c.scratch[e * MB + j])
              << "row-0 score, step " << step << " layer " << l << " entry " << e << " block " << j;
        }
      }
      const auto count = ToHost(dview_.union_count, n);
      const auto ids = ToHost(dview_.union_ids, static_cast<size_t>(n) * MB);
      const auto phys = ToHost(dview_.phys, static_cast<size_t>(n) * MB);
      const auto clen = ToHost(dview_.compact_len, static_cast<size_t>(n) * R);
      for (int e = 0; e < n; ++e) {
        ASSERT_EQ(count[e], c.union_count[e]) << "step " << step << " layer " << l << " e " << e;
        for (int k = 0; k < count[e]; ++k) {
          ASSERT_EQ(ids[e * MB + k], c.union_ids[e * MB + k])
              << "step " << step << " layer " << l << " entry " << e << " k " << k;
          ASSERT_EQ(phys[e * MB + k], c.phys[e * MB + k]);
        }
        for (int r = 0; r < rows; ++r) ASSERT_EQ(clen[e * R + r], c.compact_len[e * R + r]);
      }
      // Logits of the compacted layout, built from the (common) union.
      std::vector<float> logits(static_cast<size_t>(n) * rows * stride_, -INFINITY);
      for (int e = 0; e < n; ++e) {
        if (seq[e] < 0) continue;
        for (int r = 0; r < rows; ++r) {
          for (int k = 0; k < c.union_count[e]; ++k) {
            for (int o = 0; o < b; ++o) {
              const int i = c.union_ids[e * MB + k] * b + o;
              if (i >= ctx[e] + r) break;
              logits[(static_cast<size_t>(e) * rows + r) * stride_ + k * b + o] =
                  score_(seq[e], l, step, r, i, q[e] + r);
            }
          }
        }
      }
      CUDA_OK(cudaMemcpy(LogitsOf(l), logits.data(), logits.size() * 4, cudaMemcpyHostToDevice));
      // Remap of random compacted indices, some out of range.
      std::vector<int32_t> idx(static_cast<size_t>(n) * rows * kTopK);
      for (size_t x = 0; x < idx.size(); ++x) {
        idx[x] = static_cast<int32_t>(rng_() % (stride_ + 10)) - 5;
      }
      // With the step's table, layer 1 is not observed every fourth step (its Select's
      // statistics, which no Observe counts then, are counted when the next Select is made).
      if (step_table_ && l == 1 && step % 4 == 3) {
        ASSERT_NO_FATAL_FAILURE(RemapBoth(n, rows, step));
        continue;
      }
      if (remap_observe_ && !fused_) {
        // RemapAndObserve on both backends (the CPU's: its checks, RemapTopK, Observe).
        std::vector<int32_t> idx = RandomTopK(n, rows);
        ASSERT_TRUE(cpu_.dp()
                        .RemapAndObserve(l, idx.data(), kTopK, logits.data(), stride_,
                                         no_accepted_ ? nullptr : acc.data())
                        .ok());
        ASSERT_TRUE(gpu_->RemapAndObserve(l, d_idx_->as<int32_t>(), kTopK, LogitsOf(l), stride_,
                                          no_accepted_ ? nullptr : d_acc_->as<int32_t>())
                        .ok());
        ASSERT_EQ(ToHost(d_idx_->as<int32_t>(), idx.size()), idx) << "remap, step " << step;
        ASSERT_NO_FATAL_FAILURE(ResetThenRemap(seq, n, rows, step, l));
        if (after_observe_) after_observe_(step, l);
        continue;
      }
      // With the engine's top-K, every third step gives it after Observe (which then counted
      // the probe from the logits: RemapTopK only maps).
      const bool remap_after = given_topk_ && !fused_ && step % 3 == 2;
      if (!remap_after) {
        ASSERT_NO_FATAL_FAILURE(RemapBoth(n, rows, step));
      }
      if (fused_) {
        // The GPU's own indexer writes the logits and applies the EMA; the CPU observes them.
        if (one_call_) {
          logits = fused_logits;
        } else {
          const absl::Status st = IndexAndObserve(*gpu_, l, FusedArgs(step));
          ASSERT_TRUE(st.ok()) << st;
          logits = ToHost(d_logits_->as<float>(), logits.size());
        }
        ASSERT_TRUE(cpu_.dp().Observe(l, logits.data(), stride_, nullptr).ok());
        // Every fourth step, layer 0 once more in the same step: the call selects it again from
        // the state its first call left (the reference's Select after Observe).
        if (one_call_ && l == 0 && step % 4 == 1) OneCallAgain(l, n, rows, step);
        if (after_observe_) after_observe_(step, l);
        continue;
      }
      // The engine contract passes no accepted counts: row 0 only on both backends.
      ASSERT_TRUE(
          cpu_.dp().Observe(l, logits.data(), stride_, no_accepted_ ? nullptr : acc.data()).ok());
      ASSERT_TRUE(
          gpu_->Observe(l, LogitsOf(l), stride_, no_accepted_ ? nullptr : d_acc_->as<int32_t>())
              .ok());
      if (remap_after) {
        ASSERT_NO_FATAL_FAILURE(RemapBoth(n, rows, step));
      }
      ASSERT_NO_FATAL_FAILURE(ResetThenRemap(seq, n, rows, step, l));
      if (after_observe_) after_observe_(step, l);
    }
    CUDA_OK(cudaDeviceSynchronize());
  }

  // Remap (RemapTopK with GivenTopK: on probe steps the indices are the engine's top-K that the
  // curves count) of random compacted indices, some out of range, on both backends; the mapped
  // indices compared.
  void RemapBoth(int n, int rows, int step) {
    std::vector<int32_t> idx = RandomTopK(n, rows);
    if (given_topk_) {
      ASSERT_TRUE(cpu_.dp().RemapTopK(idx.data(), kTopK).ok());
      ASSERT_TRUE(gpu_->RemapTopK(d_idx_->as<int32_t>(), kTopK).ok());
    } else {
      ASSERT_TRUE(cpu_.dp().Remap(idx.data(), kTopK).ok());
      ASSERT_TRUE(gpu_->Remap(d_idx_->as<int32_t>(), kTopK).ok());
    }
    ASSERT_EQ(ToHost(d_idx_->as<int32_t>(), idx.size()), idx) << "remap, step " << step;
  }

  // With the step's table, every sixth step after layer 0's Observe (which published layer 1's
  // selection into the outputs): a reset of a slot outside the batch (layer 1's Select must then
  // publish again, while the outputs still hold its selection), then a Remap of layer 0's
  // indices, which must map through layer 0's selection.
  void ResetThenRemap(const std::vector<int32_t>& seq, int n, int rows, int step, int l) {
    if (!step_table_ || l != 0 || step % 6 != 5) return;
    for (int s = static_cast<int>(g_.max_seqs) - 1; s >= 0; --s) {
      if (std::find(seq.begin(), seq.end(), s) != seq.end()) continue;
      ASSERT_NO_FATAL_FAILURE(Reset(s, 7000 + step));
      ASSERT_NO_FATAL_FAILURE(RemapBoth(n, rows, step));
      return;
    }
  }

  // Random compacted indices (some out of range) for n x rows rows of kTopK, also copied to
  // the device buffer.
  std::vector<int32_t> RandomTopK(int n, int rows) {
    std::vector<int32_t> idx(static_cast<size_t>(n) * rows * kTopK);
    for (size_t x = 0; x < idx.size(); ++x) {
      idx[x] = static_cast<int32_t>(rng_() % (stride_ + 10)) - 5;
    }
    EXPECT_EQ(cudaMemcpy(d_idx_->p, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    return idx;
  }

  // The unfused layers from now on: RemapAndObserve in place of RemapTopK and Observe.
  void RemapAndObserveMode() { remap_observe_ = true; }

  // The engine gives its top-K from now on: RemapTopK instead of Remap, and the fused calls
  // leave the probe to it (FusedIndexerArgs::probe_at_remap).
  void GivenTopK() { given_topk_ = true; }

  // The fused mode from now on: the engine's indexer inputs (FusedInputs) in a pool of KV
  // pages that the block table points into; each layer then runs IndexAndObserve on the GPU, and
  // the CPU observes the logits the fused kernel wrote (row 0 only, the engine contract).
  // one_call: SelectIndexAndObserve in place of Select and IndexAndObserve.
  void Fused(bool one_call = false) {
    fused_ = true;
    one_call_ = one_call;
    no_accepted_ = true;
    in_ = std::make_unique<FusedInputs>(g_.max_seqs, g_.max_rows, cpu_.view().max_blocks);
    table_ = in_->table;
    EXPECT_EQ(cudaMemcpy(d_table_->p, table_.data(), table_.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
  }

  // The fused mode's arguments in step `step`: ring depths 4-7, several CTAs per row (chunks of
  // 3 pages) or the automatic chunk, each row's pages spread over its CTAs or not, a
  // programmatic launch or not.
  FusedIndexerArgs FusedArgs(int step) const {
    FusedIndexerArgs f = in_->Args(d_logits_->as<float>());
    f.logits_stride = stride_;
    f.stages = 4 + step % 4;
    f.chunk_pages = step % 3 == 2 ? 3 : 0;
    f.spread = step % 2 == 1;
    f.programmatic = step % 4 >= 2;
    f.probe_at_remap = given_topk_;
    return f;
  }

  // The engine's scores for (seq, layer, step, row, slot, q) in later Steps (default: Score).
  using ScoreFn = std::function<float(int, int, int, int, int, int)>;
  void SetScore(ScoreFn f) { score_ = std::move(f); }

  // Called after each layer's Observe in Step (step, layer): events in the middle of a step.
  void AfterObserve(std::function<void(int, int)> f) { after_observe_ = std::move(f); }
  // Observe without accepted counts (the engine's MTP contract).
  void NoAccepted() { no_accepted_ = true; }

  // The engine's block table given at BeginStep from now on (StepBatch::block_table), and the
  // Selects mostly without one: on the GPU each Observe publishes the next layer's selection
  // and that layer's Select launches nothing.
  void StepTable() {
    step_table_ = true;
    d_table2_ = std::make_unique<DevBuf>(table_.size() * 4);
    EXPECT_EQ(cudaMemcpy(d_table2_->p, table_.data(), table_.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
  }

  // Select(l) on both backends now, and their outputs compared.
  void SelectAndCompare(int l, int n, int rows, const std::string& what) {
    ASSERT_TRUE(cpu_.dp().Select(l, table_.data(), cpu_.view().max_blocks).ok());
    ASSERT_TRUE(gpu_->Select(l, d_table_->as<int32_t>(), cpu_.view().max_blocks).ok());
    const ArenaView& c = cpu_.view();
    const int MB = static_cast<int>(c.max_blocks), R = static_cast<int>(g_.max_rows);
    const auto count = ToHost(dview_.union_count, n);
    const auto ids = ToHost(dview_.union_ids, static_cast<size_t>(n) * MB);
    const auto phys = ToHost(dview_.phys, static_cast<size_t>(n) * MB);
    const auto clen = ToHost(dview_.compact_len, static_cast<size_t>(n) * R);
    for (int e = 0; e < n; ++e) {
      ASSERT_EQ(count[e], c.union_count[e]) << what << ", entry " << e;
      for (int k = 0; k < count[e]; ++k) {
        ASSERT_EQ(ids[e * MB + k], c.union_ids[e * MB + k]) << what << ", entry " << e;
        ASSERT_EQ(phys[e * MB + k], c.phys[e * MB + k]) << what << ", entry " << e;
      }
      for (int r = 0; r < rows; ++r) ASSERT_EQ(clen[e * R + r], c.compact_len[e * R + r]) << what;
    }
  }

  // SelectIndexAndObserve of layer l again in the current step on the GPU, Select and Observe of
  // its logits on the CPU; the published outputs compared.
  void OneCallAgain(int l, int n, int rows, int step) {
    const int MB = static_cast<int>(cpu_.view().max_blocks), R = static_cast<int>(g_.max_rows);
    ASSERT_TRUE(cpu_.dp().Select(l, table_.data(), MB).ok());
    const absl::Status st =
        SelectIndexAndObserve(*gpu_, l, d_table_->as<int32_t>(), MB, FusedArgs(step + 1));
    ASSERT_TRUE(st.ok()) << st;
    const ArenaView& c = cpu_.view();
    const auto count = ToHost(dview_.union_count, n);
    const auto ids = ToHost(dview_.union_ids, static_cast<size_t>(n) * MB);
    const auto phys = ToHost(dview_.phys, static_cast<size_t>(n) * MB);
    const auto clen = ToHost(dview_.compact_len, static_cast<size_t>(n) * R);
    for (int e = 0; e < n; ++e) {
      ASSERT_EQ(count[e], c.union_count[e]) << "again, step " << step << " entry " << e;
      for (int k = 0; k < count[e]; ++k) {
        ASSERT_EQ(ids[e * MB + k], c.union_ids[e * MB + k]) << "again, entry " << e;
        ASSERT_EQ(phys[e * MB + k], c.phys[e * MB + k]) << "again, entry " << e;
      }
      for (int r = 0; r < rows; ++r) ASSERT_EQ(clen[e * R + r], c.compact_len[e * R + r]);
    }
    const auto logits = ToHost(d_logits_->as<float>(), static_cast<size_t>(n) * rows * stride_);
    if (given_topk_) {
      ASSERT_NO_FATAL_FAILURE(RemapBoth(n, rows, step));
    }
    ASSERT_TRUE(cpu_.dp().Observe(l, logits.data(), stride_, nullptr).ok());
  }

  // Every byte except the scratch and mask sections (whose unused tails may differ) agrees.
  void ExpectSameArena(const std::string& what) {
    const auto dev = ToHost(static_cast<const uint8_t*>(dev_->p), bytes_);
    const ArenaHeader& h = *cpu_.view().header;
    const uint8_t* host = cpu_.base();
    auto same = [&](uint64_t lo, uint64_t hi, const char* name) {
      for (uint64_t i = lo; i < hi; ++i) {
        if (dev[i] != host[i]) {
          ADD_FAILURE() << what << ": arena differs at byte " << i << " in " << name;
          return;
        }
      }
    };
    same(0, h.off_state, "header/policy/budgets/stats/curves/seqs/fresh");
    same(h.off_state, h.off_vsum, "state");
    same(h.off_vsum, h.off_batch, "V block summaries");
    same(h.off_batch, h.off_scratch, "batch/outputs");
    same(h.off_error, h.total_bytes, "error");
  }

  const ArenaView& dview() const { return dview_; }
  DataPlane& gpu() { return *gpu_; }
  TestArena& cpu() { return cpu_; }

  static constexpr int kTopK = 32;

 private:
  TestArena cpu_;
  Geometry g_;
  uint64_t bytes_ = 0;
  std::unique_ptr<DevBuf> dev_, d_seq_, d_ctx_, d_q_, d_acc_, d_table_, d_logits_, d_idx_;
  std::vector<std::unique_ptr<DevBuf>> layer_logits_;  // with a deferred EMA: per layer
  // The logits buffer the unfused calls of layer l read.
  float* LogitsOf(int l) {
    return layer_logits_.empty() ? d_logits_->as<float>() : layer_logits_[l]->as<float>();
  }
  std::unique_ptr<DevBuf> d_table2_;  // StepTable: the same table at another address
  ArenaView dview_;
  std::unique_ptr<DataPlane> gpu_;
  std::vector<int32_t> table_;
  int64_t stride_ = 0;
  std::mt19937 rng_{3};
  std::function<void(int, int)> after_observe_;
  bool no_accepted_ = false;
  bool fused_ = false;
  bool one_call_ = false;
  bool given_topk_ = false;
  bool remap_observe_ = false;
  bool step_table_ = false;
  std::unique_ptr<FusedInputs> in_;
  ScoreFn score_ = Score;
};

struct Scenario {
  StateDtype dtype;
  int rows;
  double rho, gamma;
  uint32_t period;
  bool engine_contract = false;  ///< Observe without accepted counts (row 0 only)
  bool fused = false;            ///< IndexAndObserve on the GPU (row 0 only), from its logits
  bool one_call = false;         ///< fused: SelectIndexAndObserve instead of Select + that
  bool given_topk = false;       ///< RemapTopK: the probes count the engine's top-K
  bool remap_observe = false;    ///< unfused: RemapAndObserve (the remap in the Probe launch)
  bool step_table = false;       ///< unfused: the block table given at BeginStep (publish ahead)
  bool defer_ema = false;        ///< unfused: CudaDataPlaneOptions::defer_ema
};

// max_slots 64 * 40 + 17 runs the word-access EMA kernel (EmaWordKernel) and slot-by-slot block
// scores; 64 * 40 + 8 (a multiple of 8) the 16-byte EMA (EmaVecKernel), whose D chunks then
// reach the array's last entry, and scores from the V block summaries; with an odd logits
// stride pad, EmaWordKernel + VSummaryKernel feed the summaries instead. Blocks of 32 and 128
// slots run the generic kernels: ScoresKernel, EmaKernel (b = 32) or EmaWordKernel (b = 128),
// then VSummaryKernel. All have a partial last block.
// ahead_group > 0 selects that many layers per select-ahead grid (else all 3 at once); with
// mid_step, events inside steps: after layer 0's Observe a new policy is written (it applies
// from the next step), layer 0 is selected again (from its updated state) and, at step 7, a
// sequence of the batch is reset (it is padding for the rest of the step).
void RunScenarioWith(const Scenario& sc, uint32_t max_slots, int stride_pad, uint32_t block = 64,
                     int ahead_group = 0, bool mid_step = false, bool probe_beside_ema = true) {
  SCOPED_TRACE(::testing::Message()
               << "max_slots " << max_slots << ", stride pad " << stride_pad << ", block " << block
               << ", ahead group " << ahead_group << (mid_step ? ", mid-step events" : "")
               << (probe_beside_ema ? "" : ", Probe before the EMA")
               << (sc.defer_ema ? ", EMA deferred" : ""));
  Geometry g;
  g.layers = 3;
  g.max_seqs = 6;
  g.max_slots = max_slots;
  g.block_size = block;
  g.topk = 256;
  g.max_rows = static_cast<uint32_t>(sc.rows);
  g.dtype = sc.dtype;
  Policy p;
  p.target_sparsity = sc.rho;
  p.exploration = sc.gamma;
  p.alpha = 0.3f;
  p.probe_period = sc.period;
  CudaDataPlaneOptions options;
  options.ahead_group_layers = ahead_group;
  options.probe_beside_ema = probe_beside_ema;
  options.defer_ema = sc.defer_ema;
  Twin t(g, p, 99, stride_pad, options);
  if (sc.engine_contract) t.NoAccepted();
  if (sc.fused) t.Fused(sc.one_call);
  if (sc.given_topk) t.GivenTopK();
  if (sc.remap_observe) t.RemapAndObserveMode();
  if (sc.step_table) t.StepTable();
  int step_n = 0;  // entries of the current step
  if (mid_step) {
    t.AfterObserve([&](int step, int l) {
      if (l != 0) return;
      Policy q = p;
      q.target_sparsity = step % 2 ? sc.rho : std::min(0.9, sc.rho + 0.2);
      q.exploration = step % 2 ? sc.gamma : sc.gamma / 2;
      ASSERT_TRUE(WritePolicy(t.cpu().view(), q).ok());
      ASSERT_TRUE(WriteDevicePolicy(t.dview(), q).ok());
      t.SelectAndCompare(0, step_n, sc.rows, "layer 0 selected again after its Observe");
      if (step == 7) t.Reset(1, 4242);  // entry 3 of the batch
    });
  }
  std::mt19937 rng(sc.rows * 10 + static_cast<int>(sc.dtype));
  const int kSteps = 24;
  // Sequence s starts with context start[s]; sequence 0 ends exactly at max_slots.
  std::vector<int> ctx = {
      static_cast<int>(g.max_slots) - kSteps * sc.rows + 1, 100, 900, 1500, 64 * 20, 63};
  for (int s = 0; s < 6; ++s) t.Reset(s, 1000 + s);
  for (int step = 0; step < kSteps; ++step) {
    if (step == 12) t.Reset(3, 555);  // a sequence slot reused mid-run
    std::vector<int32_t> seq = {0, 2, -1, 1, 3, 4}, c, q, acc;
    if (step % 5 == 4) seq[5] = 5;
    // Entry 2 has no sequence: padding (context 0) every third step, else served dense over a
    // context of its own. Every seventh step is dense (the engine decided so after capture):
    // no entry has a sequence, each keeps its context.
    const int pad_ctx =
        step % 3 == 0 ? 0 : 1 + (step * 97) % (static_cast<int>(g.max_slots) - sc.rows);
    const bool dense_step = step % 7 == 5;
    for (int32_t s : seq) {
      const int cc = s < 0 ? pad_ctx : ctx[s];
      c.push_back(cc);
      q.push_back(
          s < 0 || dense_step ? 0 : (s == 4 && cc > 2 ? cc - 2 : cc - 1));  // seq 4: query trails
      acc.push_back(sc.rows == 1 ? 1 : static_cast<int32_t>(rng() % (sc.rows + 1)));
    }
    std::vector<int32_t> step_seq = seq;
    if (dense_step) std::fill(step_seq.begin(), step_seq.end(), -1);
    step_n = static_cast<int>(seq.size());
    t.Step(step_seq, c, q, sc.rows, acc, step);
    for (size_t e = 0; e < seq.size(); ++e) {
      if (seq[e] >= 0) ctx[seq[e]] += std::max(1, acc[e]);  // the engine's contexts still grow
    }
  }
  t.ExpectSameArena("end of run");
}

void RunScenario(const Scenario& sc) {
  RunScenarioWith(sc, 64 * 40 + 17, 0);
  RunScenarioWith(sc, 64 * 40 + 8, 0);
  RunScenarioWith(sc, 64 * 40 + 8, 0, 64, 0, false, false);  // Probe, then the EMA
  RunScenarioWith(sc, 64 * 40 + 8, 1);
  RunScenarioWith(sc, 32 * 80 + 9, 0, 32);
  RunScenarioWith(sc, 128 * 20 + 40, 0, 128);
  // The EMA off the caller's stream (CudaDataPlaneOptions::defer_ema), joined by later calls:
  // with the mid-step events (a layer selected again and a reset, which join it first).
  Scenario deferred = sc;
  deferred.defer_ema = true;
  RunScenarioWith(deferred, 64 * 40 + 8, 0, 64, 0, true);
  RunScenarioWith(deferred, 32 * 80 + 9, 1, 32);
}

TEST_F(CudaTest, ParityFp32SingleRow) { RunScenario({StateDtype::kFp32, 1, 0.5, 0.1, 3}); }
TEST_F(CudaTest, ParityFp32Mtp) { RunScenario({StateDtype::kFp32, 3, 0.6, 0.2, 4}); }
TEST_F(CudaTest, ParityBf16SingleRow) { RunScenario({StateDtype::kBf16, 1, 0.4, 0.05, 5}); }
TEST_F(CudaTest, ParityBf16Mtp) { RunScenario({StateDtype::kBf16, 2, 0.7, 0.25, 2}); }
// MTP as an engine runs it: Observe with no accepted counts applies row 0 only.
TEST_F(CudaTest, ParityFp32MtpEngineContract) {
  RunScenario({StateDtype::kFp32, 4, 0.5, 0.1, 3, true});
}
TEST_F(CudaTest, ParityBf16MtpEngineContract) {
  RunScenario({StateDtype::kBf16, 3, 0.6, 0.2, 0, true});
}
TEST_F(CudaTest, ParityNoExplorationNoProbes) { RunScenario({StateDtype::kFp32, 1, 0.3, 0.0, 0}); }

// The fused scenarios: fp32 and bf16, one row and MTP rows, probe steps, a partial last block
// with an odd stride pad, and the mid-step events; one_call: SelectIndexAndObserve.
void RunFusedScenarios(bool one_call) {
  for (Scenario sc : {Scenario{StateDtype::kFp32, 1, 0.5, 0.1, 3, true, true},
                      Scenario{StateDtype::kBf16, 1, 0.4, 0.05, 0, true, true},
                      Scenario{StateDtype::kBf16, 3, 0.6, 0.2, 4, true, true},
                      Scenario{StateDtype::kFp32, 2, 0.7, 0.25, 2, true, true}}) {
    sc.one_call = one_call;
    RunScenarioWith(sc, 64 * 40 + 8, 0);
    RunScenarioWith(sc, 64 * 40 + 17, 3);
    RunScenarioWith(sc, 64 * 40 + 8, 0, 64, 0, true);
  }
}

// The fused mode (IndexAndObserve: spind's indexer with the row-0 EMA in its epilogue) against
// the CPU observing the logits it wrote: every selection, and at the end every byte of state,
// V summaries, statistics and curves. fp32 and bf16, one row and MTP rows (row 0 applied),
// probe steps, rows split over several CTAs, max_slots a multiple of 8 and not (a partial last
// block), and the mid-step events (a layer selected again after its fused Observe, a policy
// write, a reset). The scales' NaN and inf make non-finite logits (the bad-score count).
TEST_F(CudaTest, ParityFusedIndexerEma) {
  SPIN_REQUIRE_OR_SKIP(
      Sm90(), "the fused mode needs an sm_90 device (wgmma), this one is " << DeviceArch());
  RunFusedScenarios(false);
}

// SelectIndexAndObserve (Select and the fused indexer in one kernel, which reads the layer's
// selection and the engine's block table itself and publishes Select's outputs): the same
// scenarios as ParityFusedIndexerEma, and after every call the published union, compacted
// table and lengths and a Remap equal the CPU's Select, besides every selection and, at the end,
// every byte of the arena. Rows spread over their CTAs every other step.
TEST_F(CudaTest, ParityFusedSelectIndexAndObserve) {
  SPIN_REQUIRE_OR_SKIP(
      Sm90(), "the fused mode needs an sm_90 device (wgmma), this one is " << DeviceArch());
  RunFusedScenarios(true);
}

// The engine's top-K given to RemapTopK is what the probe steps count (docs/design.md §5, "given by
// the engine"), on both backends: random compacted indices (some padding, some out of range) on
// every layer, counted per curve level for the probing entries; Observe (and the fused calls,
// with probe_at_remap) then compute no top-K. Unfused: one row and MTP rows, Probe beside the
// EMA and before it, 32-slot blocks; fused: both calls, one row and MTP rows, and the one call
// made twice in a step (each selection counted once). At the end every byte of the arena,
// curves and probe statistics included, equals the CPU's.
TEST_F(CudaTest, ParityProbeCountsTheEngineTopK) {
  for (Scenario sc : {Scenario{StateDtype::kFp32, 1, 0.5, 0.1, 3},
                      Scenario{StateDtype::kBf16, 3, 0.6, 0.2, 2, true}}) {
    sc.given_topk = true;
    RunScenarioWith(sc, 64 * 40 + 8, 0);
    RunScenarioWith(sc, 64 * 40 + 8, 0, 64, 0, true, false);  // mid-step events, Probe first
    RunScenarioWith(sc, 32 * 80 + 9, 0, 32);
  }
  if (!Sm90()) return;
  for (bool one_call : {false, true}) {
    for (Scenario sc : {Scenario{StateDtype::kBf16, 1, 0.4, 0.05, 2, true, true},
                        Scenario{StateDtype::kFp32, 2, 0.6, 0.2, 3, true, true}}) {
      sc.one_call = one_call;
      sc.given_topk = true;
      RunScenarioWith(sc, 64 * 40 + 8, 0);
      RunScenarioWith(sc, 64 * 40 + 8, 0, 64, 0, true);
    }
  }
}

// RemapAndObserve (the remap inside Observe's Probe launch, the engine's top-K counted there)
// against the CPU's RemapTopK and Observe: one row and MTP rows with accepted counts and without,
// Probe beside the EMA and before it, 32-slot blocks, mid-step events; the mapped indices after
// every layer and every byte of the arena at the end.
TEST_F(CudaTest, ParityRemapAndObserve) {
  for (Scenario sc :
       {Scenario{StateDtype::kFp32, 1, 0.5, 0.1, 3}, Scenario{StateDtype::kBf16, 3, 0.6, 0.2, 2},
        Scenario{StateDtype::kBf16, 2, 0.4, 0.05, 4, true}}) {
    sc.remap_observe = true;
    RunScenarioWith(sc, 64 * 40 + 8, 0);
    RunScenarioWith(sc, 64 * 40 + 17, 0, 64, 0, true, false);  // mid-step events, Probe first
    RunScenarioWith(sc, 32 * 80 + 9, 0, 32);
    sc.defer_ema = true;
    RunScenarioWith(sc, 64 * 40 + 17, 0, 64, 0, true);
    sc.defer_ema = false;
  }
}

// The engine's block table given at BeginStep (StepBatch::block_table): on the GPU each layer's
// Observe publishes the next layer's selection and that Select launches nothing. Against the CPU
// (which selects at Select from the step's table): the outputs after every Select, every
// remapped index, and at the end every byte of the arena, statistics included. Observe and
// RemapAndObserve, with accepted counts and without, the engine's top-K, Probe beside the EMA and
// before it, 32-slot blocks, select-ahead groups, mid-step events (a layer selected again after
// its Observe, a reset between a layer's Observe and the next Select), a Select given the same
// table at another address, and a layer selected but not observed (its statistics counted at
// the next Select).
TEST_F(CudaTest, ParityStepTablePublishesAhead) {
  for (Scenario sc :
       {Scenario{StateDtype::kFp32, 1, 0.5, 0.1, 3}, Scenario{StateDtype::kBf16, 3, 0.6, 0.2, 2},
        Scenario{StateDtype::kBf16, 2, 0.4, 0.05, 4, true}}) {
    sc.step_table = true;
    for (bool remap_observe : {false, true}) {
      sc.remap_observe = remap_observe;
      sc.given_topk = !remap_observe && sc.rows == 1;
      RunScenarioWith(sc, 64 * 40 + 8, 0);
      RunScenarioWith(sc, 64 * 40 + 17, 0, 64, 0, true, false);  // mid-step events, Probe first
      RunScenarioWith(sc, 64 * 40 + 8, 0, 64, 2, true);
      RunScenarioWith(sc, 32 * 80 + 9, 0, 32);
      // vLLM's path with the EMA deferred: each layer's EMA joined by the next Observe, a layer
      // selected but not observed (the one after joins), the mid-step events.
      Scenario deferred = sc;
      deferred.defer_ema = true;
      RunScenarioWith(deferred, 64 * 40 + 8, 0);
      RunScenarioWith(deferred, 64 * 40 + 17, 0, 64, 0, true);
    }
  }
}

// A step of padding entries only still needs a logits buffer, on both backends alike (the CUDA
// data plane cannot tell on the host that nothing will be read): refused with the same status,
// the arenas unchanged; with a buffer and stride 0 both accept it and still equal each other.
TEST_F(CudaTest, APaddingOnlyStepNeedsLogitsOnBothBackends) {
  Twin t(TwoSequences(), Policy{}, 1);
  t.Reset(0, 1);
  const int32_t seq[2] = {-1, -1}, ctx[2] = {0, 0}, qp[2] = {0, 0};
  const DevStep step(seq, ctx, qp);
  DevBuf z(16);
  ASSERT_TRUE(t.cpu().dp().BeginStep(StepBatch{seq, ctx, qp, 2, 1}).ok());
  ASSERT_TRUE(t.gpu().BeginStep(step.batch()).ok());
  ASSERT_TRUE(t.cpu().dp().Select(0).ok());
  ASSERT_TRUE(t.gpu().Select(0).ok());
  for (int64_t stride : {0, -1}) {
    const absl::Status on_cpu = t.cpu().dp().Observe(0, nullptr, stride);
    const absl::Status on_gpu = t.gpu().Observe(0, nullptr, stride);
    EXPECT_EQ(on_cpu.code(), absl::StatusCode::kInvalidArgument) << on_cpu;
    EXPECT_EQ(on_gpu, on_cpu);
  }
  const float none = 0.0f;
  EXPECT_EQ(t.cpu().dp().Observe(0, &none, -1), t.gpu().Observe(0, z.as<float>(), -1));
  t.ExpectSameArena("after the refused Observes");
  EXPECT_TRUE(t.cpu().dp().Observe(0, &none, 0).ok());
  EXPECT_TRUE(t.gpu().Observe(0, z.as<float>(), 0).ok());
  t.ExpectSameArena("after the padding-only Observe");
}

// Bad arguments to SelectIndexAndObserve are refused before anything runs: no block table, a
// stride below max blocks, a layer out of range, missing indexer inputs; the arena is unchanged
// and the data plane still takes the step's calls.
TEST_F(CudaTest, SelectIndexAndObserveRefusesBadArgumentsAndChangesNothing) {
  SPIN_REQUIRE_OR_SKIP(
      Sm90(), "the fused mode needs an sm_90 device (wgmma), this one is " << DeviceArch());
  Geometry g;
  g.layers = 2;
  g.max_seqs = 2;
  g.max_slots = 64 * 16;
  g.topk = 64;
  Policy p;
  const uint64_t bytes = ArenaBytes(g);
  DevBuf arena(bytes);
  auto dp = MakeDataPlane(arena.p, bytes, DeviceSpec(g, 5, p));
  ASSERT_TRUE(dp.ok());
  const ArenaView* view = &(*dp)->arena();
  const int64_t MB = view->max_blocks;
  FusedInputs in(g.max_seqs, 1, MB);
  DevBuf d_table(in.table.size() * 4), logits(g.max_seqs * MB * 64 * 4);
  CUDA_OK(cudaMemcpy(d_table.p, in.table.data(), in.table.size() * 4, cudaMemcpyHostToDevice));
  std::vector<int32_t> seq = {0, 1}, ctx = {500, 700}, q = {499, 699};
  DevBuf d_seq(8), d_ctx(8), d_q(8);
  CUDA_OK(cudaMemcpy(d_seq.p, seq.data(), 8, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_ctx.p, ctx.data(), 8, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_q.p, q.data(), 8, cudaMemcpyHostToDevice));
  for (int s = 0; s < 2; ++s) ASSERT_TRUE((*dp)->ResetSequence(s, 9 + s).ok());
  ASSERT_TRUE(
      (*dp)
          ->BeginStep(StepBatch{d_seq.as<int32_t>(), d_ctx.as<int32_t>(), d_q.as<int32_t>(), 2, 1})
          .ok());
  FusedIndexerArgs f = in.Args(logits.as<float>());
  f.logits_stride = MB * 64;
  const int32_t* table = d_table.as<int32_t>();
  // Layer 0 observed once: a refused call of layer 0 must not select it again either (its
  // selection would be remade from the updated state; the row-0 block scores would show it).
  ASSERT_TRUE(SelectIndexAndObserve(**dp, 0, table, MB, f).ok());
  CUDA_OK(cudaDeviceSynchronize());
  const auto before = ToHost(static_cast<const uint8_t*>(arena.p), bytes);
  const auto scores_before = ReadDeviceBlockScores(**dp, 0, 2);
  ASSERT_TRUE(scores_before.ok());
  auto expect = [&](absl::Status st, absl::StatusCode code, const std::string& what) {
    EXPECT_EQ(st.code(), code) << what << ": " << st;
    EXPECT_FALSE(st.message().empty()) << what;
  };
  expect(SelectIndexAndObserve(**dp, 0, nullptr, MB, f), absl::StatusCode::kInvalidArgument,
         "no block table");
  expect(SelectIndexAndObserve(**dp, 0, table, MB - 1, f), absl::StatusCode::kInvalidArgument,
         "stride below max blocks");
  expect(SelectIndexAndObserve(**dp, 2, table, MB, f), absl::StatusCode::kOutOfRange,
         "layer out of range");
  FusedIndexerArgs no_q = f;
  no_q.q = nullptr;
  expect(SelectIndexAndObserve(**dp, 0, table, MB, no_q), absl::StatusCode::kInvalidArgument,
         "no q");
  FusedIndexerArgs bad_stride = f;
  bad_stride.logits_stride = -1;
  expect(SelectIndexAndObserve(**dp, 0, table, MB, bad_stride), absl::StatusCode::kInvalidArgument,
         "negative logits stride");
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(ToHost(static_cast<const uint8_t*>(arena.p), bytes), before)
      << "a refused call changed the arena";
  EXPECT_EQ(*ReadDeviceBlockScores(**dp, 0, 2), *scores_before)
      << "a refused call selected layer 0 again";
  // Refused calls select nothing: layer 1 has no Select yet, so IndexAndObserve of it is refused.
  EXPECT_EQ(IndexAndObserve(**dp, 1, f).code(), absl::StatusCode::kFailedPrecondition);
  // The step goes on.
  for (int l = 0; l < 2; ++l) {
    const absl::Status st = SelectIndexAndObserve(**dp, l, table, MB, f);
    ASSERT_TRUE(st.ok()) << st;
  }
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(*ReadDeviceError(*view), 0u);
  // A step of no entries: the call selects the layer (Remap then runs) and launches nothing.
  ASSERT_TRUE((*dp)->BeginStep(StepBatch{nullptr, nullptr, nullptr, 0, 1}).ok());
  ASSERT_TRUE(SelectIndexAndObserve(**dp, 1, table, MB, f).ok());
  DevBuf idx(4);
  EXPECT_TRUE((*dp)->Remap(idx.as<int32_t>(), 1).ok());
  // Blocks that are not one KV page each.
  Geometry g32 = g;
  g32.block_size = 32;
  const uint64_t bytes32 = ArenaBytes(g32);
  DevBuf arena32(bytes32);
  auto dp32 = MakeDataPlane(arena32.p, bytes32, DeviceSpec(g32, 5, p));
  ASSERT_TRUE(dp32.ok());
  const ArenaView* view32 = &(*dp32)->arena();
  expect(SelectIndexAndObserve(**dp32, 0, table, view32->max_blocks, f),
         absl::StatusCode::kFailedPrecondition, "32-slot blocks");
}

// A logits stride below one entry's compacted row: the device records kArenaBadStride, that entry
// is not applied (its state and fresh flag unchanged) and the others are; the fused kernel never
// writes past the stride. The same in the unfused Observe (Probe validates), in IndexAndObserve
// and in SelectIndexAndObserve (the fused kernel validates, its Probe launch does not).
TEST_F(CudaTest, ALogitsStrideBelowARowIsAnErrorAndOnlyThatEntryIsNotApplied) {
  enum Mode { kUnfused, kTwoCalls, kOneCall };
  for (const Mode mode : {kUnfused, kTwoCalls, kOneCall}) {
    if (mode != kUnfused && !Sm90()) continue;
    SCOPED_TRACE(::testing::Message() << "mode " << mode);
    Geometry g;
    g.layers = 1;
    g.max_seqs = 2;
    g.max_slots = 64 * 24;
    g.topk = 64;
    g.dtype = StateDtype::kBf16;
    Policy p;
    const uint64_t bytes = ArenaBytes(g);
    DevBuf arena(bytes);
    auto dp = MakeDataPlane(arena.p, bytes, DeviceSpec(g, 3, p));
    ASSERT_TRUE(dp.ok());
    const ArenaView* view = &(*dp)->arena();
    const int64_t MB = view->max_blocks, stride = 1000;
    for (int s = 0; s < 2; ++s) ASSERT_TRUE((*dp)->ResetSequence(s, 20 + s).ok());
    // Fresh pairs select densely: the compacted rows are the contexts, 1280 (above the stride)
    // and 200.
    const std::vector<int32_t> seq = {0, 1}, ctx = {1280, 200}, q = {1279, 199};
    DevBuf d_seq(8), d_ctx(8), d_q(8);
    CUDA_OK(cudaMemcpy(d_seq.p, seq.data(), 8, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_ctx.p, ctx.data(), 8, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_q.p, q.data(), 8, cudaMemcpyHostToDevice));
    FusedInputs in(g.max_seqs, 1, MB);
    DevBuf d_table(in.table.size() * 4);
    CUDA_OK(cudaMemcpy(d_table.p, in.table.data(), in.table.size() * 4, cudaMemcpyHostToDevice));
    // Two rows of `stride` logits and a guard row after them.
    const std::vector<float> sentinel(3 * stride, -7.0f);
    std::vector<float> ones(3 * stride, 1.0f);
    DevBuf logits(sentinel.size() * 4);
    CUDA_OK(cudaMemcpy(logits.p, mode == kUnfused ? ones.data() : sentinel.data(),
                       sentinel.size() * 4, cudaMemcpyHostToDevice));
    const uint64_t rec = view->StateRecordBytes();
    const auto state0 = ToHost(view->StateRecord(0, 0), rec);
    const auto state1 = ToHost(view->StateRecord(1, 0), rec);
    ASSERT_TRUE((*dp)
                    ->BeginStep(StepBatch{d_seq.as<int32_t>(), d_ctx.as<int32_t>(),
                                          d_q.as<int32_t>(), 2, 1})
                    .ok());
    const int32_t* table = d_table.as<int32_t>();
    FusedIndexerArgs f = in.Args(logits.as<float>());
    f.logits_stride = stride;
    if (mode == kOneCall) {
      ASSERT_TRUE(SelectIndexAndObserve(**dp, 0, table, MB, f).ok());
    } else {
      ASSERT_TRUE((*dp)->Select(0, table, MB).ok());
      if (mode == kUnfused) {
        ASSERT_TRUE((*dp)->Observe(0, logits.as<float>(), stride, nullptr).ok());
      } else {
        ASSERT_TRUE(IndexAndObserve(**dp, 0, f).ok());
      }
    }
    CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(*ReadDeviceError(*view), static_cast<uint32_t>(kArenaBadStride));
    const auto fresh = ToHost(view->fresh, 2);
    EXPECT_EQ(fresh[0], 1) << "the entry whose row passes the stride was applied";
    EXPECT_EQ(fresh[1], 0) << "the entry that fits was not applied";
    EXPECT_EQ(ToHost(view->StateRecord(0, 0), rec), state0) << "state of the entry not applied";
    EXPECT_NE(ToHost(view->StateRecord(1, 0), rec), state1) << "state of the entry applied";
    if (mode != kUnfused) {
      // Row 0 (1280 slots) is written up to the stride only: row 1 holds entry 1's 200 logits
      // and then the sentinel, and the guard row is untouched.
      const auto out = ToHost(logits.as<float>(), sentinel.size());
      for (int64_t i = 0; i < stride; ++i) ASSERT_NE(out[i], -7.0f) << "row 0 slot " << i;
      for (int64_t i = 200; i < 2 * stride; ++i) {
        ASSERT_EQ(out[stride + i], -7.0f) << "written past row 1's length or by row 0 at " << i;
      }
    }
  }
}

// The fused mode captured in a CUDA graph: a step (BeginStep, then per layer Select and
// IndexAndObserve) captured once and replayed on one arena, the same calls eagerly on a twin
// arena with the same inputs; after every step the two arenas are equal byte for byte (and the
// eager fused mode equals the CPU reference: ParityFusedIndexerEma). MTP rows, probe steps, a
// policy change in the middle.
TEST_F(CudaTest, FusedStepInAGraphEqualsEager) {
  SPIN_REQUIRE_OR_SKIP(
      Sm90(), "the fused mode needs an sm_90 device (wgmma), this one is " << DeviceArch());
  for (const auto& [dtype, one_call] :
       {std::pair{StateDtype::kBf16, false}, std::pair{StateDtype::kFp32, false},
        std::pair{StateDtype::kBf16, true}, std::pair{StateDtype::kFp32, true}}) {
    SCOPED_TRACE(::testing::Message()
                 << (one_call ? "graph: SelectIndexAndObserve (spread, programmatic)"
                              : "graph: Select + IndexAndObserve"));
    Geometry g;
    g.layers = 3;
    g.max_seqs = 4;
    g.max_slots = 64 * 48 + 8;
    g.topk = 128;
    g.max_rows = 2;
    g.dtype = dtype;
    Policy p;
    p.target_sparsity = 0.5;
    p.exploration = 0.1;
    p.probe_period = 4;
    const uint64_t bytes = ArenaBytes(g);
    DevBuf ea(bytes), ga(bytes);
    auto edp = MakeDataPlane(ea.p, bytes, DeviceSpec(g, 7, p));
    auto gdp = MakeDataPlane(ga.p, bytes, DeviceSpec(g, 7, p));
    ASSERT_TRUE(edp.ok() && gdp.ok());
    const ArenaView *ev = &(*edp)->arena(), *gv = &(*gdp)->arena();
    const int n = 4, rows = 2, L = 3;
    const int64_t MB = ev->max_blocks, stride = MB * 64;
    FusedInputs in(g.max_seqs, g.max_rows, MB);
    DevBuf d_seq(n * 4), d_ctx(n * 4), d_q(n * 4), d_table(in.table.size() * 4);
    DevBuf e_logits(static_cast<size_t>(n) * rows * stride * 4);
    DevBuf g_logits(static_cast<size_t>(n) * rows * stride * 4);
    CUDA_OK(cudaMemcpy(d_table.p, in.table.data(), in.table.size() * 4, cudaMemcpyHostToDevice));
    for (int s = 0; s < n; ++s) {
      ASSERT_TRUE((*edp)->ResetSequence(s, 40 + s).ok());
      ASSERT_TRUE((*gdp)->ResetSequence(s, 40 + s).ok());
    }
    const StepBatch batch{d_seq.as<int32_t>(), d_ctx.as<int32_t>(), d_q.as<int32_t>(), n, rows};
    // one_call: the graph runs SelectIndexAndObserve (rows spread over their CTAs, programmatic
    // launches), the eager twin Select and IndexAndObserve (chunks for max_pages, ordinary
    // launches), so the two forms are compared byte for byte too.
    auto step = [&](DataPlane& dp, float* logits, cudaStream_t st, bool one) {
      ASSERT_TRUE(dp.BeginStep(batch, st).ok());
      for (int l = 0; l < L; ++l) {
        FusedIndexerArgs f = in.Args(logits);
        f.logits_stride = stride;
        if (one) {
          f.spread = true;
          f.programmatic = true;
          const absl::Status s = SelectIndexAndObserve(dp, l, d_table.as<int32_t>(), MB, f, st);
          ASSERT_TRUE(s.ok()) << s;
        } else {
          f.spread = false;
          f.programmatic = false;
          ASSERT_TRUE(dp.Select(l, d_table.as<int32_t>(), MB, st).ok());
          const absl::Status s = IndexAndObserve(dp, l, f, st);
          ASSERT_TRUE(s.ok()) << s;
        }
      }
    };
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    step(**gdp, g_logits.as<float>(), stream, one_call);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<int32_t> seq = {2, 0, 3, 1}, ctx = {300, 900, 1700, 64 * 48 - 60};
    for (int t = 0; t < 24; ++t) {
      if (t == 10) {
        Policy q2 = p;
        q2.target_sparsity = 0.7;
        ASSERT_TRUE(WriteDevicePolicy(*ev, q2).ok());
        ASSERT_TRUE(WriteDevicePolicy(*gv, q2).ok());
      }
      std::vector<int32_t> q(n);
      for (int e = 0; e < n; ++e) q[e] = ctx[e] - 1;
      CUDA_OK(cudaMemcpy(d_seq.p, seq.data(), n * 4, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(d_ctx.p, ctx.data(), n * 4, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(d_q.p, q.data(), n * 4, cudaMemcpyHostToDevice));
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      step(**edp, e_logits.as<float>(), stream, false);
      CUDA_OK(cudaStreamSynchronize(stream));
      const auto eb = ToHost(static_cast<const uint8_t*>(ea.p), bytes);
      const auto gb = ToHost(static_cast<const uint8_t*>(ga.p), bytes);
      ArenaHeader h;
      std::memcpy(&h, eb.data(), sizeof(h));
      for (uint64_t i = 0; i < h.off_scratch; ++i) {
        ASSERT_EQ(eb[i], gb[i]) << "step " << t << ": the graph's arena differs at byte " << i;
      }
      for (int e = 0; e < n; ++e) ctx[e] += 1;
    }
    ASSERT_EQ(*ReadDeviceError(*ev), 0u);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

// The step's selections made ahead in groups of 1 and 2 layers instead of all 3 at once, and
// events inside a step (a policy write, a layer selected again after its Observe, a sequence
// reset): the same results as the reference.
TEST_F(CudaTest, ParitySelectAheadGroupsAndMidStepEvents) {
  for (const Scenario& sc :
       {Scenario{StateDtype::kFp32, 1, 0.5, 0.1, 3}, Scenario{StateDtype::kBf16, 3, 0.6, 0.2, 4}}) {
    RunScenarioWith(sc, 64 * 40 + 8, 0, 64, 1);
    RunScenarioWith(sc, 64 * 40 + 8, 0, 64, 2);
    RunScenarioWith(sc, 64 * 40 + 8, 0, 64, 0, true);
    RunScenarioWith(sc, 64 * 40 + 17, 0, 64, 2, true);
  }
}

// Select keeps a row's keys in registers, 2 per thread up to 2048 blocks and 4 up to 4096, and in
// the private scratch beyond; the union takes 4096 blocks per round. Sequence 0 ends near 256K
// and 269K slots (about 4000 blocks of 64, so all four register rounds, and 4200), so the larger
// register variant, the scratch variant (long contexts: 1M slots is 16K blocks) and a two-round
// union are compared with the CPU too, with MTP rows, exploration and probe steps.
TEST_F(CudaTest, ParityLongContexts) {
  const Scenario sc{StateDtype::kBf16, 2, 0.5, 0.1, 5};
  RunScenarioWith(sc, 64 * 4000 + 8, 0);
  RunScenarioWith(sc, 64 * 4200 + 8, 0);
}

// Every path of the probe's top-K and curve, probing every sequence at every step after its
// first (period 1), against the CPU's curves and statistics. Rows longer than the probe's 8192
// candidates take a threshold from a sample of 2048 logits: sequence 0 (blocks of 16, more than
// 8192 blocks, so the curve's ranking falls back to radix selects) and sequence 3 (the sorted
// ranking) with the usual scores; sequence 1 with one score everywhere but a few non-finite ones
// (more candidates than fit: the top-K falls back to radix selects, with ties); sequence 2 with
// the largest scores at every other sampled slot, the other samples and six in seven of the
// other slots NaN (too few candidates above the sample's threshold, and fewer than 8192 finite
// scores, so the pass runs again with every finite score a candidate).
// Sequence 4 is shorter than 8192 slots (every finite score a candidate).
TEST_F(CudaTest, ParityProbePaths) {
  for (StateDtype dtype : {StateDtype::kFp32, StateDtype::kBf16}) {
    SCOPED_TRACE(dtype == StateDtype::kFp32 ? "fp32" : "bf16");
    Geometry g;
    g.layers = 2;
    g.max_seqs = 5;
    g.block_size = 16;
    g.max_slots = 16 * 8300 + 3;
    g.topk = 256;
    g.dtype = dtype;
    Policy p;
    p.target_sparsity = 0.6;
    p.exploration = 0.1;
    p.alpha = 0.3f;
    p.probe_period = 1;
    Twin t(g, p, 17);
    constexpr int kSample = 2048;  // the probe's sample (kProbeSample in the backend)
    t.SetScore([](int seq, int layer, int step, int row, int slot, int q) {
      const float usual = Score(seq, layer, step, row, slot, q);
      if (seq == 1) return std::isfinite(usual) ? 1.0f : usual;
      if (seq == 2) {
        const int64_t n = q - row + 1;  // row 0's length (the probe's row)
        const int64_t s = (static_cast<int64_t>(slot) * kSample + n - 1) / n;  // first sample >=
        if (s < kSample && (s * n) / kSample == slot) return s % 2 == 0 ? 100.0f + usual : NAN;
        return slot % 7 == 0 ? usual : NAN;
      }
      return usual;
    });
    std::vector<int> ctx = {static_cast<int>(g.max_slots) - 6, 20000, 20000, 30001, 5000};
    for (int s = 0; s < 5; ++s) t.Reset(s, 300 + s);
    for (int step = 0; step < 6; ++step) {
      std::vector<int32_t> seq = {0, 1, 2, 3, 4}, c, q, acc(5, 1);
      for (int s : seq) {
        c.push_back(ctx[s]);
        q.push_back(ctx[s] - 1);
      }
      t.Step(seq, c, q, 1, acc, step);
      for (int& x : ctx) ++x;
    }
    t.ExpectSameArena("after probe steps");
    const auto probes = ToHost(&t.dview().stats[0].probe_steps, 1);
    EXPECT_EQ(probes[0], 5u * 5u) << "every sequence probes every step after its first";
  }
}

// The 16-byte EMA shares the segments of a whole batch of at most 512 entries over its grid
// (kEmaFlatMaxEntries in the backend), and above that gives each entry its own grid row. Batches
// of 600 entries (per-entry grids), exactly 512 (the whole batch at the limit) and 37 (far fewer
// than the grid's warps), with padding, mixed and partial-block contexts, MTP rows with random
// acceptance and probe steps (whose rows are dense, so the rows' lengths differ most), in fp32
// and bf16: every selection and, at the end, the whole state equal the CPU's.
TEST_F(CudaTest, ParityLargeAndSmallBatchesShareTheEma) {
  for (StateDtype dtype : {StateDtype::kFp32, StateDtype::kBf16}) {
    SCOPED_TRACE(dtype == StateDtype::kFp32 ? "fp32" : "bf16");
    Geometry g;
    g.layers = 2;
    g.max_seqs = 600;
    g.block_size = 64;
    g.max_slots = 64 * 16 + 8;
    g.topk = 64;
    g.max_rows = 2;
    g.dtype = dtype;
    Policy p;
    p.target_sparsity = 0.5;
    p.exploration = 0.1;
    p.alpha = 0.3f;
    p.probe_period = 3;
    Twin t(g, p, 23);
    std::vector<int> ctx(600);
    for (int s = 0; s < 600; ++s) {
      ctx[s] = 1 + (s * 37) % 900;
      t.Reset(s, 7000 + s);
    }
    std::mt19937 rng(5);
    const int sizes[] = {600, 512, 37, 600, 512, 37};
    for (int step = 0; step < 6; ++step) {
      const int n = sizes[step];
      std::vector<int32_t> seq, c, q, acc;
      for (int e = 0; e < n; ++e) {
        const int s = (e * 7 + step) % 600;  // distinct within a step (7 is prime to 600)
        const bool pad = e % 29 == 5;
        seq.push_back(pad ? -1 : s);
        c.push_back(pad ? 0 : ctx[s]);
        q.push_back(pad ? 0 : ctx[s] - 1);
        acc.push_back(static_cast<int32_t>(rng() % 3));
      }
      t.Step(seq, c, q, 2, acc, step);
      for (int e = 0; e < n; ++e) {
        if (seq[e] >= 0) ctx[seq[e]] += std::max(1, acc[e]);
      }
    }
    t.ExpectSameArena("after batches of 600, 512 and 37 entries");
  }
}

// BeginStep keeps each entry in registers, kMaxSequences / 1024 rounds per thread: a batch of
// more than 1024 entries (padding among them) uses the second round, and must still equal the
// CPU. A sequence twice in one batch is refused as a whole (shared bitmap), as on the CPU.
TEST_F(CudaTest, BeginStepOverMoreThan1024EntriesAndDuplicates) {
  Geometry g;
  g.layers = 1;
  g.max_seqs = 1100;
  g.max_slots = 256;
  g.topk = 64;
  Policy p;
  p.target_sparsity = 0.5;
  p.probe_period = 3;
  Twin t(g, p, 9);
  for (int s = 0; s < 1100; ++s) t.Reset(s, 500 + s);
  std::vector<int32_t> seq(1100), ctx(1100), q(1100), acc(1100, 1);
  for (int step = 0; step < 4; ++step) {
    for (int e = 0; e < 1100; ++e) {
      seq[e] = e % 97 == 5 ? -1 : e;  // some padding, in both rounds
      ctx[e] = 100 + (e % 50) + step;
      q[e] = ctx[e] - 1;
    }
    t.Step(seq, ctx, q, 1, acc, step);
  }
  t.ExpectSameArena("after 1100-entry steps");
  // Sequence 1050 (second round) twice: refused, nothing advanced.
  const auto steps_before = ToHost(&t.dview().seqs[1050].steps, 1);
  std::vector<int32_t> dup = {3, 1050, 7, 1050};
  const int32_t c[4] = {120, 120, 120, 120}, qq[4] = {119, 119, 119, 119};
  DevBuf ds(16), dc(16), dq(16);
  CUDA_OK(cudaMemcpy(ds.p, dup.data(), 16, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dc.p, c, 16, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dq.p, qq, 16, cudaMemcpyHostToDevice));
  ASSERT_TRUE(t.gpu()
                  .BeginStep(StepBatch{ds.as<int32_t>(), dc.as<int32_t>(), dq.as<int32_t>(), 4, 1})
                  .ok());
  auto err = ReadDeviceError(t.dview());
  ASSERT_TRUE(err.ok());
  EXPECT_EQ(*err, kArenaBadBatch);
  EXPECT_EQ(ToHost(&t.dview().batch->n, 1)[0], 0);
  EXPECT_EQ(ToHost(&t.dview().seqs[1050].steps, 1), steps_before);
  EXPECT_EQ(ToHost(&t.dview().seqs[3].steps, 1)[0], 4u);  // not advanced either
}

TEST_F(CudaTest, BadBatchRecordsAnErrorAndRunsNoEntry) {
  const Geometry g = TwoSequences();
  Twin t(g, Policy{}, 1);
  t.Reset(0, 1);
  const int32_t seq[2] = {0, 1}, ctx[2] = {100, 100}, qp[2] = {99, 99};  // sequence 1 not open
  const DevStep step(seq, ctx, qp);
  ASSERT_TRUE(t.gpu().BeginStep(step.batch()).ok());
  auto err = ReadDeviceError(t.dview());
  ASSERT_TRUE(err.ok());
  EXPECT_EQ(*err, kArenaBadBatch);
  const auto n = ToHost(&t.dview().batch->n, 1);
  EXPECT_EQ(n[0], 0);
  const auto steps = ToHost(&t.dview().seqs[0].steps, 1);
  EXPECT_EQ(steps[0], 0u);  // nothing advanced
  // Host-checked errors return a status and launch nothing.
  EXPECT_EQ(t.gpu().Select(1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(t.gpu().Observe(0, nullptr, 0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.gpu().ResetSequence(2, 0).code(), absl::StatusCode::kOutOfRange);
  if (!Sm90()) return;
  // The fused mode over the refused step: the call is accepted (the batch is checked on the
  // device) and writes nothing, neither the arena nor the logits.
  CUDA_OK(cudaDeviceSynchronize());
  const uint64_t bytes = ArenaBytes(g);
  const auto before = ToHost(reinterpret_cast<const uint8_t*>(t.dview().header), bytes);
  const int64_t MB = t.cpu().view().max_blocks;
  FusedInputs in(g.max_seqs, 1, MB);
  DevBuf d_table(in.table.size() * 4);
  CUDA_OK(cudaMemcpy(d_table.p, in.table.data(), in.table.size() * 4, cudaMemcpyHostToDevice));
  const std::vector<float> sentinel(2 * MB * 64, -7.0f);
  DevBuf logits(sentinel.size() * 4);
  CUDA_OK(cudaMemcpy(logits.p, sentinel.data(), sentinel.size() * 4, cudaMemcpyHostToDevice));
  FusedIndexerArgs f = in.Args(logits.as<float>());
  f.logits_stride = MB * 64;
  ASSERT_TRUE(SelectIndexAndObserve(t.gpu(), 0, d_table.as<int32_t>(), MB, f).ok());
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(ToHost(reinterpret_cast<const uint8_t*>(t.dview().header), bytes), before);
  EXPECT_EQ(ToHost(logits.as<float>(), sentinel.size()), sentinel);
}

// A whole decode step (BeginStep, then Select / engine indexer / Observe per layer) captured
// once in a CUDA graph and replayed for many steps, against the CPU reference run eagerly. Live
// tuning without recapture: at step 15 a new target and exploration share, at step 25 per-layer
// mode with a written budget table, on both backends; the same graph keeps replaying.
// With step_table the engine's block table is given at BeginStep: in the graph each Select but
// layer 0's launches nothing (the previous layer's Observe published its selection), and the
// logits are gathered through the outputs each Select left. With defer_ema each layer's EMA
// runs on the data plane's second stream, joined by the next layer's Observe (the last layer's
// at once, so the capture ends joined), and each layer has its own logits buffer.
void GraphReplayScenario(bool step_table, bool defer_ema = false) {
  SCOPED_TRACE(::testing::Message() << (step_table ? "the table given at BeginStep" : "no table")
                                    << (defer_ema ? ", EMA deferred" : ""));
  Geometry g;
  g.layers = 4;
  g.max_seqs = 4;
  g.max_slots = 64 * 32;
  g.topk = 128;
  g.max_rows = 2;
  Policy p;
  p.target_sparsity = 0.5;
  p.exploration = 0.1;
  p.probe_period = 5;
  CudaDataPlaneOptions options;
  options.defer_ema = defer_ema;
  Twin t(g, p, 5, 0, options);
  for (int s = 0; s < 4; ++s) t.Reset(s, 77 + s);
  const int n = 4, rows = 2, L = 4;
  const int64_t N = g.max_slots, MB = t.cpu().view().max_blocks, stride = MB * 64;
  DevBuf d_seq(n * 4), d_ctx(n * 4), d_q(n * 4), d_acc(n * 4), d_table(n * MB * 4);
  std::vector<int32_t> table(static_cast<size_t>(n) * MB);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>((i * 53) % 9973);
  CUDA_OK(cudaMemcpy(d_table.p, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  DevBuf d_dense(static_cast<size_t>(n) * L * rows * N * 4);
  std::vector<std::unique_ptr<DevBuf>> d_logits;
  for (int l = 0; l < (defer_ema ? L : 1); ++l) {
    d_logits.push_back(std::make_unique<DevBuf>(static_cast<size_t>(n) * rows * stride * 4));
  }
  auto logits_of = [&](int l) { return d_logits[defer_ema ? l : 0]->as<float>(); };
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  StepBatch dbatch{d_seq.as<int32_t>(), d_ctx.as<int32_t>(), d_q.as<int32_t>(), n, rows};
  if (step_table) dbatch.block_table = d_table.as<int32_t>(), dbatch.table_stride = MB;
  ASSERT_TRUE(t.gpu().BeginStep(dbatch, stream).ok());
  for (int l = 0; l < L; ++l) {
    ASSERT_TRUE(t.gpu().Select(l, nullptr, 0, stream).ok());
    CUDA_OK(LaunchGatherLogits(t.dview(), l, d_dense.as<float>(), N, logits_of(l), stride, stream));
    ASSERT_TRUE(t.gpu().Observe(l, logits_of(l), stride, d_acc.as<int32_t>(), stream).ok());
  }
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  std::vector<int32_t> seq = {2, 0, 3, 1}, ctx = {300, 700, 1200, 64 * 32 - 2 * 40 - 2};
  std::mt19937 rng(8);
  std::vector<float> dense(static_cast<size_t>(n) * L * rows * N);
  const int kSteps = 40;
  std::vector<int> kept_total(kSteps, 0);  // last layer's selected blocks over the batch
  for (int step = 0; step < kSteps; ++step) {
    if (step == 15 || step == 25) {
      Policy q2 = p;
      q2.target_sparsity = 0.75;
      q2.exploration = 0.05;
      if (step == 25) q2.budget_mode = BudgetMode::kPerLayer;
      ASSERT_TRUE(WriteArenaPolicy(t.cpu().dp(), q2).ok());
      ASSERT_TRUE(WriteArenaPolicy(t.gpu(), q2).ok());
      if (step == 25) {
        const std::vector<double> table = {0.2, 0.4, 0.6, 0.9};
        ASSERT_TRUE(WriteArenaBudgets(t.cpu().dp(), table).ok());
        ASSERT_TRUE(WriteArenaBudgets(t.gpu(), table).ok());
      }
    }
    std::vector<int32_t> q(n), acc(n);
    for (int e = 0; e < n; ++e) {
      q[e] = ctx[e] - 1;
      acc[e] = static_cast<int32_t>(rng() % (rows + 1));
      for (int l = 0; l < L; ++l) {
        for (int r = 0; r < rows; ++r) {
          float* z = dense.data() + ((static_cast<size_t>(e) * L + l) * rows + r) * N;
          for (int i = 0; i < ctx[e] + r; ++i) z[i] = Score(seq[e], l, step, r, i, q[e] + r);
        }
      }
    }
    CUDA_OK(cudaMemcpy(d_seq.p, seq.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_ctx.p, ctx.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_q.p, q.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_acc.p, acc.data(), n * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_dense.p, dense.data(), dense.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    // The reference, eagerly on the CPU with the same inputs.
    DataPlane& c = t.cpu().dp();
    StepBatch cbatch{seq.data(), ctx.data(), q.data(), n, rows};
    if (step_table) cbatch.block_table = table.data(), cbatch.table_stride = MB;
    ASSERT_TRUE(c.BeginStep(cbatch).ok());
    const ArenaView& cv = t.cpu().view();
    for (int l = 0; l < L; ++l) {
      ASSERT_TRUE(c.Select(l).ok());
      std::vector<float> logits(static_cast<size_t>(n) * rows * stride, -INFINITY);
      for (int e = 0; e < n; ++e) {
        for (int r = 0; r < rows; ++r) {
          const float* z = dense.data() + ((static_cast<size_t>(e) * L + l) * rows + r) * N;
          for (int k = 0; k < cv.union_count[e]; ++k) {
            for (int o = 0; o < 64; ++o) {
              const int i = cv.union_ids[e * MB + k] * 64 + o;
              if (i < ctx[e] + r)
                logits[(static_cast<size_t>(e) * rows + r) * stride + k * 64 + o] = z[i];
            }
          }
        }
      }
      ASSERT_TRUE(c.Observe(l, logits.data(), stride, acc.data()).ok());
    }
    // The last layer's outputs after the replay equal the reference's.
    const auto count = ToHost(t.dview().union_count, n);
    const auto ids = ToHost(t.dview().union_ids, static_cast<size_t>(n) * MB);
    const auto phys = ToHost(t.dview().phys, static_cast<size_t>(n) * MB);
    for (int e = 0; e < n; ++e) {
      ASSERT_EQ(count[e], cv.union_count[e]) << "step " << step;
      for (int k = 0; k < count[e]; ++k) {
        ASSERT_EQ(ids[e * MB + k], cv.union_ids[e * MB + k]);
        if (step_table) {
          ASSERT_EQ(phys[e * MB + k], cv.phys[e * MB + k]);
        }
      }
      kept_total[step] += count[e];
    }
    for (int e = 0; e < n; ++e) ctx[e] += std::max(1, acc[e]);
  }
  // Steps 15, 20 and 25 are probe steps (dense); around them the policy in force shows.
  EXPECT_LT(kept_total[16], kept_total[14]) << "a higher target keeps fewer blocks at once";
  EXPECT_LT(kept_total[26], kept_total[24]) << "the last layer's 0.9 budget applies at once";
  t.ExpectSameArena("after graph replays");
  auto err = ReadDeviceError(t.dview());
  ASSERT_TRUE(err.ok());
  EXPECT_EQ(*err, 0u);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The deferred EMA across a capture boundary (CudaDataPlaneOptions::defer_ema): layer 0
// observed eagerly leaves its EMA pending; an Observe captured then is refused (joining eager
// work inside a capture would cross its boundary) and changes nothing, and the capture still
// ends; the eager Observes of layers 1 and 2 then join it and their own (the last layer's at
// once), and the arena equals the CPU's after the same calls. (A whole step captured with the
// option: GraphReplayMatchesEagerReference.)
TEST_F(CudaTest, DeferredEmaAcrossACaptureBoundary) {
  Geometry g = TwoSequences();
  g.layers = 3;
  CudaDataPlaneOptions options;
  options.defer_ema = true;
  Twin t(g, Policy{}, 4, 0, options);
  for (int s = 0; s < 2; ++s) t.Reset(s, 31 + s);
  const int32_t seq[2] = {0, 1}, ctx[2] = {400, 230}, qp[2] = {399, 229};
  const DevStep step(seq, ctx, qp);
  const int64_t stride = static_cast<int64_t>(t.cpu().view().max_blocks) * g.block_size;
  std::vector<std::vector<float>> logits(g.layers);
  std::vector<std::unique_ptr<DevBuf>> d_logits;
  for (uint32_t l = 0; l < g.layers; ++l) {
    logits[l].resize(2 * stride);
    for (size_t i = 0; i < logits[l].size(); ++i) {
      logits[l][i] = Score(static_cast<int>(i / stride), static_cast<int>(l), 0, 0,
                           static_cast<int>(i % stride), 1000);
    }
    d_logits.push_back(std::make_unique<DevBuf>(logits[l].size() * 4));
    CUDA_OK(
        cudaMemcpy(d_logits[l]->p, logits[l].data(), logits[l].size() * 4, cudaMemcpyHostToDevice));
  }
  DataPlane& c = t.cpu().dp();
  ASSERT_TRUE(c.BeginStep(StepBatch{seq, ctx, qp, 2, 1}).ok());
  for (uint32_t l = 0; l < g.layers; ++l) {
    ASSERT_TRUE(c.Select(static_cast<int32_t>(l)).ok());
    ASSERT_TRUE(c.Observe(static_cast<int32_t>(l), logits[l].data(), stride).ok());
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ASSERT_TRUE(t.gpu().BeginStep(step.batch(), stream).ok());
  ASSERT_TRUE(t.gpu().Select(0, nullptr, 0, stream).ok());
  ASSERT_TRUE(t.gpu().Observe(0, d_logits[0]->as<float>(), stride, nullptr, stream).ok());
  ASSERT_TRUE(t.gpu().Select(1, nullptr, 0, stream).ok());
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status refused =
      t.gpu().Observe(1, d_logits[1]->as<float>(), stride, nullptr, stream);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  CUDA_OK(cudaGraphDestroy(graph));
  ASSERT_TRUE(t.gpu().Observe(1, d_logits[1]->as<float>(), stride, nullptr, stream).ok());
  ASSERT_TRUE(t.gpu().Select(2, nullptr, 0, stream).ok());
  ASSERT_TRUE(t.gpu().Observe(2, d_logits[2]->as<float>(), stride, nullptr, stream).ok());
  CUDA_OK(cudaStreamSynchronize(stream));
  t.ExpectSameArena("after the refused capture and the eager layers");
  cudaStreamDestroy(stream);
}

TEST_F(CudaTest, GraphReplayMatchesEagerReference) {
  GraphReplayScenario(false);
  GraphReplayScenario(true);
  GraphReplayScenario(true, true);
}

// The device narrows bf16 state with the hardware conversion (numerics.h); the host with the
// integer definition. Parity of bf16 state rests on their agreeing for every float.
TEST(CudaNumerics, DeviceBf16NarrowingEqualsTheReferenceForEveryFloat) {
  SPIN_REQUIRE_GPU_OR_SKIP();
  uint64_t mismatches = 0;
  uint32_t first = 0;
  ASSERT_EQ(CountBf16Mismatches(&mismatches, &first), cudaSuccess);
  EXPECT_EQ(mismatches, 0u) << "first differing input bits 0x" << std::hex << first;
}

}  // namespace
}  // namespace spin::testing
