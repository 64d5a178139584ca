"""Tests of spind_vllm, the vLLM plugin, over vLLM's own files (tests/python/vllm_real).

vLLM's files at the pinned commit (9aaf83ef, spind_vllm/pinned.py) are loaded unmodified from
the shared copy by the vllm_real harness: the entry point goes through vLLM's real
load_general_plugins, the substitution through the real CustomOp, every step's metadata through
the real DeepseekV32IndexerMetadataBuilder (over CommonAttentionMetadata as vLLM's model runner
fills it), the dense indexer is vLLM's real sparse_attn_indexer, and the scheduler output is
vLLM's dataclasses. What the harness stubs (vllm_real.STUBBED_MODULES) is stubbed here too: the
worker and model runner (SpindWorker subclasses the harness's Worker), the configs, the
distributed groups, a CPU-like platform, and the kernels (float32 stand-ins,
vllm_real/kernels.py). These tests say nothing about DeepGEMM, CUDA graphs or a GPU (docs/vllm.md,
"Verified where"). Padded decode batches, dense steps after capture, the MTP drafter's builds and
persistent_topk are tested in test_vllm_steps.py.

Run (from tests/python): PYTHONPATH=<build>/python python3 -m unittest -v test_vllm_plugin
(CTest python_vllm_plugin). Skipped when the shared vLLM sources are absent.
"""
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import torch

import vllm_real
from spind.keys import sequence_key
from spind_vllm import _state

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
_DIST = None

# DeepSeek-V3.2's page size; a small model otherwise (the stand-in kernels take any head shape).
BLOCK, MAX_LEN, TOPK, HEADS, DIM = 64, 1024, 128, 4, 16
MAX_SEQS, MAX_TOKENS = 4, 2048
PAGES = 1 + MAX_SEQS * MAX_LEN // BLOCK  # page 0 is vLLM's null block, never a request's


def setUpModule():
    global _DIST
    vllm_real.install_for_tests()
    # The entry point as `pip install ./python` declares it (python/pyproject.toml), found by
    # importlib.metadata on sys.path and loaded by vLLM's own load_general_plugins.
    project = pyproject()
    group = "vllm.general_plugins"
    points = project["entry-points"][group]
    _DIST = tempfile.mkdtemp(prefix="spind-vllm-ep-")
    name = project["name"].replace("-", "_")
    info = os.path.join(_DIST, f"{name}-{project['version']}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                f"Version: {project['version']}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    sys.path.insert(0, _DIST)
    import vllm.plugins
    from vllm.model_executor.custom_op import op_registry_oot
    vllm.plugins.load_general_plugins()
    if "SparseAttnIndexer" not in op_registry_oot:  # vLLM logs a failing plugin and goes on
        raise RuntimeError("vllm.plugins.load_general_plugins did not register spind_vllm")


def pyproject():
    """python/pyproject.toml's [project] table (name, version, entry-points)."""
    path = os.path.join(REPO, "python", "pyproject.toml")
    try:
        import tomllib
    except ImportError:  # Python < 3.11: the three keys read by hand
        with open(path) as f:
            text = f.read()
        key = r'^{} = "([^"]*)"'
        section = re.search(r'^\[project\.entry-points\."vllm\.general_plugins"\]\n(.*?)(?:^\[|\Z)',
                            text, re.M | re.S).group(1)
        return {"name": re.search(key.format("name"), text, re.M).group(1),
                "version": re.search(key.format("version"), text, re.M).group(1),
                "entry-points": {"vllm.general_plugins": dict(
                    re.findall(r'^(\S+) = "([^"]*)"', section, re.M))}}
    with open(path, "rb") as f:
        return tomllib.load(f)["project"]


def tearDownModule():
    if _DIST is not None:
        if _DIST in sys.path:
            sys.path.remove(_DIST)
        shutil.rmtree(_DIST, ignore_errors=True)


def prefix(layer):
    """The indexer cache's layer name, as DeepSeek-V3.2's Indexer gives it."""
    return f"model.layers.{layer}.self_attn.indexer.k_cache"


@contextlib.contextmanager
def environ(env):
    """os.environ with `env` added, restored afterwards."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def dense_calls():
    """Records the layer prefix of every call of vLLM's own indexer function (what the plugin's
    op runs when a layer is dense)."""
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    real = sai.sparse_attn_indexer
    calls = []

    def recording(*args):
        calls.append(args[1])
        return real(*args)
    sai.sparse_attn_indexer = recording
    try:
        yield calls
    finally:
        sai.sparse_attn_indexer = real


# ---- vLLM's scheduler output (vllm.v1.core.sched.output, real) ------------------------------
def new_request(rid, prompt_len, pages=()):
    from vllm.v1.core.sched.output import NewRequestData
    return NewRequestData(req_id=rid, prompt_token_ids=list(range(prompt_len)), mm_features=[],
                          sampling_params=None, pooling_params=None, block_ids=(list(pages),),
                          num_computed_tokens=0, lora_request=None)


def cached_requests(ids=(), resumed=(), new_pages=None, computed=None, outputs=None):
    from vllm.v1.core.sched.output import CachedRequestData
    ids = list(ids)
    return CachedRequestData(
        req_ids=ids, resumed_req_ids=set(resumed), new_token_ids=[], all_token_ids={},
        new_block_ids=[(list(new_pages[r]),) if new_pages and new_pages.get(r) else None
                       for r in ids],
        num_computed_tokens=[(computed or {}).get(r, 0) for r in ids],
        num_output_tokens=[(outputs or {}).get(r, 0) for r in ids])


def scheduler_output(new=(), cached=None, counts=None, finished=(), preempted=(),
                     spec_tokens=None):
    from vllm.v1.core.sched.output import SchedulerOutput
    counts = dict(counts or {})
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached if cached is not None else cached_requests(),
        num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(counts.values()),
        scheduled_spec_decode_tokens=dict(spec_tokens or {}), scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0], finished_req_ids=set(finished),
        free_encoder_mm_hashes=[], preempted_req_ids=set(preempted) or None)


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
        self.step_seq = None  # the seq entries of the last begin_step

    def __getattr__(self, name):
        return getattr(self._s, name)

    def begin_step(self, *args):
        self.calls.append(("begin_step",))
        self.step_seq = args[0].clone()
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


class Engine:
    """A small DeepSeek-V3.2-shaped engine over vLLM's real files. Per layer one indexer,
    constructed as vLLM's Indexer constructs its SparseAttnIndexer (so the plugin's OOT class
    is what vLLM's CustomOp instantiates), over a float32 paged K cache; one model-wide top-K
    buffer; the real DeepseekV32IndexerMetadataBuilder over CommonAttentionMetadata as vLLM's
    runner fills it (vllm_real.batch) with this engine's own scattered pages. Steps go through
    SpindWorker (over the harness's Worker) with vLLM's SchedulerOutput: execute_model (the
    step boundary, then the runner's forward: input_batch.req_ids in batch order, the build,
    every layer under one forward context), then sample_tokens. draft_layer: one more indexer,
    model.layers.<layers> (DeepSeek-V3.2's MTP layer), in the same KV-cache group and
    forward."""

    def __init__(self, layers=2, spec_tokens=0, env=None, worker=True, seed=0,
                 draft_layer=False):
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
        from vllm.v1.attention.backends.mla.indexer import get_max_prefill_buffer_size
        self.layers, self.spec_tokens, self.rows = layers, spec_tokens, 1 + spec_tokens
        self.gen = torch.Generator().manual_seed(seed)
        self.config = vllm_real.make_vllm_config(
            max_model_len=MAX_LEN, block_size=BLOCK, max_num_seqs=MAX_SEQS,
            num_speculative_tokens=spec_tokens, max_num_batched_tokens=MAX_TOKENS,
            layers=layers)
        self.prefixes = [prefix(i) for i in range(layers + (1 if draft_layer else 0))]
        self.builder = vllm_real.make_builder(block_size=BLOCK, head_dim=DIM,
                                              layer_names=self.prefixes,
                                              vllm_config=self.config)
        self.free_pages = (torch.randperm(PAGES - 1, generator=self.gen) + 1).tolist()
        self.caches = [vllm_real.new_kv_cache(PAGES, BLOCK, DIM) for _ in self.prefixes]
        self.buffer = torch.full((MAX_TOKENS, TOPK), -1, dtype=torch.int32)
        self.reqs = {}     # id -> dict(prompt, pages, computed, keys [layers, MAX_LEN, DIM])
        self.outputs = []  # per step: {layer: (topk [T, TOPK], q, w)}
        self.metadata = []  # per step: (indexer metadata, CommonAttentionMetadata)
        self.order = []
        self.table_blocks = None  # narrow the block table to this many blocks
        _state.STATE.detach()

        def make_layers():
            total = get_max_prefill_buffer_size(self.config)
            return [SparseAttnIndexer(vllm_real.k_cache(p, c), 128, "ue8m0", TOPK, DIM,
                                      MAX_LEN, total, self.buffer)
                    for p, c in zip(self.prefixes, self.caches)]
        if worker:
            from spind_vllm.worker import SpindWorker
            self.worker = SpindWorker(self.config, 0, 0)
            runner = self.worker.model_runner
            runner.load_fn = lambda: setattr(self, "model", make_layers())
            runner.step_fn = self._forward
            with environ(env):
                self.worker.load_model()
        else:
            self.model = make_layers()

    def _pages_for(self, rid, end):
        r, added = self.reqs[rid], []
        while len(r["pages"]) * BLOCK < end:
            added.append(self.free_pages.pop())
            r["pages"].append(added[-1])
        return added

    def schedule(self, new=(), decode=(), prefill=(), finished=(), preempted=()):
        """new: {id: prompt_len}; decode: ids decoding `rows` tokens, in batch order;
        prefill: {id: tokens} (a later prompt chunk)."""
        for rid in list(finished) + list(preempted):
            self.free_pages.extend(self.reqs.pop(rid)["pages"])
        new = dict(new)
        counts = {rid: self.rows for rid in decode}
        counts.update(dict(prefill))
        counts.update(new)
        for rid, n in new.items():
            self.reqs[rid] = dict(prompt=n, pages=[], computed=0,
                                  keys=torch.randn(len(self.prefixes), MAX_LEN, DIM,
                                                   generator=self.gen))
        added = {rid: self._pages_for(rid, self.reqs[rid]["computed"] + counts[rid])
                 for rid in counts}
        self.order = list(decode) + list(prefill) + list(new)
        cached = list(decode) + list(prefill)
        return scheduler_output(
            new=[new_request(rid, n, added[rid]) for rid, n in new.items()],
            cached=cached_requests(
                cached, new_pages=added,
                computed={r: self.reqs[r]["computed"] for r in cached},
                outputs={r: max(0, self.reqs[r]["computed"] - self.reqs[r]["prompt"])
                         for r in cached}),
            counts=counts, finished=finished, preempted=preempted,
            spec_tokens={r: [0] * self.spec_tokens for r in decode} if self.spec_tokens else None)

    def step(self, sched):
        if not hasattr(self, "worker"):
            return self._forward(sched)
        out = self.worker.execute_model(sched)
        self.worker.sample_tokens(None)
        return out

    def _forward(self, sched):
        ids = self.order
        requests = []
        for rid in ids:
            r, q = self.reqs[rid], sched.num_scheduled_tokens[rid]
            requests.append((r["computed"] + q, q, r["computed"] < r["prompt"]))
        cam = vllm_real.batch(requests, block_table=[self.reqs[r]["pages"] for r in ids],
                              block_size=BLOCK, max_model_len=MAX_LEN)
        if self.table_blocks is not None:
            cam.block_table_tensor = cam.block_table_tensor[:, : self.table_blocks].contiguous()
        if hasattr(self, "worker"):
            self.worker.model_runner.input_batch.req_ids = list(ids)
        md = self.builder.build(0, cam)
        self.metadata.append((md, cam))
        T = cam.num_actual_tokens
        out = {}
        with vllm_real.forward_context({p: md for p in self.prefixes}, self.config):
            for layer, mod in enumerate(self.model):
                q = torch.randn(T, HEADS, DIM, generator=self.gen)
                w = torch.rand(T, HEADS, generator=self.gen)
                k = torch.stack([self.reqs[rid]["keys"][layer, pos]
                                 for rid, (L, n, _) in zip(ids, requests)
                                 for pos in range(L - n, L)])
                res = mod(torch.zeros(T, 1), q, k, w)
                out[layer] = (res[:T].clone(), q, w)
        for rid, (L, _, _) in zip(ids, requests):
            self.reqs[rid]["computed"] = L
        self.outputs.append(out)
        return out


def dense_logits(engine, layer, q, w, md):
    """The paged logits of the step's decode rows over the full block table (vLLM's DeepGEMM
    wrapper, the stand-in kernel): what the dense indexer scores."""
    from vllm.utils.deep_gemm import fp8_fp4_paged_mqa_logits
    dec = md.decode
    batch, rows = dec.seq_lens.shape
    n = batch * rows
    return fp8_fp4_paged_mqa_logits((q[:n].reshape(batch, rows, HEADS, DIM), None),
                                    engine.caches[layer].unsqueeze(-2), w[:n], dec.seq_lens,
                                    dec.block_table, None, MAX_LEN, True)


def best(scores, columns, k):
    """The k columns of the highest scores (ties to the lower column), ascending."""
    order = sorted(range(len(columns)), key=lambda i: (-float(scores[i]), int(columns[i])))
    return sorted(int(columns[i]) for i in order[:k])


def valid(row):
    return [t for t in row.tolist() if t >= 0]


LOCAL = {"SPIND_TARGET": "", "SPIND_STATE": "fp32", "SPIND_SPARSITY": "0.5",
         "SPIND_EXPLORATION": "0.0", "SPIND_SEED": "7", "SPIND_BLOCK_SIZE": str(BLOCK)}


class Registration(unittest.TestCase):
    def test_entry_point_registers_and_substitutes_the_custom_op(self):
        import vllm.plugins
        from vllm.model_executor.custom_op import op_registry_oot
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder
        import spind_vllm
        # vLLM's loader finds our entry point (it ran it in setUpModule).
        self.assertTrue(vllm.plugins.plugins_loaded)
        found = vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
        self.assertIs(found.get("spind"), spind_vllm.register)
        ours = op_registry_oot["SparseAttnIndexer"]
        self.assertIsNot(ours, SparseAttnIndexer)
        self.assertTrue(issubclass(ours, SparseAttnIndexer))
        self.assertTrue(getattr(DeepseekV32IndexerMetadataBuilder.build, "_spind_wrapped"))
        self.assertEqual(set(spind_vllm.PATCHED), {"custom_op", "splitting_ops", "builder",
                                                   "worker"})
        _state.STATE.detach()
        try:
            from vllm.config import get_cached_compilation_config
            cfg = get_cached_compilation_config()
            # Both of CustomOp's dispatches (enabled: forward_cuda; custom_ops "none", the
            # default under Inductor: forward_native) reach our op: a profiling run (no
            # metadata) goes to vLLM's own function through it.
            for custom_ops in (["all"], ["none"]):
                with mock.patch.object(cfg, "custom_ops", custom_ops):
                    layer = SparseAttnIndexer(
                        vllm_real.k_cache(prefix(3), vllm_real.new_kv_cache(4, BLOCK, DIM)),
                        128, "ue8m0", TOPK, DIM, MAX_LEN, MAX_LEN,
                        torch.full((4, TOPK), -7, dtype=torch.int32))
                self.assertIsInstance(layer, ours)
                self.assertEqual(layer.spin_layer, 3)
                self.assertEqual(layer._forward_method.__func__,
                                 ours.forward_cuda if custom_ops == ["all"]
                                 else ours.forward_native)
                before = _state.STATE.dense_reasons.get("profiling run", 0)
                with vllm_real.forward_context(None), \
                        environ({"VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "1"}):
                    out = layer(torch.zeros(4, 1), torch.zeros(4, HEADS, DIM),
                                torch.zeros(4, DIM), torch.zeros(4, HEADS))
                self.assertIs(out, layer.topk_indices_buffer)
                self.assertEqual(_state.STATE.dense_reasons.get("profiling run"), before + 1)
            self.assertEqual(_state.STATE.topk_layers, [(3, TOPK), (3, TOPK)])
        finally:
            _state.STATE.detach()
        spind_vllm.register()  # a second call changes nothing
        self.assertIs(op_registry_oot["SparseAttnIndexer"], ours)
        self.assertTrue(hasattr(torch.ops.spind_vllm, "sparse_attn_indexer"))

    def test_op_is_a_splitting_op_beside_vllms(self):
        from vllm.config.compilation import CompilationConfig, CompilationMode
        ops = CompilationConfig._attention_ops
        self.assertEqual(ops.count("spind_vllm::sparse_attn_indexer"), 1)
        # vLLM's own list, read from its file, with ours appended
        real = vllm_real.real_class_literal(vllm_real.real_path("vllm/config/compilation.py"),
                                            "CompilationConfig", "_attention_ops")
        self.assertEqual(ops, real + ["spind_vllm::sparse_attn_indexer"])
        c = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
        c.set_splitting_ops_for_v1()
        self.assertIn("vllm::sparse_attn_indexer", c.splitting_ops)
        self.assertIn("spind_vllm::sparse_attn_indexer", c.splitting_ops)
        self.assertTrue(c.splitting_ops_contain_attention())


class Prologue(unittest.TestCase):
    def setUp(self):
        self.st = _state.PluginState()
        self.fake = FakeSession()
        self.st.attach(self.fake, layers=2, rows=1, block_size=BLOCK, topk=TOPK, max_seqs=2)

    def sched(self, new=(), finished=(), preempted=(), resumed=()):
        return scheduler_output(new=[new_request(r, 10) for r in new],
                                cached=cached_requests(resumed, resumed=resumed),
                                finished=finished, preempted=preempted)

    def resets(self):
        out = [c[1:] for c in self.fake.calls if c[0] == "reset_sequence"]
        self.fake.calls.clear()
        return out

    def test_slots_resets_and_reuse(self):
        key = sequence_key
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

    def test_refresh_every_step_and_no_broadcast_without_tp(self):
        self.st.on_schedule(self.sched())
        self.st.on_schedule(self.sched())
        self.assertEqual(self.fake.calls, [("refresh",), ("refresh",)])

    def test_keys_identical_in_another_process(self):
        ids = ["cmpl-1", "req-7f3a-0", "x" * 300, "ü-request"]
        code = ("import json,sys; from spind.keys import sequence_key as k; "
                "print(json.dumps([k(i) for i in json.loads(sys.argv[1])]))")
        env = dict(os.environ, PYTHONHASHSEED="12345")
        out = subprocess.run([sys.executable, "-c", code, json.dumps(ids)], env=env,
                             capture_output=True, text=True, check=True).stdout
        mine = [sequence_key(i) for i in ids]
        self.assertEqual(json.loads(out), mine)
        self.assertEqual(len(set(mine)), len(ids))
        self.assertTrue(all(-2**63 <= k < 2**63 for k in mine))


class Decode(unittest.TestCase):
    def tearDown(self):
        _state.STATE.detach()

    def run_engine(self, engine, steps, prompt=(600, 400, 250)):
        ids = [f"req-{i}" for i in range(len(prompt))]
        engine.step(engine.schedule(new=dict(zip(ids, prompt))))
        for _ in range(steps):
            engine.step(engine.schedule(decode=ids))
        return ids

    def test_block_table_narrower_than_the_session_runs_dense_with_its_reason(self):
        # The decode block table is given to begin_step (every layer selects through it); one
        # narrower than the session's blocks would be refused there, so the step runs dense and
        # says why, and nothing raises.
        e = Engine(env=LOCAL)
        e.table_blocks = MAX_LEN // BLOCK - 1
        with dense_calls() as dense:
            self.run_engine(e, 2, prompt=(100, 60))
        self.assertEqual(len(dense), 3 * e.layers)
        self.assertEqual(_state.STATE.counters["spin_calls"], 0)
        reason = "decode block table narrower than the session's blocks"
        self.assertEqual(sum(n for k, n in _state.STATE.dense_reasons.items()
                             if k.startswith(reason)), 2 * e.layers, _state.STATE.dense_reasons)

    def test_prefill_and_mixed_batches_are_dense(self):
        e = Engine(env=LOCAL)
        st = _state.STATE
        with dense_calls() as dense:
            e.step(e.schedule(new={"a": 100}))
            self.assertEqual(dense, [prefix(i) for i in range(e.layers)])
            self.assertEqual(st.dense_reasons, {"prefill batch": e.layers})
            e.step(e.schedule(decode=["a"], new={"b": 50}))  # mixed: decode a + prefill b
            md, _ = e.metadata[-1]
            self.assertEqual((md.num_decodes, md.num_prefills), (1, 1))
            self.assertEqual(len(dense), 2 * e.layers)
            self.assertEqual(st.dense_reasons.get("prefill or mixed batch"), e.layers)
            self.assertEqual(st.counters["spin_calls"], 0)
            e.step(e.schedule(decode=["a", "b"]))  # decode only: SPIN
            self.assertEqual(st.counters["spin_calls"], e.layers)
        self.assertEqual(len(dense), 2 * e.layers)
        # The dense layers ran vLLM's own function, which wrote vLLM's causal top-K: prefill
        # token i of a sees a's tokens 0..i.
        for i in (0, 63, 99):
            self.assertEqual(valid(e.outputs[0][0][0][i]), list(range(i + 1)))

    def test_spin_decode_order_and_valid_selections(self):
        kernels = vllm_real.kernels
        e = Engine(env=LOCAL)
        rec = RecordingSession(_state.STATE.session)
        _state.STATE.session = rec
        ids = ["a", "b", "c"]
        e.step(e.schedule(new={"a": 600, "b": 400, "c": 250}))
        skipped = 0
        for step in range(4):
            rec.calls.clear()
            rec.selections.clear()
            kernels.reset()
            order = ids[step % 3:] + ids[: step % 3]  # vLLM reorders its persistent batch
            out = e.step(e.schedule(decode=order))
            self.assertEqual(rec.calls[0], ("refresh",))
            self.assertEqual(rec.calls[1], ("begin_step",))
            # the begun entries are the requests' slots in batch order (input_batch.req_ids)
            self.assertEqual(rec.step_seq[:3].tolist(),
                             [_state.STATE.slots.get(r) for r in order])
            per_layer = rec.calls[2:]
            expect = []
            for layer in range(e.layers):
                # remap (the engine's top-K: on probe steps the curves count it) and observe in
                # one call: remap_and_observe(layer, topk, logits), no accepted
                expect += [("select", layer), ("remap_and_observe", layer, 2, ())]
            self.assertEqual(per_layer, expect)
            md, cam = e.metadata[-1]
            seq_lens = cam.seq_lens.tolist()
            # The decode block table is given as the step begins (every layer selects through
            # it; on the GPU each observe publishes the next layer's selection).
            self.assertIs(rec.step_table, md.decode.block_table)
            self.assertEqual(len(kernels.SCHEDULE_CALLS), e.layers)
            for layer, (_, count, union) in enumerate(rec.selections):
                topk, q, w = out[layer]
                logits = dense_logits(e, layer, q, w, md)
                compact = []
                for b, L in enumerate(seq_lens):
                    blocks = union[b, : count[b]].tolist()
                    self.assertEqual(blocks, sorted(blocks))
                    self.assertIn((L - 1) // BLOCK, blocks)  # the query's own block
                    allowed = torch.cat([torch.arange(j * BLOCK, min((j + 1) * BLOCK, L))
                                         for j in blocks])
                    compact.append(len(allowed))
                    got = valid(topk[b])
                    self.assertEqual(len(got), min(TOPK, len(allowed)))
                    self.assertTrue(set(got) <= set(allowed.tolist()))
                    # the top-K of the dense scores restricted to the selected blocks
                    self.assertEqual(sorted(got), best(logits[b, allowed], allowed, TOPK))
                    skipped += -(-L // BLOCK) - len(blocks)
                # this layer's schedule metadata was built from the compacted lengths
                self.assertEqual(kernels.SCHEDULE_CALLS[layer].tolist(), [[n] for n in compact])
            if step == 0:
                self.assertEqual(skipped, 0)  # fresh sequences: dense on the first decode
        self.assertGreater(skipped, 0)  # later steps skip blocks at sparsity 0.5
        self.assertEqual(_state.STATE.counters["spin_calls"], 4 * e.layers)

    def test_sparsity_zero_equals_dense(self):
        spin = Engine(env=dict(LOCAL, SPIND_SPARSITY="0.0"), seed=3)
        self.run_engine(spin, 3)
        self.assertEqual(_state.STATE.counters["spin_calls"], 3 * spin.layers)
        dense = Engine(env={"SPIND_DISABLE": "1"}, seed=3)
        self.assertIsNone(_state.STATE.session)
        self.run_engine(dense, 3)
        self.assertEqual(_state.STATE.counters["spin_calls"], 0)
        self.assertEqual(len(spin.outputs), 4)
        for s_out, d_out in zip(spin.outputs, dense.outputs):
            for layer in s_out:
                self.assertTrue(torch.equal(s_out[layer][0], d_out[layer][0]))

    def test_unreachable_spind_decodes_dense(self):
        env = dict(LOCAL, SPIND_TARGET="unix:///nonexistent/spind-test.sock")
        spin = Engine(env=env, seed=5)
        self.assertFalse(_state.STATE.session.counters()["attached"])
        self.run_engine(spin, 3)
        self.assertEqual(_state.STATE.counters["spin_calls"], 3 * spin.layers)
        dense = Engine(worker=False, seed=5)
        self.run_engine(dense, 3)
        for s_out, d_out in zip(spin.outputs, dense.outputs):
            for layer in s_out:
                self.assertTrue(torch.equal(s_out[layer][0], d_out[layer][0]))

    def test_mtp_rows_and_draft_layer_dense(self):
        # next_n = 2: rows per entry 2; the draft layer (numbered past the model's layers, in
        # the same forward and KV-cache group) runs vLLM's dense indexer.
        e = Engine(spec_tokens=1, env=LOCAL, draft_layer=True)
        st = _state.STATE
        self.assertEqual((st.rows, st.layers), (2, e.layers))
        self.assertEqual(e.model[-1].spin_layer, e.layers)
        with dense_calls() as dense:
            self.run_engine(e, 2, prompt=(500, 190))
        self.assertEqual(st.counters["spin_calls"], 2 * e.layers)
        self.assertEqual(dense.count(prefix(e.layers)), 3)  # the prefill and both decodes
        self.assertEqual(st.dense_reasons.get(
            "layer outside the session (e.g. an MTP draft layer)"), 2)
        md, cam = e.metadata[-1]
        self.assertEqual(md.decode.seq_lens.shape, (2, 2))
        seq_lens = cam.seq_lens.tolist()
        for layer in range(e.layers + 1):
            topk, q, w = e.outputs[-1][layer]
            logits = dense_logits(e, layer, q, w, md) if layer == e.layers else None
            for b, L in enumerate(seq_lens):
                for j in range(2):
                    n = L - 2 + j + 1  # vLLM's row length: L - next_n + j + 1
                    row = valid(topk[b * 2 + j])
                    self.assertTrue(row and max(row) < n)
                    if logits is not None:
                        self.assertEqual(row, best(logits[b * 2 + j, :n], range(n), TOPK))


_TP_CHILD = r"""
import json, os, sys, torch
sys.path[:0] = json.loads(os.environ["CHILD_PATH"])
import vllm_real
vllm_real.install()
from vllm.distributed.parallel_state import GroupCoordinator
from vllm.v1.core.sched.output import SchedulerOutput
from spind_vllm import _state
from test_vllm_plugin import FakeSession
rank = int(os.environ["RANK"])
torch.distributed.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"],
                                     rank=rank, world_size=2)
fake = FakeSession([7.0, 1.0, 0.6 + rank / 10, 0.05, 0.3, 0.0, 1.0, 0.6, 0.7])
st = _state.PluginState()
st.attach(fake, layers=2, rows=1, block_size=64, topk=128, max_seqs=2,
          tp_group=GroupCoordinator([0, 1], rank, torch.distributed.group.WORLD))
st.on_schedule(SchedulerOutput.make_empty())
st.on_schedule(SchedulerOutput.make_empty())  # the same control again: not adopted twice
print(json.dumps(fake.calls), flush=True)
# Both ranks are done with the group before either leaves; then leave without the interpreter's
# teardown, where gloo's threads can abort a rank whose peer already closed its sockets
# ("terminate called without an active exception", seen once in CI). Teardown is torch's, not
# what this test checks.
torch.distributed.barrier()
sys.stderr.flush()
os._exit(0)
"""


class TensorParallel(unittest.TestCase):
    """The group's step boundary (spind_vllm._state.sync_tp_group)."""

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

    def test_sync_skipped_for_one_rank(self):
        from vllm.distributed.parallel_state import GroupCoordinator
        fake = FakeSession()
        self.assertIsNone(_state.sync_tp_group(fake, GroupCoordinator([0], 0), _state.GroupSync()))
        self.assertEqual(fake.calls, [])

    def test_rank1_adopts_rank0_control_once(self):
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

    def test_a_rank_without_spind_makes_the_group_dense(self):
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

    def test_a_session_switch_resets_every_rank(self):
        from vllm.distributed.parallel_state import GroupCoordinator
        from vllm.v1.core.sched.output import SchedulerOutput
        fake = FakeSession()
        st = _state.PluginState()
        g = GroupCoordinator([4, 5], 1, "cpu-group")
        st.attach(fake, layers=2, rows=1, block_size=BLOCK, topk=TOPK, max_seqs=2, tp_group=g)
        st.slots.assign("req-a")
        other_switched = [0.0]

        def reduce(t, group):
            t[:len(self.RANK0)] += torch.tensor(self.RANK0, dtype=torch.float64)
            t[-1] += other_switched[0]
        orig = _state.sync_tp_group
        try:
            _state.sync_tp_group = lambda s, grp, sy: orig(s, grp, sy, reduce)
            st.on_schedule(SchedulerOutput.make_empty())
            self.assertNotIn("reset_sequence", [c[0] for c in fake.calls])
            other_switched[0] = 1.0  # the other rank switched to a new spind session
            st.on_schedule(SchedulerOutput.make_empty())
            other_switched[0] = 0.0
            fake.generation += 1     # then this one did
            st.on_schedule(SchedulerOutput.make_empty())
        finally:
            _state.sync_tp_group = orig
        resets = [c for c in fake.calls if c[0] == "reset_sequence"]
        self.assertEqual(resets, [("reset_sequence", 0, sequence_key("req-a"))] * 2)
        self.assertEqual(st.counters["group_resets"], 2)

    def test_two_gloo_ranks_adopt_rank0_control(self):
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, INIT_FILE=os.path.join(d, "init"),
                       CHILD_PATH=json.dumps([HERE] + sys.path))
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


class GpuTarget(unittest.TestCase):
    def test_gpu_uuid_target(self):
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


class SessionOptions(unittest.TestCase):
    def test_session_options_from_the_environment(self):
        from spind_vllm.worker import session_options
        o = session_options({})
        self.assertEqual((o["state"], o["target_sparsity"], o["defer_ema"]), ("bf16", 0.5, False))
        o = session_options({"SPIND_DEFER_EMA": "1", "SPIND_SPARSITY": "0.7"})
        self.assertEqual((o["defer_ema"], o["target_sparsity"]), (True, 0.7))
        with self.assertRaisesRegex(ValueError, "SPIND_DEFER_EMA must be 0 or 1, not 'yes'"):
            session_options({"SPIND_DEFER_EMA": "yes"})
        # No env given: os.environ, every variable (SPIND_DEFER_EMA too).
        with environ({"SPIND_DEFER_EMA": "1", "SPIND_SPARSITY": "0.25"}):
            o = session_options()
        self.assertEqual((o["defer_ema"], o["target_sparsity"]), (True, 0.25))
        # Every key is a spind.Session keyword (the worker passes them through).
        import inspect
        import spind
        params = inspect.signature(spind.Session.__init__).parameters
        self.assertEqual([k for k in o if k not in params], [])

    def test_session_options_read_only_the_env_passed(self):
        # SPIND_DEFER_EMA given only in the passed env; os.environ holds other values (an
        # invalid one included), none of which may be read.
        from spind_vllm.worker import session_options
        with environ({"SPIND_DEFER_EMA": "yes", "SPIND_SPARSITY": "0.9", "SPIND_SEED": "99"}):
            o = session_options(env={"SPIND_DEFER_EMA": "1"})
            self.assertEqual((o["defer_ema"], o["target_sparsity"], o["seed"]), (True, 0.5, 1))
            o = session_options(env={"SPIND_DEFER_EMA": "0"})
            self.assertFalse(o["defer_ema"])


class ModelKey(unittest.TestCase):
    def test_model_key_is_a_safe_file_name(self):
        from types import SimpleNamespace as ns
        from spind_vllm.worker import model_key
        self.assertEqual(model_key(ns(served_model_name=["deepseek-ai/DeepSeek-V3.2"])),
                         "deepseek-ai_DeepSeek-V3.2")
        self.assertEqual(model_key(ns(served_model_name=None, model="/models/../ds v3")),
                         "_models_.._ds_v3")
        self.assertEqual(model_key(ns(model="." * 3 + "x")), "x")
        self.assertEqual(len(model_key(ns(model="a" * 300))), 128)
        self.assertEqual(model_key(ns()), "")


class Preflight(unittest.TestCase):
    """scripts/vllm-preflight in a process of its own where the harness provides `vllm`: the
    names it checks in vLLM's real files (vllm_real.REAL_MODULES) are checked against them;
    the others against the harness's stubs (only that they are still spelled as pinned)."""

    SCRIPT = os.path.join(REPO, "scripts", "vllm-preflight")
    RUN = ("import runpy, sys; sys.path.insert(0, {here!r}); import vllm_real; "
           "vllm_real.install(); sys.argv = [{script!r}]; "
           "runpy.run_path({script!r}, run_name='__main__')")

    def run_preflight(self, src):
        code = self.RUN.format(here=HERE, script=self.SCRIPT)
        env = dict(os.environ, SPIND_VLLM_SRC=src)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)

    def test_preflight_passes_over_the_real_files(self):
        from spind_vllm import pinned
        r = self.run_preflight(vllm_real.SRC)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("spind-vllm-real-9aaf83ef", r.stdout)  # the harness's vllm
        self.assertIn("PASS", r.stdout)
        self.assertIn("SparseAttnIndexer", r.stdout)
        self.assertIn("spind_vllm::sparse_attn_indexer", r.stdout)
        real = [f"{m}.{q}" for m, q, _ in pinned.SIGNATURES if m in vllm_real.REAL_MODULES]
        self.assertGreaterEqual(len(real), 10)
        ok = {line.split()[1].split("(")[0] for line in r.stdout.splitlines()
              if line.startswith("  ok  ")}
        self.assertEqual([w for w in real if w not in ok], [])

    def test_preflight_fails_on_a_broken_copy(self):
        for rel, old, new, expect in [
            ("vllm/v1/attention/backends/mla/indexer.py",
             "        self,\n        common_prefix_len: int,\n"
             "        common_attn_metadata: CommonAttentionMetadata,\n",
             "        self,\n        common_attn_metadata: CommonAttentionMetadata,\n",
             "DeepseekV32IndexerMetadataBuilder.build"),
            ("vllm/config/compilation.py", '"vllm::sparse_attn_indexer",', "",
             "vllm::sparse_attn_indexer"),
            ("vllm/model_executor/layers/sparse_attn_indexer.py",
             "        max_total_seq_len: int,\n", "        max_total_seq_lens: int,\n",
             "SparseAttnIndexer.__init__"),
            ("vllm/v1/core/sched/output.py",
             "    req_id: str\n    prompt_token_ids:", "    request_id: str\n    prompt_token_ids:",
             "NewRequestData"),
        ]:
            with self.subTest(rel), tempfile.TemporaryDirectory() as d:
                broken = os.path.join(d, "vllm-src")
                shutil.copytree(vllm_real.SRC, broken, copy_function=shutil.copyfile)
                for dirpath, _, _ in os.walk(broken):  # the shared copy is read-only
                    os.chmod(dirpath, 0o755)
                p = os.path.join(broken, rel)
                with open(p) as f:
                    text = f.read()
                self.assertEqual(text.count(old), 1, old)
                with open(p, "w") as f:
                    f.write(text.replace(old, new))
                r = self.run_preflight(broken)
                self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
                self.assertIn("MISMATCH", r.stdout)
                self.assertIn(expect, r.stdout)


if __name__ == "__main__":
    unittest.main()
