"""STUB vllm.v1.attention.backends.mla.compressor_utils: DeepSeek-V4's compressed-cache slot
mapping (compress_ratio > 1); the harness builds V3.2 indexers (compress_ratio 1) only."""


def get_compressed_slot_mapping(*args, **kwargs):
    raise NotImplementedError("vllm_real: compressed indexer caches (DeepSeek-V4) are not "
                              "stubbed")
