"""STUB vLLM indexer: the pinned function sparse_attn_indexer (16 parameters), the
kv_cache_as_quant_view helper and the SparseAttnIndexer CustomOp with the pinned __init__ and
forward signatures. The function is a dense CPU reference over the stub kernels; it counts its
calls in DENSE_CALLS so tests can tell which path ran."""
import torch

from vllm import _custom_ops as ops
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import CustomOp
from vllm.utils.deep_gemm import fp8_fp4_paged_mqa_logits, get_paged_mqa_logits_metadata
from vllm.utils.torch_utils import _encode_layer_name, _resolve_layer_name

DENSE_CALLS = [0]


def kv_cache_as_quant_view(kv_cache, head_dim, use_fp4_cache):
    return kv_cache.unsqueeze(-2)


def sparse_attn_indexer(hidden_states, k_cache_prefix, kv_cache, q_quant, q_scale, k, weights,
                        quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                        total_seq_lens, topk_indices_buffer, skip_k_cache_insert,
                        use_fp4_cache=False):
    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return topk_indices_buffer
    DENSE_CALLS[0] += 1
    md = attn_metadata[_resolve_layer_name(k_cache_prefix)]
    n = md.slot_mapping.shape[0]
    if not skip_k_cache_insert:
        ops.indexer_k_quant_and_cache(k[:n], kv_cache, md.slot_mapping, quant_block_size,
                                      scale_fmt)
    topk_indices_buffer[: hidden_states.shape[0]] = -1
    kv = kv_cache_as_quant_view(kv_cache, head_dim, use_fp4_cache)
    if md.num_prefills > 0:
        p = md.prefill.chunks[0]  # stub: one chunk, one query row per token
        t0, t1 = p.token_start, p.token_end
        ctx = p.token_ctx.reshape(-1, 1)
        sched = get_paged_mqa_logits_metadata(ctx, kv.shape[1], 1)
        logits = fp8_fp4_paged_mqa_logits((q_quant[t0:t1].unsqueeze(1), None), kv,
                                          weights[t0:t1], ctx, p.block_table, sched,
                                          max_model_len=max_model_len, clean_logits=False)
        torch.ops._C.top_k_per_row_decode(logits, 1, ctx, topk_indices_buffer[t0:t1, :topk_tokens],
                                          t1 - t0, logits.stride(0), logits.stride(1), topk_tokens)
    if md.num_decodes > 0:
        dec = md.decode
        batch = dec.decode_lens.shape[0]
        next_n = dec.seq_lens.shape[1]
        rows = batch * next_n
        q = q_quant[:rows].reshape(batch, next_n, *q_quant.shape[1:])
        logits = fp8_fp4_paged_mqa_logits((q, None), kv, weights[:rows], dec.seq_lens,
                                          dec.block_table, dec.schedule_metadata,
                                          max_model_len=max_model_len, clean_logits=False)
        torch.ops._C.top_k_per_row_decode(logits, next_n, dec.seq_lens,
                                          topk_indices_buffer[:rows, :topk_tokens], rows,
                                          logits.stride(0), logits.stride(1), topk_tokens)
    return topk_indices_buffer


@CustomOp.register("sparse_attn_indexer")
class SparseAttnIndexer(CustomOp):
    def __init__(self, k_cache, quant_block_size, scale_fmt, topk_tokens, head_dim,
                 max_model_len, max_total_seq_len, topk_indices_buffer,
                 skip_k_cache_insert=False, use_fp4_cache=False):
        super().__init__()
        self.k_cache = k_cache
        self.quant_block_size = quant_block_size
        self.scale_fmt = scale_fmt
        self.topk_tokens = topk_tokens
        self.head_dim = head_dim
        self.max_model_len = max_model_len
        self.max_total_seq_len = max_total_seq_len
        self.topk_indices_buffer = topk_indices_buffer
        self.skip_k_cache_insert = skip_k_cache_insert
        self.use_fp4_cache = use_fp4_cache

    def forward_native(self, hidden_states, q_quant, k, weights):
        return self.forward_cuda(hidden_states, q_quant, k, weights)

    def forward_cuda(self, hidden_states, q_quant, k, weights):
        return sparse_attn_indexer(
            hidden_states, _encode_layer_name(self.k_cache.prefix), self.k_cache.kv_cache,
            q_quant, None, k, weights, self.quant_block_size, self.scale_fmt, self.topk_tokens,
            self.head_dim, self.max_model_len, self.max_total_seq_len, self.topk_indices_buffer,
            self.skip_k_cache_insert, self.use_fp4_cache)
