"""The stand-in for vllm.platforms.current_platform: neither CPU nor CUDA, set by the test.

vLLM's code asks the platform which branch to take. The questions that matter here:
  - is_cuda(): False by default ("CPU-like"); cuda_like(True) makes the real builder build
    DeepGEMM schedule metadata and the real sparse_attn_indexer take its persistent_topk
    branch (top-K 512/1024/2048), as on a GPU. The tensors may stay on the CPU either way.
  - is_cuda_alike(): always True, so the real sparse_attn_indexer imports vllm._custom_ops
    (our stand-ins) as it does on CUDA and ROCm; is_rocm/is_xpu/is_cpu/is_tpu are False, so
    CustomOp dispatches enabled ops to forward_cuda.
  - is_device_capability_family(f): f == capability // 10 * 10 (default 90, Hopper: the
    builder flattens MTP with next_n > 2, as on H100/H200).
  - fp8_dtype(): torch.float32 by default: the indexer K cache stand-in holds K unquantized
    (float32), so the prefill K-gather workspace is float32 too. Set it to
    torch.float8_e4m3fn (torch >= 2.1) to exercise fp8 workspaces.
  - device: where workspaces (and the stub worker) live; make_builder sets it.
  - dispatch_key: "CompositeExplicitAutograd", so vllm::sparse_attn_indexer has one kernel
    for CPU and CUDA tensors alike (vLLM registers it for "CUDA" only).
"""
import contextlib

import torch


class StandInPlatform:
    device_name = "spind-test"
    device_type = "cuda"
    dispatch_key = "CompositeExplicitAutograd"
    simple_compile_backend = "inductor"
    ray_device_key = "GPU"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"

    def __init__(self):
        self.cuda = False
        self.capability = 90
        self.fp8 = torch.float32
        self.num_sms = 132  # H100 / H200
        self.device = torch.device("cpu")  # where the workspaces and stub worker live

    # ---- what the tests set ----------------------------------------------------------------
    def configure(self, cuda=None, capability=None, fp8_dtype=None, num_sms=None, device=None):
        if device is not None:
            self.device = torch.device(device)
        if cuda is not None:
            self.cuda = bool(cuda)
        if capability is not None:
            self.capability = int(capability)
        if fp8_dtype is not None:
            self.fp8 = fp8_dtype
        if num_sms is not None:
            self.num_sms = int(num_sms)

    # ---- the questions vLLM asks -----------------------------------------------------------
    def is_cuda(self):
        return self.cuda

    def is_cuda_alike(self):
        return True

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_cpu(self):
        return False

    def is_tpu(self):
        return False

    def is_out_of_tree(self):
        return False

    def fp8_dtype(self):
        return self.fp8

    def support_deep_gemm(self):
        return True

    def get_device_capability(self, device_id=0):
        major, minor = divmod(self.capability, 10)
        return _Capability(major, minor)

    def has_device_capability(self, capability, device_id=0):
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return self.capability >= capability

    def is_device_capability(self, capability, device_id=0):
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return self.capability == capability

    def is_device_capability_family(self, family, device_id=0):
        return self.capability // 10 * 10 == family

    def graph_pool_handle(self):
        return torch.cuda.graph_pool_handle()

    current_stream = None


class _Capability(tuple):
    def __new__(cls, major, minor):
        return super().__new__(cls, (major, minor))

    @property
    def major(self):
        return self[0]

    @property
    def minor(self):
        return self[1]

    def to_int(self):
        return self[0] * 10 + self[1]


PLATFORM = StandInPlatform()


@contextlib.contextmanager
def cuda_like(flag=True):
    """Within the block current_platform.is_cuda() answers `flag`."""
    saved = PLATFORM.cuda
    PLATFORM.cuda = bool(flag)
    try:
        yield PLATFORM
    finally:
        PLATFORM.cuda = saved
