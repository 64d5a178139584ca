// What a per-layer budget recompute costs (docs/budgets.md): the allocator alone, and a
// controller update that absorbs a probe snapshot and recomputes, for model-sized sessions.
// Run: build/bench/budget_bench
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "spin/budget.h"

namespace spin {
namespace {

// Noisy decreasing curves, different per layer (a few layers several times harder).
std::vector<MissCurve> Curves(int layers, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<MissCurve> out(layers);
  for (int l = 0; l < layers; ++l) {
    const double scale = 0.05 + 0.6 * u(rng) * u(rng);
    for (int p = 0; p < kCurvePoints; ++p) {
      const double f = CurveKeepFraction(p);
      out[l][p] = std::max(0.0, scale * std::pow(1 - f, 1.5) + 0.01 * (u(rng) - 0.5));
    }
  }
  return out;
}

void BM_Allocate(benchmark::State& state) {
  AllocationInput in;
  in.curves = Curves(static_cast<int>(state.range(0)), 3);
  in.num_blocks = static_cast<int32_t>(state.range(1));
  in.topk = 2048;
  in.block_size = 64;
  in.target_sparsity = 0.5;
  for (auto _ : state) {
    absl::StatusOr<Allocation> a = AllocateBudgets(in);
    benchmark::DoNotOptimize(a);
  }
}
// Layers x blocks: V4-Flash (21 CSA layers) and V3.2 (61 layers) at 16K-1M slots of 64.
BENCHMARK(BM_Allocate)
    ->Args({21, 256})
    ->Args({21, 4096})
    ->Args({21, 16384})
    ->Args({61, 4096})
    ->Args({61, 16384})
    ->Unit(benchmark::kMicrosecond);

// One probe-thread pass that recomputes: snapshot in, table out (drift threshold 0 forces it).
void BM_ControllerRecompute(benchmark::State& state) {
  const int layers = static_cast<int>(state.range(0));
  Geometry g;
  g.layers = layers;
  g.max_seqs = 1;
  g.max_slots = static_cast<uint32_t>(state.range(1)) * 64;
  g.block_size = 64;
  g.topk = 2048;
  BudgetTuning t;
  t.drift_threshold = 0;
  BudgetController c(g, t);
  std::vector<uint64_t> curves(static_cast<size_t>(layers) * kCurvePoints, 0);
  std::vector<LayerStats> stats(layers, LayerStats{});
  const std::vector<MissCurve> shape = Curves(layers, 5);
  uint64_t recomputes = 0;
  for (auto _ : state) {
    for (int l = 0; l < layers; ++l) {
      stats[l].steps += 8;
      stats[l].blocks_total += 8 * static_cast<uint64_t>(state.range(1));
      stats[l].probe_steps += 1;
      stats[l].probe_topk += 2048;
      for (int p = 0; p < kCurvePoints; ++p) {
        curves[static_cast<size_t>(l) * kCurvePoints + p] +=
            static_cast<uint64_t>(2048 * shape[l][p]) + (stats[l].probe_steps % 3);
      }
    }
    absl::StatusOr<std::optional<BudgetUpdate>> u = c.Update(ProbeSnapshot{curves, stats}, 0.5);
    recomputes += u.ok() && u->has_value();
  }
  state.counters["recomputed"] =
      benchmark::Counter(static_cast<double>(recomputes) / static_cast<double>(state.iterations()));
}
BENCHMARK(BM_ControllerRecompute)
    ->Args({21, 4096})
    ->Args({61, 16384})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace spin

BENCHMARK_MAIN();
