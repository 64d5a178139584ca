// The sessions behind the handles, and the ops between steps: attach, close, reset_sequence,
// outputs, refresh, policy, statistics, budgets, control (ops.h).
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <map>
#include <mutex>

#include "ops.h"
#include "spin/budget.h"
#include "spin_client.h"
#if SPIN_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "spin/shared_device_memory.h"
#endif

namespace spind_torch {
namespace {

using spin::ArenaView;
using spin::BudgetMode;

std::mutex registry_mu;
std::map<int64_t, std::shared_ptr<Handle>> registry;
int64_t next_handle = 1;

BudgetMode ModeOf(const std::string& m) {
  const std::optional<BudgetMode> mode = spin::ParseBudgetMode(m);
  TORCH_CHECK(mode.has_value(), "spind: budget mode '", m, "': use ", spin::kBudgetModeChoices);
  return *mode;
}

// Reads arena memory into host memory (control calls only: a device copy synchronises).
void ArenaRead(Handle& h, void* dst, const void* src, uint64_t bytes, const char* op) {
  Check(spin::ReadArena(h.dp(), dst, src, bytes), op);
}

spin::ArenaPolicy PolicyOf(Handle& h, const char* op) {
  absl::StatusOr<spin::ArenaPolicy> p = spin::ReadArenaPolicy(h.dp());
  Check(p.status(), op);
  return *p;
}

// An int argument that becomes a uint32 field; `what` names it in the message.
uint32_t U32(int64_t v, const char* op, const char* what) {
  TORCH_CHECK(v >= 0 && v <= UINT32_MAX, "spind.", op, ": ", what, " ", v, " out of range");
  return static_cast<uint32_t>(v);
}

}  // namespace

void Check(const absl::Status& s, const char* op) {
  TORCH_CHECK(s.ok(), "spind.", op, ": ", std::string(s.message()));
}

std::shared_ptr<Handle> Get(int64_t h) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry.find(h);
  TORCH_CHECK(it != registry.end(), "spind: no session with handle ", h,
              " (closed, or never opened)");
  return it->second;
}

cudaStream_t Stream(Handle& h) {
#if SPIN_TORCH_CUDA
  if (h.dp().on_device()) return c10::cuda::getCurrentCUDAStream(h.device).stream();
#endif
  return nullptr;
}

void CheckPlace(Handle& s, const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() == !s.dp().on_device(), "spind: ", what, " is on ", t.device(),
              " but the session's data plane runs ",
              s.dp().on_device() ? "on the GPU" : "on the CPU");
}

const int32_t* Int32Data(const at::Tensor& t, const char* what, int64_t min_numel) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "spind: ", what, " must be int32, not ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "spind: ", what, " must be contiguous");
  TORCH_CHECK(t.numel() >= min_numel, "spind: ", what, " has ", t.numel(),
              " elements; needs at least ", min_numel);
  return t.data_ptr<int32_t>();
}

// device: -1 for an arena in host memory (spind's CPU backend, or a local CPU data plane), else
// the CUDA ordinal the engine runs on (spind's CUDA backend on that GPU, or a local CUDA data
// plane), which becomes the calling thread's current device.
int64_t Attach(const std::string& target, int64_t layers, int64_t max_slots, int64_t block_size,
               int64_t topk, int64_t max_sequences, int64_t max_rows, const std::string& state,
               int64_t seed, double target_sparsity, double exploration, double alpha,
               int64_t probe_period, const std::string& budget_mode, double miss_target,
               const std::string& client_name, int64_t device, bool engine_control,
               const std::string& model, bool defer_ema) {
  const std::optional<spin::StateDtype> dtype = spin::ParseStateDtype(state);
  TORCH_CHECK_VALUE(dtype.has_value(), "spind.attach: state must be fp32 or bf16, not '", state,
                    "'");
  auto h = std::make_shared<Handle>();
  spin::Geometry& g = h->geometry;
  g.layers = U32(layers, "attach", "layers");
  g.max_slots = U32(max_slots, "attach", "max_slots");
  g.block_size = U32(block_size, "attach", "block_size");
  g.topk = U32(topk, "attach", "topk");
  g.max_seqs = U32(max_sequences, "attach", "max_sequences");
  g.max_rows = U32(max_rows, "attach", "max_rows");
  g.dtype = *dtype;
  spin::Policy p;
  p.target_sparsity = target_sparsity;
  p.exploration = exploration;
  p.alpha = static_cast<float>(alpha);
  p.probe_period = U32(probe_period, "attach", "probe_period");
  p.budget_mode = ModeOf(budget_mode);
  p.miss_target = miss_target;
  Check(spin::ValidateGeometry(g), "attach");
  Check(spin::ValidatePolicy(p), "attach");
  TORCH_CHECK(seed >= 0, "spind.attach: seed must be >= 0");
  h->device = static_cast<int>(device);
#if !SPIN_TORCH_CUDA
  TORCH_CHECK(device < 0, "spind.attach: this build of the spind package has no CUDA (torch ",
              TORCH_VERSION, " without CUDA, or spind built without the CUDA toolkit)");
#else
  if (device >= 0) Check(spin::CudaSetDevice(static_cast<int>(device)), "attach");
#endif
  if (!target.empty()) {
    spin::client::AttachOptions o;
    o.geometry = g;
    o.policy = p;
    o.seed = static_cast<uint64_t>(seed);
    o.client_name = client_name;
    o.engine_control = engine_control;
    o.model = model;
    o.defer_ema = defer_ema;
    if (device < 0) {
      o.require_backend = 1;  // host arenas: spind's CPU backend
      h->resilient = std::make_unique<spin::client::ResilientDataPlane>(
          target, o, std::chrono::milliseconds(1000));
    } else {
#if SPIN_TORCH_CUDA
      absl::StatusOr<std::unique_ptr<spin::client::ResilientDataPlane>> r =
          spin::client::ResilientDataPlane::CreateOnDevice(target, o,
                                                           std::chrono::milliseconds(1000));
      Check(r.status(), "attach");
      h->resilient = std::move(*r);
#endif
    }
  } else {
    spin::DataPlaneSpec spec{
        .geometry = g, .seed = static_cast<uint64_t>(seed), .policy = p, .on_device = device >= 0};
    spec.cuda.defer_ema = defer_ema;
    absl::StatusOr<std::unique_ptr<spin::DataPlane>> dp = spin::NewDataPlane(spec);
    Check(dp.status(), "attach");
    h->local = std::move(*dp);
    if (spin::TableFromProbes(p.budget_mode)) {
      absl::StatusOr<spin::LocalBudgets> b = spin::LocalBudgets::Create(g);
      Check(b.status(), "attach");
      h->budgets.emplace(std::move(*b));
      h->write_initial_table = true;  // at the first begin_step, as spind's probe thread does
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
  Check(s->dp().ResetSequence(static_cast<int32_t>(seq), static_cast<uint64_t>(key), Stream(*s)),
        "reset_sequence");
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

// Between steps. Attached: notices a lost daemon and switches in a new session. Local with
// per-layer budgets: after each probe-period step (miss-target: after every step, which the
// exploration estimate measures), the budget controller may write a new table
// (spin::LocalBudgets, as spind's probe thread does). Returns 1 when the budget table or the
// session changed, else 0.
int64_t Refresh(int64_t h) {
  auto s = Get(h);
  if (s->resilient) {
    const std::string before = s->resilient->session_id();
    Check(s->resilient->Refresh(), "refresh");
    return s->resilient->session_id() != before ? 1 : 0;
  }
  if (!s->budgets) return 0;
  absl::StatusOr<bool> wrote = s->budgets->AfterStep(*s->local, s->steps_begun - 1);
  Check(wrote.status(), "refresh");
  return *wrote ? 1 : 0;
}

// The budget modes' names, in the order choices are listed (spin::kBudgetModes).
std::vector<std::string> BudgetModes() {
  std::vector<std::string> names;
  for (BudgetMode m : spin::kBudgetModes) names.emplace_back(spin::BudgetModeName(m));
  return names;
}

std::tuple<double, double, double, int64_t, std::string, double> GetPolicy(int64_t h) {
  auto s = Get(h);
  const spin::ArenaPolicy p = PolicyOf(*s, "get_policy");
  return {p.target_sparsity,
          p.exploration,
          p.alpha,
          static_cast<int64_t>(p.probe_period),
          std::string(spin::BudgetModeName(static_cast<BudgetMode>(p.budget_mode))),
          p.miss_target};
}

void SetPolicy(int64_t h, c10::optional<double> target_sparsity, c10::optional<double> exploration,
               c10::optional<double> alpha, c10::optional<int64_t> probe_period,
               c10::optional<std::string> budget_mode, c10::optional<double> miss_target) {
  auto s = Get(h);
  TORCH_CHECK(!probe_period || (*probe_period >= 0 && *probe_period <= UINT32_MAX),
              "spind.set_policy: probe_period out of range");
  if (s->resilient) {
    // Attached: spind changes it (from the next step; in an engine_control session, once the
    // engine adopts its control).
    spin::client::PolicyChange c;
    if (target_sparsity) c.target_sparsity = *target_sparsity;
    if (exploration) c.exploration = *exploration;
    if (alpha) c.alpha = static_cast<float>(*alpha);
    if (probe_period) c.probe_period = static_cast<uint32_t>(*probe_period);
    if (budget_mode) c.budget_mode = ModeOf(*budget_mode);
    if (miss_target) c.miss_target = *miss_target;
    Check(s->resilient->SetPolicy(c).status(), "set_policy");
    return;
  }
  const spin::ArenaPolicy cur = PolicyOf(*s, "set_policy");
  spin::Policy p;
  p.target_sparsity = target_sparsity.value_or(cur.target_sparsity);
  p.exploration = exploration.value_or(cur.exploration);
  p.alpha = static_cast<float>(alpha.value_or(cur.alpha));
  p.probe_period = probe_period ? static_cast<uint32_t>(*probe_period) : cur.probe_period;
  p.budget_mode = budget_mode ? ModeOf(*budget_mode) : static_cast<BudgetMode>(cur.budget_mode);
  p.miss_target = miss_target.value_or(cur.miss_target);
  Check(spin::ValidatePolicy(p), "set_policy");
  Check(spin::WriteArenaPolicy(*s->local, p, Stream(*s)), "set_policy");
}

// Per layer: steps, dense_steps, probe_steps, blocks_kept, blocks_total, sparse_blocks_kept,
// sparse_blocks_total, observed, bad_scores, probe_topk, probe_missed, explore_steps,
// explore_topk, explore_est (int64 [layers, 14]).
at::Tensor Stats(int64_t h) {
  auto s = Get(h);
  const ArenaView& a = s->dp().arena();
  static_assert(sizeof(spin::LayerStats) == 14 * sizeof(uint64_t), "14 counters");
  at::Tensor out = at::empty({static_cast<int64_t>(a.geometry.layers), 14}, at::kLong);
  ArenaRead(*s, out.data_ptr<int64_t>(), a.stats, a.geometry.layers * sizeof(spin::LayerStats),
            "stats");
  return out;
}

// The per-layer sparsity table the kernels use (float64 [layers]).
at::Tensor Budgets(int64_t h) {
  auto s = Get(h);
  const ArenaView& a = s->dp().arena();
  at::Tensor out = at::empty({static_cast<int64_t>(a.geometry.layers)}, at::kDouble);
  ArenaRead(*s, out.data_ptr<double>(), a.sparsity, a.geometry.layers * sizeof(double), "budgets");
  return out;
}

// The session's control as one float64 tensor, what a tensor-parallel group broadcasts from
// rank 0 (docs/vllm.md): [version, attached, target_sparsity, exploration, alpha, probe_period,
// budget_mode (0 uniform, 1 per-layer), sparsity of layer 0 .. L-1]. Attached sessions ask spind
// (an RPC; between steps): its proposal in an engine_control session. Without a session (dense,
// or spind away), and for local sessions, it is what the arena holds, with version -1 and
// attached 0 (local: version = the arena's epoch, attached 1).
constexpr int64_t kControlHead = 7;

at::Tensor GetControl(int64_t h) {
  auto s = Get(h);
  const int64_t L = s->geometry.layers;
  at::Tensor out = at::empty({kControlHead + L}, at::kDouble);
  double* o = out.data_ptr<double>();
  auto fill = [&](double version, double attached, const spin::Policy& p, const double* table) {
    o[0] = version;
    o[1] = attached;
    o[2] = p.target_sparsity;
    o[3] = p.exploration;
    o[4] = p.alpha;
    o[5] = p.probe_period;
    // The table comes from probes in both per-layer modes: adopting it is what the kernels need.
    o[6] = spin::TableFromProbes(p.budget_mode) ? 1.0 : 0.0;
    std::copy(table, table + L, o + kControlHead);
  };
  if (s->resilient) {
    absl::StatusOr<spin::client::Control> c = s->resilient->GetControl();
    if (c.ok()) {
      TORCH_CHECK(static_cast<int64_t>(c->layer_sparsity.size()) == L, "spind.control: spind sent ",
                  c->layer_sparsity.size(), " layers, not ", L);
      fill(static_cast<double>(c->version), 1.0, c->policy, c->layer_sparsity.data());
      return out;
    }
  }
  const ArenaView& a = s->dp().arena();
  const spin::ArenaPolicy ap = PolicyOf(*s, "control");
  std::vector<double> table(L);
  ArenaRead(*s, table.data(), a.sparsity, L * sizeof(double), "control");
  spin::Policy p;
  p.target_sparsity = ap.target_sparsity;
  p.exploration = ap.exploration;
  p.alpha = ap.alpha;
  p.probe_period = ap.probe_period;
  p.budget_mode = static_cast<BudgetMode>(ap.budget_mode);
  if (s->resilient) {
    fill(-1.0, 0.0, p, table.data());
  } else {
    fill(static_cast<double>(ap.epoch), 1.0, p, table.data());
  }
  return out;
}

// Writes a control tensor (GetControl's layout; version and attached are not read) into the
// session: it takes effect at the next begin_step. Everything is checked first; a bad tensor
// changes nothing.
void AdoptControl(int64_t h, const at::Tensor& control) {
  auto s = Get(h);
  const int64_t L = s->geometry.layers;
  TORCH_CHECK(control.device().is_cpu() && control.scalar_type() == at::kDouble &&
                  control.dim() == 1 && control.numel() == kControlHead + L,
              "spind.adopt_control: control must be a CPU float64 tensor of ", kControlHead + L,
              " values (what control() returns), got ", control.scalar_type(), " ", control.sizes(),
              " on ", control.device());
  const at::Tensor c = control.contiguous();
  const double* v = c.data_ptr<double>();
  TORCH_CHECK(v[5] >= 0 && v[5] <= UINT32_MAX && v[5] == std::floor(v[5]),
              "spind.adopt_control: probe_period ", v[5], " is not a count");
  TORCH_CHECK(v[6] == 0.0 || v[6] == 1.0, "spind.adopt_control: budget_mode ", v[6],
              " is neither 0 (uniform) nor 1 (per-layer)");
  spin::Policy p;
  p.target_sparsity = v[2];
  p.exploration = v[3];
  p.alpha = static_cast<float>(v[4]);
  p.probe_period = static_cast<uint32_t>(v[5]);
  p.budget_mode = v[6] == 1.0 ? BudgetMode::kPerLayer : BudgetMode::kUniform;
  const std::vector<double> table(v + kControlHead, v + kControlHead + L);
  Check(spin::ValidatePolicy(p), "adopt_control");
  Check(spin::ValidateBudgetTable(s->geometry, table), "adopt_control");
  if (s->resilient) {
    Check(s->resilient->AdoptControl(p, table, Stream(*s)), "adopt_control");
    return;
  }
  // Local: the policy, then a per-layer table (uniform mode writes its own).
  Check(spin::WriteArenaPolicy(*s->local, p, Stream(*s)), "adopt_control");
  if (spin::TableFromProbes(p.budget_mode)) {
    Check(spin::WriteArenaBudgets(*s->local, table), "adopt_control");
  }
}

// counters() without reading the arena (no device copy, so an engine can ask at every step
// boundary). Local sessions: attached, generation 0.
std::tuple<bool, int64_t> Link(int64_t h) {
  auto s = Get(h);
  if (!s->resilient) return {true, 0};
  return {s->resilient->attached(), static_cast<int64_t>(s->resilient->generation())};
}

// generation: the spind sessions switched in so far (each starts with fresh state).
std::tuple<int64_t, int64_t, bool, int64_t> Counters(int64_t h) {
  auto s = Get(h);
  return {static_cast<int64_t>(PolicyOf(*s, "counters").epoch),
          s->budgets ? static_cast<int64_t>(s->budgets->recomputes()) : 0,
          s->resilient ? s->resilient->attached() : true,
          s->resilient ? static_cast<int64_t>(s->resilient->generation()) : 0};
}

}  // namespace spind_torch
