// SPIN on the GPU, measured side by side in one process under CUDA graphs:
//   floor   - time to stream the dense indexer's bytes (132 B/slot) at the read bandwidth
//             measured in this run;
//   dense   - the reference paged indexer over every block, both kernels (mma.sync, wgmma):
//             the wgmma logits are checked against mma.sync's, and the faster kernel that
//             agrees is the one the sparse stage uses;
//   spin    - SPIN's own per-step work over a model step of kModelLayers layers (one BeginStep,
//             then Select + Observe per layer), per layer;
//   sparse  - the sparse stage: SPIN + the indexer over SPIN's compacted table.
// The indexer's KV caches rotate over several "layers" so that every timed pass reads more than
// the 60 MB L2; SPIN keeps state for kModelLayers layers (layer l reads KV layer l mod L), as
// a model step does, so its state does not stay in L2 either and BeginStep is paid once per
// step rather than once per layer. Prints a Markdown table (and writes it to --out FILE).
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "spin/cuda_data_plane.h"
#include "spin/data_plane_setup.h"
#include "spin/paged_indexer.h"

namespace spin {
namespace {

#define CHECK_CUDA(x)                                                                         \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define CHECK_OK(x)                                                  \
  do {                                                               \
    absl::Status s_ = (x);                                           \
    if (!s_.ok()) {                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, \
                   std::string(s_.message()).c_str());               \
      std::exit(1);                                                  \
    }                                                                \
  } while (0)

__global__ void ReadStream(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads alive
}

__global__ void FillRandom(uint8_t* p, size_t n, uint32_t seed, int fp8) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    // fp8: a finite e4m3 value with a moderate exponent; otherwise raw bytes.
    p[i] = fp8 ? static_cast<uint8_t>((h & 0x87u) | ((3u + (h >> 8) % 7u) << 3))
               : static_cast<uint8_t>(h);
  }
}

__global__ void FillScales(uint8_t* kv, size_t pages) {
  for (size_t x = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       x < pages * kPageSlots; x += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float* s =
        reinterpret_cast<float*>(kv + (x / kPageSlots) * kPageBytes + kPageSlots * kIndexerDim);
    s[x % kPageSlots] = 0.5f + static_cast<float>((x * 7919) % 1000) / 1000.0f;
  }
}

// 16-byte global load and store that the compiler keeps (the traffic kernel below writes back
// what it read, which it would otherwise drop).
__device__ __forceinline__ uint4 Load16(const void* p) {
  uint4 x;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
               : "l"(p));
  return x;
}
__device__ __forceinline__ void Store16(void* p, uint4 x) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(x.x), "r"(x.y), "r"(x.z),
               "r"(x.w)
               : "memory");
}

// The engine's top-K kernel as far as the step's graph sees it: a kernel writing the top-K
// buffer (here a copy of a fixed top-K), so the remap after it follows a kernel as in an engine,
// not a memcpy node.
__global__ void WriteTopKKernel(const int32_t* from, int32_t* to, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    to[i] = from[i];
  }
}

// The EMA's memory traffic and nothing else, for layer `layer` after a step: for every
// compacted block of every entry's row 0 (entry e is sequence e here), its logits read and its
// V entries and the aligned 16-byte words covering its D range read and written back unchanged,
// eight lanes a block as in the EMA, every load of a lane issued before its first store. Its
// time is what the EMA's bytes cost in the EMA's access pattern, with no arithmetic.
template <int kStateBytes>
__global__ void EmaTrafficKernel(const float* logits, int64_t stride, const int32_t* ids,
                                 int max_blocks, const int32_t* lens, int max_rows,
                                 const int32_t* qpos, uint8_t* state, uint64_t record_bytes,
                                 int layers, int layer, int max_slots, uint32_t* sink) {
  constexpr int kChunk = 16 / kStateBytes;            // entries per 16-byte word
  constexpr int kVWords = 8 / kChunk;                 // a lane's eight V entries
  constexpr int kDWords = (64 / kChunk + 1 + 7) / 8;  // a lane's share of <= 9 or 17 D words
  const int e = static_cast<int>(blockIdx.y);
  const int len = lens[static_cast<int64_t>(e) * max_rows];
  const int sg = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 8),
            s8 = threadIdx.x % 8;
  if (sg * 64 >= len) return;
  const int j = ids[static_cast<int64_t>(e) * max_blocks + sg], q = qpos[e];
  const int cnt = min(64, len - sg * 64), base = j * 64, t0 = 8 * s8;
  uint8_t* rec = state + (static_cast<uint64_t>(e) * layers + layer) * record_bytes;
  uint8_t* v = rec + static_cast<int64_t>(base + t0) * kStateBytes;
  uint8_t* dd = rec + static_cast<int64_t>(max_slots) * kStateBytes;
  const float* z = logits + static_cast<int64_t>(e) * stride + sg * 64 + t0;
  uint4 zw[2], vw[kVWords], dw[kDWords];
  const bool has_z = t0 + 8 <= cnt, has_v = t0 < cnt;
  const int jhi = q - base, jlo = max(0, jhi - (cnt - 1));
  const int cb = jlo - jlo % kChunk, nch = jhi >= 0 ? (jhi - cb) / kChunk + 1 : 0;
  if (has_z) {
    zw[0] = Load16(z);
    zw[1] = Load16(z + 4);
  }
  if (has_v) {
#pragma unroll
    for (int w = 0; w < kVWords; ++w) vw[w] = Load16(v + 16 * w);
  }
#pragma unroll
  for (int w = 0; w < kDWords; ++w) {
    if (s8 + 8 * w < nch)
      dw[w] = Load16(dd + static_cast<int64_t>(cb + (s8 + 8 * w) * kChunk) * kStateBytes);
  }
  if (has_v) {
#pragma unroll
    for (int w = 0; w < kVWords; ++w) Store16(v + 16 * w, vw[w]);
  }
#pragma unroll
  for (int w = 0; w < kDWords; ++w) {
    if (s8 + 8 * w < nch)
      Store16(dd + static_cast<int64_t>(cb + (s8 + 8 * w) * kChunk) * kStateBytes, dw[w]);
  }
  if (has_z && (zw[0].x ^ zw[1].w) == 0x9E3779B9u) *sink = zw[0].y;  // keeps the logits' loads
}

float MedianGraphMs(cudaGraphExec_t exec, cudaStream_t stream, int reps) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(a, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <typename F>
cudaGraphExec_t Capture(cudaStream_t stream, F&& body) {
  cudaGraph_t g;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  body();
  CHECK_CUDA(cudaStreamEndCapture(stream, &g));
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, g, 0));
  CHECK_CUDA(cudaGraphDestroy(g));
  return exec;
}

// Graphs timed in interleaved rounds: each round times every graph once (MedianGraphMs), and
// each result is the median over the rounds, in microseconds per `per` (layers). Slow drifts of
// the GPU (clocks, power) then fall on every graph alike instead of on the one timed last.
struct Timed {
  cudaGraphExec_t exec;
  double* out;
  double per;
};
void TimeInterleaved(const std::vector<Timed>& timed, cudaStream_t stream, int reps, int rounds) {
  std::vector<std::vector<double>> v(timed.size());
  for (int k = 0; k < rounds; ++k) {
    for (size_t i = 0; i < timed.size(); ++i) {
      v[i].push_back(MedianGraphMs(timed[i].exec, stream, reps) * 1e3 / timed[i].per);
    }
  }
  for (size_t i = 0; i < timed.size(); ++i) {
    std::sort(v[i].begin(), v[i].end());
    *timed[i].out = v[i][v[i].size() / 2];
  }
}

enum Contexts { kFull = 0, kMixed = 1, kRagged = 2 };

struct Point {
  int batch, slots;
  double rho;
  StateDtype dtype;
  uint32_t probe_period = 0;  // 0: no probe steps; 1: every step probes every sequence
  // Contexts: kFull, every entry `slots`; kMixed, spread over the batch: entry e has
  // slots * (B - e) / B (at least one page), as in a batch of sequences at different lengths;
  // kRagged, entry e has slots - (7 e mod 64), so the queries fall at every place of an
  // eight-slot chunk (q % 8 takes every value over eight entries), as they do in decoding.
  int contexts = 0;
};

struct Result {
  Point p;
  int layers;
  double floor_us, spin_us, sparse_us, select_us, kept;
  double begin_us = 0;    // BeginStep alone, per step (spin_us includes it / kModelLayers)
  double traffic_us = 0;  // EmaTrafficKernel per layer: the EMA's bytes in its access pattern
  double mma_us = 0, wg_us = 0;  // dense, each kernel (0: not measured)
  double dense_us = 0;           // dense, the kernel used for the sparse stage
  IndexerKernel used = IndexerKernel::kMmaSync;
  bool wg_ok = false;  // wgmma ran and agreed with mma.sync
  double wg_dev = 0;   // worst |wgmma - mma.sync| over the row's largest |logit|
  // The fused mode (Plan::fused, wgmma only), per layer: the fused sparse stage (BeginStep,
  // Select, IndexAndObserve), and the same step with the plain sparse indexer and no Observe;
  // plain_us - select_us is the indexer's own part, fused_us minus that is SPIN's.
  double fused_us = 0, plain_us = 0;
  double FusedSpin() const { return fused_us - (plain_us - select_us); }
  // The one-call fused mode (SelectIndexAndObserve in place of Select + IndexAndObserve), rows
  // as chunks for max_pages (one_us) and spread over their CTAs (one_spread_us), and the plain
  // step with the spread indexer (plain_spread_us): each SPIN share against the indexer with
  // the same chunking.
  double one_us = 0, one_spread_us = 0, plain_spread_us = 0;
  double OneSpin() const { return one_us - (plain_us - select_us); }
  double OneSpreadSpin() const { return one_spread_us - (plain_spread_us - select_us); }
  // The same with programmatic launches of the indexer (PagedIndexerArgs::programmatic): the
  // one-call spread step, the plain spread step, and the dense indexer.
  double one_pdl_us = 0, plain_pdl_us = 0, dense_pdl_us = 0;
  double OnePdlSpin() const { return one_pdl_us - (plain_pdl_us - select_us); }
  // The unfused step with Observe's Probe launch before the EMA on the caller's stream
  // (CudaDataPlaneOptions::probe_beside_ema = false) instead of beside it.
  double spin_seq_us = 0;
  // The step as an engine runs it with the top-K remapped: each layer writes a fixed top-K into
  // the engine's buffer (WriteTopKKernel; copy_us: those kernels alone), then Remap (the probe's
  // top-K computed from the logits) or RemapTopK (the engine's top-K counted at the remap), unfused
  // and one call (spread, PDL; with RemapTopK, FusedIndexerArgs::probe_at_remap: no Probe launch).
  double copy_us = 0, remap_us = 0, remap_topk_us = 0, one_remap_us = 0, one_topk_us = 0;
  double remap_joint_us = 0;  // unfused, RemapAndObserve (the remap inside the Probe launch)
  // The same with the engine's table given at BeginStep (StepBatch::block_table): each Observe
  // publishes the next layer's selection and that Select launches nothing. Timed after the
  // other graphs, interleaved with RemapAndObserve's graph alone (remap_joint_pair_us): among
  // the others its replays raised the RemapAndObserve and one-call columns by 3-11 us at
  // 64 x 128K (docs/lab/cuda-backend-history.md, "The benchmark's table graph").
  double remap_ahead_us = 0, remap_joint_pair_us = 0;
  // The table-at-BeginStep step again with the EMA deferred (CudaDataPlaneOptions::defer_ema:
  // each layer's EMA on the data plane's second stream, joined by the next layer's Observe; the
  // layers' logits in two buffers taken in turn), timed with the pair above.
  double remap_defer_us = 0;
  double RemapSpin(double step_us) const { return step_us - copy_us - (plain_us - select_us); }
  double OneRemapSpin(double step_us) const {
    return step_us - copy_us - (plain_pdl_us - select_us);
  }
};

// wgmma accumulates fp8 products with fewer bits than fp32; a wrong layout gives differences
// of the order of the logits themselves.
constexpr double kAgreeLimit = 1e-2;

// Which kernels to time (stages; 0: not timed) and whether to time SPIN and the sparse stage.
struct Plan {
  int mma_stages = 8;
  int wg_stages = 7;
  bool full = true;
  bool fused = false;  // also time the fused mode (when the sparse stage runs wgmma)
  int rounds = 1;      // interleaved rounds of the step graphs (TimeInterleaved)
};

// DeepSeek-V3.2's layer count: SPIN's graphs cover one whole decode step of this many layers.
constexpr int kModelLayers = 61;

// Measures one point; times are per layer.
Result Measure(const Point& pt, double read_bw, const Plan& plan, cudaStream_t stream, int reps) {
  const int B = pt.batch, N = pt.slots, P = N / kPageSlots;
  const double kv_layer = static_cast<double>(B) * N * kSlotBytes;
  const int L = std::clamp(static_cast<int>(std::ceil(240e6 / kv_layer)), 1, 48);
  uint8_t* kv = nullptr;
  const size_t pages = static_cast<size_t>(L) * B * P;
  CHECK_CUDA(cudaMalloc(&kv, pages * kPageBytes));
  FillRandom<<<4096, 256, 0, stream>>>(kv, pages * kPageBytes, 17, 1);
  FillScales<<<4096, 256, 0, stream>>>(kv, pages);
  std::vector<int32_t> table(static_cast<size_t>(L) * B * P);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
  int32_t* d_table = nullptr;
  CHECK_CUDA(cudaMalloc(&d_table, table.size() * 4));
  CHECK_CUDA(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  uint8_t* q = nullptr;
  float* w = nullptr;
  CHECK_CUDA(cudaMalloc(&q, static_cast<size_t>(B) * kIndexerHeads * kIndexerDim));
  CHECK_CUDA(cudaMalloc(&w, static_cast<size_t>(B) * kIndexerHeads * 4));
  FillRandom<<<256, 256, 0, stream>>>(q, static_cast<size_t>(B) * kIndexerHeads * kIndexerDim, 5,
                                      1);
  std::vector<float> hw(static_cast<size_t>(B) * kIndexerHeads);
  for (size_t i = 0; i < hw.size(); ++i) hw[i] = (static_cast<float>(i % 17) - 8.0f) / 64.0f;
  CHECK_CUDA(cudaMemcpy(w, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
  float* logits = nullptr;
  CHECK_CUDA(cudaMalloc(&logits, static_cast<size_t>(B) * N * 4));
  std::vector<int32_t> seq(B), ctx(B, N), qp(B, N - 1);
  for (int e = 0; e < B; ++e) {
    seq[e] = e;
    if (pt.contexts == kMixed) {
      ctx[e] = std::max<int32_t>(kPageSlots, static_cast<int32_t>(int64_t{N} * (B - e) / B));
    } else if (pt.contexts == kRagged) {
      ctx[e] = N - (7 * e) % 64;
    }
    qp[e] = ctx[e] - 1;
  }
  int32_t *d_seq, *d_ctx, *d_q;
  CHECK_CUDA(cudaMalloc(&d_seq, B * 4));
  CHECK_CUDA(cudaMalloc(&d_ctx, B * 4));
  CHECK_CUDA(cudaMalloc(&d_q, B * 4));
  CHECK_CUDA(cudaMemcpy(d_seq, seq.data(), B * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_ctx, ctx.data(), B * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_q, qp.data(), B * 4, cudaMemcpyHostToDevice));

  Geometry g;
  const int Ls = kModelLayers;  // SPIN state layers; layer l uses KV layer l % L
  g.layers = static_cast<uint32_t>(Ls);
  g.max_seqs = static_cast<uint32_t>(B);
  g.max_slots = static_cast<uint32_t>(N);
  g.block_size = kPageSlots;
  g.topk = 2048;
  g.dtype = pt.dtype;
  DataPlaneSpec spec;
  spec.geometry = g;
  spec.seed = 1;
  spec.policy.target_sparsity = pt.rho;
  spec.policy.exploration = 0.05;
  spec.policy.probe_period = pt.probe_period;
  spec.on_device = true;
  auto dpr = NewDataPlane(spec);
  CHECK_OK(dpr.status());
  DataPlane& dp = **dpr;
  const ArenaView* view = &dp.arena();
  for (int e = 0; e < B; ++e) CHECK_OK(dp.ResetSequence(e, 100 + e, stream));
  // With a probe period P > 1, sequence e starts e mod P steps in, so each step has about B / P
  // probing sequences (as sequences that joined the batch at different times would).
  if (pt.probe_period > 1) {
    CHECK_CUDA(cudaStreamSynchronize(stream));
    for (int e = 0; e < B; ++e) {
      const uint64_t steps = static_cast<uint64_t>(e % pt.probe_period);
      CHECK_CUDA(cudaMemcpy(&view->seqs[e].steps, &steps, sizeof(steps), cudaMemcpyHostToDevice));
    }
  }

  PagedIndexerArgs dense;
  dense.q = q;
  dense.weights = w;
  dense.kv = kv;
  dense.table_stride = P;
  dense.lens = d_ctx;
  dense.lens_stride = 1;
  dense.logits = logits;
  dense.logits_stride = N;
  dense.batch = B;
  dense.max_pages = P;
  dense.table = d_table;

  auto layer_table = [&](int l) { return d_table + static_cast<size_t>(l) * B * P; };
  Result r;
  r.p = pt;
  r.layers = L;
  r.floor_us = kv_layer / read_bw * 1e6;
  // The dense indexer over every KV layer of the point, one graph.
  auto dense_args = [&](IndexerKernel k, int stages, bool pdl) {
    PagedIndexerArgs base = dense;
    base.kernel = k;
    base.stages = stages;
    base.programmatic = pdl;
    return base;
  };
  auto dense_graph = [&](const PagedIndexerArgs& base) {
    return Capture(stream, [&] {
      for (int l = 0; l < L; ++l) {
        PagedIndexerArgs a = base;
        a.table = layer_table(l);
        CHECK_OK(LaunchPagedIndexer(a, stream));
      }
    });
  };
  // Dense, each kernel; the last layer's logits of each are compared.
  std::vector<float> mma_out, wg_out;
  auto time_dense = [&](IndexerKernel k, int stages, std::vector<float>* out, bool pdl = false) {
    const PagedIndexerArgs base = dense_args(k, stages, pdl);
    const absl::Status probe = LaunchPagedIndexer(base, stream);
    if (!probe.ok()) {
      std::fprintf(stderr, "%s indexer unavailable: %s\n", IndexerKernelName(k),
                   std::string(probe.message()).c_str());
      return 0.0;
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaGraphExec_t exec = dense_graph(base);
    const double us = MedianGraphMs(exec, stream, reps) * 1e3 / L;
    CHECK_CUDA(cudaStreamSynchronize(stream));
    out->resize(static_cast<size_t>(B) * N);
    CHECK_CUDA(cudaMemcpy(out->data(), logits, out->size() * 4, cudaMemcpyDeviceToHost));
    cudaGraphExecDestroy(exec);
    return us;
  };
  if (plan.mma_stages > 0)
    r.mma_us = time_dense(IndexerKernel::kMmaSync, plan.mma_stages, &mma_out);
  if (plan.wg_stages > 0) r.wg_us = time_dense(IndexerKernel::kWgmma, plan.wg_stages, &wg_out);
  if (plan.wg_stages > 0 && plan.fused) {
    std::vector<float> pdl_out;
    r.dense_pdl_us = time_dense(IndexerKernel::kWgmma, plan.wg_stages, &pdl_out, true);
    if (pdl_out != wg_out) {
      std::fprintf(stderr, "the programmatic launch changed the dense logits\n");
      std::exit(1);
    }
  }
  if (r.wg_us > 0 && r.mma_us > 0) {
    double dev = 0;
    for (int b = 0; b < B; ++b) {
      double top = 0, diff = 0;
      for (int s = 0; s < N; ++s) {
        const size_t i = static_cast<size_t>(b) * N + s;
        top = std::max(top, std::fabs(static_cast<double>(mma_out[i])));
        const double d = std::fabs(static_cast<double>(mma_out[i]) - wg_out[i]);
        diff = std::isnan(d) ? 1e30 : std::max(diff, d);
      }
      dev = std::max(dev, diff / std::max(top, 1e-30));
    }
    r.wg_dev = dev;
    r.wg_ok = dev <= kAgreeLimit;
  } else {
    r.wg_ok = r.wg_us > 0;  // nothing to compare against: timed alone
  }
  int sparse_stages = plan.mma_stages;
  if (r.wg_ok && (r.mma_us <= 0 || r.wg_us < r.mma_us)) {
    r.used = IndexerKernel::kWgmma;
    r.dense_us = r.wg_us;
    sparse_stages = plan.wg_stages;
  } else {
    r.used = IndexerKernel::kMmaSync;
    r.dense_us = r.mma_us;
  }
  PagedIndexerArgs sparse = dense;
  sparse.kernel = r.used;
  sparse.stages = sparse_stages;
  sparse.table = view->phys;
  sparse.table_stride = view->max_blocks;
  sparse.lens = view->compact_len;
  sparse.lens_stride = g.max_rows;
  const StepBatch batch{d_seq, d_ctx, d_q, B, 1};
  auto sparse_step = [&] {
    CHECK_OK(dp.BeginStep(batch, stream));
    for (int l = 0; l < Ls; ++l) {
      CHECK_OK(dp.Select(l, layer_table(l % L), P, stream));
      CHECK_OK(LaunchPagedIndexer(sparse, stream));
      CHECK_OK(dp.Observe(l, logits, N, nullptr, stream));
    }
  };
  auto release = [&] {
    dpr->reset();
    for (void* p : {static_cast<void*>(kv), static_cast<void*>(d_table), static_cast<void*>(q),
                    static_cast<void*>(w), static_cast<void*>(logits), static_cast<void*>(d_seq),
                    static_cast<void*>(d_ctx), static_cast<void*>(d_q)}) {
      CHECK_CUDA(cudaFree(p));
    }
  };
  if (!plan.full || r.dense_us <= 0) {
    r.spin_us = r.sparse_us = r.select_us = r.kept = 0;
    release();
    return r;
  }
  // Warm-up: the first step is dense (fresh state), later ones select.
  for (int i = 0; i < 3; ++i) sparse_step();
  CHECK_CUDA(cudaStreamSynchronize(stream));

  cudaGraphExec_t g_spin = Capture(stream, [&] {
    CHECK_OK(dp.BeginStep(batch, stream));
    for (int l = 0; l < Ls; ++l) {
      CHECK_OK(dp.Select(l, layer_table(l % L), P, stream));
      CHECK_OK(dp.Observe(l, logits, N, nullptr, stream));
    }
  });
  cudaGraphExec_t g_sparse = Capture(stream, sparse_step);
  cudaGraphExec_t g_select = Capture(stream, [&] {
    CHECK_OK(dp.BeginStep(batch, stream));
    for (int l = 0; l < Ls; ++l) CHECK_OK(dp.Select(l, layer_table(l % L), P, stream));
  });
  // BeginStep alone (it advances the step counters, so it runs after the timed step graphs'
  // warm-up like any step).
  cudaGraphExec_t g_begin = Capture(stream, [&] { CHECK_OK(dp.BeginStep(batch, stream)); });

  int32_t *topk_fixed = nullptr, *topk_buf = nullptr;  // the fused plan's top-K buffers
  std::vector<Timed> timed;  // the fused plan's graphs, timed with the step's below
  std::vector<cudaGraphExec_t> fused_graphs;  // destroyed after
  std::unique_ptr<DataPlane> seq_plane;       // the fused plan's second data plane
  std::unique_ptr<DataPlane> defer_plane;     // and its third (the EMA deferred)
  float* logits_odd = nullptr;                // the odd layers' logits in the deferred step
  cudaGraphExec_t g_remap_defer = nullptr;
  // The table-at-BeginStep graph and RemapAndObserve's, timed as a pair after the others.
  cudaGraphExec_t g_remap_ahead = nullptr, g_pair_joint = nullptr;
  if (plan.fused && r.used == IndexerKernel::kWgmma) {
    FusedIndexerArgs fa;
    fa.q = q;
    fa.weights = w;
    fa.kv = kv;
    fa.logits = logits;
    fa.logits_stride = N;
    fa.stages = sparse_stages;
    fa.spread = false;  // the two-call and one-call columns: chunks for max_pages, ordinary launch
    fa.programmatic = false;
    auto fused_step = [&] {
      CHECK_OK(dp.BeginStep(batch, stream));
      for (int l = 0; l < Ls; ++l) {
        CHECK_OK(dp.Select(l, layer_table(l % L), P, stream));
        CHECK_OK(IndexAndObserve(dp, l, fa, stream));
      }
    };
    fused_step();
    CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaGraphExec_t g_fused = Capture(stream, fused_step);
    cudaGraphExec_t g_plain = Capture(stream, [&] {
      CHECK_OK(dp.BeginStep(batch, stream));
      for (int l = 0; l < Ls; ++l) {
        CHECK_OK(dp.Select(l, layer_table(l % L), P, stream));
        CHECK_OK(LaunchPagedIndexer(sparse, stream));
      }
    });
    // One call per layer (the kernel publishes the selection), chunked for max_pages or spread.
    auto one_step = [&](bool spread, bool pdl = false) {
      FusedIndexerArgs f1 = fa;
      f1.spread = spread;
      f1.programmatic = pdl;
      CHECK_OK(dp.BeginStep(batch, stream));
      for (int l = 0; l < Ls; ++l) {
        CHECK_OK(SelectIndexAndObserve(dp, l, layer_table(l % L), P, f1, stream));
      }
    };
    one_step(false);
    one_step(true);
    one_step(true, true);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaGraphExec_t g_one = Capture(stream, [&] { one_step(false); });
    cudaGraphExec_t g_one_spread = Capture(stream, [&] { one_step(true); });
    cudaGraphExec_t g_one_pdl = Capture(stream, [&] { one_step(true, true); });
    auto plain_step = [&](bool pdl) {
      PagedIndexerArgs spread = sparse;
      spread.spread = true;
      spread.programmatic = pdl;
      CHECK_OK(dp.BeginStep(batch, stream));
      for (int l = 0; l < Ls; ++l) {
        CHECK_OK(dp.Select(l, layer_table(l % L), P, stream));
        CHECK_OK(LaunchPagedIndexer(spread, stream));
      }
    };
    cudaGraphExec_t g_plain_spread = Capture(stream, [&] { plain_step(false); });
    cudaGraphExec_t g_plain_pdl = Capture(stream, [&] { plain_step(true); });
    // The dense indexer again, ordinary and programmatic launches, in the same rounds.
    cudaGraphExec_t g_dense = dense_graph(dense_args(IndexerKernel::kWgmma, plan.wg_stages, false));
    cudaGraphExec_t g_dense_pdl =
        dense_graph(dense_args(IndexerKernel::kWgmma, plan.wg_stages, true));
    // A second data plane over the same arena whose Observe runs Probe before the EMA.
    CudaDataPlaneOptions seq_options;
    seq_options.probe_beside_ema = false;
    auto seq_dp = MakeCudaDataPlane(*view, seq_options);
    CHECK_OK(seq_dp.status());
    cudaGraphExec_t g_spin_seq = Capture(stream, [&] {
      CHECK_OK((*seq_dp)->BeginStep(batch, stream));
      for (int l = 0; l < Ls; ++l) {
        CHECK_OK((*seq_dp)->Select(l, layer_table(l % L), P, stream));
        CHECK_OK((*seq_dp)->Observe(l, logits, N, nullptr, stream));
      }
    });
    seq_plane = std::move(*seq_dp);
    // The engine's top-K per layer: a fixed one (row 0 of each entry: K distinct compacted
    // indices below a quarter of the context, inside every compacted row here) copied into the
    // buffer that Remap maps in place, then Remap or RemapTopK.
    const size_t topk_n = static_cast<size_t>(B) * g.topk;
    std::vector<int32_t> fixed(topk_n);
    for (size_t x = 0; x < topk_n; ++x) {
      fixed[x] = static_cast<int32_t>(((x % g.topk) * 97) % static_cast<size_t>(N / 4));
    }
    CHECK_CUDA(cudaMalloc(&topk_fixed, topk_n * 4));
    CHECK_CUDA(cudaMalloc(&topk_buf, topk_n * 4));
    CHECK_CUDA(cudaMemcpy(topk_fixed, fixed.data(), topk_n * 4, cudaMemcpyHostToDevice));
    const int32_t K = static_cast<int32_t>(g.topk);
    auto copy_topk = [&] {
      const unsigned blocks = static_cast<unsigned>(std::min<size_t>((topk_n + 255) / 256, 1024));
      WriteTopKKernel<<<blocks, 256, 0, stream>>>(topk_fixed, topk_buf,
                                                  static_cast<int64_t>(topk_n));
      CHECK_CUDA(cudaGetLastError());
    };
    // With `ahead`, as vLLM runs it: one block table for every layer (given at BeginStep), each
    // layer's indexer over its own KV cache. Layer l's pages are layer 0's ids offset by
    // l * B * P (the identity table above), so its indexer gets layer 0's ids and a KV base
    // moved by that many pages: it reads the same bytes as the other graphs' layer l. (Reading
    // layer 0's KV at every layer, as this graph did before, let the indexer run from L2 at
    // small batches: docs/lab/cuda-backend-history.md, "The benchmark's table graph".)
    // `plane`: dp, or the deferred-EMA data plane below, whose step gives the layers two logits
    // buffers in turn (a layer's logits stay unwritten until the next layer's Observe).
    auto remap_step = [&](bool given, bool joint = false, bool ahead = false,
                          DataPlane* plane = nullptr) {
      DataPlane& p = plane ? *plane : dp;
      StepBatch b = batch;
      if (ahead) b.block_table = layer_table(0), b.table_stride = P;  // one table, every layer
      CHECK_OK(p.BeginStep(b, stream));
      for (int l = 0; l < Ls; ++l) {
        PagedIndexerArgs s = sparse;
        if (plane && l % 2) s.logits = logits_odd;
        if (ahead) {
          CHECK_OK(p.Select(l, nullptr, 0, stream));
          s.kv = kv + static_cast<size_t>(l % L) * B * P * kPageBytes;
        } else {
          CHECK_OK(p.Select(l, layer_table(l % L), P, stream));
        }
        CHECK_OK(LaunchPagedIndexer(s, stream));
        copy_topk();
        if (joint) {
          CHECK_OK(p.RemapAndObserve(l, topk_buf, K, s.logits, N, nullptr, stream));
          continue;
        }
        CHECK_OK(given ? p.RemapTopK(topk_buf, K, stream) : p.Remap(topk_buf, K, stream));
        CHECK_OK(p.Observe(l, s.logits, N, nullptr, stream));
      }
    };
    auto one_remap_step = [&](bool given) {
      FusedIndexerArgs f1 = fa;
      f1.spread = true;
      f1.programmatic = true;
      f1.probe_at_remap = given;
      CHECK_OK(dp.BeginStep(batch, stream));
      for (int l = 0; l < Ls; ++l) {
        CHECK_OK(SelectIndexAndObserve(dp, l, layer_table(l % L), P, f1, stream));
        copy_topk();
        CHECK_OK(given ? dp.RemapTopK(topk_buf, K, stream) : dp.Remap(topk_buf, K, stream));
      }
    };
    // vLLM's path (the table at BeginStep, RemapAndObserve) with the EMA deferred, on a third
    // data plane over the same arena (remap_step with it).
    CudaDataPlaneOptions defer_options;
    defer_options.defer_ema = true;
    auto defer_dp = MakeCudaDataPlane(*view, defer_options);
    CHECK_OK(defer_dp.status());
    defer_plane = std::move(*defer_dp);
    CHECK_CUDA(cudaMalloc(&logits_odd, static_cast<size_t>(B) * N * 4));
    for (bool given : {false, true}) remap_step(given), one_remap_step(given);
    remap_step(true, true);
    remap_step(true, true, true, defer_plane.get());
    CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaGraphExec_t g_copy = Capture(stream, [&] {
      for (int l = 0; l < Ls; ++l) copy_topk();
    });
    cudaGraphExec_t g_remap = Capture(stream, [&] { remap_step(false); });
    cudaGraphExec_t g_remap_topk = Capture(stream, [&] { remap_step(true); });
    cudaGraphExec_t g_remap_joint = Capture(stream, [&] { remap_step(true, true); });
    g_remap_ahead = Capture(stream, [&] { remap_step(true, true, true); });  // timed apart
    g_remap_defer =
        Capture(stream, [&] { remap_step(true, true, true, defer_plane.get()); });  // with it
    g_pair_joint = g_remap_joint;
    cudaGraphExec_t g_one_remap = Capture(stream, [&] { one_remap_step(false); });
    cudaGraphExec_t g_one_topk = Capture(stream, [&] { one_remap_step(true); });
    fused_graphs = {g_fused,       g_plain,       g_one,        g_one_spread, g_plain_spread,
                    g_one_pdl,     g_plain_pdl,   g_dense,      g_dense_pdl,  g_spin_seq,
                    g_copy,        g_remap,       g_remap_topk, g_one_remap,  g_one_topk,
                    g_remap_joint, g_remap_ahead, g_remap_defer};
    timed = {{g_fused, &r.fused_us, double(Ls)},
             {g_plain, &r.plain_us, double(Ls)},
             {g_one, &r.one_us, double(Ls)},
             {g_one_spread, &r.one_spread_us, double(Ls)},
             {g_plain_spread, &r.plain_spread_us, double(Ls)},
             {g_one_pdl, &r.one_pdl_us, double(Ls)},
             {g_plain_pdl, &r.plain_pdl_us, double(Ls)},
             {g_dense, &r.dense_us, double(L)},
             {g_dense_pdl, &r.dense_pdl_us, double(L)},
             {g_spin_seq, &r.spin_seq_us, double(Ls)},
             {g_copy, &r.copy_us, double(Ls)},
             {g_remap, &r.remap_us, double(Ls)},
             {g_remap_topk, &r.remap_topk_us, double(Ls)},
             {g_one_remap, &r.one_remap_us, double(Ls)},
             {g_one_topk, &r.one_topk_us, double(Ls)},
             {g_remap_joint, &r.remap_joint_us, double(Ls)}};
    // One eager layer of each over the same compacted table, in NVTX ranges for profilers
    // (ncu --nvtx --nvtx-include sparse-plain/ or fused/): the plain indexer, then the fused mode
    // (two calls, chunks for max_pages).
    CHECK_OK(dp.BeginStep(batch, stream));
    CHECK_OK(dp.Select(0, layer_table(0), P, stream));
    nvtxRangePushA("sparse-plain");
    CHECK_OK(LaunchPagedIndexer(sparse, stream));
    nvtxRangePop();
    nvtxRangePushA("fused");
    CHECK_OK(IndexAndObserve(dp, 0, fa, stream));
    nvtxRangePop();
    // The same two over layer 1's table with each row's pages spread over its CTAs
    // (sparse-plain-spread/, fused-spread/).
    CHECK_OK(dp.Select(1, layer_table(1 % L), P, stream));
    PagedIndexerArgs sparse_spread = sparse;
    sparse_spread.spread = true;
    nvtxRangePushA("sparse-plain-spread");
    CHECK_OK(LaunchPagedIndexer(sparse_spread, stream));
    nvtxRangePop();
    FusedIndexerArgs fs = fa;
    fs.spread = true;
    nvtxRangePushA("fused-spread");
    CHECK_OK(IndexAndObserve(dp, 1, fs, stream));
    nvtxRangePop();
    CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  timed.push_back({g_spin, &r.spin_us, double(Ls)});
  timed.push_back({g_sparse, &r.sparse_us, double(Ls)});
  timed.push_back({g_select, &r.select_us, double(Ls)});
  timed.push_back({g_begin, &r.begin_us, 1.0});
  TimeInterleaved(timed, stream, reps, plan.rounds);
  if (g_remap_ahead != nullptr) {
    TimeInterleaved({{g_pair_joint, &r.remap_joint_pair_us, double(Ls)},
                     {g_remap_ahead, &r.remap_ahead_us, double(Ls)},
                     {g_remap_defer, &r.remap_defer_us, double(Ls)}},
                    stream, reps, plan.rounds);
  }
  for (cudaGraphExec_t e : fused_graphs) cudaGraphExecDestroy(e);
  seq_plane.reset();
  defer_plane.reset();
  CHECK_CUDA(cudaFree(logits_odd));
  CHECK_CUDA(cudaFree(topk_fixed));
  CHECK_CUDA(cudaFree(topk_buf));
  // The EMA's bytes alone, per layer (each layer its own state), over the last Select's union.
  {
    uint32_t* sink = nullptr;
    CHECK_CUDA(cudaMalloc(&sink, 4));
    const dim3 grid((view->max_blocks * 8 + 255) / 256, static_cast<unsigned>(B));
    auto* traffic = g.dtype == StateDtype::kFp32 ? EmaTrafficKernel<4> : EmaTrafficKernel<2>;
    cudaGraphExec_t g_traffic = Capture(stream, [&] {
      for (int l = 0; l < Ls; ++l) {
        traffic<<<grid, 256, 0, stream>>>(logits, N, view->union_ids,
                                          static_cast<int>(view->max_blocks), view->compact_len,
                                          static_cast<int>(g.max_rows), d_q, view->state,
                                          view->StateRecordBytes(), Ls, l, N, sink);
      }
    });
    r.traffic_us = MedianGraphMs(g_traffic, stream, reps) * 1e3 / Ls;
    cudaGraphExecDestroy(g_traffic);
    CHECK_CUDA(cudaFree(sink));
  }
  std::vector<int32_t> count(B);
  CHECK_CUDA(cudaMemcpy(count.data(), view->union_count, B * 4, cudaMemcpyDeviceToHost));
  double kept = 0;
  for (int c : count) kept += c;
  r.kept = kept / B / P;
  auto err = ReadDeviceError(*view);
  CHECK_OK(err.status());
  if (*err != 0) {
    std::fprintf(stderr, "arena error %u at batch %d slots %d\n", *err, B, N);
    std::exit(1);
  }
  for (cudaGraphExec_t e : {g_spin, g_sparse, g_select, g_begin}) cudaGraphExecDestroy(e);
  release();
  return r;
}

// The fused mode's table (gpu_bench --fused): per point, in one Measure, the dense wgmma
// indexer, the unfused sparse stage (the indexer over SPIN's table, then Observe) and the fused
// one (IndexAndObserve), with SPIN's part of each.
int FusedTable(double bw, bool wgmma_runs, const std::string& out_path, bool quick,
               cudaStream_t stream, int reps, std::string md) {
  if (!wgmma_runs) {
    std::fprintf(stderr, "gpu_bench --fused: the wgmma indexer does not run here\n");
    return 3;
  }
  Plan plan;
  plan.mma_stages = 0;
  plan.wg_stages = 5;
  plan.fused = true;
  plan.rounds = 5;
  md +=
      "Fused mode against unfused, side by side in each row (wgmma indexer, 5 pages in flight; "
      "us per layer of a 61-layer step under CUDA graphs). Unfused: Select, the indexer over "
      "SPIN's compacted table, then Observe (Probe beside the EMA; in the column 'Probe before "
      "the EMA', a data plane with CudaDataPlaneOptions::probe_beside_ema = false). Fused: Select, "
      "then IndexAndObserve "
      "(the indexer with the row-0 EMA beside it, then Probe). One call: SelectIndexAndObserve "
      "(the same kernel also publishes the selection; Select launches nothing), its rows chunked "
      "for max_pages or spread over their CTAs (PagedIndexerArgs::spread). SPIN = the sparse "
      "stage less the plain sparse indexer's own time (a step of BeginStep + Select + indexer, "
      "less BeginStep + Select), the indexer chunked the same way. Contexts: full (every entry "
      "SLOTS), ragged (entry e SLOTS - (7 e mod 64)); probe period 8 staggered. PDL: the "
      "same one-call spread step with programmatic launches of the indexer "
      "(PagedIndexerArgs::programmatic), against the plain spread indexer launched so, and the "
      "dense indexer launched so (dense PDL us; every ratio is against the ordinary dense "
      "launch). Every graph of a row is timed in 5 interleaved rounds (each the median of its "
      "replays) and the median round is given; the first row is measured once before, and that "
      "result dropped, while the GPU's clocks settle.\n\n"
      "| batch | slots | sparsity | state | contexts | probe period | dense us | "
      "unfused SPIN us | unfused SPIN/dense | unfused sparse/dense | unfused SPIN/dense, Probe "
      "before the EMA | fused SPIN us | "
      "fused SPIN/dense | fused sparse/dense | one call SPIN/dense | one call sparse/dense | "
      "one call spread SPIN/dense | one call spread sparse/dense | PDL SPIN/dense | "
      "PDL sparse/dense | dense PDL us | indexer over SPIN's table us | the same, spread us | "
      "the same, spread, PDL us | BeginStep us per step | select part us |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
      "---|---|---|---|\n";
  std::vector<Point> points = {
      {64, 128 << 10, 0.5, StateDtype::kBf16, 0, kFull},
      {64, 128 << 10, 0.5, StateDtype::kBf16, 0, kRagged},
      {64, 128 << 10, 0.5, StateDtype::kFp32, 0, kRagged},
      {64, 128 << 10, 0.3, StateDtype::kBf16, 0, kRagged},
      {64, 128 << 10, 0.5, StateDtype::kBf16, 8, kRagged},
      {1, 128 << 10, 0.5, StateDtype::kBf16, 0, kRagged},
      {16, 128 << 10, 0.5, StateDtype::kBf16, 0, kRagged},
      {128, 128 << 10, 0.5, StateDtype::kBf16, 0, kRagged},
      {64, 32 << 10, 0.5, StateDtype::kBf16, 0, kRagged},
      {64, 256 << 10, 0.5, StateDtype::kBf16, 0, kRagged},
      {16, 256 << 10, 0.5, StateDtype::kBf16, 8, kRagged},
  };
  if (quick) points.resize(2);
  // The second table: the probe's top-K computed from the logits (Remap) or the engine's given
  // to RemapTopK, with the top-K remapped as an engine does.
  std::string md2 =
      "\nThe probe's top-K from the engine (RemapTopK), same run: each layer of these steps also "
      "writes a fixed top-K (K per entry) into the engine's buffer with a copy kernel (the "
      "engine's "
      "top-K kernel's stand-in) and remaps it, with Remap (the "
      "probe's dense top-K computed from the logits by Observe's Probe launch, or the fused "
      "call's) or with RemapTopK (the engine's top-K counted at the remap; Observe computes none, "
      "and the one call, FusedIndexerArgs::probe_at_remap, launches no Probe); unfused, "
      "RemapAndObserve: RemapTopK and Observe in one call, the remap inside Observe's Probe "
      "launch; with the table at BeginStep: the same, the engine's block table given to BeginStep "
      "(StepBatch::block_table; one table for every layer), so each Observe publishes the next "
      "layer's selection and that Select launches nothing (its graph is timed after the others, "
      "interleaved with RemapAndObserve's graph and the next: among them its replays raised "
      "other columns); EMA deferred: the same on a data plane with "
      "CudaDataPlaneOptions::defer_ema, each layer's EMA on a second stream joined by the next "
      "layer's Observe (the layers' logits in two buffers taken in turn). SPIN = the step "
      "less the copy kernels alone (copy us, per layer) less the plain sparse indexer's own time; "
      "one "
      "call: spread, programmatic launches, against the plain indexer launched so.\n\n"
      "| batch | slots | sparsity | state | contexts | probe period | dense us | copy us | "
      "unfused + Remap SPIN/dense | unfused + RemapTopK SPIN/dense | unfused + RemapTopK "
      "sparse/dense | unfused, RemapAndObserve SPIN/dense | unfused, RemapAndObserve "
      "sparse/dense | unfused, RemapAndObserve timed with the next column SPIN/dense | unfused, "
      "RemapAndObserve, table at BeginStep SPIN/dense | unfused, "
      "RemapAndObserve, table at BeginStep sparse/dense | the same, EMA deferred SPIN/dense | "
      "the same, EMA deferred sparse/dense | one call + Remap SPIN/dense | one call + "
      "RemapTopK SPIN/dense | one call + RemapTopK sparse/dense |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  char line[512];
  Measure(points[0], bw, plan, stream, reps);  // dropped: the clocks settle
  for (const Point& pt : points) {
    const Result r = Measure(pt, bw, plan, stream, reps);
    const double idx = r.plain_us - r.select_us;
    std::snprintf(
        line, sizeof(line),
        "| %d | %dK | %.1f | %s | %s | %u | %.1f | %.1f | %.3f | %.3f | %.3f | %.1f | %.3f | "
        "%.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.1f | %.1f | %.1f | %.1f | "
        "%.1f | %.1f |\n",
        pt.batch, pt.slots >> 10, pt.rho, pt.dtype == StateDtype::kFp32 ? "fp32" : "bf16",
        pt.contexts == kRagged  ? "ragged"
        : pt.contexts == kMixed ? "mixed"
                                : "full",
        pt.probe_period, r.dense_us, r.spin_us, r.spin_us / r.dense_us, r.sparse_us / r.dense_us,
        r.spin_seq_us / r.dense_us, r.FusedSpin(), r.FusedSpin() / r.dense_us,
        r.fused_us / r.dense_us, r.OneSpin() / r.dense_us, r.one_us / r.dense_us,
        r.OneSpreadSpin() / r.dense_us, r.one_spread_us / r.dense_us, r.OnePdlSpin() / r.dense_us,
        r.one_pdl_us / r.dense_us, r.dense_pdl_us, idx, r.plain_spread_us - r.select_us,
        r.plain_pdl_us - r.select_us, r.begin_us, r.select_us);
    md += line;
    std::fprintf(stderr, "%s", line);
    std::snprintf(
        line, sizeof(line),
        "| %d | %dK | %.1f | %s | %s | %u | %.1f | %.1f | %.3f | %.3f | %.3f | %.3f | "
        "%.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n",
        pt.batch, pt.slots >> 10, pt.rho, pt.dtype == StateDtype::kFp32 ? "fp32" : "bf16",
        pt.contexts == kRagged  ? "ragged"
        : pt.contexts == kMixed ? "mixed"
                                : "full",
        pt.probe_period, r.dense_us, r.copy_us, r.RemapSpin(r.remap_us) / r.dense_us,
        r.RemapSpin(r.remap_topk_us) / r.dense_us, (r.remap_topk_us - r.copy_us) / r.dense_us,
        r.RemapSpin(r.remap_joint_us) / r.dense_us, (r.remap_joint_us - r.copy_us) / r.dense_us,
        r.RemapSpin(r.remap_joint_pair_us) / r.dense_us, r.RemapSpin(r.remap_ahead_us) / r.dense_us,
        (r.remap_ahead_us - r.copy_us) / r.dense_us, r.RemapSpin(r.remap_defer_us) / r.dense_us,
        (r.remap_defer_us - r.copy_us) / r.dense_us, r.OneRemapSpin(r.one_remap_us) / r.dense_us,
        r.OneRemapSpin(r.one_topk_us) / r.dense_us, (r.one_topk_us - r.copy_us) / r.dense_us);
    md2 += line;
    std::fprintf(stderr, "%s", line);
  }
  md += md2;
  std::printf("%s", md.c_str());
  if (!out_path.empty()) std::ofstream(out_path) << md;
  return 0;
}

double MeasureReadBandwidth(cudaStream_t stream) {
  const size_t bytes = size_t{4} << 30;
  uint4* buf = nullptr;
  uint32_t* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&buf, bytes));
  CHECK_CUDA(cudaMalloc(&sink, 4));
  FillRandom<<<4096, 256, 0, stream>>>(reinterpret_cast<uint8_t*>(buf), bytes, 3, 0);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaGraphExec_t exec =
      Capture(stream, [&] { ReadStream<<<sms * 8, 512, 0, stream>>>(buf, bytes / 16, sink); });
  const float ms = MedianGraphMs(exec, stream, 20);
  cudaGraphExecDestroy(exec);
  CHECK_CUDA(cudaFree(buf));
  CHECK_CUDA(cudaFree(sink));
  return bytes / (ms * 1e-3);
}

// Runs the wgmma kernel once on a small problem in a child process (before this process
// touches CUDA), so that a kernel that faults costs its own numbers, not the whole run.
bool WgmmaPreflight() {
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    if (!CudaAvailable()) _exit(1);
    constexpr int kPages = 3;
    uint8_t *kv = nullptr, *q = nullptr;
    float *w = nullptr, *logits = nullptr;
    int32_t *table = nullptr, *lens = nullptr;
    if (cudaMalloc(&kv, kPages * kPageBytes) != cudaSuccess ||
        cudaMalloc(&q, kIndexerHeads * kIndexerDim) != cudaSuccess ||
        cudaMalloc(&w, kIndexerHeads * 4) != cudaSuccess ||
        cudaMalloc(&logits, kPages * kPageSlots * 4) != cudaSuccess ||
        cudaMalloc(&table, kPages * 4) != cudaSuccess || cudaMalloc(&lens, 4) != cudaSuccess) {
      _exit(1);
    }
    FillRandom<<<64, 256>>>(kv, kPages * kPageBytes, 9, 1);
    FillScales<<<1, 256>>>(kv, kPages);
    FillRandom<<<64, 256>>>(q, kIndexerHeads * kIndexerDim, 10, 1);
    const std::vector<int32_t> t = {2, 0, 1};
    const int32_t len = kPages * kPageSlots - 3;
    std::vector<float> hw(kIndexerHeads, 0.25f);
    if (cudaMemcpy(table, t.data(), kPages * 4, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(lens, &len, 4, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(w, hw.data(), kIndexerHeads * 4, cudaMemcpyHostToDevice) != cudaSuccess) {
      _exit(1);
    }
    PagedIndexerArgs a;
    a.q = q;
    a.weights = w;
    a.kv = kv;
    a.table = table;
    a.table_stride = kPages;
    a.lens = lens;
    a.lens_stride = 1;
    a.logits = logits;
    a.logits_stride = kPages * kPageSlots;
    a.batch = 1;
    a.max_pages = kPages;
    a.kernel = IndexerKernel::kWgmma;
    if (!LaunchPagedIndexer(a, nullptr).ok()) _exit(1);
    _exit(cudaDeviceSynchronize() == cudaSuccess ? 0 : 1);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace
}  // namespace spin

int main(int argc, char** argv) {
  using namespace spin;
  std::string out_path;
  bool quick = false, fused_table = false;
  int pb = 0, pn = 0;
  double prho = 0.5;
  char pdt[8] = "bf16";
  unsigned pprobe = 0;
  int pmixed = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--fused")) {
      fused_table = true;
    } else if (!std::strcmp(argv[i], "--point") && i + 1 < argc &&
               std::sscanf(argv[i + 1], "%d,%d,%lf,%4[^,],%u,%d", &pb, &pn, &prho, pdt, &pprobe,
                           &pmixed) >= 4 &&
               pmixed >= kFull && pmixed <= kRagged) {
      ++i;
    } else {
      std::fprintf(stderr,
                   "usage: gpu_bench [--out FILE] [--quick] [--fused] "
                   "[--point BATCH,SLOTS,RHO,fp32|bf16[,PROBE_PERIOD[,MIXED]]]\n"
                   "Times the dense reference indexer, SPIN and the sparse stage on the GPU.\n"
                   "--fused times only the fused-mode table: unfused and fused side by side\n"
                   "(with --point: that point, the fused mode too, 5 pages in flight).\n"
                   "--point measures one configuration (for profilers); PROBE_PERIOD 1 makes\n"
                   "every step a probe step of every sequence (default 0: none); with a period\n"
                   "P > 1 sequence e starts e mod P steps in, so each step has about BATCH / P\n"
                   "probing sequences. MIXED 1 spreads the contexts: entry e has\n"
                   "SLOTS * (BATCH - e) / BATCH; MIXED 2 gives entry e SLOTS - (7 e mod 64)\n"
                   "(ragged: the queries at every place of an 8-slot chunk).\n");
      return 2;
    }
  }
  const bool wgmma_runs = WgmmaPreflight();
  if (!wgmma_runs) std::fprintf(stderr, "gpu_bench: the wgmma indexer failed its preflight\n");
  if (!CudaAvailable()) {
    std::fprintf(stderr, "gpu_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int reps = quick ? 5 : 15;
  if (pb > 0) {
    const StateDtype dt = std::strcmp(pdt, "fp32") == 0 ? StateDtype::kFp32 : StateDtype::kBf16;
    Plan point_plan;
    if (!wgmma_runs) point_plan.wg_stages = 0;
    point_plan.fused = fused_table;
    if (fused_table) point_plan.wg_stages = 5, point_plan.rounds = 5;  // as the fused table
    const Result r = Measure({pb, pn, prho, dt, pprobe, pmixed}, 4.5e12, point_plan, stream, 3);
    std::printf(
        "point: dense mma.sync %.1f us, wgmma %.1f us (%s, worst deviation %.2g of the row "
        "max), sparse stage on %s; spin %.1f us (select %.1f), sparse %.1f us per layer of a "
        "%d-layer step (probe period %u); BeginStep (with every layer's selection) %.1f us per "
        "step; the EMA's bytes alone %.1f us per layer\n",
        r.mma_us, r.wg_us, r.wg_ok ? "agrees" : "DISAGREES or unavailable", r.wg_dev,
        IndexerKernelName(r.used), r.spin_us, r.select_us, r.sparse_us, kModelLayers, pprobe,
        r.begin_us, r.traffic_us);
    if (fused_table) {
      std::printf("point, fused mode: fused sparse stage %.1f us, SPIN %.1f us per layer\n",
                  r.fused_us, r.FusedSpin());
      std::printf(
          "point, top-K remapped (us per layer): copies %.1f; unfused + Remap %.1f, + RemapTopK "
          "%.1f, RemapAndObserve %.1f (SPIN %.1f, %.1f, %.1f); one call + Remap %.1f, + "
          "RemapTopK %.1f (SPIN %.1f, %.1f); dense %.1f\n",
          r.copy_us, r.remap_us, r.remap_topk_us, r.remap_joint_us, r.RemapSpin(r.remap_us),
          r.RemapSpin(r.remap_topk_us), r.RemapSpin(r.remap_joint_us), r.one_remap_us,
          r.one_topk_us, r.OneRemapSpin(r.one_remap_us), r.OneRemapSpin(r.one_topk_us), r.dense_us);
      std::printf(
          "point, table at BeginStep (us per layer, the three graphs timed together after the "
          "others): RemapAndObserve %.1f -> with the table at BeginStep %.1f -> and the EMA "
          "deferred %.1f (SPIN %.1f -> %.1f -> %.1f; SPIN/dense %.3f -> %.3f -> %.3f; sparse "
          "stage/dense, the copies left out, %.3f -> %.3f)\n",
          r.remap_joint_pair_us, r.remap_ahead_us, r.remap_defer_us,
          r.RemapSpin(r.remap_joint_pair_us), r.RemapSpin(r.remap_ahead_us),
          r.RemapSpin(r.remap_defer_us), r.RemapSpin(r.remap_joint_pair_us) / r.dense_us,
          r.RemapSpin(r.remap_ahead_us) / r.dense_us, r.RemapSpin(r.remap_defer_us) / r.dense_us,
          (r.remap_ahead_us - r.copy_us) / r.dense_us, (r.remap_defer_us - r.copy_us) / r.dense_us);
    }
    return r.wg_ok ? 0 : 3;
  }
  const double bw = MeasureReadBandwidth(stream);
  std::string md;
  char line[512];
  std::snprintf(line, sizeof(line),
                "Device: %s (%d SMs). Read-stream bandwidth measured in this run: %.0f GB/s.\n\n",
                prop.name, prop.multiProcessorCount, bw / 1e9);
  md += line;
  // Loads in flight for each kernel: 8-slot tiles per warp (mma.sync), pages per CTA (wgmma).
  Plan plan;
  if (!wgmma_runs) {
    plan.wg_stages = 0;
    md +=
        "The wgmma indexer FAILED its preflight (a fault or an unsupported device): mma.sync "
        "only.\n\n";
  }
  if (fused_table) return FusedTable(bw, wgmma_runs, out_path, quick, stream, reps, md);
  const Point sweep_at{64, 128 << 10, 0.5, StateDtype::kBf16};
  md += "Indexer variants (batch 64, 128K slots, dense, us per layer): mma.sync ";
  double best = 1e30;
  for (int tiles : {4, 8, 12}) {
    const Result r = Measure(sweep_at, bw, Plan{tiles, 0, false}, stream, reps);
    std::snprintf(line, sizeof(line), "%d stages %.1f; ", tiles, r.mma_us);
    md += line;
    if (r.mma_us > 0 && r.mma_us < best) best = r.mma_us, plan.mma_stages = tiles;
  }
  md += "wgmma ";
  best = 1e30;
  for (int stages : {4, 5, 7}) {
    if (!wgmma_runs) break;
    const Result r = Measure(sweep_at, bw, Plan{plan.mma_stages, stages, false}, stream, reps);
    std::snprintf(line, sizeof(line), "%d pages %.1f (%s, deviation %.2g); ", stages, r.wg_us,
                  r.wg_ok ? "agrees" : "FAILED", r.wg_dev);
    md += line;
    if (r.wg_ok && r.wg_us > 0 && r.wg_us < best) best = r.wg_us, plan.wg_stages = stages;
  }
  std::snprintf(line, sizeof(line),
                "using mma.sync %d, wgmma %d. Per point, the sparse stage runs the faster dense "
                "kernel whose logits agree with mma.sync's (worst |difference| at most %.0e of "
                "the row's largest |logit|).\n\n",
                plan.mma_stages, plan.wg_stages, kAgreeLimit);
  md += line;
  std::fprintf(stderr, "%s", md.c_str());
  md +=
      "| batch | slots | sparsity | state | KV layers rotated | floor us | dense mma.sync us | "
      "dense wgmma us (deviation) | indexer used | dense us | dense/floor BW | "
      "SPIN us (select + observe) | SPIN/dense | sparse stage us | sparse/dense | kept | "
      "BeginStep us per step (every layer's selection) |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  std::vector<int> batches = {1, 16, 64, 128}, slots = {32 << 10, 128 << 10, 256 << 10};
  if (quick) {
    batches = {1, 64};
    slots = {128 << 10};
  }
  bool wg_failed = false;
  // Each table row: `line` (just formatted for r) into the table and onto stderr as progress.
  auto emit = [&](const Result& r) {
    if (!r.wg_ok) wg_failed = true;
    md += line;
    std::fprintf(stderr, "%s", line);
  };
  for (int b : batches) {
    for (int n : slots) {
      for (double rho : {0.3, 0.5}) {
        for (StateDtype dt : {StateDtype::kFp32, StateDtype::kBf16}) {
          const Result r = Measure({b, n, rho, dt}, bw, plan, stream, reps);
          std::snprintf(line, sizeof(line),
                        "| %d | %dK | %.1f | %s | %d | %.1f | %.1f | %.1f (%.1e%s) | %s | %.1f | "
                        "%.2f | %.1f (%.1f + %.1f) | %.3f | %.1f | %.3f | %.3f | %.1f |\n",
                        b, n >> 10, rho, dt == StateDtype::kFp32 ? "fp32" : "bf16", r.layers,
                        r.floor_us, r.mma_us, r.wg_us, r.wg_dev, r.wg_ok ? "" : " FAILED",
                        IndexerKernelName(r.used), r.dense_us, r.floor_us / r.dense_us, r.spin_us,
                        r.select_us, r.spin_us - r.select_us, r.spin_us / r.dense_us, r.sparse_us,
                        r.sparse_us / r.dense_us, r.kept, r.begin_us);
          emit(r);
        }
      }
    }
  }
  // Probe steps (the table above has none): every step a probe step of every sequence (period
  // 1), and period 8 with the sequences' probe steps spread over steps (about batch / 8 probing
  // at each step, as in a batch whose sequences joined at different times).
  md +=
      "\nProbe steps, 50% sparsity, bf16 state: period 1 makes every step a probe step of every "
      "sequence; period 8 starts sequence e e mod 8 steps in, so about batch / 8 sequences probe "
      "at each step. A probing sequence's selection is dense and its Observe takes row 0's dense "
      "top-K and miss curve.\n\n"
      "| batch | slots | probe period | dense us | SPIN us (select + observe) | SPIN/dense | "
      "sparse stage us | sparse/dense |\n"
      "|---|---|---|---|---|---|---|---|\n";
  struct ProbePoint {
    int b, n;
    uint32_t period;
  };
  const std::vector<ProbePoint> probe_points =
      quick ? std::vector<ProbePoint>{{1, 128 << 10, 1}, {64, 128 << 10, 1}, {64, 128 << 10, 8}}
            : std::vector<ProbePoint>{{1, 128 << 10, 1},  {1, 256 << 10, 1},  {16, 128 << 10, 1},
                                      {16, 256 << 10, 1}, {64, 128 << 10, 1}, {64, 256 << 10, 1},
                                      {16, 128 << 10, 8}, {64, 128 << 10, 8}, {64, 256 << 10, 8},
                                      {128, 128 << 10, 8}};
  for (const ProbePoint& pp : probe_points) {
    const Result r =
        Measure({pp.b, pp.n, 0.5, StateDtype::kBf16, pp.period}, bw, plan, stream, reps);
    std::snprintf(
        line, sizeof(line), "| %d | %dK | %u | %.1f | %.1f (%.1f + %.1f) | %.3f | %.1f | %.3f |\n",
        pp.b, pp.n >> 10, pp.period, r.dense_us, r.spin_us, r.select_us, r.spin_us - r.select_us,
        r.spin_us / r.dense_us, r.sparse_us, r.sparse_us / r.dense_us);
    emit(r);
  }
  // Mixed contexts (the tables above give every entry the same context).
  md +=
      "\nMixed contexts, 50% sparsity, bf16 state, no probe steps: entry e of a batch of B has "
      "slots * (B - e) / B slots (at least 64), so the batch holds about half the slots of the "
      "rows above.\n\n"
      "| batch | slots (longest) | dense us | SPIN us (select + observe) | SPIN/dense | "
      "sparse stage us | sparse/dense |\n"
      "|---|---|---|---|---|---|---|\n";
  const std::vector<std::pair<int, int>> mixed_points =
      quick ? std::vector<std::pair<int, int>>{{64, 128 << 10}}
            : std::vector<std::pair<int, int>>{{16, 128 << 10}, {64, 128 << 10}, {128, 256 << 10}};
  for (const auto& [mb, mn] : mixed_points) {
    const Result r = Measure({mb, mn, 0.5, StateDtype::kBf16, 0, kMixed}, bw, plan, stream, reps);
    std::snprintf(line, sizeof(line),
                  "| %d | %dK | %.1f | %.1f (%.1f + %.1f) | %.3f | %.1f | %.3f |\n", mb, mn >> 10,
                  r.dense_us, r.spin_us, r.select_us, r.spin_us - r.select_us,
                  r.spin_us / r.dense_us, r.sparse_us, r.sparse_us / r.dense_us);
    emit(r);
  }
  // Ragged contexts: the tables above give every query the same place in its eight-slot chunk
  // (slots - 1 = 7 mod 8), the EMA's best case; in decoding a query moves by one slot a step.
  md +=
      "\nRagged contexts, no probe steps: entry e has slots - (7 e mod 64) slots, so the "
      "queries take every place of an eight-slot D chunk (in the tables above every query is "
      "at slots - 1, the last place of one). \"EMA bytes alone\" is a kernel that moves exactly "
      "the EMA's bytes in the EMA's access pattern (each compacted block's logits read, its V "
      "entries and the 16-byte words covering its D range read and written back unchanged, eight "
      "lanes a block) and does nothing else, per layer as Observe is; against the observe part "
      "it shows how much of the EMA is its memory traffic.\n\n"
      "| batch | slots | sparsity | state | dense us | SPIN us (select + observe) | SPIN/dense | "
      "sparse stage us | sparse/dense | EMA bytes alone us |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n";
  struct RaggedPoint {
    int b, n;
    double rho;
    StateDtype dt;
  };
  const std::vector<RaggedPoint> ragged_points =
      quick ? std::vector<RaggedPoint>{{64, 128 << 10, 0.5, StateDtype::kBf16}}
            : std::vector<RaggedPoint>{{16, 128 << 10, 0.5, StateDtype::kBf16},
                                       {64, 128 << 10, 0.5, StateDtype::kBf16},
                                       {64, 128 << 10, 0.5, StateDtype::kFp32},
                                       {64, 128 << 10, 0.3, StateDtype::kBf16},
                                       {128, 256 << 10, 0.5, StateDtype::kBf16}};
  for (const RaggedPoint& rp : ragged_points) {
    const Result r = Measure({rp.b, rp.n, rp.rho, rp.dt, 0, kRagged}, bw, plan, stream, reps);
    std::snprintf(
        line, sizeof(line),
        "| %d | %dK | %.1f | %s | %.1f | %.1f (%.1f + %.1f) | %.3f | %.1f | %.3f | %.1f |\n", rp.b,
        rp.n >> 10, rp.rho, rp.dt == StateDtype::kFp32 ? "fp32" : "bf16", r.dense_us, r.spin_us,
        r.select_us, r.spin_us - r.select_us, r.spin_us / r.dense_us, r.sparse_us,
        r.sparse_us / r.dense_us, r.traffic_us);
    emit(r);
  }
  if (wg_failed) md += "\nwgmma FAILED (disagreed with mma.sync or did not run) at some points.\n";
  std::printf("%s", md.c_str());
  if (!out_path.empty()) std::ofstream(out_path) << md;
  return wg_failed ? 3 : 0;
}
