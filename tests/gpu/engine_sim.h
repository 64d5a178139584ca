// Test support for GPU tests: a stand-in for the engine's indexer (see engine_sim.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "spin/arena.h"

namespace spin::testing {

/// Writes compacted logits for every (entry, row) of the current step: union block k's slots
/// from `dense` ([entry][layer][row][n_max] floats), -inf beyond the row's context.
cudaError_t LaunchGatherLogits(const ArenaView& a, int layer, const float* dense, int64_t n_max,
                               float* logits, int64_t stride, cudaStream_t stream);

/// Runs FloatToBf16 on the device (the hardware conversion) and FloatToBf16Bits (the integer
/// definition the host uses) on every one of the 2^32 float bit patterns; writes how many
/// results differ to *mismatches (host memory) and the first differing input to *first.
cudaError_t CountBf16Mismatches(uint64_t* mismatches, uint32_t* first);

}  // namespace spin::testing
