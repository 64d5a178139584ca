// GPU tests skip cleanly on a machine without a usable CUDA device, unless the run requires
// one: with SPIN_REQUIRE_GPU=1 in the environment (scripts/gpu-check sets it) a missing device
// is a failure that says why, so a GPU run cannot report success with nothing run.
//
//   SPIN_REQUIRE_GPU_OR_SKIP();                        // in SetUp() or at the top of a TEST
//   SPIN_REQUIRE_OR_SKIP(HopperDevice(), "wgmma needs an sm_90 device");
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "gtest/gtest.h"
#include "spin/cuda_data_plane.h"

namespace spin::testing {

/// True when SPIN_REQUIRE_GPU=1: GPU tests must run, a skip is a failure.
inline bool GpuRequired() {
  const char* v = std::getenv("SPIN_REQUIRE_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

/// Why there is no usable device, in the runtime's words ("" if CudaAvailable()).
inline std::string NoGpuReason() {
  if (CudaAvailable()) return "";
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(e) + " (" +
           cudaGetErrorString(e) + ")";
  }
  return "cudaGetDeviceCount found " + std::to_string(n) + " devices";
}

/// The device's compute capability as "sm_XY" (for messages).
inline std::string DeviceArch() {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "unknown";
  return "sm_" + std::to_string(prop.major) + std::to_string(prop.minor);
}

}  // namespace spin::testing

/// Skips the test when `cond` is false, or fails it (with `why`) under SPIN_REQUIRE_GPU=1.
/// Returns from the calling function either way (a fatal failure in SetUp skips the body).
#define SPIN_REQUIRE_OR_SKIP(cond, why)                                            \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      if (::spin::testing::GpuRequired()) {                                        \
        GTEST_FAIL() << "SPIN_REQUIRE_GPU=1 but this test cannot run: " << why;    \
      } else {                                                                     \
        GTEST_SKIP() << why << " (set SPIN_REQUIRE_GPU=1 to make this a failure)"; \
      }                                                                            \
    }                                                                              \
  } while (0)

/// Skips without a usable CUDA device; fails instead under SPIN_REQUIRE_GPU=1.
#define SPIN_REQUIRE_GPU_OR_SKIP()              \
  SPIN_REQUIRE_OR_SKIP(::spin::CudaAvailable(), \
                       "no usable CUDA device: " << ::spin::testing::NoGpuReason())
