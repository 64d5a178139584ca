"""The spind torch ops on a GPU (torch with CUDA; skipped without one): CUDA sessions select
exactly what CPU sessions select on the same inputs, a whole step captures in one CUDA graph
and replays, the per-step ops run under torch.compile(fullgraph=True), opcheck on the ops, and
a session attached to spind keeps its captured graph through a daemon SIGKILL and restart
(dense while spind is away, SPIN again once it is back), with grpcio and protobuf loaded first.
Run on the GPU machine by
scripts/gpu-check with PYTHONPATH=<bundle>/python-gpu and SPIND=<bundle>/spind."""
import os
import signal
import subprocess
import tempfile
import time
import unittest

import google.protobuf  # noqa: F401  (loaded before spind, as in a vLLM worker)
import grpc
import torch

import spind

B = 64
CUDA = torch.cuda.is_available()


def step_inputs(device, steps, ctx0, width, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, width, generator=g).to(device) for _ in range(steps)]


def capture(step):
    """Runs step() once eagerly on a side stream (as graph capture wants), then captures it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def run(s, layers, ctx, logits, topk_count):
    """One eager step of sequence 0: per layer select, top-K of the given logits over the
    compacted width, remap, observe. Returns per layer (union ids, remapped top-K)."""
    dev = s.device
    s.begin_step(torch.tensor([0], dtype=torch.int32, device=dev),
                 torch.tensor([ctx], dtype=torch.int32, device=dev),
                 torch.tensor([ctx - 1], dtype=torch.int32, device=dev), 1)
    out = []
    for layer in range(layers):
        s.select(layer)
        n = int(s.union_count[0])
        width = int(s.compact_len[0, 0])
        z = logits[layer][:, :width]
        k = min(topk_count, width)
        top = torch.topk(z, k, dim=1).indices.to(torch.int32)
        top = torch.sort(top, dim=1).values.contiguous()
        s.remap(top)
        full = torch.full((1, s.union_ids.shape[1] * B), float("-inf"), device=dev)
        full[:, :width] = z
        s.observe(layer, full, torch.ones(1, dtype=torch.int32, device=dev))
        out.append((s.union_ids[0, :n].cpu().tolist(), top.cpu().tolist()))
    s.refresh()
    return out


@unittest.skipUnless(CUDA, "no CUDA device")
class Gpu(unittest.TestCase):
    def test_cuda_sessions_select_what_cpu_sessions_select(self):
        # defer_ema: each layer's EMA beside the next layer's work, the session keeping the
        # logits (made afresh per layer by run()) alive until the next observe.
        for state, defer in (("fp32", False), ("bf16", False), ("bf16", True)):
            with self.subTest(state=state, defer_ema=defer):
                kw = dict(topk=256, target_sparsity=0.5, exploration=0.1, probe_period=4,
                          state=state, seed=3)
                layers, slots = 3, 128 * B
                cpu = spind.Session(layers, slots, **kw)
                gpu = spind.Session(layers, slots, device="cuda", defer_ema=defer, **kw)
                for s in (cpu, gpu):
                    s.reset_sequence(0, 11)
                g = torch.Generator().manual_seed(5)
                for t in range(12):
                    ctx = slots - 40 + t
                    logits = [torch.randn(1, slots, generator=g) for _ in range(layers)]
                    a = run(cpu, layers, ctx, logits, 256)
                    b = run(gpu, layers, ctx, [z.cuda() for z in logits], 256)
                    self.assertEqual(a, b, f"step {t}")
                self.assertTrue(torch.equal(cpu.stats(), gpu.stats()))
                cpu.close()
                gpu.close()

    def test_a_whole_step_captures_in_one_cuda_graph(self):
        for defer in (False, True):
            with self.subTest(defer_ema=defer):
                self.capture_and_replay(defer)

    def capture_and_replay(self, defer):
        layers, slots = 4, 64 * B
        s = spind.Session(layers, slots, topk=128, target_sparsity=0.5, exploration=0.0,
                          device="cuda", defer_ema=defer)
        ref = spind.Session(layers, slots, topk=128, target_sparsity=0.5, exploration=0.0)
        for x in (s, ref):
            x.reset_sequence(0, 3)
        dev = torch.device("cuda")
        seq = torch.zeros(1, dtype=torch.int32, device=dev)
        ctx = torch.full((1,), slots - 8, dtype=torch.int32, device=dev)
        q = ctx - 1
        logits = torch.zeros(layers, 1, slots, device=dev)
        acc = torch.ones(1, dtype=torch.int32, device=dev)
        top = torch.zeros(1, 64, dtype=torch.int32, device=dev)
        ids = torch.zeros(layers, s.union_ids.shape[1], dtype=torch.int32, device=dev)

        def step():
            s.begin_step(seq, ctx, q, 1)
            for layer in range(layers):
                s.select(layer)
                ids[layer].copy_(s.union_ids[0])
                top.copy_(torch.arange(64, dtype=torch.int32, device=dev)[None])
                s.remap(top)
                s.observe(layer, logits[layer], acc)

        # One eager step (the warm-up, its logits kept for the reference), then the capture.
        g = torch.Generator().manual_seed(9)
        host_logits = []
        host_logits.append(torch.randn(layers, 1, slots, generator=g))
        logits.copy_(host_logits[-1].cuda())
        graph = capture(step)
        # The eager CPU reference runs the same steps: the warm-up one, then each replay.
        def ref_step(z):
            ref.begin_step(torch.tensor([0], dtype=torch.int32),
                           torch.tensor([slots - 8], dtype=torch.int32),
                           torch.tensor([slots - 9], dtype=torch.int32), 1)
            got = []
            for layer in range(layers):
                ref.select(layer)
                got.append(ref.union_ids[0].clone())
                t = torch.arange(64, dtype=torch.int32)[None].clone()
                ref.remap(t)
                ref.observe(layer, z[layer], torch.ones(1, dtype=torch.int32))
            return torch.stack(got)
        ref_step(host_logits[0])
        for r in range(6):
            z = torch.randn(layers, 1, slots, generator=g)
            logits.copy_(z.cuda())
            graph.replay()
            torch.cuda.synchronize()
            want = ref_step(z)
            self.assertTrue(torch.equal(ids.cpu(), want), f"replay {r}")
        st = s.stats()
        self.assertEqual(st[0, 0].item(), 7, "1 eager step + 6 replays (capture ran nothing)")
        s.close()
        ref.close()

    def test_per_step_ops_run_under_torch_compile_fullgraph(self):
        if not hasattr(torch, "compile"):
            self.skipTest("torch without torch.compile")
        layers, slots = 2, 32 * B
        s = spind.Session(layers, slots, topk=64, target_sparsity=0.5, exploration=0.0,
                          device="cuda")
        s.reset_sequence(0, 1)
        dev = torch.device("cuda")
        seq = torch.zeros(1, dtype=torch.int32, device=dev)
        ctx = torch.full((1,), slots, dtype=torch.int32, device=dev)
        q = ctx - 1
        acc = torch.ones(1, dtype=torch.int32, device=dev)

        @torch.compile(fullgraph=True)
        def step(logits, top):
            s.begin_step(seq, ctx, q, 1)
            counts = []
            for layer in range(layers):
                s.select(layer)
                counts.append(s.union_count[:1].clone())
                s.remap(top)
                s.observe(layer, logits * 2.0, acc)
            return torch.cat(counts)

        for t in range(3):
            logits = torch.randn(1, slots, device=dev)
            top = torch.arange(16, dtype=torch.int32, device=dev)[None].clone()
            counts = step(logits, top)
            torch.cuda.synchronize()
            want = 32 if t == 0 else 16  # the fresh sequence's first step is dense
            self.assertEqual(counts.cpu().tolist(), [want] * layers, f"step {t}")
        self.assertEqual(s.stats()[:, 0].tolist(), [3] * layers, "no op was dropped")
        s.close()

    def test_opcheck(self):
        if not hasattr(torch.library, "opcheck"):
            self.skipTest("torch without torch.library.opcheck")
        s = spind.Session(1, 16 * B, topk=64, device="cuda")
        s.reset_sequence(0, 1)
        dev = torch.device("cuda")
        i = lambda v: torch.tensor([v], dtype=torch.int32, device=dev)
        # Each opcheck runs its op several times (a new step each time for begin_step).
        for test in ("test_schema", "test_faketensor"):
            torch.library.opcheck(spind.ops.begin_step.default,
                                  (s.handle, i(0), i(16 * B), i(16 * B - 1), 1, None, s.token),
                                  test_utils=(test,))
            torch.library.opcheck(spind.ops.begin_step.default,
                                  (s.handle, i(0), i(16 * B), i(16 * B - 1), 1,
                                   torch.arange(16, dtype=torch.int32, device=dev)[None],
                                   s.token), test_utils=(test,))
            torch.library.opcheck(spind.ops.select.default,
                                  (s.handle, 0, None, s.union_count, s.union_ids, s.phys,
                                   s.compact_len, s.token), test_utils=(test,))
            torch.library.opcheck(spind.ops.remap.default,
                                  (s.handle, torch.zeros(1, 8, dtype=torch.int32, device=dev),
                                   s.token), test_utils=(test,))
            torch.library.opcheck(spind.ops.remap_topk.default,
                                  (s.handle, torch.zeros(1, 8, dtype=torch.int32, device=dev),
                                   s.token), test_utils=(test,))
            torch.library.opcheck(spind.ops.remap_and_observe.default,
                                  (s.handle, 0, torch.zeros(1, 8, dtype=torch.int32, device=dev),
                                   torch.zeros(1, 16 * B, device=dev), None, s.token),
                                  test_utils=(test,))
            torch.library.opcheck(spind.ops.observe.default,
                                  (s.handle, 0, torch.randn(1, 16 * B, device=dev), None,
                                   s.token), test_utils=(test,))
            # The engine's indexer and top-k ops (python/csrc/indexer_op.cc).
            pages = 4
            torch.library.opcheck(
                spind.ops.paged_indexer.default,
                (torch.randint(0, 120, (2, 64, 128), dtype=torch.uint8, device=dev),
                 torch.rand(2, 64, device=dev),
                 torch.randint(0, 120, (pages, 64 * 132), dtype=torch.uint8, device=dev),
                 torch.arange(pages, dtype=torch.int32, device=dev).view(1, pages),
                 torch.tensor([[200, 201]], dtype=torch.int32, device=dev),
                 torch.zeros(2, pages * 64, device=dev), pages, 2), test_utils=(test,))
            torch.library.opcheck(
                spind.ops.row_topk.default,
                (torch.randn(3, 500, device=dev),
                 torch.tensor([500, 40, 0], dtype=torch.int32, device=dev), 64,
                 torch.zeros(3, 64, dtype=torch.int32, device=dev)), test_utils=(test,))

        s.close()


@unittest.skipUnless(CUDA, "no CUDA device")
class GpuUuid(unittest.TestCase):
    def test_plugin_gpu_uuid_is_nvidia_smis(self):
        # The vLLM plugin's {gpu_uuid} (what spind names its GPU link by) from real torch
        # device properties: one of the UUIDs nvidia-smi lists. The plugin sits beside the
        # package in python/; its vllm imports are vLLM's own files (tests/python/vllm_real).
        import sys
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:0] = [os.path.join(here, "..", "..", "python"), here]
        import vllm_real
        if not vllm_real.available():
            self.skipTest(vllm_real.SKIP_REASON)
        vllm_real.install()
        from spind_vllm.worker import gpu_uuid, resolve_target
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        uuid = gpu_uuid(0)
        self.assertIn(f"(UUID: {uuid})", listed)
        self.assertEqual(resolve_target("unix:///run/spin/{gpu_uuid}.sock", 0),
                         f"unix:///run/spin/{uuid}.sock")


@unittest.skipUnless(CUDA and os.environ.get("SPIND"), "no CUDA device or SPIND unset")
class GpuAttached(unittest.TestCase):
    def test_captured_graph_survives_a_daemon_sigkill_and_restart(self):
        d = tempfile.mkdtemp()
        target = "unix://" + os.path.join(d, "spind.sock")

        def start():
            p = subprocess.Popen([os.environ["SPIND"], "--listen", target, "--backend", "cuda",
                                  "--client-grace-ms", "1000"], stderr=subprocess.DEVNULL)
            return p

        layers, slots = 2, 64 * B
        daemon = start()
        s = spind.Session(layers, slots, topk=128, target_sparsity=0.5, exploration=0.0,
                          device="cuda", target=target)
        deadline = time.monotonic() + 20
        while not s.counters()["attached"] and time.monotonic() < deadline:
            time.sleep(0.05)
            s.refresh()
        self.assertTrue(s.counters()["attached"], "attached to spind")
        # grpcio in the same process, on the same socket, beside the extension's own gRPC.
        channel = grpc.insecure_channel(target)
        grpc.channel_ready_future(channel).result(timeout=5)
        channel.close()
        s.reset_sequence(0, 5)
        dev = torch.device("cuda")
        seq = torch.zeros(1, dtype=torch.int32, device=dev)
        ctx = torch.full((1,), slots, dtype=torch.int32, device=dev)
        q = ctx - 1
        acc = torch.ones(1, dtype=torch.int32, device=dev)
        logits = torch.randn(1, slots, device=dev)
        kept = torch.zeros(layers, dtype=torch.int32, device=dev)

        def step():
            s.begin_step(seq, ctx, q, 1)
            for layer in range(layers):
                s.select(layer)
                kept[layer].copy_(s.union_count[0])
                s.observe(layer, logits, acc)

        graph = capture(step)

        def replay():
            s.refresh()  # between replays: notices a lost daemon, switches sessions
            graph.replay()
            torch.cuda.synchronize()
            return kept.cpu().tolist()

        self.assertEqual(replay(), [32, 32], "SPIN through the daemon")
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        after_kill = [replay() for _ in range(5)]
        self.assertTrue(all(k in ([32, 32], [64, 64]) for k in after_kill), after_kill)
        daemon = start()
        try:
            deadline = time.monotonic() + 20
            got = []
            while time.monotonic() < deadline:
                got.append(replay())
                if s.counters()["attached"] and got[-1] == [32, 32]:
                    break
                time.sleep(0.05)
            self.assertTrue(s.counters()["attached"], "reattached after the restart")
            self.assertEqual(got[-1], [32, 32], "SPIN again, same graph, no recapture")
        finally:
            s.close()
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=20)


if __name__ == "__main__":
    unittest.main()
