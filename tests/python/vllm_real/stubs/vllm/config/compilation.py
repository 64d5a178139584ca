"""STUB vllm.config.compilation: vLLM's CompilationConfig is a pydantic v2 dataclass (absent
here) with ~80 fields. What the harness keeps REAL, read from the shared file at run time: the
CompilationMode and CUDAGraphMode enums (their class bodies are executed as written) and the
list CompilationConfig._attention_ops (the splitting ops). The stub class around them holds the
fields CustomOp and the plugin read."""
import collections
import dataclasses
import enum  # noqa: F401 - the real enum bodies use it
import types
from typing import ClassVar

_REAL = harness.real_path("vllm/config/compilation.py")  # noqa: F821
harness.exec_real_definitions(_REAL, ["CompilationMode", "CUDAGraphMode"], globals())  # noqa: F821


@dataclasses.dataclass
class CompilationConfig:
    mode: "CompilationMode" = CompilationMode.NONE  # noqa: F821
    backend: str = ""
    custom_ops: list = dataclasses.field(default_factory=lambda: ["all"])
    splitting_ops: list = None
    cudagraph_mode: "CUDAGraphMode" = CUDAGraphMode.FULL_AND_PIECEWISE  # noqa: F821
    cudagraph_capture_sizes: list = None
    use_inductor_graph_partition: bool = False
    pass_config: object = dataclasses.field(default_factory=lambda: types.SimpleNamespace(
        fuse_attn_quant=False, fuse_rope_kvcache=False, enable_sp=False))
    enabled_custom_ops: collections.Counter = dataclasses.field(
        default_factory=collections.Counter)
    disabled_custom_ops: collections.Counter = dataclasses.field(
        default_factory=collections.Counter)
    static_forward_context: dict = dataclasses.field(default_factory=dict)

    _attention_ops: ClassVar[list] = harness.real_class_literal(  # noqa: F821
        _REAL, "CompilationConfig", "_attention_ops")

    def set_splitting_ops_for_v1(self, all2all_backend="", data_parallel_size=1):
        """vLLM's outcome without attention-quant fusion: under VLLM_COMPILE the default
        splitting ops are a copy of _attention_ops; other modes split nothing."""
        if self.splitting_ops is None:
            self.splitting_ops = (list(self._attention_ops)
                                  if self.mode == CompilationMode.VLLM_COMPILE else [])  # noqa: F821

    def splitting_ops_contain_attention(self):
        return self.splitting_ops is not None and all(
            op in self.splitting_ops for op in self._attention_ops)
