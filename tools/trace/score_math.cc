#include "score_math.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace spin {

void TopKSlots(const float* scores, int n, int k, std::vector<int32_t>* ids) {
  ids->clear();
  for (int i = 0; i < n; ++i) {
    if (std::isfinite(scores[i])) ids->push_back(i);
  }
  const auto better = [scores](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  if (k < 0) k = 0;
  if (static_cast<int>(ids->size()) > k) {
    std::nth_element(ids->begin(), ids->begin() + k, ids->end(), better);
    ids->resize(k);
  }
  std::sort(ids->begin(), ids->end());
}

double Pearson(const float* a, const float* b, int n) {
  double sa = 0, sb = 0;
  int64_t count = 0;
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) continue;
    sa += a[i];
    sb += b[i];
    ++count;
  }
  if (count < 2) return std::numeric_limits<double>::quiet_NaN();
  const double ma = sa / count, mb = sb / count;
  double vaa = 0, vbb = 0, vab = 0;
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) continue;
    const double x = a[i] - ma, y = b[i] - mb;
    vaa += x * x;
    vbb += y * y;
    vab += x * y;
  }
  if (vaa <= 0 || vbb <= 0) return std::numeric_limits<double>::quiet_NaN();
  return vab / std::sqrt(vaa * vbb);
}

int64_t SortedOverlap(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  int64_t common = 0;
  for (size_t x = 0, y = 0; x < a.size() && y < b.size();) {
    if (a[x] == b[y]) {
      ++common;
      ++x;
      ++y;
    } else if (a[x] < b[y]) {
      ++x;
    } else {
      ++y;
    }
  }
  return common;
}

double NearestRankPercentile(std::vector<double>* v, double p) {
  if (v->empty()) return 0.0;
  std::sort(v->begin(), v->end());
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(v->size())));
  return (*v)[std::clamp<size_t>(rank, 1, v->size()) - 1];
}

}  // namespace spin
