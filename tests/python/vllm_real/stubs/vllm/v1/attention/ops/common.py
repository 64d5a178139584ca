"""STUB vllm.v1.attention.ops.common: pack_seq_triton / unpack_seq_triton as torch references
of the Triton kernels (vllm_real/kernels.py: pack_seq, unpack_seq); the real file is not among
the shared sources (its other helpers serve context parallelism)."""
pack_seq_triton = harness.kernels.pack_seq  # noqa: F821
unpack_seq_triton = harness.kernels.unpack_seq  # noqa: F821
