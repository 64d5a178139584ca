"""STUB TESTS of spind_vllm, the vLLM plugin, against tests/python/stub_vllm (NOT vLLM).

vLLM cannot be installed here: tests/python/stub_vllm reproduces only the names and signatures
the plugin touches at the pinned commit (spind_vllm/pinned.py), with float32 CPU reference
kernels. These tests check the plugin's own logic (registration, the prologue, the SPIN decode
path with a real local spind.Session, the dense fallbacks, the TP broadcast, the preflight);
they say nothing about real vLLM, DeepGEMM or CUDA graphs (docs/vllm.md, "Verified where").

Run: PYTHONPATH=build/python:tests/python/stub_vllm python3 -m unittest -v test_vllm_plugin
(from tests/python; CTest python_vllm_stub).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
STUB = os.path.join(HERE, "stub_vllm")
_DIST = tempfile.mkdtemp(prefix="spind-vllm-ep-")


def setUpModule():
    # The entry point as `pip install ./python` declares it, found by importlib.metadata on
    # sys.path, then loaded by the stub's load_general_plugins (the pinned group name).
    info = os.path.join(_DIST, "spind-0.0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: spind\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nspind = spind_vllm:register\n")
    sys.path.insert(0, _DIST)
    import vllm.plugins
    vllm.plugins.load_general_plugins()


def tearDownModule():
    shutil.rmtree(_DIST, ignore_errors=True)


import spind  # noqa: E402
from spind_vllm import _state  # noqa: E402

BLOCK, MAX_LEN, TOPK, HEADS, DIM = 16, 512, 32, 2, 8


class FakeSession:
    """Records calls; control() gives a per-instance float64 snapshot of 7 + layers values."""

    layers = 2

    def __init__(self, control_values=None, attached=True, generation=1):
        self.calls = []
        self.device = torch.device("cpu")
        if control_values is None:
            control_values = [3.0, 1.0, 0.5, 0.05, 0.3, 0.0, 0.0, 0.5, 0.5]
        self._control = torch.tensor(control_values, dtype=torch.float64)
        self.attached, self.generation = attached, generation

    def reset_sequence(self, slot, key):
        self.calls.append(("reset_sequence", slot, key))

    def refresh(self):
        self.calls.append(("refresh",))
        return False

    def link(self):
        self.calls.append(("link",))
        return self.attached, self.generation

    def control(self):
        self.calls.append(("control",))
        return self._control.clone()

    def adopt_control(self, t):
        self.calls.append(("adopt_control", t.tolist()))

    def begin_step(self, *args):
        self.calls.append(("begin_step",))


class RecordingSession:
    """A real spind.Session, recording the per-step calls and each layer's selection."""

    def __init__(self, session):
        self._s = session
        self.calls = []
        self.selections = []  # (layer, union_count [n], union_ids [n, max_blocks]) per select

    def __getattr__(self, name):
        return getattr(self._s, name)

    def begin_step(self, *args):
        self.calls.append(("begin_step",))
        self.step_table = args[4] if len(args) > 4 else None  # the block table given, if any
        return self._s.begin_step(*args)

    def select(self, layer, block_table=None):
        self.calls.append(("select", layer))
        out = self._s.select(layer, block_table)
        self.selections.append((layer, self._s.union_count.clone(), self._s.union_ids.clone()))
        return out

    def remap(self, topk, engine_topk=False):
        self.calls.append(("remap", engine_topk))
        return self._s.remap(topk, engine_topk=engine_topk)

    def observe(self, layer, *args, **kwargs):
        self.calls.append(("observe", layer, len(args), tuple(kwargs)))
        return self._s.observe(layer, *args, **kwargs)

    def remap_and_observe(self, layer, *args, **kwargs):
        self.calls.append(("remap_and_observe", layer, len(args), tuple(kwargs)))
        return self._s.remap_and_observe(layer, *args, **kwargs)

    def reset_sequence(self, slot, key):
        self.calls.append(("reset_sequence", slot, key))
        return self._s.reset_sequence(slot, key)

    def refresh(self):
        self.calls.append(("refresh",))
        return self._s.refresh()


def vllm_config(layers=2, max_num_seqs=4, spec_tokens=0, tp=1):
    ns = types.SimpleNamespace
    return ns(model_config=ns(hf_config=ns(num_hidden_layers=layers), max_model_len=MAX_LEN),
              scheduler_config=ns(max_num_seqs=max_num_seqs),
              speculative_config=ns(num_speculative_tokens=spec_tokens) if spec_tokens else None,
              parallel_config=ns(tensor_parallel_size=tp))


class StubEngine:
    """A tiny engine over the stub: per layer one indexer (constructed as vLLM's
    SparseAttnIndexer, so the plugin's substitution decides the class), a paged float K cache
    with scattered pages, requests scheduled as the test says (decode requests first)."""

    def __init__(self, layers=2, spec_tokens=0, env=None, worker=True, seed=0):
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder
        self.layers, self.rows = layers, 1 + spec_tokens
        self.gen = torch.Generator().manual_seed(seed)
        self.pages_total = 4 * MAX_LEN // BLOCK
        self.free_pages = torch.randperm(self.pages_total, generator=self.gen).tolist()
        self.buffer = torch.full((1024, TOPK), -1, dtype=torch.int32)
        self.caches = [torch.zeros(self.pages_total, BLOCK, DIM) for _ in range(layers)]
        self.builder = DeepseekV32IndexerMetadataBuilder(types.SimpleNamespace(block_size=BLOCK),
                                                         num_speculative_tokens=spec_tokens)
        self.reqs = {}  # id -> dict(pages, computed, keys [layers, MAX_LEN, DIM])
        self.outputs = []  # per step: {layer: topk [T, TOPK]}
        self.metadata = []
        self.order = []
        _state.STATE.detach()
        self._make_layers = lambda: [
            SparseAttnIndexer(types.SimpleNamespace(prefix=f"model.layers.{i}.self_attn.indexer."
                                                    "k_cache", kv_cache=self.caches[i]),
                              128, "ue8m0", TOPK, DIM, MAX_LEN, MAX_LEN, self.buffer)
            for i in range(layers)]
        if worker:
            from spind_vllm.worker import SpindWorker
            self.worker = SpindWorker(vllm_config(layers, 4, spec_tokens), 0, 0)
            self.worker.model_runner.load_fn = lambda: setattr(self, "model", self._make_layers())
            self.worker.model_runner.step_fn = self._step
            saved = dict(os.environ)
            os.environ.update(env or {})
            try:
                self.worker.load_model()
            finally:
                os.environ.clear()
                os.environ.update(saved)
        else:
            self.model = self._make_layers()

    def schedule(self, new=(), decode=(), prefill=(), finished=(), preempted=None, resumed=()):
        """new: {id: prompt_len}; decode: ids decoding `rows` tokens; prefill: {id: tokens}."""
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        for rid in list(finished) + list(preempted or ()):
            for p in self.reqs.pop(rid)["pages"]:
                self.free_pages.append(p)
        counts = {rid: self.rows for rid in decode}
        counts.update(dict(prefill))
        counts.update(dict(new))
        for rid in list(new) + list(resumed):
            self.reqs[rid] = dict(pages=[], computed=0,
                                  keys=torch.randn(self.layers, MAX_LEN, DIM, generator=self.gen))
        self.order = list(decode) + list(prefill) + list(resumed) + list(new)
        return SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(rid) for rid in new],
            scheduled_cached_reqs=CachedRequestData(list(decode) + list(prefill) + list(resumed),
                                                    set(resumed)),
            num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
            finished_req_ids=set(finished), preempted_req_ids=preempted)

    def step(self, sched):
        return (self.worker.execute_model(sched) if hasattr(self, "worker")
                else self._step(sched))

    def _step(self, sched):
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata
        ids = self.order
        qlens = [sched.num_scheduled_tokens[r] for r in ids]
        slots, positions, seq_lens = [], [], []
        max_blocks = getattr(self, "table_blocks", MAX_LEN // BLOCK)
        table = torch.zeros(len(ids), max_blocks, dtype=torch.int32)
        for i, rid in enumerate(ids):
            r = self.reqs[rid]
            end = r["computed"] + qlens[i]
            while len(r["pages"]) * BLOCK < end:
                r["pages"].append(self.free_pages.pop())
            table[i, : len(r["pages"])] = torch.tensor(r["pages"], dtype=torch.int32)
            for pos in range(r["computed"], end):
                positions.append((i, pos))
                slots.append(r["pages"][pos // BLOCK] * BLOCK + pos % BLOCK)
            seq_lens.append(end)
        qsl = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)
        cam = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(ids),
            num_actual_tokens=len(slots), max_seq_len=max(seq_lens),
            block_table_tensor=table, slot_mapping=torch.tensor(slots, dtype=torch.int64))
        if hasattr(self, "worker"):
            self.worker.model_runner.input_batch._req_ids = list(ids)
        md = self.builder.build(0, cam)
        self.metadata.append((md, table, seq_lens))
        T = len(slots)
        out = {}
        for layer, mod in enumerate(self.model):
            q = torch.randn(T, HEADS, DIM, generator=self.gen)
            w = torch.rand(T, HEADS, generator=self.gen)
            k = torch.stack([self.reqs[ids[i]]["keys"][layer, pos] for i, pos in positions])
            with set_forward_context({mod.k_cache.prefix: md}):
                res = mod(torch.zeros(T, 1), q, k, w)
            out[layer] = (res[:T].clone(), q, w)
        for i, rid in enumerate(ids):
            self.reqs[rid]["computed"] += qlens[i]
        self.outputs.append(out)
        return out


def dense_logits(engine, layer, q, w, table, seq_lens, rows, batch):
    """The stub kernel over the engine's full block table: what the dense indexer scores."""
    from vllm.utils.deep_gemm import fp8_fp4_paged_mqa_logits
    lens = torch.tensor([[L - rows + j + 1 for j in range(rows)] for L in seq_lens[:batch]],
                        dtype=torch.int32)
    return fp8_fp4_paged_mqa_logits((q[: batch * rows].reshape(batch, rows, HEADS, DIM), None),
                                    engine.caches[layer].unsqueeze(-2), w[: batch * rows], lens,
                                    table[:batch], None, MAX_LEN, False), lens


LOCAL = {"SPIND_TARGET": "", "SPIND_STATE": "fp32", "SPIND_SPARSITY": "0.5",
         "SPIND_EXPLORATION": "0.0", "SPIND_SEED": "7",
         "SPIND_BLOCK_SIZE": str(BLOCK)}


class StubRegistration(unittest.TestCase):
    def test_stub_entry_point_registers_and_substitutes_the_custom_op(self):
        from vllm.model_executor.custom_op import op_registry_oot
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
        import spind_vllm
        self.assertIn("SparseAttnIndexer", op_registry_oot)
        ours = op_registry_oot["SparseAttnIndexer"]
        self.assertIsNot(ours, SparseAttnIndexer)
        self.assertTrue(issubclass(ours, SparseAttnIndexer))
        layer = SparseAttnIndexer(types.SimpleNamespace(prefix="model.layers.3.x.k_cache",
                                                        kv_cache=torch.zeros(1)),
                                  128, "ue8m0", TOPK, DIM, MAX_LEN, MAX_LEN,
                                  torch.zeros(1, TOPK, dtype=torch.int32))
        self.assertIsInstance(layer, ours)
        self.assertEqual(layer.spin_layer, 3)
        spind_vllm.register()  # a second call changes nothing
        self.assertIs(op_registry_oot["SparseAttnIndexer"], ours)
        self.assertTrue(hasattr(torch.ops.spind_vllm, "sparse_attn_indexer"))

    def test_stub_op_is_in_the_splitting_ops_like_vllms(self):
        from vllm.config.compilation import CompilationConfig
        self.assertEqual(CompilationConfig._attention_ops.count("spind_vllm::sparse_attn_indexer"),
                         1)
        c = CompilationConfig()
        c.set_splitting_ops_for_v1()
        self.assertIn("vllm::sparse_attn_indexer", c.splitting_ops)
        self.assertIn("spind_vllm::sparse_attn_indexer", c.splitting_ops)
        self.assertTrue(c.splitting_ops_contain_attention())


class StubPrologue(unittest.TestCase):
    def setUp(self):
        self.st = _state.PluginState()
        self.fake = FakeSession()
        self.st.attach(self.fake, layers=2, rows=1, block_size=BLOCK, topk=TOPK, max_seqs=2)

    def sched(self, **kw):
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        return SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(r) for r in kw.get("new", ())],
            scheduled_cached_reqs=CachedRequestData(list(kw.get("resumed", ())),
                                                    set(kw.get("resumed", ()))),
            finished_req_ids=set(kw.get("finished", ())), preempted_req_ids=kw.get("preempted"))

    def resets(self):
        out = [c[1:] for c in self.fake.calls if c[0] == "reset_sequence"]
        self.fake.calls.clear()
        return out

    def test_stub_slots_resets_and_reuse(self):
        key = _state.sequence_key
        self.st.on_schedule(self.sched(new=["a", "b"]))
        self.assertEqual(self.resets(), [(0, key("a")), (1, key("b"))])
        self.st.on_schedule(self.sched(finished=["a"], new=["c"]))  # c reuses a's slot
        self.assertEqual(self.resets(), [(0, key("c"))])
        self.st.on_schedule(self.sched(preempted={"b"}))
        self.assertIsNone(self.st.slots.get("b"))
        self.st.on_schedule(self.sched(resumed=["b"]))  # back: a fresh sequence again
        self.assertEqual(self.resets(), [(1, key("b"))])
        self.st.on_schedule(self.sched(new=["d"]))  # no slot left: not opened, logged
        self.assertEqual(self.resets(), [])
        self.assertIsNone(self.st.slots.get("d"))

    def test_stub_refresh_every_step_and_no_broadcast_without_tp(self):
        self.st.on_schedule(self.sched())
        self.st.on_schedule(self.sched())
        self.assertEqual(self.fake.calls, [("refresh",), ("refresh",)])

    def test_stub_keys_identical_in_another_process(self):
        ids = ["cmpl-1", "req-7f3a-0", "x" * 300, "ü-request"]
        code = ("import json,sys; from spind_vllm._state import sequence_key as k; "
                "print(json.dumps([k(i) for i in json.loads(sys.argv[1])]))")
        env = dict(os.environ, PYTHONHASHSEED="12345")
        out = subprocess.run([sys.executable, "-c", code, json.dumps(ids)], env=env,
                             capture_output=True, text=True, check=True).stdout
        mine = [_state.sequence_key(i) for i in ids]
        self.assertEqual(json.loads(out), mine)
        self.assertEqual(len(set(mine)), len(ids))
        self.assertTrue(all(-2**63 <= k < 2**63 for k in mine))


class StubDecode(unittest.TestCase):
    def run_engine(self, engine, steps, prompt=(300, 200, 120)):
        ids = [f"req-{i}" for i in range(len(prompt))]
        engine.step(engine.schedule(new=dict(zip(ids, prompt))))
        for _ in range(steps):
            engine.step(engine.schedule(decode=ids))
        return ids

    def test_stub_a_block_table_narrower_than_the_session_runs_dense_with_its_reason(self):
        # The decode block table is given to begin_step (every layer selects through it); one
        # narrower than the session's blocks would be refused there, so the step runs dense and
        # says why, and nothing raises.
        from vllm.model_executor.layers import sparse_attn_indexer as sai
        e = StubEngine(env=LOCAL)
        e.table_blocks = MAX_LEN // BLOCK - 1
        before = sai.DENSE_CALLS[0]
        self.run_engine(e, 2, prompt=(100, 60))
        self.assertEqual(sai.DENSE_CALLS[0] - before, 3 * e.layers)
        self.assertEqual(_state.STATE.counters["spin_calls"], 0)
        reason = "decode block table narrower than the session's blocks"
        self.assertTrue(any(k.startswith(reason) for k in _state.STATE.dense_reasons),
                        _state.STATE.dense_reasons)

    def test_stub_prefill_and_mixed_batches_are_dense(self):
        from vllm.model_executor.layers import sparse_attn_indexer as sai
        e = StubEngine(env=LOCAL)
        before = sai.DENSE_CALLS[0]
        e.step(e.schedule(new={"a": 100}))
        self.assertEqual(sai.DENSE_CALLS[0] - before, e.layers)
        e.step(e.schedule(decode=["a"], new={"b": 50}))  # mixed: decode a + prefill b
        self.assertEqual(sai.DENSE_CALLS[0] - before, 2 * e.layers)
        self.assertEqual(_state.STATE.counters["spin_calls"], 0)
        self.assertEqual(_state.STATE.dense_reasons.get("prefill or mixed batch"), 2 * e.layers)
        e.step(e.schedule(decode=["a", "b"]))  # decode only: SPIN
        self.assertEqual(sai.DENSE_CALLS[0] - before, 2 * e.layers)
        self.assertEqual(_state.STATE.counters["spin_calls"], e.layers)

    def test_stub_spin_decode_order_and_valid_selections(self):
        from vllm.utils import deep_gemm
        e = StubEngine(env=LOCAL)
        rec = RecordingSession(_state.STATE.session)
        _state.STATE.session = rec
        ids = ["a", "b", "c"]
        e.step(e.schedule(new={"a": 300, "b": 200, "c": 120}))
        skipped = 0
        for step in range(4):
            rec.calls.clear()
            rec.selections.clear()
            deep_gemm.SCHEDULE_CALLS.clear()
            out = e.step(e.schedule(decode=ids))
            self.assertEqual(rec.calls[0], ("refresh",))
            self.assertEqual(rec.calls[1], ("begin_step",))
            per_layer = rec.calls[2:]
            expect = []
            for layer in range(e.layers):
                # remap (the engine's top-K: on probe steps the curves count it) and observe in
                # one call: remap_and_observe(layer, topk, logits), no accepted
                expect += [("select", layer), ("remap_and_observe", layer, 2, ())]
            self.assertEqual(per_layer, expect)
            md, table, seq_lens = e.metadata[-1]
            # The decode block table is given as the step begins (every layer selects through
            # it; on the GPU each observe publishes the next layer's selection).
            self.assertIs(rec.step_table, md.decode.block_table)
            for layer, (count, union) in enumerate((c, u) for _, c, u in rec.selections):
                topk, q, w = out[layer]
                logits, lens = dense_logits(e, layer, q, w, table, seq_lens, 1, len(ids))
                for b in range(len(ids)):
                    L = seq_lens[b]
                    blocks = union[b, : count[b]].tolist()
                    self.assertEqual(blocks, sorted(blocks))
                    self.assertIn((L - 1) // BLOCK, blocks)  # the query's own block
                    allowed = torch.cat([torch.arange(j * BLOCK, min((j + 1) * BLOCK, L))
                                         for j in blocks])
                    got = sorted(t for t in topk[b].tolist() if t >= 0)
                    self.assertEqual(len(got), min(TOPK, len(allowed)))
                    self.assertTrue(set(got) <= set(allowed.tolist()))
                    # the top-K of the dense scores restricted to the selected blocks
                    sub = logits[b, allowed]
                    order = sorted(range(len(allowed)), key=lambda i: (-float(sub[i]), i))
                    self.assertEqual(got, sorted(allowed[order[:TOPK]].tolist()))
                    skipped += -(-L // BLOCK) - len(blocks)
                # the schedule metadata was built from the compacted lengths
                self.assertTrue(any(torch.equal(c.reshape(-1), count.new_tensor(
                    [sum(min(BLOCK, seq_lens[b] - j * BLOCK) for j in union[b, : count[b]].tolist())
                     for b in range(len(ids))])) for c in deep_gemm.SCHEDULE_CALLS))
            if step == 0:
                self.assertEqual(skipped, 0)  # fresh sequences: dense on the first decode
        self.assertGreater(skipped, 0)  # later steps skip blocks at sparsity 0.5

    def test_stub_sparsity_zero_equals_dense(self):
        spin = StubEngine(env=dict(LOCAL, SPIND_SPARSITY="0.0"), seed=3)
        dense = StubEngine(env={"SPIND_DISABLE": "1"}, seed=3)
        self.assertIsNone(_state.STATE.session)
        a = self.run_engine(spin, 3)
        self.run_engine(dense, 3)
        for s_out, d_out in zip(spin.outputs, dense.outputs):
            for layer in s_out:
                self.assertTrue(torch.equal(s_out[layer][0], d_out[layer][0]))
        self.assertEqual(len(a), 3)

    def test_stub_unreachable_spind_decodes_dense(self):
        env = dict(LOCAL, SPIND_TARGET="unix:///nonexistent/spind-test.sock")
        spin = StubEngine(env=env, seed=5)
        self.assertFalse(_state.STATE.session.counters()["attached"])
        self.run_engine(spin, 3)
        self.assertEqual(_state.STATE.counters["spin_calls"], 3 * spin.layers)
        dense = StubEngine(worker=False, seed=5)
        self.run_engine(dense, 3)
        for s_out, d_out in zip(spin.outputs, dense.outputs):
            for layer in s_out:
                self.assertTrue(torch.equal(s_out[layer][0], d_out[layer][0]))

    def test_stub_mtp_rows_and_draft_layer_dense(self):
        # next_n = 2: rows per entry 2; a layer numbered past the model's layers is dense.
        e = StubEngine(spec_tokens=1, env=LOCAL)
        self.assertEqual(_state.STATE.rows, 2)
        self.run_engine(e, 2, prompt=(200, 90))
        self.assertEqual(_state.STATE.counters["spin_calls"], 2 * e.layers)
        md, table, seq_lens = e.metadata[-1]
        for layer in range(e.layers):
            topk = e.outputs[-1][layer][0]
            for b, L in enumerate(seq_lens):
                for j in range(2):
                    row = [t for t in topk[b * 2 + j].tolist() if t >= 0]
                    self.assertTrue(row and max(row) < L - 2 + j + 1)  # N = L - next_n + j + 1
        self.assertEqual(_state.layer_index("model.layers.61.self_attn.indexer.k_cache"), 61)
        self.assertGreaterEqual(61, _state.STATE.layers)


_TP_CHILD = r"""
import json, os, sys, torch
sys.path[:0] = json.loads(os.environ["CHILD_PATH"])
from vllm.distributed.parallel_state import GroupCoordinator
from vllm.v1.core.sched.output import SchedulerOutput
from spind_vllm import _state
sys.path.insert(0, os.environ["TEST_DIR"])
from test_vllm_plugin import FakeSession
rank = int(os.environ["RANK"])
torch.distributed.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"],
                                     rank=rank, world_size=2)
fake = FakeSession([7.0, 1.0, 0.6 + rank / 10, 0.05, 0.3, 0.0, 1.0, 0.6, 0.7])
st = _state.PluginState()
st.attach(fake, layers=2, rows=1, block_size=16, topk=32, max_seqs=2,
          tp_group=GroupCoordinator([0, 1], rank, torch.distributed.group.WORLD))
st.on_schedule(SchedulerOutput())
st.on_schedule(SchedulerOutput())  # the same control again: not adopted twice
print(json.dumps(fake.calls))
"""


class StubTensorParallel(unittest.TestCase):
    """STUB tests of the group's step boundary (spind_vllm._state.sync_tp_group)."""

    RANK0 = [3.0, 1.0, 0.7, 0.05, 0.3, 4.0, 1.0, 0.6, 0.8]

    def group(self, rank, rank0=None, degraded=0.0, switched=0.0):
        """A fake two-rank group whose all_reduce adds rank 0's control (when this is rank 1)
        and the other rank's flags."""
        from vllm.distributed.parallel_state import GroupCoordinator
        g = GroupCoordinator([4, 5], rank, "cpu-group")

        def all_reduce(t, group):
            self.assertIs(group, g)
            if rank0 is not None:
                t[:len(rank0)] += torch.tensor(rank0, dtype=torch.float64)
            t[-2] += degraded
            t[-1] += switched
        return g, all_reduce

    def test_stub_sync_skipped_for_one_rank(self):
        from vllm.distributed.parallel_state import GroupCoordinator
        fake = FakeSession()
        self.assertIsNone(_state.sync_tp_group(fake, GroupCoordinator([0], 0), _state.GroupSync()))
        self.assertEqual(fake.calls, [])

    def test_stub_rank1_adopts_rank0_control_once(self):
        fake, sync = FakeSession(), _state.GroupSync()
        g, reduce = self.group(1, rank0=self.RANK0)
        control, degraded, switched = _state.sync_tp_group(fake, g, sync, reduce)
        self.assertEqual(control.tolist(), self.RANK0)
        self.assertFalse(degraded or switched)
        # Rank 1 never asks its own daemon: its proposal is not the group's.
        self.assertEqual(fake.calls, [("link",), ("adopt_control", self.RANK0)])
        fake.calls.clear()
        _state.sync_tp_group(fake, g, sync, reduce)
        self.assertEqual(fake.calls, [("link",)], "an unchanged control is not adopted again")
        changed = list(self.RANK0)
        changed[0], changed[7] = 4.0, 0.9  # a new version with a new table
        g, reduce = self.group(1, rank0=changed)
        _state.sync_tp_group(fake, g, sync, reduce)
        self.assertEqual(fake.calls[-1], ("adopt_control", changed))

    def test_stub_a_rank_without_spind_makes_the_group_dense(self):
        fake, sync = FakeSession(), _state.GroupSync()
        g, reduce = self.group(0, degraded=1.0)
        _, degraded, _ = _state.sync_tp_group(fake, g, sync, reduce)
        self.assertTrue(degraded)
        self.assertNotIn("adopt_control", [c[0] for c in fake.calls])
        # Rank 0 itself degraded: its control (version -1, attached 0) is never adopted.
        fake = FakeSession([-1.0, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0], attached=False)
        g, reduce = self.group(0)
        _, degraded, _ = _state.sync_tp_group(fake, g, sync, reduce)
        self.assertTrue(degraded)
        self.assertNotIn("adopt_control", [c[0] for c in fake.calls])

    def test_stub_a_session_switch_resets_every_rank(self):
        from vllm.distributed.parallel_state import GroupCoordinator
        from vllm.v1.core.sched.output import SchedulerOutput
        fake = FakeSession()
        st = _state.PluginState()
        g = GroupCoordinator([4, 5], 1, "cpu-group")
        st.attach(fake, layers=2, rows=1, block_size=16, topk=32, max_seqs=2, tp_group=g)
        st.slots.assign("req-a")
        other_switched = [0.0]

        def reduce(t, group):
            t[:len(self.RANK0)] += torch.tensor(self.RANK0, dtype=torch.float64)
            t[-1] += other_switched[0]
        orig = _state.sync_tp_group
        try:
            _state.sync_tp_group = lambda s, grp, sy: orig(s, grp, sy, reduce)
            st.on_schedule(SchedulerOutput())
            self.assertNotIn("reset_sequence", [c[0] for c in fake.calls])
            other_switched[0] = 1.0  # the other rank switched to a new spind session
            st.on_schedule(SchedulerOutput())
            other_switched[0] = 0.0
            fake.generation += 1     # then this one did
            st.on_schedule(SchedulerOutput())
        finally:
            _state.sync_tp_group = orig
        resets = [c for c in fake.calls if c[0] == "reset_sequence"]
        self.assertEqual(resets, [("reset_sequence", 0, _state.sequence_key("req-a"))] * 2)
        self.assertEqual(st.counters["group_resets"], 2)

    def test_stub_two_ranks_adopt_rank0_control(self):
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, INIT_FILE=os.path.join(d, "init"), TEST_DIR=HERE,
                       CHILD_PATH=json.dumps(sys.path))
            procs = [subprocess.Popen([sys.executable, "-c", _TP_CHILD],
                                      env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for r in (0, 1)]
            outs = [p.communicate(timeout=60) for p in procs]
        for p, (out, err) in zip(procs, outs):
            self.assertEqual(p.returncode, 0, err)
        rank0 = [7.0, 1.0, 0.6, 0.05, 0.3, 0.0, 1.0, 0.6, 0.7]
        for r, (out, _) in enumerate(outs):
            calls = json.loads(out.strip().splitlines()[-1])
            own = [["control"]] if r == 0 else []
            self.assertEqual(calls, [["refresh"], ["link"]] + own + [["adopt_control", rank0]] +
                             [["refresh"], ["link"]] + own, f"rank {r}")


class StubGpuTarget(unittest.TestCase):
    def test_stub_gpu_uuid_target(self):
        from spind_vllm.worker import resolve_target, gpu_uuid

        class Props:
            def __init__(self, uuid):
                self.uuid = uuid
        want = "GPU-5e6a0d41-1c2b-4d3e-8f90-a1b2c3d4e5f6"
        for raw in ("5e6a0d41-1c2b-4d3e-8f90-a1b2c3d4e5f6", want, want.upper().replace("GPU-", ""),
                    bytes.fromhex("5e6a0d411c2b4d3e8f90a1b2c3d4e5f6")):
            self.assertEqual(gpu_uuid(0, Props(raw)), want, raw)
        self.assertEqual(resolve_target("unix:///run/spin/{gpu_uuid}.sock", 3, Props(want)),
                         f"unix:///run/spin/{want}.sock")
        # Without the placeholder the target is left alone (and torch is never asked).
        self.assertEqual(resolve_target("unix:///run/spin/spind.sock", 0, None),
                         "unix:///run/spin/spind.sock")
        with self.assertRaisesRegex(ValueError, "no GPU UUID"):
            gpu_uuid(1, Props("not-a-uuid"))


class StubSessionOptions(unittest.TestCase):
    def test_stub_session_options_from_the_environment(self):
        from spind_vllm.worker import session_options
        o = session_options({})
        self.assertEqual((o["state"], o["target_sparsity"], o["defer_ema"]), ("bf16", 0.5, False))
        o = session_options({"SPIND_DEFER_EMA": "1", "SPIND_SPARSITY": "0.7"})
        self.assertEqual((o["defer_ema"], o["target_sparsity"]), (True, 0.7))
        with self.assertRaisesRegex(ValueError, "SPIND_DEFER_EMA must be 0 or 1, not 'yes'"):
            session_options({"SPIND_DEFER_EMA": "yes"})
        # Every key is a spind.Session keyword (the worker passes them through).
        import inspect
        import spind
        params = inspect.signature(spind.Session.__init__).parameters
        self.assertEqual([k for k in o if k not in params], [])


class StubModelKey(unittest.TestCase):
    def test_stub_model_key_is_a_safe_file_name(self):
        from types import SimpleNamespace as ns
        from spind_vllm.worker import model_key
        self.assertEqual(model_key(ns(served_model_name=["deepseek-ai/DeepSeek-V3.2"])),
                         "deepseek-ai_DeepSeek-V3.2")
        self.assertEqual(model_key(ns(served_model_name=None, model="/models/../ds v3")),
                         "_models_.._ds_v3")
        self.assertEqual(model_key(ns(model="." * 3 + "x")), "x")
        self.assertEqual(len(model_key(ns(model="a" * 300))), 128)
        self.assertEqual(model_key(ns()), "")


class StubPreflight(unittest.TestCase):
    SCRIPT = os.path.join(REPO, "scripts", "vllm-preflight")

    def run_preflight(self, stub_dir):
        path = [stub_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(":")
                             if p and os.path.abspath(p) != STUB]
        env = dict(os.environ, PYTHONPATH=":".join(path))
        return subprocess.run([sys.executable, self.SCRIPT], env=env, capture_output=True,
                              text=True, timeout=120)

    def test_stub_preflight_passes_on_the_stub(self):
        r = self.run_preflight(STUB)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("0.0.0+spind-stub", r.stdout)
        self.assertIn("SparseAttnIndexer", r.stdout)
        self.assertIn("spind_vllm::sparse_attn_indexer", r.stdout)

    def test_stub_preflight_fails_on_a_broken_stub(self):
        for rel, old, new, expect in [
            ("vllm/v1/attention/backends/mla/indexer.py",
             "def build(self, common_prefix_len, common_attn_metadata, fast_build=False)",
             "def build(self, common_attn_metadata, fast_build=False)",
             "DeepseekV32IndexerMetadataBuilder.build"),
            ("vllm/config/compilation.py", '"vllm::sparse_attn_indexer",', "",
             "vllm::sparse_attn_indexer"),
        ]:
            with tempfile.TemporaryDirectory() as d:
                broken = os.path.join(d, "stub")
                shutil.copytree(STUB, broken)
                p = os.path.join(broken, rel)
                with open(p) as f:
                    text = f.read()
                self.assertIn(old, text)
                with open(p, "w") as f:
                    f.write(text.replace(old, new))
                r = self.run_preflight(broken)
                self.assertNotEqual(r.returncode, 0, r.stdout)
                self.assertIn(expect, r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
