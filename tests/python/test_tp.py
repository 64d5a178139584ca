"""Tensor-parallel consistency (docs/vllm.md): the ranks of a TP group each run their own spind
session on their own daemon and must select the same blocks at every step.

Two "ranks" in one process, each attached to its own spind (CPU backend) whose probe thread runs
on its own clock (--probe-interval-ms 3 and 41), fed the same step stream: MTP rows, per-layer
budgets with probe steps (so each daemon recomputes tables when its thread gets to it), and a
policy change that reaches rank 0's daemon at step 12 and rank 1's at step 17, as an operator's
change reaches the daemons of a node one after the other.

- engine_control sessions with rank 0's control adopted by both ranks at every step boundary
  select identically at every step, and the change and the recomputes do take effect;
- the same stream without it diverges (so the comparison can fail).

Run by CTest (label python) with PYTHONPATH=<build>/python and SPIND=<spind binary>."""
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import unittest

import torch

import spind

B = 64            # block size
LAYERS = 3
SLOTS = 48 * B    # max slots per sequence
ROWS = 2          # 1 + one MTP draft
STEPS = 40
REQUESTS = ["req-a", "req-b"]


def key(request_id):
    """A sequence key every rank derives alike: a stable hash, never Python's salted hash()."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


def scores(step, layer, n):
    """The indexer's scores of every logical slot below n at (step, layer): the same on every rank
    (the indexer is replicated). A few heavy regions that move slowly, plus noise."""
    g = torch.Generator().manual_seed(1000 * step + layer)
    slot = torch.arange(n, dtype=torch.float32)
    heavy = torch.zeros(n)
    for c in range(4):
        centre = (layer * 977 + c * 613 + step * 7) % n
        heavy += 3.0 * torch.exp(-((slot - centre) / 90.0) ** 2)
    return heavy + torch.rand(n, generator=g)


class Rank:
    """One rank: a session on its own daemon, and what it selected at every step."""

    def __init__(self, target, engine_control):
        self.s = spind.Session(LAYERS, SLOTS, topk=128, max_sequences=len(REQUESTS),
                               max_rows=ROWS, seed=7, target_sparsity=0.5, exploration=0.1,
                               probe_period=4, budget_mode="per-layer", target=target,
                               engine_control=engine_control)
        self.selections = []

    def step(self, t, ctx):
        s = self.s
        n = len(REQUESTS)
        ctx_t = torch.tensor(ctx, dtype=torch.int32)
        s.begin_step(torch.arange(n, dtype=torch.int32), ctx_t, ctx_t - 1, ROWS)
        picked = []
        width = SLOTS + ROWS
        for layer in range(LAYERS):
            s.select(layer)
            count = s.union_count.tolist()
            ids = s.union_ids
            logits = torch.full((n * ROWS, width), float("-inf"))
            for e in range(n):
                blocks = ids[e, :count[e]].tolist()
                picked.append((layer, e, tuple(blocks)))
                z = scores(t, layer, SLOTS)
                for r in range(ROWS):
                    valid = ctx[e] + r
                    col = 0
                    for j in blocks:
                        lo, hi = j * B, min(j * B + B, valid)
                        if lo < hi:
                            logits[e * ROWS + r, col:col + hi - lo] = z[lo:hi]
                        col += max(0, hi - lo)
            s.observe(layer, logits)
        self.selections.append(picked)


def start_daemon(sock, interval_ms):
    return subprocess.Popen([os.environ["SPIND"], "--listen", "unix://" + sock, "--backend", "cpu",
                             "--probe-interval-ms", str(interval_ms)], stderr=subprocess.DEVNULL)


@unittest.skipUnless(os.environ.get("SPIND"), "SPIND (the spind binary) is not set")
class TensorParallel(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.socks = [os.path.join(self.dir, f"rank{r}.sock") for r in range(2)]
        self.daemons = [start_daemon(self.socks[0], 3), start_daemon(self.socks[1], 41)]

    def tearDown(self):
        for d in self.daemons:
            d.terminate()
            d.wait(timeout=20)
        shutil.rmtree(self.dir, ignore_errors=True)

    def run_group(self, engine_control):
        ranks = [Rank("unix://" + sock, engine_control) for sock in self.socks]
        deadline = time.monotonic() + 15
        while not all(r.s.counters()["attached"] for r in ranks):
            self.assertLess(time.monotonic(), deadline, "both ranks attach to their spind")
            for r in ranks:
                r.s.refresh()
            time.sleep(0.02)
        for r in ranks:
            for slot, req in enumerate(REQUESTS):
                r.s.reset_sequence(slot, key(req))
        ctx = [20 * B + 5, 30 * B + 17]
        adopted = None
        versions = set()
        for t in range(STEPS):
            if t == 12:
                ranks[0].s.set_policy(target_sparsity=0.75)
            if t == 17:
                ranks[1].s.set_policy(target_sparsity=0.75)
            if engine_control:
                # The step boundary: rank 0's control, adopted by every rank when it changed
                # (the plugin broadcasts it over the TP group).
                c = ranks[0].s.control()
                versions.add(int(c[0]))
                if adopted is None or not torch.equal(c[2:], adopted[2:]):
                    for r in ranks:
                        r.s.adopt_control(c)
                    adopted = c
            for r in ranks:
                r.s.refresh()
                r.step(t, ctx)
            ctx = [c + 1 + (t % 2) for c in ctx]  # one draft accepted every other step
            time.sleep(0.02)  # the daemons' probe threads run between steps
        return ranks, adopted, versions

    def test_engine_switched_control_keeps_ranks_identical(self):
        ranks, adopted, versions = self.run_group(engine_control=True)
        for t in range(STEPS):
            self.assertEqual(ranks[0].selections[t], ranks[1].selections[t], f"step {t}")
        self.assertEqual(float(adopted[2]), 0.75, "the policy change was adopted")
        self.assertEqual(ranks[1].s.policy()["target_sparsity"], 0.75)
        # Rank 0's daemon recomputed per-layer tables besides the policy change.
        self.assertGreater(len(versions), 2, f"control versions seen: {sorted(versions)}")
        kept = [sum(len(b) for (_, _, b) in ranks[0].selections[t]) for t in (10, STEPS - 2)]
        self.assertLess(kept[1], kept[0], "fewer blocks after the change to 0.75")
        for r in ranks:
            r.s.close()

    def test_without_it_ranks_diverge(self):
        ranks, _, _ = self.run_group(engine_control=False)
        differ = [t for t in range(STEPS) if ranks[0].selections[t] != ranks[1].selections[t]]
        self.assertTrue(differ, "each daemon applying changes on its own clock diverges")
        for r in ranks:
            r.s.close()

    def test_bad_control_is_refused_and_changes_nothing(self):
        s = spind.Session(LAYERS, SLOTS, topk=128, target_sparsity=0.5)
        before = s.control()
        bad = before.clone()
        bad[2] = 1.5
        with self.assertRaisesRegex(RuntimeError, "adopt_control: target sparsity 1.5 is out of range"):
            s.adopt_control(bad)
        bad = before.clone()
        bad[7] = float("nan")
        with self.assertRaisesRegex(RuntimeError, "adopt_control"):
            s.adopt_control(bad)
        with self.assertRaisesRegex(RuntimeError, "adopt_control: control must be"):
            s.adopt_control(before[:-1])
        with self.assertRaisesRegex(RuntimeError, "adopt_control: control must be"):
            s.adopt_control(before.float())
        self.assertTrue(torch.equal(s.control()[2:], before[2:]), "nothing changed")
        s.close()


if __name__ == "__main__":
    unittest.main()
