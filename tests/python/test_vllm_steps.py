"""spind_vllm's decode steps as vLLM runs them, over vLLM's own files (tests/python/vllm_real).

vLLM's real indexer metadata builder, CustomOp dispatch and `sparse_attn_indexer` body (loaded
from the shared copy of vLLM 9aaf83ef, CPU stand-ins for the fp8 kernels), the plugin's worker
class over a stub runner that builds CommonAttentionMetadata as vLLM's model runner does, and a
real local spind.Session. What each test shows:

  - a decode batch padded to a captured CUDA-graph size (requires_padding, padding requests
    with no tokens) is a SPIN step over its live requests, next_n 1 and 2;
  - a dense decision taken after a graph was captured on the SPIN path is obeyed by the replay:
    the SPIN path alone (what a FULL graph replays, `_op.spin_path`) then computes vLLM's dense
    result (a tensor-parallel rank without spind, a failed begin_step, a mixed batch,
    non-uniform MTP lengths);
  - the MTP drafter's builds (in sample_tokens, its own builder) leave the target step alone
    and the draft layer runs vLLM's dense path;
  - at sparsity 0 the layer's output equals vLLM's own sparse_attn_indexer bit for bit at
    top-K 2048 on a CUDA-like platform, where both take persistent_topk.

Run (from tests/python): PYTHONPATH=<build>/python python3 -m unittest -v test_vllm_steps
"""
import os
import types
import unittest

import torch

import vllm_real

D, H, BLOCK = 16, 4, 64


def prefix(layer):
    return f"model.layers.{layer}.self_attn.indexer.k_cache"


def setUpModule():
    vllm_real.install_for_tests()
    import spind_vllm
    spind_vllm.register()


def sched(new=(), decode=(), finished=()):
    """vLLM's SchedulerOutput (the fields the plugin reads; the rest filled plainly)."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    news = [NewRequestData(req_id=r, prompt_token_ids=[0], mm_features=[], sampling_params=None,
                           pooling_params=None, block_ids=([],), num_computed_tokens=0,
                           lora_request=None) for r in new]
    cached = CachedRequestData(req_ids=list(decode), resumed_req_ids=set(), new_token_ids=[],
                               all_token_ids={}, new_block_ids=[], num_computed_tokens=[],
                               num_output_tokens=[])
    return SchedulerOutput(scheduled_new_reqs=news, scheduled_cached_reqs=cached,
                           num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           num_common_prefix_blocks=[], finished_req_ids=set(finished),
                           free_encoder_mm_hashes=[])


class Recorder:
    """The session, recording each select's union (entry -> kept logical blocks)."""

    def __init__(self, s):
        self._s = s
        self.unions = []

    def __getattr__(self, name):
        return getattr(self._s, name)

    def select(self, layer, block_table=None):
        self._s.select(layer, block_table)
        count = self._s.union_count.cpu()
        ids = self._s.union_ids.cpu()
        self.unions.append((layer, [ids[e, : int(count[e])].tolist()
                                    for e in range(count.shape[0])]))


class Engine:
    """vLLM's side of a decode step: the real builder, `layers` real SparseAttnIndexer layers
    (the plugin's class, through CustomOp's OOT registry) over float32 indexer caches, the
    plugin's SpindWorker over a stub runner, requests with their own pages."""

    def __init__(self, layers=2, spec=0, topk=64, max_len=1024, max_seqs=8, sparsity="0.5",
                 device="cpu", seed=0):
        from spind_vllm import _state
        from spind_vllm.worker import SpindWorker
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
        self.nl, self.rows, self.topk, self.max_len = layers, 1 + spec, topk, max_len
        self.device = torch.device(device)
        cfg = vllm_real.make_vllm_config(max_model_len=max_len, block_size=BLOCK,
                                         max_num_seqs=max_seqs, num_speculative_tokens=spec,
                                         max_num_batched_tokens=4096, layers=layers)
        # The target model's KV-cache group lists the draft layer too (vLLM's one group).
        names = [prefix(i) for i in range(layers + (1 if spec else 0))]
        self.builder = vllm_real.make_builder(vllm_config=cfg, layer_names=names, head_dim=D,
                                              device=device, block_size=BLOCK,
                                              max_model_len=max_len)
        self.pages = max_seqs * (max_len // BLOCK) + 1
        self.caches = [vllm_real.new_kv_cache(self.pages, BLOCK, D, device=device)
                       for _ in range(layers + 1)]
        self.buf = torch.full((4096, topk), -7, dtype=torch.int32, device=device)
        self.gen = torch.Generator().manual_seed(seed)
        self.free = list(range(self.pages - 1, 0, -1))
        self.reqs = {}  # id -> {"len": computed tokens, "pages": [...]}
        _state.STATE.detach()

        def load():
            self.model = [SparseAttnIndexer(vllm_real.k_cache(prefix(i), self.caches[i]), 128,
                                            "ue8m0", topk, D, max_len, max_len * 40, self.buf)
                          for i in range(layers + 1)]  # the last: the MTP draft layer
        self.worker = SpindWorker(cfg, 0, 0)
        self.worker.model_runner.load_fn = load
        env = {"SPIND_TARGET": "", "SPIND_STATE": "fp32", "SPIND_SPARSITY": sparsity,
               "SPIND_EXPLORATION": "0.0", "SPIND_SEED": "7", "SPIND_BLOCK_SIZE": str(BLOCK)}
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            self.worker.load_model()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self.st = _state.STATE
        self.assertions = []
        self.recorder = Recorder(self.st.session)
        self.st.session = self.recorder

    # ---- one engine step ---------------------------------------------------------------------
    def _table(self, ids):
        return [self.reqs[r]["pages"] for r in ids]

    def _grow(self, rid, tokens):
        r = self.reqs[rid]
        r["len"] += tokens
        while len(r["pages"]) * BLOCK < r["len"]:
            r["pages"].append(self.free.pop())

    def step(self, decode=(), prefill=None, new=None, padded_to=None, order=None,
             before_build=None):
        """One execute_model: `new` {id: prompt tokens} (prefilled now), `decode` ids (each
        `rows` tokens), `prefill` {id: chunk tokens} of running requests; the batch is padded
        to `padded_to` requests as a FULL graph is. `order`: the runner's batch order of the
        decode requests. `before_build()` runs after the step boundary, before vLLM builds the
        metadata. Returns per layer (output rows, q, k, w); the metadata is in self.md."""
        new, prefill = dict(new or {}), dict(prefill or {})
        for rid in new:
            self.reqs[rid] = {"len": 0, "pages": []}
        decode = list(order or decode)
        reqs = []
        for rid in decode:
            self._grow(rid, self.rows)
            reqs.append((self.reqs[rid]["len"], self.rows, False))
        chunks = list(prefill.items()) + list(new.items())
        for rid, n in chunks:
            self._grow(rid, n)
            reqs.append((self.reqs[rid]["len"], n, True))
        ids = decode + [rid for rid, _ in chunks]
        cam = vllm_real.batch(reqs, padded_to=padded_to, block_table=self._table(ids),
                              device=self.device)
        out = {}

        def run(_sched):
            self.worker.model_runner.input_batch.req_ids = ids
            if before_build is not None:
                before_build()
            md = self.builder.build(0, cam)
            self.md, self.cam = md, cam
            t = cam.num_actual_tokens
            for i in range(self.nl):
                q = torch.randn(t, H, D, generator=self.gen).to(self.device)
                w = torch.rand(t, H, generator=self.gen).to(self.device)
                k = torch.randn(t, D, generator=self.gen).to(self.device)
                with vllm_real.forward_context({prefix(j): md for j in range(self.nl + 1)}):
                    res = self.model[i](torch.zeros(t, 1, device=self.device), q, k, w)
                out[i] = (res[:t].clone(), q, k, w)
            return None
        self.worker.model_runner.step_fn = run
        self.worker.execute_model(sched(new=list(new), decode=decode))
        return out

    # ---- references --------------------------------------------------------------------------
    def vllm_dense(self, layer, md, q, k, w):
        """vLLM's own sparse_attn_indexer (the real function body) over the same inputs, the
        step's K already in the cache."""
        from vllm.model_executor.layers import sparse_attn_indexer as sai
        buf = torch.full_like(self.buf, -7)
        t = q.shape[0]
        with vllm_real.forward_context({prefix(j): md for j in range(self.nl + 1)}):
            sai.sparse_attn_indexer(torch.zeros(t, 1, device=self.device), prefix(layer),
                                    self.caches[layer], q, None, k, w, 128, "ue8m0", self.topk,
                                    D, self.max_len, self.max_len * 40, buf, True, False)
        return buf[:t]

    def replay(self, layer, md, q, k, w):
        """What a FULL CUDA graph captured on the SPIN path replays for this layer: the SPIN
        path alone, with no Python decision (spind_vllm._op.spin_path)."""
        from spind_vllm import _op
        buf = torch.full_like(self.buf, -7)
        t = q.shape[0]
        _op.spin_path(self.st, md, torch.zeros(t, 1, device=self.device), self.caches[layer], q,
                      k, w, 128, "ue8m0", self.topk, D, self.max_len, buf, True, layer)
        return buf[:t]

    def restricted_topk(self, layer, md, q, w, b, j, blocks):
        """vLLM's dense scores of row (b, j), restricted to `blocks`: the top-K slots."""
        kernels = vllm_real.kernels
        dec = md.decode
        lens = dec.seq_lens[b: b + 1].to(torch.int32)
        r = b * self.rows
        logits = kernels.fp8_fp4_paged_mqa_logits(
            (q[r: r + self.rows].reshape(1, self.rows, H, D), None),
            self.caches[layer].unsqueeze(-2), w[r: r + self.rows], lens,
            dec.block_table[b: b + 1], None, self.max_len, True)[j].cpu()
        n = int(lens[0, j])
        slots = [c for c in range(n) if c // BLOCK in set(blocks)]
        ranked = sorted(slots, key=lambda c: (-float(logits[c]), c))[: self.topk]
        return sorted(ranked)


def live(row):
    return [x for x in row.tolist() if x >= 0]


class PaddedBatches(unittest.TestCase):
    """Item 1: a batch padded to a captured size is a SPIN step over its live requests."""

    def run_padded(self, spec):
        e = Engine(spec=spec)
        e.step(new={"a": 700, "b": 450, "c": 300})  # prefill: dense (vLLM's own path)
        sparse_rows = 0
        for step in range(4):
            before = dict(e.st.counters)
            e.recorder.unions.clear()
            # The runner's order: c, a, b (not the order they arrived); padded to 4 requests.
            out = e.step(decode=["c", "a", "b"], padded_to=4)
            self.assertTrue(e.md.decode.requires_padding)
            self.assertEqual(e.md.num_decodes, 4)
            self.assertEqual(e.st.counters["spin_calls"] - before["spin_calls"], e.nl,
                             f"step {step}: the padded batch ran dense: {e.st.dense_reasons}")
            self.assertEqual(e.st.live, 3)
            for layer, (rows_out, q, k, w) in out.items():
                unions = dict(e.recorder.unions)[layer]
                self.assertEqual(unions[3], [], "the padding entry selects nothing")
                for j in range(e.rows):
                    self.assertEqual(live(rows_out[3 * e.rows + j]), [], "padding row")
                for b, rid in enumerate(["c", "a", "b"]):
                    L = e.reqs[rid]["len"]
                    nb = -(-L // BLOCK)
                    self.assertIn((L - 1) // BLOCK, unions[b], "the query block is kept")
                    sparse_rows += len(unions[b]) < nb
                    for j in range(e.rows):
                        want = e.restricted_topk(layer, e.md, q, w, b, j, unions[b])
                        self.assertEqual(live(rows_out[b * e.rows + j]), want,
                                         f"step {step} layer {layer} request {rid} row {j}")
        self.assertGreater(sparse_rows, 0, "some selections were sparse")

    def test_padded_decode_is_a_spin_step(self):
        self.run_padded(spec=0)

    def test_padded_mtp_decode_next_n_2_is_a_spin_step(self):
        self.run_padded(spec=1)

    def test_unpadded_decode_is_a_spin_step_too(self):
        e = Engine()
        e.step(new={"a": 500, "b": 260})
        before = e.st.counters["spin_calls"]
        e.step(decode=["a", "b"])
        self.assertFalse(e.md.decode.requires_padding)
        self.assertEqual(e.st.counters["spin_calls"] - before, e.nl)


class DenseDecisions(unittest.TestCase):
    """Item 2: a dense decision after capture is state the replayed SPIN path obeys."""

    def warm(self, spec=0):
        e = Engine(spec=spec)
        e.step(new={"a": 900, "b": 640, "c": 333})
        for _ in range(3):  # SPIN steps: the sequences' state is set, selections sparse
            e.step(decode=["a", "b", "c"], padded_to=4)
        return e

    def check_replay_is_dense(self, e, out, reason, rows=None):
        self.assertEqual(e.st.dense_reason, reason)
        self.assertFalse(e.st.spin_step)
        rows = rows if rows is not None else e.st.batch_size * e.rows
        for layer, (eager, q, k, w) in out.items():
            want = e.vllm_dense(layer, e.md, q, k, w)
            self.assertTrue(torch.equal(eager, want), f"layer {layer}: eager = vLLM's dense")
            got = e.replay(layer, e.md, q, k, w)
            self.assertTrue(torch.equal(got[:rows], want[:rows]),
                            f"layer {layer}: the replayed SPIN path is not vLLM's dense")

    def test_a_tensor_parallel_rank_without_spind(self):
        e = self.warm()
        dense_before = e.st.counters["dense_steps"]

        def degraded():  # what on_schedule's group sync found this step
            e.st.tp_dense = True
        out = e.step(decode=["a", "b", "c"], padded_to=4, before_build=degraded)
        self.assertEqual(e.st.counters["dense_steps"], dense_before + 1)
        self.check_replay_is_dense(e, out, "a tensor-parallel rank runs without a spind session")

    def test_a_failed_begin_step(self):
        e = self.warm()
        real = e.recorder._s.begin_step
        calls = []

        def failing_once(*args):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("spind.begin_step: injected failure")
            return real(*args)
        e.recorder.begin_step = failing_once
        out = e.step(decode=["a", "b", "c"], padded_to=4)
        self.assertEqual(len(calls), 2, "the SPIN step failed, the dense step began")
        self.check_replay_is_dense(e, out, "begin_step failed")

    def test_a_dense_step_that_cannot_begin(self):
        # Every begin_step fails: a uniform decode batch (which a FULL graph may replay) fails
        # the step loudly rather than replay a stale selection; a mixed batch (eager or
        # piecewise: the op's Python serves it) runs vLLM's own indexer.
        from spind_vllm._state import DenseStepFailed
        e = self.warm()

        def failing(*args):
            raise RuntimeError("spind.begin_step: injected failure")
        e.recorder.begin_step = failing
        with self.assertRaises(DenseStepFailed):
            e.step(decode=["a", "b", "c"], padded_to=4)
        self.assertFalse(e.st.in_step)
        out = e.step(decode=["a", "b"], prefill={"c": 40})
        self.assertEqual(e.st.dense_reason, "prefill or mixed batch")
        for layer, (eager, q, k, w) in out.items():
            self.assertTrue(torch.equal(eager, e.vllm_dense(layer, e.md, q, k, w)))

    def test_flattened_mtp_is_dense_at_capture_and_after(self):
        # next_n 3 on Hopper: vLLM flattens the rows (one per token). Fixed by the
        # configuration, so the capture run already takes vLLM's path: nothing is begun.
        e = Engine(spec=2)
        self.assertTrue(e.builder.use_flattening)
        e.step(new={"a": 300, "b": 200})
        begun = e.st.counters["begin_steps"], e.st.counters["dense_steps"]
        e.builder.build(0, vllm_real.capture_batch(2, next_n=3))
        out = e.step(decode=["a", "b"])
        self.assertEqual(e.st.dense_reason, "flattened MTP decode")
        self.assertEqual((e.st.counters["begin_steps"], e.st.counters["dense_steps"]), begun)
        for layer, (eager, q, k, w) in out.items():
            self.assertTrue(torch.equal(eager, e.vllm_dense(layer, e.md, q, k, w)))

    def test_a_mixed_batch(self):
        e = self.warm()
        out = e.step(decode=["a", "b"], prefill={"c": 40})
        self.assertGreater(e.md.num_prefills, 0)
        self.check_replay_is_dense(e, out, "prefill or mixed batch",
                                   rows=e.md.num_decodes * e.rows)

    def test_a_short_request_among_mtp_decodes(self):
        e = self.warm(spec=1)
        # c schedules one token while a and b schedule 1 + 1: vLLM's split (uniform decodes
        # required on Hopper) makes c a prefill, so the batch is mixed.
        out = e.step(decode=["a", "b"], prefill={"c": 1})
        self.assertEqual((e.md.num_decodes, e.md.num_prefills), (2, 1))
        self.check_replay_is_dense(e, out, "prefill or mixed batch",
                                   rows=e.md.num_decodes * e.rows)

    def test_a_dense_step_changes_no_spin_state(self):
        # The same engine twice (same seeds); the second takes a dense step before the step
        # compared, whose selections must be the first one's (same contexts, same inputs).
        e1 = self.warm()
        gen, lens = e1.gen.get_state(), {r: e1.reqs[r]["len"] for r in "abc"}
        e1.recorder.unions.clear()
        e1.step(decode=["a", "b", "c"], padded_to=4)
        first = list(e1.recorder.unions)
        e2 = self.warm()

        def degraded():
            e2.st.tp_dense = True
        e2.step(decode=["a", "b", "c"], padded_to=4, before_build=degraded)
        self.assertEqual(e2.st.dense_reason, "a tensor-parallel rank runs without a spind session")
        e2.gen.set_state(gen)
        for rid in "abc":
            e2.reqs[rid]["len"] = lens[rid]
        e2.recorder.unions.clear()
        e2.step(decode=["a", "b", "c"], padded_to=4)
        self.assertTrue(e2.st.spin_step)
        self.assertEqual(e2.recorder.unions, first)


class Drafter(unittest.TestCase):
    """Item 3: the MTP drafter's builds leave the target step alone; the draft layer is dense."""

    def test_drafter_builds_leave_the_target_step_alone(self):
        e = Engine(spec=1)
        e.step(new={"a": 500, "b": 300, "c": 200})
        e.step(decode=["a", "b", "c"], padded_to=4)
        drafter = vllm_real.make_builder(vllm_config=e.builder.vllm_config, head_dim=D,
                                         layer_names=[prefix(e.nl)], block_size=BLOCK,
                                         max_model_len=e.max_len)
        target_md = e.md
        outputs = {}

        def sample(_grammar):
            # The drafter's passes as vLLM's proposer builds them: every live request's 1 + k
            # tokens, then one token each (the target's metadata, rewrapped).
            begun = e.st.counters["begin_steps"], e.st.counters["dense_steps"]
            snap = (e.recorder.compact_len.clone(), e.recorder.phys.clone())
            lens = [e.reqs[r]["len"] for r in ("a", "b", "c")]
            pass1 = drafter.build(0, vllm_real.decode_batch(lens, next_n=2,
                                                            block_table=e._table("abc")),
                                  fast_build=True)
            drafter.build(0, vllm_real.batch([(L + 1, 1) for L in lens],
                                             block_table=e._table("abc")), fast_build=True)
            self.assertEqual((e.st.counters["begin_steps"], e.st.counters["dense_steps"]), begun)
            self.assertTrue(torch.equal(e.recorder.compact_len, snap[0]))
            self.assertTrue(torch.equal(e.recorder.phys, snap[1]))
            # The draft layer (past the session's layers) runs vLLM's dense path.
            t = pass1.num_decode_tokens
            q, w = torch.randn(t, H, D), torch.rand(t, H)
            k = torch.randn(t, D)
            dense_before = e.st.dense_reasons.get(
                "layer outside the session (e.g. an MTP draft layer)", 0)
            with vllm_real.forward_context({prefix(e.nl): pass1}):
                outputs["draft"] = e.model[e.nl](torch.zeros(t, 1), q, k, w)[:t].clone()
            self.assertEqual(e.st.dense_reasons.get(
                "layer outside the session (e.g. an MTP draft layer)", 0), dense_before + 1)
            outputs["draft_want"] = e.vllm_dense(e.nl, pass1, q, k, w)
        e.worker.model_runner.sample_fn = sample
        e.worker.sample_tokens(None)
        self.assertIn("draft", outputs)
        self.assertTrue(torch.equal(outputs["draft"], outputs["draft_want"]))
        self.assertFalse(e.st.drafting)
        # The layer-name test alone (a drafter build outside sample_tokens) also begins nothing.
        begun = e.st.counters["begin_steps"]
        drafter.build(0, vllm_real.decode_batch([e.reqs["a"]["len"]], next_n=2,
                                                block_table=e._table("a")))
        self.assertEqual(e.st.counters["begin_steps"], begun)
        # The target's next step still runs on SPIN, its selection valid.
        spin = e.st.counters["spin_calls"]
        e.step(decode=["a", "b", "c"], padded_to=4)
        self.assertEqual(e.st.counters["spin_calls"] - spin, e.nl)
        self.assertIsNot(e.md, target_md)


class DenseEqualsVllm(unittest.TestCase):
    """Item 5: at sparsity 0 the layer equals vLLM's own, at top-K 2048 (persistent_topk)."""

    def test_sparsity_zero_equals_vllms_indexer_at_topk_2048(self):
        kernels = vllm_real.kernels
        with vllm_real.cuda_like(True):
            e = Engine(topk=2048, max_len=4096, sparsity="0")
            for rid, n in (("a", 3900), ("b", 2500), ("c", 2100)):  # a chunk per step
                e.step(new={rid: n})
            for step in range(3):
                kernels.reset()
                spin = e.st.counters["spin_calls"]
                out = e.step(decode=["b", "c", "a"], padded_to=4)
                self.assertEqual(e.st.counters["spin_calls"] - spin, e.nl)
                self.assertEqual(kernels.CALLS["persistent_topk"], e.nl)
                self.assertEqual(kernels.CALLS["top_k_per_row_decode"], 0)
                for layer, (eager, q, k, w) in out.items():
                    want = e.vllm_dense(layer, e.md, q, k, w)
                    self.assertTrue(torch.equal(eager, want), f"step {step} layer {layer}")
                # vLLM's own calls in vllm_dense took persistent_topk as well.
                self.assertEqual(kernels.CALLS["persistent_topk"], 2 * e.nl)


class StaticInputs:
    """The runner's persistent tensors for one captured batch size (vLLM fills its own in place
    every step, so a FULL graph's addresses stay valid): the CommonAttentionMetadata device
    tensors, and the layers' inputs."""

    def __init__(self, e, padded, tokens):
        dev = e.device
        self.padded, self.tokens = padded, tokens
        self.qsl = torch.zeros(padded + 1, dtype=torch.int32, device=dev)
        self.seq = torch.zeros(padded, dtype=torch.int32, device=dev)
        self.table = None
        self.slots = torch.full((tokens,), -1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.q = [torch.zeros(tokens, H, D, device=dev) for _ in range(e.nl)]
        self.w = [torch.zeros(tokens, H, device=dev) for _ in range(e.nl)]
        self.k = [torch.zeros(tokens, D, device=dev) for _ in range(e.nl)]
        self.hidden = torch.zeros(tokens, 1, device=dev)

    def fill(self, cam):
        """Copies a step's metadata into the persistent tensors; returns the metadata over
        them (the host parts as built)."""
        import dataclasses
        if self.table is None:
            self.table = torch.zeros_like(cam.block_table_tensor)
        self.qsl.copy_(cam.query_start_loc)
        self.seq.copy_(cam.seq_lens)
        self.table.copy_(cam.block_table_tensor)
        self.slots.copy_(cam.slot_mapping)
        self.positions.copy_(cam.positions)
        return dataclasses.replace(cam, query_start_loc=self.qsl, seq_lens=self.seq,
                                   block_table_tensor=self.table, slot_mapping=self.slots,
                                   positions=self.positions)


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device (the GPU test machine runs it)")
class CudaGraphs(unittest.TestCase):
    """Item 7, on the GPU: FULL CUDA graphs of the plugin's decode layers captured at batch sizes
    1, 2, 4 and 8 with metadata from vLLM's builder, replayed for batches of 3, 5 and 7 live
    requests and an MTP batch: the live requests' selections equal an eager CPU session's fed
    the same step and logits, padding rows stay -1, a dense decision after capture is obeyed,
    and the step path (step boundary, build, replay) makes no synchronising call."""

    def engine(self, spec):
        import spind
        e = Engine(spec=spec, device="cuda", max_seqs=8, layers=3)
        # The CUDA session's mirror: a CPU session of the same geometry and policy that begins
        # the same batches and observes the same logits.
        e.cpu = spind.Session(e.nl, e.max_len, block_size=BLOCK, topk=e.topk, max_sequences=8,
                              max_rows=e.rows, state="fp32", seed=7, target_sparsity=0.5,
                              exploration=0.0)
        e.snap = {}
        return e

    def capture(self, e, padded):
        """Captures the decode step of `padded` requests (vLLM's capture run: every request a
        dummy, so the plugin begins an all-padding step), after one eager warm-up."""
        from vllm.utils import deep_gemm
        tokens = padded * e.rows
        st = StaticInputs(e, padded, tokens)
        md = e.builder.build(0, st.fill(vllm_real.capture_batch(padded, next_n=e.rows,
                                                                device="cuda")))
        self.assertTrue(e.st.spin_step)
        real_logits = deep_gemm.fp8_fp4_paged_mqa_logits
        snaps = {layer: {} for layer in range(e.nl)}
        state = {"layer": None}

        def logits_and_snapshot(*args, **kwargs):
            out = real_logits(*args, **kwargs)
            snap = snaps[state["layer"]]
            if "logits" not in snap:
                snap["logits"] = torch.empty_like(out)
            snap["logits"].copy_(out)
            s = e.recorder._s
            for name in ("union_count", "union_ids", "compact_len"):
                if name not in snap:
                    snap[name] = torch.empty_like(getattr(s, name))
                snap[name].copy_(getattr(s, name))
            return out

        def forward():
            ctx = {prefix(j): md for j in range(e.nl + 1)}
            with vllm_real.forward_context(ctx):
                for layer in range(e.nl):
                    state["layer"] = layer
                    e.model[layer](st.hidden, st.q[layer], st.k[layer], st.w[layer])
        deep_gemm.fp8_fp4_paged_mqa_logits = logits_and_snapshot
        e.recorder.select = e.recorder._s.select  # no host copies inside a capture
        try:
            forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
        finally:
            deep_gemm.fp8_fp4_paged_mqa_logits = real_logits
        torch.cuda.synchronize()
        return graph, st, snaps

    def replay_step(self, e, graphs, live, order, new=None, finished=None, before_build=None,
                    check_sync=True):
        """One engine step of the live requests `order` on the smallest captured graph that
        holds them: the persistent tensors filled, then execute_model (step boundary, vLLM's
        build, the graph's replay) under torch's sync debug mode "error"."""
        padded = min(p for p in graphs if p >= len(order))
        graph, st, snaps = graphs[padded]
        for rid in order:
            e._grow(rid, e.rows)
        cam = vllm_real.batch([(e.reqs[r]["len"], e.rows, False) for r in order],
                              padded_to=padded, block_table=e._table(order), device="cuda")
        cam = st.fill(cam)
        for layer in range(e.nl):
            st.q[layer].copy_(torch.randn(st.tokens, H, D, generator=e.gen))
            st.w[layer].copy_(torch.rand(st.tokens, H, generator=e.gen))
            st.k[layer].copy_(torch.randn(st.tokens, D, generator=e.gen))
        torch.cuda.synchronize()
        result = {}

        def run(_sched):
            e.worker.model_runner.input_batch.req_ids = list(order)
            if before_build is not None:
                before_build()
            result["md"] = e.builder.build(0, cam)
            graph.replay()
        e.worker.model_runner.step_fn = run
        if check_sync:
            torch.cuda.set_sync_debug_mode("error")
        try:
            e.worker.execute_model(sched(new=list(new or ()), decode=list(order),
                                         finished=list(finished or ())))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        return result["md"], st, snaps, padded

    def mirror(self, e, md, snaps, padded, dense=False):
        """The CPU session begins the batch the CUDA session began, selects each layer and
        must select what the GPU did; then observes the logits the GPU observed."""
        seq, ctx, qpos = (b.cpu() for b in e.st._buffers)
        table = md.decode.block_table.cpu().contiguous()
        e.cpu.begin_step(seq[:padded].contiguous(), ctx[:padded].contiguous(),
                         qpos[:padded].contiguous(), e.rows, table)
        for layer in range(e.nl):
            e.cpu.select(layer)
            snap = snaps[layer]
            n = padded
            self.assertEqual(e.cpu.union_count[:n].tolist(),
                             snap["union_count"][:n].cpu().tolist(), f"layer {layer}")
            for b in range(n):
                c = int(e.cpu.union_count[b])
                self.assertEqual(e.cpu.union_ids[b, :c].tolist(),
                                 snap["union_ids"][b, :c].cpu().tolist(),
                                 f"layer {layer} entry {b}")
            logits = snap["logits"].cpu().contiguous()
            e.cpu.observe(layer, logits)

    def run_sizes(self, spec, live_counts):
        e = self.engine(spec)
        ids = [f"r{i}" for i in range(8)]
        for rid in ids:  # prefill every request eagerly (vLLM's own path)
            e.step(new={rid: 200 + 97 * int(rid[1:])})
            e.cpu.reset_sequence(e.st.slots.get(rid), _key(rid))
        graphs = {p: self.capture(e, p) for p in (1, 2, 4, 8)}
        for n in live_counts:
            order = list(reversed(ids[:n]))  # the runner's order, not arrival order
            for _ in range(2):
                md, st, snaps, padded = self.replay_step(e, graphs, n, order)
                self.assertTrue(e.st.spin_step, e.st.dense_reason)
                self.assertEqual(e.st.live, n)
                self.mirror(e, md, snaps, padded)
                out = e.buf[: padded * e.rows].cpu()
                for row in range(n * e.rows, padded * e.rows):
                    self.assertEqual(live(out[row]), [], f"padding row {row}")
        return e, graphs, ids

    def test_captured_sizes_replay_live_batches(self):
        e, graphs, ids = self.run_sizes(0, (3, 5, 7))
        # A step boundary that finishes a request and opens a new one in its slot: the reset
        # is queued on the stream behind the steps in flight, with no synchronising call.
        slot = e.st.slots.get("r7")
        md, st, snaps, padded = self.replay_step(e, graphs, 3, ids[:3], new=["z"],
                                                 finished=["r7"])
        self.assertEqual(e.st.slots.get("z"), slot)
        e.cpu.reset_sequence(slot, _key("z"))
        self.mirror(e, md, snaps, padded)

    def test_captured_mtp_replays(self):
        self.run_sizes(1, (3,))

    def test_a_dense_decision_after_capture(self):
        e, graphs, ids = self.run_sizes(0, (3,))
        order = ids[:5]

        def degraded():
            e.st.tp_dense = True
        md, st, snaps, padded = self.replay_step(e, graphs, 5, order, before_build=degraded)
        self.assertEqual(e.st.dense_reason, "a tensor-parallel rank runs without a spind session")
        for layer in range(e.nl):
            replayed = e.buf[: padded].clone()  # the last layer's rows are in the buffer
            if layer != e.nl - 1:
                continue
            want = e.vllm_dense(layer, md, st.q[layer], st.k[layer], st.w[layer])
            self.assertTrue(torch.equal(replayed[:5].cpu(), want[:5].cpu()))


def _key(rid):
    from spind.keys import sequence_key
    return sequence_key(rid)


if __name__ == "__main__":
    unittest.main()
