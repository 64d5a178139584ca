"""STUB vllm.compilation.monitor: the capture-enabled check is a no-op (the real one tracks
vLLM's compilation and capture phases)."""


def validate_cudagraph_capturing_enabled():
    return None
