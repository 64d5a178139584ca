"""STUB vllm.forward_context: set_forward_context / get_forward_context with the attn_metadata
(a dict by layer name, or None in profiling runs) and the batch descriptor. The real module also
coordinates data parallelism, micro-batches and KV connectors."""
import contextlib
import dataclasses

from vllm.config import CUDAGraphMode


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int
    num_reqs: int = None
    uniform: bool = False
    has_lora: bool = False
    num_active_loras: int = 0


@dataclasses.dataclass
class ForwardContext:
    attn_metadata: object = None
    vllm_config: object = None
    virtual_engine: int = 0
    num_tokens: int = None
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor = None
    ubatch_slices: object = None
    slot_mapping: object = None
    no_compile_layers: dict = dataclasses.field(default_factory=dict)


_forward_context = None


def is_forward_context_available():
    return _forward_context is not None


def get_forward_context():
    assert _forward_context is not None, (
        "Forward context is not set. Please use `set_forward_context` to set the forward "
        "context.")
    return _forward_context


@contextlib.contextmanager
def override_forward_context(forward_context):
    global _forward_context
    saved, _forward_context = _forward_context, forward_context
    try:
        yield
    finally:
        _forward_context = saved


@contextlib.contextmanager
def set_forward_context(attn_metadata, vllm_config=None, virtual_engine=0, num_tokens=None,
                        num_tokens_across_dp=None, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                        batch_descriptor=None, ubatch_slices=None, slot_mapping=None,
                        skip_compiled=False):
    ctx = ForwardContext(attn_metadata=attn_metadata, vllm_config=vllm_config,
                         virtual_engine=virtual_engine, num_tokens=num_tokens,
                         cudagraph_runtime_mode=cudagraph_runtime_mode,
                         batch_descriptor=batch_descriptor, ubatch_slices=ubatch_slices,
                         slot_mapping=slot_mapping)
    with override_forward_context(ctx):
        yield ctx
