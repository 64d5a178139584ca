"""STUB vllm.v1.worker.gpu_model_runner: a runner with an input_batch whose load_model and
execute_model call what the test sets (load_fn, step_fn), and sample_tokens its sample_fn (where
vLLM samples and runs the MTP drafter). The real runner (7k lines) needs a
GPU, a model and the whole engine; vllm_real.batches builds the CommonAttentionMetadata it
would (read from the shared gpu_model_runner.py)."""
from vllm.v1.worker.gpu_input_batch import InputBatch


class GPUModelRunner:
    def __init__(self, vllm_config, device):
        self.vllm_config = vllm_config
        self.device = device
        self.input_batch = InputBatch()
        self.load_fn = None
        self.step_fn = None
        self.sample_fn = None

    def load_model(self, *args, **kwargs):
        if self.load_fn is not None:
            self.load_fn()

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return None if self.step_fn is None else self.step_fn(scheduler_output)

    def sample_tokens(self, grammar_output):
        return None if self.sample_fn is None else self.sample_fn(grammar_output)
