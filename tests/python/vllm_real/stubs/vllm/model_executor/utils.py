"""STUB vllm.model_executor.utils: no Inductor graph partition options (CustomOp only asks when
it compiles forward_native, which mode NONE never does)."""


def maybe_disable_graph_partition(backend):
    return {}
