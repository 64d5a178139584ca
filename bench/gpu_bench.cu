// SPIN on the GPU, measured side by side in one process under CUDA graphs:
//   floor   - time to stream the dense indexer's bytes (132 B/slot) at the read bandwidth
//             measured in this run;
//   dense   - the reference paged indexer over every block;
//   spin    - SPIN's own per-step work (BeginStep + per layer Select + Observe);
//   sparse  - the sparse stage: SPIN + the indexer over SPIN's compacted table.
// Inputs rotate over several "layers" (separate KV caches and state) so that every timed pass
// reads more than the 60 MB L2. Prints a Markdown table (and writes it to --out FILE).
#include <cuda_runtime.h>

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

struct Point {
  int batch, slots;
  double rho;
  StateDtype dtype;
};

struct Result {
  Point p;
  int layers;
  double floor_us, dense_us, spin_us, sparse_us, select_us, kept;
};

// Measures one point; times are per layer.
Result Measure(const Point& pt, double read_bw, int tiles, cudaStream_t stream, int reps) {
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
  for (int e = 0; e < B; ++e) seq[e] = e;
  int32_t *d_seq, *d_ctx, *d_q;
  CHECK_CUDA(cudaMalloc(&d_seq, B * 4));
  CHECK_CUDA(cudaMalloc(&d_ctx, B * 4));
  CHECK_CUDA(cudaMalloc(&d_q, B * 4));
  CHECK_CUDA(cudaMemcpy(d_seq, seq.data(), B * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_ctx, ctx.data(), B * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_q, qp.data(), B * 4, cudaMemcpyHostToDevice));

  Geometry g;
  g.layers = static_cast<uint32_t>(L);
  g.max_seqs = static_cast<uint32_t>(B);
  g.max_slots = static_cast<uint32_t>(N);
  g.block_size = kPageSlots;
  g.topk = 2048;
  g.dtype = pt.dtype;
  Policy pol;
  pol.target_sparsity = pt.rho;
  pol.exploration = 0.05;
  const uint64_t bytes = ArenaBytes(g);
  void* arena = nullptr;
  CHECK_CUDA(cudaMalloc(&arena, bytes));
  auto view = InitDeviceArena(arena, bytes, g, 1, pol, stream);
  CHECK_OK(view.status());
  auto dpr = MakeCudaDataPlane(*view);
  CHECK_OK(dpr.status());
  DataPlane& dp = **dpr;
  for (int e = 0; e < B; ++e) CHECK_OK(dp.ResetSequence(e, 100 + e, stream));

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
  dense.stages = tiles;
  PagedIndexerArgs sparse = dense;
  sparse.table = view->phys;
  sparse.table_stride = view->max_blocks;
  sparse.lens = view->compact_len;
  sparse.lens_stride = g.max_rows;
  const StepBatch batch{d_seq, d_ctx, d_q, B, 1};
  auto layer_table = [&](int l) { return d_table + static_cast<size_t>(l) * B * P; };
  auto sparse_step = [&] {
    CHECK_OK(dp.BeginStep(batch, stream));
    for (int l = 0; l < L; ++l) {
      CHECK_OK(dp.Select(l, layer_table(l), P, stream));
      CHECK_OK(LaunchPagedIndexer(sparse, stream));
      CHECK_OK(dp.Observe(l, logits, N, nullptr, stream));
    }
  };
  // Warm-up: the first step is dense (fresh state), later ones select.
  for (int i = 0; i < 3; ++i) sparse_step();
  CHECK_CUDA(cudaStreamSynchronize(stream));

  cudaGraphExec_t g_dense = Capture(stream, [&] {
    for (int l = 0; l < L; ++l) {
      PagedIndexerArgs a = dense;
      a.table = layer_table(l);
      CHECK_OK(LaunchPagedIndexer(a, stream));
    }
  });
  cudaGraphExec_t g_spin = Capture(stream, [&] {
    CHECK_OK(dp.BeginStep(batch, stream));
    for (int l = 0; l < L; ++l) {
      CHECK_OK(dp.Select(l, layer_table(l), P, stream));
      CHECK_OK(dp.Observe(l, logits, N, nullptr, stream));
    }
  });
  cudaGraphExec_t g_sparse = Capture(stream, sparse_step);
  cudaGraphExec_t g_select = Capture(stream, [&] {
    CHECK_OK(dp.BeginStep(batch, stream));
    for (int l = 0; l < L; ++l) CHECK_OK(dp.Select(l, layer_table(l), P, stream));
  });

  Result r;
  r.p = pt;
  r.layers = L;
  r.floor_us = kv_layer / read_bw * 1e6;
  r.dense_us = MedianGraphMs(g_dense, stream, reps) * 1e3 / L;
  r.spin_us = MedianGraphMs(g_spin, stream, reps) * 1e3 / L;
  r.sparse_us = MedianGraphMs(g_sparse, stream, reps) * 1e3 / L;
  r.select_us = MedianGraphMs(g_select, stream, reps) * 1e3 / L;
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
  for (cudaGraphExec_t e : {g_dense, g_spin, g_sparse, g_select}) cudaGraphExecDestroy(e);
  dpr->reset();
  for (void* p : {static_cast<void*>(kv), static_cast<void*>(d_table), static_cast<void*>(q),
                  static_cast<void*>(w), static_cast<void*>(logits), static_cast<void*>(d_seq),
                  static_cast<void*>(d_ctx), static_cast<void*>(d_q), arena}) {
    CHECK_CUDA(cudaFree(p));
  }
  return r;
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

}  // namespace
}  // namespace spin

int main(int argc, char** argv) {
  using namespace spin;
  std::string out_path;
  bool quick = false;
  int pb = 0, pn = 0;
  double prho = 0.5;
  char pdt[8] = "bf16";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out_path = argv[++i];
    } else if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--point") && i + 1 < argc &&
               std::sscanf(argv[i + 1], "%d,%d,%lf,%4s", &pb, &pn, &prho, pdt) == 4) {
      ++i;
    } else {
      std::fprintf(stderr,
                   "usage: gpu_bench [--out FILE] [--quick] [--point BATCH,SLOTS,RHO,fp32|bf16]\n"
                   "Times the dense reference indexer, SPIN and the sparse stage on the GPU.\n"
                   "--point measures one configuration (for profilers).\n");
      return 2;
    }
  }
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
    const Result r = Measure({pb, pn, prho, dt}, 4.5e12, 8, stream, 3);
    std::printf("point: dense %.1f us, spin %.1f us (select %.1f), sparse %.1f us per layer\n",
                r.dense_us, r.spin_us, r.select_us, r.sparse_us);
    return 0;
  }
  const double bw = MeasureReadBandwidth(stream);
  std::string md;
  char line[512];
  std::snprintf(line, sizeof(line),
                "Device: %s (%d SMs). Read-stream bandwidth measured in this run: %.0f GB/s.\n\n",
                prop.name, prop.multiProcessorCount, bw / 1e9);
  md += line;
  // Indexer variant: loads in flight per warp.
  int best_tiles = 8;
  double best = 1e30;
  md += "Indexer variants (batch 64, 128K slots, dense, us per layer): ";
  for (int tiles : {4, 8, 12}) {
    const Result r = Measure({64, 128 << 10, 0.5, StateDtype::kBf16}, bw, tiles, stream, reps);
    std::snprintf(line, sizeof(line), "%d stages %.1f; ", tiles, r.dense_us);
    md += line;
    if (r.dense_us < best) {
      best = r.dense_us;
      best_tiles = tiles;
    }
  }
  std::snprintf(line, sizeof(line), "using %d.\n\n", best_tiles);
  md += line;
  std::fprintf(stderr, "%s", md.c_str());
  md +=
      "| batch | slots | sparsity | state | layers rotated | floor us | dense us | dense/floor BW "
      "| "
      "SPIN us (select + observe) | SPIN/dense | sparse stage us | sparse/dense | kept |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  std::vector<int> batches = {1, 16, 64, 128}, slots = {32 << 10, 128 << 10, 256 << 10};
  if (quick) {
    batches = {1, 64};
    slots = {128 << 10};
  }
  for (int b : batches) {
    for (int n : slots) {
      for (double rho : {0.3, 0.5}) {
        for (StateDtype dt : {StateDtype::kFp32, StateDtype::kBf16}) {
          const Result r = Measure({b, n, rho, dt}, bw, best_tiles, stream, reps);
          std::snprintf(line, sizeof(line),
                        "| %d | %dK | %.1f | %s | %d | %.1f | %.1f | %.2f | %.1f (%.1f + %.1f) | "
                        "%.3f | %.1f | %.3f | %.3f |\n",
                        b, n >> 10, rho, dt == StateDtype::kFp32 ? "fp32" : "bf16", r.layers,
                        r.floor_us, r.dense_us, r.floor_us / r.dense_us, r.spin_us, r.select_us,
                        r.spin_us - r.select_us, r.spin_us / r.dense_us, r.sparse_us,
                        r.sparse_us / r.dense_us, r.kept);
          md += line;
          std::fprintf(stderr, "%s", line);
        }
      }
    }
  }
  std::printf("%s", md.c_str());
  if (!out_path.empty()) std::ofstream(out_path) << md;
  return 0;
}
