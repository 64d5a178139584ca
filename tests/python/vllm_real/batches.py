"""CommonAttentionMetadata as vLLM's GPU model runner fills it, and the real indexer builder.

Read from the shared vllm/v1/worker/gpu_model_runner.py (9aaf83ef):
  - _prepare_inputs: query_start_loc = [0, cumsum(query lens)], the entries past num_reqs
    repeat the last value (non-decreasing, lines 1965-1969); optimistic seq_lens =
    num_computed + scheduled, 0 past num_reqs (1977-1982, device copy 2076-2079); slot
    mapping from the block table (2081-2085; block_table.py's kernel writes -1 past the
    tokens).
  - execute_model: a uniform decode batch dispatched to a FULL CUDA graph is padded to the
    graph's size (4063-4066; cudagraph_dispatcher.py 136-160: num_reqs = num_tokens_padded //
    (1 + num_spec_tokens)); only then (pad_attn, 4092) are the slot mapping and the metadata
    built padded (4124-4148); PIECEWISE and eager batches are built unpadded.
  - _get_slot_mappings: slot_mapping[num_tokens:num_tokens_padded] = -1 (3904).
  - _build_attention_metadata (2171-2281): block-table rows num_reqs..num_reqs_padded set
    to NULL_BLOCK_ID 0 (2226); max_seq_len the max live optimistic length, or
    max_model_len while capturing (2201-2207); seq_lens_cpu_upper_bound =
    optimistic_seq_lens_cpu[:num_reqs_padded] (2252-2253); num_reqs = num_reqs_padded,
    num_actual_tokens = num_tokens_padded, max_query_len the live maximum (2265-2281).
  - _dummy_run (capture): every request has the uniform query length and seq_len equal to it,
    every slot -1 (5666, 5685-5711).
So a padding request has query length 0, seq_len 0, a block-table row of zeros and -1 slots.
The block table is [num_reqs, cdiv(max_model_len, block_size)] rounded up to a multiple of
128 // block_size (block_table.py 249-264). Stale values the runner leaves in padding rows
(num_computed_tokens, positions) are zeros here.
"""
import types

import torch

from . import kernels as _kernels
from . import platform as _platform

NULL_BLOCK_ID = 0
PAD_SLOT_ID = -1


def cdiv(a, b):
    return -(a // -b)


def block_table_width(max_model_len, block_size=64):
    """The runner's block-table width: cdiv(max_model_len, block_size), rounded up to a
    multiple of 128 // block_size when block_size <= 128."""
    n = cdiv(max_model_len, block_size)
    if block_size <= 128:
        n = cdiv(n, 128 // block_size) * (128 // block_size)
    return n


def assign_pages(seq_lens, block_size=64, first_page=1):
    """Distinct pages for each request, in order, from `first_page` (page 0 is vLLM's null
    block): [[1, 2], [3], ...] for lengths needing 2, 1, ... pages."""
    pages, nxt = [], first_page
    for n in seq_lens:
        k = cdiv(int(n), block_size)
        pages.append(list(range(nxt, nxt + k)))
        nxt += k
    return pages


def _table(pages, rows, width, device):
    table = torch.full((rows, width), NULL_BLOCK_ID, dtype=torch.int32)
    for r, p in enumerate(pages):
        if len(p) > width:
            raise ValueError(f"request {r} needs {len(p)} pages; the table has {width}")
        if p:
            table[r, : len(p)] = torch.as_tensor(p, dtype=torch.int32)
    return table.to(device)


def batch(requests, *, padded_to=None, padded_tokens=None, block_size=None,
          max_model_len=None, block_table=None, device=None, capture=False):
    """CommonAttentionMetadata for `requests` in batch order (vLLM puts decodes first), each
    (seq_len, query_len) or (seq_len, query_len, is_prefilling): seq_len counts the tokens
    scheduled now (num_computed + query_len).

    padded_to: pad to this many requests as a FULL CUDA graph does (padded_tokens defaults to
    padded_to * query_len of a uniform batch). block_table: a [n, >= pages] tensor, or lists of
    page ids per request; default: assign_pages. capture: what _dummy_run builds while
    capturing (max_seq_len = max_model_len, every slot -1). block_size and max_model_len
    default to the current VllmConfig's (make_builder sets it)."""
    from vllm.config import get_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata

    cfg = get_current_vllm_config()
    block_size = block_size or cfg.cache_config.block_size
    max_model_len = max_model_len or cfg.model_config.max_model_len
    device = torch.device(device if device is not None else _platform.PLATFORM.device)
    reqs = [tuple(r) + ((False,) if len(r) == 2 else ()) for r in requests]
    n = len(reqs)
    seq = [int(r[0]) for r in reqs]
    qlens = [int(r[1]) for r in reqs]
    prefilling = [bool(r[2]) for r in reqs]
    if any(q > s for s, q in zip(seq, qlens)):
        raise ValueError("a request schedules more tokens than its seq_len")
    tokens = sum(qlens)
    rows = n if padded_to is None else int(padded_to)
    if rows < n:
        raise ValueError(f"padded_to {rows} < {n} live requests")
    if padded_to is None:
        tokens_padded = tokens
    elif padded_tokens is not None:
        tokens_padded = int(padded_tokens)
    elif len(set(qlens)) == 1:
        tokens_padded = rows * qlens[0]
    else:
        raise ValueError("padded_to needs padded_tokens unless the batch is uniform")
    if tokens_padded < tokens:
        raise ValueError("padded_tokens below the live tokens")

    width = block_table_width(max_model_len, block_size)
    if block_table is None:
        table = _table(assign_pages(seq, block_size), rows, width, device)
    elif isinstance(block_table, torch.Tensor):
        table = torch.full((rows, max(width, block_table.shape[1])), NULL_BLOCK_ID,
                           dtype=torch.int32, device=device)
        table[:n, : block_table.shape[1]] = block_table[:n].to(device, torch.int32)
    else:
        short = [r for r, (p, L) in enumerate(zip(block_table, seq))
                 if len(p) < cdiv(L, block_size)]
        if short:
            raise ValueError(f"requests {short} have fewer pages than their seq_len needs")
        table = _table(block_table, rows, width, device)

    cu = [0]
    for q in qlens:
        cu.append(cu[-1] + q)
    qsl_cpu = torch.tensor(cu + [cu[-1]] * (rows - n), dtype=torch.int32)
    seq_cpu = torch.tensor(seq + [0] * (rows - n), dtype=torch.int32)
    computed_cpu = torch.tensor([s - q for s, q in zip(seq, qlens)] + [0] * (rows - n),
                                dtype=torch.int32)
    positions = torch.zeros(tokens_padded, dtype=torch.int64)
    slots = torch.full((tokens_padded,), PAD_SLOT_ID, dtype=torch.int64)
    table_cpu = table.cpu()
    t = 0
    for r in range(n):
        for pos in range(seq[r] - qlens[r], seq[r]):
            positions[t] = pos
            if not capture:
                slots[t] = int(table_cpu[r, pos // block_size]) * block_size + pos % block_size
            t += 1
    if capture:
        seq_cpu[:n] = torch.tensor(qlens, dtype=torch.int32)
    max_seq_len = max_model_len if capture else (max(seq) if seq else 0)
    return CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq_cpu.to(device),
        _seq_lens_cpu=seq_cpu,
        _num_computed_tokens_cpu=computed_cpu,
        seq_lens_cpu_upper_bound=seq_cpu,
        num_reqs=rows,
        num_actual_tokens=tokens_padded,
        max_query_len=max(qlens) if qlens else 0,
        max_seq_len=max_seq_len,
        block_table_tensor=table,
        slot_mapping=slots.to(device),
        causal=True,
        is_prefilling=torch.tensor(prefilling + [False] * (rows - n), dtype=torch.bool),
        positions=positions.to(device),
    )


def decode_batch(live_lens, padded_to=None, next_n=1, block_table=None, **kw):
    """n live decode requests of next_n tokens each (seq_len live_lens[i] after this step),
    optionally padded to a captured FULL graph of padded_to requests."""
    return batch([(int(L), next_n) for L in live_lens], padded_to=padded_to,
                 block_table=block_table, **kw)


def mixed_batch(decode_lens, prefills, next_n=1, block_table=None, **kw):
    """Decodes first (seq_len, next_n tokens each), then prefill chunks given as (seq_len,
    query_len): vLLM's order after reorder_batch. Mixed batches run unpadded (PIECEWISE)."""
    reqs = [(int(L), next_n, False) for L in decode_lens]
    reqs += [(int(L), int(q), True) for L, q in prefills]
    return batch(reqs, block_table=block_table, **kw)


def capture_batch(num_reqs, next_n=1, **kw):
    """What vLLM builds while capturing a FULL decode graph of num_reqs requests."""
    return batch([(next_n, next_n)] * num_reqs, capture=True, **kw)


def make_vllm_config(max_model_len=4096, block_size=64, max_num_seqs=256,
                     num_speculative_tokens=0, max_num_batched_tokens=8192, layers=2,
                     tensor_parallel_size=1, use_fp4_indexer_cache=False):
    """The stub VllmConfig with the fields the builder, CustomOp and the plugin read."""
    from vllm.config import (AttentionConfig, CacheConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, VllmConfig)
    return VllmConfig(
        model_config=ModelConfig(max_model_len=max_model_len,
                                 hf_config=types.SimpleNamespace(num_hidden_layers=layers)),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_num_batched_tokens),
        cache_config=CacheConfig(block_size=block_size),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        speculative_config=(SpeculativeConfig(num_speculative_tokens=num_speculative_tokens)
                            if num_speculative_tokens else None),
        attention_config=AttentionConfig(use_fp4_indexer_cache=use_fp4_indexer_cache))


def make_builder(max_model_len=4096, block_size=64, max_num_seqs=16, num_speculative_tokens=0,
                 max_num_batched_tokens=2048, device="cpu", layer_names=None, head_dim=128,
                 vllm_config=None):
    """vLLM's own DeepseekV32IndexerMetadataBuilder over a stub VllmConfig and DeepSeek-V3.2's
    indexer cache spec (MLAAttentionSpec: one head of head_dim fp8 bytes + 4 scale bytes).
    The config becomes the current one (batch() reads its geometry), and the platform
    stand-in's device becomes `device` (workspaces are allocated there)."""
    from vllm.config import set_current
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    device = torch.device(device)
    _platform.PLATFORM.configure(device=device)
    if vllm_config is None:
        vllm_config = make_vllm_config(max_model_len, block_size, max_num_seqs,
                                       num_speculative_tokens, max_num_batched_tokens)
    set_current(vllm_config)
    _kernels.prepare(device)
    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_dim + 4,
                            dtype=torch.uint8)
    names = layer_names or ["model.layers.0.self_attn.indexer.k_cache"]
    return DeepseekV32IndexerMetadataBuilder(spec, names, vllm_config, device)


def new_kv_cache(num_pages, block_size=64, head_dim=128, device=None, fp8=False):
    """An indexer K cache: float32 [pages, block, head_dim] (K unquantized), or uint8
    [pages, block, head_dim + 4] in vLLM's fp8 layout when fp8."""
    device = device if device is not None else _platform.PLATFORM.device
    if fp8:
        return torch.zeros(num_pages, block_size, head_dim + 4, dtype=torch.uint8,
                           device=device)
    return torch.zeros(num_pages, block_size, head_dim, dtype=torch.float32, device=device)


def k_cache(prefix, kv_cache):
    """The object SparseAttnIndexer takes as k_cache (DeepseekV32IndexerCache's prefix and
    kv_cache)."""
    return types.SimpleNamespace(prefix=prefix, kv_cache=kv_cache)
