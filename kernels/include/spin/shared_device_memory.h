// Device memory that two processes share through a POSIX file descriptor (CUDA VMM, docs/design.md
// §3): spind creates a session's arena with cuMemCreate and exports it; the engine imports the fd
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

/// A fixed range of device addresses whose memory can be replaced: engines capture CUDA graphs
/// against the arena's addresses, so when libspin_client moves to a new spind session (after a
/// daemon restart) it maps the new session's allocation at the same addresses. Starts with a
/// private allocation of its own (the dense fallback arena lives there).
class DeviceWindow {
 public:
  /// Reserves at least `bytes` of addresses on device `ordinal` (rounded up to the allocation
  /// granularity) and maps a private allocation there. The memory is not cleared.
  static absl::StatusOr<std::unique_ptr<DeviceWindow>> Create(int ordinal, uint64_t bytes);
  ~DeviceWindow();
  DeviceWindow(const DeviceWindow&) = delete;
  DeviceWindow& operator=(const DeviceWindow&) = delete;

  /// Replaces the memory behind the window with the allocation `fd` refers to (exported by
  /// another process; its size must be bytes()). Waits for all of this process's work on the
  /// device first, since the old memory is unmapped: call it between steps, never while a step
  /// is in flight. The caller keeps ownership of `fd`.
  absl::Status MapImported(int fd);
  void* ptr() const { return ptr_; }
  uint64_t bytes() const { return bytes_; }
  int ordinal() const { return ordinal_; }

 private:
  DeviceWindow() = default;
  absl::Status MapHandle(unsigned long long handle);
  unsigned long long handle_ = 0;
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
  int ordinal_ = 0;
  bool mapped_ = false, reserved_ = false, created_ = false;
};

/// The calling thread's current CUDA device.
absl::StatusOr<int> CudaCurrentDevice();

/// Devices the CUDA runtime sees (0 without a driver or device).
int CudaDeviceCount();
/// The device's UUID as nvidia-smi and dcgm-exporter print it ("GPU-xxxxxxxx-xxxx-...").
absl::StatusOr<std::string> CudaDeviceUuid(int ordinal);
/// The ordinal in this process of the device with that UUID (CUDA_VISIBLE_DEVICES may number
/// devices differently in different processes). NOT_FOUND if this process cannot see it.
absl::StatusOr<int> CudaOrdinalOfUuid(const std::string& uuid);
/// Makes `ordinal` the calling thread's current device.
absl::Status CudaSetDevice(int ordinal);
/// Free bytes of device `ordinal` now (cudaMemGetInfo; makes it the current device).
absl::StatusOr<uint64_t> CudaDeviceFreeBytes(int ordinal);

}  // namespace spin
