"""STUB vllm.distributed.kv_transfer.kv_connector.utils: no KV connector; vLLM's default
layout."""


def get_kv_connector_cache_layout():
    return "NHD"
