// Every op of the `spind` torch library: its schema and its kernels (the functions are in ops.h).
// Arguments are named; attach and set_policy take theirs by name only (after `*`). Budget modes
// and state dtypes are text ("per-layer", "bf16"; spin/arena.h's codec), budget_modes() lists
// the modes.
//
// The per-step ops take tensors and are registered per backend (CPU, CUDA), so torch can trace
// them with the fake implementations the package registers; the control ops take none and have
// one catch-all kernel.
#include <torch/library.h>

#include "ops.h"

namespace spind_torch {

TORCH_LIBRARY(spind, m) {
  // Sessions and the calls between steps (session_ops.cc).
  m.def(
      "attach(*, str target, int layers, int max_slots, int block_size, int topk, "
      "int max_sequences, int max_rows, str state, int seed, float target_sparsity, "
      "float exploration, float alpha, int probe_period, str budget_mode, float miss_target, "
      "str client_name, int device=-1, bool engine_control=False, str model=\"\", "
      "bool defer_ema=False) -> int",
      &Attach);
  m.def("close(int handle) -> ()", &Close);
  m.def("reset_sequence(int handle, int seq, int key) -> ()", &ResetSequence);
  m.def("outputs(int handle) -> (Tensor, Tensor, Tensor, Tensor)", &Outputs);
  m.def("refresh(int handle) -> int", &Refresh);
  m.def("budget_modes() -> str[]", &BudgetModes);
  m.def(
      "get_policy(int handle) -> (float target_sparsity, float exploration, float alpha, "
      "int probe_period, str budget_mode, float miss_target)",
      &GetPolicy);
  m.def(
      "set_policy(int handle, *, float? target_sparsity=None, float? exploration=None, "
      "float? alpha=None, int? probe_period=None, str? budget_mode=None, "
      "float? miss_target=None) -> ()",
      &SetPolicy);
  m.def("stats(int handle) -> Tensor", &Stats);
  m.def("budgets(int handle) -> Tensor", &Budgets);
  m.def("counters(int handle) -> (int epoch, int budget_recomputes, bool attached, int generation)",
        &Counters);
  m.def("link(int handle) -> (bool attached, int generation)", &Link);
  m.def("control(int handle) -> Tensor", &GetControl);
  m.def("adopt_control(int handle, Tensor control) -> ()", &AdoptControl);
  // The per-step ops (step_ops.cc).
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
  // The engine's indexer and top-k (indexer_op.cc).
  m.def("row_topk(Tensor logits, Tensor lens, int k, Tensor(a!) out) -> ()");
  m.def(
      "paged_indexer(Tensor q, Tensor weights, Tensor kv, Tensor table, Tensor lens, "
      "Tensor(a!) logits, int max_pages, int next_n, str kernel=\"auto\") -> ()");
}

namespace {

// One kernel per backend; the functions themselves dispatch on the session.
void ImplPerStep(torch::Library& m) {
  m.impl("begin_step", &BeginStep);
  m.impl("select", &Select);
  m.impl("remap", &Remap);
  m.impl("remap_topk", &RemapTopK);
  m.impl("observe", &Observe);
  m.impl("remap_and_observe", &RemapAndObserve);
}

}  // namespace

TORCH_LIBRARY_IMPL(spind, CPU, m) {
  ImplPerStep(m);
  m.impl("paged_indexer", &PagedIndexerCpu);
  m.impl("row_topk", &RowTopKCpu);
}

TORCH_LIBRARY_IMPL(spind, CUDA, m) {
  ImplPerStep(m);
#if SPIN_TORCH_CUDA
  m.impl("paged_indexer", &PagedIndexerCuda);
  m.impl("row_topk", &RowTopKCuda);
#endif
}

}  // namespace spind_torch
