// The data-plane interface driven through spind's remote-mode RPCs (OpenSequences,
// PredictMasks, ObserveScores, GetStats), for tools and tests: `spinctl replay --remote` runs
// the same engine loop as offline replay over it. A host-memory mirror arena holds what the
// RPCs return (outputs and statistics), so callers read results exactly as from a local arena.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "spin/data_plane.h"
#include "spin/v1/spin.grpc.pb.h"

namespace spin::client {

/// A DataPlane whose operations run inside spind on the session's arena.
class RemoteDataPlane final : public DataPlane {
 public:
  /// `geometry` must be the session's.
  static absl::StatusOr<std::unique_ptr<RemoteDataPlane>> Create(spin::v1::Spin::Stub* stub,
                                                                 std::string session_id,
                                                                 std::string token,
                                                                 const Geometry& geometry);
  ~RemoteDataPlane() override;

  const ArenaView& arena() const override { return mirror_; }
  absl::Status ResetSequence(int32_t seq, uint64_t key, cudaStream_t stream = nullptr) override;
  absl::Status BeginStep(const StepBatch& batch, cudaStream_t stream = nullptr) override;
  absl::Status Select(int32_t layer, const int32_t* block_table = nullptr, int64_t table_stride = 0,
                      cudaStream_t stream = nullptr) override;
  absl::Status Remap(int32_t* idx, int32_t count, cudaStream_t stream = nullptr) override;
  /// Checks every argument on the mirror first (layer, selection, logits buffer and stride,
  /// accepted counts): the logits are read for the request only once they are known to cover
  /// every compacted row. Then ObserveScores.
  absl::Status Observe(int32_t layer, const float* logits, int64_t logits_stride,
                       const int32_t* accepted = nullptr, cudaStream_t stream = nullptr) override;
  /// Observe's checks and the top-K buffer's first, then the local remap and ObserveScores; only
  /// a failed RPC leaves the top-K mapped. The top-K is computed by spind (it is sent the
  /// logits, not the top-K).
  absl::Status RemapAndObserve(int32_t layer, int32_t* idx, int32_t count, const float* logits,
                               int64_t logits_stride, const int32_t* accepted = nullptr,
                               cudaStream_t stream = nullptr) override;

 private:
  RemoteDataPlane() = default;
  absl::Status RefreshStats();
  // ObserveScores of checked arguments.
  absl::Status SendScores(int32_t layer, const float* logits, int64_t logits_stride,
                          const int32_t* accepted);
  spin::v1::SessionRef Ref() const;

  spin::v1::Spin::Stub* stub_ = nullptr;
  std::string id_, token_;
  std::unique_ptr<DataPlane> local_;  // owns the mirror arena; Remap over the mirrored outputs
  ArenaView mirror_;                  // local_'s arena
  bool pending_begin_ = false;
  std::vector<int32_t> seq_, ctx_, q_;
  int32_t rows_ = 1;
};

}  // namespace spin::client
