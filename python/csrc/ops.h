// The torch ops of the spind package, over libspin_client: what a Python engine (a vLLM worker)
// calls at every decode step. Three files: schema.cc registers every op (its schema, with named
// arguments, and its kernels); session_ops.cc holds the sessions and the ops between steps;
// step_ops.cc the per-step ops; indexer_op.cc the reference indexer and the row top-k.
//
// A session is an int64 handle (sessions live in session_ops.cc's registry, so the ops take and
// return only torch types). Two kinds:
//   - attached to spind at `target` through client::ResilientDataPlane: fail-open, dense while
//     the daemon is away, switched to a new session at the next refresh/begin_step;
//   - local (empty target): a data plane with a private arena in this process, with the
//     per-layer budgets run by `refresh` (what `spinctl replay` does without a daemon).
// Budget modes and state dtypes cross the boundary as their text form (spin/arena.h's codec).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "resilient_data_plane.h"
#include "spin/arena.h"
#include "spin/data_plane.h"
#include "spin/data_plane_setup.h"

namespace spind_torch {

/// One session.
struct Handle {
  spin::Geometry geometry;
  int device = -1;  ///< CUDA ordinal of the arena, -1: host memory
  /// Attached to spind.
  std::unique_ptr<spin::client::ResilientDataPlane> resilient;
  /// Local: the data plane owns its arena; per-layer sessions also run their budgets here.
  std::unique_ptr<spin::DataPlane> local;
  std::optional<spin::LocalBudgets> budgets;
  bool write_initial_table = false;  ///< local per-layer: at the first begin_step
  int64_t steps_begun = 0;
  /// The last begun step's entries and rows: what the per-layer ops' tensors must cover.
  int64_t step_n = 0, step_rows = 0;

  spin::DataPlane& dp() { return resilient ? static_cast<spin::DataPlane&>(*resilient) : *local; }
};

// Shared by the op files (session_ops.cc).

/// Fails the op with the status's message (a RuntimeError in Python).
void Check(const absl::Status& s, const char* op);
/// The session of handle `h`; fails the op when there is none.
std::shared_ptr<Handle> Get(int64_t h);
/// The stream the per-step ops enqueue on: torch's current CUDA stream for device sessions.
cudaStream_t Stream(Handle& h);
/// Fails unless `t` is on the session's side (CPU tensors for a host arena, CUDA ones else).
void CheckPlace(Handle& s, const at::Tensor& t, const char* what);
/// A contiguous int32 tensor's data, with at least `min_numel` elements.
const int32_t* Int32Data(const at::Tensor& t, const char* what, int64_t min_numel);

// Session ops (session_ops.cc): between steps; they may synchronise and call spind.

int64_t Attach(const std::string& target, int64_t layers, int64_t max_slots, int64_t block_size,
               int64_t topk, int64_t max_sequences, int64_t max_rows, const std::string& state,
               int64_t seed, double target_sparsity, double exploration, double alpha,
               int64_t probe_period, const std::string& budget_mode, double miss_target,
               const std::string& client_name, int64_t device, bool engine_control,
               const std::string& model, bool defer_ema);
void Close(int64_t h);
void ResetSequence(int64_t h, int64_t seq, int64_t key);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> Outputs(int64_t h);
int64_t Refresh(int64_t h);
std::vector<std::string> BudgetModes();
std::tuple<double, double, double, int64_t, std::string, double> GetPolicy(int64_t h);
void SetPolicy(int64_t h, c10::optional<double> target_sparsity, c10::optional<double> exploration,
               c10::optional<double> alpha, c10::optional<int64_t> probe_period,
               c10::optional<std::string> budget_mode, c10::optional<double> miss_target);
at::Tensor Stats(int64_t h);
at::Tensor Budgets(int64_t h);
at::Tensor GetControl(int64_t h);
void AdoptControl(int64_t h, const at::Tensor& control);
std::tuple<bool, int64_t> Link(int64_t h);
std::tuple<int64_t, int64_t, bool, int64_t> Counters(int64_t h);

// Step ops (step_ops.cc): on torch's current stream; no synchronisation, allocation or RPC.

void BeginStep(int64_t h, const at::Tensor& seq, const at::Tensor& ctx_len, const at::Tensor& q_pos,
               int64_t rows, const c10::optional<at::Tensor>& block_table, at::Tensor& token);
void Select(int64_t h, int64_t layer, const c10::optional<at::Tensor>& block_table,
            at::Tensor& union_count, at::Tensor& union_ids, at::Tensor& phys,
            at::Tensor& compact_len, at::Tensor& token);
void Remap(int64_t h, at::Tensor& topk, at::Tensor& token);
void RemapTopK(int64_t h, at::Tensor& topk, at::Tensor& token);
void Observe(int64_t h, int64_t layer, const at::Tensor& logits,
             const c10::optional<at::Tensor>& accepted, at::Tensor& token);
void RemapAndObserve(int64_t h, int64_t layer, at::Tensor& topk, const at::Tensor& logits,
                     const c10::optional<at::Tensor>& accepted, at::Tensor& token);

// The engine's indexer and top-k (indexer_op.cc), one kernel per backend.

void PagedIndexerCpu(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& kv,
                     const at::Tensor& table, const at::Tensor& lens, at::Tensor& logits,
                     int64_t max_pages, int64_t next_n, const std::string& kernel);
void RowTopKCpu(const at::Tensor& logits, const at::Tensor& lens, int64_t k, at::Tensor& out);
#if SPIN_TORCH_CUDA
void PagedIndexerCuda(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& kv,
                      const at::Tensor& table, const at::Tensor& lens, at::Tensor& logits,
                      int64_t max_pages, int64_t next_n, const std::string& kernel);
void RowTopKCuda(const at::Tensor& logits, const at::Tensor& lens, int64_t k, at::Tensor& out);
#endif

}  // namespace spind_torch
