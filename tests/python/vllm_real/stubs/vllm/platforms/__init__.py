"""STUB vllm.platforms: current_platform is the harness's StandInPlatform (vllm_real/platform.py),
whose is_cuda() the test sets; vLLM's platform detection needs a real device and its drivers."""
current_platform = harness.platform.PLATFORM  # noqa: F821
