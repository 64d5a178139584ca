#include "npy.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <string_view>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spin/status_macros.h"

namespace spin {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the .npy reader maps '<f4' data directly and needs a little-endian host");

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
constexpr size_t kAlign = 64;

struct DictEntry;

// A value of the Python literal subset that .npy headers use. Only what the checks below need
// is kept: the raw text (for error messages), strings, booleans and integer tuples.
struct PyValue {
  enum Kind { kString, kBool, kNone, kInt, kFloat, kTuple, kList, kDict } kind = kNone;
  std::string raw;
  std::string str;
  bool boolean = false;
  int64_t integer = 0;
  std::vector<PyValue> items;      // tuple and list elements
  std::vector<DictEntry> entries;  // dict entries in file order
};

// A vector of pair<string, PyValue> would need PyValue complete inside its own definition,
// which libstdc++ allows under GCC but not under clang; a named entry type declared first does.
struct DictEntry {
  std::string key;
  PyValue value;
};

// Recursive-descent parser for the header dict. Depth is bounded so a hostile header cannot
// exhaust the stack.
class HeaderParser {
 public:
  explicit HeaderParser(std::string_view text) : text_(text) {}

  bool ParseTop(PyValue* out) {
    SkipSpace();
    if (!ParseValue(out, 0)) return false;
    SkipSpace();
    if (pos_ != text_.size()) return Fail("unexpected text after the closing brace");
    return true;
  }
  const std::string& error() const { return error_; }
  size_t pos() const { return pos_; }

 private:
  bool Fail(std::string why) {
    if (error_.empty()) error_ = std::move(why);
    return false;
  }
  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool Consume(char c) {
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool ParseValue(PyValue* out, int depth) {
    if (depth > 16) return Fail("nested too deeply");
    SkipSpace();
    if (pos_ >= text_.size()) return Fail("ends early");
    const size_t start = pos_;
    const char c = text_[pos_];
    bool ok;
    if (c == '\'' || c == '"') {
      out->kind = PyValue::kString;
      ok = ParseString(&out->str);
    } else if (c == '(' || c == '[') {
      out->kind = c == '(' ? PyValue::kTuple : PyValue::kList;
      ok = ParseSequence(c == '(' ? ')' : ']', &out->items, depth);
    } else if (c == '{') {
      out->kind = PyValue::kDict;
      ok = ParseDict(&out->entries, depth);
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      ok = ParseNumber(out);
    } else {
      ok = ParseWord(out);
    }
    if (!ok) return false;
    out->raw = std::string(text_.substr(start, pos_ - start));
    return true;
  }
  bool ParseString(std::string* out) {
    const char quote = text_[pos_++];
    while (pos_ < text_.size() && text_[pos_] != quote) {
      // Escapes do not occur in the keys and dtypes we accept; keep the escaped character
      // so that an unusual dtype still shows up readably in the error.
      if (text_[pos_] == '\\' && pos_ + 1 < text_.size()) ++pos_;
      out->push_back(text_[pos_++]);
    }
    if (pos_ >= text_.size()) return Fail("has an unterminated string");
    ++pos_;
    return true;
  }
  // Integers become kInt; anything else numeric (2.5, 1e3) is kept as kFloat so that the shape
  // check can report it as a malformed shape rather than as unparseable text.
  bool ParseNumber(PyValue* out) {
    bool negative = false;
    if (text_[pos_] == '-') {
      negative = true;
      ++pos_;
    }
    if (pos_ >= text_.size() || text_[pos_] < '0' || text_[pos_] > '9') {
      return Fail("has a malformed number");
    }
    int64_t value = 0;
    bool overflow = false;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      overflow = overflow || __builtin_mul_overflow(value, 10, &value) ||
                 __builtin_add_overflow(value, text_[pos_] - '0', &value);
      ++pos_;
    }
    out->kind = PyValue::kInt;
    while (pos_ < text_.size() &&
           std::string_view(".eE+-0123456789").find(text_[pos_]) != std::string_view::npos) {
      out->kind = PyValue::kFloat;
      ++pos_;
    }
    if (out->kind == PyValue::kInt) {
      if (overflow) return Fail("has an integer that does not fit in 64 bits");
      // Python 2 era NumPy wrote long integers as 3L.
      if (pos_ < text_.size() && (text_[pos_] == 'L' || text_[pos_] == 'l')) ++pos_;
      out->integer = negative ? -value : value;
    }
    return true;
  }
  bool ParseWord(PyValue* out) {
    for (const auto& [word, kind, value] :
         {std::tuple{std::string_view("True"), PyValue::kBool, true},
          std::tuple{std::string_view("False"), PyValue::kBool, false},
          std::tuple{std::string_view("None"), PyValue::kNone, false}}) {
      if (text_.substr(pos_, word.size()) == word) {
        pos_ += word.size();
        out->kind = kind;
        out->boolean = value;
        return true;
      }
    }
    return Fail("has an unexpected token");
  }
  bool ParseSequence(char close, std::vector<PyValue>* items, int depth) {
    ++pos_;
    while (true) {
      if (Consume(close)) return true;
      items->emplace_back();
      if (!ParseValue(&items->back(), depth + 1)) return false;
      if (Consume(',')) continue;
      if (Consume(close)) return true;
      return Fail("has a tuple or list without a closing bracket");
    }
  }
  bool ParseDict(std::vector<DictEntry>* entries, int depth) {
    ++pos_;
    while (true) {
      if (Consume('}')) return true;
      SkipSpace();
      if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) {
        return Fail("has a dict key that is not a string");
      }
      std::string key;
      if (!ParseString(&key)) return false;
      if (!Consume(':')) return Fail("has a dict key without ':'");
      PyValue value;
      if (!ParseValue(&value, depth + 1)) return false;
      entries->push_back(DictEntry{std::move(key), std::move(value)});
      if (Consume(',')) continue;
      if (Consume('}')) return true;
      return Fail("has a dict without a closing brace");
    }
  }

  std::string_view text_;
  size_t pos_ = 0;
  std::string error_;
};

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Header text echoed in a message: printable ASCII as is, anything else as \xNN, at most 80
// characters, so that an error stays one readable line whatever the file holds.
std::string Quote(std::string_view text) {
  constexpr size_t kMax = 80;
  std::string out;
  for (size_t i = 0; i < text.size() && i < kMax; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  if (text.size() > kMax) absl::StrAppend(&out, "... (", text.size(), " bytes)");
  return out;
}

absl::Status Invalid(const std::string& path, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat(path, " ", problem));
}

absl::Status TooShort(const std::string& path, size_t len) {
  return Invalid(path, absl::StrCat("is not a .npy file (", len,
                                    " bytes, too short for the \\x93NUMPY magic); write it "
                                    "with numpy.save"));
}

// Validates the bytes of a mapped file; on success fills shape, element count, data offset and
// element size (4 for '<f4', 2 for '<f2').
absl::Status ParseNpy(const std::string& path, const unsigned char* bytes, size_t len,
                      std::vector<int64_t>* shape, int64_t* count, size_t* data_offset,
                      int* item_bytes) {
  if (len < kMagicLen + 2 || std::memcmp(bytes, kMagic, kMagicLen) != 0) {
    return Invalid(path,
                   absl::StrCat("is not a .npy file (", len < kMagicLen + 2 ? "too short, " : "",
                                "no \\x93NUMPY magic at the start); write it with numpy.save"));
  }
  const int major = bytes[6], minor = bytes[7];
  size_t header_start, header_len;
  if (major == 1 && minor == 0) {
    header_start = 10;
    if (len < header_start) return Invalid(path, "ends inside its .npy preamble");
    header_len = bytes[8] | (size_t{bytes[9]} << 8);
  } else if (major == 2 && minor == 0) {
    header_start = 12;
    if (len < header_start) return Invalid(path, "ends inside its .npy preamble");
    header_len =
        bytes[8] | (size_t{bytes[9]} << 8) | (size_t{bytes[10]} << 16) | (size_t{bytes[11]} << 24);
  } else {
    return Invalid(path, absl::StrCat("has unsupported .npy format version ", major, ".", minor,
                                      "; this reader supports 1.0 and 2.0 (save it with "
                                      "numpy.save, which writes 1.0 for ordinary arrays)"));
  }
  if (header_len > len - header_start) {
    return Invalid(
        path, absl::StrCat("declares a ", header_len, "-byte header but only ", len - header_start,
                           " bytes follow the preamble; the file is truncated"));
  }
  *data_offset = header_start + header_len;

  const std::string_view text(reinterpret_cast<const char*>(bytes + header_start), header_len);
  HeaderParser parser(text);
  PyValue dict;
  if (!parser.ParseTop(&dict)) {
    return Invalid(path, absl::StrCat("has a malformed header (", parser.error(),
                                      " at header byte ", parser.pos(),
                                      "); expected a dict like {'descr': '<f4', "
                                      "'fortran_order': False, 'shape': (...)}"));
  }
  if (dict.kind != PyValue::kDict) {
    return Invalid(path,
                   "has a header that is not a dict; expected {'descr': '<f4', "
                   "'fortran_order': False, 'shape': (...)}");
  }
  const PyValue* descr = nullptr;
  const PyValue* fortran = nullptr;
  const PyValue* shape_value = nullptr;
  for (const auto& [key, value] : dict.entries) {
    if (key == "descr") descr = &value;
    if (key == "fortran_order") fortran = &value;
    if (key == "shape") shape_value = &value;
  }
  for (const auto& [name, value] : {std::pair{"descr", descr}, std::pair{"fortran_order", fortran},
                                    std::pair{"shape", shape_value}}) {
    if (value == nullptr) {
      return Invalid(path, absl::StrCat("has no '", name,
                                        "' in its header dict; write it with "
                                        "numpy.save"));
    }
  }
  if (descr->kind != PyValue::kString) {
    return Invalid(path, absl::StrCat("has dtype ", Quote(descr->raw),
                                      " (a structured dtype); expected float32 '<f4'"));
  }
  if (descr->str != "<f4" && descr->str != "<f2") {
    return Invalid(path, absl::StrCat("has dtype '", Quote(descr->str),
                                      "'; expected float32 '<f4' or float16 '<f2' (convert with "
                                      "arr.astype('<f4'))"));
  }
  const int item = descr->str == "<f4" ? 4 : 2;
  *item_bytes = item;
  if (fortran->kind != PyValue::kBool) {
    return Invalid(
        path, absl::StrCat("has fortran_order ", Quote(fortran->raw), "; expected True or False"));
  }
  if (fortran->boolean) {
    return Invalid(path,
                   "is stored in Fortran order; save a C-order copy "
                   "(numpy.ascontiguousarray(arr))");
  }
  if (shape_value->kind != PyValue::kTuple) {
    return Invalid(path, absl::StrCat("has malformed shape ", Quote(shape_value->raw),
                                      "; expected a tuple of non-negative integers"));
  }
  shape->clear();
  int64_t n = 1;
  bool overflow = false;
  for (const PyValue& dim : shape_value->items) {
    if (dim.kind != PyValue::kInt || dim.integer < 0) {
      return Invalid(path, absl::StrCat("has malformed shape ", Quote(shape_value->raw),
                                        "; expected a tuple of non-negative integers"));
    }
    shape->push_back(dim.integer);
    overflow = overflow || __builtin_mul_overflow(n, dim.integer, &n);
  }
  int64_t data_bytes = 0;
  if (overflow || __builtin_mul_overflow(n, int64_t{item}, &data_bytes)) {
    return Invalid(path, absl::StrCat("has shape ", Quote(shape_value->raw),
                                      " whose size does not fit in 64 bits"));
  }
  *count = n;

  if (*data_offset % static_cast<size_t>(item) != 0) {
    return Invalid(
        path, absl::StrCat("puts its data at byte ", *data_offset, ", not a multiple of ", item,
                           ", so it cannot be mapped as ", item == 4 ? "float32" : "float16",
                           "; rewrite it with numpy.save"));
  }
  const size_t actual = len - *data_offset;
  if (actual < static_cast<uint64_t>(data_bytes)) {
    return Invalid(path, absl::StrCat("is truncated: shape ", ShapeString(*shape), " needs ",
                                      data_bytes, " data bytes but the file has ", actual,
                                      " after its header; re-copy or regenerate it"));
  }
  if (actual > static_cast<uint64_t>(data_bytes)) {
    return Invalid(
        path, absl::StrCat("has ", actual - data_bytes, " trailing bytes after the data for shape ",
                           ShapeString(*shape), " (expected ", data_bytes, " data bytes, found ",
                           actual, "); header and data disagree, regenerate the file"));
  }
  return absl::OkStatus();
}

// write(2) until everything is written; short writes and EINTR are normal on large buffers.
bool WriteAll(int fd, const void* data, size_t len) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    const ssize_t n = ::write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return true;
}

std::atomic<uint64_t> g_tmp_counter{0};

}  // namespace

NpyArray::~NpyArray() { Reset(); }

NpyArray::NpyArray(NpyArray&& other) noexcept
    : map_(std::exchange(other.map_, nullptr)),
      map_len_(std::exchange(other.map_len_, 0)),
      data_(std::exchange(other.data_, nullptr)),
      widened_(std::move(other.widened_)),
      size_(std::exchange(other.size_, 0)),
      shape_(std::move(other.shape_)),
      path_(std::move(other.path_)) {
  other.widened_.clear();
  other.shape_.clear();
  other.path_.clear();
}

NpyArray& NpyArray::operator=(NpyArray&& other) noexcept {
  if (this != &other) {
    Reset();
    map_ = std::exchange(other.map_, nullptr);
    map_len_ = std::exchange(other.map_len_, 0);
    data_ = std::exchange(other.data_, nullptr);
    widened_ = std::move(other.widened_);
    other.widened_.clear();
    size_ = std::exchange(other.size_, 0);
    shape_ = std::move(other.shape_);
    path_ = std::move(other.path_);
    other.shape_.clear();
    other.path_.clear();
  }
  return *this;
}

void NpyArray::Reset() {
  if (map_ != nullptr) ::munmap(map_, map_len_);
  map_ = nullptr;
  map_len_ = 0;
  data_ = nullptr;
  widened_ = {};
  size_ = 0;
  shape_.clear();
  path_.clear();
}

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

RegularFile::RegularFile(RegularFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), size_(std::exchange(other.size_, 0)) {}

RegularFile& RegularFile::operator=(RegularFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

absl::StatusOr<RegularFile> OpenRegularFile(const std::string& path, const char* missing_hint) {
  // O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer, forever if none
  // comes. O_NOCTTY: a terminal named like a trace file must not become our controlling tty.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat(path, " does not exist; ", missing_hint));
    }
    struct stat st;
    if (err == ENXIO && ::stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
      return Invalid(path, "is not a regular file (it is a socket); point at a regular file");
    }
    return absl::ErrnoToStatus(
        err, absl::StrCat("cannot open ", path, " (check that it exists and is readable)"));
  }
  RegularFile file;
  file.fd_ = fd;  // closed by `file` on every return below
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat("cannot stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO (named pipe)"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a file";
    return Invalid(path, absl::StrCat("is not a regular file (it is ", kind,
                                      "); only regular files are read, so that a pipe or a "
                                      "device cannot block the reader: write the data to a "
                                      "regular file and point at that"));
  }
  // Back to blocking reads (O_NONBLOCK means nothing for a regular file, but say so).
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat("cannot set up reading ", path));
  }
  file.size_ = static_cast<uint64_t>(st.st_size);
  return file;
}

absl::Status ParseNpyF32(const std::string& path, const unsigned char* bytes, size_t len,
                         std::vector<int64_t>* shape, int64_t* count, size_t* data_offset,
                         int* item_bytes) {
  if (len < kMagicLen + 2) return TooShort(path, len);
  int item = 0;
  SPIN_RETURN_IF_ERROR(ParseNpy(path, bytes, len, shape, count, data_offset, &item));
  if (item_bytes != nullptr) *item_bytes = item;
  return absl::OkStatus();
}

float HalfToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits >> 15) << 31;
  const uint32_t exponent = (bits >> 10) & 0x1f;
  const uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in float32
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign != 0 ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) {  // infinity, or NaN with its payload kept (and quiet)
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13) |
                                (mantissa != 0 ? 0x400000u : 0u));
  }
  // A normal value: rebias the exponent (15 -> 127) and widen the mantissa (10 -> 23 bits).
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

absl::StatusOr<NpyArray> ReadNpyF32(const std::string& path) {
  SPIN_ASSIGN_OR_RETURN(RegularFile file,
                        OpenRegularFile(path, "check the path (a trace needs scores.npy)"));
  const size_t len = static_cast<size_t>(file.size());
  if (len < kMagicLen + 2) return TooShort(path, len);  // and mmap cannot map 0 bytes
  // MAP_PRIVATE + PROT_READ: pages come from the page cache and nothing is ever copied. The
  // mapping keeps the file alive after `file` closes the descriptor.
  void* map = ::mmap(nullptr, len, PROT_READ, MAP_PRIVATE, file.fd(), 0);
  if (map == MAP_FAILED) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat("cannot mmap ", path));
  }

  NpyArray array;
  array.map_ = map;
  array.map_len_ = len;
  array.path_ = path;
  size_t offset = 0;
  int item = 0;
  absl::Status status = ParseNpyF32(path, static_cast<const unsigned char*>(map), len,
                                    &array.shape_, &array.size_, &offset, &item);
  if (!status.ok()) return status;  // array's destructor unmaps
  const char* first = static_cast<const char*>(map) + offset;
  if (item == 4) {
    array.data_ = reinterpret_cast<const float*>(first);
    return array;
  }
  // float16: widen once into memory the array owns, then drop the mapping.
  array.widened_.resize(static_cast<size_t>(array.size_));
  for (int64_t i = 0; i < array.size_; ++i) {
    uint16_t bits;
    std::memcpy(&bits, first + 2 * i, sizeof bits);
    array.widened_[static_cast<size_t>(i)] = HalfToFloat(bits);
  }
  ::munmap(array.map_, array.map_len_);
  array.map_ = nullptr;
  array.map_len_ = 0;
  array.data_ = array.widened_.data();
  return array;
}

std::string NpyF32Header(const std::vector<int64_t>& shape) {
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) {
    absl::StrAppend(&dict, shape[i], shape.size() == 1 ? "," : (i + 1 < shape.size() ? ", " : ""));
  }
  absl::StrAppend(&dict, "), }");
  // Version 1.0 has a 16-bit header length; NumPy switches to 2.0 only past that, as we do.
  auto padded_len = [&](size_t preamble) {
    const size_t total = preamble + dict.size() + 1;  // +1: the terminating newline
    return (total + kAlign - 1) / kAlign * kAlign - preamble;
  };
  const bool v2 = padded_len(10) > 65535;
  const size_t header_len = padded_len(v2 ? 12 : 10);
  dict.append(header_len - dict.size() - 1, ' ');
  dict.push_back('\n');

  std::string out(kMagic, kMagicLen);
  out.push_back(static_cast<char>(v2 ? 2 : 1));
  out.push_back(0);
  for (size_t i = 0; i < (v2 ? 4u : 2u); ++i) {
    out.push_back(static_cast<char>((header_len >> (8 * i)) & 0xff));
  }
  return out + dict;
}

absl::StatusOr<NpyWriter> NpyWriter::Open(const std::string& path, std::vector<int64_t> shape) {
  int64_t total = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(total, d, &total) || total > (int64_t{1} << 60)) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot write ", path, ": invalid shape ", ShapeString(shape)));
    }
  }
  NpyWriter writer;
  writer.path_ = path;
  writer.total_ = total;
  // A unique name in the same directory, so the final rename is atomic; O_EXCL keeps two
  // writers (threads or processes) from sharing a temporary file.
  for (int attempt = 0; attempt < 100 && writer.fd_ < 0; ++attempt) {
    writer.tmp_path_ = absl::StrCat(path, ".tmp.", ::getpid(), ".", g_tmp_counter.fetch_add(1));
    writer.fd_ = ::open(writer.tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (writer.fd_ < 0 && errno != EEXIST) break;
  }
  if (writer.fd_ < 0) {
    const int err = errno;
    writer.tmp_path_.clear();
    return absl::ErrnoToStatus(err, absl::StrCat("cannot create a temporary file to write ", path));
  }
  const std::string header = NpyF32Header(shape);
  if (!WriteAll(writer.fd_, header.data(), header.size())) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", writer.tmp_path_));
  }
  return writer;
}

NpyWriter::~NpyWriter() { Abandon(); }

NpyWriter::NpyWriter(NpyWriter&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)),
      tmp_path_(std::move(other.tmp_path_)),
      written_(std::exchange(other.written_, 0)),
      total_(std::exchange(other.total_, 0)) {
  other.tmp_path_.clear();
}

NpyWriter& NpyWriter::operator=(NpyWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    tmp_path_ = std::move(other.tmp_path_);
    written_ = std::exchange(other.written_, 0);
    total_ = std::exchange(other.total_, 0);
    other.tmp_path_.clear();
  }
  return *this;
}

void NpyWriter::Abandon() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_path_.empty()) ::unlink(tmp_path_.c_str());
  fd_ = -1;
  tmp_path_.clear();
}

absl::Status NpyWriter::Write(const float* data, int64_t count) {
  if (fd_ < 0)
    return absl::FailedPreconditionError("NpyWriter::Write on a writer that is not open");
  if (count < 0 || count > total_ - written_) {
    return absl::OutOfRangeError(absl::StrCat("writing ", count, " floats to ", path_, " after ",
                                              written_, " would exceed its ", total_, " elements"));
  }
  if (!WriteAll(fd_, data, static_cast<size_t>(count) * sizeof(float))) {
    const int err = errno;
    Abandon();  // the file now has an unknown length; nothing sensible can follow
    return absl::ErrnoToStatus(err, absl::StrCat("cannot write ", path_));
  }
  written_ += count;
  return absl::OkStatus();
}

absl::Status NpyWriter::Close() {
  if (fd_ < 0)
    return absl::FailedPreconditionError("NpyWriter::Close on a writer that is not open");
  if (written_ != total_) {
    const std::string message = absl::StrCat("closing ", path_, " after ", written_, " of ", total_,
                                             " floats; the file was not written");
    Abandon();
    return absl::FailedPreconditionError(message);
  }
  // fsync before rename: otherwise a crash can leave the new name pointing at missing data.
  if (::fsync(fd_) != 0 || ::close(std::exchange(fd_, -1)) != 0) {
    const int err = errno;
    Abandon();
    return absl::ErrnoToStatus(err, absl::StrCat("cannot flush ", path_));
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    Abandon();
    return absl::ErrnoToStatus(err, absl::StrCat("cannot rename the temporary file to ", path_));
  }
  tmp_path_.clear();
  return absl::OkStatus();
}

absl::Status WriteNpyF32(const std::string& path, const std::vector<int64_t>& shape,
                         const float* data) {
  SPIN_ASSIGN_OR_RETURN(NpyWriter writer, NpyWriter::Open(path, shape));
  SPIN_RETURN_IF_ERROR(writer.Write(data, writer.total()));
  return writer.Close();
}

}  // namespace spin
