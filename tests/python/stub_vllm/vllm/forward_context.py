"""STUB forward context: get_forward_context().attn_metadata (a dict by layer name, or None in
profiling runs)."""
import contextlib


class ForwardContext:
    def __init__(self, attn_metadata):
        self.attn_metadata = attn_metadata


_current = ForwardContext(None)


def get_forward_context():
    return _current


@contextlib.contextmanager
def set_forward_context(attn_metadata):
    global _current
    previous, _current = _current, ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _current = previous
