"""A small Triton interpreter: vLLM's own @triton.jit kernels run in Python on torch tensors.

The real indexer builder launches two Triton kernels (the uniform-decode expansion and the
prefill chunk metadata). Triton is absent here (and cannot run on CPU tensors anyway), so
`vllm.triton_utils` hands vLLM this module instead: `triton.jit(fn)` keeps the kernel's own
Python body, and `kernel[grid](*args, **constexprs)` runs it once per program id, with tensor
arguments turned into pointers (element offsets into the tensor's storage), tl.load/tl.store
as gathers/scatters that honour masks, tl.arange/tl.program_id as torch/Python values. It
covers the subset of the language those kernels use (pointer arithmetic, masks, scalar loads,
Python loops, tl.range, tl.where/full/minimum/maximum, casts); anything else raises.

Slow and host-synchronising (Python loops over programs): fine for metadata builders, which
run eagerly before a step, never inside a CUDA graph.
"""
import itertools
import threading

import torch

_tls = threading.local()


def _ctx():
    ctx = getattr(_tls, "ctx", None)
    if ctx is None:
        raise RuntimeError("triton_interp: tl.* used outside a kernel launch")
    return ctx


def _storage_len(t):
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage().nbytes() // t.element_size()
    return t.storage().size()


class Pointer:
    """A tensor's storage plus element offsets (an int or an integer tensor)."""

    def __init__(self, flat, offsets=0):
        self.flat = flat        # 1-D view from the tensor's first element to its storage's end
        self.offsets = offsets

    @classmethod
    def of(cls, t):
        start = t.storage_offset()
        flat = torch.as_strided(t, (_storage_len(t) - start,), (1,), start)
        return cls(flat)

    def __add__(self, other):
        if isinstance(other, Pointer):
            raise TypeError("triton_interp: pointer + pointer")
        return Pointer(self.flat, self.offsets + other)

    __radd__ = __add__

    def __sub__(self, other):
        return Pointer(self.flat, self.offsets - other)

    @property
    def dtype(self):
        return self.flat.dtype

    def _index(self):
        off = self.offsets
        if isinstance(off, torch.Tensor):
            return off.to(device=self.flat.device, dtype=torch.int64)
        return int(off)


def _mask_of(mask, shape, device):
    if mask is None:
        return None
    m = torch.as_tensor(mask, device=device)
    return m.to(torch.bool).expand(shape) if m.shape != shape else m.to(torch.bool)


def load(pointer, mask=None, other=None, **_):
    if not isinstance(pointer, Pointer):
        raise TypeError("triton_interp: tl.load of a non-pointer")
    idx = pointer._index()
    flat = pointer.flat
    if not isinstance(idx, torch.Tensor):
        if mask is not None and not bool(mask):
            return torch.tensor(0 if other is None else other, dtype=flat.dtype,
                                device=flat.device)
        return flat[idx].clone()
    m = _mask_of(mask, idx.shape, flat.device)
    if m is None:
        return flat[idx]
    safe = torch.where(m, idx, torch.zeros_like(idx))
    vals = flat[safe]
    fill = torch.zeros((), dtype=flat.dtype, device=flat.device) if other is None else \
        torch.as_tensor(other, dtype=flat.dtype, device=flat.device)
    return torch.where(m, vals, fill)


def store(pointer, value, mask=None, **_):
    if not isinstance(pointer, Pointer):
        raise TypeError("triton_interp: tl.store to a non-pointer")
    idx = pointer._index()
    flat = pointer.flat
    if not isinstance(idx, torch.Tensor):
        if mask is not None and not bool(mask):
            return
        flat[idx] = torch.as_tensor(value, device=flat.device).to(flat.dtype)
        return
    vals = torch.as_tensor(value, device=flat.device).to(flat.dtype).expand(idx.shape)
    m = _mask_of(mask, idx.shape, flat.device)
    if m is None:
        flat[idx.reshape(-1)] = vals.reshape(-1)
    else:
        flat[idx[m]] = vals[m]


def program_id(axis=0):
    return _ctx()["pid"][axis]


def num_programs(axis=0):
    return _ctx()["grid"][axis]


def arange(start, end):
    return torch.arange(int(start), int(end), device=_ctx()["device"], dtype=torch.int32)


def range_(start, end=None, step=1, **_):
    if end is None:
        start, end = 0, start
    return range(int(start), int(end), int(step))


def full(shape, value, dtype):
    return torch.full(tuple(shape), value, dtype=dtype, device=_ctx()["device"])


def zeros(shape, dtype):
    return full(shape, 0, dtype)


def where(cond, a, b):
    device = _ctx()["device"]
    return torch.where(torch.as_tensor(cond, device=device), torch.as_tensor(a, device=device),
                       torch.as_tensor(b, device=device))


def minimum(a, b):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))


def maximum(a, b):
    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))


def cdiv(a, b):
    return -(a // -b)


def next_power_of_2(n):
    n = int(n)
    return 1 if n < 1 else 1 << (n - 1).bit_length()


class constexpr:  # noqa: N801 - Triton's name
    """Only ever an annotation here: constexpr arguments arrive as plain Python values."""

    def __init__(self, value=None):
        self.value = value


class Kernel:
    """What @triton.jit returns: kernel[grid](*args, **kwargs) runs the body per program."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for k in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
                kwargs.pop(k, None)
            meta = dict(kwargs)
            g = grid(meta) if callable(grid) else grid
            g = tuple(int(x) for x in (g if isinstance(g, (tuple, list)) else (g,)))
            g = g + (1,) * (3 - len(g))
            device = next((a.device for a in args if isinstance(a, torch.Tensor)),
                          torch.device("cpu"))
            ptr_args = [Pointer.of(a) if isinstance(a, torch.Tensor) else a for a in args]
            ptr_kwargs = {k: Pointer.of(v) if isinstance(v, torch.Tensor) else v
                          for k, v in kwargs.items()}
            saved = getattr(_tls, "ctx", None)
            try:
                for pid in itertools.product(*(range(n) for n in g)):
                    _tls.ctx = {"pid": pid, "grid": g, "device": device}
                    self.fn(*ptr_args, **ptr_kwargs)
            finally:
                _tls.ctx = saved
        return launch

    def __call__(self, *args, **kwargs):
        raise RuntimeError("triton_interp: a @triton.jit kernel is launched as kernel[grid](...)")


def jit(fn=None, **_):
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def _passthrough_decorator(*_, **__):
    def wrap(fn):
        return fn
    return wrap


class Config:
    def __init__(self, kwargs=None, num_warps=4, num_stages=2, **rest):
        self.kwargs = kwargs or {}
        self.num_warps, self.num_stages = num_warps, num_stages


# The two namespaces vLLM imports: `triton` and `triton.language` (`tl`).
triton = type("triton", (), {})()
triton.jit = jit
triton.cdiv = cdiv
triton.next_power_of_2 = next_power_of_2
triton.Config = Config
triton.autotune = _passthrough_decorator
triton.heuristics = _passthrough_decorator
triton.__version__ = "0.0.0+spind-interpreter"

tl = type("triton.language", (), {})()
for _name, _obj in {
    "constexpr": constexpr, "program_id": program_id, "num_programs": num_programs,
    "arange": arange, "range": range_, "static_range": range_, "load": load, "store": store,
    "full": full, "zeros": zeros, "where": where, "minimum": minimum, "maximum": maximum,
    "cdiv": cdiv, "int1": torch.bool, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
}.items():
    setattr(tl, _name, _obj)
triton.language = tl

