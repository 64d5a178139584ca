"""STUB GPU worker: pinned load_model / execute_model(self, scheduler_output)."""
import torch

from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class Worker:
    def __init__(self, vllm_config, local_rank=0, rank=0, distributed_init_method=None,
                 is_driver_worker=False):
        self.vllm_config = vllm_config
        self.local_rank = local_rank
        self.rank = rank
        self.device = torch.device("cpu")
        self.model_runner = GPUModelRunner(vllm_config, self.device)

    def load_model(self):
        self.model_runner.load_model()

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)
