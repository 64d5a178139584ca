"""STUB vllm._aiter_ops: ROCm's AITER kernels; never enabled here."""


class rocm_aiter_ops:  # noqa: N801 - vLLM's name
    @staticmethod
    def is_enabled():
        return False
