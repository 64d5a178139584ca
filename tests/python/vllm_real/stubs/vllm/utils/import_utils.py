"""STUB vllm.utils.import_utils: has_deep_gemm() is True (the harness's fake `deep_gemm`
package is importable); the real module probes site-packages for a dozen optional kernels."""
import importlib


def has_deep_gemm():
    return True


def resolve_obj_by_qualname(qualname):
    module_name, obj_name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), obj_name)
