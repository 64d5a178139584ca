"""spind_vllm: the vLLM plugin that runs DeepSeek-V3.2's DSA indexer on SPIN (spind).

Installed with `pip install ./python` on a vLLM host, it declares the `vllm.general_plugins`
entry point `spind = "spind_vllm:register"`, which vLLM calls in every process before the model
is built. `register()`:
  1. defines our torch op spind_vllm::sparse_attn_indexer (mutates the top-K buffer; fake impl);
  2. appends it to CompilationConfig._attention_ops, the list vLLM's own indexer op is in (the
     default splitting_ops are copied from it), so it is a splitting op exactly as vLLM's is;
  3. registers SpindSparseAttnIndexer with CustomOp.register_oot(name="SparseAttnIndexer"): every
     SparseAttnIndexer vLLM constructs is ours, and its forward calls our op;
  4. wraps DeepseekV32IndexerMetadataBuilder.build to begin each step's batch on the session.
Sessions are opened by the worker class, `--worker-cls spind_vllm.worker.SpindWorker`, which also
runs the step boundary (slots, resets, TP control broadcast, refresh). Without it every step is
dense. Written against one vLLM commit (spind_vllm.pinned); `scripts/vllm-preflight` checks a
host's vLLM against it. See docs/vllm.md.
"""
import logging

from .pinned import OOT_NAME, SPIND_INDEXER_OP, VLLM_COMMIT  # noqa: F401

log = logging.getLogger("spind_vllm")

_registered = False
# What register() changed, for logs, tests and scripts/vllm-preflight.
PATCHED = {}


def _make_layer_class():
    import torch
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.utils.torch_utils import _resolve_layer_name

    from . import _state

    class SpindSparseAttnIndexer(SparseAttnIndexer):
        """vLLM's SparseAttnIndexer whose forward calls spind_vllm::sparse_attn_indexer.

        A subclass, so vLLM's own __init__ (its arguments, its checks) runs unchanged; the
        layer number comes from the indexer cache's prefix (MTP draft layers lie beyond the
        session's layers and stay dense)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.spin_prefix = _resolve_layer_name(self.k_cache.prefix)
            self.spin_layer = _state.layer_index(self.spin_prefix)
            _state.STATE.note_layer(self.spin_layer, self.topk_tokens)

        def _spind_forward(self, hidden_states, q_quant, k, weights):
            if isinstance(q_quant, tuple):
                q_values, q_scale = q_quant
            else:
                q_values, q_scale = q_quant, None
            torch.ops.spind_vllm.sparse_attn_indexer(
                hidden_states, self.spin_prefix, self.k_cache.kv_cache, q_values, q_scale, k,
                weights, self.quant_block_size, self.scale_fmt, self.topk_tokens,
                self.head_dim, self.max_model_len, self.max_total_seq_len,
                self.topk_indices_buffer, self.skip_k_cache_insert, self.use_fp4_cache,
                self.spin_layer)
            return self.topk_indices_buffer

        # CustomOp dispatches to forward_cuda when the op is enabled, forward_native when it
        # is not (custom_ops "none", the default under Inductor): both go to our op.
        def forward_cuda(self, hidden_states, q_quant, k, weights):
            return self._spind_forward(hidden_states, q_quant, k, weights)

        def forward_native(self, hidden_states, q_quant, k, weights):
            return self._spind_forward(hidden_states, q_quant, k, weights)

    return SpindSparseAttnIndexer


def _wrap_builder():
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder as B

    from . import _state
    if getattr(B.build, "_spind_wrapped", False):
        return B
    original = B.build

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = original(self, common_prefix_len, common_attn_metadata, fast_build)
        try:
            _state.STATE.on_build(self, common_attn_metadata, metadata)
        except _state.DenseStepFailed:
            raise
        except Exception:  # noqa: BLE001 - never fail vLLM's step for SPIN: this step is dense
            log.exception("spind_vllm: begin_step failed; this step runs dense")
            _state.STATE.fail_dense(metadata, "begin_step failed")
        return metadata

    build._spind_wrapped = True
    build.__wrapped__ = original
    B.build = build
    return B


def register():
    """The vllm.general_plugins entry point. Idempotent (vLLM may call it more than once)."""
    global _registered
    if _registered:
        return
    from vllm.config.compilation import CompilationConfig
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    from ._op import register_op
    register_op()
    ops = CompilationConfig._attention_ops
    if SPIND_INDEXER_OP not in ops:
        ops.append(SPIND_INDEXER_OP)
    if OOT_NAME not in op_registry_oot:
        CustomOp.register_oot(_make_layer_class(), name=OOT_NAME)
    builder = _wrap_builder()
    PATCHED.update({
        "custom_op": f"{OOT_NAME} -> {op_registry_oot[OOT_NAME].__qualname__}",
        "splitting_ops": f"CompilationConfig._attention_ops += {SPIND_INDEXER_OP}",
        "builder": f"{builder.__module__}.{builder.__qualname__}.build (wrapped)",
        "worker": "spind_vllm.worker.SpindWorker (--worker-cls)",
    })
    _registered = True
    log.info("spind_vllm registered (written against vLLM %s): %s", VLLM_COMMIT, PATCHED)
