"""STUB vllm.v1.worker.gpu_worker: Worker with vLLM's constructor arguments, load_model,
execute_model(self, scheduler_output) and sample_tokens(self, grammar_output) over the stub runner. The real worker initialises CUDA,
NCCL and the model; the plugin's SpindWorker subclasses this one in tests."""
import torch

from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class Worker:
    def __init__(self, vllm_config, local_rank=0, rank=0, distributed_init_method=None,
                 is_driver_worker=False):
        self.vllm_config = vllm_config
        self.local_rank = local_rank
        self.rank = rank
        self.device = harness.platform.PLATFORM.device  # noqa: F821
        self.model_runner = GPUModelRunner(vllm_config, torch.device(self.device))

    def load_model(self):
        self.model_runner.load_model()

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        return self.model_runner.sample_tokens(grammar_output)
