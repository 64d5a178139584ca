// torch ops over libspin_client: what a Python engine (a vLLM worker) calls at every decode step.
//
// A session is an int64 handle (sessions live here, in a registry, so the ops take and return
// only torch types). Two kinds:
//   - attached to spind at `target` through client::ResilientDataPlane: fail-open, dense while
//     the daemon is away, switched to a new session at the next refresh/begin_step;
//   - local (empty target): a private arena and data plane in this process, with the per-layer
//     budget controller run by `refresh` (what `spinctl replay` does without a daemon).
// The per-step ops (begin_step, select, remap, observe) take pointers to the tensors' memory and
// never copy, synchronise or allocate; the outputs of select are views of the arena's output
// buffers (`outputs`), passed back to `select` as the tensors it mutates.
#include <torch/library.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "resilient_data_plane.h"
#include "spin/arena.h"
#include "spin/budget.h"
#include "spin/data_plane.h"
#include "spin_client.h"

namespace spind_torch {
namespace {

using spin::ArenaView;
using spin::BudgetMode;
using spin::DataPlane;

// Fails the op with the status's message (a RuntimeError in Python).
void Check(const absl::Status& s, const char* op) {
  TORCH_CHECK(s.ok(), "spind.", op, ": ", std::string(s.message()));
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

struct Handle {
  std::string target;
  spin::Geometry geometry;
  // Attached to spind.
  std::unique_ptr<spin::client::ResilientDataPlane> resilient;
  // Local.
  std::unique_ptr<void, FreeDeleter> mem;
  std::unique_ptr<DataPlane> local;
  std::optional<spin::BudgetController> budgets;
  std::vector<uint64_t> curves;
  std::vector<spin::LayerStats> stats;
  int64_t steps_begun = 0;
  bool write_uniform_table = false;  // local per-layer: the table starts uniform at the target

  DataPlane& dp() { return resilient ? static_cast<DataPlane&>(*resilient) : *local; }
};

std::mutex registry_mu;
std::map<int64_t, std::shared_ptr<Handle>> registry;
int64_t next_handle = 1;

std::shared_ptr<Handle> Get(int64_t h) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry.find(h);
  TORCH_CHECK(it != registry.end(), "spind: no session with handle ", h,
              " (closed, or never opened)");
  return it->second;
}

BudgetMode ModeOf(const std::string& m) {
  if (m == "uniform") return BudgetMode::kUniform;
  if (m == "per-layer") return BudgetMode::kPerLayer;
  TORCH_CHECK(false, "spind: budget mode '", m, "': use uniform or per-layer");
}

// geometry: [layers, block_size, topk, max_sequences, max_slots, max_rows, state (1 fp32,
// 2 bf16)]; policy: [target_sparsity, exploration, alpha, probe_period].
int64_t Attach(const std::string& target, std::vector<int64_t> geometry, int64_t seed,
               std::vector<double> policy, const std::string& budget_mode,
               const std::string& client_name) {
  TORCH_CHECK(geometry.size() == 7,
              "spind.attach: geometry is [layers, block_size, topk, max_sequences, max_slots, "
              "max_rows, state (1 fp32, 2 bf16)]");
  TORCH_CHECK(policy.size() == 4,
              "spind.attach: policy is [target_sparsity, exploration, alpha, probe_period]");
  for (int64_t v : geometry) {
    TORCH_CHECK(v >= 0 && v <= INT32_MAX, "spind.attach: geometry value ", v, " out of range");
  }
  TORCH_CHECK(geometry[6] == 1 || geometry[6] == 2,
              "spind.attach: state must be 1 (fp32) or 2 (bf16)");
  TORCH_CHECK(policy[3] >= 0 && policy[3] <= UINT32_MAX, "spind.attach: probe_period out of range");
  auto h = std::make_shared<Handle>();
  spin::Geometry& g = h->geometry;
  g.layers = static_cast<uint32_t>(geometry[0]);
  g.block_size = static_cast<uint32_t>(geometry[1]);
  g.topk = static_cast<uint32_t>(geometry[2]);
  g.max_seqs = static_cast<uint32_t>(geometry[3]);
  g.max_slots = static_cast<uint32_t>(geometry[4]);
  g.max_rows = static_cast<uint32_t>(geometry[5]);
  g.dtype = geometry[6] == 2 ? spin::StateDtype::kBf16 : spin::StateDtype::kFp32;
  spin::Policy p;
  p.target_sparsity = policy[0];
  p.exploration = policy[1];
  p.alpha = static_cast<float>(policy[2]);
  p.probe_period = static_cast<uint32_t>(policy[3]);
  p.budget_mode = ModeOf(budget_mode);
  Check(spin::ValidateGeometry(g), "attach");
  Check(spin::ValidatePolicy(p), "attach");
  TORCH_CHECK(seed >= 0, "spind.attach: seed must be >= 0");
  h->target = target;
  if (!target.empty()) {
    spin::client::AttachOptions o;
    o.geometry = g;
    o.policy = p;
    o.seed = static_cast<uint64_t>(seed);
    o.client_name = client_name;
    // Host arenas: spind's CPU backend (the CUDA engine path is CreateOnDevice).
    o.require_backend = 1;
    h->resilient = std::make_unique<spin::client::ResilientDataPlane>(
        target, o, std::chrono::milliseconds(1000));
  } else {
    const uint64_t bytes = spin::ArenaBytes(g);
    h->mem.reset(std::aligned_alloc(spin::kArenaAlign, (bytes + spin::kArenaAlign - 1) /
                                                           spin::kArenaAlign * spin::kArenaAlign));
    TORCH_CHECK(h->mem != nullptr, "spind.attach: cannot allocate a ", bytes, "-byte arena");
    absl::StatusOr<ArenaView> view =
        spin::InitArena(h->mem.get(), bytes, g, static_cast<uint64_t>(seed), p);
    Check(view.status(), "attach");
    h->local = spin::MakeCpuDataPlane(*view);
    if (p.budget_mode == BudgetMode::kPerLayer) {
      h->budgets.emplace(g);
      h->curves.resize(static_cast<size_t>(g.layers) * spin::kCurvePoints);
      h->stats.resize(g.layers);
      h->write_uniform_table = true;  // at the first begin_step, as spind's probe thread does
    }
  }
  std::lock_guard<std::mutex> lock(registry_mu);
  const int64_t id = next_handle++;
  registry[id] = std::move(h);
  return id;
}

void Close(int64_t h) {
  std::shared_ptr<Handle> keep;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = registry.find(h);
    TORCH_CHECK(it != registry.end(), "spind.close: no session with handle ", h);
    keep = std::move(it->second);
    registry.erase(it);
  }
}

void ResetSequence(int64_t h, int64_t seq, int64_t key) {
  auto s = Get(h);
  TORCH_CHECK(seq >= 0 && seq < s->geometry.max_seqs, "spind.reset_sequence: sequence ", seq,
              " outside [0, ", s->geometry.max_seqs, ")");
  Check(s->dp().ResetSequence(static_cast<int32_t>(seq), static_cast<uint64_t>(key)),
        "reset_sequence");
}

const int32_t* Int32Data(const at::Tensor& t, const char* what, int64_t min_numel) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "spind: ", what, " must be int32, not ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "spind: ", what, " must be contiguous");
  TORCH_CHECK(t.numel() >= min_numel, "spind: ", what, " has ", t.numel(),
              " elements; needs at least ", min_numel);
  return t.data_ptr<int32_t>();
}

void CheckPlace(Handle& s, const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() == !s.dp().on_device(), "spind: ", what, " is on ", t.device(),
              " but the session's data plane runs ",
              s.dp().on_device() ? "on the GPU" : "on the CPU");
}

void BeginStep(int64_t h, const at::Tensor& seq, const at::Tensor& ctx_len, const at::Tensor& q_pos,
               int64_t rows) {
  auto s = Get(h);
  const int64_t n = seq.numel();
  TORCH_CHECK(n <= s->geometry.max_seqs, "spind.begin_step: ", n, " entries; the session holds ",
              s->geometry.max_seqs);
  for (const at::Tensor* t : {&seq, &ctx_len, &q_pos}) CheckPlace(*s, *t, "a step tensor");
  const spin::StepBatch b{Int32Data(seq, "seq", n), Int32Data(ctx_len, "ctx_len", n),
                          Int32Data(q_pos, "q_pos", n), static_cast<int32_t>(n),
                          static_cast<int32_t>(rows)};
  if (s->write_uniform_table) {
    const ArenaView& a = s->local->arena();
    const std::vector<double> uniform(a.geometry.layers, a.policy->target_sparsity);
    Check(spin::WriteBudgetTable(a, uniform), "begin_step");
    s->write_uniform_table = false;
  }
  Check(s->dp().BeginStep(b), "begin_step");
  ++s->steps_begun;
}

// The arena's output buffers as tensors: union_count [S], union_ids [S, max_blocks],
// phys [S, max_blocks], compact_len [S, max_rows]. Fixed for a local session; an attached
// session on the CPU backend moves them when it switches daemons (fetch them after refresh).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> Outputs(int64_t h) {
  auto s = Get(h);
  const spin::Outputs o = s->dp().outputs();
  const int64_t S = s->geometry.max_seqs;
  auto opts = at::TensorOptions().dtype(at::kInt).device(
      s->dp().on_device() ? at::Device(at::kCUDA) : at::Device(at::kCPU));
  auto view = [&](const int32_t* p, std::vector<int64_t> shape) {
    return torch::from_blob(const_cast<int32_t*>(p), shape, opts);
  };
  return {view(o.union_count, {S}), view(o.union_ids, {S, o.max_blocks}),
          view(o.phys, {S, o.max_blocks}), view(o.compact_len, {S, o.max_rows})};
}

void Select(int64_t h, int64_t layer, const c10::optional<at::Tensor>& block_table,
            at::Tensor& union_count, at::Tensor& union_ids, at::Tensor& phys,
            at::Tensor& compact_len) {
  auto s = Get(h);
  const spin::Outputs o = s->dp().outputs();
  TORCH_CHECK(union_count.data_ptr() == o.union_count && union_ids.data_ptr() == o.union_ids &&
                  phys.data_ptr() == o.phys && compact_len.data_ptr() == o.compact_len,
              "spind.select: the output tensors are not this session's output buffers (take "
              "them from spind.outputs, again after a refresh)");
  TORCH_CHECK(layer >= 0 && layer < s->geometry.layers, "spind.select: layer ", layer,
              " outside [0, ", s->geometry.layers, ")");
  const int32_t* table = nullptr;
  int64_t stride = 0;
  if (block_table) {
    CheckPlace(*s, *block_table, "block_table");
    TORCH_CHECK(block_table->dim() == 2, "spind.select: block_table must be [entries, blocks]");
    table = Int32Data(*block_table, "block_table", 0);
    stride = block_table->size(1);
  }
  Check(s->dp().Select(static_cast<int32_t>(layer), table, stride), "select");
}

void Remap(int64_t h, at::Tensor& topk) {
  auto s = Get(h);
  CheckPlace(*s, topk, "topk");
  TORCH_CHECK(topk.dim() == 2, "spind.remap: topk must be [entries * rows, count]");
  Check(s->dp().Remap(const_cast<int32_t*>(Int32Data(topk, "topk", 0)),
                      static_cast<int32_t>(topk.size(1))),
        "remap");
}

void Observe(int64_t h, int64_t layer, const at::Tensor& logits,
             const c10::optional<at::Tensor>& accepted) {
  auto s = Get(h);
  CheckPlace(*s, logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "spind.observe: logits must be float32");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "spind.observe: logits must be [entries * rows, width] with unit column stride");
  TORCH_CHECK(layer >= 0 && layer < s->geometry.layers, "spind.observe: layer ", layer,
              " outside [0, ", s->geometry.layers, ")");
  const int32_t* acc = nullptr;
  if (accepted) {
    CheckPlace(*s, *accepted, "accepted");
    acc = Int32Data(*accepted, "accepted", 0);
  }
  Check(
      s->dp().Observe(static_cast<int32_t>(layer), logits.data_ptr<float>(), logits.stride(0), acc),
      "observe");
}

// Between steps. Attached: notices a lost daemon and switches in a new session. Local with
// per-layer budgets: after each probe-period step, feeds the arena's counters to the budget
// controller and writes a new table when it has one (as spind's probe thread does). Returns 1
// when the budget table or the session changed, else 0.
int64_t Refresh(int64_t h) {
  auto s = Get(h);
  if (s->resilient) {
    const std::string before = s->resilient->session_id();
    Check(s->resilient->Refresh(), "refresh");
    return s->resilient->session_id() != before ? 1 : 0;
  }
  if (!s->budgets) return 0;
  const ArenaView& a = s->local->arena();
  const uint32_t period = a.policy->probe_period;
  const int64_t t = s->steps_begun - 1;
  if (period == 0 || t < 0 || t % period != 0) return 0;
  std::copy(a.curves, a.curves + s->curves.size(), s->curves.begin());
  std::copy(a.stats, a.stats + s->stats.size(), s->stats.begin());
  absl::StatusOr<std::optional<spin::BudgetUpdate>> u =
      s->budgets->Update(spin::ProbeSnapshot{s->curves, s->stats}, a.policy->target_sparsity);
  Check(u.status(), "refresh");
  if (!u->has_value()) return 0;
  Check(spin::WriteBudgetTable(a, (*u)->sparsity), "refresh");
  return 1;
}

// [target_sparsity, exploration, alpha, probe_period, budget_mode (0 uniform, 1 per-layer)]
std::vector<double> GetPolicy(int64_t h) {
  auto s = Get(h);
  const spin::ArenaPolicy& p = *s->dp().arena().policy;
  return {p.target_sparsity, p.exploration, p.alpha, static_cast<double>(p.probe_period),
          p.budget_mode == static_cast<uint32_t>(BudgetMode::kPerLayer) ? 1.0 : 0.0};
}

void SetPolicy(int64_t h, c10::optional<double> target_sparsity, c10::optional<double> exploration,
               c10::optional<double> alpha, c10::optional<int64_t> probe_period,
               c10::optional<std::string> budget_mode) {
  auto s = Get(h);
  TORCH_CHECK(!s->resilient,
              "spind.set_policy: attached sessions are tuned through spind "
              "(spinctl policy set); set_policy changes local sessions");
  const spin::ArenaPolicy& cur = *s->dp().arena().policy;
  spin::Policy p;
  p.target_sparsity = target_sparsity.value_or(cur.target_sparsity);
  p.exploration = exploration.value_or(cur.exploration);
  p.alpha = static_cast<float>(alpha.value_or(cur.alpha));
  TORCH_CHECK(!probe_period || (*probe_period >= 0 && *probe_period <= UINT32_MAX),
              "spind.set_policy: probe_period out of range");
  p.probe_period = probe_period ? static_cast<uint32_t>(*probe_period) : cur.probe_period;
  p.budget_mode = budget_mode ? ModeOf(*budget_mode) : static_cast<BudgetMode>(cur.budget_mode);
  Check(spin::ValidatePolicy(p), "set_policy");
  Check(spin::WritePolicy(s->local->arena(), p), "set_policy");
}

// Per layer: steps, dense_steps, probe_steps, blocks_kept, blocks_total, sparse_blocks_kept,
// sparse_blocks_total, observed, bad_scores, probe_topk, probe_missed (int64 [layers, 11]).
at::Tensor Stats(int64_t h) {
  auto s = Get(h);
  const ArenaView& a = s->dp().arena();
  static_assert(sizeof(spin::LayerStats) == 11 * sizeof(uint64_t), "11 counters");
  at::Tensor out = at::empty({static_cast<int64_t>(a.geometry.layers), 11}, at::kLong);
  std::memcpy(out.data_ptr<int64_t>(), a.stats, a.geometry.layers * sizeof(spin::LayerStats));
  return out;
}

// The per-layer sparsity table the kernels use (float64 [layers]).
at::Tensor Budgets(int64_t h) {
  auto s = Get(h);
  const ArenaView& a = s->dp().arena();
  at::Tensor out = at::empty({static_cast<int64_t>(a.geometry.layers)}, at::kDouble);
  std::memcpy(out.data_ptr<double>(), a.sparsity, a.geometry.layers * sizeof(double));
  return out;
}

// [epoch, budget recomputes (local per-layer), attached (1/0; local sessions 1)]
std::vector<int64_t> Counters(int64_t h) {
  auto s = Get(h);
  const ArenaView& a = s->dp().arena();
  return {static_cast<int64_t>(a.policy->epoch),
          s->budgets ? static_cast<int64_t>(s->budgets->recomputes()) : 0,
          s->resilient ? (s->resilient->attached() ? 1 : 0) : 1};
}

}  // namespace

TORCH_LIBRARY(spind, m) {
  m.def(
      "attach(str target, int[] geometry, int seed, float[] policy, str budget_mode, "
      "str client_name) -> int",
      &Attach);
  m.def("close(int handle) -> ()", &Close);
  m.def("reset_sequence(int handle, int seq, int key) -> ()", &ResetSequence);
  m.def("begin_step(int handle, Tensor seq, Tensor ctx_len, Tensor q_pos, int rows) -> ()",
        &BeginStep);
  m.def("outputs(int handle) -> (Tensor, Tensor, Tensor, Tensor)", &Outputs);
  m.def(
      "select(int handle, int layer, Tensor? block_table, Tensor(a!) union_count, "
      "Tensor(b!) union_ids, Tensor(c!) phys, Tensor(d!) compact_len) -> ()",
      &Select);
  m.def("remap(int handle, Tensor(a!) topk) -> ()", &Remap);
  m.def("observe(int handle, int layer, Tensor logits, Tensor? accepted) -> ()", &Observe);
  m.def("refresh(int handle) -> int", &Refresh);
  m.def("get_policy(int handle) -> float[]", &GetPolicy);
  m.def(
      "set_policy(int handle, float? target_sparsity, float? exploration, float? alpha, "
      "int? probe_period, str? budget_mode) -> ()",
      &SetPolicy);
  m.def("stats(int handle) -> Tensor", &Stats);
  m.def("budgets(int handle) -> Tensor", &Budgets);
  m.def("counters(int handle) -> int[]", &Counters);
}

}  // namespace spind_torch
