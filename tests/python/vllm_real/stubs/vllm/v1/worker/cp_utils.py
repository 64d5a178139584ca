"""STUB vllm.v1.worker.cp_utils: no context parallelism (world size 1); the real helper reads
the initialised prefill/decode context-parallel groups."""


def get_total_cp_world_size():
    return 1
