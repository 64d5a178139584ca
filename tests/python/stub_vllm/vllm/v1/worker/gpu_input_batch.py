"""STUB InputBatch: req_ids in batch order."""


class InputBatch:
    def __init__(self):
        self._req_ids = []

    @property
    def req_ids(self):
        return self._req_ids
