"""STUB vllm.model_executor.offloader.base: no weight offloading; the offloader's hooks are
no-ops."""


class _NoOffloader:
    def sync_prev_onload(self):
        return None

    def join_after_forward(self):
        return None


def get_offloader():
    return _NoOffloader()
