"""STUB vllm.distributed.device_communicators.pynccl_allocator: no NCCL memory pools here."""


def set_graph_pool_id(graph_pool_id):
    return None
