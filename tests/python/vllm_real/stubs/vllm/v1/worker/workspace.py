"""STUB vllm.v1.worker.workspace: current_workspace_manager().get_simultaneous(*(shape, dtype))
returns plain tensors, one persistent buffer per position and dtype (grown when too small), on
the platform stand-in's device. The real manager carves them from one shared allocation and
locks its size after warm-up."""
import torch


class WorkspaceManager:
    def __init__(self, device):
        self.device = torch.device(device)
        self._buffers = {}

    def get_simultaneous(self, *shapes_and_dtypes):
        out = []
        for i, (shape, dtype) in enumerate(shapes_and_dtypes):
            numel = 1
            for s in shape:
                numel *= int(s)
            buf = self._buffers.get((i, dtype))
            if buf is None or buf.numel() < numel:
                buf = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
                self._buffers[(i, dtype)] = buf
            out.append(buf[:numel].view(tuple(shape)))
        return out


_manager = None


def init_workspace_manager(device, num_ubatches=None):
    global _manager
    _manager = WorkspaceManager(device)
    return _manager


def is_workspace_manager_initialized():
    return _manager is not None


def current_workspace_manager():
    global _manager
    device = harness.platform.PLATFORM.device  # noqa: F821
    if _manager is None or _manager.device != torch.device(device):
        _manager = WorkspaceManager(device)
    return _manager
