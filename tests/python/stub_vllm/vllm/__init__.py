"""STUB vLLM for spind's tests (tests/python/test_vllm_plugin.py, scripts/vllm-preflight).

Not vLLM. It reproduces only the names and signatures spind_vllm touches, as they are at the
pinned commit (spind_vllm/pinned.py), with small CPU reference bodies written for these tests
(float32 where vLLM uses fp8). Nothing here is vLLM's code.
"""
__version__ = "0.0.0+spind-stub-9aaf83ef"
