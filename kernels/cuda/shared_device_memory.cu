// CUDA VMM allocations shared by file descriptor (see spin/shared_device_memory.h).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "spin/shared_device_memory.h"
#include "spin/status_macros.h"

namespace spin {
namespace {

// The driver entry points VMM needs, resolved once through the runtime (no libcuda link).
struct Driver {
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 export_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 import_handle = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuGetErrorString_v6000 error_string = nullptr;
  absl::Status status;
};

absl::Status Resolve(const char* name, unsigned version, void** out) {
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, out, version, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || *out == nullptr) {
    return absl::UnavailableError(absl::StrCat("the CUDA driver has no ", name, " (",
                                               cudaGetErrorString(e),
                                               "): is an NVIDIA driver >= 450 installed?"));
  }
  return absl::OkStatus();
}

absl::Status ResolveAll(Driver* x) {
  // Initialise the runtime (and with it the driver) first.
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::UnavailableError("no CUDA device is usable (no driver or no GPU)");
  }
  const struct {
    const char* name;
    unsigned version;
    void** out;
  } table[] = {
      {"cuMemCreate", 10020, reinterpret_cast<void**>(&x->create)},
      {"cuMemRelease", 10020, reinterpret_cast<void**>(&x->release)},
      {"cuMemAddressReserve", 10020, reinterpret_cast<void**>(&x->reserve)},
      {"cuMemAddressFree", 10020, reinterpret_cast<void**>(&x->address_free)},
      {"cuMemMap", 10020, reinterpret_cast<void**>(&x->map)},
      {"cuMemUnmap", 10020, reinterpret_cast<void**>(&x->unmap)},
      {"cuMemSetAccess", 10020, reinterpret_cast<void**>(&x->set_access)},
      {"cuMemExportToShareableHandle", 10020, reinterpret_cast<void**>(&x->export_handle)},
      {"cuMemImportFromShareableHandle", 10020, reinterpret_cast<void**>(&x->import_handle)},
      {"cuMemGetAllocationGranularity", 10020, reinterpret_cast<void**>(&x->granularity)},
      {"cuGetErrorString", 6000, reinterpret_cast<void**>(&x->error_string)},
  };
  for (const auto& t : table) {
    SPIN_RETURN_IF_ERROR(Resolve(t.name, t.version, t.out));
  }
  return absl::OkStatus();
}

const Driver& GetDriver() {
  static const Driver* d = [] {
    auto* x = new Driver();
    x->status.Update(ResolveAll(x));
    return x;
  }();
  return *d;
}

absl::Status Check(const Driver& d, CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* text = nullptr;
  if (d.error_string != nullptr) d.error_string(r, &text);
  const std::string msg = absl::StrCat(what, " failed: ", text != nullptr ? text : "unknown error",
                                       " (CUresult ", static_cast<int>(r), ")");
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

CUmemAllocationProp Prop(int ordinal) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

absl::Status CheckOrdinal(int ordinal) {
  const int n = CudaDeviceCount();
  if (ordinal < 0 || ordinal >= n) {
    return absl::OutOfRangeError(
        absl::StrCat("CUDA device ", ordinal, " does not exist (this process sees ", n, ")"));
  }
  return absl::OkStatus();
}

// The allocation size for `bytes` on a device: rounded up to the driver's granularity.
absl::StatusOr<uint64_t> RoundedSize(const Driver& d, int ordinal, uint64_t bytes) {
  const CUmemAllocationProp prop = Prop(ordinal);
  size_t gran = 0;
  SPIN_RETURN_IF_ERROR(Check(d, d.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                             "cuMemGetAllocationGranularity"));
  return (bytes + gran - 1) / gran * gran;
}

absl::StatusOr<CUmemGenericAllocationHandle> NewHandle(const Driver& d, int ordinal,
                                                       uint64_t bytes) {
  const CUmemAllocationProp prop = Prop(ordinal);
  CUmemGenericAllocationHandle h = 0;
  SPIN_RETURN_IF_ERROR(Check(d, d.create(&h, bytes, &prop, 0), "cuMemCreate"));
  return h;
}

absl::StatusOr<CUmemGenericAllocationHandle> ImportHandle(const Driver& d, int fd) {
  CUmemGenericAllocationHandle h = 0;
  SPIN_RETURN_IF_ERROR(Check(d,
                             d.import_handle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                             "cuMemImportFromShareableHandle"));
  return h;
}

absl::StatusOr<void*> Reserve(const Driver& d, uint64_t bytes) {
  CUdeviceptr p = 0;
  SPIN_RETURN_IF_ERROR(Check(d, d.reserve(&p, bytes, 0, 0, 0), "cuMemAddressReserve"));
  return reinterpret_cast<void*>(p);
}

// Maps `h` at `ptr` read/write for the device; on failure nothing stays mapped.
absl::Status MapAt(const Driver& d, void* ptr, uint64_t bytes, CUmemGenericAllocationHandle h,
                   int ordinal) {
  const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(ptr);
  SPIN_RETURN_IF_ERROR(Check(d, d.map(p, bytes, 0, h, 0), "cuMemMap"));
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  absl::Status s = Check(d, d.set_access(p, bytes, &access, 1), "cuMemSetAccess");
  if (!s.ok()) d.unmap(p, bytes);
  return s;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedDeviceMemory>> SharedDeviceMemory::Create(int ordinal,
                                                                               uint64_t bytes) {
  const Driver& d = GetDriver();
  SPIN_RETURN_IF_ERROR(d.status);
  SPIN_RETURN_IF_ERROR(CheckOrdinal(ordinal));
  SPIN_ASSIGN_OR_RETURN(const uint64_t size, RoundedSize(d, ordinal, bytes));
  std::unique_ptr<SharedDeviceMemory> m(new SharedDeviceMemory());
  m->ordinal_ = ordinal;
  m->bytes_ = size;
  SPIN_ASSIGN_OR_RETURN(const CUmemGenericAllocationHandle h, NewHandle(d, ordinal, m->bytes_));
  m->handle_ = h;
  m->created_ = true;
  SPIN_ASSIGN_OR_RETURN(m->ptr_, Reserve(d, m->bytes_));
  m->reserved_ = true;
  SPIN_RETURN_IF_ERROR(MapAt(d, m->ptr_, m->bytes_, h, ordinal));
  m->mapped_ = true;
  return m;
}

absl::StatusOr<std::unique_ptr<SharedDeviceMemory>> SharedDeviceMemory::Import(int fd, int ordinal,
                                                                               uint64_t bytes) {
  const Driver& d = GetDriver();
  SPIN_RETURN_IF_ERROR(d.status);
  SPIN_RETURN_IF_ERROR(CheckOrdinal(ordinal));
  if (fd < 0 || bytes == 0) {
    return absl::InvalidArgumentError("importing device memory needs an fd and its size");
  }
  std::unique_ptr<SharedDeviceMemory> m(new SharedDeviceMemory());
  m->ordinal_ = ordinal;
  m->bytes_ = bytes;
  SPIN_ASSIGN_OR_RETURN(const CUmemGenericAllocationHandle h, ImportHandle(d, fd));
  m->handle_ = h;
  m->created_ = true;
  SPIN_ASSIGN_OR_RETURN(m->ptr_, Reserve(d, bytes));
  m->reserved_ = true;
  if (absl::Status s = MapAt(d, m->ptr_, bytes, h, ordinal); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), " (is the size the exporter's?)"));
  }
  m->mapped_ = true;
  return m;
}

SharedDeviceMemory::~SharedDeviceMemory() {
  const Driver& d = GetDriver();
  if (!d.status.ok()) return;
  const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(ptr_);
  // Work queued on the memory (by this process) must finish before it is unmapped.
  if (mapped_) {
    cudaSetDevice(ordinal_);
    cudaDeviceSynchronize();
    d.unmap(p, bytes_);
  }
  if (reserved_) d.address_free(p, bytes_);
  if (created_) d.release(static_cast<CUmemGenericAllocationHandle>(handle_));
}

absl::StatusOr<int> SharedDeviceMemory::ExportFd() const {
  const Driver& d = GetDriver();
  SPIN_RETURN_IF_ERROR(d.status);
  int fd = -1;
  SPIN_RETURN_IF_ERROR(
      Check(d,
            d.export_handle(&fd, static_cast<CUmemGenericAllocationHandle>(handle_),
                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle"));
  return fd;
}

absl::StatusOr<std::unique_ptr<DeviceWindow>> DeviceWindow::Create(int ordinal, uint64_t bytes) {
  const Driver& d = GetDriver();
  SPIN_RETURN_IF_ERROR(d.status);
  SPIN_RETURN_IF_ERROR(CheckOrdinal(ordinal));
  SPIN_ASSIGN_OR_RETURN(const uint64_t size, RoundedSize(d, ordinal, bytes));
  std::unique_ptr<DeviceWindow> w(new DeviceWindow());
  w->ordinal_ = ordinal;
  w->bytes_ = size;
  SPIN_ASSIGN_OR_RETURN(w->ptr_, Reserve(d, w->bytes_));
  w->reserved_ = true;
  SPIN_ASSIGN_OR_RETURN(const CUmemGenericAllocationHandle h, NewHandle(d, ordinal, w->bytes_));
  // The window does not own the new handle until MapHandle succeeds.
  if (absl::Status s = w->MapHandle(h); !s.ok()) {
    d.release(h);
    return s;
  }
  return w;
}

absl::Status DeviceWindow::MapHandle(unsigned long long handle) {
  const Driver& d = GetDriver();
  if (mapped_) {
    // The old memory goes away: nothing of this process may still be using it (on this
    // device; the window's device is the engine's current one).
    cudaError_t e = cudaSetDevice(ordinal_);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("cudaDeviceSynchronize before remapping: ", cudaGetErrorString(e)));
    }
    SPIN_RETURN_IF_ERROR(
        Check(d, d.unmap(reinterpret_cast<CUdeviceptr>(ptr_), bytes_), "cuMemUnmap"));
    mapped_ = false;
  }
  if (absl::Status s = MapAt(d, ptr_, bytes_, handle, ordinal_); !s.ok()) {
    // Keep the window usable: put the old memory back.
    if (created_ && MapAt(d, ptr_, bytes_, handle_, ordinal_).ok()) mapped_ = true;
    return s;
  }
  mapped_ = true;
  if (created_) d.release(static_cast<CUmemGenericAllocationHandle>(handle_));
  handle_ = handle;
  created_ = true;
  return absl::OkStatus();
}

absl::Status DeviceWindow::MapImported(int fd) {
  const Driver& d = GetDriver();
  SPIN_RETURN_IF_ERROR(d.status);
  SPIN_ASSIGN_OR_RETURN(const CUmemGenericAllocationHandle h, ImportHandle(d, fd));
  // This window does not own the imported handle until MapHandle succeeds.
  if (absl::Status s = MapHandle(h); !s.ok()) {
    d.release(h);
    return s;
  }
  return absl::OkStatus();
}

DeviceWindow::~DeviceWindow() {
  const Driver& d = GetDriver();
  if (!d.status.ok()) return;
  const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(ptr_);
  if (mapped_) {
    cudaSetDevice(ordinal_);
    cudaDeviceSynchronize();
    d.unmap(p, bytes_);
  }
  if (created_) d.release(static_cast<CUmemGenericAllocationHandle>(handle_));
  if (reserved_) d.address_free(p, bytes_);
}

absl::StatusOr<int> CudaCurrentDevice() {
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("no current CUDA device: ", cudaGetErrorString(e)));
  }
  return dev;
}

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error for later calls
    return 0;
  }
  return n;
}

absl::StatusOr<std::string> CudaDeviceUuid(int ordinal) {
  SPIN_RETURN_IF_ERROR(CheckOrdinal(ordinal));
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, ordinal); e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaGetDeviceProperties(", ordinal, "): ", cudaGetErrorString(e)));
  }
  const auto* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  std::string out = "GPU-";
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    std::snprintf(hex, sizeof(hex), "%02x", u[i]);
    out += hex;
  }
  return out;
}

absl::StatusOr<int> CudaOrdinalOfUuid(const std::string& uuid) {
  const int n = CudaDeviceCount();
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<std::string> u = CudaDeviceUuid(i);
    if (u.ok() && *u == uuid) return i;
  }
  return absl::NotFoundError(absl::StrCat("this process sees no CUDA device ", uuid, " (of ", n,
                                          " visible): check CUDA_VISIBLE_DEVICES"));
}

absl::Status CudaSetDevice(int ordinal) {
  SPIN_RETURN_IF_ERROR(CheckOrdinal(ordinal));
  if (cudaError_t e = cudaSetDevice(ordinal); e != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaSetDevice(", ordinal, "): ", cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CudaDeviceFreeBytes(int ordinal) {
  SPIN_RETURN_IF_ERROR(CudaSetDevice(ordinal));
  size_t free = 0, total = 0;
  if (cudaError_t e = cudaMemGetInfo(&free, &total); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaMemGetInfo: ", cudaGetErrorString(e)));
  }
  return static_cast<uint64_t>(free);
}

}  // namespace spin
