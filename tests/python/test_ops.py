"""The spind torch ops on the CPU backend: a local session's step, every bad input refused with
its reason and nothing changed, the fail-open attach (dense without a daemon, SPIN with one),
and gRPC/protobuf's Python modules loaded in the same process first.
Run by CTest (label python) with PYTHONPATH=<build>/python and SPIND=<spind binary>."""
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


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


def run_step(s, ctx, layers, logits_fill=1.0):
    """One step of sequence 0 over every layer; returns each layer's kept block count."""
    s.begin_step(i32(0), i32(ctx), i32(ctx - 1), 1)
    kept = []
    width = s.union_ids.shape[1] * B
    for layer in range(layers):
        s.select(layer)
        kept.append(int(s.union_count[0]))
        logits = torch.full((1, width), float("-inf"))
        logits[0, : int(s.compact_len[0, 0])] = logits_fill
        s.observe(layer, logits, i32(1))
    s.refresh()
    return kept


def probe_session():
    """One layer, probe period 2, no exploration."""
    return spind.Session(1, 32 * B, topk=64, target_sparsity=0.5, exploration=0.0,
                         probe_period=2)


def begin_probe_step(s):
    """Sequence 0 through two steps, then step 2 (a probe step, the pair no longer fresh) begun
    and layer 0 selected; returns an engine top-K of 40 valid slots (dense row: compacted =
    logical) padded to 64 with -1."""
    s.reset_sequence(0, 1)
    run_step(s, 32 * B, 1)
    run_step(s, 32 * B, 1)
    s.begin_step(i32(0), i32(32 * B), i32(32 * B - 1), 1)
    s.select(0)
    topk = torch.full((1, 64), -1, dtype=torch.int32)
    topk[0, :40] = torch.arange(40, dtype=torch.int32) * 37
    return topk


class LocalSession(unittest.TestCase):
    def test_a_step_selects_the_budget(self):
        with spind.Session(2, 32 * B, topk=64, target_sparsity=0.5, exploration=0.0) as s:
            s.reset_sequence(0, 7)
            self.assertEqual(run_step(s, 32 * B, 2), [32, 32], "a fresh sequence is dense")
            kept = run_step(s, 32 * B, 2)
            self.assertEqual(kept, [16, 16])
            ids = s.union_ids[0, :16].tolist()
            self.assertEqual(ids, sorted(ids))
            stats = s.stats()
            self.assertEqual(stats.shape, (2, 14))
            self.assertEqual(stats[:, 0].tolist(), [2, 2])  # steps
            self.assertEqual(stats[:, 1].tolist(), [1, 1])  # dense steps

    def test_defer_ema_is_accepted_and_changes_nothing_on_the_cpu(self):
        # A CUDA data plane option (its EMA beside the next layer): the CPU backend observes
        # synchronously, so a session asking for it selects and counts as any other.
        got = []
        for defer in (False, True):
            with spind.Session(2, 32 * B, topk=64, target_sparsity=0.5, exploration=0.0,
                               defer_ema=defer) as s:
                s.reset_sequence(0, 7)
                kept = [run_step(s, 32 * B, 2) for _ in range(3)]
                got.append((kept, s.union_ids.clone(), s.stats().clone()))
        self.assertEqual(got[0][0], got[1][0])
        self.assertTrue(torch.equal(got[0][1], got[1][1]))
        self.assertTrue(torch.equal(got[0][2], got[1][2]))

    def test_remap_maps_compacted_slots_to_logical_ones(self):
        with spind.Session(1, 32 * B, topk=64, target_sparsity=0.5, exploration=0.0) as s:
            s.reset_sequence(0, 1)
            run_step(s, 32 * B, 1)
            s.begin_step(i32(0), i32(32 * B), i32(32 * B - 1), 1)
            s.select(0)
            ids = s.union_ids[0, : int(s.union_count[0])].tolist()
            topk = torch.tensor([[0, B + 3, -1, 10**6]], dtype=torch.int32)
            s.remap(topk)
            self.assertEqual(topk.tolist(), [[ids[0] * B, ids[1] * B + 3, -1, -1]])

    def test_remap_with_the_engine_topk_gives_the_probe_its_top_k(self):
        # Probe period 2: step 2 probes (step 0 was fresh). With engine_topk the curve counts
        # the remapped row (40 valid slots), and observe computes no top-K of its own.
        for engine_topk, want_topk in ((True, 40), (False, 64)):
            with self.subTest(engine_topk=engine_topk):
                with probe_session() as s:
                    topk = begin_probe_step(s)
                    self.assertEqual(int(s.union_count[0]), 32, "a probe step is dense")
                    s.remap(topk, engine_topk=engine_topk)
                    self.assertEqual(topk[0, :40].tolist(), [i * 37 for i in range(40)])
                    s.refresh()
                    self.assertEqual(int(s.stats()[0, 2]), 1 if engine_topk else 0)
                    logits = torch.full((1, 32 * B), 1.0)
                    s.observe(0, logits, i32(1))
                    s.refresh()
                    stats = s.stats()
                    self.assertEqual(int(stats[0, 2]), 1)  # probe steps
                    self.assertEqual(int(stats[0, 9]), want_topk)  # top-K slots counted

    def test_remap_and_observe_is_remap_then_observe(self):
        # Two sessions through a probe step: remap(engine_topk=True) + observe on one,
        # remap_and_observe on the other; the same indices and counters. A refused call (logits
        # too narrow for the dense probing row) changes nothing, the top-K buffer included.
        got = []
        for joint in (False, True):
            with probe_session() as s:
                topk = begin_probe_step(s)
                logits = torch.arange(32 * B, dtype=torch.float32)[None]
                if joint:
                    before = s.stats().clone()
                    with self.assertRaisesRegex(RuntimeError, "logits stride"):
                        s.remap_and_observe(0, topk, torch.zeros(1, 100))
                    self.assertEqual(topk[0, :3].tolist(), [0, 37, 74])
                    s.refresh()
                    self.assertTrue(torch.equal(s.stats(), before))
                    s.remap_and_observe(0, topk, logits)
                else:
                    s.remap(topk, engine_topk=True)
                    s.observe(0, logits)
                s.refresh()
                got.append((topk.clone(), s.stats().clone()))
        self.assertTrue(torch.equal(got[0][0], got[1][0]))
        self.assertTrue(torch.equal(got[0][1], got[1][1]))
        self.assertEqual(int(got[1][1][0, 9]), 40)  # the given top-K was counted

    def test_tensors_shorter_than_the_step_are_refused(self):
        # A step of two entries: a top-K with rows for one entry, or accepted counts for one, are
        # refused before the data plane runs (it writes every top-K row of the step, and on the
        # GPU reads every entry's accepted count).
        with spind.Session(1, 32 * B, max_sequences=2, topk=64, exploration=0.0) as s:
            for seq in (0, 1):
                s.reset_sequence(seq, seq + 1)
            s.begin_step(i32(0, 1), i32(32 * B, 32 * B), i32(32 * B - 1, 32 * B - 1), 1)
            s.select(0)
            short = torch.zeros((1, 64), dtype=torch.int32)
            logits = torch.zeros((2, 32 * B))
            for call in (lambda: s.remap(short), lambda: s.remap(short, engine_topk=True),
                         lambda: s.remap_and_observe(0, short, logits)):
                with self.assertRaisesRegex(RuntimeError, "topk has 1 rows; the step has 2"):
                    call()
            with self.assertRaisesRegex(RuntimeError, "accepted has 1 elements"):
                s.observe(0, logits, i32(1))
            s.refresh()
            self.assertEqual(int(s.stats()[0, 7]), 0, "nothing observed")
            s.observe(0, logits, i32(1, 1))
            s.refresh()
            self.assertEqual(int(s.stats()[0, 7]), 2 * 32 * B)

    def test_select_maps_the_engine_block_table_to_the_compacted_one(self):
        with spind.Session(1, 32 * B, topk=64, target_sparsity=0.5, exploration=0.0) as s:
            s.reset_sequence(0, 1)
            run_step(s, 32 * B, 1)
            s.begin_step(i32(0), i32(32 * B), i32(32 * B - 1), 1)
            table = (torch.arange(32, dtype=torch.int32) * 7 + 100)[None]  # physical blocks
            s.select(0, table)
            n = int(s.union_count[0])
            ids = s.union_ids[0, :n].long()
            self.assertEqual(n, 16)
            self.assertTrue(torch.equal(s.phys[0, :n], table[0, ids]))
            self.assertEqual(int(s.compact_len[0, 0]), n * B)

    def test_the_block_table_given_at_begin_step_serves_every_select(self):
        # begin_step(..., block_table): a select without a table uses it (the same compacted
        # table as given to select); a table narrower than the session's blocks is refused at
        # begin_step with its reason, and the step is not begun.
        with spind.Session(2, 32 * B, topk=64, target_sparsity=0.5, exploration=0.0) as s:
            s.reset_sequence(0, 1)
            run_step(s, 32 * B, 2)
            table = (torch.arange(32, dtype=torch.int32) * 7 + 100)[None]
            with self.assertRaisesRegex(RuntimeError, "block table stride 31"):
                s.begin_step(i32(0), i32(32 * B), i32(32 * B - 1), 1, table[:, :31].contiguous())
            with self.assertRaisesRegex(RuntimeError, "block_table must be"):
                s.begin_step(i32(0), i32(32 * B), i32(32 * B - 1), 1, table[0])
            with self.assertRaisesRegex(RuntimeError, "without its Select|Select of the current"):
                s.observe(0, torch.zeros(1, 32 * B))  # no step was begun by the refused calls
            s.begin_step(i32(0), i32(32 * B), i32(32 * B - 1), 1, table)
            for layer in range(2):
                s.select(layer)
                n = int(s.union_count[0])
                self.assertEqual(n, 16)
                ids = s.union_ids[0, :n].long()
                self.assertTrue(torch.equal(s.phys[0, :n], table[0, ids]))
                s.observe(layer, torch.zeros(1, 32 * B))

    def test_miss_target_mode(self):
        with spind.Session(2, 32 * B, topk=64, budget_mode="miss-target", miss_target=0.02,
                           probe_period=4) as s:
            p = s.policy()
            self.assertEqual(p["budget_mode"], "miss-target")
            self.assertAlmostEqual(p["miss_target"], 0.02)
            s.reset_sequence(0, 1)
            self.assertEqual(run_step(s, 32 * B, 2), [32, 32], "fresh: dense")
            s.refresh()
            s.set_policy(target_sparsity=0.6)  # the miss target stays
            self.assertAlmostEqual(s.policy()["miss_target"], 0.02)
            s.set_policy(miss_target=0.05)
            self.assertAlmostEqual(s.policy()["miss_target"], 0.05)
            with self.assertRaisesRegex(RuntimeError, "miss target 1.5 is out of range"):
                s.set_policy(miss_target=1.5)
            self.assertAlmostEqual(s.policy()["miss_target"], 0.05)
        with self.assertRaisesRegex(RuntimeError, "miss-target budget mode needs a miss target"):
            spind.Session(2, 32 * B, topk=64, budget_mode="miss-target")

    def test_budget_modes_cross_as_text(self):
        # The names come from the C++ codec (spin::BudgetModeName), in its order.
        self.assertEqual(spind.BUDGET_MODES, ("uniform", "per-layer", "miss-target"))
        with spind.Session(2, 32 * B, topk=64, miss_target=0.02, probe_period=4) as s:
            for mode in spind.BUDGET_MODES:
                s.set_policy(budget_mode=mode)
                self.assertEqual(s.policy()["budget_mode"], mode)
            with self.assertRaisesRegex(RuntimeError, "budget mode 'dense': use uniform, "
                                                      "per-layer or miss-target"):
                s.set_policy(budget_mode="dense")
            self.assertEqual(s.policy()["budget_mode"], "miss-target")
            self.assertEqual(s.policy()["probe_period"], 4)
        # attach takes its arguments by name only.
        with self.assertRaises((RuntimeError, TypeError)):
            spind.ops.attach("", 1, 32 * B, 64, 64, 1, 1, "fp32", 1, 0.5, 0.05, 0.3, 0, "uniform",
                             0.0, "python")

    def test_policy_changes_apply_at_the_next_step(self):
        with spind.Session(1, 32 * B, topk=64, target_sparsity=0.5, exploration=0.0) as s:
            s.reset_sequence(0, 1)
            run_step(s, 32 * B, 1)
            s.set_policy(target_sparsity=0.75)
            self.assertEqual(s.policy()["target_sparsity"], 0.75)
            self.assertEqual(run_step(s, 32 * B, 1), [8])
            with self.assertRaisesRegex(RuntimeError, "exploration"):
                s.set_policy(exploration=1.5)
            self.assertEqual(s.policy()["exploration"], 0.0, "a refused change changes nothing")

    def test_bad_inputs_are_refused_and_change_nothing(self):
        with spind.Session(2, 32 * B, topk=64, exploration=0.0) as s:
            s.reset_sequence(0, 1)
            before = s.stats().clone()
            bad = [
                (lambda: s.begin_step(i32(5), i32(100), i32(99), 1), "sequence"),
                (lambda: s.begin_step(torch.tensor([0]), i32(100), i32(99), 1), "int32"),
                (lambda: s.begin_step(i32(0), i32(10**6), i32(99), 1), "ctx_len"),
                (lambda: s.reset_sequence(3, 1), "outside"),
            ]
            for call, why in bad:
                with self.subTest(why=why):
                    with self.assertRaisesRegex(RuntimeError, why):
                        call()
            self.assertTrue(torch.equal(s.stats(), before))
            s.begin_step(i32(0), i32(100), i32(99), 1)
            with self.assertRaisesRegex(RuntimeError, "layer 7 outside"):
                s.select(7)
            with self.assertRaisesRegex(RuntimeError, "union_count must be a contiguous int32"):
                spind.ops.select(s.handle, 0, None, torch.zeros(2, dtype=torch.int32),
                                 s.union_ids, s.phys, s.compact_len, s.token)
            # Other tensors of the right shapes (torch.compile passes copies): filled the same.
            outs = [torch.full_like(t, -7) for t in (s.union_count, s.union_ids, s.phys,
                                                     s.compact_len)]
            spind.ops.select(s.handle, 1, None, *outs, s.token)
            for got, arena in zip(outs, (s.union_count, s.union_ids, s.phys, s.compact_len)):
                self.assertTrue(torch.equal(got, arena))
            self.assertEqual(int(outs[0][0]), 2, "100 slots: 2 blocks, dense")
            s.select(0)
            with self.assertRaisesRegex(RuntimeError, "float32"):
                s.observe(0, torch.zeros(1, 4 * B, dtype=torch.float64))
            with self.assertRaisesRegex(RuntimeError, "stride|covers|width"):
                s.observe(0, torch.zeros(1, 1))
            nan = torch.full((1, 2 * B), float("nan"))
            s.observe(0, nan)  # non-finite scores are skipped and counted, not an error
            self.assertEqual(int(s.stats()[0, 8]), 100)  # bad_scores
        with self.assertRaisesRegex(RuntimeError, "no session with handle"):
            spind.ops.reset_sequence(s.handle or 12345, 0, 1)
        with self.assertRaisesRegex(RuntimeError, "geometry|layers"):
            spind.Session(0, 32 * B)
        with self.assertRaisesRegex(RuntimeError, "target_sparsity|sparsity"):
            spind.Session(1, 32 * B, target_sparsity=1.0)
        with self.assertRaisesRegex(ValueError, "state"):
            spind.Session(1, 32 * B, state="fp8")


@unittest.skipUnless(os.environ.get("SPIND"), "SPIND (the spind binary) is not set")
class AttachedSession(unittest.TestCase):
    def test_dense_without_a_daemon_then_spin_once_it_is_there(self):
        d = tempfile.mkdtemp()
        sock = os.path.join(d, "spind.sock")
        target = "unix://" + sock
        # grpcio in the same process, on the same socket: the extension's own gRPC must not
        # clash with it.
        channel = grpc.insecure_channel(target)
        with spind.Session(1, 32 * B, topk=64, target_sparsity=0.5, exploration=0.0,
                           target=target) as s:
            self.assertFalse(s.counters()["attached"])
            s.reset_sequence(0, 1)
            self.assertEqual(run_step(s, 32 * B, 1), [32])
            self.assertEqual(run_step(s, 32 * B, 1), [32], "no daemon: dense")
            daemon = subprocess.Popen([os.environ["SPIND"], "--listen", target, "--backend", "cpu"],
                                      stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 15
                while not s.counters()["attached"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                    run_step(s, 32 * B, 1)
                self.assertTrue(s.counters()["attached"], "attached once spind is up")
                grpc.channel_ready_future(channel).result(timeout=5)
                run_step(s, 32 * B, 1)  # the reopened sequence's first step is dense
                self.assertEqual(run_step(s, 32 * B, 1), [16], "SPIN through the daemon")
            finally:
                daemon.send_signal(signal.SIGTERM)
                daemon.wait(timeout=20)
        channel.close()


if __name__ == "__main__":
    unittest.main()
