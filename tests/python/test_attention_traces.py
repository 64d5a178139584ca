"""bench/attention-traces (docs/lab/attention-traces.md): a tiny CPU run end to end (trace
format, constraints, statistics, log and summary, determinism), the statistics against
spinctl trace-stats, and the model's pieces. The torch parts skip without torch; the
spinctl parts skip without a spinctl ($SPINCTL or build/tools/spinctl/spinctl)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import unittest

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "bench", "attention-traces")
sys.path.insert(0, os.path.join(REPO, "bench"))

import attention_traces_lib as lib  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def find_spinctl():
    p = os.environ.get("SPINCTL") or os.path.join(REPO, "build", "tools", "spinctl", "spinctl")
    return p if os.path.isfile(p) and os.access(p, os.X_OK) else None


def stdlib_dir():
    return sysconfig.get_paths()["stdlib"]


TINY = ["--device", "cpu", "--context", "1024", "--steps", "64", "--layers", "2", "--dim", "32",
        "--heads", "2", "--train-context", "128", "--batch-tokens", "512", "--train-steps", "4",
        "--long-fraction", "0.25", "--docs", "2", "--corpus-mb", "1", "--threads", "1",
        "--quiet"]


class StatsTest(unittest.TestCase):
    def test_topk_ties_and_nonfinite(self):
        s = np.array([1.0, 3.0, np.nan, 3.0, np.inf, 2.0, 3.0], dtype=np.float32)
        # inf is not finite (excluded); the three 3.0 tie: lower ids win.
        self.assertEqual(lib.topk_slots(s, 2).tolist(), [1, 3])
        self.assertEqual(lib.topk_slots(s, 4).tolist(), [1, 3, 5, 6])
        self.assertEqual(lib.topk_slots(s, 10).tolist(), [0, 1, 3, 5, 6])

    def test_pearson(self):
        a = np.arange(10, dtype=np.float32)
        self.assertAlmostEqual(lib.pearson(a, 2 * a + 1), 1.0)
        self.assertAlmostEqual(lib.pearson(a, -a), -1.0)
        self.assertTrue(math.isnan(lib.pearson(a, np.ones(10, dtype=np.float32))))

    def test_identical_steps(self):
        rng = np.random.default_rng(3)
        one = rng.standard_normal((1, 2, 500)).astype(np.float32)
        scores = np.repeat(one, 5, axis=0)
        st = lib.trace_stats(scores, [500] * 5, 50, 64)
        self.assertAlmostEqual(st["prev_iter_pearson"], 1.0)
        self.assertAlmostEqual(st["prev_iter_recall"], 1.0)

    @unittest.skipUnless(find_spinctl(), "no spinctl ($SPINCTL or build/tools/spinctl/spinctl)")
    def test_stats_match_spinctl(self):
        spinctl = find_spinctl()
        with tempfile.TemporaryDirectory() as tmp:
            d = os.path.join(tmp, "gt")
            subprocess.run([spinctl, "gen-trace", d, "--layers", "3", "--slots", "3000",
                            "--steps", "20", "--topk", "200", "--nonfinite-rate", "0.01",
                            "--seed", "5"], check=True, capture_output=True)
            meta, scores = lib.check_trace(d)
            mine = lib.trace_stats(np.asarray(scores[:, :, 0, :]), meta["ctx_len"],
                                   meta["topk"], meta["block_size"])
            theirs = lib.spinctl_checks(spinctl, d, [])
            self.assertNotIn("error", theirs)
            ts = theirs["trace_stats"]
            self.assertAlmostEqual(mine["prev_iter_pearson"], ts["prev_iter_pearson"], places=5)
            self.assertAlmostEqual(mine["prev_iter_recall"], ts["prev_iter_recall"], places=5)

    def test_write_and_check_trace(self):
        q, c = lib.decode_positions(300, 10)
        self.assertEqual(q[0], 290)
        self.assertEqual(c[-1], 300)
        with tempfile.TemporaryDirectory() as tmp:
            lib.write_trace(tmp, np.zeros((10, 3, 300), np.float32), q, c, 64, 20)
            meta, scores = lib.check_trace(tmp)
            self.assertEqual(scores.shape, (10, 3, 1, 300))
            self.assertEqual(meta["rows"], 1)


class CommittedTracesTest(unittest.TestCase):
    """bench/traces/attn-cpu-*: valid traces whose statistics are the ones summary.json and
    docs/lab/attention-traces.md state."""

    def test_committed_traces(self):
        base = os.path.join(REPO, "bench", "traces")
        runs = sorted(d for d in os.listdir(base) if d.startswith("attn-cpu-"))
        self.assertTrue(runs)
        for run in runs:
            with open(os.path.join(base, run, "summary.json")) as f:
                summary = json.load(f)
            for tr in summary["traces"]:
                meta, scores = lib.check_trace(os.path.join(base, run, tr["dir"]))
                st = lib.trace_stats(np.asarray(scores[:, :, 0, :]), meta["ctx_len"],
                                     meta["topk"], meta["block_size"])
                want = tr["stats"][summary["score"]]
                self.assertAlmostEqual(st["prev_iter_pearson"], want["prev_iter_pearson"], 9)
                self.assertAlmostEqual(st["prev_iter_recall"], want["prev_iter_recall"], 9)


@unittest.skipUnless(HAVE_TORCH, "torch is not importable")
class ModelTest(unittest.TestCase):
    def test_chunked_attention_is_exact(self):
        import torch
        _, have_sdpa, chunked = lib.build_model_class()
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 3, 700, 16, dtype=torch.float64) for _ in range(3))
        got = chunked(q, k, v, chunk=128)
        s = (q @ k.transpose(-1, -2)) / 4.0
        s = s.masked_fill(torch.ones(700, 700, dtype=torch.bool).triu(1), float("-inf"))
        want = torch.softmax(s, -1) @ v
        self.assertLess(float((got - want).abs().max()), 1e-9)
        if have_sdpa:
            import torch.nn.functional as F
            sd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            self.assertLess(float((got - sd).abs().max()), 1e-9)

    def test_conv_linear_matches_linear(self):
        import torch
        a, _, _ = lib.build_model_class(conv_linear=False)
        b, _, _ = lib.build_model_class(conv_linear=True)
        torch.manual_seed(0)
        m1 = a(2, 32, 2, 4, 10000.0)
        m2 = b(2, 32, 2, 4, 10000.0)
        m2.load_state_dict(m1.state_dict())
        x = torch.randint(0, 256, (2, 100))
        with torch.no_grad():
            self.assertLess(float((m1(x)[0] - m2(x)[0]).abs().max()), 1e-4)

    def test_captured_scores(self):
        import torch
        model_cls, _, _ = lib.build_model_class()
        torch.manual_seed(0)
        m = model_cls(2, 32, 4, 2, 10000.0).eval()
        x = torch.randint(0, 256, (1, 200))
        with torch.no_grad():
            _, cap = m(x, capture_steps=8)
        self.assertEqual(len(cap), 2)
        for layer in cap:
            la, mx, mean = layer["log-attn"], layer["logit-max"], layer["logit-mean"]
            self.assertEqual(tuple(la.shape), (8, 200))
            for t in range(8):
                ctx = 200 - 8 + t + 1
                # The head-averaged attention weights of a query sum to one over its context.
                self.assertAlmostEqual(float(torch.logsumexp(la[t, :ctx], 0)), 0.0, places=4)
                self.assertTrue(bool((mx[t, :ctx] >= mean[t, :ctx] - 1e-5).all()))
                self.assertTrue(bool((la[t, ctx:] == 0).all()))


@unittest.skipUnless(HAVE_TORCH, "torch is not importable")
class ScriptTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.out = os.path.join(cls.tmp.name, "a")
        cls.model = os.path.join(cls.tmp.name, "model.npz")
        cls.run_script(cls.out, ["--save-model", cls.model])

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @staticmethod
    def run_script(out, extra=()):
        cmd = [sys.executable, SCRIPT] + TINY + ["--corpus", stdlib_dir(), "--out", out]
        cmd += list(extra)
        if not find_spinctl():
            cmd += ["--spinctl", "none"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, SPINCTL=find_spinctl() or ""))
        if r.returncode != 0:
            raise AssertionError("%s failed (rc %d):\n%s" % (" ".join(cmd), r.returncode,
                                                             r.stderr[-4000:]))
        return r

    def test_trace_format(self):
        for name in ("doc0", "doc1"):
            d = os.path.join(self.out, name)
            with open(os.path.join(d, "meta.json")) as f:
                meta = json.load(f)
            for key in ("version", "layers", "block_size", "topk", "steps", "rows", "q_pos",
                        "ctx_len"):
                self.assertIn(key, meta)
            self.assertEqual((meta["version"], meta["layers"], meta["steps"], meta["rows"]),
                             (1, 2, 64, 1))
            self.assertEqual(meta["topk"], 1024 // 16)
            scores = np.load(os.path.join(d, "scores.npy"), mmap_mode="r")
            self.assertEqual(scores.dtype.str, "<f4")
            self.assertTrue(scores.flags.c_contiguous)
            self.assertEqual(scores.shape, (64, 2, 1, 1024))
            q, c = meta["q_pos"], meta["ctx_len"]
            self.assertEqual(len(q), 64)
            self.assertTrue(all(b > a for a, b in zip(q, q[1:])))
            self.assertTrue(all(1 <= x <= 1024 for x in c))
            self.assertEqual((q[-1], c[-1]), (1023, 1024))
            self.assertTrue(np.isfinite(np.asarray(scores)).all())
            lib.check_trace(d)

    def test_summary_and_log(self):
        with open(os.path.join(self.out, "summary.json")) as f:
            s = json.load(f)
        self.assertEqual(len(s["traces"]), 2)
        self.assertGreater(s["model"]["parameters"], 0)
        for tr in s["traces"]:
            for kind in lib.SCORE_KINDS:
                st = tr["stats"][kind]
                self.assertTrue(-1.0 <= st["prev_iter_pearson"] <= 1.0)
                self.assertTrue(0.0 <= st["prev_iter_recall"] <= 1.0)
            if "spinctl" in tr:
                self.assertNotIn("error", tr["spinctl"])
                self.assertTrue(tr["spinctl"]["stats_agree"])
        self.assertEqual(s["spinctl_failures"], [])
        with open(os.path.join(self.out, "log.txt")) as f:
            log = f.read()
        for needle in ("command:", "device:", "torch:", "model:", "parameters", "corpus:",
                       "held-out rule:", "context:", "wall time per phase:"):
            self.assertIn(needle, log)

    def test_deterministic(self):
        out2 = os.path.join(self.tmp.name, "b")
        self.run_script(out2)
        for name in ("doc0", "doc1"):
            with open(os.path.join(self.out, name, "scores.npy"), "rb") as f:
                a = f.read()
            with open(os.path.join(out2, name, "scores.npy"), "rb") as f:
                b = f.read()
            self.assertEqual(a, b, name)

    def test_saved_model_rebuilds_the_traces(self):
        # The saved model (float16 weights) gives the trained model's traces up to that rounding,
        # the same bytes on every load, and --skip-docs picks the later held-out documents.
        outs = []
        for name in ("load1", "load2"):
            out = os.path.join(self.tmp.name, name)
            r = self.run_script(out, ["--load-model", self.model, "--skip-docs", "1", "--docs", "1",
                                      "--layers", "5"])
            outs.append(out)
            self.assertFalse(os.path.exists(os.path.join(out, "doc0")))
            with open(os.path.join(out, "summary.json")) as f:
                s = json.load(f)
            self.assertEqual([t["name"] for t in s["traces"]], ["doc1"])
            self.assertEqual(s["model"]["layers"], 2)  # the file's sizes, not --layers
            self.assertEqual(s["training"]["loaded_from"], os.path.abspath(self.model))
            self.assertEqual(s["training"]["steps"], 4)
            self.assertNotIn("training for", r.stderr)
        with open(os.path.join(outs[0], "doc1", "scores.npy"), "rb") as f:
            a = f.read()
        with open(os.path.join(outs[1], "doc1", "scores.npy"), "rb") as f:
            self.assertEqual(a, f.read())
        trained = np.load(os.path.join(self.out, "doc1", "scores.npy"))
        loaded = np.load(os.path.join(outs[0], "doc1", "scores.npy"))
        self.assertEqual(trained.shape, loaded.shape)
        self.assertLess(float(np.abs(trained - loaded).max()), 0.05)
        self.assertFalse(np.array_equal(trained, loaded))  # the weights were rounded: not a copy

    def test_bad_model_files(self):
        with tempfile.TemporaryDirectory() as tmp:
            junk = os.path.join(tmp, "junk.npz")
            with open(junk, "wb") as f:
                f.write(b"not a model")
            other = os.path.join(tmp, "other.npz")
            np.savez(other, meta=np.frombuffer(b'{"format": "x"}', dtype=np.uint8))
            for path, needle in ((junk, "cannot read the model file"),
                                 (other, "is not a model of this script"),
                                 (os.path.join(tmp, "missing.npz"), "cannot read the model file")):
                cmd = [sys.executable, SCRIPT] + TINY + ["--corpus", stdlib_dir(), "--out",
                                                         os.path.join(tmp, "o"), "--load-model",
                                                         path, "--spinctl", "none"]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn(needle, r.stderr)
                self.assertIn("--save-model", r.stderr)
            cmd = [sys.executable, SCRIPT] + TINY + ["--out", os.path.join(tmp, "o"),
                                                     "--load-model", junk, "--save-model", junk]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 2)
            self.assertIn("exclude each other", r.stderr)

    def test_corpus_too_small(self):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "x.txt"), "w") as f:
                f.write("hello\n" * 100)
            cmd = [sys.executable, SCRIPT] + TINY + ["--corpus", tmp, "--out",
                                                     os.path.join(tmp, "o")]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 2)
            self.assertIn("corpus too small", r.stderr)
            self.assertIn("pass --corpus", r.stderr)


if __name__ == "__main__":
    unittest.main()
