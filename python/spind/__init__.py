"""spind: SPIN's data plane for Python engines, as torch ops over libspin_client.

    import spind
    s = spind.Session(layers=61, max_slots=131072, target="unix:///run/spin/spind.sock")
    s.reset_sequence(0, key)
    s.begin_step(seq, ctx_len, q_pos, rows, block_table)  # int32 tensors, one entry each
    for layer in range(layers):
        s.select(layer)                                 # -> s.union_count, s.union_ids, ...
        ...the engine's indexer over the compacted table, its top-k...
        s.remap_and_observe(layer, topk, logits, accepted)  # topk in place: -> logical slots
    s.refresh()                                         # between steps

The ops are torch.ops.spind.*; Session only keeps the handle and the output views. An empty
target runs a private data plane in this process (offline replay, tests).
"""
import os

import torch

torch.ops.load_library(os.path.join(os.path.dirname(__file__), "_C.so"))
ops = torch.ops.spind

# The budget modes' names, as the C++ codec spells them ("uniform", "per-layer", "miss-target").
BUDGET_MODES = tuple(ops.budget_modes())

# Fake implementations (torch >= 2.4) so torch.compile can trace the per-step ops: they return
# nothing and change only what their schemas declare mutated.
if hasattr(torch.library, "register_fake"):
    def _none(*args, **kwargs):
        return None

    for _name in ("begin_step", "select", "remap", "remap_topk", "observe", "remap_and_observe",
                  "paged_indexer", "row_topk"):
        torch.library.register_fake(f"spind::{_name}")(_none)


class Session:
    """One SPIN session: attached to spind at `target` (fail-open: dense while the daemon is
    away), or local when `target` is empty."""

    def __init__(self, layers, max_slots, *, block_size=64, topk=2048, max_sequences=1,
                 max_rows=1, state="fp32", seed=1, target_sparsity=0.5, exploration=0.05,
                 alpha=0.3, probe_period=0, budget_mode="uniform", target="",
                 client_name="python", device=None, engine_control=False, model="",
                 miss_target=0.0, defer_ema=False):
        self.layers = layers
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.device = device
        ordinal = -1
        if device.type == "cuda":
            ordinal = device.index if device.index is not None else torch.cuda.current_device()
        # A session attached to spind on the CPU backend moves its outputs when it switches to
        # a new daemon session (at begin_step or refresh): the views are taken again there.
        self._outputs_move = bool(target) and device.type == "cpu"
        self.handle = ops.attach(
            target=target, layers=layers, max_slots=max_slots, block_size=block_size, topk=topk,
            max_sequences=max_sequences, max_rows=max_rows, state=state, seed=seed,
            target_sparsity=float(target_sparsity), exploration=float(exploration),
            alpha=float(alpha), probe_period=int(probe_period), budget_mode=budget_mode,
            miss_target=float(miss_target), client_name=client_name, device=ordinal,
            engine_control=bool(engine_control), model=model, defer_ema=bool(defer_ema))
        # defer_ema (CUDA sessions): each layer's EMA runs beside the engine's work up to the
        # next layer's observe, reading that layer's logits meanwhile, so the session keeps the
        # last observed logits (and accepted counts) alive until the next observe: the caching
        # allocator cannot hand their memory to the next layer's tensors before the EMA has read
        # it. The CPU backend ignores it.
        self._defer = bool(defer_ema) and device.type == "cuda"
        self._held = None
        # Declared mutated by every per-step op (see python/csrc/step_ops.cc): orders them.
        self.token = torch.zeros(1, dtype=torch.int32, device=device)
        self._fetch_outputs()

    def _fetch_outputs(self):
        (self.union_count, self.union_ids, self.phys,
         self.compact_len) = ops.outputs(self.handle)

    def close(self):
        if getattr(self, "handle", None) is not None:
            ops.close(self.handle)
            self.handle = None

    def __del__(self):
        # A session nobody closed is freed with its object (spind then reclaims its lease).
        try:
            self.close()
        except Exception:  # interpreter shutdown: the ops may be gone already
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def reset_sequence(self, seq, key):
        ops.reset_sequence(self.handle, seq, key)

    def begin_step(self, seq, ctx_len, q_pos, rows=1, block_table=None):
        """Begins a decode step. block_table ([entries, blocks] int32, optional): the engine's
        block table for every layer of the step; a select without a table of its own uses it,
        and on the GPU each observe then publishes the next layer's selection, so that select
        launches nothing (read a layer's outputs before its observe). Keep it alive and
        unchanged until the step's last select."""
        ops.begin_step(self.handle, seq, ctx_len, q_pos, rows, block_table, self.token)
        if self._outputs_move:
            self._fetch_outputs()

    def select(self, layer, block_table=None):
        ops.select(self.handle, layer, block_table, self.union_count, self.union_ids, self.phys,
                   self.compact_len, self.token)

    def remap(self, topk, engine_topk=False):
        """Compacted top-K indices -> logical slots, in place. engine_topk: topk is the engine's
        own top-K of the layer just selected; on a probe step its row 0 is then the dense top-K
        that the miss curves count, and observe computes none (DataPlane::RemapTopK)."""
        if engine_topk:
            ops.remap_topk(self.handle, topk, self.token)
        else:
            ops.remap(self.handle, topk, self.token)

    def observe(self, layer, logits, accepted=None):
        ops.observe(self.handle, layer, logits, accepted, self.token)
        if self._defer:
            self._held = (logits, accepted)

    def remap_and_observe(self, layer, topk, logits, accepted=None):
        """remap(topk, engine_topk=True) and observe(layer, logits, accepted) in one call: every
        argument checked first; on the GPU the remap runs inside observe's first launch."""
        ops.remap_and_observe(self.handle, layer, topk, logits, accepted, self.token)
        if self._defer:
            self._held = (logits, accepted)

    def refresh(self):
        changed = ops.refresh(self.handle)
        if changed and self._outputs_move:
            self._fetch_outputs()
        return bool(changed)

    def policy(self):
        p = ops.get_policy(self.handle)
        return dict(zip(("target_sparsity", "exploration", "alpha", "probe_period",
                         "budget_mode", "miss_target"), p))

    def set_policy(self, target_sparsity=None, exploration=None, alpha=None, probe_period=None,
                   budget_mode=None, miss_target=None):
        ops.set_policy(self.handle, target_sparsity=target_sparsity, exploration=exploration,
                       alpha=alpha, probe_period=probe_period, budget_mode=budget_mode,
                       miss_target=miss_target)

    def stats(self):
        return ops.stats(self.handle)

    def budgets(self):
        return ops.budgets(self.handle)

    def counters(self):
        epoch, recomputes, attached, generation = ops.counters(self.handle)
        return {"epoch": epoch, "budget_recomputes": recomputes, "attached": bool(attached),
                "generation": generation}

    def link(self):
        """(attached, generation) without touching the arena (cheap at every step boundary):
        generation counts the spind sessions switched in; each starts with fresh state."""
        attached, generation = ops.link(self.handle)
        return bool(attached), generation

    def control(self):
        """The session's control, a CPU float64 tensor: [version, attached, target_sparsity,
        exploration, alpha, probe_period, budget_mode (0 uniform, 1 per-layer), the sparsity
        of each layer]. Attached: what spind proposes (an RPC; call between steps). What a
        tensor-parallel group's rank 0 broadcasts (docs/vllm.md)."""
        return ops.control(self.handle)

    def adopt_control(self, control):
        """Makes `control` (control()'s layout) the session's policy and budget table from the
        next begin_step. With engine_control=True spind never changes them itself, so every
        rank that adopts the same tensor at the same step boundary selects the same blocks."""
        ops.adopt_control(self.handle, control)
