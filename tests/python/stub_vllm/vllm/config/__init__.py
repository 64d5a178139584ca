"""STUB (see vllm/__init__.py)."""
from .compilation import CompilationConfig  # noqa: F401
