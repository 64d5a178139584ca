// Throughput of SPIN's own per-step work on the CPU backend: Select + Observe of one
// (sequence, layer) per iteration, in slot-steps per second. The engine's indexer is not timed:
// the logits it would produce are a fixed random buffer.
#include <memory>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "spin/data_plane_setup.h"

namespace spin {
namespace {

void BM_SelectObserve(benchmark::State& state) {
  const int32_t slots = static_cast<int32_t>(state.range(0));
  const StateDtype dtype = state.range(1) == 16 ? StateDtype::kBf16 : StateDtype::kFp32;
  Geometry g;
  g.layers = 1;
  g.max_seqs = 1;
  g.max_slots = static_cast<uint32_t>(slots);
  g.block_size = 64;
  g.topk = 2048;
  g.dtype = dtype;
  DataPlaneSpec spec;
  spec.geometry = g;
  spec.seed = 1;
  spec.policy.target_sparsity = 0.5;
  spec.policy.exploration = 0.05;
  std::unique_ptr<DataPlane> dp = *NewDataPlane(spec);
  const ArenaView& view = dp->arena();
  if (!dp->ResetSequence(0, 1).ok()) state.SkipWithError("reset failed");

  std::mt19937 rng(1);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::vector<float> logits(slots);
  for (float& z : logits) z = gauss(rng);
  const int32_t seq = 0, ctx = slots, q = slots - 1;
  const StepBatch batch{&seq, &ctx, &q, 1, 1};
  for (auto _ : state) {
    if (!dp->BeginStep(batch).ok() || !dp->Select(0).ok() ||
        !dp->Observe(0, logits.data(), slots).ok()) {
      state.SkipWithError("data plane call failed");
      break;
    }
    benchmark::DoNotOptimize(view.union_count[0]);
  }
  state.counters["slot_steps_per_s"] =
      benchmark::Counter(static_cast<double>(slots), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["kept_ratio"] = static_cast<double>(view.union_count[0]) / ((slots + 63) / 64);
}

BENCHMARK(BM_SelectObserve)
    ->ArgNames({"slots", "state_bits"})
    ->ArgsProduct({{8 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10}, {32, 16}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace spin

BENCHMARK_MAIN();
