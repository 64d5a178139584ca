"""STUB vllm.model_executor.layers.quantization.utils.quant_utils: the fp8 e4m3 range and the
QuantKey constants backend.py names (the real module carries vLLM's whole quantization scheme
vocabulary)."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class QuantKey:
    name: str


kFp8Dynamic64Sym = QuantKey("fp8_dynamic_64_sym")
kFp8Dynamic128Sym = QuantKey("fp8_dynamic_128_sym")
kFp8StaticTensorSym = QuantKey("fp8_static_tensor_sym")
kNvfp4Dynamic = QuantKey("nvfp4_dynamic")


def get_fp8_min_max():
    return -448.0, 448.0
