"""The one vLLM version spind_vllm is written against, and every name and signature it touches.

vLLM main at commit 9aaf83ef502fc37bc647f6e474314d48ba36cd1c (2026-05-19, "[CI failure]
Temporarily disable using persistent cache for flashinfer autotune (#43119)"), read from a
mirror that carries upstream's history (github:local-inference-lab/vllm, whose fork commits
start after it). Files read: vllm/model_executor/custom_op.py,
vllm/model_executor/layers/sparse_attn_indexer.py, vllm/config/compilation.py,
vllm/v1/attention/backends/mla/indexer.py, vllm/utils/deep_gemm.py, vllm/_custom_ops.py,
vllm/utils/torch_utils.py, vllm/plugins/__init__.py, vllm/engine/arg_utils.py,
vllm/v1/worker/gpu_worker.py, vllm/v1/worker/gpu_input_batch.py, vllm/v1/core/sched/output.py,
vllm/distributed/parallel_state.py, vllm/compilation/breakable_cudagraph.py,
vllm/model_executor/models/deepseek_v2.py.

`SIGNATURES` lists (module, qualified name, parameter names in order or None for "exists");
`scripts/vllm-preflight` checks each with inspect on a host that has vLLM, and the plugin
checks the few it cannot work without when it registers. Only names and signatures (facts)
are recorded here; nothing of vLLM's code.
"""

VLLM_COMMIT = "9aaf83ef502fc37bc647f6e474314d48ba36cd1c"
VLLM_COMMIT_DATE = "2026-05-19"

# The custom op vLLM registers for the indexer, and ours.
VLLM_INDEXER_OP = "vllm::sparse_attn_indexer"
SPIND_INDEXER_OP = "spind_vllm::sparse_attn_indexer"
OOT_NAME = "SparseAttnIndexer"  # the class name CustomOp.__new__ looks up in op_registry_oot

SIGNATURES = [
    ("vllm.plugins", "load_general_plugins", []),
    ("vllm.plugins", "DEFAULT_PLUGINS_GROUP", None),
    ("vllm.model_executor.custom_op", "CustomOp.register_oot", ["_decorated_op_cls", "name"]),
    ("vllm.model_executor.custom_op", "op_registry_oot", None),
    ("vllm.model_executor.layers.sparse_attn_indexer", "SparseAttnIndexer.__init__",
     ["self", "k_cache", "quant_block_size", "scale_fmt", "topk_tokens", "head_dim",
      "max_model_len", "max_total_seq_len", "topk_indices_buffer", "skip_k_cache_insert",
      "use_fp4_cache"]),
    ("vllm.model_executor.layers.sparse_attn_indexer", "SparseAttnIndexer.forward_native",
     ["self", "hidden_states", "q_quant", "k", "weights"]),
    ("vllm.model_executor.layers.sparse_attn_indexer", "SparseAttnIndexer.forward_cuda",
     ["self", "hidden_states", "q_quant", "k", "weights"]),
    ("vllm.model_executor.layers.sparse_attn_indexer", "sparse_attn_indexer",
     ["hidden_states", "k_cache_prefix", "kv_cache", "q_quant", "q_scale", "k", "weights",
      "quant_block_size", "scale_fmt", "topk_tokens", "head_dim", "max_model_len",
      "total_seq_lens", "topk_indices_buffer", "skip_k_cache_insert", "use_fp4_cache"]),
    ("vllm.model_executor.layers.sparse_attn_indexer", "kv_cache_as_quant_view",
     ["kv_cache", "head_dim", "use_fp4_cache"]),
    ("vllm.config.compilation", "CompilationConfig._attention_ops", None),
    ("vllm.config.compilation", "CompilationConfig.set_splitting_ops_for_v1", None),
    ("vllm.v1.attention.backends.mla.indexer", "DeepseekV32IndexerMetadataBuilder.build",
     ["self", "common_prefix_len", "common_attn_metadata", "fast_build"]),
    ("vllm.v1.attention.backends.mla.indexer", "DeepseekV32IndexerMetadata",
     ["seq_lens", "max_seq_len", "slot_mapping", "num_decodes", "num_decode_tokens",
      "num_prefills", "num_prefill_tokens", "decode", "prefill"]),
    ("vllm.v1.attention.backends.mla.indexer", "DeepSeekV32IndexerDecodeMetadata",
     ["block_table", "seq_lens", "decode_lens", "requires_padding", "schedule_metadata"]),
    ("vllm.utils.deep_gemm", "fp8_fp4_paged_mqa_logits",
     ["q", "kv_cache", "weights", "context_lens", "block_tables", "schedule_metadata",
      "max_model_len", "clean_logits"]),
    ("vllm.utils.deep_gemm", "get_paged_mqa_logits_metadata",
     ["context_lens", "block_size", "num_sms"]),
    ("vllm._custom_ops", "indexer_k_quant_and_cache",
     ["k", "kv_cache", "slot_mapping", "quant_block_size", "kv_cache_dtype"]),
    ("vllm.utils.torch_utils", "_resolve_layer_name", ["layer_name"]),
    # The persistent top-K's branch, as the pinned indexer takes it.
    ("vllm.model_executor.layers.sparse_attn_indexer", "RADIX_TOPK_WORKSPACE_SIZE", None),
    ("vllm.v1.worker.workspace", "current_workspace_manager", []),
    ("vllm.platforms", "current_platform", None),
    ("vllm.v1.worker.gpu_worker", "Worker.sample_tokens", ["self", "grammar_output"]),
    ("vllm.forward_context", "get_forward_context", []),
    ("vllm.v1.worker.gpu_worker", "Worker.execute_model", ["self", "scheduler_output"]),
    ("vllm.v1.worker.gpu_worker", "Worker.load_model", None),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", None),
    ("vllm.v1.core.sched.output", "SchedulerOutput",
     ["scheduled_new_reqs", "scheduled_cached_reqs", "finished_req_ids", "preempted_req_ids"]),
    ("vllm.v1.core.sched.output", "CachedRequestData", ["req_ids", "resumed_req_ids"]),
    ("vllm.v1.core.sched.output", "NewRequestData", ["req_id"]),
    ("vllm.distributed.parallel_state", "get_tp_group", []),
    ("vllm.distributed.parallel_state", "GroupCoordinator", None),
]

# Registered torch ops the SPIN decode path calls (checked by name: torch.ops.<ns>.<op>).
TORCH_OPS = [("_C", "top_k_per_row_decode"), ("_C", "persistent_topk")]
# Positional arguments of torch.ops._C.top_k_per_row_decode as the pinned indexer passes them:
# (logits, next_n, seq_lens, topk_indices, num_rows, stride0, stride1, topk_tokens); of
# torch.ops._C.persistent_topk (CUDA, top-K 512/1024/2048): (logits, seq_lens, topk_indices,
# workspace, topk_tokens, max_seq_len).
