"""The sequence key of a request, one function for every engine integration (the DSA engine,
the vLLM plugin): exploration draws are keyed by it, so tensor-parallel ranks and restarted
processes must compute the same key from the same request id."""
import hashlib


def sequence_key(request_id):
    """blake2b of the id's text with an 8-byte digest, as a signed int64 (the ops take int64 and
    read its 64 bits unsigned). Stable across processes and runs, unlike Python's salted
    hash()."""
    digest = hashlib.blake2b(str(request_id).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)
