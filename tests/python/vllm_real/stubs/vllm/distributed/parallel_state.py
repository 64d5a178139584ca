"""STUB vllm.distributed.parallel_state: a GroupCoordinator with the attributes the plugin reads
(world_size, rank_in_group, ranks, cpu_group) and get_tp_group (a one-rank group unless a test
sets another). The real module builds NCCL/Gloo groups and device communicators."""


class GroupCoordinator:
    def __init__(self, ranks, rank_in_group=0, cpu_group=None, device_group=None):
        self.ranks = list(ranks)
        self.world_size = len(self.ranks)
        self.rank_in_group = rank_in_group
        self.rank = self.ranks[rank_in_group] if self.ranks else 0
        self.cpu_group = cpu_group
        self.device_group = device_group


_TP = GroupCoordinator([0], 0)


def get_tp_group():
    return _TP


def set_tp_group(group):
    """Harness only: what get_tp_group() returns from now on."""
    global _TP
    _TP = group
