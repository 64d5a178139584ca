"""STUB vllm.v1.worker.gpu_input_batch: InputBatch.req_ids in batch order (set by the test);
the real persistent batch holds every request's tokens, sampling state and block tables."""


class InputBatch:
    def __init__(self, req_ids=None):
        self._req_ids = list(req_ids or [])

    @property
    def req_ids(self):
        return self._req_ids

    @req_ids.setter
    def req_ids(self, ids):
        self._req_ids = list(ids)

    @property
    def num_reqs(self):
        return len(self._req_ids)
