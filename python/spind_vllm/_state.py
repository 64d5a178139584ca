"""The per-step prologue, outside any CUDA graph: request id -> sequence slot, resets, the
tensor-parallel control broadcast, refresh, and the begin_step of each forward.

Two hooks drive it (docs/vllm.md, "Why a worker class and a builder wrapper"):
  - `on_schedule(scheduler_output)`, from the --worker-cls subclass before every
    execute_model: only the scheduler output says which requests are new, finished, preempted or
    resumed. It frees and assigns slots, resets reopened sequences, adopts rank 0's control
    (TP > 1) and refreshes the session. This is the step boundary.
  - `on_build(builder, common_attn_metadata, metadata)`, wrapped around the indexer metadata
    builder's build: only there are the batch order (decode requests first) and the lengths
    final. It calls begin_step with one entry per session slot row (padding after the decode
    requests), and records whether this forward's indexer runs on SPIN.
"""
import logging
import re

import torch

log = logging.getLogger("spind_vllm")


def _sequence_key(request_id):
    """spind.keys.sequence_key, imported on first use: the plugin loads before spind (and its
    torch ops) is imported, and calls this only with a spind session open."""
    from spind.keys import sequence_key

    return sequence_key(request_id)


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(prefix):
    """The decoder layer number in a vLLM layer prefix ("model.layers.12.self_attn.indexer.
    k_cache" -> 12); -1 when there is none (such a layer always runs dense)."""
    m = _LAYER_RE.search(str(prefix))
    return int(m.group(1)) if m else -1


class SlotMap:
    """Request id -> sequence slot in [0, capacity). Released slots are reused lowest first."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.slot_of = {}
        self._free = list(range(capacity - 1, -1, -1))  # pop() gives the lowest

    def assign(self, request_id):
        """The request's slot, taking a free one if it has none; None when all are taken."""
        slot = self.slot_of.get(request_id)
        if slot is None and self._free:
            slot = self._free.pop()
            self.slot_of[request_id] = slot
        return slot

    def release(self, request_id):
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort(reverse=True)
        return slot

    def get(self, request_id):
        return self.slot_of.get(request_id)


class GroupSync:
    """What one rank remembers between tensor-parallel step boundaries."""

    def __init__(self):
        self.generation = None  # this rank's session generation at the last boundary
        self.adopted = None     # the control tensor adopted last


def sync_tp_group(session, group, sync, all_reduce=None):
    """Tensor parallelism: one step boundary of the group, so that every rank selects the same
    blocks from the next begin_step on (docs/vllm.md). One collective (a sum over the group's
    CPU group) carries:
      - rank 0's control (`session.control()`: policy + budget table of its engine_control
        session; the other ranks add zeros), adopted by every rank when it changed and rank 0 is
        attached (its daemon's proposals only take effect this way, at the same step everywhere);
      - how many ranks run without a spind session (then the whole group runs dense);
      - how many ranks switched to a new spind session since the last boundary (each starts with
        fresh state, so every rank then resets its open sequences: states equal again).
    Returns (control, degraded, switched); None when the group has one rank. `all_reduce(t,
    group)` defaults to torch.distributed.all_reduce over `group.cpu_group`; `group` needs
    world_size, rank_in_group and cpu_group (vLLM's GroupCoordinator has them)."""
    if group is None or group.world_size <= 1:
        return None
    attached, generation = session.link()
    switched_here = sync.generation is not None and generation != sync.generation
    sync.generation = generation
    width = 7 + session.layers
    if group.rank_in_group == 0:
        control = session.control()
        if control.dtype != torch.float64 or control.device.type != "cpu" or \
                control.numel() != width:
            raise RuntimeError(f"spind_vllm: Session.control() gave {control.dtype} "
                               f"{tuple(control.shape)} on {control.device}; a CPU float64 "
                               f"tensor of {width} values is expected")
    else:
        control = torch.zeros(width, dtype=torch.float64)
    payload = torch.cat([control.contiguous(), torch.tensor(
        [0.0 if attached else 1.0, 1.0 if switched_here else 0.0], dtype=torch.float64)])
    if all_reduce is None:
        torch.distributed.all_reduce(payload, group=group.cpu_group)
    else:
        all_reduce(payload, group)
    control, degraded, switched = payload[:width], payload[width] > 0, payload[width + 1] > 0
    rank0_attached = control[1] == 1.0
    if rank0_attached and not degraded and (
            sync.adopted is None or not torch.equal(control[2:], sync.adopted[2:])):
        session.adopt_control(control)
        sync.adopted = control.clone()
    return control, bool(degraded), bool(switched)


class DenseStepFailed(RuntimeError):
    """A dense decision whose dense step could not begin (the builder wrapper lets it through:
    vLLM's step fails rather than replay a captured SPIN graph on a stale selection)."""


class PluginState:
    """What the plugin knows in one worker process. `STATE` below is the process's instance."""

    def __init__(self):
        self.session = None
        self.layers = 0           # indexer layers on SPIN: 0 .. layers-1 (MTP layers beyond)
        self.rows = 1             # 1 + speculative tokens
        self.block_size = 64
        self.topk = 2048
        self.max_seqs = 0
        self.slots = None
        self.runner = None        # the model runner (its input_batch.req_ids: the batch order)
        self.tp_group = None      # a GroupCoordinator when TP > 1
        self.in_step = False      # inside a real execute_model (not a dummy or capture run)
        self.drafting = False     # inside the worker's sample_tokens: the MTP drafter's builds
        self.step_pending = False # on_schedule ran; the next indexer build begins the step
        self.spin_step = False    # this forward's indexer batch was begun on SPIN
        self.dense_reason = "no session"
        self.batch_size = 0       # decode entries of the begun batch (padding included)
        self.live = 0             # of which live requests (rows 0 .. live-1)
        self.num_sms = 0
        self.topk_layers = []     # (layer, topk_tokens) the SPIN-capable indexer layers noted
        self.counters = {"resets": 0, "begin_steps": 0, "dense_steps": 0, "spin_calls": 0,
                         "dense_calls": 0,
                         "broadcasts": 0, "group_resets": 0}
        self.tp_sync = GroupSync()  # TP > 1: what the last step boundary saw
        self.tp_dense = False       # TP > 1: a rank runs without spind, the group runs dense
        self.dense_reasons = {}
        self._buffers = None
        self._ring, self._ring_at = [], 0
        self.topk_buf = None

    # ---- set-up ----------------------------------------------------------------------------
    def note_layer(self, layer, topk_tokens):
        self.topk_layers.append((layer, topk_tokens))

    def attach(self, session, *, layers, rows, block_size, topk, max_seqs, tp_group=None):
        """Adopt a spind.Session (opened by the worker, or by a test)."""
        self.session = session
        self.layers, self.rows, self.block_size = layers, rows, block_size
        self.topk, self.max_seqs = topk, max_seqs
        self.slots = SlotMap(max_seqs)
        self.tp_group = tp_group
        device = getattr(session, "device", torch.device("cpu"))
        i32 = dict(dtype=torch.int32, device=device)
        self._buffers = (torch.full((max_seqs,), -1, **i32), torch.zeros(max_seqs, **i32),
                         torch.zeros(max_seqs, **i32))
        # Pinned staging buffers for the slots (CUDA): a ring, so a step's host write never
        # races the previous steps' copies still queued on the stream.
        self._ring = [(torch.empty(max_seqs, dtype=torch.int32, pin_memory=True),
                       torch.cuda.Event()) for _ in range(3)] if device.type == "cuda" else []
        self._ring_at = 0
        # Top-K over the compacted logits, remapped in place for all begun entries (padding
        # entries' rows become -1), then copied into the engine's buffer.
        self.topk_buf = torch.full((max_seqs * rows, topk), -1, **i32)

    def detach(self):
        self.__init__()

    # ---- the step boundary (worker) --------------------------------------------------------
    def _open(self, request_id):
        slot = self.slots.assign(request_id)
        if slot is None:
            log.error("spind_vllm: no free sequence slot for request %s (max_seqs %d)",
                      request_id, self.max_seqs)
            return None
        self.session.reset_sequence(slot, _sequence_key(request_id))
        self.counters["resets"] += 1
        return slot

    def on_schedule(self, scheduler_output):
        if self.session is None:
            return
        for rid in getattr(scheduler_output, "finished_req_ids", None) or ():
            self.slots.release(rid)
        # A preempted request lost its KV cache: its slot is freed; if it comes back it is
        # resumed (below) and starts over as a fresh sequence.
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.slots.release(rid)
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            self._open(new.req_id)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        for rid in (getattr(cached, "resumed_req_ids", None) or ()) if cached else ():
            self.slots.release(rid)  # reset even if it kept its slot: its KV was recomputed
            self._open(rid)
        # Switch in a session the retry thread attached now, so the group sees it this step.
        self.session.refresh()
        self.tp_dense = False
        if self.tp_group is not None and self.tp_group.world_size > 1:
            synced = sync_tp_group(self.session, self.tp_group, self.tp_sync)
            if synced is not None:
                self.counters["broadcasts"] += 1
                _, degraded, switched = synced
                if switched:
                    # A rank's new spind session starts fresh: every rank starts over alike.
                    for rid, slot in self.slots.slot_of.items():
                        self.session.reset_sequence(slot, _sequence_key(rid))
                    self.counters["group_resets"] += 1
                self.tp_dense = degraded
        self.step_pending = True

    # ---- each forward (indexer metadata builder) -------------------------------------------
    def _dense_step(self, reason):
        self.spin_step = False
        self.dense_reason = reason

    def _static_reason(self, builder, metadata):
        """Dense reasons fixed by the configuration: the same when a CUDA graph is captured as
        when it is replayed, so the captured graph holds vLLM's own (dense) indexer path."""
        if getattr(builder, "compress_ratio", 1) != 1:
            return "compressed indexer cache (DeepSeek-V4)"
        spec = getattr(builder, "kv_cache_spec", None)
        if spec is not None and getattr(spec, "block_size", self.block_size) != self.block_size:
            return "indexer block size differs from the session's"
        if getattr(builder, "use_flattening", False) and self.rows > 1:
            # next_n > 2 on Hopper (or an FP4 cache): one row per token, 1-D lengths.
            return "flattened MTP decode"
        dec = metadata.decode
        if dec is not None and (dec.block_table.dim() != 2 or
                                dec.block_table.shape[1] < self.session.phys.shape[1]):
            # begin_step would refuse it (every layer selects through it): say why, once a step.
            return ("decode block table narrower than the session's blocks "
                    "(is the session's max_slots above max_model_len?)")
        return None

    def _live_rows(self, common_attn_metadata, nd):
        """How many of the nd decode rows are live requests, from the host copy of the query
        start locations (no device sync): live requests come first with `rows` query tokens
        each, then the padding requests of a batch padded to a captured CUDA-graph size, with
        none. None when the lengths are anything else (a short chunked prefill among the
        decodes: not a uniform batch)."""
        qsl = common_attn_metadata.query_start_loc_cpu[: nd + 1].tolist()
        lens = [b - a for a, b in zip(qsl, qsl[1:])]
        live = 0
        while live < nd and lens[live] == self.rows:
            live += 1
        if any(n != 0 for n in lens[live:]):
            return None
        return live

    def _stage_slots(self, slots):
        """The live requests' sequence slots into the device's seq buffer without a host sync:
        through a pinned staging buffer (one of a small ring, reused only after its copy ran)
        and a non-blocking copy on the current stream."""
        seq = self._buffers[0]
        n = len(slots)
        if seq.device.type != "cuda":
            seq[:n] = torch.tensor(slots, dtype=torch.int32)
            return
        host, event = self._ring[self._ring_at]
        if not event.query():
            event.synchronize()  # recorded steps ago: done unless the host ran far ahead
        host[:n] = torch.tensor(slots, dtype=torch.int32)
        seq[:n].copy_(host[:n], non_blocking=True)
        event.record()
        self._ring_at = (self._ring_at + 1) % len(self._ring)

    def _begin(self, dec, nd, live, slots):
        """begin_step over the nd decode rows: rows 0..live-1 are the requests in `slots` (None:
        a dense step, no sequence: every block of each row, no SPIN state read or changed), the
        rest padding (no sequence, no slots). The decode block table is every indexer layer's
        (the op selects through the same tensor): given now, each layer's observe publishes
        the next layer's selection and that select launches nothing (docs/vllm.md)."""
        seq, ctx, qpos = self._buffers
        seq.fill_(-1)
        ctx.zero_()
        if slots:
            self._stage_slots(slots)
        if live:
            # Row 0 of request b sees N = seq_lens[b, 0] slots (vLLM's 2-D decode seq_lens are
            # L - next_n + j + 1), and its own key is the last of them.
            ctx[:live] = dec.seq_lens[:live, 0].to(ctx.device, torch.int32)
        torch.sub(ctx, 1, out=qpos)
        qpos.clamp_(min=0)
        self.session.begin_step(seq, ctx, qpos, self.rows, dec.block_table)
        self.batch_size = nd

    def _begin_dense(self, dec, nd, live, reason, replayable=False):
        """A dense decision: vLLM's own indexer runs where our op's Python runs (eager and
        piecewise steps), and a replayed CUDA graph holding the SPIN path (captured before the
        decision) selects every block of every live row through a dense step. If even that
        step cannot begin for a batch a FULL graph may replay (`replayable`: a uniform decode
        batch), the replay would read a stale selection: the step fails loudly instead. Other
        batches run eagerly or piecewise, where the op's Python takes vLLM's path."""
        self._dense_step(reason)
        if dec is None or nd > self.max_seqs:
            return
        try:
            self._begin(dec, nd, nd if live is None else live, None)
            self.counters["dense_steps"] += 1
        except Exception as e:  # noqa: BLE001
            if not replayable:
                log.exception("spind_vllm: the dense step could not begin (%s); this batch "
                              "runs eagerly, vLLM's own indexer serves it", reason)
                return
            raise DenseStepFailed(f"spind_vllm: this step is dense ({reason}) and its dense step "
                                  f"could not begin ({e}); a replayed CUDA graph would select "
                                  "stale blocks, so the step fails instead") from e

    def _drafter_builder(self, builder):
        """The MTP drafter's own builder: every layer it builds for lies past the session's
        layers (the draft layer, model.layers.61 of DeepSeek-V3.2); the target model's builder
        lists the model's layers (and the draft layer too: one KV-cache group)."""
        names = getattr(builder, "layer_names", None)
        if not names:
            return False
        return all(layer_index(n) < 0 or layer_index(n) >= self.layers for n in names)

    def fail_dense(self, metadata, reason):
        """on_build failed unexpectedly: this step is dense, as every dense decision is."""
        if self.session is None or self.drafting:
            return self._dense_step(reason)
        return self._begin_dense(metadata.decode, metadata.num_decodes, None, reason,
                                 replayable=metadata.num_prefills == 0)

    def on_build(self, builder, common_attn_metadata, metadata):
        if self.session is None:
            return self._dense_step("no session (is --worker-cls spind_vllm.worker.SpindWorker set?)")
        if self.drafting or self._drafter_builder(builder):
            return  # the MTP drafter's build (after the target's forward): not a step of ours
        real = self.in_step
        if real and not self.step_pending:
            return  # a second build in the same step (another KV-cache group)
        self.step_pending = False
        static = self._static_reason(builder, metadata)
        if static is not None:
            return self._dense_step(static)
        dec = metadata.decode
        nd = metadata.num_decodes
        self.num_sms = getattr(builder, "num_sms", 0)
        if dec is None:
            return self._dense_step("prefill batch")
        live = self._live_rows(common_attn_metadata, nd)
        # A uniform decode batch (every live request next_n tokens, padding none) is what a
        # FULL CUDA graph may replay; anything else runs eagerly or piecewise.
        replayable = metadata.num_prefills == 0 and live is not None

        def dense(reason, rows=live):
            return self._begin_dense(dec, nd, rows, reason, replayable)
        if self.tp_dense:
            return dense("a tensor-parallel rank runs without a spind session")
        if metadata.num_prefills > 0:
            return dense("prefill or mixed batch")
        if dec.seq_lens.dim() != 2 or dec.seq_lens.shape[1] != self.rows:
            return dense("decode rows differ from the session's")
        if nd > self.max_seqs:
            return dense("more decode requests than session slots")
        if live is None:
            return dense("non-uniform decode lengths", None)
        slots = []
        if real and live:
            req_ids = list(self.runner.input_batch.req_ids[:live]) if self.runner else []
            slots = [self.slots.get(r) for r in req_ids]
            if len(slots) != live or any(s is None for s in slots):
                log.error("spind_vllm: decode requests without a sequence slot: %s", req_ids)
                return dense("decode requests without a slot")
        elif not real:
            live = 0  # a dummy or capture run: padding entries, the SPIN path is captured
        try:
            self._begin(dec, nd, live, slots)
        except Exception:  # noqa: BLE001 - never fail vLLM's step for SPIN: this step is dense
            log.exception("spind_vllm: begin_step failed; this step runs dense")
            return dense("begin_step failed")
        self.counters["begin_steps"] += 1
        self.live = live
        self.spin_step = True
        self.dense_reason = None

    def note_dense(self, reason):
        self.counters["dense_calls"] += 1
        self.dense_reasons[reason] = self.dense_reasons.get(reason, 0) + 1


STATE = PluginState()
