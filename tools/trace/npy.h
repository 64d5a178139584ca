// NumPy .npy files holding little-endian float32 in C order, read through a read-only mapping
// (trace scores run to gigabytes and must not be copied) and written atomically. float16 files
// are read too, widened once into memory (exactly: every float16 value is a float32 value), so
// real-attention traces can be kept at half the size (bench/traces/attn-h100-32k-hard).
//
// Supported: format versions 1.0 and 2.0, dtype '<f4' or '<f2', fortran_order False, any rank
// (rank 0 is a scalar). A file longer than its shape implies is rejected: trailing bytes mean the
// header and the data disagree, and guessing which one is right would hide a broken writer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace spin {

/// A float32 array mapped read-only from a .npy file (or widened from a float16 file into memory
/// it owns); owns the mapping or the memory (move-only).
class NpyArray {
 public:
  /// An empty array that maps nothing.
  NpyArray() = default;
  /// Unmaps the file.
  ~NpyArray();
  /// Takes over `other`'s mapping; `other` becomes empty.
  NpyArray(NpyArray&& other) noexcept;
  /// Releases this mapping and takes over `other`'s.
  NpyArray& operator=(NpyArray&& other) noexcept;
  /// Not copyable: the mapping has a single owner.
  NpyArray(const NpyArray&) = delete;
  /// Not copyable: the mapping has a single owner.
  NpyArray& operator=(const NpyArray&) = delete;

  /// Dimensions, outermost first (C order); empty for a scalar.
  const std::vector<int64_t>& shape() const { return shape_; }
  /// Number of dimensions.
  int rank() const { return static_cast<int>(shape_.size()); }
  /// Number of elements (product of the shape; 1 for a scalar).
  int64_t size() const { return size_; }
  /// First element, 64-byte aligned for files written by WriteNpyF32; valid while *this lives.
  /// For a float16 file, the widened copy.
  const float* data() const { return data_; }
  /// The path the array was read from.
  const std::string& path() const { return path_; }

 private:
  friend absl::StatusOr<NpyArray> ReadNpyF32(const std::string& path);
  void Reset();

  void* map_ = nullptr;
  size_t map_len_ = 0;
  const float* data_ = nullptr;
  std::vector<float> widened_;  // a float16 file's values as float32 (then nothing is mapped)
  int64_t size_ = 0;
  std::vector<int64_t> shape_;
  std::string path_;
};

/// A read-only descriptor of a regular file and the file's size when it was opened; closes the
/// descriptor (move-only).
class RegularFile {
 public:
  /// Holds nothing.
  RegularFile() = default;
  /// Closes the descriptor.
  ~RegularFile();
  /// Takes over `other`'s descriptor.
  RegularFile(RegularFile&& other) noexcept;
  /// Closes this descriptor and takes over `other`'s.
  RegularFile& operator=(RegularFile&& other) noexcept;
  /// Not copyable: the descriptor has a single owner.
  RegularFile(const RegularFile&) = delete;
  /// Not copyable: the descriptor has a single owner.
  RegularFile& operator=(const RegularFile&) = delete;

  /// The descriptor (blocking reads; -1 when empty).
  int fd() const { return fd_; }
  /// st_size from fstat at open.
  uint64_t size() const { return size_; }

 private:
  friend absl::StatusOr<RegularFile> OpenRegularFile(const std::string& path,
                                                     const char* missing_hint);
  int fd_ = -1;
  uint64_t size_ = 0;
};

/// Opens `path` (symlinks followed) for reading if and only if it is a regular file. The one
/// way trace files are opened: the open itself uses O_NONBLOCK, so a FIFO (or a device) named
/// like a trace file is opened without waiting for a writer, then fstat on the opened
/// descriptor (not a stat of the name before the open, which a rename could race) rejects
/// anything that is not a regular file; O_NONBLOCK is cleared again for the reads. Errors:
/// NotFound ("PATH does not exist; " + `missing_hint`), InvalidArgument naming the kind of file
/// found and what to do, and the errno's code (with the path) for other open failures.
absl::StatusOr<RegularFile> OpenRegularFile(const std::string& path, const char* missing_hint);

/// Maps `path` read-only and validates its header and length; a float16 ('<f2') file is widened
/// to float32 in memory and unmapped. Errors: NotFound for a missing
/// file, InvalidArgument (one line naming the file and the problem) for anything malformed or
/// not a regular file (opened with OpenRegularFile: a FIFO is refused, never waited on).
absl::StatusOr<NpyArray> ReadNpyF32(const std::string& path);

/// Validates the bytes of a whole .npy file held in memory exactly as ReadNpyF32 validates a
/// mapped file (the fuzz target's entry point); on success fills the shape, the element count,
/// the offset of the first data byte and (if not null) the element size: 4 for '<f4', 2 for
/// '<f2'. `path` only names the file in messages.
absl::Status ParseNpyF32(const std::string& path, const unsigned char* bytes, size_t len,
                         std::vector<int64_t>* shape, int64_t* count, size_t* data_offset,
                         int* item_bytes = nullptr);

/// The float32 value of an IEEE 754 binary16 bit pattern (exact; NaN stays NaN).
float HalfToFloat(uint16_t bits);

/// Writes `data` (product of `shape` floats, C order) to `path` via a temporary file and a
/// rename, so readers see either the old file or the complete new one.
absl::Status WriteNpyF32(const std::string& path, const std::vector<int64_t>& shape,
                         const float* data);

/// Streams a float32 .npy file of known shape in pieces; the file appears at its final path only
/// when Close() succeeds, and an unclosed writer removes its temporary file (move-only).
class NpyWriter {
 public:
  /// Creates the temporary file beside `path` and writes the header for `shape`.
  static absl::StatusOr<NpyWriter> Open(const std::string& path, std::vector<int64_t> shape);

  /// A writer that holds nothing; only assignment and destruction are valid.
  NpyWriter() = default;
  /// Removes the temporary file unless Close() succeeded.
  ~NpyWriter();
  /// Takes over `other`'s file; `other` holds nothing afterwards.
  NpyWriter(NpyWriter&& other) noexcept;
  /// Abandons this writer's file (as the destructor does) and takes over `other`'s.
  NpyWriter& operator=(NpyWriter&& other) noexcept;
  /// Not copyable: the temporary file has a single owner.
  NpyWriter(const NpyWriter&) = delete;
  /// Not copyable: the temporary file has a single owner.
  NpyWriter& operator=(const NpyWriter&) = delete;

  /// Appends `count` floats (one write(2) per call: pass large chunks). Fails, writing nothing,
  /// if that would exceed the shape.
  absl::Status Write(const float* data, int64_t count);
  /// Checks that exactly the shape's element count was written, flushes to disk and renames
  /// the file into place. The writer holds nothing afterwards, whatever the outcome.
  absl::Status Close();

  /// True between a successful Open() and Close() (or a failed Write()).
  bool is_open() const { return fd_ >= 0; }
  /// Floats written so far.
  int64_t written() const { return written_; }
  /// Floats the shape calls for.
  int64_t total() const { return total_; }
  /// The final path.
  const std::string& path() const { return path_; }

 private:
  void Abandon();

  int fd_ = -1;
  std::string path_;
  std::string tmp_path_;
  int64_t written_ = 0;
  int64_t total_ = 0;
};

/// The complete .npy header (magic, version, length, padded dict) for a float32 C-order array
/// of `shape`, sized so that the data starts at a multiple of 64 bytes.
std::string NpyF32Header(const std::vector<int64_t>& shape);

}  // namespace spin
