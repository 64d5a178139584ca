"""STUB indexer metadata (pinned dataclass fields) and builder (pinned build parameters).

build(): decode requests first (query length <= 1 + speculative tokens), decode seq_lens 2-D
[B, next_n] with [b, j] = L_b - next_n + j + 1, requires_padding when decode lengths differ,
schedule metadata from get_paged_mqa_logits_metadata. The prefill part is the stub's own
(one chunk, per-token context lengths): the plugin never reads it."""
from dataclasses import dataclass

import torch

from vllm.utils.deep_gemm import get_paged_mqa_logits_metadata


@dataclass
class DeepseekV32IndexerPrefillChunkMetadata:
    block_table: torch.Tensor
    token_ctx: torch.Tensor
    token_start: int
    token_end: int


@dataclass
class DeepseekV32IndexerPrefillMetadata:
    chunks: list


@dataclass
class DeepSeekV32IndexerDecodeMetadata:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    decode_lens: torch.Tensor
    requires_padding: bool
    schedule_metadata: torch.Tensor


@dataclass
class DeepseekV32IndexerMetadata:
    seq_lens: torch.Tensor
    max_seq_len: int
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: DeepSeekV32IndexerDecodeMetadata = None
    prefill: DeepseekV32IndexerPrefillMetadata = None


class DeepseekV32IndexerMetadataBuilder:
    reorder_batch_threshold = 1

    def __init__(self, kv_cache_spec, num_speculative_tokens=0, num_sms=8):
        self.kv_cache_spec = kv_cache_spec
        self.num_speculative_tokens = num_speculative_tokens
        self.reorder_batch_threshold = 1 + num_speculative_tokens
        self.num_sms = num_sms
        self.compress_ratio = 1

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        m = common_attn_metadata
        qlens = torch.diff(m.query_start_loc_cpu).tolist()
        nd = 0
        while nd < m.num_reqs and qlens[nd] <= self.reorder_batch_threshold:
            nd += 1
        nd_tokens = sum(qlens[:nd])
        next_n = 1 + self.num_speculative_tokens
        decode = None
        if nd:
            lens = m.seq_lens[:nd]
            seq_lens = torch.stack([lens - next_n + j + 1 for j in range(next_n)], 1).to(
                torch.int32)
            decode = DeepSeekV32IndexerDecodeMetadata(
                block_table=m.block_table_tensor[:nd].contiguous(), seq_lens=seq_lens,
                decode_lens=torch.tensor(qlens[:nd], dtype=torch.int32),
                requires_padding=min(qlens[:nd]) != max(qlens[:nd]),
                schedule_metadata=get_paged_mqa_logits_metadata(
                    seq_lens, self.kv_cache_spec.block_size, self.num_sms))
        prefill = None
        if nd < m.num_reqs:
            ctx, rows = [], []
            for r in range(nd, m.num_reqs):
                start = int(m.seq_lens[r]) - qlens[r]
                for i in range(qlens[r]):
                    ctx.append(start + i + 1)
                    rows.append(r)
            prefill = DeepseekV32IndexerPrefillMetadata([DeepseekV32IndexerPrefillChunkMetadata(
                block_table=m.block_table_tensor[torch.tensor(rows)].contiguous(),
                token_ctx=torch.tensor(ctx, dtype=torch.int32), token_start=nd_tokens,
                token_end=m.num_actual_tokens)])
        return DeepseekV32IndexerMetadata(
            seq_lens=m.seq_lens, max_seq_len=m.max_seq_len, slot_mapping=m.slot_mapping,
            num_decodes=nd, num_decode_tokens=nd_tokens, num_prefills=m.num_reqs - nd,
            num_prefill_tokens=m.num_actual_tokens - nd_tokens, decode=decode, prefill=prefill)
