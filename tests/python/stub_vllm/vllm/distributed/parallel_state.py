"""STUB tensor-parallel group: the GroupCoordinator attributes the plugin reads."""


class GroupCoordinator:
    def __init__(self, ranks, rank_in_group, cpu_group=None):
        self.ranks = list(ranks)
        self.world_size = len(self.ranks)
        self.rank_in_group = rank_in_group
        self.cpu_group = cpu_group


_TP = GroupCoordinator([0], 0)


def get_tp_group():
    return _TP
