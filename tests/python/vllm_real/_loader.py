"""The import hook: `vllm.*` (and `deep_gemm`) resolved to vLLM's own files or to our stubs.

One sys.meta_path finder, first in the list, answers every `vllm` name:
  - a name in STUBBED_MODULES loads our stub (stubs/<dotted path>.py or .../__init__.py);
  - a name in REAL_MODULES loads vLLM's file from the shared sources, unmodified;
  - a folder on either side (vllm.v1, vllm.v1.attention, ...) becomes an empty package;
  - anything else fails with ModuleNotFoundError naming the harness, so a real file that
    starts importing something new is caught instead of silently picking up another vLLM.
Stubs get the harness package as the global `harness` before they run (their way to the
stand-in kernels and the platform object without knowing where the harness is imported from).
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

STUBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")


def _rel(name):
    return name.replace(".", os.sep)


def stub_file(name):
    """The stub's file for a module name, or None."""
    base = os.path.join(STUBS, _rel(name))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def real_file(src, name):
    """vLLM's file for a module name under the shared sources, or None."""
    base = os.path.join(src, _rel(name))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


class _Loader(importlib.machinery.SourceFileLoader):
    """SourceFileLoader that hands stubs the harness and runs a per-module prologue."""

    def __init__(self, fullname, path, harness, is_stub, around=None):
        super().__init__(fullname, path)
        self.harness, self.is_stub, self.around = harness, is_stub, around

    def set_data(self, path, data, *, _mode=0o666):
        if self.is_stub:  # no bytecode caches written into the shared vLLM sources
            super().set_data(path, data, _mode=_mode)

    def exec_module(self, module):
        if self.is_stub:
            module.harness = self.harness
        if self.around is None:
            return super().exec_module(module)
        with self.around():
            return super().exec_module(module)


class _PackageLoader(importlib.abc.Loader):
    """An empty package (a folder with no __init__ we load)."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []


class Finder(importlib.abc.MetaPathFinder):
    def __init__(self, src, real, stubbed, harness, around=None):
        self.src = src                # the directory holding vLLM's `vllm/`
        self.real = set(real)
        self.stubbed = set(stubbed)
        self.harness = harness
        self.around = around or {}    # module name -> context manager factory run around exec

    def owns(self, name):
        return name == "vllm" or name.startswith("vllm.") or name in self.stubbed

    def find_spec(self, name, path=None, target=None):
        if not self.owns(name):
            return None
        if name in self.stubbed:
            origin = stub_file(name)
            if origin is None:
                raise ModuleNotFoundError(f"tests/python/vllm_real: stub for {name} is missing",
                                          name=name)
            return self._spec(name, origin, True)
        if name in self.real:
            origin = real_file(self.src, name)
            if origin is None:
                raise ModuleNotFoundError(
                    f"{name}: not in the shared vLLM sources at {self.src}", name=name)
            return self._spec(name, origin, False)
        if os.path.isdir(os.path.join(STUBS, _rel(name))) or \
                os.path.isdir(os.path.join(self.src, _rel(name))):
            return importlib.machinery.ModuleSpec(name, _PackageLoader(), is_package=True)
        raise ModuleNotFoundError(
            f"{name}: neither loaded from the shared vLLM sources nor stubbed by "
            f"tests/python/vllm_real (add it to REAL_MODULES or write a stub)", name=name)

    def _spec(self, name, origin, is_stub):
        loader = _Loader(name, origin, self.harness, is_stub, self.around.get(name))
        package = os.path.basename(origin) == "__init__.py"
        return importlib.util.spec_from_file_location(
            name, origin, loader=loader,
            submodule_search_locations=[] if package else None)


def install(finder):
    """Puts the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, finder)


def foreign_vllm():
    """A `vllm` module imported before the harness (another stub, a real install), or None."""
    mod = sys.modules.get("vllm")
    if mod is None:
        return None
    spec = getattr(mod, "__spec__", None)
    if spec is not None and isinstance(spec.loader, _Loader):
        return None
    return mod
