// Test helpers: an arena in host memory with a CPU data plane, and direct access to its state.
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "spin/arena.h"
#include "spin/data_plane.h"
#include "spin/data_plane_setup.h"
#include "spin/numerics.h"

namespace spin::testing {

/// An arena in host memory with a CPU data plane over it (NewDataPlane).
class TestArena {
 public:
  explicit TestArena(const Geometry& g, const Policy& p = Policy{}, uint64_t seed = 7) {
    auto dp = NewDataPlane({.geometry = g, .seed = seed, .policy = p});
    EXPECT_TRUE(dp.ok()) << dp.status();
    dp_ = std::move(*dp);
    view_ = dp_->arena();
    bytes_ = ArenaBytes(g);
  }

  DataPlane& dp() { return *dp_; }
  const ArenaView& view() const { return view_; }
  uint8_t* base() const { return reinterpret_cast<uint8_t*>(view_.header); }
  uint64_t bytes() const { return bytes_; }

  /// State element i of V (which=0) or D (which=1) for (seq, layer), as float.
  float Get(int seq, int layer, int which, int i) const {
    const uint8_t* rec = view_.StateRecord(seq, layer);
    const uint64_t at = static_cast<uint64_t>(which) * view_.geometry.max_slots + i;
    if (view_.geometry.dtype == StateDtype::kFp32) return reinterpret_cast<const float*>(rec)[at];
    return Bf16ToFloat(reinterpret_cast<const uint16_t*>(rec)[at]);
  }
  /// Writes a state element, and for V refreshes its block's summary (arena.h) as every backend
  /// does, so the arena stays valid.
  void Set(int seq, int layer, int which, int i, float v) {
    uint8_t* rec = view_.StateRecord(seq, layer);
    const uint64_t at = static_cast<uint64_t>(which) * view_.geometry.max_slots + i;
    if (view_.geometry.dtype == StateDtype::kFp32) {
      reinterpret_cast<float*>(rec)[at] = v;
    } else {
      reinterpret_cast<uint16_t*>(rec)[at] = FloatToBf16(v);
    }
    if (which != 0) return;
    // The block's summary (arena.h, off_vsum): NaN if any V entry is unset, else the largest.
    const int b = static_cast<int>(view_.geometry.block_size), j = i / b;
    const int end = std::min<int>((j + 1) * b, static_cast<int>(view_.geometry.max_slots));
    float m = -INFINITY;
    for (int k = j * b; k < end; ++k) {
      const float x = Get(seq, layer, 0, k);
      m = std::isnan(x) || std::isnan(m) ? NAN : std::max(m, x);
    }
    view_.VSummaries(seq, layer)[j] = m == 0.0f ? 0.0f : m;
  }
  void SetFresh(int seq, int layer, bool fresh) {
    view_.fresh[static_cast<uint64_t>(seq) * view_.geometry.layers + layer] = fresh ? 1 : 0;
  }
  bool Fresh(int seq, int layer) const {
    return view_.fresh[static_cast<uint64_t>(seq) * view_.geometry.layers + layer] != 0;
  }

  /// Selected blocks (union) of batch entry e after the last Select.
  std::vector<int> Selected(int e = 0) const {
    const int32_t* ids = view_.union_ids + static_cast<int64_t>(e) * view_.max_blocks;
    return std::vector<int>(ids, ids + view_.union_count[e]);
  }

  /// Snapshot of the whole arena, to check that a rejected call changed nothing.
  std::vector<uint8_t> Snapshot() const { return {base(), base() + bytes_}; }

 private:
  std::unique_ptr<DataPlane> dp_;  // owns the arena
  ArenaView view_;
  uint64_t bytes_ = 0;
};

/// One-entry batch over host arrays that outlive the call.
struct OneSeqStep {
  int32_t seq = 0, ctx = 0, q = 0;
  StepBatch batch(int rows = 1) const { return StepBatch{&seq, &ctx, &q, 1, rows}; }
};

}  // namespace spin::testing
