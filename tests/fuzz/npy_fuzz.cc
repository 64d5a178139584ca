// libFuzzer target: the .npy reader (tools/trace/npy.cc). The input is a whole .npy file.
//
// Properties checked, besides "no crash, no sanitizer report":
//  - ReadNpyF32 on the input written to a file agrees with ParseNpyF32 on the bytes in memory
//    (same verdict, same message, same shape and element count);
//  - an accepted file's shape accounts for every byte (header + item * count == size, item 4
//    for '<f4' and 2 for '<f2'), and every element reads back: the mapped bytes for float32,
//    HalfToFloat of each value for float16;
//  - the header NpyF32Header writes for that shape, followed by the same float32 data, reads
//    back with the same shape and data.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using spin::fuzz::ScratchDir;
  static const std::string path = ScratchDir() + "/input.npy";
  static const std::string again = ScratchDir() + "/again.npy";

  std::vector<int64_t> shape;
  int64_t count = -1;
  size_t offset = 0;
  int item = 0;
  const absl::Status parsed = spin::ParseNpyF32(path, data, size, &shape, &count, &offset, &item);

  spin::fuzz::WriteFileOrDie(path, data, size);
  const absl::StatusOr<spin::NpyArray> read = spin::ReadNpyF32(path);
  FUZZ_CHECK(parsed.ok() == read.ok(), "in memory: %s\n  from the file: %s",
             parsed.ToString().c_str(), read.status().ToString().c_str());
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed == read.status(), "in memory: %s\n  from the file: %s",
               parsed.ToString().c_str(), read.status().ToString().c_str());
    FUZZ_CHECK(parsed.code() == absl::StatusCode::kInvalidArgument, "%s",
               parsed.ToString().c_str());
    // One line naming the file, as spinctl prints it.
    FUZZ_CHECK(parsed.message().find('\n') == absl::string_view::npos &&
                   parsed.message().substr(0, path.size()) == path,
               "%s", parsed.ToString().c_str());
    return 0;
  }
  FUZZ_CHECK(read->shape() == shape && read->size() == count, "shape differs");
  int64_t product = 1;
  for (int64_t d : shape) product *= d;  // cannot overflow: the reader checked
  FUZZ_CHECK(product == count, "count %lld is not the shape's product %lld",
             static_cast<long long>(count), static_cast<long long>(product));
  FUZZ_CHECK(item == 4 || item == 2, "element size %d", item);
  FUZZ_CHECK(offset + item * static_cast<uint64_t>(count) == size, "bytes unaccounted for");
  std::vector<float> values(static_cast<size_t>(count));
  if (item == 4) {
    if (count > 0) std::memcpy(values.data(), data + offset, 4 * static_cast<size_t>(count));
  } else {
    for (int64_t i = 0; i < count; ++i) {
      uint16_t bits;
      std::memcpy(&bits, data + offset + 2 * i, 2);
      values[static_cast<size_t>(i)] = spin::HalfToFloat(bits);
    }
  }
  FUZZ_CHECK(count == 0 || std::memcmp(read->data(), values.data(), 4 * values.size()) == 0,
             "the data read differs from the file's");

  // Round trip through the writer's header, with the data as float32.
  const std::string header = spin::NpyF32Header(shape);
  std::string rewritten = header;
  rewritten.append(reinterpret_cast<const char*>(values.data()), 4 * values.size());
  std::vector<int64_t> shape2;
  int64_t count2 = -1;
  size_t offset2 = 0;
  const absl::Status back =
      spin::ParseNpyF32(again, reinterpret_cast<const uint8_t*>(rewritten.data()), rewritten.size(),
                        &shape2, &count2, &offset2);
  FUZZ_CHECK(back.ok(), "NpyF32Header's own output is rejected: %s", back.ToString().c_str());
  FUZZ_CHECK(shape2 == shape && count2 == count && offset2 == header.size() && offset2 % 64 == 0,
             "round trip changed the shape or the data offset");
  return 0;
}
