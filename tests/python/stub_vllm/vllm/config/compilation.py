"""STUB CompilationConfig: the class-level _attention_ops list and the default splitting_ops
copied from it (set_splitting_ops_for_v1), as at the pinned commit."""
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class CompilationConfig:
    splitting_ops: list = None
    _attention_ops: ClassVar[list] = [
        "vllm::unified_attention_with_output",
        "vllm::unified_mla_attention_with_output",
        "vllm::sparse_attn_indexer",
        "vllm::rocm_aiter_sparse_attn_indexer",
    ]

    def set_splitting_ops_for_v1(self, all2all_backend="", data_parallel_size=1):
        if self.splitting_ops is None:
            self.splitting_ops = list(self._attention_ops)

    def splitting_ops_contain_attention(self):
        return self.splitting_ops is not None and all(
            op in self.splitting_ops for op in self._attention_ops)
