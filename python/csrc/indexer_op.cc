// torch.ops.spind.paged_indexer: the reference fp8 paged indexer (kernels/include/spin/
// paged_indexer.h) as a torch op, for the DSA decode engine (python/spind/dsa_engine.py) and
// its tests and benchmark; and torch.ops.spind.row_topk, the engine's top-k over each row's
// valid prefix (kernels/include/spin/row_topk.h).
//
//   logits[row][s] = sum_h w[row][h] * ReLU(q[row][h] . k[s]) * scale[s]
//
// for the slots s < lens[b][r] of row = b * next_n + r, over the pages table[b][0..max_pages);
// slots at or past the row's length (or past max_pages * 64) are left untouched. The CUDA
// kernel runs on torch's current stream with no synchronisation (graph-capturable): wgmma on
// compute capability 9.0, mma.sync elsewhere. The CPU kernel is a plain C++ loop with the same
// formula (fp32 accumulation), used by the CPU tests and as the engine's CPU indexer.
//
// Their schemas and kernel registrations are in schema.cc.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ops.h"
#include "spin/paged_indexer.h"
#include "spin/row_topk.h"
#if SPIN_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace spind_torch {
namespace {

using spin::kIndexerDim;
using spin::kIndexerHeads;
using spin::kPageBytes;
using spin::kPageSlots;

// The 256 values of fp8 e4m3 (NaN at 0x7F and 0xFF).
const std::array<float, 256>& Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int v = 0; v < 256; ++v) t[v] = spin::Fp8E4m3ToFloat(static_cast<uint8_t>(v));
    return t;
  }();
  return table;
}

// What one call computes, read from the validated arguments.
struct Problem {
  int64_t batch = 0;
  int64_t rows = 0;
  int64_t pages_in_cache = 0;
};

// Every shape, dtype, layout and device rule of the op; fails with a message naming the op and
// the problem. Values (lengths, page ids) are checked by the CPU kernel only: the CUDA one
// cannot read them without a synchronisation.
Problem Validate(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& kv,
                 const at::Tensor& table, const at::Tensor& lens, const at::Tensor& logits,
                 int64_t max_pages, int64_t next_n) {
  constexpr const char* op = "spind.paged_indexer";
  TORCH_CHECK(next_n >= 1, op, ": next_n must be >= 1, not ", next_n);
  TORCH_CHECK(max_pages >= 0, op, ": max_pages must be >= 0, not ", max_pages);
  TORCH_CHECK(max_pages <= INT32_MAX, op, ": max_pages ", max_pages, " out of range");
  const at::Device dev = q.device();
  struct Named {
    const at::Tensor* t;
    const char* name;
  };
  for (const Named& x : {Named{&weights, "weights"}, Named{&kv, "kv"}, Named{&table, "table"},
                         Named{&lens, "lens"}, Named{&logits, "logits"}}) {
    TORCH_CHECK(x.t->device() == dev, op, ": ", x.name, " is on ", x.t->device(), " but q is on ",
                dev, " (every tensor must be on one device)");
  }
  TORCH_CHECK(q.scalar_type() == at::kByte, op,
              ": q must be uint8 (fp8 e4m3 bytes; view a float8_e4m3fn tensor as torch.uint8), "
              "not ",
              q.scalar_type());
  TORCH_CHECK(q.dim() == 3 && q.size(1) == kIndexerHeads && q.size(2) == kIndexerDim, op,
              ": q must be [batch * next_n, ", kIndexerHeads, ", ", kIndexerDim, "], not ",
              q.sizes());
  TORCH_CHECK(q.is_contiguous(), op, ": q must be contiguous");
  const int64_t rows = q.size(0);
  TORCH_CHECK(rows % next_n == 0, op, ": q has ", rows, " rows, not a multiple of next_n ", next_n);
  const int64_t batch = rows / next_n;
  TORCH_CHECK(batch <= INT32_MAX, op, ": batch ", batch, " out of range");
  TORCH_CHECK(weights.scalar_type() == at::kFloat, op, ": weights must be float32, not ",
              weights.scalar_type());
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == rows && weights.size(1) == kIndexerHeads, op,
              ": weights must be [", rows, ", ", kIndexerHeads, "] (q's rows), not ",
              weights.sizes());
  TORCH_CHECK(weights.is_contiguous(), op, ": weights must be contiguous");
  TORCH_CHECK(kv.scalar_type() == at::kByte, op, ": kv must be uint8, not ", kv.scalar_type());
  TORCH_CHECK(kv.is_contiguous(), op, ": kv must be contiguous");
  TORCH_CHECK(kv.dim() >= 1 && kv.numel() == kv.size(0) * kPageBytes, op,
              ": kv must be [pages, ...] with ", kPageBytes, " bytes per page, not ", kv.sizes());
  TORCH_CHECK(table.scalar_type() == at::kInt, op, ": table must be int32, not ",
              table.scalar_type());
  TORCH_CHECK(table.dim() == 2 && table.stride(1) == 1, op,
              ": table must be [batch, pages] with unit column stride, not ", table.sizes());
  TORCH_CHECK(table.size(0) >= batch, op, ": table has ", table.size(0), " rows for a batch of ",
              batch);
  TORCH_CHECK(max_pages <= table.size(1), op, ": max_pages ", max_pages, " exceeds the table's ",
              table.size(1), " columns");
  TORCH_CHECK(lens.scalar_type() == at::kInt, op, ": lens must be int32, not ", lens.scalar_type());
  TORCH_CHECK(lens.dim() == 2 && lens.stride(1) == 1, op,
              ": lens must be [batch, next_n] with unit column stride, not ", lens.sizes());
  TORCH_CHECK(lens.size(0) >= batch && lens.size(1) >= next_n, op, ": lens is ", lens.sizes(),
              "; needs at least [", batch, ", ", next_n, "]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, op, ": logits must be float32, not ",
              logits.scalar_type());
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, op,
              ": logits must be [batch * next_n, width] with unit column stride, not ",
              logits.sizes());
  TORCH_CHECK(logits.size(0) == rows, op, ": logits has ", logits.size(0), " rows; q has ", rows);
  TORCH_CHECK(logits.size(1) >= max_pages * kPageSlots, op, ": logits has ", logits.size(1),
              " columns; max_pages ", max_pages, " needs ", max_pages * kPageSlots);
  return Problem{batch, rows, kv.size(0)};
}

#if SPIN_TORCH_CUDA
// "auto": wgmma on compute capability 9.0 (sm_90a), mma.sync elsewhere; or named.
spin::IndexerKernel KernelFor(const std::string& kernel, int device) {
  if (kernel == "wgmma") return spin::IndexerKernel::kWgmma;
  if (kernel == "mma.sync") return spin::IndexerKernel::kMmaSync;
  TORCH_CHECK(kernel == "auto", "spind.paged_indexer: kernel '", kernel,
              "': use auto, wgmma or mma.sync");
  int major = 0, minor = 0;
  TORCH_CHECK(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
          cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess,
      "spind.paged_indexer: cannot read the compute capability of device ", device);
  return major == 9 && minor == 0 ? spin::IndexerKernel::kWgmma : spin::IndexerKernel::kMmaSync;
}
#endif

// row_topk: out[r][0..k) = the k best of logits[r][0..lens[r]) (spin/row_topk.h).
spin::RowTopKArgs RowTopKArgsOf(const at::Tensor& logits, const at::Tensor& lens, int64_t k,
                                at::Tensor& out) {
  constexpr const char* op = "spind.row_topk";
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  (logits.size(1) <= 1 || logits.stride(1) == 1),
              op, ": logits must be float32 [rows, width] with unit column stride, got ",
              logits.scalar_type(), " ", logits.sizes());
  TORCH_CHECK(lens.scalar_type() == at::kInt && lens.dim() == 1 && lens.is_contiguous() &&
                  lens.size(0) == logits.size(0),
              op, ": lens must be contiguous int32 [rows] (rows = ", logits.size(0), "), got ",
              lens.scalar_type(), " ", lens.sizes());
  TORCH_CHECK(out.scalar_type() == at::kInt && out.dim() == 2 && out.size(0) == logits.size(0) &&
                  out.size(1) >= k && (out.size(1) <= 1 || out.stride(1) == 1),
              op, ": out must be int32 [rows, >= k] with unit column stride, got ",
              out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(lens.device() == logits.device() && out.device() == logits.device(), op,
              ": logits, lens and out must be on one device");
  TORCH_CHECK(k >= 1 && k <= 8192, op, ": k ", k, " outside [1, 8192]");
  TORCH_CHECK(logits.size(0) <= INT32_MAX, op, ": too many rows");
  spin::RowTopKArgs a;
  a.logits = logits.data_ptr<float>();
  a.logits_stride = logits.size(0) > 0 ? logits.stride(0) : logits.size(1);
  a.width = logits.size(1);
  a.lens = lens.data_ptr<int32_t>();
  a.rows = static_cast<int32_t>(logits.size(0));
  a.k = static_cast<int32_t>(k);
  a.out = out.data_ptr<int32_t>();
  a.out_stride = out.size(0) > 0 ? out.stride(0) : out.size(1);
  return a;
}

}  // namespace

void PagedIndexerCpu(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& kv,
                     const at::Tensor& table, const at::Tensor& lens, at::Tensor& logits,
                     int64_t max_pages, int64_t next_n, const std::string& kernel) {
  (void)kernel;  // one CPU kernel
  const Problem p = Validate(q, weights, kv, table, lens, logits, max_pages, next_n);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* wp = weights.data_ptr<float>();
  const uint8_t* kvp = kv.data_ptr<uint8_t>();
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  float* out = logits.data_ptr<float>();
  const int64_t ts = table.stride(0), ls = lens.stride(0), os = logits.stride(0);
  // The pages a row reads, as the CUDA kernels bound them: min(ceil(len / 64), max_pages).
  auto pages_of = [&](int64_t row) {
    const int64_t len = lp[(row / next_n) * ls + row % next_n];
    return len <= 0 ? int64_t{0} : std::min((len + kPageSlots - 1) / kPageSlots, max_pages);
  };
  // Page ids first, before anything is written (the GPU kernel would read out of bounds).
  for (int64_t row = 0; row < p.rows; ++row) {
    const int64_t b = row / next_n, pages = pages_of(row);
    for (int64_t j = 0; j < pages; ++j) {
      const int32_t page = tp[b * ts + j];
      TORCH_CHECK(page >= 0 && page < p.pages_in_cache, "spind.paged_indexer: table[", b, "][", j,
                  "] is page ", page, ", outside the cache's ", p.pages_in_cache, " pages");
    }
  }
  const std::array<float, 256>& fp8 = Fp8Table();
  at::parallel_for(0, p.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kIndexerHeads * kIndexerDim);
    float kf[kIndexerDim];
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / next_n;
      const int64_t len = lp[b * ls + row % next_n];
      const int64_t pages = pages_of(row);
      if (pages == 0) continue;
      const uint8_t* qr = qp + row * kIndexerHeads * kIndexerDim;
      for (int i = 0; i < kIndexerHeads * kIndexerDim; ++i) qf[i] = fp8[qr[i]];
      const float* w = wp + row * kIndexerHeads;
      float* o = out + row * os;
      for (int64_t j = 0; j < pages; ++j) {
        const uint8_t* page = kvp + static_cast<int64_t>(tp[b * ts + j]) * kPageBytes;
        const uint8_t* scales = page + kPageSlots * kIndexerDim;
        for (int s = 0; s < kPageSlots; ++s) {
          const int64_t slot = j * kPageSlots + s;
          if (slot >= len) break;
          for (int d = 0; d < kIndexerDim; ++d) kf[d] = fp8[page[s * kIndexerDim + d]];
          float acc = 0.0f;
          for (int h = 0; h < kIndexerHeads; ++h) {
            const float* qh = qf.data() + h * kIndexerDim;
            float dot = 0.0f;
            for (int d = 0; d < kIndexerDim; ++d) dot += qh[d] * kf[d];
            if (dot > 0.0f) acc += w[h] * dot;  // ReLU (a NaN product counts as 0)
          }
          float scale;
          std::memcpy(&scale, scales + s * sizeof(float), sizeof(float));
          o[slot] = acc * scale;
        }
      }
    }
  });
}

#if SPIN_TORCH_CUDA
void PagedIndexerCuda(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& kv,
                      const at::Tensor& table, const at::Tensor& lens, at::Tensor& logits,
                      int64_t max_pages, int64_t next_n, const std::string& kernel) {
  const Problem p = Validate(q, weights, kv, table, lens, logits, max_pages, next_n);
  const c10::cuda::CUDAGuard guard(q.device());
  const int device = q.device().index();
  spin::PagedIndexerArgs a;
  a.q = q.data_ptr<uint8_t>();
  a.weights = weights.data_ptr<float>();
  a.kv = kv.data_ptr<uint8_t>();
  a.table = table.data_ptr<int32_t>();
  a.table_stride = table.stride(0);
  a.lens = lens.data_ptr<int32_t>();
  a.lens_stride = lens.stride(0);
  a.logits = logits.data_ptr<float>();
  a.logits_stride = logits.stride(0);
  a.batch = static_cast<int32_t>(p.batch);
  a.next_n = static_cast<int32_t>(next_n);
  a.max_pages = static_cast<int32_t>(max_pages);
  a.kernel = KernelFor(kernel, device);
  a.stages = a.kernel == spin::IndexerKernel::kWgmma ? 7 : 8;
  const absl::Status s =
      spin::LaunchPagedIndexer(a, c10::cuda::getCurrentCUDAStream(device).stream());
  TORCH_CHECK(s.ok(), "spind.paged_indexer (", spin::IndexerKernelName(a.kernel),
              "): ", std::string(s.message()));
}
#endif

void RowTopKCpu(const at::Tensor& logits, const at::Tensor& lens, int64_t k, at::Tensor& out) {
  const spin::RowTopKArgs a = RowTopKArgsOf(logits, lens, k, out);
  const absl::Status s = spin::RowTopKHost(a);
  TORCH_CHECK(s.ok(), "spind.row_topk: ", std::string(s.message()));
}

#if SPIN_TORCH_CUDA
void RowTopKCuda(const at::Tensor& logits, const at::Tensor& lens, int64_t k, at::Tensor& out) {
  const spin::RowTopKArgs a = RowTopKArgsOf(logits, lens, k, out);
  const c10::cuda::CUDAGuard guard(logits.device());
  const absl::Status s =
      spin::LaunchRowTopK(a, c10::cuda::getCurrentCUDAStream(logits.device().index()).stream());
  TORCH_CHECK(s.ok(), "spind.row_topk: ", std::string(s.message()));
}
#endif

}  // namespace spind_torch
