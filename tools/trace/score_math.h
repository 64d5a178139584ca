// Small statistics over indexer scores shared by the trace generator, replay and the quality
// study: top-K slot ids, Pearson correlation, overlap of sorted id lists, percentiles.
#pragma once

#include <cstdint>
#include <vector>

namespace spin {

/// The k highest of scores[0, n) (non-finite excluded, ties to the lower id), as slot ids
/// sorted ascending.
void TopKSlots(const float* scores, int n, int k, std::vector<int32_t>* ids);

/// Pearson correlation over the slots where both are finite (two passes: scores can sit far
/// from zero). NaN with fewer than two such slots or without variance.
double Pearson(const float* a, const float* b, int n);

/// Ids two ascending lists have in common.
int64_t SortedOverlap(const std::vector<int32_t>& a, const std::vector<int32_t>& b);

/// Nearest-rank percentile p in [0, 1] of a sample (sorted in place); 0 for an empty one.
double NearestRankPercentile(std::vector<double>* v, double p);

}  // namespace spin
