#include "npy.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

namespace spin {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, so tests can run in parallel (ctest -j) without collisions.
std::string TestDir() {
  const auto* info = testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir =
      fs::path(testing::TempDir()) / "npy_test" / info->test_suite_name() / info->name();
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A .npy file with an arbitrary header dict, version and payload, padded as NumPy pads.
// `remainder` != 0 puts the data at an offset that is not a multiple of `pad_to`.
std::string MakeNpy(const std::string& dict, int major, size_t payload_bytes, size_t pad_to = 64,
                    size_t remainder = 0) {
  const size_t preamble = major == 1 ? 10 : 12;
  std::string header = dict;
  while ((preamble + header.size() + 1) % pad_to != remainder) header.push_back(' ');
  header.push_back('\n');
  std::string out("\x93NUMPY", 6);
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  for (size_t i = 0; i < (major == 1 ? 2u : 4u); ++i) {
    out.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));
  }
  out += header;
  std::vector<float> values((payload_bytes + 3) / 4);  // whole floats covering the payload
  std::iota(values.begin(), values.end(), 0.0f);
  out.append(reinterpret_cast<const char*>(values.data()), payload_bytes);
  return out;
}

std::vector<float> Iota(int64_t n, float start = 0.5f) {
  std::vector<float> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

bool ContainsPath(const std::string& message, const std::string& path) {
  return message.find(path) != std::string::npos;
}

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(NpyHeader, LayoutMatchesTheFormat) {
  const std::string header = NpyF32Header({2, 3});
  EXPECT_EQ(header.size() % 64, 0u);
  EXPECT_EQ(header.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  EXPECT_EQ(static_cast<size_t>(static_cast<unsigned char>(header[8]) |
                                (static_cast<unsigned char>(header[9]) << 8)),
            header.size() - 10);
  EXPECT_NE(header.find("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"),
            std::string::npos);
  EXPECT_EQ(header.back(), '\n');
  EXPECT_NE(NpyF32Header({7}).find("'shape': (7,)"), std::string::npos);
  EXPECT_NE(NpyF32Header({}).find("'shape': ()"), std::string::npos);
}

TEST(NpyHeader, HugeRankSwitchesToVersion2) {
  // A header over 64 KiB cannot be expressed in version 1.0.
  const std::vector<int64_t> shape(30000, 1);
  const std::string header = NpyF32Header(shape);
  EXPECT_EQ(header[6], 2);
  EXPECT_EQ(header.size() % 64, 0u);
  const std::string path = TestDir() + "/v2.npy";
  const float v = 42;
  ASSERT_TRUE(WriteNpyF32(path, shape, &v).ok());
  absl::StatusOr<NpyArray> array = ReadNpyF32(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->rank(), 30000);
  EXPECT_EQ(array->data()[0], 42.0f);
}

class NpyRoundTrip : public testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(NpyRoundTrip, WritesAndMapsBack) {
  const std::string path = TestDir() + "/a.npy";
  const std::vector<int64_t> shape = GetParam();
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  const std::vector<float> values = Iota(n, -3.25f);
  ASSERT_TRUE(WriteNpyF32(path, shape, values.data()).ok());

  absl::StatusOr<NpyArray> array = ReadNpyF32(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape(), shape);
  EXPECT_EQ(array->rank(), static_cast<int>(shape.size()));
  EXPECT_EQ(array->size(), n);
  EXPECT_EQ(array->path(), path);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(array->data()) % 64, 0u);
  if (n > 0) {
    EXPECT_EQ(std::memcmp(array->data(), values.data(), n * sizeof(float)), 0);
  }
  EXPECT_EQ(fs::file_size(path), NpyF32Header(shape).size() + n * sizeof(float));
  EXPECT_EQ(FilesIn(fs::path(path).parent_path().string()), std::vector<std::string>{"a.npy"});
}

INSTANTIATE_TEST_SUITE_P(Ranks, NpyRoundTrip,
                         testing::Values(std::vector<int64_t>{}, std::vector<int64_t>{5},
                                         std::vector<int64_t>{3, 4}, std::vector<int64_t>{2, 3, 7},
                                         std::vector<int64_t>{2, 1, 3, 129},
                                         std::vector<int64_t>{0, 5}));

TEST(NpyRead, AcceptsVersion2AndNumPyVariants) {
  const std::string dir = TestDir();
  struct Case {
    const char* name;
    std::string bytes;
    std::vector<int64_t> shape;
  } cases[] = {
      {"v2.npy",
       MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 2, 24),
       {2, 3}},
      {"order.npy", MakeNpy("{'shape': (4,), 'fortran_order': False, 'descr': '<f4'}", 1, 16), {4}},
      {"py2.npy",
       MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (2L, 2L), }", 1, 16),
       {2, 2}},
      {"pad16.npy",
       MakeNpy("{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (3,)}", 1, 12, 16),
       {3}},
  };
  for (const Case& c : cases) {
    const std::string path = dir + "/" + c.name;
    WriteBytes(path, c.bytes);
    absl::StatusOr<NpyArray> array = ReadNpyF32(path);
    ASSERT_TRUE(array.ok()) << c.name << ": " << array.status();
    EXPECT_EQ(array->shape(), c.shape) << c.name;
    // The payload's every value (the loop must not run zero times on a wrong size).
    ASSERT_EQ(array->size(), c.shape[0] * (c.shape.size() > 1 ? c.shape[1] : 1)) << c.name;
    for (int64_t i = 0; i < array->size(); ++i) EXPECT_EQ(array->data()[i], float(i)) << c.name;
  }
}

// Every float16 bit pattern widens to its IEEE 754 binary16 value, computed here from the
// definition (sign, 5-bit exponent with bias 15, 10-bit fraction; subnormals at 2^-14, the
// all-ones exponent for infinity and NaN) in double arithmetic, so a float16 trace replays the
// exact values it holds.
TEST(NpyRead, HalfToFloatIsExactForEveryPattern) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    const bool negative = (b >> 15) != 0;
    const int exponent = static_cast<int>((b >> 10) & 0x1f);
    const int fraction = static_cast<int>(b & 0x3ff);
    const float got = HalfToFloat(bits);
    ASSERT_EQ(std::signbit(got), negative) << std::hex << b;
    if (exponent == 31) {
      if (fraction == 0) {
        ASSERT_TRUE(std::isinf(got)) << std::hex << b;
      } else {
        ASSERT_TRUE(std::isnan(got)) << std::hex << b;
      }
      continue;
    }
    const double magnitude =
        exponent == 0 ? std::ldexp(fraction, -24) : std::ldexp(1024 + fraction, exponent - 25);
    ASSERT_EQ(static_cast<double>(got), negative ? -magnitude : magnitude) << std::hex << b;
  }
}

// A float16 file (as numpy.save writes one) reads as float32: shape, size and every value.
TEST(NpyRead, ReadsFloat16WidenedToFloat32) {
  const std::string path = TestDir() + "/half.npy";
  const uint16_t bits[] = {0x0000, 0x8000, 0x3c00, 0xc100, 0x0001, 0x7bff, 0x3555, 0x7c00};
  const float want[] = {0.0f, -0.0f, 1.0f, -2.5f, 0x1p-24f, 65504.0f, 0.333251953125f, INFINITY};
  std::string bytes = MakeNpy("{'descr': '<f2', 'fortran_order': False, 'shape': (2, 4), }", 1, 0);
  bytes.append(reinterpret_cast<const char*>(bits), sizeof bits);
  WriteBytes(path, bytes);
  absl::StatusOr<NpyArray> array = ReadNpyF32(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape(), (std::vector<int64_t>{2, 4}));
  ASSERT_EQ(array->size(), 8);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(array->data()[i]), std::bit_cast<uint32_t>(want[i])) << i;
  }
  // The widened values move with the array.
  NpyArray moved = *std::move(array);
  EXPECT_EQ(moved.data()[2], 1.0f);
  EXPECT_EQ(moved.size(), 8);
}

TEST(NpyRead, MissingFileIsNotFound) {
  const std::string path = TestDir() + "/nope.npy";
  absl::StatusOr<NpyArray> array = ReadNpyF32(path);
  ASSERT_EQ(array.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(ContainsPath(std::string(array.status().message()), path));
  EXPECT_NE(array.status().message().find("does not exist"), std::string::npos);
}

struct BadCase {
  const char* name;
  std::string bytes;
  const char* expected;  // phrase the one-line message must contain
};

TEST(NpyRead, RejectsMalformedFilesWithPreciseMessages) {
  const std::string dir = TestDir();
  const std::string good_dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  std::string bad_magic = MakeNpy(good_dict, 1, 24);
  bad_magic[1] = 'X';
  std::string v3 = MakeNpy(good_dict, 1, 24);
  v3[6] = 3;
  std::string huge_header_len = MakeNpy(good_dict, 1, 0);
  huge_header_len[8] = '\xff';
  huge_header_len[9] = '\x7f';
  const BadCase cases[] = {
      {"empty.npy", "", "is not a .npy file"},
      {"short.npy", "\x93NUM", "is not a .npy file"},
      {"magic.npy", bad_magic, "is not a .npy file"},
      {"text.npy", std::string(100, 'a'), "is not a .npy file"},
      {"v3.npy", v3, "unsupported .npy format version 3.0"},
      {"hlen.npy", huge_header_len, "-byte header but only"},
      {"list.npy", MakeNpy("['<f4', False, (2, 3)]", 1, 24), "header that is not a dict"},
      {"syntax.npy", MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)", 1, 24),
       "malformed header"},
      {"junk.npy", MakeNpy("{'descr': '<f4'} extra", 1, 24), "malformed header"},
      {"nodescr.npy", MakeNpy("{'fortran_order': False, 'shape': (2, 3)}", 1, 24),
       "has no 'descr'"},
      {"noshape.npy", MakeNpy("{'descr': '<f4', 'fortran_order': False}", 1, 24), "has no 'shape'"},
      {"f8.npy", MakeNpy("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }", 1, 24),
       "has dtype '<f8'; expected float32 '<f4'"},
      {"be.npy", MakeNpy("{'descr': '>f4', 'fortran_order': False, 'shape': (6,), }", 1, 24),
       "has dtype '>f4'; expected float32 '<f4'"},
      {"be2.npy", MakeNpy("{'descr': '>f2', 'fortran_order': False, 'shape': (6,), }", 1, 12),
       "has dtype '>f2'; expected float32 '<f4' or float16 '<f2'"},
      {"f2trunc.npy", MakeNpy("{'descr': '<f2', 'fortran_order': False, 'shape': (6,), }", 1, 10),
       "is truncated: shape [6] needs 12 data bytes but the file has 10"},
      {"f2trail.npy", MakeNpy("{'descr': '<f2', 'fortran_order': False, 'shape': (6,), }", 1, 16),
       "has 4 trailing bytes"},
      {"f2misaligned.npy",
       MakeNpy("{'descr': '<f2', 'fortran_order': False, 'shape': (6,)}", 1, 12, 64, 1),
       "not a multiple of 2, so it cannot be mapped as float16"},
      {"struct.npy",
       MakeNpy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,), }", 1, 24),
       "structured dtype"},
      {"fortran.npy", MakeNpy("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 1, 24),
       "Fortran order"},
      {"fortran_int.npy", MakeNpy("{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }", 1, 24),
       "has fortran_order 0"},
      {"negdim.npy", MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 3), }", 1, 24),
       "malformed shape (-2, 3)"},
      {"floatdim.npy",
       MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (2.5, 3), }", 1, 24),
       "malformed shape (2.5, 3)"},
      {"strdim.npy", MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': ('a',), }", 1, 24),
       "malformed shape"},
      {"listshape.npy",
       MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3], }", 1, 24),
       "malformed shape [2, 3]"},
      {"intshape.npy", MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': 6, }", 1, 24),
       "malformed shape 6"},
      {"overflow.npy",
       MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", 1,
               0),
       "does not fit in 64 bits"},
      {"truncated.npy", MakeNpy(good_dict, 1, 20),
       "is truncated: shape [2, 3] needs 24 data bytes but the file has 20"},
      {"trailing.npy", MakeNpy(good_dict, 1, 28), "has 4 trailing bytes"},
      {"misaligned.npy",
       MakeNpy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}", 1, 24, 64, 2),
       "not a multiple of 4"},
  };
  for (const BadCase& c : cases) {
    const std::string path = dir + "/" + c.name;
    WriteBytes(path, c.bytes);
    absl::StatusOr<NpyArray> array = ReadNpyF32(path);
    ASSERT_FALSE(array.ok()) << c.name;
    const std::string message(array.status().message());
    EXPECT_EQ(array.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << c.name << ": \"" << message << "\" lacks \"" << c.expected << "\"";
    EXPECT_TRUE(ContainsPath(message, path)) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(NpyRead, TruncatedRealFileSaysExpectedAndActualBytes) {
  const std::string path = TestDir() + "/scores.npy";
  const std::vector<float> values = Iota(1000);
  ASSERT_TRUE(WriteNpyF32(path, {10, 100}, values.data()).ok());
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(fs::file_size(path) - 100)), 0);
  absl::StatusOr<NpyArray> array = ReadNpyF32(path);
  ASSERT_FALSE(array.ok());
  EXPECT_NE(array.status().message().find("needs 4000 data bytes but the file has 3900"),
            std::string::npos)
      << array.status();
}

TEST(NpyRead, DirectoryIsRejected) {
  const std::string dir = TestDir();
  absl::StatusOr<NpyArray> array = ReadNpyF32(dir);
  ASSERT_FALSE(array.ok());
  EXPECT_NE(array.status().message().find("is not a regular file"), std::string::npos);
}

TEST(NpyArray, MoveKeepsTheMappingAlive) {
  const std::string path = TestDir() + "/m.npy";
  const std::vector<float> values = Iota(64);
  ASSERT_TRUE(WriteNpyF32(path, {64}, values.data()).ok());
  absl::StatusOr<NpyArray> read = ReadNpyF32(path);
  ASSERT_TRUE(read.ok());
  NpyArray a = *std::move(read);
  const float* data = a.data();
  NpyArray b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(a.size(), 0);
  EXPECT_EQ(b.data(), data);
  NpyArray c;
  c = std::move(b);
  EXPECT_EQ(c.data()[63], 63.5f);
  // The mapping survives the file being deleted, as the trace loader relies on.
  fs::remove(path);
  EXPECT_EQ(c.data()[10], 10.5f);
}

TEST(NpyWrite, ReplacesAnExistingFile) {
  const std::string path = TestDir() + "/r.npy";
  const std::vector<float> first = Iota(4), second = Iota(6, 100);
  ASSERT_TRUE(WriteNpyF32(path, {4}, first.data()).ok());
  absl::StatusOr<NpyArray> old = ReadNpyF32(path);
  ASSERT_TRUE(old.ok());
  ASSERT_TRUE(WriteNpyF32(path, {2, 3}, second.data()).ok());
  absl::StatusOr<NpyArray> now = ReadNpyF32(path);
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->shape(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(now->data()[5], 105.0f);
  // A reader that mapped the old file keeps seeing the old contents.
  EXPECT_EQ(old->shape(), std::vector<int64_t>{4});
  EXPECT_EQ(old->data()[3], 3.5f);
}

TEST(NpyWrite, MissingDirectoryIsAnError) {
  const std::string path = TestDir() + "/no/such/dir/x.npy";
  const float v = 1;
  absl::Status status = WriteNpyF32(path, {1}, &v);
  ASSERT_FALSE(status.ok());
  EXPECT_TRUE(ContainsPath(std::string(status.message()), path)) << status;
}

TEST(NpyWrite, RejectsNegativeShape) {
  const float v = 1;
  absl::Status status = WriteNpyF32(TestDir() + "/n.npy", {-1}, &v);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("invalid shape [-1]"), std::string::npos) << status;
}

TEST(NpyWriter, StreamsAndAppearsOnlyOnClose) {
  const std::string dir = TestDir();
  const std::string path = dir + "/s.npy";
  absl::StatusOr<NpyWriter> writer = NpyWriter::Open(path, {3, 5, 7});
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ(writer->total(), 105);
  const std::vector<float> values = Iota(105);
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(writer->Write(values.data() + step * 35, 35).ok());
    EXPECT_FALSE(fs::exists(path));
  }
  EXPECT_EQ(writer->written(), 105);
  EXPECT_EQ(writer->Write(values.data(), 1).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(writer->Close().ok());
  EXPECT_FALSE(writer->is_open());
  EXPECT_EQ(FilesIn(dir), std::vector<std::string>{"s.npy"});

  absl::StatusOr<NpyArray> array = ReadNpyF32(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(std::memcmp(array->data(), values.data(), 105 * sizeof(float)), 0);
  // Identical to the one-shot writer, byte for byte.
  ASSERT_TRUE(WriteNpyF32(dir + "/w.npy", {3, 5, 7}, values.data()).ok());
  EXPECT_EQ(ReadBytes(path), ReadBytes(dir + "/w.npy"));
}

TEST(NpyWriter, ShortCloseLeavesNothing) {
  const std::string dir = TestDir();
  absl::StatusOr<NpyWriter> writer = NpyWriter::Open(dir + "/s.npy", {10});
  ASSERT_TRUE(writer.ok());
  const std::vector<float> values = Iota(10);
  ASSERT_TRUE(writer->Write(values.data(), 9).ok());
  absl::Status status = writer->Close();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("after 9 of 10 floats"), std::string::npos) << status;
  EXPECT_TRUE(FilesIn(dir).empty());
  EXPECT_EQ(writer->Close().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(NpyWriter, AbandonedWriterRemovesItsTemporaryFile) {
  const std::string dir = TestDir();
  {
    absl::StatusOr<NpyWriter> writer = NpyWriter::Open(dir + "/a.npy", {4});
    ASSERT_TRUE(writer.ok());
    EXPECT_EQ(FilesIn(dir).size(), 1u);  // the temporary file
    NpyWriter moved = *std::move(writer);
    const float v[2] = {1, 2};
    ASSERT_TRUE(moved.Write(v, 2).ok());
  }
  EXPECT_TRUE(FilesIn(dir).empty());
}

TEST(NpyWriter, ConcurrentWritersToOnePathDoNotShareATemporaryFile) {
  const std::string path = TestDir() + "/c.npy";
  absl::StatusOr<NpyWriter> a = NpyWriter::Open(path, {2});
  absl::StatusOr<NpyWriter> b = NpyWriter::Open(path, {3});
  ASSERT_TRUE(a.ok() && b.ok());
  const float v[3] = {1, 2, 3};
  ASSERT_TRUE(a->Write(v, 2).ok());
  ASSERT_TRUE(b->Write(v, 3).ok());
  ASSERT_TRUE(a->Close().ok());
  ASSERT_TRUE(b->Close().ok());
  absl::StatusOr<NpyArray> array = ReadNpyF32(path);
  ASSERT_TRUE(array.ok()) << array.status();
  EXPECT_EQ(array->shape(), std::vector<int64_t>{3});  // the last rename wins, whole
}

}  // namespace
}  // namespace spin
