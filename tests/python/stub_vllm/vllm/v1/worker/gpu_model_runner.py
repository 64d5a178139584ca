"""STUB model runner: an input_batch; execute_model/load_model call what the test sets."""
from vllm.v1.worker.gpu_input_batch import InputBatch


class GPUModelRunner:
    def __init__(self, vllm_config, device):
        self.vllm_config = vllm_config
        self.device = device
        self.input_batch = InputBatch()
        self.step_fn = None
        self.load_fn = None

    def load_model(self):
        if self.load_fn:
            self.load_fn()

    def execute_model(self, scheduler_output):
        return self.step_fn(scheduler_output)
