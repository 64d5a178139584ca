"""STUB vllm.envs: the environment variables the loaded files read, with vLLM's defaults
(overridable from os.environ as in vLLM). The real module lazily evaluates ~300 variables."""
import os


def _bool(name, default):
    return lambda: bool(int(os.getenv(name, default)))


def _int(name, default):
    return lambda: int(os.getenv(name, default))


_VARS = {
    "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": _int("VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", "512"),
    "VLLM_USE_DEEP_GEMM": _bool("VLLM_USE_DEEP_GEMM", "1"),
    "VLLM_USE_DEEP_GEMM_E8M0": _bool("VLLM_USE_DEEP_GEMM_E8M0", "1"),
    "VLLM_USE_BREAKABLE_CUDAGRAPH": _bool("VLLM_USE_BREAKABLE_CUDAGRAPH", "0"),
    "VLLM_USE_LAYERNAME": _bool("VLLM_USE_LAYERNAME", "1"),
    "VLLM_CACHE_ROOT": lambda: os.path.expanduser(os.getenv("VLLM_CACHE_ROOT",
                                                            "~/.cache/vllm")),
    "VLLM_PLUGINS": lambda: (None if "VLLM_PLUGINS" not in os.environ else
                             os.environ["VLLM_PLUGINS"].split(",")),
    "VLLM_KV_CACHE_LAYOUT": lambda: os.getenv("VLLM_KV_CACHE_LAYOUT") or None,
    "VLLM_LOGGING_LEVEL": lambda: os.getenv("VLLM_LOGGING_LEVEL", "INFO").upper(),
}


def __getattr__(name):
    if name in _VARS:
        return _VARS[name]()
    raise AttributeError(f"vllm.envs (stub): {name} is not provided by tests/python/vllm_real")


def __dir__():
    return list(_VARS)
