"""STUB DeepGEMM: the `deep_gemm` package that vLLM's own vllm/utils/deep_gemm.py imports.

The real wrapper module runs unmodified on top of it; the entry points are the float32
stand-ins of tests/python/vllm_real/kernels.py (DeepGEMM needs a Hopper/Blackwell GPU and its
JIT). Only the symbols the DSA indexer reaches exist; the wrapper sees the others as missing.
"""
fp8_fp4_paged_mqa_logits = harness.kernels.fp8_fp4_paged_mqa_logits  # noqa: F821
get_paged_mqa_logits_metadata = harness.kernels.get_paged_mqa_logits_metadata  # noqa: F821
fp8_fp4_mqa_logits = harness.kernels.fp8_fp4_mqa_logits  # noqa: F821


def get_num_sms():
    return harness.platform.PLATFORM.num_sms  # noqa: F821


def set_num_sms(num_sms):
    harness.platform.PLATFORM.num_sms = int(num_sms)  # noqa: F821
