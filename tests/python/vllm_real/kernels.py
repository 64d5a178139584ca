"""Stand-ins for the kernels vLLM's indexer calls: float32 references, CPU or CUDA.

What each computes is what the real kernel computes (DeepGEMM's MQA logits, vLLM's cache and
top-K ops, the pack/unpack Triton helpers), with these test-friendly choices:
  - the indexer K cache is float32 [pages, block, D] holding K unquantized (what
    indexer_k_quant_and_cache stores here); a uint8 cache in vLLM's fp8 layout
    ([pages, block, D + 4]: per page, block * D e4m3 bytes then block float32 scales) is read
    too, and written when torch has float8_e4m3fn;
  - logits past a row's length hold GARBAGE (1e30) when clean_logits is False: the real
    kernels leave those columns unwritten, and a caller that reads them is caught;
  - a top-K row lists the chosen column indices in ascending order (ties to the lower column,
    NaN below every number), -1 after them: spind.row_topk's order, and a valid order for
    vLLM's kernels (which guarantee none).
Every stand-in is vectorised torch that reads no tensor value on the host while a CUDA graph is
being captured, so the decode path can be captured (pack_seq/unpack_seq read a length, as
vLLM's own do; call prepare(device) before capturing with an fp8 cache). On CUDA
tensors the paged logits and the decode top-K use spind's reference ops
(torch.ops.spind.paged_indexer / row_topk) when spind is loaded and the shapes fit
(USE_SPIND_OPS). CALLS counts every call by name; SCHEDULE_CALLS keeps the context lengths
each schedule was built from; PERSISTENT_TOPK_MAX_SEQ_LENS the max_seq_len of each
persistent_topk call.
"""
import collections

import torch

GARBAGE = 1e30
USE_SPIND_OPS = True

CALLS = collections.Counter()
SCHEDULE_CALLS = []
PERSISTENT_TOPK_MAX_SEQ_LENS = []


def reset():
    """Clears the call records."""
    CALLS.clear()
    SCHEDULE_CALLS.clear()
    PERSISTENT_TOPK_MAX_SEQ_LENS.clear()


def _capturing():
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _spind_op(name):
    try:
        return getattr(torch.ops.spind, name)
    except Exception:  # noqa: BLE001 - spind not loaded: the torch reference runs
        return None


# ---- fp8 e4m3 ------------------------------------------------------------------------------
_E4M3 = {}


def _e4m3_values():
    v = torch.arange(256, dtype=torch.int64)
    exp, man = (v >> 3) & 15, (v & 7).double()
    mag = torch.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * torch.pow(2.0, exp - 7.0))
    val = torch.where(v >= 128, -mag, mag)
    val[(v & 0x7F) == 0x7F] = float("nan")
    return val.float()


def prepare(device):
    """Makes the device's constant tables (call before capturing a graph on that device)."""
    device = torch.device(device)
    if device not in _E4M3:
        _E4M3[device] = _e4m3_values().to(device)
    return _E4M3[device]


def fp8_decode(b):
    """e4m3 bytes (uint8) -> float32."""
    table = _E4M3.get(b.device)
    if table is None:
        if _capturing():
            raise RuntimeError(f"vllm_real.kernels.prepare({b.device}) before capturing")
        table = prepare(b.device)
    return table[b.long()]


def _as_float(x):
    return fp8_decode(x) if x.dtype == torch.uint8 else x.float()


def _float8():
    return getattr(torch, "float8_e4m3fn", None)


# ---- the indexer K cache -------------------------------------------------------------------
def _paged_keys(kv):
    """(keys [pages, block, D] float32, scales [pages, block] float32) of a cache given as
    [pages, block, W] or DeepGEMM's [pages, block, 1, W] view."""
    if kv.dim() == 4:
        kv = kv.squeeze(2)
    pages, block, width = kv.shape
    if kv.dtype != torch.uint8:
        return kv.float(), torch.ones(pages, block, dtype=torch.float32, device=kv.device)
    d = width - 4
    raw = kv.reshape(pages, block * width)
    keys = fp8_decode(raw[:, : block * d]).reshape(pages, block, d)
    scales = raw[:, block * d:].contiguous().view(torch.float32).reshape(pages, block)
    return keys, scales


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, kv_cache_dtype):
    """Writes token t's K at slot slot_mapping[t] (skipping slots < 0, as the kernel does). A
    float cache stores K as is; a uint8 cache stores e4m3 bytes with one float32 scale a token
    (amax / 448, rounded up to a power of two for "ue8m0"), which needs torch's float8."""
    CALLS["indexer_k_quant_and_cache"] += 1
    n = slot_mapping.shape[0]
    k = k[:n]
    pages, block, width = kv_cache.shape
    slots = slot_mapping.to(torch.int64)
    if kv_cache.dtype != torch.uint8:
        _scatter_slots(kv_cache, slots, k.reshape(n, width).to(kv_cache.dtype))
        return
    f8 = _float8()
    if f8 is None:
        raise NotImplementedError("vllm_real: an fp8 (uint8) indexer cache needs "
                                  "torch.float8_e4m3fn; use a float32 cache on this torch")
    d = width - 4
    if quant_block_size != d:
        raise NotImplementedError("vllm_real: one scale a token (quant_block_size == head_dim)")
    kf = k.reshape(n, d).float()
    scale = kf.abs().amax(dim=1).clamp(min=1e-4) / 448.0
    if kv_cache_dtype == "ue8m0":
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    values = (kf / scale[:, None]).to(f8).view(torch.uint8)
    raw = kv_cache.view(pages, block * width)
    _scatter_slots(raw[:, : block * d].view(pages, block, d), slots, values)
    _scatter_slots(raw[:, block * d:].view(pages, block, 4), slots,
                   scale.contiguous().view(torch.uint8).reshape(n, 4))


def _scatter_slots(dst, slots, rows):
    """dst[slot // block, slot % block] = rows[i] for slots >= 0 (dst [pages, block, X], a
    view into the cache). While a graph is being captured (no boolean indexing there) a
    negative slot rewrites slot 0 with its own value instead: block 0 is vLLM's null block,
    never a request's."""
    block = dst.shape[1]
    if _capturing():
        s = slots.clamp(min=0)
        page, off = s // block, s % block
        keep = (slots >= 0)[:, None]
        dst.index_put_((page, off), torch.where(keep, rows, dst[page, off]))
        return
    ok = slots >= 0
    s = slots[ok]
    dst[s // block, s % block] = rows[ok]


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens):
    """Gathers the chunk's requests' K into dst_k [T, D] and their scales' bytes into
    dst_scale [T, 4]: token t of request r (cu_seq_lens[r] <= t < cu_seq_lens[r + 1]) is
    position t - cu_seq_lens[r] of r's pages in block_table[r]."""
    CALLS["cp_gather_indexer_k_quant_cache"] += 1
    total = dst_k.shape[0]
    if total == 0:
        return
    pages, block, width = kv_cache.shape
    dev = kv_cache.device
    cu = cu_seq_lens.to(device=dev, dtype=torch.int64)
    t = torch.arange(total, device=dev)
    r = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp(max=cu.numel() - 2)
    pos = t - cu[r]
    page = block_table.to(dev)[r, (pos // block).clamp(max=block_table.shape[1] - 1)].long()
    slot = page.clamp(0, pages - 1) * block + pos % block
    if kv_cache.dtype != torch.uint8:
        dst_k.copy_(kv_cache.reshape(pages * block, width)[slot].to(dst_k.dtype))
        one = torch.ones(total, dtype=torch.float32, device=dev)
        dst_scale.copy_(one.view(torch.uint8).reshape(total, 4))
        return
    d = width - 4
    raw = kv_cache.view(pages, block * width)
    vals = raw[:, : block * d].reshape(pages * block, d)[slot]
    scs = raw[:, block * d:].reshape(pages * block, 4)[slot]
    if dst_k.dtype == torch.uint8 or dst_k.element_size() == 1:
        dst_k.view(torch.uint8).copy_(vals)
    else:
        dst_k.copy_(fp8_decode(vals).to(dst_k.dtype))
    dst_scale.copy_(scs)


# ---- DeepGEMM ------------------------------------------------------------------------------
def get_paged_mqa_logits_metadata(context_lens, block_size, num_sms):
    """Records the lengths the schedule is built from; the schedule itself (num_sms + 1, 2)
    int32 is zeros (the logits stand-in needs none)."""
    CALLS["get_paged_mqa_logits_metadata"] += 1
    SCHEDULE_CALLS.append(context_lens.clone())
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_tables,
                             schedule_metadata, max_model_len, clean_logits):
    """logits[b * next_n + j, c] = sum_h weights[row, h] * relu(q[b, j, h] . K[c]) * scale[c]
    for c < context_lens[b, j], K[c] at block_tables[b, c // block]; [B * next_n,
    max_model_len] float32, GARBAGE (-inf if clean_logits) elsewhere."""
    CALLS["fp8_fp4_paged_mqa_logits"] += 1
    q_values, q_scale = q
    if q_scale is not None:
        raise NotImplementedError("vllm_real: FP4 indexer queries")
    batch, next_n, heads, dim = q_values.shape
    rows = batch * next_n
    dev = q_values.device
    lens = context_lens.reshape(batch, -1)
    fill = float("-inf") if clean_logits else GARBAGE
    if _spind_paged_indexer(q_values, kv_cache, weights, lens, block_tables):
        max_pages = min(block_tables.shape[1], -(-max_model_len // 64))
        out = torch.full((rows, max(max_model_len, max_pages * 64)), fill, dtype=torch.float32,
                         device=dev)
        q8 = q_values.reshape(rows, heads, dim)
        q8 = q8 if q8.dtype == torch.uint8 else q8.view(torch.uint8)
        torch.ops.spind.paged_indexer(
            q8.contiguous(), weights[:rows].float().contiguous(), kv_cache.contiguous(),
            block_tables[:batch].to(torch.int32), lens.to(torch.int32), out, max_pages, next_n,
            "auto")
        CALLS["spind.paged_indexer"] += 1
        return out[:, :max_model_len]
    keys, scales = _paged_keys(kv_cache)
    pages, block, _ = keys.shape
    cols = torch.arange(max_model_len, device=dev)
    nblk = block_tables.shape[1]
    page = block_tables[:batch].to(dev)[:, (cols // block).clamp(max=nblk - 1)].long()
    page = page.clamp(0, pages - 1)                                    # [B, W]
    k = keys[page, cols % block]                                       # [B, W, D]
    s = scales[page, cols % block]                                     # [B, W]
    qf = _as_float(q_values)
    score = torch.relu(torch.einsum("bnhd,bwd->bnhw", qf, k))          # [B, N, H, W]
    w = weights[:rows].float().reshape(batch, next_n, heads, 1)
    logits = (w * score).sum(2) * s[:, None, :]                         # [B, N, W]
    valid = cols < lens[:, :next_n, None].to(torch.int64)
    logits = torch.where(valid, logits, torch.full((), fill, device=dev))
    return logits.reshape(rows, max_model_len)


def _spind_paged_indexer(q_values, kv_cache, weights, lens, block_tables):
    """Whether spind's fp8 paged indexer can compute these logits: CUDA, spind loaded, vLLM's
    fp8 cache layout with 64-slot pages, 64 heads of 128, fp8 queries."""
    if not (USE_SPIND_OPS and q_values.is_cuda and _spind_op("paged_indexer") is not None):
        return False
    kv = kv_cache.squeeze(2) if kv_cache.dim() == 4 else kv_cache
    _, _, heads, dim = q_values.shape
    return (kv.dtype == torch.uint8 and kv.shape[1] == 64 and kv.shape[2] == 132 and
            heads == 64 and dim == 128 and q_values.element_size() == 1 and
            block_tables.stride(-1) == 1 and lens.stride(-1) == 1)


def fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits):
    """Prefill: logits[m, n] = sum_h weights[m, h] * relu(q[m, h] . k[n]) * k_scale[n] for
    cu_seqlen_ks[m] <= n < cu_seqlen_ke[m]; [M, N] float32, GARBAGE (-inf) elsewhere."""
    CALLS["fp8_fp4_mqa_logits"] += 1
    q_values, q_scale = q
    if q_scale is not None:
        raise NotImplementedError("vllm_real: FP4 indexer queries")
    k, k_scale = kv
    dev = q_values.device
    score = torch.relu(torch.einsum("mhd,nd->mhn", _as_float(q_values), _as_float(k)))
    logits = (weights.float()[:, :, None] * score).sum(1) * k_scale.float()[None, :]
    cols = torch.arange(k.shape[0], device=dev)
    valid = (cols >= cu_seqlen_ks.to(torch.int64)[:, None]) & \
        (cols < cu_seqlen_ke.to(torch.int64)[:, None])
    fill = float("-inf") if clean_logits else GARBAGE
    return torch.where(valid, logits, torch.full((), fill, device=dev))


# ---- top-K ---------------------------------------------------------------------------------
def _order_key(x):
    """int64 keys ordered as the float32 values, NaN lowest (0), every number above it."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(u >= 2 ** 31, (2 ** 32 - 1) - u, u + 2 ** 31)
    return torch.where(torch.isnan(x), torch.zeros_like(key), key + 1)


def topk_rows(logits, starts, ends, k, out):
    """out[r, :k] = the columns c in [starts[r], ends[r]) of the k largest logits[r, c], as
    c - starts[r], ascending; -1 after them. Graph-safe (sort-based, no host reads)."""
    rows = out.shape[0]
    if rows == 0 or k == 0:
        return
    x = logits[:rows].float()
    width = x.shape[1]
    dev = x.device
    starts = starts.to(device=dev, dtype=torch.int64).reshape(rows).clamp(0, width)
    ends = ends.to(device=dev, dtype=torch.int64).reshape(rows).clamp(0, width)
    cols = torch.arange(width, device=dev)
    valid = (cols >= starts[:, None]) & (cols < ends[:, None])
    key = torch.where(valid, _order_key(x), torch.full((), -1, dtype=torch.int64, device=dev))
    kk = min(k, width)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :kk]
    count = (ends - starts).clamp(min=0)
    taken = torch.arange(kk, device=dev)[None, :] < count[:, None]
    chosen = torch.where(taken, order, torch.full((), width, dtype=order.dtype, device=dev))
    chosen = torch.sort(chosen, dim=1).values
    res = torch.where(chosen < width, chosen - starts[:, None],
                      torch.full((), -1, dtype=chosen.dtype, device=dev))
    out[:, :kk] = res.to(out.dtype)
    if k > kk:
        out[:, kk:k] = -1


def _decode_lens(seq_lens, next_n, num_rows):
    """Each row's length: seq_lens flattened when it has one value a row ([B, next_n] or
    flattened [B * next_n]); a 1-D [B] with next_n rows each gives L - next_n + j + 1."""
    lens = seq_lens.reshape(-1)
    if lens.numel() == num_rows:
        return lens
    if seq_lens.dim() == 1 and lens.numel() * next_n == num_rows:
        j = torch.arange(next_n, device=lens.device, dtype=lens.dtype)
        return (lens[:, None] - next_n + j[None, :] + 1).reshape(-1)
    raise ValueError(f"vllm_real: seq_lens {tuple(seq_lens.shape)} for {num_rows} rows "
                     f"(next_n {next_n})")


def _decode_topk(logits, lens, out, k):
    rows = out.shape[0]
    op = _spind_op("row_topk") if (USE_SPIND_OPS and logits.is_cuda) else None
    if op is not None and 1 <= k <= 8192 and logits.dtype == torch.float32 and \
            logits.stride(-1) == 1 and out.stride(-1) == 1:
        op(logits[:rows], lens.to(torch.int32).contiguous(), k, out)
        CALLS["spind.row_topk"] += 1
        return
    topk_rows(logits, torch.zeros_like(lens), lens, k, out)


def top_k_per_row_decode(logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1,
                         topk_tokens):
    """torch.ops._C.top_k_per_row_decode: row i's top-K among columns [0, len_i)."""
    CALLS["top_k_per_row_decode"] += 1
    lens = _decode_lens(seq_lens, next_n, num_rows)
    _decode_topk(logits, lens, topk_indices[:num_rows], topk_tokens)


def persistent_topk(logits, seq_lens, topk_indices, workspace, topk_tokens, max_seq_len):
    """torch.ops._C.persistent_topk: row i's top-K among columns [0, seq_lens.flatten()[i])."""
    CALLS["persistent_topk"] += 1
    PERSISTENT_TOPK_MAX_SEQ_LENS.append(int(max_seq_len))
    rows = logits.shape[0]
    lens = _decode_lens(seq_lens, 1, rows)
    _decode_topk(logits, lens, topk_indices[:rows], topk_tokens)


def top_k_per_row_prefill(logits, cu_seqlen_ks, cu_seqlen_ke, topk_indices, num_rows, stride0,
                          stride1, topk_tokens):
    """torch.ops._C.top_k_per_row_prefill: row i's top-K among columns [ks_i, ke_i), written
    relative to ks_i (a position in the row's request)."""
    CALLS["top_k_per_row_prefill"] += 1
    topk_rows(logits, cu_seqlen_ks[:num_rows], cu_seqlen_ke[:num_rows], topk_tokens,
              topk_indices[:num_rows])


_lib = None
_SCHEMAS = {
    "top_k_per_row_decode": ("top_k_per_row_decode(Tensor logits, int next_n, Tensor seq_lens, "
                             "Tensor(a!) topk_indices, int num_rows, int stride0, int stride1, "
                             "int topk_tokens) -> ()", top_k_per_row_decode),
    "top_k_per_row_prefill": ("top_k_per_row_prefill(Tensor logits, Tensor cu_seqlen_ks, "
                              "Tensor cu_seqlen_ke, Tensor(a!) topk_indices, int num_rows, "
                              "int stride0, int stride1, int topk_tokens) -> ()",
                              top_k_per_row_prefill),
    "persistent_topk": ("persistent_topk(Tensor logits, Tensor seq_lens, "
                        "Tensor(a!) topk_indices, Tensor(b!) workspace, int topk_tokens, "
                        "int max_seq_len) -> ()", persistent_topk),
}


def register_ops():
    """Defines torch.ops._C.{top_k_per_row_decode, top_k_per_row_prefill, persistent_topk}
    (CPU and CUDA kernels) once per process."""
    global _lib
    if _lib is not None:
        return
    try:
        lib = torch.library.Library("_C", "FRAGMENT")
    except ValueError:  # torch 1.13: DEF or IMPL only
        lib = torch.library.Library("_C", "DEF")
    for name, (schema, fn) in _SCHEMAS.items():
        lib.define(schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, fn, key)
    _lib = lib


# ---- vllm.v1.attention.ops.common ----------------------------------------------------------
def _bits(t):
    """An integer view of a 1-byte float tensor (float8), else the tensor: gathers and
    scatters of fp8 values move bytes."""
    if t.is_floating_point() and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def pack_seq(x, lengths, pad_value=float("-inf"), block_t=64, block_d=64):
    """pack_seq_triton: x [N, ...] of B sequences of `lengths` -> [B, max(lengths), ...],
    sequence b's tokens first, pad_value after (as bytes for uint8, cast otherwise)."""
    CALLS["pack_seq_triton"] += 1
    shape = x.shape
    xf = x.reshape(shape[0], -1)
    batch = lengths.numel()
    lmax = int(lengths.max().item()) if batch else 0
    lens = lengths.to(device=x.device, dtype=torch.int64).reshape(batch)
    starts = torch.cumsum(lens, 0) - lens
    t = torch.arange(lmax, device=x.device)
    valid = t[None, :] < lens[:, None]
    if x.dtype == torch.uint8:
        pad = torch.tensor(int(pad_value), dtype=torch.uint8)
    else:
        pad = torch.tensor(float(pad_value), dtype=torch.float32).to(x.dtype)
    out = _bits(pad.to(x.device)).expand(batch, lmax, xf.shape[1]).clone()
    if xf.shape[0]:
        src = (starts[:, None] + t[None, :]).clamp(max=xf.shape[0] - 1)
        out[valid] = _bits(xf)[src[valid]]
    out = out.view(x.dtype) if out.dtype != x.dtype else out
    return out.reshape((batch, lmax) + tuple(shape[1:]))


def unpack_seq(packed, lengths, block_t=64, block_d=64):
    """unpack_seq_triton: [B, Lmax, ...] -> [sum(lengths), ...], sequence b's first lengths[b]
    rows in order."""
    CALLS["unpack_seq_triton"] += 1
    shape = packed.shape
    batch, lmax = shape[0], shape[1]
    lens = lengths.to(device=packed.device, dtype=torch.int64).reshape(batch)
    valid = torch.arange(lmax, device=packed.device)[None, :] < lens[:, None]
    flat = _bits(packed.reshape(batch, lmax, -1))[valid]
    flat = flat.view(packed.dtype) if flat.dtype != packed.dtype else flat
    return flat.reshape((flat.shape[0],) + tuple(shape[2:]))
