"""spind_vllm::sparse_attn_indexer, our registered torch op: the indexer with SPIN on decode.

Same arguments as the pinned vllm::sparse_attn_indexer plus `spin_layer`; it mutates
`topk_indices_buffer` and returns nothing (the layer returns the buffer). It is added to
CompilationConfig._attention_ops (a splitting op): eager inside piecewise graphs, captured
inside FULL decode graphs, so the SPIN path below launches only graph-safe work (spind's ops on
the current stream, the engine's kernels, copies between fixed buffers).

Decode on SPIN, per layer: select(layer, block_table) -> the engine's paged logits over s.phys
with s.compact_len (and schedule metadata for those lengths) -> top-K over the compacted
lengths -> s.remap_and_observe(layer, topk, logits): the remap to logical slots (on probe
steps the miss curves count vLLM's own top-K) and the observation (no accepted argument:
acceptance is known only after sampling, so the data plane applies row 0 only;
docs/lab/mtp-contract.md) in one call. Everything else (prefill, mixed or
non-uniform batches, profiling runs, MTP draft layers, FP4 caches, compressed caches) calls
vLLM's own indexer function: dense.
"""
import importlib
import logging

import torch

from . import _state
from .pinned import SPIND_INDEXER_OP

log = logging.getLogger("spind_vllm")

_SCHEMA = ("sparse_attn_indexer(Tensor hidden_states, str k_cache_prefix, Tensor kv_cache, "
           "Tensor q_quant, Tensor? q_scale, Tensor? k, Tensor weights, int quant_block_size, "
           "str? scale_fmt, int topk_tokens, int head_dim, int max_model_len, "
           "int total_seq_lens, Tensor(a!) topk_indices_buffer, bool skip_k_cache_insert, "
           "bool use_fp4_cache, int spin_layer) -> ()")

_lib = None


def _mod(name):
    return importlib.import_module(name)


def _dense(args, reason):
    """vLLM's own indexer (the pinned function, called with its 16 positional arguments)."""
    _state.STATE.note_dense(reason)
    sai = _mod("vllm.model_executor.layers.sparse_attn_indexer")
    sai.sparse_attn_indexer(*args)


def _why_not_spin(st, layer, md, q_scale, use_fp4_cache, topk_tokens, max_model_len):
    if st.session is None:
        return "no session"
    if not st.spin_step:
        return st.dense_reason or "step not begun"
    if layer < 0 or layer >= st.layers:
        return "layer outside the session (e.g. an MTP draft layer)"
    if use_fp4_cache or q_scale is not None:
        return "FP4 indexer cache"
    if md.num_prefills > 0 or md.decode is None:
        return "prefill or mixed batch"
    dec = md.decode
    # A batch padded to a captured size has requires_padding set (its padding requests have no
    # query tokens): the begun step holds them as padding entries, so it runs on SPIN.
    if dec.seq_lens.dim() != 2 or dec.seq_lens.shape[1] != st.rows:
        return "non-uniform or flattened decode"
    if dec.decode_lens.shape[0] != st.batch_size:
        return "batch differs from the begun step"
    if topk_tokens != st.topk:
        return "top-K differs from the session's"
    return None


def sparse_attn_indexer(hidden_states, k_cache_prefix, kv_cache, q_quant, q_scale, k, weights,
                        quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                        total_seq_lens, topk_indices_buffer, skip_k_cache_insert,
                        use_fp4_cache, spin_layer):
    args = (hidden_states, k_cache_prefix, kv_cache, q_quant, q_scale, k, weights,
            quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len, total_seq_lens,
            topk_indices_buffer, skip_k_cache_insert, use_fp4_cache)
    st = _state.STATE
    attn_metadata = _mod("vllm.forward_context").get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):  # profiling run: vLLM reserves its workspaces
        return _dense(args, "profiling run")
    md = attn_metadata[k_cache_prefix]
    reason = _why_not_spin(st, spin_layer, md, q_scale, use_fp4_cache, topk_tokens,
                           max_model_len)
    if reason is not None:
        return _dense(args, reason)
    st.counters["spin_calls"] += 1
    spin_path(st, md, hidden_states, kv_cache, q_quant, k, weights, quant_block_size, scale_fmt,
              topk_tokens, head_dim, max_model_len, topk_indices_buffer, skip_k_cache_insert,
              spin_layer)


def spin_path(st, md, hidden_states, kv_cache, q_quant, k, weights, quant_block_size, scale_fmt,
              topk_tokens, head_dim, max_model_len, topk_indices_buffer, skip_k_cache_insert,
              spin_layer):
    """The SPIN decode path of one layer: what a FULL CUDA graph captured here replays, with
    no Python decision in between. So whatever the step boundary decides after the capture
    (dense included) must be in the session's begun step (spind_vllm._state)."""
    ops = _mod("vllm._custom_ops")
    deep_gemm = _mod("vllm.utils.deep_gemm")
    sai = _mod("vllm.model_executor.layers.sparse_attn_indexer")
    s = st.session

    # The step's K goes into the indexer cache first, as the dense path does.
    num_tokens = md.slot_mapping.shape[0]
    if not skip_k_cache_insert:
        ops.indexer_k_quant_and_cache(k[:num_tokens], kv_cache, md.slot_mapping,
                                      quant_block_size, scale_fmt)
    topk_indices_buffer[: hidden_states.shape[0]] = -1

    dec = md.decode
    batch = dec.decode_lens.shape[0]
    next_n = st.rows
    rows = batch * next_n
    q = q_quant[:rows].reshape(batch, next_n, *q_quant.shape[1:])
    s.select(spin_layer, dec.block_table)
    # [batch, next_n] compacted lengths and the compacted physical block table: prefixes of
    # the arena's [max_seqs, max_rows] and [max_seqs, max_blocks] buffers (contiguous).
    compact_len = s.compact_len[:batch, :next_n]
    phys = s.phys[:batch]
    schedule = deep_gemm.get_paged_mqa_logits_metadata(compact_len, st.block_size, st.num_sms)
    logits = deep_gemm.fp8_fp4_paged_mqa_logits(
        (q, None), sai.kv_cache_as_quant_view(kv_cache, head_dim, False), weights[:rows],
        compact_len, phys, schedule, max_model_len=max_model_len, clean_logits=False)
    topk = st.topk_buf
    topk.fill_(-1)
    # vLLM's own choice of top-K kernel (so at sparsity 0 the indices are vLLM's bit for bit):
    # persistent_topk on CUDA at top-K 512/1024/2048 (DeepSeek-V3.2's is 2048), the per-row
    # decode kernel otherwise. md.max_seq_len bounds the compacted lengths as it bounds vLLM's.
    platform = _mod("vllm.platforms").current_platform
    if platform.is_cuda() and topk_tokens in (512, 1024, 2048):
        (workspace,) = _mod("vllm.v1.worker.workspace").current_workspace_manager() \
            .get_simultaneous(((sai.RADIX_TOPK_WORKSPACE_SIZE,), torch.uint8))
        torch.ops._C.persistent_topk(logits, compact_len, topk[:rows], workspace, topk_tokens,
                                     md.max_seq_len)
    else:
        torch.ops._C.top_k_per_row_decode(logits, next_n, compact_len, topk[:rows], rows,
                                          logits.stride(0), logits.stride(1), topk_tokens)
    # Compacted slots -> logical slots, every begun entry's rows (on a probe step the engine's
    # own top-K is the dense top-K the miss curves count), and the EMA from the logits, in one
    # call (on the GPU the remap runs inside observe's first launch).
    s.remap_and_observe(spin_layer, topk, logits)
    topk_indices_buffer[:rows, :topk_tokens] = topk[:rows]


def _fake(*args):
    return None


def register_op():
    """Defines spind_vllm::sparse_attn_indexer once per process (CPU and CUDA kernels, a fake
    implementation where torch has torch.library.register_fake). Returns the op."""
    global _lib
    if _lib is not None:
        return torch.ops.spind_vllm.sparse_attn_indexer
    ns, name = SPIND_INDEXER_OP.split("::")
    lib = torch.library.Library(ns, "DEF")
    lib.define(_SCHEMA)
    impl = sparse_attn_indexer
    try:  # vLLM's breakable-CUDA-graph break point, as its own indexer op has (pinned vLLM)
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture
        impl = eager_break_during_capture(impl)
    except Exception:  # noqa: BLE001 - absent in other versions: nothing to break on
        pass
    for key in ("CPU", "CUDA"):
        lib.impl(name, impl, key)
    if hasattr(torch.library, "register_fake"):
        torch.library.register_fake(SPIND_INDEXER_OP)(_fake)
    else:
        lib.impl(name, _fake, "Meta")
    _lib = lib
    return torch.ops.spind_vllm.sparse_attn_indexer
