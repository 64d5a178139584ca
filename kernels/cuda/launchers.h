// Host launchers of the CUDA backend's kernels, one per kernel or kernel family, defined next to
// their kernels (step_kernels.cu, select_kernels.cu, probe_kernels.cu, ema_kernels.cu: without
// relocatable device code a kernel is launched from the translation unit that defines it).
//
// Each launcher takes the arena view, what decides the launch shape, and the caller's stream; it
// picks the template instantiation for the arena (state type, block size), enqueues, never
// synchronises, and returns the launch's cudaError_t. The per-step kernels are programmatic
// dependent launches (device_common.cuh), so their effects keep stream order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dev.h"

// Returns the cudaError_t of `expr` from the enclosing function (which returns cudaError_t)
// unless it is cudaSuccess: the cudaError_t counterpart of SPIN_RETURN_IF_ERROR, for chains of
// launches and runtime calls that stop at the first failure.
#define SPIN_CUDA_RETURN_IF_ERROR(expr)                                                 \
  do {                                                                                  \
    if (const cudaError_t spin_cuda_error_ = (expr); spin_cuda_error_ != cudaSuccess) { \
      return spin_cuda_error_;                                                          \
    }                                                                                   \
  } while (false)

namespace spin::cuda_kernels {

// ---- step_kernels.cu

// Resets sequence `seq`: every layer's state and V summaries unset, its layers fresh, its
// record opened with `key`, and any current entry of it made padding.
cudaError_t LaunchReset(const Dev& d, int seq, uint64_t key, cudaStream_t stream);

// The step's entries (n of them, `rows` query rows each), checked on the device, into the arena,
// with the step's budgets and exploration keys.
cudaError_t LaunchBeginStep(const Dev& d, const int32_t* seq, const int32_t* ctx_len,
                            const int32_t* q_pos, int n, int rows, cudaStream_t stream);

// A new arena's unset values: `state_elems` state entries of `state_bytes` bytes each at `state`,
// then `vsum_elems` floats at `vsum`.
cudaError_t LaunchFillUnset(uint8_t* state, uint64_t state_elems, int state_bytes, float* vsum,
                            uint64_t vsum_elems, cudaStream_t stream);

// ---- select_kernels.cu

// Block scores of every row of the select-ahead group's `layers` layers from `l0`, for the step's
// n entries of `rows` rows (ScoresKernel, or Scores64Kernel for b = 64).
cudaError_t LaunchScores(const Dev& d, int l0, int layers, int n, int rows, cudaStream_t stream);

// The selections and unions of the same group, after LaunchScores (SelectKernel).
cudaError_t LaunchSelect(const Dev& d, int l0, int layers, int n, int rows, cudaStream_t stream);

// Select(layer): the layer's select-ahead record into the outputs (PublishKernel); `table` may
// be null. `count_stats`: add the layer's Select statistics (not when publishing again a
// selection already counted).
cudaError_t LaunchPublish(const Dev& d, int layer, int n, const int32_t* table,
                          int64_t table_stride, bool count_stats, cudaStream_t stream);

// Select's statistics of `layer` for the step's entries (CountSelectKernel): for a Select that
// launched nothing (its selection published ahead), when no Observe of the layer counts them.
cudaError_t LaunchCountSelect(const Dev& d, int layer, int n, cudaStream_t stream);

// Remap of the n x rows x count top-K buffer `idx` through the union of `layer` (the selected
// one; RemapKernel); nothing to launch when it is empty. With `probe` (RemapTopK) the probing
// entries' row 0, mapped, is counted against the layer's miss curve.
cudaError_t LaunchRemap(const Dev& d, int layer, int32_t* idx, int count, int n, int rows,
                        bool probe, cudaStream_t stream);

// ---- probe_kernels.cu

// Raises ProbeRankKernel's dynamic shared memory limit for every CTA size LaunchProbeRank uses;
// once, before the first launch.
cudaError_t SetProbeRankSharedMemory();

// ProbeRankKernel's CTA size for an arena of `max_blocks` blocks per row.
int ProbeRankThreads(int64_t max_blocks);

// Clears the probe counts of layers [l0, l0 + layers), then ranks the blocks of every probing
// (layer, entry) pair of them, after the layers' selections (ProbeRankKernel<threads>).
cudaError_t LaunchProbeRank(const Dev& d, int l0, int layers, int n, int threads,
                            cudaStream_t stream);

// A remap the Probe launch also does (RemapAndObserve): the top-K buffer, its count per row, and
// whether it is counted as the engine's top-K (RemapTopK). idx null: none.
struct RemapWork {
  int32_t* idx = nullptr;
  int count = 0;
  bool probe = false;
};

// What Observe's Probe launch also does for the engine's Selects when the engine gave its block
// table at BeginStep: `count_select`, count the observed layer's Select statistics (its Select
// launched nothing); `publish_layer` >= 0, publish that layer's selection through `table` into
// the outputs, ahead of its Select (which then launches nothing).
struct SelectWork {
  const int32_t* table = nullptr;
  int64_t table_stride = 0;
  int publish_layer = -1;
  bool count_select = false;
};

// Observe's validation (unless the fused kernel did it: validate = false) and probe miss curve
// of `layer` (ProbeKernel: row 0's dense top-K from the logits, unless RemapTopK counted the
// engine's: topk = false), on at most `sms` CTAs; first, over the whole grid, `remap`'s work;
// with validation, `sel`'s.
cudaError_t LaunchProbe(const Dev& d, int layer, int n, int sms, const float* logits,
                        int64_t stride, const int32_t* accepted, bool validate, bool topk,
                        const RemapWork& remap, const SelectWork& sel, cudaStream_t stream);

// ---- ema_kernels.cu

// EmaWordKernel / EmaVecKernel CTAs of the arena's state type resident per multiprocessor.
cudaError_t EmaWordBlocksPerSm(const Dev& d, int* per_sm);
cudaError_t EmaVecBlocksPerSm(const Dev& d, int* per_sm);

// Which EMA kernel Observe uses: EmaVecKernel for the engine's layout (b = 64, max_slots % 8 == 0,
// 16-byte aligned logits rows), else EmaWordKernel for even blocks of at least 64 slots, else
// EmaKernel; the last two need the V summaries recomputed (LaunchVSummary).
bool EmaVecFits(const Dev& d, const float* logits, int64_t stride);
bool EmaWordFits(const Dev& d);

// The EMA of `layer`, one launch per row in row order, stopping at the first failed launch.
// `resident`: the kernel's CTAs resident on the device at once (its persistent grid).
cudaError_t LaunchEmaVec(const Dev& d, int layer, int n, int rows, const float* logits,
                         int64_t stride, const int32_t* accepted, int resident,
                         cudaStream_t stream);
cudaError_t LaunchEmaWord(const Dev& d, int layer, int n, int rows, const float* logits,
                          int64_t stride, const int32_t* accepted, int resident,
                          cudaStream_t stream);
cudaError_t LaunchEma(const Dev& d, int layer, int n, int rows, const float* logits, int64_t stride,
                      const int32_t* accepted, cudaStream_t stream);

// The V summaries of the blocks of every entry's union, after LaunchEmaWord or LaunchEma.
cudaError_t LaunchVSummary(const Dev& d, int layer, int n, cudaStream_t stream);

}  // namespace spin::cuda_kernels
