"""STUB vllm.config: VllmConfig and its parts as plain dataclasses with the fields vLLM's indexer
builder, CustomOp and the plugin read (the real configs are pydantic v2 dataclasses with
validation across hundreds of fields; pydantic is absent here)."""
import contextlib
import dataclasses
import types

import torch

from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode  # noqa: F401


@dataclasses.dataclass
class ModelConfig:
    max_model_len: int = 4096
    hf_config: object = dataclasses.field(
        default_factory=lambda: types.SimpleNamespace(num_hidden_layers=2))
    served_model_name: object = None
    model: str = "spind-test-model"
    dtype: torch.dtype = torch.bfloat16


@dataclasses.dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


@dataclasses.dataclass
class CacheConfig:
    block_size: int = 64
    cache_dtype: str = "auto"


@dataclasses.dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1


@dataclasses.dataclass
class SpeculativeConfig:
    num_speculative_tokens: int = 1
    method: str = "mtp"
    parallel_drafting: bool = False


@dataclasses.dataclass
class AttentionConfig:
    use_fp4_indexer_cache: bool = False


@dataclasses.dataclass
class VllmConfig:
    model_config: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig = None
    attention_config: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    compilation_config: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)


_current = VllmConfig()


def get_current_vllm_config():
    return _current


@contextlib.contextmanager
def set_current_vllm_config(vllm_config, check_compile=False, prefix=None):
    global _current
    saved, _current = _current, vllm_config
    try:
        yield
    finally:
        _current = saved


def set_current(vllm_config):
    """Harness only (vllm_real.make_builder): the config the process runs under from now on."""
    global _current
    _current = vllm_config


def get_cached_compilation_config():
    return _current.compilation_config


def get_layers_from_vllm_config(vllm_config, layer_type, layer_names=None):
    ctx = vllm_config.compilation_config.static_forward_context
    names = ctx.keys() if layer_names is None else layer_names
    return {n: ctx[n] for n in names if isinstance(ctx.get(n), layer_type)}
