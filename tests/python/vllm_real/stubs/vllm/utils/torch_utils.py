"""STUB vllm.utils.torch_utils, used only where vLLM's own file cannot load: torch < 2.x has no
torch.library.infer_schema (and Debian's Python lacks `packaging`). Layer names stay plain
strings (vLLM wraps them in an opaque LayerName only on torch >= 2.11), and
direct_register_custom_op defines the op from a schema written from its annotations."""
import inspect
import types
import typing

import torch

LayerNameType = str


class LayerName:
    def __init__(self, value):
        self.value = value


def _resolve_layer_name(layer_name):
    return layer_name.value if isinstance(layer_name, LayerName) else layer_name


def _encode_layer_name(layer_name):
    return layer_name


def is_torch_equal_or_newer(target):
    def parts(v):
        return tuple(int(p) for p in v.split("+")[0].split(".")[:3] if p.isdigit())
    return parts(torch.__version__) >= parts(target)


def weak_ref_tensor(tensor):
    return tensor


def weak_ref_tensors(tensors):
    return tensors


def current_stream():
    return torch.cuda.current_stream() if torch.cuda.is_available() else None


_TYPES = {torch.Tensor: "Tensor", int: "int", float: "float", bool: "bool", str: "str"}


def _schema_type(annotation):
    if annotation in _TYPES:
        return _TYPES[annotation]
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if (origin is typing.Union or origin is types.UnionType) and len(args) == 1 and \
            args[0] in _TYPES:
        return _TYPES[args[0]] + "?"
    raise TypeError(f"vllm_real torch_utils stub: no schema type for {annotation!r}")


def _infer_schema(fn, mutates_args):
    sig = inspect.signature(fn)
    params = []
    for name, p in sig.parameters.items():
        ty = _schema_type(p.annotation)
        if name in mutates_args:
            ty = ty.replace("Tensor", "Tensor(a!)", 1) if "?" not in ty else "Tensor(a!)?"
        default = ""
        if p.default is not inspect.Parameter.empty:
            default = "=" + ("None" if p.default is None else
                             str(p.default) if not isinstance(p.default, bool) else
                             ("True" if p.default else "False"))
        params.append(f"{ty} {name}{default}")
    ret = sig.return_annotation
    out = "()" if ret in (None, inspect.Signature.empty) else _schema_type(ret)
    return f"({', '.join(params)}) -> {out}"


try:
    vllm_lib = torch.library.Library("vllm", "FRAGMENT")
except ValueError:  # torch 1.13
    vllm_lib = torch.library.Library("vllm", "DEF")


def direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None,
                              target_lib=None, dispatch_key=None, tags=()):
    if dispatch_key is None:
        dispatch_key = harness.platform.PLATFORM.dispatch_key  # noqa: F821
    lib = target_lib or vllm_lib
    lib.define(op_name + _infer_schema(op_func, mutates_args or []))
    lib.impl(op_name, op_func, dispatch_key)
    if fake_impl is not None:
        if hasattr(lib, "_register_fake"):
            lib._register_fake(op_name, fake_impl)
        else:
            lib.impl(op_name, fake_impl, "Meta")
