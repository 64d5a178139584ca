"""A DeepSeek-V3.2-shaped DSA decode engine in torch, for tests and measurement.

What it models, per decode step of a batch of `batch` sequence slots with `next_n` query rows
each (row r of a request at context c attends c + r slots; its own key is slot c - 1 + r):

- per layer, a paged fp8 indexer key cache: 64-slot pages of kPageBytes (paged_indexer.h):
  64 x 128 e4m3 key bytes, then 64 fp32 scales (a slot's key is quantised to e4m3 after
  division by its scale, amax / 448);
- the indexer inputs of the step: q [batch * next_n, 64, 128] e4m3 (uint8 storage: Debian's
  torch 1.13 has no float8) and head weights [batch * next_n, 64] float32;
- the paged indexer (torch.ops.spind.paged_indexer: the wgmma kernel on an H200, the C++
  reference on the CPU), then a top-k (2048 in DSA) over each row's valid slots;
- sparse MLA-style attention over the selected slots: 128 heads, latent 512 + rope 64
  (absorbed MLA: the latent row is both key and value), bf16 on the GPU, fp32 on the CPU.
  The latent cache is ONE cache shared by all layers (what changes the cost of the attention
  is the number of selected slots, not which layer's cache they come from; 61 layers of it
  would not fit an H200 next to the 61 indexer caches). The indexer caches are per layer.

Two modes share everything but the selection:
- dense: the indexer over each row's full block table;
- spin: a spind.Session (local by default, or attached to spind) picks blocks: begin_step once
  per step (with the block table); per layer select(layer), the indexer over s.phys with
  s.compact_len, top-k over the compacted slots, s.remap_and_observe(layer, topk, logits): the
  remap to logical slots (on probe steps the miss curves count that top-K) and the observation with no
  accepted count (the engine contract: acceptance is known only after sampling), then
  the attention over the remapped logical slots.

Requests arrive (admit), finish (when their context reaches their final length) and are
preempted; their sequence slots and pages are reused, and spind's reset_sequence(slot, key)
runs on every admission with key = a stable 64-bit hash of the request id (blake2b, never
Python's salted hash()), so every tensor-parallel rank and every run agrees. A request's keys
are written for its whole final length when it is admitted (its "prefill"): a decode step's
new keys are then already in their slots, which changes nothing the step reads (slots at or
beyond a row's length are never read).

Synthetic but structured scores, so that SPIN has something to predict:
- heavy slots: a request's tokens are heavy with small probabilities (whole 8-token phrases,
  single tokens, per-layer extra tokens, and the first 4 tokens as sinks). A heavy key carries a
  large component along one of two per-layer "topic" directions in the key's non-rotary half;
  every query head carries both topics with weights drawn per step and entry. Heavy slots are
  therefore persistent (the same slots score high step after step, which SPIN's per-slot EMA V
  learns) while their order moves with the topic weights.
- a local window: the key's first 64 dims are rotary pairs (cos, sin)(p * theta_i) with 32
  random frequencies in (0, pi / window), the query's are the same at its own position P, so the
  dot product carries sum_i cos((P - p) theta_i): large for the last ~window/2 slots, noise
  beyond (which SPIN's per-offset EMA D learns);
- Gaussian noise on keys and queries, so the order among ordinary slots is random.
The attention latents repeat the structure (heavy tokens along shared topic directions, rotary
rope part), so the attention mass sits on the same kind of slots the indexer ranks high.

One full decode step of all layers captures in ONE torch.cuda.CUDAGraph on a GPU: every
buffer is allocated at construction, every op of the step writes into a preallocated tensor
(out= or in place), nothing synchronises with the host, and the step's inputs are copied into
the static tensors before a replay (prepare_step). Four bodies are captured lazily: the dense
and SPIN indexer stages (indexer + top-k of every layer; SPIN's with its ops) and the dense and
SPIN full steps (with attention).

SPIN's logits and top-k are over a static compacted width: the widest union the step's rows
can select when every sequence is past its fresh (dense) step and probes are off (next_n rows
of at most m kept blocks each, m = KeptBlocks at the widest table), else the full table. The
host knows which sequences are fresh (admitted since their last SPIN step) and picks the wide
body for those steps. A full SPIN step records the widest compacted row it saw per layer;
check_widths() fails if that ever exceeded the width used.
"""
import hashlib
import math
import random
import time

import torch

from . import ops
from .keys import sequence_key

PAGE = 64  # slots per page (paged_indexer.h kPageSlots; spind's block size here)
INDEX_HEADS = 64
INDEX_DIM = 128
KEY_BYTES = PAGE * INDEX_DIM  # a page's key bytes, then PAGE fp32 scales
PAGE_BYTES = PAGE * (INDEX_DIM + 4)  # paged_indexer.h kPageBytes
MASKED = -1e30  # a masked attention score: finite, so a row with nothing selected stays finite


def _seed(*parts):
    """A 63-bit seed from any parts (for torch generators)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def fp8_e4m3_values():
    """The 256 values of the e4m3 bytes (NaN at 0x7F and 0xFF), as spin::Fp8E4m3ToFloat
    decodes them."""
    out = []
    for v in range(256):
        sign, exp, man = v >> 7, (v >> 3) & 0xF, v & 7
        if exp == 0xF and man == 7:
            mag = float("nan")
        elif exp == 0:
            mag = math.ldexp(man / 8.0, -6)
        else:
            mag = math.ldexp(1.0 + man / 8.0, exp - 7)
        out.append(-mag if sign else mag)
    return torch.tensor(out, dtype=torch.float32)


_FP8_CACHE = {}


def _fp8_tables(device):
    device = torch.device(device)
    key = str(device)
    if key not in _FP8_CACHE:
        values = fp8_e4m3_values()
        positive = values[:127]  # codes 0x00..0x7E, increasing
        mids = (positive[:-1] + positive[1:]) / 2
        _FP8_CACHE[key] = (values.to(device), mids.to(device))
    return _FP8_CACHE[key]


def fp8_encode(x):
    """float -> e4m3 bytes (uint8): the nearest value (ties toward zero), saturating at 448."""
    _, mids = _fp8_tables(x.device)
    code = torch.bucketize(x.abs().float().contiguous(), mids).to(torch.uint8)
    return torch.where(x < 0, code | 0x80, code)


def fp8_decode(b):
    """e4m3 bytes (uint8) -> float32."""
    values, _ = _fp8_tables(b.device)
    return values[b.long()]


def kept_blocks(num_blocks, topk, block_size, sparsity):
    """Blocks one SPIN row keeps (docs/design.md §5; spin::KeptBlocks)."""
    floor_blocks = -(-topk // block_size)
    want = math.ceil((1.0 - sparsity) * num_blocks - 1e-6)
    return min(num_blocks, max(floor_blocks, max(0, want)))


def check_paged_indexer(device, kernel="auto", seed=7):
    """Self-check of torch.ops.spind.paged_indexer on `device` against float64 on a small random
    problem (next_n 2, ragged lengths, scattered pages): every logit within the kernels'
    tolerance (docs/cuda-backend.md: 1e-5 of sum_h |w_h||q_h.k| scale, plus for wgmma, whose fp8
    tensor cores accumulate with fewer bits, 2^-10 of sum_h |w_h| sum_d |q_hd k_d| scale) and
    every slot past a row's length untouched. Returns the worst error as a fraction of the
    tolerance; raises RuntimeError when a logit is out of it."""
    g = torch.Generator().manual_seed(seed)
    batch, next_n, pages, width = 4, 2, 40, 10
    rows = batch * next_n
    q = torch.randint(0, 255, (rows, INDEX_HEADS, INDEX_DIM), dtype=torch.uint8, generator=g)
    q[(q & 0x7F) == 0x7F] = 0  # no NaN
    w = torch.randn(rows, INDEX_HEADS, generator=g)
    kv = torch.randint(0, 255, (pages, PAGE_BYTES), dtype=torch.uint8, generator=g)
    kv[:, :KEY_BYTES][(kv[:, :KEY_BYTES] & 0x7F) == 0x7F] = 0
    kv[:, KEY_BYTES:] = (0.001 + 0.01 * torch.rand(pages, PAGE, generator=g)).view(torch.uint8)
    table = torch.randperm(pages, generator=g)[: batch * width].view(batch, width).int()
    lens = torch.randint(1, width * PAGE, (batch, next_n), generator=g).int()
    out = torch.full((rows, width * PAGE), -1.0, device=device)
    ops.paged_indexer(q.to(device), w.to(device), kv.to(device), table.to(device),
                      lens.to(device), out, width, next_n, kernel)
    out = out.cpu().double()
    values = fp8_e4m3_values().double()
    worst = 0.0
    for row in range(rows):
        b, r = divmod(row, next_n)
        n = int(lens[b, r])
        pg = table[b, : -(-n // PAGE)].long()
        keys = values[kv[pg, :KEY_BYTES].reshape(-1, INDEX_DIM).long()][:n]
        scales = kv[pg, KEY_BYTES:].contiguous().view(torch.float32).reshape(-1)[:n].double()
        qf = values[q[row].long()]
        wr = w[row].double()[:, None]
        dots = qf @ keys.t()
        logit = (wr * torch.relu(dots)).sum(0) * scales
        mag = (wr.abs() * dots.abs()).sum(0) * scales
        abs_mag = (wr.abs() * (qf.abs() @ keys.abs().t())).sum(0) * scales
        tol = 1e-5 * mag + 2.0 ** -10 * abs_mag + 1e-6
        worst = max(worst, float(((out[row, :n] - logit).abs() / tol).max()))
        if not bool((out[row, n:] == -1.0).all()):
            raise RuntimeError(f"paged_indexer on {device}: row {row} wrote past its length {n}")
    if not worst <= 1.0:
        raise RuntimeError(f"paged_indexer on {device}: a logit is {worst:.3g} times the "
                           "tolerance away from float64")
    return worst


class DsaEngine:
    """The engine; see the module docstring. Typical use:

        eng = DsaEngine(layers, batch, max_context, next_n=1, device="cuda")
        for i in range(batch):
            eng.admit(f"req-{i}", ctx_len, final_len)
        eng.prepare_step()            # the step's inputs into the static tensors
        eng.run("dense", "full")      # or "indexer"; graph replays on a GPU
        eng.run("spin", "full")
        m = eng.metrics()             # per layer: SPIN vs dense recall and attention error
        eng.advance()                 # contexts grow by the accepted tokens; finished requests go
    """

    def __init__(self, layers, batch, max_context, *, next_n=1, topk=2048, device="cpu",
                 sparsity=0.5, state="bf16", exploration=0.05, alpha=0.3, probe_period=0,
                 attn_heads=128, latent_dim=512, rope_dim=64, dtype=None, seed=1, window=256,
                 phrase_heavy=0.01, token_heavy=0.004, layer_heavy=0.004, acceptance=0.7,
                 kernel="auto", spin_target="", graphs=None, spin=True):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        if cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if next_n < 1:
            raise ValueError("next_n must be >= 1")
        if rope_dim % 2:
            raise ValueError("rope_dim must be even")
        self.L, self.B, self.n, self.K = layers, batch, next_n, topk
        self.R = batch * next_n
        self.pages_per_seq = -(-max_context // PAGE)
        self.max_slots = self.pages_per_seq * PAGE
        self.num_pages = batch * self.pages_per_seq
        self.dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
        self.heads, self.latent_dim, self.rope_dim = attn_heads, latent_dim, rope_dim
        self.D = latent_dim + rope_dim
        # DeepSeek-V3's softmax scale: qk head dim 128 + 64 (absorbed MLA keeps it).
        self.softmax_scale = (128 + 64) ** -0.5
        self.seed, self.window, self.acceptance, self.kernel = seed, window, acceptance, kernel
        self.heavy = (phrase_heavy, token_heavy, layer_heavy)
        self.use_graphs = cuda if graphs is None else bool(graphs)
        if self.use_graphs and not cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        self.sparsity, self.probe_period = sparsity, probe_period
        dev, R, K, L = self.device, self.R, self.K, layers

        self._constants()
        # Caches: per-layer indexer pages, one latent cache for every layer.
        self.kv = [torch.zeros(self.num_pages, PAGE_BYTES, dtype=torch.uint8, device=dev)
                   for _ in range(L)]
        self.latent = torch.zeros(self.num_pages * PAGE, self.D, dtype=self.dtype, device=dev)
        # Per-step inputs (static: CUDA graphs read them at fixed addresses).
        self.block_table = torch.zeros(batch, self.pages_per_seq, dtype=torch.int32, device=dev)
        self.seq = torch.full((batch,), -1, dtype=torch.int32, device=dev)
        self.ctx = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.q_pos = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(batch, next_n, dtype=torch.int32, device=dev)
        self.q_index = torch.zeros(L, R, INDEX_HEADS, INDEX_DIM, dtype=torch.uint8, device=dev)
        self.w_index = torch.zeros(L, R, INDEX_HEADS, dtype=torch.float32, device=dev)
        self.q_attn = torch.zeros(L, R, attn_heads, self.D, dtype=self.dtype, device=dev)
        # Outputs of each mode: per layer top-k logical slots (-1: none) and attention.
        self.topk_out = {m: torch.full((L, R, K), -1, dtype=torch.int32, device=dev)
                         for m in ("dense", "spin")}
        self.attn_out = {m: torch.zeros(L, R, attn_heads, latent_dim, dtype=self.dtype,
                                        device=dev) for m in ("dense", "spin")}
        # Dense indexer stage.
        self.width_dense = self.max_slots
        self.logits_dense = torch.empty(R, self.width_dense, dtype=torch.float32, device=dev)
        # SPIN.
        self.session = None
        if spin:
            from . import Session
            self.session = Session(layers, self.max_slots, block_size=PAGE, topk=topk,
                                   max_sequences=batch, max_rows=next_n, state=state, seed=seed,
                                   target_sparsity=sparsity, exploration=exploration,
                                   alpha=alpha, probe_period=probe_period, target=spin_target,
                                   device=dev)
            max_blocks = self.session.union_ids.shape[1]
            self.width_wide = max_blocks * PAGE
            narrow_blocks = min(max_blocks,
                                next_n * kept_blocks(max_blocks, topk, PAGE, sparsity))
            # Probe steps are dense for a sequence: no static bound short of the full table.
            self.width_narrow = self.width_wide if probe_period > 0 else narrow_blocks * PAGE
            self.logits_spin = torch.empty(R, self.width_wide, dtype=torch.float32, device=dev)
            # The widest compacted row of each layer over the narrow full steps so far.
            self.widest_seen = torch.zeros(L, dtype=torch.int32, device=dev)
            self._widest_step = torch.zeros(L, dtype=torch.int32, device=dev)
        self._topk_scratch = torch.full((R, K), -1, dtype=torch.int32, device=dev)
        self._generation = self.session.link()[1] if self.session is not None else 0
        # Attention workspaces.
        self._row_base = (torch.arange(R, device=dev) // next_n * self.pages_per_seq).view(R, 1)
        self._inv = torch.empty(R, K, dtype=torch.bool, device=dev)
        self._i64 = torch.empty(R, K, dtype=torch.int64, device=dev)
        self._blk = torch.empty(R, K, dtype=torch.int64, device=dev)
        self._off = torch.empty(R, K, dtype=torch.int64, device=dev)
        self._pg = torch.empty(R, K, dtype=torch.int32, device=dev)
        self._slot = torch.empty(R, K, dtype=torch.int64, device=dev)
        self._gath = torch.empty(R, K, self.D, dtype=self.dtype, device=dev)
        self._scores = torch.empty(R, attn_heads, K, dtype=self.dtype, device=dev)
        self._scores32 = (self._scores if self.dtype == torch.float32 else
                          torch.empty(R, attn_heads, K, dtype=torch.float32, device=dev))
        self._mx = torch.empty(R, attn_heads, 1, dtype=torch.float32, device=dev)
        self._sum = torch.empty(R, attn_heads, 1, dtype=torch.float32, device=dev)

        # Host state: requests in slots, the page pool, the step counter.
        self.slots = [None] * batch
        self.fresh = [False] * batch
        self._rng = random.Random(_seed(seed, "host"))
        self.free_pages = list(range(self.num_pages))
        self._rng.shuffle(self.free_pages)  # pages of a request are scattered, as in vLLM
        self.resets = []  # (slot, key) of every reset_sequence call
        self.t = 0
        self._graphs = {}
        self._ran = set()  # modes whose full step ran on the current inputs

    # ----------------------------------------------------------------------------- synthetic data
    def _constants(self):
        """Per-layer directions, frequencies and head sensitivities (from a CPU generator, so a
        CPU and a GPU engine with one seed hold the same constants)."""
        L, dev = self.L, self.device
        g = torch.Generator().manual_seed(_seed(self.seed, "constants"))
        half = INDEX_DIM // 2
        u = torch.randn(L, half, 2, generator=g, dtype=torch.float64)
        self.topic_u = torch.linalg.qr(u)[0].transpose(1, 2).float().to(dev)  # [L, 2, 64]
        self.theta = (torch.rand(L, half // 2, generator=g, dtype=torch.float64)
                      * math.pi / self.window).to(dev)
        self.head_c = (0.2 + torch.rand(L, INDEX_HEADS, generator=g)).to(dev)
        self.head_b = (0.1 + 0.9 * torch.rand(L, INDEX_HEADS, generator=g)).to(dev)
        self.w_base = (0.5 + torch.rand(L, INDEX_HEADS, generator=g)).to(dev)
        v = torch.randn(self.latent_dim, 2, generator=g, dtype=torch.float64)
        self.topic_v = torch.linalg.qr(v)[0].t().float().to(dev)  # [2, latent]
        self.phi = (torch.rand(self.rope_dim // 2, generator=g, dtype=torch.float64)
                    * math.pi / self.window).to(dev)
        self.head_alpha = (2.0 + 4.0 * torch.rand(L, self.heads, generator=g)).to(dev)
        self.head_beta = (0.5 + torch.rand(L, self.heads, generator=g)).to(dev)

    @staticmethod
    def _rotary(pos, freqs):
        """[N] positions, [F] frequencies -> [N, 2F] interleaved (cos, sin)(pos * freq)."""
        a = pos.double()[:, None] * freqs[None, :]
        return torch.stack((torch.cos(a), torch.sin(a)), dim=2).flatten(1).float()

    def _write_request(self, key, pages, length):
        """Writes the keys (every layer) and latents of a request's positions [0, length)
        into its pages; a pure function of (seed, key, position)."""
        dev, n = self.device, len(pages) * PAGE
        g = torch.Generator(device=dev).manual_seed(_seed(self.seed, key, "base"))
        pos = torch.arange(n, device=dev)
        phrase = torch.rand(-(-n // 8), generator=g, device=dev) < self.heavy[0]
        heavy = phrase.repeat_interleave(8)[:n] | (
            torch.rand(n, generator=g, device=dev) < self.heavy[1]) | (pos < 4)
        strength = 0.5 + torch.rand(n, generator=g, device=dev)
        topic = (torch.rand(n, generator=g, device=dev) < 0.5).long()
        page_t = torch.tensor(pages, dtype=torch.int64, device=dev)
        half = INDEX_DIM // 2
        for layer in range(self.L):
            gl = torch.Generator(device=dev).manual_seed(_seed(self.seed, key, layer))
            hl = heavy | (torch.rand(n, generator=gl, device=dev) < self.heavy[2])
            k = torch.randn(n, INDEX_DIM, generator=gl, device=dev)
            k[:, half:] += (6.0 * strength * hl)[:, None] * self.topic_u[layer][topic]
            k[:, :half] += self._rotary(pos, self.theta[layer])
            scale = k.abs().amax(dim=1).clamp(min=1e-6) / 448.0
            code = fp8_encode(k / scale[:, None])
            kv = self.kv[layer]
            kv[page_t, :KEY_BYTES] = code.view(len(pages), KEY_BYTES)
            kv[page_t, KEY_BYTES:] = scale.view(len(pages), PAGE).contiguous().view(torch.uint8)
        lat = torch.randn(n, self.D, generator=g, device=dev)
        lat[:, :self.latent_dim] += (8.0 * strength * heavy)[:, None] * self.topic_v[topic]
        lat[:, self.latent_dim:] += self._rotary(pos, self.phi)
        rows = (page_t[:, None] * PAGE + torch.arange(PAGE, device=dev)).flatten()
        self.latent[rows] = lat.to(self.dtype)
        del length  # positions past the final length are written too (never read)

    def _write_queries(self, positions, live_rows):
        """The step's indexer q and weights and attention queries of every layer, for rows at
        `positions` ([R] query positions; rows not live get zeros)."""
        dev, R, half = self.device, self.R, INDEX_DIM // 2
        g = torch.Generator(device=dev).manual_seed(_seed(self.seed, "step", self.t))
        tw = (0.3 + 0.7 * torch.rand(self.B, 2, generator=g, device=dev)).repeat_interleave(
            self.n, dim=0)  # topic weights per entry, shared by its rows
        live = live_rows[:, None].float()
        rot_a = self._rotary(positions, self.phi)
        hv_a = tw @ self.topic_v
        for layer in range(self.L):
            rot = self._rotary(positions, self.theta[layer])
            hv = tw @ self.topic_u[layer]
            q = 0.3 * torch.randn(R, INDEX_HEADS, INDEX_DIM, generator=g, device=dev)
            q[:, :, :half] += 0.3 * self.head_b[layer][None, :, None] * rot[:, None, :]
            q[:, :, half:] += self.head_c[layer][None, :, None] * hv[:, None, :]
            q *= live[:, :, None]
            self.q_index[layer].copy_(fp8_encode(q))
            w = self.w_base[layer][None, :] * (
                1 + 0.1 * torch.randn(R, INDEX_HEADS, generator=g, device=dev))
            self.w_index[layer].copy_(w * live)
            qa = 0.1 * torch.randn(R, self.heads, self.D, generator=g, device=dev)
            qa[:, :, :self.latent_dim] += self.head_alpha[layer][None, :, None] * hv_a[:, None]
            qa[:, :, self.latent_dim:] += self.head_beta[layer][None, :, None] * rot_a[:, None]
            self.q_attn[layer].copy_(qa)

    # --------------------------------------------------------------------------------- requests
    def free_slots(self):
        return [i for i, r in enumerate(self.slots) if r is None]

    def admit(self, request_id, ctx_len, final_len, slot=None):
        """Puts a request (new, or preempted earlier: same id, same content) into a free slot:
        pages for its final length, its keys and latents written, spind's sequence reset.
        Returns the slot."""
        if slot is None:
            free = self.free_slots()
            if not free:
                raise RuntimeError("dsa_engine: no free sequence slot")
            slot = free[0]
        if self.slots[slot] is not None:
            raise RuntimeError(f"dsa_engine: slot {slot} holds {self.slots[slot]['id']!r}")
        if not 1 <= ctx_len or ctx_len + self.n - 1 > final_len or final_len > self.max_slots:
            raise ValueError(f"dsa_engine: need 1 <= ctx_len ({ctx_len}) and ctx_len + next_n - "
                             f"1 <= final_len ({final_len}) <= {self.max_slots}")
        npages = -(-final_len // PAGE)
        if npages > len(self.free_pages):
            raise RuntimeError("dsa_engine: out of KV pages")
        pages = [self.free_pages.pop() for _ in range(npages)]
        key = sequence_key(request_id)
        self._write_request(key, pages, final_len)
        row = torch.zeros(self.pages_per_seq, dtype=torch.int32)
        row[:npages] = torch.tensor(pages, dtype=torch.int32)
        self.block_table[slot].copy_(row)
        if self.session is not None:
            self.session.reset_sequence(slot, key)
        self.resets.append((slot, key))
        self.slots[slot] = {"id": request_id, "key": key, "ctx": ctx_len, "final": final_len,
                            "pages": pages}
        self.fresh[slot] = True
        return slot

    def _release(self, slot):
        req = self.slots[slot]
        if req is None:
            raise RuntimeError(f"dsa_engine: slot {slot} is empty")
        self.free_pages.extend(req.pop("pages"))
        self.slots[slot] = None
        self.fresh[slot] = False
        return req

    def finish(self, slot):
        """The request in `slot` is done; its slot and pages are free. Returns its record."""
        return self._release(slot)

    def preempt(self, slot):
        """Evicts the request in `slot` (vLLM recomputes it later: admit it again with its id
        and context). Returns its record {id, key, ctx, final}."""
        return self._release(slot)

    # ------------------------------------------------------------------------------------ steps
    def prepare_step(self):
        """Copies the step's inputs (batch, lengths, queries) into the static tensors. Returns
        the number of live entries."""
        seq, ctx, lens = [-1] * self.B, [0] * self.B, [[0] * self.n for _ in range(self.B)]
        for e, req in enumerate(self.slots):
            if req is not None:
                seq[e], ctx[e] = e, req["ctx"]
                lens[e] = [req["ctx"] + r for r in range(self.n)]
        dev = self.device
        self.seq.copy_(torch.tensor(seq, dtype=torch.int32))
        self.ctx.copy_(torch.tensor(ctx, dtype=torch.int32))
        self.q_pos.copy_(torch.tensor([max(c - 1, 0) for c in ctx], dtype=torch.int32))
        self.lens.copy_(torch.tensor(lens, dtype=torch.int32))
        live = torch.tensor([s >= 0 for s in seq], device=dev).repeat_interleave(self.n)
        pos = torch.tensor([max(c - 1, 0) + r for c in ctx for r in range(self.n)], device=dev)
        self._write_queries(pos, live)
        self._ran.clear()
        return sum(s >= 0 for s in seq)

    def _topk(self, logits, lens, out32):
        """Top-k of each row's valid prefix (lens, int32 [rows]) into out32 [rows, K]: the
        indices of the K best logits, ties to the lower index, -1 past a row's length
        (spind.row_topk: reads each row's length only, as vLLM's decode top-k does, so nothing
        past it needs filling)."""
        ops.row_topk(logits, lens, self.K, out32)

    def _attend(self, mode, layer):
        """Sparse MLA attention of layer `layer` over the mode's selected logical slots."""
        idx = self.topk_out[mode][layer]
        torch.lt(idx, 0, out=self._inv)
        self._i64.copy_(idx)
        self._i64.clamp_(min=0)
        torch.div(self._i64, PAGE, rounding_mode="floor", out=self._blk)
        torch.remainder(self._i64, PAGE, out=self._off)
        self._blk.add_(self._row_base)
        torch.index_select(self.block_table.view(-1), 0, self._blk.view(-1),
                           out=self._pg.view(-1))
        self._slot.copy_(self._pg)
        self._slot.mul_(PAGE).add_(self._off)
        torch.index_select(self.latent, 0, self._slot.view(-1),
                           out=self._gath.view(-1, self.D))
        torch.bmm(self.q_attn[layer], self._gath.transpose(1, 2), out=self._scores)
        s = self._scores32
        if s is not self._scores:
            s.copy_(self._scores)
        s.mul_(self.softmax_scale)
        s.masked_fill_(self._inv.unsqueeze(1), MASKED)
        torch.amax(s, dim=2, keepdim=True, out=self._mx)
        s.sub_(self._mx).exp_()
        torch.sum(s, dim=2, keepdim=True, out=self._sum)
        s.div_(self._sum)
        if s is not self._scores:
            self._scores.copy_(s)
        torch.bmm(self._scores, self._gath[:, :, :self.latent_dim], out=self.attn_out[mode][layer])

    def _dense_body(self, full):
        lg = self.logits_dense
        for layer in range(self.L):
            ops.paged_indexer(self.q_index[layer], self.w_index[layer], self.kv[layer],
                              self.block_table, self.lens, lg, self.pages_per_seq, self.n,
                              self.kernel)
            self._topk(lg, self.lens.view(-1), self.topk_out["dense"][layer])
            if full:
                self._attend("dense", layer)

    def _spin_body(self, full, wide):
        s = self.session
        width = self.width_wide if wide else self.width_narrow
        lg = self.logits_spin[:, :width]
        # The block table is every layer's: given as the step begins, each layer's observe
        # publishes the next layer's selection (on the GPU its select then launches nothing).
        s.begin_step(self.seq, self.ctx, self.q_pos, self.n, self.block_table)
        for layer in range(self.L):
            s.select(layer)
            ops.paged_indexer(self.q_index[layer], self.w_index[layer], self.kv[layer], s.phys,
                              s.compact_len, lg, width // PAGE, self.n, self.kernel)
            out = self.topk_out["spin"][layer]
            self._topk(lg, s.compact_len.view(-1), out)
            # The outputs are read before the layer's observe: with the table given at
            # begin_step, the observe publishes the next layer's selection into them.
            if full and not wide:
                torch.amax(s.compact_len.view(-1), dim=0, out=self._widest_step[layer])
            # The remap (on probe steps the curves count this top-K) and the observation (no
            # accepted count: acceptance is not known yet) in one call.
            s.remap_and_observe(layer, out, lg)
            if full:
                self._attend("spin", layer)
        if full and not wide:
            torch.maximum(self.widest_seen, self._widest_step, out=self.widest_seen)

    def _replay(self, key, body):
        """Runs `body` eagerly, or as a CUDA graph captured at its first use (after one eager
        warm-up run on a side stream, which initialises kernels and libraries outside the
        capture)."""
        if not self.use_graphs:
            body()
            return
        graph = self._graphs.get(key)
        if graph is None:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                body()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            self._graphs[key] = graph
        graph.replay()

    def spin_wide(self):
        """True when this step's SPIN body must use the full width (a live sequence is fresh:
        its step is dense)."""
        return self.width_narrow == self.width_wide or any(
            f and r is not None for f, r in zip(self.fresh, self.slots))

    def run(self, mode, stage="full"):
        """One step of `mode` ("dense" or "spin"), `stage` "indexer" (indexer + top-k of every
        layer; SPIN's with its ops) or "full" (with the attention). Asynchronous on a GPU."""
        if stage not in ("indexer", "full"):
            raise ValueError(f"stage must be indexer or full, not {stage!r}")
        full = stage == "full"
        if mode == "dense":
            self._replay(("dense", stage), lambda: self._dense_body(full))
        elif mode == "spin":
            if self.session is None:
                raise RuntimeError("dsa_engine: built with spin=False")
            wide = self.spin_wide()
            self._replay(("spin", stage, wide), lambda: self._spin_body(full, wide))
            for e, req in enumerate(self.slots):
                if req is not None:
                    self.fresh[e] = False  # observed once: its next steps are sparse
            # Between steps: an attached session may switch to a new spind session (a restarted
            # daemon; its sequences start fresh) or run on the dense fallback (no daemon yet):
            # either way every block may be selected next step, so the wide graph runs.
            self.session.refresh()
            attached, generation = self.session.link()
            if not attached or generation != self._generation:
                self._generation = generation
                for e, req in enumerate(self.slots):
                    if req is not None:
                        self.fresh[e] = True
        else:
            raise ValueError(f"mode must be dense or spin, not {mode!r}")
        if full:
            self._ran.add(mode)

    def timed_topk(self, mode):
        """The top-k part of a mode's indexer stage alone, timed (ms): every layer's row_topk
        over the mode's logits buffer and row lengths as the last step left them (dense: the
        full contexts; SPIN: the compacted lengths). Run after that mode's step."""
        if mode == "dense":
            lg, lens = self.logits_dense, self.lens.view(-1)
        else:
            lg, lens = self.logits_spin[:, :self.width_narrow], self.session.compact_len.view(-1)
        out = self._topk_scratch
        body = lambda: [self._topk(lg, lens, out) for _ in range(self.L)]  # noqa: E731
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self._replay(("topk", mode), body)
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        body()
        return (time.perf_counter() - t0) * 1e3

    def timed_run(self, mode, stage="full"):
        """run() timed: CUDA events around it on a GPU (the graph replay), else wall time.
        Returns milliseconds."""
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            self.run(mode, stage)
            end.record(stream)
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        self.run(mode, stage)
        return (time.perf_counter() - t0) * 1e3

    def advance(self, accepted=None):
        """Ends the step: each live request's context grows by its accepted tokens (given per
        slot, else drawn: 1 + the drafts accepted in a row, each with probability
        `acceptance`); requests that cannot take another step finish. Returns the finished
        records."""
        done = []
        for e, req in enumerate(self.slots):
            if req is None:
                continue
            if accepted is not None:
                a = int(accepted[e])
            else:
                a = 1
                while a < self.n and self._rng.random() < self.acceptance:
                    a += 1
            if not 1 <= a <= self.n:
                raise ValueError(f"accepted[{e}] = {a} outside [1, {self.n}]")
            req["ctx"] += a
            if req["ctx"] + self.n - 1 > req["final"]:
                done.append(self.finish(e))
        self.t += 1
        return done

    # ---------------------------------------------------------------------------------- quality
    def live_rows(self):
        return torch.tensor([r is not None for r in self.slots],
                            device=self.device).repeat_interleave(self.n)

    def metrics(self):
        """SPIN against dense on the current step (both full steps must have run on it): per
        layer, the top-K recall (the fraction of the dense top-K slots in SPIN's top-K, over the
        live rows) and the attention output's relative error ||o_spin - o_dense|| / ||o_dense||
        (Frobenius over the live rows, in fp32)."""
        if self._ran != {"dense", "spin"}:
            raise RuntimeError("dsa_engine.metrics: run both full steps on this step first")
        live = self.live_rows()
        dummy = self.max_slots
        mark = torch.zeros(self.R, dummy + 1, dtype=torch.bool, device=self.device)
        recall, err = [], []
        for layer in range(self.L):
            d = self.topk_out["dense"][layer].long()
            s = self.topk_out["spin"][layer].long()
            d_valid, s_valid = d >= 0, s >= 0
            mark.zero_()
            mark.scatter_(1, torch.where(d_valid, d, torch.full_like(d, dummy)), True)
            mark[:, dummy] = False
            hits = (mark.gather(1, torch.where(s_valid, s, torch.full_like(s, dummy)))
                    & s_valid).sum(1)
            want = d_valid.sum(1)
            rows = live & (want > 0)
            recall.append(float((hits[rows].double() / want[rows].double()).mean())
                          if bool(rows.any()) else float("nan"))
            od = self.attn_out["dense"][layer][live].float()
            osp = self.attn_out["spin"][layer][live].float()
            err.append(float((osp - od).norm() / od.norm().clamp(min=1e-30)))
        return {"recall": recall, "rel_err": err}

    def spin_sparsity(self):
        """Per layer, SPIN's realized sparsity over its sparse (non-dense) steps so far."""
        st = self.session.stats()
        kept, total = st[:, 5].double(), st[:, 6].double()
        return [float(1 - k / t) if t > 0 else float("nan") for k, t in zip(kept, total)]

    def check_widths(self):
        """Fails if a SPIN row of a narrow step was ever wider than the narrow width (the
        narrow full SPIN steps record the widest compacted row per layer). Returns that width."""
        widest = int(self.widest_seen.max())
        limit = self.width_narrow
        if widest > limit:
            raise RuntimeError(f"dsa_engine: a SPIN row of {widest} compacted slots exceeded the "
                               f"static width {limit}")
        return widest
