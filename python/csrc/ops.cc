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
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "resilient_data_plane.h"
#include "spin/arena.h"
#if SPIN_HAVE_CUDA
#include "spin/cuda_data_plane.h"
#include "spin/shared_device_memory.h"
#endif
#if SPIN_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif
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
  spin::Geometry geometry;
  // Attached to spind.
  std::unique_ptr<spin::client::ResilientDataPlane> resilient;
  int device = -1;  // CUDA ordinal of the arena, -1: host memory
  // Local.
  std::unique_ptr<void, FreeDeleter> mem;
  void* device_mem = nullptr;  // local session on a GPU (DeviceAlloc)
  std::unique_ptr<DataPlane> local;
  std::optional<spin::BudgetController> budgets;
  std::vector<uint64_t> curves;
  std::vector<spin::LayerStats> stats;
  int64_t steps_begun = 0;
  // The last begun step's entries and rows: what the per-layer ops' tensors must cover.
  int64_t step_n = 0, step_rows = 0;
  bool write_uniform_table = false;  // local per-layer: the table starts uniform at the target

  DataPlane& dp() { return resilient ? static_cast<DataPlane&>(*resilient) : *local; }
  ~Handle() {
    resilient.reset();
    local.reset();
#if SPIN_HAVE_CUDA
    if (device_mem != nullptr) spin::DeviceFree(device_mem);
#endif
  }
};

// Reads arena memory: a host copy, or a synchronous device copy (control calls only).
void ArenaRead(Handle& h, void* dst, const void* src, uint64_t bytes, const char* op) {
  if (!h.dp().on_device()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if SPIN_HAVE_CUDA
  Check(spin::CopyToHost(dst, src, bytes), op);
#else
  TORCH_CHECK(false, "spind.", op, ": a device arena in a build without CUDA");
#endif
}

// The stream the per-step ops enqueue on: torch's current CUDA stream for device sessions.
cudaStream_t Stream(Handle& h) {
#if SPIN_TORCH_CUDA
  if (h.dp().on_device()) return c10::cuda::getCurrentCUDAStream(h.device).stream();
#endif
  return nullptr;
}

spin::ArenaPolicy PolicyOf(Handle& h, const char* op) {
  spin::ArenaPolicy p;
  ArenaRead(h, &p, h.dp().arena().policy, sizeof(p), op);
  return p;
}

// A local session's new budget table, with a new epoch (the next step uses it).
void WriteTable(Handle& h, const std::vector<double>& table, const char* op) {
  const ArenaView& a = h.local->arena();
  if (!h.local->on_device()) {
    Check(spin::WriteBudgetTable(a, table), op);
    return;
  }
#if SPIN_HAVE_CUDA
  Check(spin::ValidateBudgetTable(a.geometry, table), op);
  Check(spin::CopyToDevice(a.sparsity, table.data(), table.size() * sizeof(double)), op);
  spin::ArenaPolicy p = PolicyOf(h, op);
  p.epoch += 1;
  Check(spin::CopyToDevice(&a.policy->epoch, &p.epoch, sizeof(p.epoch)), op);
#endif
}

// A local session's new policy (and, in uniform mode, table), with a new epoch: a host write,
// or a device write on the session's stream.
void WriteLocalPolicy(Handle& h, const spin::Policy& p, const char* op) {
  if (!h.local->on_device()) {
    Check(spin::WritePolicy(h.local->arena(), p), op);
    return;
  }
#if SPIN_HAVE_CUDA
  Check(spin::WriteDevicePolicy(h.local->arena(), p, Stream(h)), op);
#endif
}

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
  const std::optional<BudgetMode> mode = spin::ParseBudgetMode(m);
  TORCH_CHECK(mode.has_value(), "spind: budget mode '", m, "': use ", spin::kBudgetModeChoices);
  return *mode;
}

// geometry: [layers, block_size, topk, max_sequences, max_slots, max_rows, state (1 fp32,
// 2 bf16)]; policy: [target_sparsity, exploration, alpha, probe_period].
// device: -1 for an arena in host memory (spind's CPU backend, or a local CPU data plane), else
// the CUDA ordinal the engine runs on (spind's CUDA backend on that GPU, or a local CUDA data
// plane), which becomes the calling thread's current device.
int64_t Attach(const std::string& target, std::vector<int64_t> geometry, int64_t seed,
               std::vector<double> policy, const std::string& budget_mode,
               const std::string& client_name, int64_t device, bool engine_control,
               const std::string& model, bool defer_ema) {
  TORCH_CHECK(geometry.size() == 7,
              "spind.attach: geometry is [layers, block_size, topk, max_sequences, max_slots, "
              "max_rows, state (1 fp32, 2 bf16)]");
  TORCH_CHECK(policy.size() == 4 || policy.size() == 5,
              "spind.attach: policy is [target_sparsity, exploration, alpha, probe_period"
              "(, miss_target)]");
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
  p.miss_target = policy.size() == 5 ? policy[4] : 0.0;
  Check(spin::ValidateGeometry(g), "attach");
  Check(spin::ValidatePolicy(p), "attach");
  TORCH_CHECK(seed >= 0, "spind.attach: seed must be >= 0");
  h->device = static_cast<int>(device);
#if !SPIN_TORCH_CUDA
  TORCH_CHECK(device < 0, "spind.attach: this build of the spind package has no CUDA (torch ",
              TORCH_VERSION, " without CUDA, or spind built without the CUDA toolkit)");
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
      Check(spin::CudaSetDevice(static_cast<int>(device)), "attach");
      absl::StatusOr<std::unique_ptr<spin::client::ResilientDataPlane>> r =
          spin::client::ResilientDataPlane::CreateOnDevice(target, o,
                                                           std::chrono::milliseconds(1000));
      Check(r.status(), "attach");
      h->resilient = std::move(*r);
#endif
    }
  } else {
    const uint64_t bytes = spin::ArenaBytes(g);
    if (device < 0) {
      h->mem.reset(std::aligned_alloc(
          spin::kArenaAlign,
          (bytes + spin::kArenaAlign - 1) / spin::kArenaAlign * spin::kArenaAlign));
      TORCH_CHECK(h->mem != nullptr, "spind.attach: cannot allocate a ", bytes, "-byte arena");
      absl::StatusOr<ArenaView> view =
          spin::InitArena(h->mem.get(), bytes, g, static_cast<uint64_t>(seed), p);
      Check(view.status(), "attach");
      h->local = spin::MakeCpuDataPlane(*view);
    } else {
#if SPIN_TORCH_CUDA
      Check(spin::CudaSetDevice(static_cast<int>(device)), "attach");
      absl::StatusOr<void*> m = spin::DeviceAlloc(bytes);
      Check(m.status(), "attach");
      h->device_mem = *m;
      absl::StatusOr<ArenaView> view =
          spin::InitDeviceArena(h->device_mem, bytes, g, static_cast<uint64_t>(seed), p);
      Check(view.status(), "attach");
      spin::CudaDataPlaneOptions cuda;
      cuda.defer_ema = defer_ema;
      absl::StatusOr<std::unique_ptr<DataPlane>> dp = spin::MakeCudaDataPlane(*view, cuda);
      Check(dp.status(), "attach");
      h->local = std::move(*dp);
#endif
    }
    if (spin::TableFromProbes(p.budget_mode)) {
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
  Check(s->dp().ResetSequence(static_cast<int32_t>(seq), static_cast<uint64_t>(key), Stream(*s)),
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

// `token` (one int32 on the session's device, never written) is declared mutated by every
// per-step op: the ops' order on it is the data plane's call order, and a compiler keeps and
// orders them even though their effects on the arena are invisible to it.
// `block_table` (optional, [entries, blocks]): the engine's table for every layer of the step;
// a select without one uses it, and on the GPU each observe then publishes the next layer's
// selection (spin::StepBatch::block_table). It must stay alive and unchanged until the step's
// last select.
void BeginStep(int64_t h, const at::Tensor& seq, const at::Tensor& ctx_len, const at::Tensor& q_pos,
               int64_t rows, const c10::optional<at::Tensor>& block_table, at::Tensor& token) {
  auto s = Get(h);
  const int64_t n = seq.numel();
  TORCH_CHECK(n <= s->geometry.max_seqs, "spind.begin_step: ", n, " entries; the session holds ",
              s->geometry.max_seqs);
  for (const at::Tensor* t : {&seq, &ctx_len, &q_pos}) CheckPlace(*s, *t, "a step tensor");
  spin::StepBatch b{Int32Data(seq, "seq", n), Int32Data(ctx_len, "ctx_len", n),
                    Int32Data(q_pos, "q_pos", n), static_cast<int32_t>(n),
                    static_cast<int32_t>(rows)};
  if (block_table) {
    CheckPlace(*s, *block_table, "block_table");
    TORCH_CHECK(block_table->dim() == 2,
                "spind.begin_step: block_table must be [entries, blocks] (a row for every live "
                "entry); got ",
                block_table->sizes());
    b.block_table = Int32Data(*block_table, "block_table", 0);
    b.table_stride = block_table->size(1);
  }
  if (s->write_uniform_table) {  // before the first step: a control-plane write
    const std::vector<double> uniform(s->geometry.layers,
                                      PolicyOf(*s, "begin_step").target_sparsity);
    WriteTable(*s, uniform, "begin_step");
    s->write_uniform_table = false;
  }
  Check(s->dp().BeginStep(b, Stream(*s)), "begin_step");
  ++s->steps_begun;
  s->step_n = n;
  s->step_rows = n * rows;
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

// Select writes the layer's outputs into the four tensors. Given the arena's own buffers (from
// `outputs`, as an eager engine does) that is where the data plane writes anyway; given other
// tensors of the same shapes (what torch.compile's functionalization passes: copies of them),
// the buffers are copied into them on the same stream after the selection.
void Select(int64_t h, int64_t layer, const c10::optional<at::Tensor>& block_table,
            at::Tensor& union_count, at::Tensor& union_ids, at::Tensor& phys,
            at::Tensor& compact_len, at::Tensor& token) {
  auto s = Get(h);
  const spin::Outputs o = s->dp().outputs();
  const int64_t S = s->geometry.max_seqs;
  struct Out {
    at::Tensor* t;
    const int32_t* arena;
    int64_t numel;
    const char* name;
  };
  const Out outs[] = {{&union_count, o.union_count, S, "union_count"},
                      {&union_ids, o.union_ids, S * o.max_blocks, "union_ids"},
                      {&phys, o.phys, S * o.max_blocks, "phys"},
                      {&compact_len, o.compact_len, S * o.max_rows, "compact_len"}};
  for (const Out& x : outs) {
    CheckPlace(*s, *x.t, x.name);
    TORCH_CHECK(x.t->scalar_type() == at::kInt && x.t->is_contiguous() && x.t->numel() == x.numel,
                "spind.select: ", x.name, " must be a contiguous int32 tensor of ", x.numel,
                " elements (the shapes spind.outputs gives)");
  }
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
  cudaStream_t stream = Stream(*s);
  Check(s->dp().Select(static_cast<int32_t>(layer), table, stride, stream), "select");
  for (const Out& x : outs) {
    if (x.t->data_ptr() == x.arena) continue;
    const size_t bytes = static_cast<size_t>(x.numel) * sizeof(int32_t);
    if (!s->dp().on_device()) {
      std::memcpy(x.t->data_ptr(), x.arena, bytes);
      continue;
    }
#if SPIN_TORCH_CUDA
    const cudaError_t e =
        cudaMemcpyAsync(x.t->data_ptr(), x.arena, bytes, cudaMemcpyDeviceToDevice, stream);
    TORCH_CHECK(e == cudaSuccess, "spind.select: copying ", x.name, ": ", cudaGetErrorString(e));
#endif
  }
}

// The top-K tensor's checks: [entries * rows, count] int32 on the session's device, with a row
// for every row of the begun step (the data plane writes them all).
int32_t* TopKInput(Handle& s, at::Tensor& topk, const char* op) {
  CheckPlace(s, topk, "topk");
  TORCH_CHECK(topk.dim() == 2, "spind.", op, ": topk must be [entries * rows, count]");
  TORCH_CHECK(topk.size(0) >= s.step_rows, "spind.", op, ": topk has ", topk.size(0),
              " rows; the step has ", s.step_rows, " (entries x rows)");
  return const_cast<int32_t*>(Int32Data(topk, "topk", 0));
}

void Remap(int64_t h, at::Tensor& topk, at::Tensor& token) {
  auto s = Get(h);
  int32_t* idx = TopKInput(*s, topk, "remap");
  Check(s->dp().Remap(idx, static_cast<int32_t>(topk.size(1)), Stream(*s)), "remap");
}

// Remap of the engine's own top-K (DataPlane::RemapTopK): on a probe step the probing entries'
// row 0 is the dense top-K their miss curves count, and observe computes none.
void RemapTopK(int64_t h, at::Tensor& topk, at::Tensor& token) {
  auto s = Get(h);
  int32_t* idx = TopKInput(*s, topk, "remap_topk");
  Check(s->dp().RemapTopK(idx, static_cast<int32_t>(topk.size(1)), Stream(*s)), "remap_topk");
}

// Observe's checks of its tensors (`op` names the op in the messages); returns the accepted
// counts' pointer (null without them).
const int32_t* ObserveInputs(Handle& s, int64_t layer, const at::Tensor& logits,
                             const c10::optional<at::Tensor>& accepted, const char* op) {
  CheckPlace(s, logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "spind.", op, ": logits must be float32");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "spind.", op,
              ": logits must be [entries * rows, width] with unit column stride");
  TORCH_CHECK(layer >= 0 && layer < s.geometry.layers, "spind.", op, ": layer ", layer,
              " outside [0, ", s.geometry.layers, ")");
  // (The logits need rows only up to the last live entry's, which only the step's sequence ids
  // tell; the CUDA backend reads an accepted count for every entry, padding included.)
  if (!accepted) return nullptr;
  CheckPlace(s, *accepted, "accepted");
  return Int32Data(*accepted, "accepted", s.step_n);
}

void Observe(int64_t h, int64_t layer, const at::Tensor& logits,
             const c10::optional<at::Tensor>& accepted, at::Tensor& token) {
  auto s = Get(h);
  const int32_t* acc = ObserveInputs(*s, layer, logits, accepted, "observe");
  Check(s->dp().Observe(static_cast<int32_t>(layer), logits.data_ptr<float>(), logits.stride(0),
                        acc, Stream(*s)),
        "observe");
}

// remap_topk and observe in one call (DataPlane::RemapAndObserve): every argument checked first,
// and on the GPU one launch fewer per layer.
void RemapAndObserve(int64_t h, int64_t layer, at::Tensor& topk, const at::Tensor& logits,
                     const c10::optional<at::Tensor>& accepted, at::Tensor& token) {
  auto s = Get(h);
  int32_t* idx = TopKInput(*s, topk, "remap_and_observe");
  const int32_t* acc = ObserveInputs(*s, layer, logits, accepted, "remap_and_observe");
  Check(
      s->dp().RemapAndObserve(static_cast<int32_t>(layer), idx, static_cast<int32_t>(topk.size(1)),
                              logits.data_ptr<float>(), logits.stride(0), acc, Stream(*s)),
      "remap_and_observe");
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
  const spin::ArenaPolicy policy = PolicyOf(*s, "refresh");
  const int64_t t = s->steps_begun - 1;
  if (policy.probe_period == 0 || t < 0 || t % policy.probe_period != 0) return 0;
  ArenaRead(*s, s->curves.data(), a.curves, s->curves.size() * sizeof(uint64_t), "refresh");
  ArenaRead(*s, s->stats.data(), a.stats, s->stats.size() * sizeof(spin::LayerStats), "refresh");
  absl::StatusOr<std::optional<spin::BudgetUpdate>> u = s->budgets->Update(
      spin::ProbeSnapshot{s->curves, s->stats}, policy.target_sparsity,
      policy.budget_mode == static_cast<uint32_t>(BudgetMode::kMissTarget) ? policy.miss_target
                                                                           : 0.0,
      policy.exploration);
  Check(u.status(), "refresh");
  if (!u->has_value()) return 0;
  WriteTable(*s, (*u)->sparsity, "refresh");
  return 1;
}

// [target_sparsity, exploration, alpha, probe_period, budget_mode (0 uniform, 1 per-layer)]
std::vector<double> GetPolicy(int64_t h) {
  auto s = Get(h);
  const spin::ArenaPolicy p = PolicyOf(*s, "get_policy");
  return {p.target_sparsity,
          p.exploration,
          p.alpha,
          static_cast<double>(p.probe_period),
          p.budget_mode == static_cast<uint32_t>(BudgetMode::kPerLayer)     ? 1.0
          : p.budget_mode == static_cast<uint32_t>(BudgetMode::kMissTarget) ? 2.0
                                                                            : 0.0,
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
  WriteLocalPolicy(*s, p, "set_policy");
}

// Per layer: steps, dense_steps, probe_steps, blocks_kept, blocks_total, sparse_blocks_kept,
// sparse_blocks_total, observed, bad_scores, probe_topk, probe_missed (int64 [layers, 11]).
at::Tensor Stats(int64_t h) {
  auto s = Get(h);
  const ArenaView& a = s->dp().arena();
  static_assert(sizeof(spin::LayerStats) == 11 * sizeof(uint64_t), "11 counters");
  at::Tensor out = at::empty({static_cast<int64_t>(a.geometry.layers), 11}, at::kLong);
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
  WriteLocalPolicy(*s, p, "adopt_control");
  if (spin::TableFromProbes(p.budget_mode)) WriteTable(*s, table, "adopt_control");
}

// [attached (1/0; local sessions 1), generation]: counters() without reading the arena (no
// device copy, so an engine can ask at every step boundary).
std::vector<int64_t> Link(int64_t h) {
  auto s = Get(h);
  if (!s->resilient) return {1, 0};
  return {s->resilient->attached() ? 1 : 0, static_cast<int64_t>(s->resilient->generation())};
}

// [epoch, budget recomputes (local per-layer), attached (1/0; local sessions 1), generation
// (spind sessions switched in so far; each starts with fresh state)]
std::vector<int64_t> Counters(int64_t h) {
  auto s = Get(h);
  return {static_cast<int64_t>(PolicyOf(*s, "counters").epoch),
          s->budgets ? static_cast<int64_t>(s->budgets->recomputes()) : 0,
          s->resilient ? (s->resilient->attached() ? 1 : 0) : 1,
          s->resilient ? static_cast<int64_t>(s->resilient->generation()) : 0};
}

}  // namespace

// The per-step ops take tensors and are registered per backend (CPU, CUDA), so torch can trace
// them with the fake implementations the package registers; the control ops take none and have
// one catch-all kernel.
TORCH_LIBRARY(spind, m) {
  m.def(
      "attach(str target, int[] geometry, int seed, float[] policy, str budget_mode, "
      "str client_name, int device=-1, bool engine_control=False, str model=\"\", "
      "bool defer_ema=False) -> int",
      &Attach);
  m.def("close(int handle) -> ()", &Close);
  m.def("reset_sequence(int handle, int seq, int key) -> ()", &ResetSequence);
  m.def("outputs(int handle) -> (Tensor, Tensor, Tensor, Tensor)", &Outputs);
  m.def("refresh(int handle) -> int", &Refresh);
  m.def("get_policy(int handle) -> float[]", &GetPolicy);
  m.def(
      "set_policy(int handle, float? target_sparsity, float? exploration, float? alpha, "
      "int? probe_period, str? budget_mode, float? miss_target=None) -> ()",
      &SetPolicy);
  m.def("stats(int handle) -> Tensor", &Stats);
  m.def("budgets(int handle) -> Tensor", &Budgets);
  m.def("counters(int handle) -> int[]", &Counters);
  m.def("link(int handle) -> int[]", &Link);
  m.def("control(int handle) -> Tensor", &GetControl);
  m.def("adopt_control(int handle, Tensor control) -> ()", &AdoptControl);
  m.def(
      "begin_step(int handle, Tensor seq, Tensor ctx_len, Tensor q_pos, int rows, "
      "Tensor? block_table, Tensor(t!) token) -> ()");
  m.def(
      "select(int handle, int layer, Tensor? block_table, Tensor(a!) union_count, "
      "Tensor(b!) union_ids, Tensor(c!) phys, Tensor(d!) compact_len, Tensor(t!) token) -> ()");
  m.def("remap(int handle, Tensor(a!) topk, Tensor(t!) token) -> ()");
  m.def("remap_topk(int handle, Tensor(a!) topk, Tensor(t!) token) -> ()");
  m.def("observe(int handle, int layer, Tensor logits, Tensor? accepted, Tensor(t!) token) -> ()");
  m.def(
      "remap_and_observe(int handle, int layer, Tensor(a!) topk, Tensor logits, Tensor? accepted, "
      "Tensor(t!) token) -> ()");
}

// One kernel per backend; the functions themselves dispatch on the session.
void ImplPerStep(torch::Library& m) {
  m.impl("begin_step", &BeginStep);
  m.impl("select", &Select);
  m.impl("remap", &Remap);
  m.impl("remap_topk", &RemapTopK);
  m.impl("observe", &Observe);
  m.impl("remap_and_observe", &RemapAndObserve);
}

TORCH_LIBRARY_IMPL(spind, CPU, m) { ImplPerStep(m); }

TORCH_LIBRARY_IMPL(spind, CUDA, m) { ImplPerStep(m); }

}  // namespace spind_torch
