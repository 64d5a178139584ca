// Device memory that two processes share through a POSIX file descriptor (CUDA VMM, DESIGN §3):
// spind creates a session's arena with cuMemCreate and exports it; the engine imports the fd
// and maps the same physical memory. The driver reference-counts the allocation, so either
// side's mapping stays valid when the other process exits.
//
// Driver entry points are resolved at run time through the CUDA runtime, so binaries never
// link libcuda and still start on machines without a driver (CudaAvailable() is then false).
// Built only with the CUDA backend (SPIN_HAVE_CUDA).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace spin {

/// One VMM allocation mapped read/write into this process on one device.
class SharedDeviceMemory {
 public:
  /// Allocates at least `bytes` on device `ordinal` (rounded up to the allocation granularity,
  /// 2 MiB on the H200) with a POSIX-fd handle, and maps it here. The memory is not cleared.
  static absl::StatusOr<std::unique_ptr<SharedDeviceMemory>> Create(int ordinal, uint64_t bytes);
  /// Imports an allocation of `bytes` (its rounded size, as the exporter reports it) from a
  /// file descriptor made by ExportFd in another process and maps it on device `ordinal`. The
  /// caller keeps ownership of `fd` (it may close it right after).
  static absl::StatusOr<std::unique_ptr<SharedDeviceMemory>> Import(int fd, int ordinal,
                                                                    uint64_t bytes);
  ~SharedDeviceMemory();
  SharedDeviceMemory(const SharedDeviceMemory&) = delete;
  SharedDeviceMemory& operator=(const SharedDeviceMemory&) = delete;

  /// A new file descriptor for the allocation (the caller closes it).
  absl::StatusOr<int> ExportFd() const;
  /// The mapping (a device pointer).
  void* ptr() const { return ptr_; }
  /// The allocation's size (a multiple of the granularity).
  uint64_t bytes() const { return bytes_; }
  int ordinal() const { return ordinal_; }

 private:
  SharedDeviceMemory() = default;
  unsigned long long handle_ = 0;  // CUmemGenericAllocationHandle
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
  int ordinal_ = 0;
  bool mapped_ = false, reserved_ = false, created_ = false;
};

/// Devices the CUDA runtime sees (0 without a driver or device).
int CudaDeviceCount();
/// The device's UUID as nvidia-smi and dcgm-exporter print it ("GPU-xxxxxxxx-xxxx-...").
absl::StatusOr<std::string> CudaDeviceUuid(int ordinal);
/// The ordinal in this process of the device with that UUID (CUDA_VISIBLE_DEVICES may number
/// devices differently in different processes). NOT_FOUND if this process cannot see it.
absl::StatusOr<int> CudaOrdinalOfUuid(const std::string& uuid);
/// Makes `ordinal` the calling thread's current device.
absl::Status CudaSetDevice(int ordinal);

}  // namespace spin
