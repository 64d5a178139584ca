"""STUB (see vllm/__init__.py)."""
