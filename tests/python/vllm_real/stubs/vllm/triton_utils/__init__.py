"""STUB vllm.triton_utils: `triton` and `tl` are the harness's interpreter
(vllm_real/triton_interp.py), which runs vLLM's own @triton.jit kernel bodies on torch tensors
(CPU or CUDA); Triton itself is absent here and compiles for GPUs only."""
triton = harness.triton_interp.triton  # noqa: F821
tl = harness.triton_interp.tl  # noqa: F821
tldevice = tl
HAS_TRITON = True
