// Host-side parts of the reference indexer toolkit (kernels/include/spin/paged_indexer.h,
// row_topk.h): fp8 decoding, kernel names, and the row top-k reference. Built without CUDA too,
// so CPU engines and tests use the same definitions.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "spin/paged_indexer.h"
#include "spin/row_topk.h"

namespace spin {

const char* IndexerKernelName(IndexerKernel k) {
  return k == IndexerKernel::kWgmma ? "wgmma" : "mma.sync";
}

float Fp8E4m3ToFloat(uint8_t v) {
  const int sign = v >> 7, exp = (v >> 3) & 0xF, man = v & 7;
  if (exp == 0xF && man == 7) return NAN;
  const float mag = exp == 0 ? std::ldexp(static_cast<float>(man) / 8.0f, -6)
                             : std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
  return sign ? -mag : mag;
}

absl::Status ValidateRowTopK(const RowTopKArgs& a) {
  if (a.rows < 0) return absl::InvalidArgumentError(absl::StrCat("rows ", a.rows, " < 0"));
  if (a.k < 1 || a.k > kRowTopKMaxK) {
    return absl::InvalidArgumentError(absl::StrCat("k ", a.k, " outside [1, ", kRowTopKMaxK, "]"));
  }
  if (a.width < 0 || a.width > a.logits_stride) {
    return absl::InvalidArgumentError(
        absl::StrCat("width ", a.width, " outside [0, logits stride ", a.logits_stride, "]"));
  }
  if (a.out_stride < a.k) {
    return absl::InvalidArgumentError(absl::StrCat("out stride ", a.out_stride, " below k ", a.k));
  }
  if (a.rows > 0 && (a.logits == nullptr || a.lens == nullptr || a.out == nullptr)) {
    return absl::InvalidArgumentError("null logits, lens or out");
  }
  return absl::OkStatus();
}

absl::Status RowTopKHost(const RowTopKArgs& a) {
  if (absl::Status s = ValidateRowTopK(a); !s.ok()) return s;
  std::vector<int32_t> idx;
  std::vector<uint32_t> key;
  for (int32_t r = 0; r < a.rows; ++r) {
    const float* x = a.logits + r * a.logits_stride;
    int32_t* o = a.out + r * a.out_stride;
    const int64_t len = std::clamp<int64_t>(a.lens[r], 0, a.width);
    key.resize(len);
    for (int64_t i = 0; i < len; ++i) {
      uint32_t bits;
      std::memcpy(&bits, x + i, sizeof(bits));
      key[i] = RowTopKKey(bits);
    }
    idx.resize(len);
    for (int64_t i = 0; i < len; ++i) idx[i] = static_cast<int32_t>(i);
    const int64_t take = std::min<int64_t>(a.k, len);
    if (take < len) {
      std::nth_element(idx.begin(), idx.begin() + (take - 1), idx.end(), [&](int32_t p, int32_t q) {
        return key[p] > key[q] || (key[p] == key[q] && p < q);
      });
    }
    std::sort(idx.begin(), idx.begin() + take);
    for (int64_t j = 0; j < a.k; ++j) o[j] = j < take ? idx[j] : -1;
  }
  return absl::OkStatus();
}

}  // namespace spin
