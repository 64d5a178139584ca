"""STUB package root: vLLM's vllm/__init__.py re-exports the engine (LLM, SamplingParams, ...),
which pulls in everything; the harness only needs the package."""
__version__ = "0.0.0+spind-vllm-real-9aaf83ef"
