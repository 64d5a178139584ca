"""STUB vllm.v1.kv_cache_interface: the spec classes the indexer builder checks (block_size,
storage_block_size, MLAAttentionSpec.compress_ratio; DeepSeek-V3.2's indexer cache is an
MLAAttentionSpec with one head of 128 fp8 + 4 scale bytes). The real module sizes and pages
every cache kind."""
import dataclasses
import enum

import torch


class KVQuantMode(enum.Enum):
    NONE = 0
    FP8_PER_TENSOR = 1


def get_kv_quant_mode(kv_cache_dtype):
    return KVQuantMode.NONE if kv_cache_dtype in (None, "auto") else KVQuantMode.FP8_PER_TENSOR


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    block_size: int

    @property
    def storage_block_size(self):
        return self.block_size


@dataclasses.dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int = 1
    head_size: int = 132
    dtype: torch.dtype = torch.uint8


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    pass


@dataclasses.dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    cache_dtype_str: str = None
    compress_ratio: int = 1


@dataclasses.dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    pass
