"""STUB vllm.utils.platform_utils: num_compute_units is the platform stand-in's num_sms (132,
an H100/H200), or the CUDA device's multiprocessor count when the platform is CUDA-like and a
GPU is there; the real module asks the current platform's driver."""
import torch


def num_compute_units(device_id=0):
    platform = harness.platform.PLATFORM  # noqa: F821
    if platform.is_cuda() and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_id or 0).multi_processor_count
    return platform.num_sms


def is_pin_memory_available():
    return False
