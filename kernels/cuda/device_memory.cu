#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "spin/cuda_data_plane.h"

namespace spin {
namespace {
absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}
}  // namespace

absl::StatusOr<void*> DeviceAlloc(uint64_t bytes) {
  void* p = nullptr;
  if (absl::Status s = Check(cudaMalloc(&p, bytes), "cudaMalloc"); !s.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of device memory: ", s.message()));
  }
  return p;
}

void DeviceFree(void* p) { cudaFree(p); }

absl::Status CopyToDevice(void* dst, const void* src, uint64_t bytes) {
  return Check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "copy to device");
}

absl::Status CopyToHost(void* dst, const void* src, uint64_t bytes) {
  return Check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy to host");
}

}  // namespace spin
