"""Self-tests of tests/python/vllm_real: vLLM's own files (9aaf83ef, from ../shared) on the stubs.

They check that the real modules load from the shared sources and the rest from stubs/, that
vllm_real.batches builds CommonAttentionMetadata as vLLM's model runner does (padded decode,
MTP, mixed batches, capture) by running vLLM's real DeepseekV32IndexerMetadataBuilder on it,
that vLLM's real sparse_attn_indexer runs end to end on the stand-in kernels (prefill, padded
decode, MTP, the persistent_topk branch when CUDA-like, the profiling run) against a brute
force, and the stand-ins' own semantics. On a CUDA machine the decode path also runs on the GPU
and inside a captured CUDA graph. Skipped when the shared vLLM sources are absent.

Run (from tests/python): PYTHONPATH=<build>/python python3 -m unittest -v test_vllm_real
"""
import os
import shutil
import sys
import tempfile
import unittest

import torch

import vllm_real

PREFIX = "model.layers.0.self_attn.indexer.k_cache"


def setUpModule():
    vllm_real.install_for_tests()


def brute_topk(q, w, keys, n, k):
    """The k best of sum_h w[h] * relu(q[h] . keys[c]) over c < n: ascending indices, ties to
    the lower column."""
    s = (w[:, None] * torch.relu(q @ keys[:n].T)).sum(0)
    order = sorted(range(n), key=lambda c: (-float(s[c]), c))[:k]
    return sorted(order)


def row(t):
    return [x for x in t.tolist() if x >= 0]


class Modules(unittest.TestCase):
    def test_real_modules_come_from_the_shared_sources(self):
        import importlib
        for name in vllm_real.REAL_MODULES:
            mod = importlib.import_module(name)
            self.assertTrue(os.path.abspath(mod.__file__).startswith(vllm_real.SRC + os.sep),
                            f"{name}: {mod.__file__}")

    def test_every_stub_is_listed_and_every_listed_stub_exists(self):
        root = vllm_real._loader.STUBS
        found = set()
        for dirpath, _, files in os.walk(root):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3]
                name = rel.replace(os.sep, ".")
                found.add(name[: -len(".__init__")] if name.endswith(".__init__") else name)
        listed = set(vllm_real.STUBBED_MODULES)
        if "vllm.utils.torch_utils" not in listed:
            found.discard("vllm.utils.torch_utils")  # loaded real on this torch
        self.assertEqual(found, listed)
        for name, why in vllm_real.STUBBED_MODULES.items():
            self.assertTrue(why and "\n" not in why, name)
        import importlib
        for name in listed:
            mod = importlib.import_module(name)
            self.assertTrue(mod.__file__.startswith(root + os.sep), f"{name}: {mod.__file__}")

    def test_unlisted_vllm_modules_are_refused(self):
        with self.assertRaisesRegex(ModuleNotFoundError, "vllm_real"):
            import vllm.v1.worker.block_table  # noqa: F401 - real file, not loaded

    def test_config_keeps_vllms_enums_and_attention_ops(self):
        from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
        self.assertIn("vllm::sparse_attn_indexer", CompilationConfig._attention_ops)
        self.assertEqual(CUDAGraphMode.FULL_AND_PIECEWISE.decode_mode(), CUDAGraphMode.FULL)
        c = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
        c.set_splitting_ops_for_v1()
        self.assertTrue(c.splitting_ops_contain_attention())

    def test_scheduler_output_is_vllms(self):
        import dataclasses
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
        names = [f.name for f in dataclasses.fields(SchedulerOutput)]
        for field in ("scheduled_new_reqs", "scheduled_cached_reqs", "finished_req_ids",
                      "preempted_req_ids"):
            self.assertIn(field, names)
        self.assertIn("resumed_req_ids", [f.name for f in dataclasses.fields(CachedRequestData)])


class RunnerMetadata(unittest.TestCase):
    """vllm_real.batches against vLLM's real builder (the facts the plugin depends on)."""

    def test_padded_decode_is_non_uniform_for_the_builder(self):
        b = vllm_real.make_builder(max_model_len=512)
        cam = vllm_real.decode_batch([100, 70, 33], padded_to=4)
        self.assertEqual(cam.query_start_loc_cpu.tolist(), [0, 1, 2, 3, 3])
        self.assertEqual(cam.seq_lens.tolist(), [100, 70, 33, 0])
        self.assertEqual((cam.num_reqs, cam.num_actual_tokens, cam.max_query_len,
                          cam.max_seq_len), (4, 4, 1, 100))
        self.assertEqual(cam.slot_mapping.tolist()[3], -1)
        self.assertEqual(cam.block_table_tensor.shape, (4, 8))
        self.assertEqual(cam.block_table_tensor[3].tolist(), [0] * 8)
        self.assertEqual(cam.slot_mapping.tolist()[:3],
                         [int(cam.block_table_tensor[r, (L - 1) // 64]) * 64 + (L - 1) % 64
                          for r, L in enumerate([100, 70, 33])])
        md = b.build(0, cam)
        self.assertEqual((md.num_decodes, md.num_decode_tokens, md.num_prefills), (4, 4, 0))
        self.assertEqual(md.decode.decode_lens.tolist(), [1, 1, 1, 0])
        self.assertTrue(md.decode.requires_padding)
        self.assertEqual(md.decode.seq_lens.tolist(), [[100], [70], [33], [0]])

    def test_unpadded_decode_is_uniform(self):
        b = vllm_real.make_builder(max_model_len=512)
        md = b.build(0, vllm_real.decode_batch([100, 70, 33]))
        self.assertFalse(md.decode.requires_padding)
        self.assertEqual(md.decode.seq_lens.shape, (3, 1))
        self.assertEqual(md.decode.decode_lens.tolist(), [1, 1, 1])

    def test_mtp_next_n_2_has_2d_lengths(self):
        b = vllm_real.make_builder(max_model_len=512, num_speculative_tokens=1)
        md = b.build(0, vllm_real.decode_batch([100, 70, 33], next_n=2))
        self.assertFalse(md.decode.requires_padding)
        self.assertEqual(md.decode.seq_lens.tolist(), [[99, 100], [69, 70], [32, 33]])
        self.assertEqual(md.decode.decode_lens.tolist(), [2, 2, 2])
        padded = b.build(0, vllm_real.decode_batch([100, 70, 33], padded_to=4, next_n=2))
        self.assertEqual(padded.decode.decode_lens.tolist(), [2, 2, 2, 0])
        self.assertTrue(padded.decode.requires_padding)
        self.assertEqual(padded.num_decode_tokens, 8)

    def test_mtp_next_n_3_is_flattened_on_hopper(self):
        # Off SM100 the FP8 paged kernel takes next_n 1 or 2: vLLM flattens, running its
        # Triton expansion kernel (here in the interpreter).
        b = vllm_real.make_builder(max_model_len=512, num_speculative_tokens=2)
        md = b.build(0, vllm_real.decode_batch([100, 33], next_n=3))
        self.assertEqual(md.decode.seq_lens.reshape(-1).tolist(), [98, 99, 100, 31, 32, 33])
        self.assertEqual(md.decode.decode_lens.tolist(), [1] * 6)
        self.assertEqual(md.decode.block_table[:, 0].tolist(), [1, 1, 1, 3, 3, 3])

    def test_mixed_batch_has_prefill_chunks(self):
        b = vllm_real.make_builder(max_model_len=512)
        cam = vllm_real.mixed_batch([100, 70], [(300, 120), (50, 50)])
        self.assertEqual(cam.is_prefilling.tolist(), [False, False, True, True])
        md = b.build(0, cam)
        self.assertEqual((md.num_decodes, md.num_prefills, md.num_decode_tokens,
                          md.num_prefill_tokens), (2, 2, 2, 170))
        self.assertEqual(len(md.prefill.chunks), 1)
        c = md.prefill.chunks[0]
        self.assertEqual((c.token_start, c.token_end, c.total_seq_lens, c.num_reqs),
                         (2, 172, 350, 2))
        self.assertEqual(c.cu_seq_lens.tolist(), [0, 300, 350])
        self.assertEqual(c.cu_seqlen_ks.tolist(), [0] * 120 + [300] * 50)
        self.assertEqual(c.cu_seqlen_ke.tolist(),
                         list(range(181, 301)) + list(range(301, 351)))
        self.assertEqual(md.decode.decode_lens.tolist(), [1, 1])

    def test_capture_batch(self):
        b = vllm_real.make_builder(max_model_len=512)
        cam = vllm_real.capture_batch(4)
        self.assertEqual(cam.seq_lens.tolist(), [1, 1, 1, 1])
        self.assertEqual(cam.slot_mapping.tolist(), [-1] * 4)
        self.assertEqual(cam.max_seq_len, 512)
        md = b.build(0, cam)
        self.assertFalse(md.decode.requires_padding)

    def test_cuda_like_builds_the_schedule_from_the_decode_lengths(self):
        b = vllm_real.make_builder(max_model_len=512)
        vllm_real.kernels.reset()
        b.build(0, vllm_real.decode_batch([100, 70, 33], padded_to=4))
        self.assertEqual(vllm_real.kernels.SCHEDULE_CALLS, [])
        with vllm_real.cuda_like():
            b.build(0, vllm_real.decode_batch([100, 70, 33], padded_to=4))
        self.assertEqual([c.tolist() for c in vllm_real.kernels.SCHEDULE_CALLS],
                         [[[100], [70], [33], [0]]])


class _Indexer:
    """One layer of vLLM's real SparseAttnIndexer over a real builder and a float32 cache."""

    H, D, BLOCK, MAX_LEN = 4, 16, 64, 1024

    def make(self, topk=512, spec_tokens=0, device="cpu"):
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
        self.builder = vllm_real.make_builder(max_model_len=self.MAX_LEN, block_size=self.BLOCK,
                                              head_dim=self.D,
                                              num_speculative_tokens=spec_tokens,
                                              device=device)
        self.kv = vllm_real.new_kv_cache(64, self.BLOCK, self.D, device=device)
        self.buf = torch.full((2048, topk), -7, dtype=torch.int32, device=device)
        self.layer = SparseAttnIndexer(vllm_real.k_cache(PREFIX, self.kv), 128, "ue8m0", topk,
                                       self.D, self.MAX_LEN, self.MAX_LEN * 40, self.buf)
        self.topk, self.device = topk, device
        self.gen = torch.Generator().manual_seed(0)

    def step(self, cam, keys_in):
        """One forward over `cam` with random q/weights; returns (topk rows, q, w)."""
        md = self.builder.build(0, cam)
        t = cam.num_actual_tokens
        q = torch.randn(t, self.H, self.D, generator=self.gen)
        w = torch.rand(t, self.H, generator=self.gen)
        k = torch.zeros(t, self.D)
        k[: keys_in.shape[0]] = keys_in
        dev = self.device
        with vllm_real.forward_context({PREFIX: md}):
            out = self.layer(torch.zeros(t, 1, device=dev), q.to(dev), k.to(dev), w.to(dev))
        return out[:t].cpu(), q, w


class Layer(_Indexer, unittest.TestCase):
    """vLLM's real SparseAttnIndexer (custom op, sparse_attn_indexer body) on the stand-ins."""

    def test_prefill_then_padded_decode(self):
        self.make()
        kernels = vllm_real.kernels
        lens = [700, 300, 40]
        keys = [torch.randn(L, self.D, generator=self.gen) for L in lens]
        kernels.reset()
        out, q, w = self.step(vllm_real.batch([(L, L, True) for L in lens]), torch.cat(keys))
        self.assertEqual(kernels.CALLS["top_k_per_row_prefill"], 1)
        self.assertEqual(kernels.CALLS["cp_gather_indexer_k_quant_cache"], 1)
        t0 = 0
        for r, L in enumerate(lens):
            for i in (0, L // 2, L - 1):
                self.assertEqual(row(out[t0 + i]),
                                 brute_topk(q[t0 + i], w[t0 + i], keys[r], i + 1, self.topk))
            t0 += L
        # One decode token each, the batch padded to a graph of 4: vLLM's padding path.
        new = torch.randn(3, self.D, generator=self.gen)
        keys = [torch.cat([k, n[None]]) for k, n in zip(keys, new)]
        kernels.reset()
        out, q, w = self.step(vllm_real.decode_batch([L + 1 for L in lens], padded_to=4), new)
        self.assertEqual((kernels.CALLS["pack_seq_triton"], kernels.CALLS["unpack_seq_triton"],
                          kernels.CALLS["top_k_per_row_decode"],
                          kernels.CALLS["persistent_topk"]), (1, 1, 1, 0))
        for r, L in enumerate(lens):
            self.assertEqual(row(out[r]), brute_topk(q[r], w[r], keys[r], L + 1, self.topk))
        self.assertEqual(row(out[3]), [])

    def test_cuda_like_takes_persistent_topk(self):
        kernels = vllm_real.kernels
        results = {}
        for topk, cuda in ((512, False), (512, True), (64, True)):
            self.make(topk=topk)
            keys = torch.randn(600, self.D, generator=self.gen)
            self.step(vllm_real.batch([(599, 599, True)]), keys[:599])
            kernels.reset()
            self.gen.manual_seed(5)
            with vllm_real.cuda_like(cuda):
                out, q, w = self.step(vllm_real.decode_batch([600], padded_to=2), keys[599:])
            used = "persistent_topk" if kernels.CALLS["persistent_topk"] else \
                "top_k_per_row_decode"
            self.assertEqual(kernels.CALLS["persistent_topk"] +
                             kernels.CALLS["top_k_per_row_decode"], 1)
            self.assertEqual(row(out[0]), brute_topk(q[0], w[0], keys, 600, topk))
            self.assertEqual(kernels.PERSISTENT_TOPK_MAX_SEQ_LENS,
                             [600] if used == "persistent_topk" else [])
            results[(topk, cuda)] = (used, out[0])
        self.assertEqual(results[(512, False)][0], "top_k_per_row_decode")
        self.assertEqual(results[(512, True)][0], "persistent_topk")
        self.assertEqual(results[(64, True)][0], "top_k_per_row_decode")
        self.assertTrue(torch.equal(results[(512, False)][1], results[(512, True)][1]))

    def test_mtp_rows_see_their_own_lengths(self):
        self.make(topk=64, spec_tokens=1)
        lens = [300, 130]
        keys = [torch.randn(L, self.D, generator=self.gen) for L in lens]
        self.step(vllm_real.batch([(L - 2, L - 2, True) for L in lens]),
                  torch.cat([k[: L - 2] for k, L in zip(keys, lens)]))
        new = torch.cat([k[L - 2:] for k, L in zip(keys, lens)])
        out, q, w = self.step(vllm_real.decode_batch(lens, next_n=2), new)
        for b, L in enumerate(lens):
            for j in range(2):
                r = 2 * b + j
                self.assertEqual(row(out[r]), brute_topk(q[r], w[r], keys[b], L - 2 + j + 1, 64))

    def test_profiling_run_reserves_and_returns(self):
        self.make(topk=64)
        vllm_real.kernels.reset()
        with vllm_real.forward_context(None):
            res = self.layer(torch.zeros(4, 1), torch.zeros(4, self.H, self.D),
                             torch.zeros(4, self.D), torch.zeros(4, self.H))
        self.assertEqual(sum(vllm_real.kernels.CALLS.values()), 0)
        self.assertTrue(bool((res == -7).all()))

    def test_oot_substitution_and_dispatch(self):
        from vllm.config import get_cached_compilation_config
        from vllm.model_executor.custom_op import CustomOp, op_registry, op_registry_oot

        @CustomOp.register("vllm_real_probe")
        class VllmRealProbe(CustomOp):
            def forward_cuda(self):
                return "cuda"

            def forward_native(self):
                return "native"

        class Ours(VllmRealProbe):
            def forward_cuda(self):
                return "ours"

        cfg = get_cached_compilation_config()
        try:
            CustomOp.register_oot(Ours, name="VllmRealProbe")
            op = VllmRealProbe()
            self.assertIsInstance(op, Ours)
            self.assertEqual(op(), "ours")
            saved = cfg.custom_ops
            cfg.custom_ops = ["none"]
            try:
                self.assertEqual(VllmRealProbe()(), "native")
            finally:
                cfg.custom_ops = saved
        finally:
            op_registry.pop("vllm_real_probe", None)
            op_registry_oot.pop("VllmRealProbe", None)

    def test_general_plugins_are_loaded_from_entry_points(self):
        import vllm.plugins
        d = tempfile.mkdtemp(prefix="vllm-real-ep-")
        try:
            info = os.path.join(d, "vllm_real_probe-0.0.0.dist-info")
            os.makedirs(info)
            with open(os.path.join(info, "METADATA"), "w") as f:
                f.write("Metadata-Version: 2.1\nName: vllm-real-probe\nVersion: 0.0.0\n")
            with open(os.path.join(info, "entry_points.txt"), "w") as f:
                f.write("[vllm.general_plugins]\nprobe = vllm_real_probe_plugin:register\n"
                        "other = vllm_real_probe_plugin:other\n")
            with open(os.path.join(d, "vllm_real_probe_plugin.py"), "w") as f:
                f.write("CALLED = []\ndef register():\n    CALLED.append('probe')\n"
                        "def other():\n    CALLED.append('other')\n")
            sys.path.insert(0, d)
            os.environ["VLLM_PLUGINS"] = "probe"
            vllm.plugins.plugins_loaded = False
            vllm.plugins.load_general_plugins()
            vllm.plugins.load_general_plugins()  # once per process
            import vllm_real_probe_plugin
            self.assertEqual(vllm_real_probe_plugin.CALLED, ["probe"])
        finally:
            os.environ.pop("VLLM_PLUGINS", None)
            sys.path.remove(d)
            sys.modules.pop("vllm_real_probe_plugin", None)
            shutil.rmtree(d, ignore_errors=True)


class Kernels(unittest.TestCase):
    def test_topk_ties_nan_and_short_rows(self):
        k = vllm_real.kernels
        x = torch.tensor([[1.0, 3.0, 3.0, float("nan"), 2.0, float("-inf")],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                          [float("nan"), float("-inf"), 5.0, 1.0, 1.0, 9.0]])
        out = torch.full((3, 4), 99, dtype=torch.int32)
        k.topk_rows(x, torch.zeros(3, dtype=torch.int32),
                    torch.tensor([6, 2, 4], dtype=torch.int32), 3, out)
        self.assertEqual(out.tolist(), [[1, 2, 4, 99], [0, 1, -1, 99], [1, 2, 3, 99]])
        out.fill_(99)
        k.topk_rows(x, torch.tensor([1, 0, 2], dtype=torch.int32),
                    torch.tensor([5, 6, 6], dtype=torch.int32), 2, out)
        self.assertEqual(out[:, :2].tolist(), [[0, 1], [0, 1], [0, 3]])

    def test_decode_lengths_1d_and_2d(self):
        k = vllm_real.kernels
        self.assertEqual(k._decode_lens(torch.tensor([[9, 10], [4, 5]]), 2, 4).tolist(),
                         [9, 10, 4, 5])
        self.assertEqual(k._decode_lens(torch.tensor([10, 5]), 2, 4).tolist(), [9, 10, 4, 5])

    def test_pack_unpack(self):
        k = vllm_real.kernels
        x = torch.arange(12, dtype=torch.float32).reshape(6, 2)
        lens = torch.tensor([1, 3, 0, 2], dtype=torch.int32)
        packed = k.pack_seq(x, lens)
        self.assertEqual(packed.shape, (4, 3, 2))
        self.assertEqual(packed[1].tolist(), [[2, 3], [4, 5], [6, 7]])
        self.assertTrue(bool(torch.isinf(packed[0, 1:]).all()))
        self.assertTrue(torch.equal(k.unpack_seq(packed, lens), x))
        b = torch.arange(6, dtype=torch.uint8).reshape(3, 2)
        self.assertEqual(k.pack_seq(b, torch.tensor([2, 1]), pad_value=0)[1].tolist(),
                         [[4, 5], [0, 0]])

    def test_cache_write_skips_padding_slots(self):
        k = vllm_real.kernels
        kv = torch.zeros(2, 4, 3)
        k.indexer_k_quant_and_cache(torch.ones(3, 3), kv, torch.tensor([5, -1, 0]), 128, "x")
        self.assertEqual(kv.reshape(8, 3).sum(1).tolist(), [3, 0, 0, 0, 0, 3, 0, 0])

    @unittest.skipUnless(hasattr(torch, "float8_e4m3fn"), "torch without float8")
    def test_fp8_cache_layout_round_trip(self):
        k = vllm_real.kernels
        kv = torch.zeros(3, 64, 132, dtype=torch.uint8)
        keys = torch.randn(5, 128)
        slots = torch.tensor([64, 65, 130, 3, 191])
        k.indexer_k_quant_and_cache(keys, kv, slots, 128, "ue8m0")
        deq, scale = k._paged_keys(kv)
        got = (deq * scale[..., None]).reshape(-1, 128)[slots]
        self.assertTrue(torch.allclose(got, keys, rtol=0.07, atol=0.02))
        # pages keep vLLM's layout: all values first, then the scales
        self.assertEqual(kv[1].reshape(-1)[64 * 128:64 * 128 + 4].view(torch.float32).item(),
                         float(scale[1, 0]))
        # the paged logits read the fp8 layout as the float cache of its dequantized keys
        table = torch.tensor([[1, 2], [0, 2]], dtype=torch.int32)
        lens = torch.tensor([[100], [70]], dtype=torch.int32)
        q = torch.randn(2, 1, 2, 128)
        w = torch.rand(2, 2)
        a = k.fp8_fp4_paged_mqa_logits((q, None), kv.unsqueeze(-2), w, lens, table, None, 128,
                                       True)
        b = k.fp8_fp4_paged_mqa_logits((q, None), (deq * scale[..., None]).unsqueeze(-2), w,
                                       lens, table, None, 128, True)
        self.assertTrue(torch.allclose(a, b, rtol=1e-5, atol=1e-5))
        self.assertTrue(bool(torch.isinf(a[0, 100:]).all() and torch.isinf(a[1, 70:]).all()))


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
class Cuda(_Indexer, unittest.TestCase):
    """The decode path on the GPU, eagerly and replayed from a captured CUDA graph (CPU-like
    and CUDA-like: top_k_per_row_decode and persistent_topk)."""

    def test_gpu_equals_cpu_and_graph_replay_equals_eager(self):
        for cuda in (False, True):
            with self.subTest(cuda_like=cuda), vllm_real.cuda_like(cuda):
                self.check_gpu(cuda)

    def check_gpu(self, cuda):
        vllm_real.kernels.reset()
        lens = [700, 300, 40]
        results = {}
        for device in ("cpu", "cuda"):
            self.make(topk=512, device=device)
            keys = torch.randn(sum(lens), self.D, generator=self.gen)
            self.step(vllm_real.batch([(L, L, True) for L in lens]), keys)
            self.gen.manual_seed(11)
            new = torch.randn(3, self.D, generator=self.gen)
            results[device] = self.step(vllm_real.decode_batch([L + 1 for L in lens]), new)[0]
        self.assertTrue(torch.equal(results["cpu"], results["cuda"]))

        # Capture the uniform decode step (what a FULL graph holds), replay with new inputs.
        md = self.builder.build(0, vllm_real.decode_batch([L + 2 for L in lens]))
        q = torch.randn(3, self.H, self.D, device="cuda")
        w = torch.rand(3, self.H, device="cuda")
        k = torch.randn(3, self.D, device="cuda")
        hidden = torch.zeros(3, 1, device="cuda")
        with vllm_real.forward_context({PREFIX: md}):
            self.layer(hidden, q, k, w)  # warm-up
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.layer(hidden, q, k, w)
            used = vllm_real.kernels.CALLS["persistent_topk"]
            for seed in (1, 2):
                g = torch.Generator(device="cuda").manual_seed(seed)
                q.copy_(torch.randn(q.shape, device="cuda", generator=g))
                w.copy_(torch.rand(w.shape, device="cuda", generator=g))
                graph.replay()
                replayed = self.buf[:3].clone()
                self.layer(hidden, q, k, w)
                self.assertTrue(torch.equal(replayed, self.buf[:3]))
        self.assertEqual(bool(used), cuda)

    def test_cache_write_under_capture_skips_padding_slots(self):
        k = vllm_real.kernels
        kv = torch.zeros(2, 4, 3, device="cuda")
        kv[0, 0] = 5.0
        rows = torch.ones(3, 3, device="cuda")
        slots = torch.tensor([-1, 6, -1], device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            k.indexer_k_quant_and_cache(rows, kv, slots, 128, "ue8m0")
        graph.replay()
        torch.cuda.synchronize()
        self.assertEqual(kv.reshape(8, 3).sum(1).tolist(), [15, 0, 0, 0, 0, 0, 3, 0])


if __name__ == "__main__":
    unittest.main()
