// The per-step ops (ops.h): begin_step, select, remap, remap_topk, observe, remap_and_observe.
// They take pointers to the tensors' memory and never copy, synchronise or allocate (but for
// the first begin_step of a local per-layer session, below); the outputs of select are views of
// the arena's output buffers (`outputs`), passed back to `select` as the tensors it mutates.
//
// `token` (one int32 on the session's device, never written) is declared mutated by every
// per-step op: the ops' order on it is the data plane's call order, and a compiler keeps and
// orders them even though their effects on the arena are invisible to it.
#include <cstring>

#include "ops.h"
#if SPIN_TORCH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace spind_torch {
namespace {

// The top-K tensor's checks: [entries * rows, count] int32 on the session's device, with a row
// for every row of the begun step (the data plane writes them all).
int32_t* TopKInput(Handle& s, at::Tensor& topk, const char* op) {
  CheckPlace(s, topk, "topk");
  TORCH_CHECK(topk.dim() == 2, "spind.", op, ": topk must be [entries * rows, count]");
  TORCH_CHECK(topk.size(0) >= s.step_rows, "spind.", op, ": topk has ", topk.size(0),
              " rows; the step has ", s.step_rows, " (entries x rows)");
  return const_cast<int32_t*>(Int32Data(topk, "topk", 0));
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

}  // namespace

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
  if (s->write_initial_table) {
    // Before the first step, a control-plane write: the first table (InitialBudget), with an
    // epoch of its own, as spind writes a per-layer session's first table.
    Check(s->budgets->WriteInitial(*s->local), "begin_step");
    s->write_initial_table = false;
  }
  Check(s->dp().BeginStep(b, Stream(*s)), "begin_step");
  ++s->steps_begun;
  s->step_n = n;
  s->step_rows = n * rows;
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

}  // namespace spind_torch
