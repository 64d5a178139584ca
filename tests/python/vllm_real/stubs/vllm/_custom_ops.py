"""STUB vllm._custom_ops: vLLM's compiled CUDA ops (vllm._C) do not exist here. The indexer's
cache ops are the float32 stand-ins of vllm_real/kernels.py; the top-K ops are registered as
torch.ops._C.* (the real indexer calls them through torch.ops) with the same stand-ins."""
import torch

harness.kernels.register_ops()  # noqa: F821

indexer_k_quant_and_cache = harness.kernels.indexer_k_quant_and_cache  # noqa: F821
cp_gather_indexer_k_quant_cache = harness.kernels.cp_gather_indexer_k_quant_cache  # noqa: F821


def top_k_per_row_decode(*args):
    torch.ops._C.top_k_per_row_decode(*args)


def top_k_per_row_prefill(*args):
    torch.ops._C.top_k_per_row_prefill(*args)
