"""Real attention traces for spind: train a small byte-level decoder-only transformer on text
that the machine's Debian packages ship, run it over held-out long documents, and write each
document's last decode steps as a replay trace (docs/replay.md "Trace format").

Used by bench/attention-traces (the command line) and tests/python/test_attention_traces.py.
docs/lab/attention-traces.md describes the method, the score definition and the commands.

torch is imported lazily (inside the functions that need it) so that the statistics and the
trace writer can be used, and the command line can print --help, without torch.
"""

import argparse
import contextlib
import gzip
import hashlib
import json
import math
import os
import platform
import shlex
import stat
import subprocess
import sys
import sysconfig
import time

import numpy as np

PAPER_PEARSON = (0.85, 0.91)  # prev-iter Pearson of real models (paper, Table 1)
PAPER_RECALL = (0.58, 0.82)   # prev-iter top-K recall of real models (paper, Table 1)
SCORE_KINDS = ("log-attn", "logit-max", "logit-mean")
PROGRESS_SECONDS = 10.0

# File name endings that are never text (checked before reading, to save time; a NUL byte in
# the content excludes binary files anyway).
BINARY_SUFFIXES = (
    ".so", ".a", ".o", ".pyc", ".pyo", ".png", ".jpg", ".jpeg", ".gif", ".ico", ".bmp", ".svgz",
    ".zip", ".whl", ".egg", ".jar", ".bz2", ".xz", ".lzma", ".zst", ".7z", ".tgz", ".mo", ".db",
    ".sqlite", ".npy", ".npz", ".pkl", ".pickle", ".ttf", ".otf", ".woff", ".woff2", ".pdf",
    ".bin", ".dat", ".wav", ".mp3", ".ogg", ".exe", ".dll", ".class", ".pyd", ".gpg", ".pem.gz",
)


# ----------------------------------------------------------------------------------------------
# Reporting: progress on stderr, a log kept for DIR/log.txt.


class Reporter:
    """Prints timestamped lines to stderr and keeps them for log.txt."""

    def __init__(self, quiet=False, live_log=None):
        self.start = time.time()
        self.lines = []
        self.quiet = quiet
        self.phases = []  # (name, seconds)
        # Lines are also appended to live_log as they come, so that a run killed at a time
        # limit leaves its progress behind; the finished run rewrites the file whole.
        self.live_log = live_log

    def _keep(self, line):
        self.lines.append(line)
        if self.live_log:
            with open(self.live_log, "a") as f:
                f.write(line + "\n")

    def say(self, msg):
        line = "[%7.1fs] %s" % (time.time() - self.start, msg)
        self._keep(line)
        if not self.quiet:
            print("attention-traces: " + line, file=sys.stderr, flush=True)

    def note(self, msg):
        """A log line that is not printed (details for log.txt)."""
        self._keep("          " + msg)

    def phase_done(self, name, seconds):
        self.phases.append((name, seconds))
        self.say("phase %s: %.1f s" % (name, seconds))


class Ticker:
    """True at most every PROGRESS_SECONDS (and never on the first call)."""

    def __init__(self, period=PROGRESS_SECONDS):
        self.period = period
        self.last = time.time()

    def due(self):
        now = time.time()
        if now - self.last >= self.period:
            self.last = now
            return True
        return False


class UserError(Exception):
    """A precise, user-facing error: printed as one line, exit status 2."""


# ----------------------------------------------------------------------------------------------
# Corpus: text files under the corpus roots, grouped by directory; whole directories held out.


def default_corpus_roots():
    """Trees of text that Debian packages ship, plus the running interpreter's standard
    library (present wherever this script runs). Only the ones that exist."""
    candidates = [
        sysconfig.get_paths().get("stdlib", ""),
        "/usr/include",
        "/usr/share/doc",
        "/usr/share/perl",
        "/usr/share/perl5",
        "/usr/lib/python3/dist-packages",
    ]
    roots, seen = [], set()
    for c in candidates:
        if c and os.path.isdir(c):
            real = os.path.realpath(c)
            if real not in seen:
                seen.add(real)
                roots.append(c)
    return roots


def path_hash(text):
    """A stable 64-bit hash of a path (SHA-256, first 8 bytes, big-endian)."""
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big")


def is_heldout_dir(dirpath, holdout_percent):
    """The held-out rule: a directory (all files directly in it) is held out when the hash of
    its absolute path, modulo 10000, is below holdout_percent * 100."""
    return path_hash(os.path.abspath(dirpath)) % 10000 < int(round(holdout_percent * 100))


def list_corpus(roots, reporter, max_file_bytes):
    """Lists candidate text files: {directory: [(path, size), ...]} with files sorted by name.
    Regular files only (symbolic links are skipped, so nothing is listed twice through a link),
    no hidden or __pycache__ directories, no known binary suffixes, sizes in (0, 64 MiB]."""
    dirs = {}
    seen_files = set()
    ticker = Ticker()
    nfiles = 0
    for root in roots:
        if os.path.isfile(root):
            st = os.lstat(root)
            if stat.S_ISREG(st.st_mode) and st.st_size > 0:
                d = os.path.dirname(os.path.abspath(root))
                dirs.setdefault(d, []).append((os.path.abspath(root), st.st_size))
                nfiles += 1
            continue
        if not os.path.isdir(root):
            raise UserError("corpus path %s does not exist (pass --corpus with existing "
                            "directories or files)" % root)
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames
                                 if not d.startswith(".") and d != "__pycache__")
            entries = []
            for name in sorted(filenames):
                if name.startswith(".") or name.lower().endswith(BINARY_SUFFIXES):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or st.st_size > (64 << 20):
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen_files:
                    continue
                seen_files.add(key)
                entries.append((os.path.abspath(path), st.st_size))
            if entries:
                dirs.setdefault(os.path.abspath(dirpath), []).extend(entries)
                nfiles += len(entries)
            if ticker.due():
                reporter.say("listing corpus: %d files in %d directories so far (%s)"
                             % (nfiles, len(dirs), dirpath))
    for d in dirs:
        dirs[d].sort()
    return dirs


def read_text_file(path, max_file_bytes):
    """The file's bytes (gzip-compressed files decompressed), at most max_file_bytes, or None
    for unreadable or binary files (a NUL byte)."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(max_file_bytes)
        else:
            with open(path, "rb") as f:
                data = f.read(max_file_bytes)
    except Exception:  # OSError, EOFError, damaged gzip data (zlib.error, BadGzipFile)
        return None
    if not data or b"\0" in data:
        return None
    return data


def file_header(path):
    """The separator written before each file's text, naming the file."""
    return b"\n==> " + path.encode("utf-8", "surrogateescape") + b" <==\n"


class Corpus:
    """The listed corpus split into training and held-out directories (each in hash order)."""

    def __init__(self, roots, holdout_percent, reporter, max_file_bytes):
        self.roots = list(roots)
        self.holdout_percent = holdout_percent
        self.max_file_bytes = max_file_bytes
        self.dirs = list_corpus(self.roots, reporter, max_file_bytes)
        order = sorted(self.dirs, key=lambda d: (path_hash(d), d))
        self.heldout_dirs = [d for d in order if is_heldout_dir(d, holdout_percent)]
        self.train_dirs = [d for d in order if not is_heldout_dir(d, holdout_percent)]
        self.listed_files = sum(len(v) for v in self.dirs.values())
        self.listed_bytes = sum(s for v in self.dirs.values() for _, s in v)
        self.heldout_listed_bytes = sum(s for d in self.heldout_dirs for _, s in self.dirs[d])

    def rule(self):
        return ("a directory is held out (all files directly in it) when SHA-256 of its "
                "absolute path, first 8 bytes big-endian, mod 10000 < %d (--holdout-percent %g); "
                "directories in hash order, files in name order"
                % (int(round(self.holdout_percent * 100)), self.holdout_percent))

    def training_stream(self, max_bytes, reporter):
        """Concatenated training text (headers + file bytes), directories in hash order, until
        max_bytes. Returns (uint8 array, info dict)."""
        buf = bytearray()
        files = skipped = ndirs = 0
        ticker = Ticker()
        for d in self.train_dirs:
            if len(buf) >= max_bytes:
                break
            ndirs += 1
            for path, _ in self.dirs[d]:
                data = read_text_file(path, self.max_file_bytes)
                if data is None:
                    skipped += 1
                    continue
                buf += file_header(path)
                buf += data
                files += 1
                if len(buf) >= max_bytes:
                    break
            if ticker.due():
                reporter.say("reading training text: %.1f MB from %d files in %d directories"
                             % (len(buf) / 1e6, files, ndirs))
        del buf[max_bytes:]
        info = {"bytes": len(buf), "files": files, "directories": ndirs,
                "skipped_binary_or_unreadable": skipped}
        return np.frombuffer(bytes(buf), dtype=np.uint8), info

    def heldout_docs(self, count, length):
        """count sequences of exactly `length` bytes from held-out directories: each starts at
        a new directory (hash order) and concatenates its files, then the next directories',
        until `length` bytes; the rest of the last directory is dropped. Returns a list of
        (uint8 array, info dict)."""
        docs = []
        it = iter(self.heldout_dirs)
        total_read = 0
        while len(docs) < count:
            buf = bytearray()
            used_files, used_dirs = [], []
            for d in it:
                used_dirs.append(d)
                for path, _ in self.dirs[d]:
                    data = read_text_file(path, self.max_file_bytes)
                    if data is None:
                        continue
                    buf += file_header(path)
                    buf += data
                    used_files.append(path)
                    if len(buf) >= length:
                        break
                if len(buf) >= length:
                    break
            total_read += len(buf)
            if len(buf) < length:
                raise UserError(
                    "held-out text too small: %d held-out directories (%.2f MB listed) under %s "
                    "gave %d full sequences of %d bytes, need --docs %d: pass --corpus with more "
                    "text, raise --holdout-percent (now %g) or lower --context/--docs"
                    % (len(self.heldout_dirs), self.heldout_listed_bytes / 1e6,
                       ", ".join(self.roots), len(docs), length, count, self.holdout_percent))
            arr = np.frombuffer(bytes(buf[:length]), dtype=np.uint8)
            docs.append((arr, {
                "files": len(used_files),
                "directories": used_dirs,
                "first_file": used_files[0] if used_files else None,
                "last_file": used_files[-1] if used_files else None,
                "concatenated": len(used_files) > 1,
            }))
        return docs


# ----------------------------------------------------------------------------------------------
# Statistics: the same definitions as tools/trace/gen_trace.cc ComputeTraceStats (row 0).


def topk_slots(scores, k):
    """Ids of the k highest finite scores (ties to the lower id), sorted ascending
    (tools/trace/score_math.cc TopKSlots)."""
    finite = np.flatnonzero(np.isfinite(scores))
    if k <= 0:
        return finite[:0]
    if finite.size > k:
        vals = scores[finite]
        order = np.argsort(-vals, kind="stable")[:k]
        finite = finite[order]
    return np.sort(finite)


def pearson(a, b):
    """Pearson correlation over slots where both are finite; NaN with fewer than two or no
    variance (score_math.cc Pearson), in float64."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 2:
        return float("nan")
    if not ok.all():
        a, b = a[ok], b[ok]
    x = a - a.mean()
    y = b - b.mean()
    vaa = float(np.dot(x, x))
    vbb = float(np.dot(y, y))
    if vaa <= 0 or vbb <= 0:
        return float("nan")
    return float(np.dot(x, y) / math.sqrt(vaa * vbb))


def nanmean(values):
    v = [x for x in values if not math.isnan(x)]
    return sum(v) / len(v) if v else float("nan")


def trace_stats(scores, ctx_len, topk, block_size):
    """Prev-iter Pearson and top-K recall of row-0 scores [T, L, N] (spinctl trace-stats):
    Pearson(scores[t, l], scores[t-1, l]) over slots below min(ctx_len[t-1], ctx_len[t]);
    recall = |topK(t-1) & topK(t)| / min(K, ctx_len[t]), each top-K over its own step's
    context; both averaged per layer over t >= 1 (NaN skipped), then over layers. Also
    prev-layer Pearson (layer l against l-1 at the same step) and top-K block coverage."""
    steps, layers, _ = scores.shape
    if steps < 2:
        raise ValueError("trace stats need at least 2 steps")
    per_p = [[] for _ in range(layers)]
    per_r = [[] for _ in range(layers)]
    layer_p, coverage = [], []
    step_p = [float("nan")] * steps
    step_r = [float("nan")] * steps
    prev_top = [None] * layers
    for t in range(steps):
        ctx = int(ctx_len[t])
        sp, sr = [], []
        for l in range(layers):
            cur = scores[t, l, :ctx]
            top = topk_slots(cur, topk)
            blocks = (ctx + block_size - 1) // block_size
            coverage.append(np.unique(top // block_size).size / blocks)
            if l > 0:
                layer_p.append(pearson(cur, scores[t, l - 1, :ctx]))
            if t > 0:
                n = min(int(ctx_len[t - 1]), ctx)
                pc = pearson(scores[t, l, :n], scores[t - 1, l, :n])
                common = np.intersect1d(prev_top[l], top, assume_unique=True).size
                rc = common / min(topk, ctx)
                per_p[l].append(pc)
                per_r[l].append(rc)
                sp.append(pc)
                sr.append(rc)
            prev_top[l] = top
        if t > 0:
            step_p[t] = nanmean(sp)
            step_r[t] = nanmean(sr)
    lp = [nanmean(x) for x in per_p]
    lr = [nanmean(x) for x in per_r]
    return {
        "prev_iter_pearson": nanmean(lp),
        "prev_iter_recall": nanmean(lr),
        "per_layer_pearson": lp,
        "per_layer_recall": lr,
        "per_step_pearson": step_p,
        "per_step_recall": step_r,
        "prev_layer_pearson": nanmean(layer_p) if layer_p else float("nan"),
        "topk_block_coverage": nanmean(coverage),
    }


# ----------------------------------------------------------------------------------------------
# Trace writing and checks.


def decode_positions(context, steps):
    """q_pos and ctx_len of the last `steps` decode steps of a `context`-token sequence: step t
    queries slot q_pos = context - steps + t with ctx_len = q_pos + 1 (its own key included,
    as spinctl gen-trace does), so the last step sees the whole sequence."""
    q_pos = [context - steps + t for t in range(steps)]
    ctx_len = [q + 1 for q in q_pos]
    return q_pos, ctx_len


def write_trace(directory, scores, q_pos, ctx_len, block_size, topk, extra=None):
    """Writes meta.json and scores.npy (<f4, C order, [T, L, 1, N]) into `directory`."""
    steps, layers, n = scores.shape
    os.makedirs(directory, exist_ok=True)
    meta = {"version": 1, "layers": int(layers), "block_size": int(block_size),
            "topk": int(topk), "steps": int(steps), "rows": 1,
            "q_pos": [int(x) for x in q_pos], "ctx_len": [int(x) for x in ctx_len]}
    if extra:
        meta.update(extra)
    arr = np.ascontiguousarray(scores.reshape(steps, layers, 1, n), dtype=np.dtype("<f4"))
    tmp = os.path.join(directory, "scores.npy.tmp")
    with open(tmp, "wb") as f:
        np.lib.format.write_array(f, arr, version=(1, 0), allow_pickle=False)
    os.replace(tmp, os.path.join(directory, "scores.npy"))
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump(meta, f, separators=(",", ":"))
        f.write("\n")


def check_trace(directory):
    """Loads a trace and checks the constraints of docs/replay.md; returns (meta, scores
    memmap). Raises ValueError naming what is wrong."""
    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    for key in ("version", "layers", "block_size", "topk", "steps", "rows", "q_pos", "ctx_len"):
        if key not in meta:
            raise ValueError("%s/meta.json: missing key %s" % (directory, key))
    if meta["version"] != 1:
        raise ValueError("version %r != 1" % meta["version"])
    scores = np.load(os.path.join(directory, "scores.npy"), mmap_mode="r")
    if scores.dtype != np.dtype("<f4") or not scores.flags.c_contiguous:
        raise ValueError("scores.npy: dtype %s, C order %s" % (scores.dtype,
                                                               scores.flags.c_contiguous))
    steps, layers, rows = meta["steps"], meta["layers"], meta["rows"]
    if scores.ndim != 4 or scores.shape[:3] != (steps, layers, rows):
        raise ValueError("scores.npy shape %s, meta says [%d, %d, %d, N]"
                         % (scores.shape, steps, layers, rows))
    n = scores.shape[3]
    if len(meta["q_pos"]) != steps or len(meta["ctx_len"]) != steps:
        raise ValueError("q_pos/ctx_len length != steps")
    for t in range(steps):
        c, q = meta["ctx_len"][t], meta["q_pos"][t]
        if c < 1 or c + rows - 1 > n:
            raise ValueError("ctx_len[%d] = %d out of [1, %d]" % (t, c, n - rows + 1))
        if q < 0 or q + rows - 1 >= n:
            raise ValueError("q_pos[%d] = %d out of [0, %d)" % (t, q, n - rows + 1))
        if t > 0 and q <= meta["q_pos"][t - 1]:
            raise ValueError("q_pos not strictly increasing at %d" % t)
    for key in ("layers", "block_size", "topk", "steps", "rows"):
        if not isinstance(meta[key], int) or meta[key] < 1:
            raise ValueError("%s = %r is not a positive integer" % (key, meta[key]))
    return meta, scores


def find_spinctl(explicit, repo_root):
    """The spinctl binary: --spinctl, $SPINCTL, then the build tree and the GPU bundle."""
    if explicit:
        return explicit if explicit != "none" else None
    env = os.environ.get("SPINCTL")
    if env:
        return env
    for rel in ("build/tools/spinctl/spinctl", "gpu-bundle/spinctl"):
        p = os.path.join(repo_root, rel)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def spinctl_checks(spinctl, directory, sparsities, env=None):
    """Runs spinctl trace-stats and replay --json on a written trace. Returns a dict; "error"
    set when spinctl rejected the trace or could not run."""
    out = {"spinctl": spinctl}
    try:
        r = subprocess.run([spinctl, "trace-stats", directory], capture_output=True, text=True,
                           timeout=600, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        out["error"] = "spinctl trace-stats could not run: %s" % e
        return out
    if r.returncode != 0:
        out["error"] = "spinctl trace-stats %s: rc %d: %s" % (directory, r.returncode,
                                                              r.stderr.strip()[-500:])
        return out
    first = r.stdout.split("\n", 1)[0].split()
    try:
        out["trace_stats"] = {"prev_iter_pearson": float(first[2]),
                              "prev_iter_recall": float(first[5])}
    except (IndexError, ValueError):
        out["trace_stats_raw"] = r.stdout
    out["replay"] = {}
    for s in sparsities:
        cmd = [spinctl, "replay", "--trace", directory, "--sparsity", repr(s), "--json"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            out["error"] = "%s could not run: %s" % (" ".join(cmd), e)
            return out
        if r.returncode != 0:
            out["error"] = "%s: rc %d: %s" % (" ".join(cmd), r.returncode,
                                              r.stderr.strip()[-500:])
            return out
        try:
            out["replay"][repr(s)] = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out["replay"][repr(s)] = {"raw": r.stdout.strip()[-2000:]}
    return out


# ----------------------------------------------------------------------------------------------
# The model (torch imported lazily).


def generic_blas(torch):
    """True when this torch's matrix products go to a reference BLAS (Debian's CPU torch links
    libblas.so.3, which is netlib's unless an optimized one is installed): then a 1x1
    convolution, which runs in oneDNN, is several times faster than F.linear on the CPU."""
    try:
        return "BLAS_INFO=generic" in torch.__config__.show()
    except Exception:
        return False


def build_model_class(conv_linear=False):
    """The model classes. conv_linear: compute CPU linear layers as 1x1 convolutions (same
    result up to rounding; see generic_blas)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    have_sdpa = hasattr(F, "scaled_dot_product_attention")

    def lin(x, w):
        """x [..., in] @ w[out, in]^T."""
        if conv_linear and x.device.type == "cpu" and x.dtype == torch.float32:
            rows = x.reshape(-1, x.shape[-1], 1, 1)
            y = F.conv2d(rows, w[:, :, None, None])
            return y.reshape(x.shape[:-1] + (w.shape[0],))
        return F.linear(x, w)

    def chunked_causal_attention(q, k, v, chunk=512):
        """Exact causal attention for torch < 2.0 (no scaled_dot_product_attention): one block
        of queries at a time, so memory is chunk x context per head, never context^2."""
        n = q.shape[-2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        outs = []
        for i0 in range(0, n, chunk):
            i1 = min(n, i0 + chunk)
            s = torch.matmul(q[..., i0:i1, :], k[..., :i1, :].transpose(-1, -2)) * scale
            cols = torch.arange(i1, device=q.device)
            rows = torch.arange(i0, i1, device=q.device)
            s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            probs = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1)
            outs.append(torch.matmul(probs.to(v.dtype), v[..., :i1, :]))
        return torch.cat(outs, dim=-2)

    def causal_attention(q, k, v):
        if have_sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return chunked_causal_attention(q, k, v)

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return x32 * self.weight.float()

    class Rope:
        """Rotary position embedding (rotate-half form), angles in float64, applied in
        float32."""

        def __init__(self, head_dim, base):
            self.head_dim = head_dim
            self.base = base
            self.cache = {}

        def tables(self, n, device):
            key = (n, str(device))
            if key not in self.cache:
                half = self.head_dim // 2
                inv = self.base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / self.head_dim)
                ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
                self.cache[key] = (torch.cos(ang).float().to(device),
                                   torch.sin(ang).float().to(device))
            return self.cache[key]

        def apply(self, x, cos, sin):
            """x [..., n, head_dim]; cos/sin [n, head_dim/2] for the same positions."""
            dtype = x.dtype
            x = x.float()
            half = self.head_dim // 2
            a, b = x[..., :half], x[..., half:]
            return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(dtype)

    class Block(nn.Module):
        def __init__(self, dim, heads, mlp_ratio, rope):
            super().__init__()
            self.heads = heads
            self.head_dim = dim // heads
            self.norm1 = RMSNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.proj = nn.Linear(dim, dim, bias=False)
            self.norm2 = RMSNorm(dim)
            self.fc1 = nn.Linear(dim, mlp_ratio * dim, bias=False)
            self.fc2 = nn.Linear(mlp_ratio * dim, dim, bias=False)
            self.rope = rope

        def split_heads(self, t, b, n):
            return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

        def forward(self, x, cos, sin, capture_steps=0):
            b, n, d = x.shape
            h = self.norm1(x)
            q, k, v = lin(h, self.qkv.weight).split(d, dim=-1)
            q = self.rope.apply(self.split_heads(q, b, n), cos, sin)
            k = self.rope.apply(self.split_heads(k, b, n), cos, sin)
            v = self.split_heads(v, b, n)
            a = causal_attention(q, k.to(q.dtype), v.to(q.dtype))
            x = x + lin(a.transpose(1, 2).reshape(b, n, d), self.proj.weight)
            x = x + lin(F.gelu(lin(self.norm2(x), self.fc1.weight)), self.fc2.weight)
            captured = self.capture(h, cos, sin, capture_steps) if capture_steps else None
            return x, captured

        def capture(self, h, cos, sin, steps):
            """Decode-step scores of the last `steps` query positions against every slot, in
            float32 outside autocast, from this layer's own normalized input and weights:
            z[h, t, s] = q_h(p_t) . k_h(s) / sqrt(head_dim) (RoPE applied), p_t = n - steps + t,
            slots s > p_t masked. Returns {kind: [steps, n] float32 tensor}, entries beyond the
            context 0."""
            n = h.shape[1]
            d = h.shape[2]
            dev_type = h.device.type
            ctx = (torch.autocast(device_type=dev_type, enabled=False)
                   if hasattr(torch, "autocast") else contextlib.nullcontext())
            with ctx:
                h32 = h[0].float()
                w = self.qkv.weight.float()
                q = F.linear(h32[n - steps:], w[:d]).view(steps, self.heads, self.head_dim)
                k = F.linear(h32, w[d:2 * d]).view(n, self.heads, self.head_dim)
                q = self.rope.apply(q.transpose(0, 1), cos[n - steps:], sin[n - steps:])
                k = self.rope.apply(k.transpose(0, 1), cos, sin)
                z = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
                pos = torch.arange(n - steps, n, device=h.device)
                invalid = torch.arange(n, device=h.device)[None, :] > pos[:, None]  # [T, n]
                z = z.masked_fill(invalid[None], float("-inf"))
                out = {}
                out["logit-max"] = z.max(dim=0).values
                out["logit-mean"] = z.masked_fill(invalid[None], 0.0).mean(dim=0)
                lse = torch.logsumexp(z, dim=-1, keepdim=True)
                out["log-attn"] = torch.logsumexp(z - lse, dim=0) - math.log(self.heads)
                for key in out:
                    out[key] = out[key].masked_fill(invalid, 0.0).contiguous()
            return out

    class ByteLM(nn.Module):
        def __init__(self, layers, dim, heads, mlp_ratio, rope_base):
            super().__init__()
            self.rope = Rope(dim // heads, rope_base)
            self.embed = nn.Embedding(256, dim)
            self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, self.rope)
                                        for _ in range(layers))
            self.norm = RMSNorm(dim)
            self.reset_parameters(layers)

        def reset_parameters(self, layers):
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02
                    if name.endswith("proj.weight") or name.endswith("fc2.weight"):
                        std = 0.02 / math.sqrt(2 * layers)
                    nn.init.normal_(p, mean=0.0, std=std)

        def forward(self, idx, capture_steps=0):
            """idx [B, n] int64 bytes -> logits [B, n, 256] (tied embedding) and, with
            capture_steps, a list per layer of {kind: [capture_steps, n]} (batch 1 only)."""
            n = idx.shape[1]
            cos, sin = self.rope.tables(n, idx.device)
            x = self.embed(idx)
            captured = []
            for blk in self.blocks:
                x, cap = blk(x, cos, sin, capture_steps)
                if cap is not None:
                    captured.append(cap)
            logits = lin(self.norm(x), self.embed.weight)
            return logits, captured

    return ByteLM, have_sdpa, chunked_causal_attention


MODEL_FORMAT = "spind-attention-traces-model/1"


def save_model_file(path, model, args, train_info, dev_name):
    """The model as float16 weights in a .npz, with its sizes and training record as JSON."""
    meta = {"format": MODEL_FORMAT, "device": dev_name,
            "model": {"layers": args.layers, "dim": args.dim, "heads": args.heads,
                      "mlp_ratio": args.mlp_ratio, "rope_base": args.rope_base},
            "training": {k: v for k, v in train_info.items() if k != "history"}}
    arrays = {"w:" + k: v.detach().float().cpu().numpy().astype(np.float16)
              for k, v in model.state_dict().items()}
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(json_clean(meta)).encode(), dtype=np.uint8),
                 **arrays)


def load_model_file(path):
    """{"model": sizes, "training": record, "device": ..., "state": {name: float16 array}}."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            state = {k[2:]: z[k] for k in z.files if k.startswith("w:")}
    except (OSError, ValueError, KeyError) as e:
        raise UserError("cannot read the model file %s (%s): pass a file written by "
                        "--save-model" % (path, e))
    if meta.get("format") != MODEL_FORMAT:
        raise UserError("%s is not a model of this script (format %r, expected %r): pass a "
                        "file written by --save-model" % (path, meta.get("format"), MODEL_FORMAT))
    sizes = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    missing = [k for k in ("layers", "dim", "heads", "mlp_ratio", "rope_base") if k not in sizes]
    if missing or not isinstance(meta.get("training"), dict) or not state:
        raise UserError("%s is incomplete (model sizes missing: %s; training record: %s; %d "
                        "tensors): pass a file written by --save-model"
                        % (path, ", ".join(missing) or "none",
                           "present" if isinstance(meta.get("training"), dict) else "missing",
                           len(state)))
    meta["state"] = state
    return meta


# ----------------------------------------------------------------------------------------------
# Command line.


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="attention-traces",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Train a small byte-level decoder-only transformer (RoPE, causal attention through\n"
            "torch scaled_dot_product_attention) on text the machine's Debian packages ship,\n"
            "run it over held-out documents of --context bytes, and write the last --steps\n"
            "decode steps of each as a replay trace (docs/replay.md): OUT/doc0, OUT/doc1, ...\n"
            "with meta.json and scores.npy [steps, layers, 1, context] float32, plus\n"
            "OUT/log.txt and OUT/summary.json (prev-iter Pearson and top-K recall per trace,\n"
            "the paper's Table-1 statistics). docs/lab/attention-traces.md has the details."),
        epilog=(
            "score of slot s at step t, layer l (--score):\n"
            "  log-attn    log of the head-averaged softmax attention weight of s for the query\n"
            "              (the target DeepSeek-V3.2 trains its indexer to match; default)\n"
            "  logit-max   max over heads of the pre-softmax logit q.k/sqrt(head_dim)\n"
            "  logit-mean  mean over heads of that logit\n"
            "summary.json reports the statistics of all three; the trace holds --score.\n\n"
            "examples:\n"
            "  attention-traces --device cuda --context 32768 --steps 64 --layers 8 \\\n"
            "      --train-seconds 300 --docs 4 --out /tmp/attn\n"
            "  attention-traces --device cpu --context 2560 --layers 4 --dim 96 --heads 3 \\\n"
            "      --train-context 256 --batch-tokens 2048 --long-fraction 0.1 --lr 3e-3 \\\n"
            "      --train-steps 300 --docs 2 --out /tmp/attn-cpu   (bench/traces/attn-cpu-2560)"))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where to train and run the model (default cuda)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output directory (created): DIR/doc<i>/, DIR/log.txt, DIR/summary.json")
    p.add_argument("--context", type=int, default=32768,
                   help="tokens (bytes) per held-out sequence = the trace's slots N (default "
                        "32768)")
    p.add_argument("--steps", type=int, default=64,
                   help="decode steps per trace: the last STEPS query positions (default 64)")
    p.add_argument("--docs", type=int, default=2,
                   help="held-out sequences, one trace each (default 2)")
    p.add_argument("--topk", type=int, default=0,
                   help="the trace's top-K (default: context/16, i.e. 2048 at 32768)")
    p.add_argument("--skip-docs", type=int, default=0, metavar="N",
                   help="start at the N-th held-out sequence: the traces are doc<N>, "
                        "doc<N+1>, ... (default 0)")
    p.add_argument("--block-size", type=int, default=64, help="KV block size (default 64)")
    p.add_argument("--score", choices=SCORE_KINDS, default="log-attn",
                   help="which score the trace holds (default log-attn; see below)")
    g = p.add_argument_group("model")
    g.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    g.add_argument("--dim", type=int, default=512, help="model width (default 512)")
    g.add_argument("--heads", type=int, default=8,
                   help="attention heads (default 8; dim/heads must be even)")
    g.add_argument("--mlp-ratio", type=int, default=4, help="MLP width / dim (default 4)")
    g.add_argument("--rope-base", type=float, default=10000.0, help="RoPE base (default 10000)")
    g = p.add_argument_group("training")
    g.add_argument("--train-seconds", type=float, default=None,
                   help="training time budget in seconds (default 300 unless --train-steps); "
                        "the step count then depends on the machine's speed")
    g.add_argument("--train-steps", type=int, default=None,
                   help="train exactly this many optimizer steps (deterministic on a given "
                        "device and torch); with --train-seconds too, stops at whichever "
                        "comes first")
    g.add_argument("--train-context", type=int, default=2048,
                   help="sequence length of the first training phase (default 2048)")
    g.add_argument("--long-fraction", type=float, default=0.25,
                   help="last fraction of training run at the full --context so that the "
                        "model has seen every position it is traced at (default 0.25)")
    g.add_argument("--batch-tokens", type=int, default=0,
                   help="tokens per optimizer step (default 65536 on cuda, 8192 on cpu)")
    g.add_argument("--lr", type=float, default=1.5e-3, help="peak AdamW learning rate")
    g.add_argument("--seed", type=int, default=1, help="seed of init and data order (default 1)")
    g.add_argument("--save-model", default=None, metavar="FILE",
                   help="after training, save the model (float16 weights, sizes and training "
                        "record) to FILE (.npz), for --load-model")
    g.add_argument("--load-model", default=None, metavar="FILE",
                   help="skip training: run the model saved in FILE by --save-model (its sizes "
                        "replace --layers/--dim/--heads/--mlp-ratio/--rope-base); the traces "
                        "then differ from the training device's only by its arithmetic")
    g.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (default: all cores)")
    g = p.add_argument_group("corpus")
    g.add_argument("--corpus", action="append", default=None, metavar="PATHS",
                   help="comma-separated directories or files of text (repeatable); default: "
                        "the Python standard library, /usr/include, /usr/share/doc, "
                        "/usr/share/perl, /usr/share/perl5, /usr/lib/python3/dist-packages "
                        "(those that exist)")
    g.add_argument("--corpus-mb", type=float, default=128.0,
                   help="at most this many MB of training text (default 128)")
    g.add_argument("--holdout-percent", type=float, default=5.0,
                   help="percent of directories held out by path hash (default 5)")
    g.add_argument("--max-file-kb", type=int, default=1024,
                   help="read at most this many KB of each file (default 1024)")
    g = p.add_argument_group("checks")
    g.add_argument("--spinctl", default=None,
                   help="spinctl binary to check each trace with (trace-stats and replay); "
                        "default $SPINCTL, build/tools/spinctl/spinctl or gpu-bundle/spinctl; "
                        "'none' skips")
    g.add_argument("--replay-sparsity", default="0.5",
                   help="comma-separated sparsities for spinctl replay --json (default 0.5)")
    g.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)

    def bad(msg):
        p.error(msg)

    if args.context < 2:
        bad("--context must be at least 2")
    if not 2 <= args.steps < args.context:
        bad("--steps must be in [2, context)")
    if args.docs < 1:
        bad("--docs must be positive")
    if args.skip_docs < 0:
        bad("--skip-docs must be >= 0")
    if args.load_model and args.save_model:
        bad("--load-model and --save-model exclude each other")
    if args.layers < 1 or args.dim < 2 or args.heads < 1 or args.mlp_ratio < 1:
        bad("model sizes must be positive")
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        bad("--dim must be a multiple of --heads with an even head size")
    if args.topk <= 0:
        args.topk = max(1, args.context // 16)
    if args.block_size < 1 or args.block_size > 4096:
        bad("--block-size must be in [1, 4096]")
    if args.train_seconds is None and args.train_steps is None:
        args.train_seconds = 300.0
    if args.train_seconds is not None and args.train_seconds <= 0:
        bad("--train-seconds must be positive")
    if args.train_steps is not None and args.train_steps < 1:
        bad("--train-steps must be positive")
    if not 0.0 <= args.long_fraction <= 1.0:
        bad("--long-fraction must be in [0, 1]")
    if args.train_context < 2:
        bad("--train-context must be at least 2")
    args.train_context = min(args.train_context, args.context)
    if args.batch_tokens <= 0:
        args.batch_tokens = 65536 if args.device == "cuda" else 8192
    if not 0 < args.holdout_percent < 100:
        bad("--holdout-percent must be in (0, 100)")
    try:
        args.replay_sparsity = [float(x) for x in args.replay_sparsity.split(",") if x.strip()]
    except ValueError:
        bad("--replay-sparsity takes comma-separated numbers")
    if args.corpus:
        args.corpus = [x for item in args.corpus for x in item.split(",") if x]
    return args


def git_commit(repo_root):
    """HEAD of the checkout, with " (this script modified)" when the script differs from it."""
    try:
        r = subprocess.run(["git", "-C", repo_root, "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        if r.returncode != 0:
            return None
        d = subprocess.run(["git", "-C", repo_root, "status", "--porcelain", "--",
                            "bench/attention-traces", "bench/attention_traces_lib.py"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() + (" (this script modified)" if d.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def json_clean(x):
    """NaN/inf -> None so that summary.json is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_clean(v) for v in x]
    return x


def train(model, stream, args, device, rep):
    """Trains on random windows of the training stream: phase 1 at --train-context, the last
    --long-fraction at --context. Progress is time- or step-based. Returns an info dict."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator()
    gen.manual_seed(args.seed * 1000003 + 17)
    data = torch.from_numpy(stream.copy())
    if device.type == "cuda":
        data = data.to(device)
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                fused=(device.type == "cuda"))
    except TypeError:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    use_bf16 = device.type == "cuda"
    start = time.time()
    ticker = Ticker()
    step = 0
    tokens = 0
    phase_tokens = 0
    phase_start = start
    phase = 0
    last_loss = float("nan")
    loss_acc, loss_n = 0.0, 0
    history = []
    phase_steps = [0, 0]
    phase_seconds = [0.0, 0.0]

    def progress():
        parts = []
        if args.train_seconds is not None:
            parts.append((time.time() - start) / args.train_seconds)
        if args.train_steps is not None:
            parts.append(step / args.train_steps)
        return max(parts)

    model.train()
    while True:
        frac = progress()
        if frac >= 1.0:
            break
        want = 1 if frac >= 1.0 - args.long_fraction else 0
        if args.long_fraction >= 1.0:
            want = 1
        if want != phase:
            phase_seconds[phase] = time.time() - phase_start
            phase, phase_start, phase_tokens = want, time.time(), 0
            rep.say("training phase 2: sequences of %d tokens (step %d)" % (args.context, step))
        seq = args.context if phase == 1 else args.train_context
        if len(stream) < seq + 1:
            raise UserError("training text (%d bytes) is shorter than one training sequence "
                            "(%d): pass --corpus with more text" % (len(stream), seq + 1))
        batch = max(1, args.batch_tokens // seq)
        starts = torch.randint(0, len(stream) - seq - 1 + 1, (batch,), generator=gen)
        offs = torch.arange(seq + 1)
        idx = (starts[:, None] + offs[None, :])
        if device.type == "cuda":
            idx = idx.to(device, non_blocking=True)
        window = data[idx].long()
        x, y = window[:, :-1], window[:, 1:]
        warm = 0.02
        lr_scale = frac / warm if frac < warm else 0.1 + 0.9 * 0.5 * (
            1 + math.cos(math.pi * min(1.0, (frac - warm) / (1 - warm))))
        lr_scale = max(lr_scale, 0.01)
        for gparam in opt.param_groups:
            gparam["lr"] = args.lr * lr_scale
        if use_bf16:
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits, _ = model(x)
        else:
            logits, _ = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        phase_steps[phase] += 1
        tokens += batch * seq
        phase_tokens += batch * seq
        if step % 10 == 0 or device.type == "cpu" or step < 3:
            last_loss = float(loss.item())  # also synchronizes the device for the clock
            loss_acc += last_loss
            loss_n += 1
        if ticker.due():
            el = time.time() - phase_start
            mean_loss = loss_acc / max(1, loss_n)
            rep.say("train step %d phase %d (seq %d x %d): loss %.3f nats/byte (%.2f bits/byte), "
                    "%.0f tokens/s, %.0f s elapsed"
                    % (step, phase + 1, batch, seq, mean_loss, mean_loss / math.log(2),
                       phase_tokens / max(el, 1e-9), time.time() - start))
            history.append({"step": step, "seconds": round(time.time() - start, 1),
                            "phase": phase + 1, "loss_nats": round(mean_loss, 4)})
            loss_acc, loss_n = 0.0, 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    phase_seconds[phase] = time.time() - phase_start
    final = float(loss.item()) if step else float("nan")
    total = time.time() - start
    return {"steps": step, "tokens": tokens, "seconds": round(total, 2),
            "phase_steps": phase_steps, "phase_seconds": [round(x, 2) for x in phase_seconds],
            "tokens_per_second": round(tokens / max(total, 1e-9)),
            "final_batch_loss_nats": final, "final_batch_bits_per_byte": final / math.log(2),
            "history": history}


def run(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    t_all = time.time()
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    live = os.path.join(out, "log.txt")
    with open(live, "w") as f:
        f.write("command: %s\n(run in progress; rewritten when it ends)\n" % command_line())
    rep = Reporter(quiet=args.quiet, live_log=live)
    try:
        return _run(args, rep, out, repo_root, t_all)
    except UserError as e:
        rep.say("error: %s" % e)
        _write_log(out, args, rep, {})
        print("attention-traces: error: %s" % e, file=sys.stderr)
        return 2


def command_line():
    return " ".join(shlex.quote(a) for a in [sys.argv[0]] + sys.argv[1:])


def _write_log(out, args, rep, header):
    with open(os.path.join(out, "log.txt"), "w") as f:
        f.write("command: %s\n" % command_line())
        for k, v in header.items():
            f.write("%s: %s\n" % (k, v))
        if rep.phases:
            f.write("wall time per phase: %s\n" % ", ".join("%s %.1f s" % pv for pv in rep.phases))
        f.write("\nprogress:\n")
        for line in rep.lines:
            f.write(line + "\n")


def _run(args, rep, out, repo_root, t_all):
    try:
        import torch
    except ImportError as e:
        raise UserError("cannot import torch (%s): this script needs PyTorch" % e)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but torch %s sees no CUDA device (use --device cpu)"
                        % torch.__version__)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or os.cpu_count() or 1)
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    conv_linear = device.type == "cpu" and generic_blas(torch)
    ByteLM, have_sdpa, _ = build_model_class(conv_linear)
    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else "cpu (%d threads, %s)" % (torch.get_num_threads(), platform.processor()
                                               or platform.machine()))
    rep.say("torch %s on %s; attention: %s" % (
        torch.__version__, dev_name,
        "scaled_dot_product_attention" if have_sdpa else
        "chunked exact attention (this torch has no scaled_dot_product_attention)"))

    # Corpus.
    t0 = time.time()
    roots = args.corpus or default_corpus_roots()
    if not roots:
        raise UserError("no corpus: none of the default directories exist; pass --corpus")
    rep.say("corpus roots: %s" % ", ".join(roots))
    corpus = Corpus(roots, args.holdout_percent, rep, args.max_file_kb * 1024)
    max_train = int(args.corpus_mb * 1e6)
    need_train = max(4 * (args.context + 1), min(max_train, 1 << 20))
    if corpus.listed_bytes < need_train:
        raise UserError("corpus too small: found %d bytes in %d files under %s, need >= %d "
                        "(training) + %d (held out): pass --corpus"
                        % (corpus.listed_bytes, corpus.listed_files, ", ".join(roots),
                           need_train, args.docs * args.context))
    docs = corpus.heldout_docs(args.skip_docs + args.docs, args.context)[args.skip_docs:]
    stream, train_info = corpus.training_stream(max_train, rep)
    if len(stream) < need_train:
        raise UserError("corpus too small: read %d bytes of training text from %d files under "
                        "%s (held-out directories excluded), need >= %d: pass --corpus"
                        % (len(stream), train_info["files"], ", ".join(roots), need_train))
    corpus_info = {
        "roots": roots, "listed_files": corpus.listed_files,
        "listed_bytes": corpus.listed_bytes, "directories": len(corpus.dirs),
        "heldout_directories": len(corpus.heldout_dirs),
        "heldout_listed_bytes": corpus.heldout_listed_bytes,
        "heldout_rule": corpus.rule(), "training": train_info,
        "file_separator": "\\n==> PATH <==\\n before each file",
        "max_file_bytes": args.max_file_kb * 1024,
    }
    rep.say("corpus: %d files, %.1f MB listed in %d directories; training text %.1f MB from %d "
            "files; %d held-out directories" % (
                corpus.listed_files, corpus.listed_bytes / 1e6, len(corpus.dirs),
                train_info["bytes"] / 1e6, train_info["files"], len(corpus.heldout_dirs)))
    for i, (_, info) in enumerate(docs, start=args.skip_docs):
        rep.say("doc%d: %d bytes from %d file(s) in %d held-out director%s (%s ... %s)%s" % (
            i, args.context, info["files"], len(info["directories"]),
            "y" if len(info["directories"]) == 1 else "ies", info["first_file"],
            info["last_file"], ", concatenated" if info["concatenated"] else ""))
    rep.phase_done("corpus", time.time() - t0)

    # Model and training (or a saved model).
    t0 = time.time()
    saved = load_model_file(args.load_model) if args.load_model else None
    if saved is not None:
        for key in ("layers", "dim", "heads", "mlp_ratio", "rope_base"):
            setattr(args, key, saved["model"][key])
    model = ByteLM(args.layers, args.dim, args.heads, args.mlp_ratio, args.rope_base).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    rep.say("model: %d layers, dim %d, %d heads of %d, MLP x%d, RoPE base %g, byte vocabulary "
            "(256), tied embedding: %d parameters (%.2f M)" % (
                args.layers, args.dim, args.heads, args.dim // args.heads, args.mlp_ratio,
                args.rope_base, nparams, nparams / 1e6))
    if saved is not None:
        state = model.state_dict()
        if set(state) != set(saved["state"]):
            raise UserError("%s does not fit this script's model: its tensors are %s, the "
                            "model's %s" % (args.load_model, sorted(saved["state"]),
                                            sorted(state)))
        for key, value in saved["state"].items():
            if tuple(value.shape) != tuple(state[key].shape):
                raise UserError("%s: tensor %s has shape %s, the model needs %s" % (
                    args.load_model, key, tuple(value.shape), tuple(state[key].shape)))
            state[key] = torch.from_numpy(value.astype(np.float32))
        model.load_state_dict(state)
        train_info2 = dict(saved["training"])
        train_info2["loaded_from"] = os.path.abspath(args.load_model)
        rep.say("loaded %s (trained on %s: %d steps, %.1f M tokens, %.0f s); no training" % (
            args.load_model, saved.get("device", "?"), train_info2["steps"],
            train_info2["tokens"] / 1e6, train_info2["seconds"]))
    else:
        budget = []
        if args.train_seconds is not None:
            budget.append("%g s" % args.train_seconds)
        if args.train_steps is not None:
            budget.append("%d steps" % args.train_steps)
        rep.say("training for %s: %d tokens/step, phase 1 at %d tokens, last %g at %d tokens" % (
            " or ".join(budget), args.batch_tokens, args.train_context, args.long_fraction,
            args.context))
        train_info2 = train(model, stream, args, device, rep)
        rep.say("trained %d steps, %.1f M tokens, %.0f tokens/s; last batch loss %.3f "
                "bits/byte" % (train_info2["steps"], train_info2["tokens"] / 1e6,
                               train_info2["tokens_per_second"],
                               train_info2["final_batch_bits_per_byte"]))
        if args.save_model:
            save_model_file(args.save_model, model, args, train_info2, dev_name)
            rep.say("saved the model to %s" % args.save_model)
    rep.phase_done("train", time.time() - t0)

    # Traces.
    t0 = time.time()
    import torch.nn.functional as F
    model.eval()
    q_pos, ctx_len = decode_positions(args.context, args.steps)
    traces = []
    for i, (arr, info) in enumerate(docs, start=args.skip_docs):
        td = time.time()
        idx = torch.from_numpy(arr.astype(np.int64))[None].to(device)
        with torch.no_grad():
            if device.type == "cuda":
                with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                    logits, captured = model(idx, capture_steps=args.steps)
            else:
                logits, captured = model(idx, capture_steps=args.steps)
            ce = F.cross_entropy(logits[0, :-1].float(), idx[0, 1:], reduction="none")
            bpb_all = float(ce.mean()) / math.log(2)
            bpb_tail = float(ce[-args.steps:].mean()) / math.log(2)
        scores = {}
        for kind in SCORE_KINDS:
            scores[kind] = np.stack([c[kind].float().cpu().numpy() for c in captured], axis=1)
        del logits, captured
        t_fwd = time.time() - td
        name = "doc%d" % i
        tdir = os.path.join(out, name)
        write_trace(tdir, scores[args.score], q_pos, ctx_len, args.block_size, args.topk, extra={
            "source": "bench/attention-traces", "score": args.score,
            "first_file": info["first_file"], "files": info["files"]})
        stats = {}
        for kind in SCORE_KINDS:
            st = trace_stats(scores[kind], ctx_len, args.topk, args.block_size)
            stats[kind] = st
        s = stats[args.score]
        rep.say("%s: held-out %.3f bits/byte (%.3f on the traced steps); %s: prev-iter Pearson "
                "%.4f, top-K recall %.4f, prev-layer Pearson %.4f (paper, real models: "
                "%.2f-%.2f / %.2f-%.2f); forward %.1f s, all %.1f s" % (
                    name, bpb_all, bpb_tail, args.score, s["prev_iter_pearson"],
                    s["prev_iter_recall"], s["prev_layer_pearson"], PAPER_PEARSON[0],
                    PAPER_PEARSON[1], PAPER_RECALL[0], PAPER_RECALL[1], t_fwd,
                    time.time() - td))
        for kind in SCORE_KINDS:
            if kind != args.score:
                rep.note("%s %s: prev-iter Pearson %.4f, recall %.4f" % (
                    name, kind, stats[kind]["prev_iter_pearson"],
                    stats[kind]["prev_iter_recall"]))
        traces.append({
            "name": name, "dir": name, "bytes": args.context, "files": info["files"],
            "concatenated": info["concatenated"], "directories": info["directories"],
            "first_file": info["first_file"], "last_file": info["last_file"],
            "heldout_bits_per_byte": bpb_all, "traced_steps_bits_per_byte": bpb_tail,
            "stats": {k: {kk: vv for kk, vv in v.items()
                          if kk not in ("per_step_pearson", "per_step_recall")}
                      for k, v in stats.items()},
            "per_step": {"pearson": stats[args.score]["per_step_pearson"],
                         "recall": stats[args.score]["per_step_recall"]},
        })
        del scores
    rep.phase_done("traces", time.time() - t0)

    # Checks with spinctl.
    t0 = time.time()
    spinctl = find_spinctl(args.spinctl, repo_root)
    failures = []
    if spinctl:
        env = dict(os.environ)
        lib = os.path.join(os.path.dirname(os.path.abspath(spinctl)), "lib")
        if os.path.isdir(lib):
            env["LD_LIBRARY_PATH"] = lib + ":" + env.get("LD_LIBRARY_PATH", "")
        for tr in traces:
            chk = spinctl_checks(spinctl, os.path.join(out, tr["dir"]), args.replay_sparsity, env)
            tr["spinctl"] = chk
            if "error" in chk:
                failures.append(chk["error"])
                rep.say("spinctl check failed: %s" % chk["error"])
                continue
            mine = tr["stats"][args.score]
            ts = chk.get("trace_stats", {})
            if ts:
                agree = (abs(ts["prev_iter_pearson"] - mine["prev_iter_pearson"]) < 1e-4 and
                         abs(ts["prev_iter_recall"] - mine["prev_iter_recall"]) < 1e-4)
                chk["stats_agree"] = agree
                if not agree:
                    failures.append("%s: spinctl trace-stats %s differs from this script's %s"
                                    % (tr["name"], ts, (mine["prev_iter_pearson"],
                                                        mine["prev_iter_recall"])))
            rep.say("%s: spinctl loads it; trace-stats %s; replay %s" % (
                tr["name"], ts, ", ".join(
                    "sparsity %s: mean_miss %s realized %s" % (
                        k, v.get("mean_miss"), v.get("realized_sparsity"))
                    for k, v in chk["replay"].items())))
    else:
        rep.say("spinctl not found (--spinctl, $SPINCTL, build/tools/spinctl/spinctl, "
                "gpu-bundle/spinctl): traces checked by this script only")
    for tr in traces:
        check_trace(os.path.join(out, tr["dir"]))
    rep.phase_done("check", time.time() - t0)

    # Summary and log.
    mean = {}
    for kind in SCORE_KINDS:
        mean[kind] = {
            "prev_iter_pearson": nanmean([t["stats"][kind]["prev_iter_pearson"] for t in traces]),
            "prev_iter_recall": nanmean([t["stats"][kind]["prev_iter_recall"] for t in traces]),
            "prev_layer_pearson": nanmean([t["stats"][kind]["prev_layer_pearson"]
                                           for t in traces]),
        }
    total = time.time() - t_all
    model_info = {"layers": args.layers, "dim": args.dim, "heads": args.heads,
                  "head_dim": args.dim // args.heads, "mlp_ratio": args.mlp_ratio,
                  "rope_base": args.rope_base, "vocab": 256, "parameters": nparams}
    summary = {
        "tool": "bench/attention-traces",
        "command": [sys.argv[0]] + sys.argv[1:],
        "git_commit": git_commit(repo_root),
        "device": dev_name, "torch": torch.__version__, "python": platform.python_version(),
        "attention": "scaled_dot_product_attention" if have_sdpa else "chunked exact",
        "seed": args.seed, "context": args.context, "steps": args.steps, "topk": args.topk,
        "block_size": args.block_size, "score": args.score,
        "score_definition": SCORE_DEFINITIONS[args.score],
        "model": model_info, "training": train_info2, "corpus": corpus_info,
        "paper_range": {"prev_iter_pearson": list(PAPER_PEARSON),
                        "prev_iter_recall": list(PAPER_RECALL)},
        "mean": mean, "traces": traces,
        "phase_seconds": {k: round(v, 2) for k, v in rep.phases},
        "wall_seconds": round(total, 2),
        "spinctl_failures": failures,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(json_clean(summary), f, indent=1, allow_nan=False)
        f.write("\n")
    rep.say("mean over %d traces (%s): prev-iter Pearson %.4f, top-K recall %.4f (paper, real "
            "models: %.2f-%.2f / %.2f-%.2f); wall %.1f s" % (
                len(traces), args.score, mean[args.score]["prev_iter_pearson"],
                mean[args.score]["prev_iter_recall"], PAPER_PEARSON[0], PAPER_PEARSON[1],
                PAPER_RECALL[0], PAPER_RECALL[1], total))
    header = {
        "git commit": summary["git_commit"],
        "device": dev_name, "torch": torch.__version__,
        "python": platform.python_version(),
        "attention": summary["attention"],
        "model": "%s; %d parameters" % (", ".join("%s=%s" % kv for kv in model_info.items()
                                                   if kv[0] != "parameters"), nparams),
        "context": "%d tokens (bytes), %d decode steps, top-K %d, block size %d, score %s" % (
            args.context, args.steps, args.topk, args.block_size, args.score),
        "corpus": "%s: %d files, %d bytes listed in %d directories; training text %d bytes from "
                  "%d files in %d directories" % (
                      ", ".join(roots), corpus.listed_files, corpus.listed_bytes,
                      len(corpus.dirs), train_info["bytes"], train_info["files"],
                      train_info["directories"]),
        "held-out rule": corpus.rule(),
        "training": "%d steps, %d tokens, %.1f s (%d tokens/s), seed %d" % (
            train_info2["steps"], train_info2["tokens"], train_info2["seconds"],
            train_info2["tokens_per_second"], args.seed),
        "wall time": "%.1f s" % total,
    }
    _write_log(out, args, rep, header)
    if failures:
        print("attention-traces: spinctl rejected or disagreed with a trace: %s"
              % "; ".join(failures), file=sys.stderr)
        return 1
    return 0


SCORE_DEFINITIONS = {
    "log-attn": "log((1/H) sum_h softmax_s(q_h(p).k_h(s)/sqrt(d_h))): log of the head-averaged "
                "attention weight of slot s for the query at p, over slots s <= p (RoPE applied, "
                "float32)",
    "logit-max": "max_h q_h(p).k_h(s)/sqrt(d_h): pre-softmax logit, max over heads",
    "logit-mean": "(1/H) sum_h q_h(p).k_h(s)/sqrt(d_h): pre-softmax logit, mean over heads",
}
