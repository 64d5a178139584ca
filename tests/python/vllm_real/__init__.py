"""vLLM's own source files at the pinned commit, imported by unit tests on a CPU-only machine.

The files are NOT in this repository: they are loaded at run time from the shared copy of
vLLM 9aaf83ef (`<repo>/../shared/vllm-9aaf83ef`, or $SPIND_VLLM_SRC: the directory holding
vLLM's `vllm/`) by an import hook (_loader.py), unmodified. What cannot run here (CUDA kernels,
DeepGEMM, Triton, pydantic configs, the distributed runtime, the 7k-line model runner) is
stubbed module by module under stubs/ (STUBBED_MODULES says why, one line each; SHIMS lists
the two patches outside vLLM that an old torch / typing_extensions needs); kernels are
float32 stand-ins with the real kernels' semantics (kernels.py); Triton kernels in real files
run in a small interpreter (triton_interp.py). REAL_MODULES lists what runs as written.

Use (one process, the harness owns `vllm` there):

    import vllm_real
    @unittest.skipUnless(vllm_real.available(), vllm_real.SKIP_REASON)
    ...
    vllm_real.install()                                # then `import vllm...` as usual
    builder = vllm_real.make_builder(max_model_len=4096)
    md = builder.build(0, vllm_real.decode_batch([100, 70, 33], padded_to=4))
    with vllm_real.forward_context({prefix: md}):
        layer(hidden, q, k, weights)                   # vLLM's real SparseAttnIndexer
    with vllm_real.cuda_like():                        # the real code's CUDA branches
        ...

Works with Debian's torch 1.13 (CPU) and torch 2.11 (CUDA); the stand-ins run on CPU or CUDA
tensors and can be captured in CUDA graphs (kernels.py).
"""
import contextlib
import importlib.util
import os
import sys

import torch

from . import _loader, kernels, platform, triton_interp  # noqa: F401
from .batches import (assign_pages, batch, block_table_width, capture_batch,  # noqa: F401
                      decode_batch, k_cache, make_builder, make_vllm_config, mixed_batch,
                      new_kv_cache)
from .platform import PLATFORM, cuda_like  # noqa: F401

VLLM_COMMIT = "9aaf83ef502fc37bc647f6e474314d48ba36cd1c"

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
SRC = os.path.abspath(os.environ.get("SPIND_VLLM_SRC") or
                      os.path.join(_REPO, "..", "shared", "vllm-9aaf83ef"))


def _importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# vLLM's torch_utils needs torch.library.infer_schema (torch >= 2.5), numpy and packaging.
_REAL_TORCH_UTILS = (hasattr(torch.library, "infer_schema") and _importable("packaging") and
                     _importable("numpy"))

# Module -> what of it the tests rely on. Loaded from SRC as written.
REAL_MODULES = {
    "vllm.v1.attention.backends.mla.indexer":
        "DeepseekV32IndexerMetadataBuilder (build, decode/prefill preparation, its Triton "
        "kernels), the indexer metadata dataclasses",
    "vllm.v1.attention.backend": "CommonAttentionMetadata, AttentionMetadataBuilder",
    "vllm.v1.attention.backends.utils": "split_decodes_and_prefills",
    "vllm.model_executor.custom_op": "CustomOp: register, register_oot, op_registry_oot, "
                                     "dispatch",
    "vllm.model_executor.layers.sparse_attn_indexer":
        "sparse_attn_indexer (the vllm::sparse_attn_indexer op body), SparseAttnIndexer",
    "vllm.utils.math_utils": "cdiv and friends",
    "vllm.utils.deep_gemm": "the DeepGEMM wrapper (over the fake deep_gemm package)",
    "vllm.plugins": "load_general_plugins (vllm.general_plugins entry points)",
    "vllm.v1.core.sched.output": "SchedulerOutput, NewRequestData, CachedRequestData",
    "vllm.compilation.breakable_cudagraph": "eager_break_during_capture",
}
if _REAL_TORCH_UTILS:
    REAL_MODULES["vllm.utils.torch_utils"] = ("direct_register_custom_op, LayerName, "
                                              "_resolve_layer_name / _encode_layer_name")

# Module -> why it is stubbed (stubs/<module path>.py says more).
STUBBED_MODULES = {
    "vllm": "the package root re-exports the whole engine",
    "vllm.envs": "~300 lazily read variables; the few read here, with vLLM's defaults",
    "vllm.logger": "vLLM's logging setup; stdlib logging with the *_once methods",
    "vllm.platforms": "platform detection needs a real device; a stand-in whose is_cuda() "
                      "the test sets",
    "vllm.triton_utils": "Triton is absent (GPU only); an interpreter runs the real kernels",
    "vllm.config": "pydantic v2 dataclasses (pydantic absent); plain dataclasses",
    "vllm.config.compilation": "pydantic CompilationConfig; its enums and _attention_ops are "
                               "read from the real file",
    "vllm.forward_context": "also drives DP, micro-batching and KV connectors; the context "
                            "and attn_metadata only",
    "vllm._custom_ops": "vLLM's compiled CUDA ops; float32 stand-ins (kernels.py)",
    "vllm._aiter_ops": "ROCm AITER kernels; never enabled",
    "vllm.utils.import_utils": "probes optional packages; has_deep_gemm() is True",
    "vllm.utils.platform_utils": "asks the device driver; the stand-in's SM count",
    "vllm.compilation.monitor": "compilation-phase bookkeeping; a no-op check",
    "vllm.distributed.parallel_state": "NCCL/Gloo groups; a minimal GroupCoordinator and "
                                       "get_tp_group",
    "vllm.distributed.device_communicators.pynccl_allocator": "NCCL memory pools",
    "vllm.distributed.kv_transfer.kv_connector.utils": "KV connectors; the default layout",
    "vllm.model_executor.utils": "Inductor options for compiled CustomOps",
    "vllm.model_executor.offloader.base": "weight offloading; no-op hooks",
    "vllm.model_executor.layers.attention_layer_base": "the attention layer interface; a "
                                                       "marker class",
    "vllm.model_executor.layers.quantization.utils.quant_utils": "vLLM's quantization "
                                                                  "vocabulary; fp8 range and "
                                                                  "the QuantKeys named",
    "vllm.v1.kv_cache_interface": "every cache spec kind; the attention/MLA specs",
    "vllm.v1.worker.cp_utils": "context-parallel groups; world size 1",
    "vllm.v1.worker.workspace": "one shared device allocation; plain tensors",
    "vllm.v1.worker.gpu_worker": "initialises CUDA, NCCL and the model; a minimal Worker",
    "vllm.v1.worker.gpu_model_runner": "needs a GPU and a model; a runner the test drives "
                                       "(batches.py builds its attention metadata)",
    "vllm.v1.worker.gpu_input_batch": "the persistent batch; req_ids only",
    "vllm.v1.attention.ops.common": "not among the shared files; torch references of "
                                    "pack_seq_triton / unpack_seq_triton",
    "vllm.v1.attention.backends.mla.compressor_utils": "DeepSeek-V4 compressed caches "
                                                       "(never reached)",
    "deep_gemm": "DeepGEMM needs a Hopper GPU and its JIT; float32 stand-ins under vLLM's "
                 "real wrapper",
}
if not _REAL_TORCH_UTILS:
    STUBBED_MODULES["vllm.utils.torch_utils"] = (
        "this torch has no torch.library.infer_schema (or numpy/packaging are missing); "
        "plain-string layer names and an explicit op schema")

# Patches outside `vllm` (what -> why), applied only where this Python or torch lacks the thing.
SHIMS = {}
if not hasattr(torch, "compile"):
    SHIMS["torch.compile"] = ("torch 1.13 has none; an identity decorator while "
                              "vllm/utils/deep_gemm.py is imported (per_block_cast_to_fp8 stays "
                              "eager, and is never called here)")

# Files the harness cannot work without.
_REQUIRED = ["vllm/v1/attention/backends/mla/indexer.py",
             "vllm/model_executor/layers/sparse_attn_indexer.py",
             "vllm/v1/attention/backend.py", "vllm/model_executor/custom_op.py"]

SKIP_REASON = (f"the shared vLLM sources are absent: no {os.path.join(SRC, 'vllm')} with "
               f"vLLM {VLLM_COMMIT[:8]}'s files (set SPIND_VLLM_SRC to the directory that "
               f"holds them)")


def available():
    """Whether vLLM's files are there to be loaded."""
    return all(os.path.isfile(os.path.join(SRC, f)) for f in _REQUIRED)


def real_path(rel):
    """The shared copy of one of vLLM's files ("vllm/...")."""
    return os.path.join(SRC, rel)


def exec_real_definitions(path, names, namespace):
    """Executes the top-level classes / functions `names` of a real vLLM file, as written,
    into `namespace` (for files that cannot be imported whole)."""
    import ast
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    picked = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and
              n.name in names]
    missing = set(names) - {n.name for n in picked}
    if missing:
        raise ImportError(f"vllm_real: {sorted(missing)} not found in {path}")
    exec(compile(ast.Module(body=picked, type_ignores=[]), path, "exec"), namespace)


def real_class_literal(path, class_name, attr):
    """The literal value of `attr` in class `class_name` of a real vLLM file."""
    import ast
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                target = getattr(item, "target", None) or (
                    item.targets[0] if isinstance(item, ast.Assign) else None)
                if getattr(target, "id", None) == attr and item.value is not None:
                    return ast.literal_eval(item.value)
    raise ImportError(f"vllm_real: {class_name}.{attr} not found in {path}")


def _deprecated_stand_in(message, *, category=DeprecationWarning, stacklevel=1):
    """typing_extensions.deprecated for typing_extensions < 4.5 (Debian 12 has 4.4): warns on
    use, as the real decorator does for functions."""
    import functools
    import warnings

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            warnings.warn(message, category, stacklevel=stacklevel + 1)
            return fn(*args, **kwargs)
        inner.__deprecated__ = message
        return inner
    return wrap


@contextlib.contextmanager
def _torch_compile_for_import():
    """torch 1.13 has no torch.compile; vllm/utils/deep_gemm.py decorates one helper
    (per_block_cast_to_fp8, never called here) with it at import. Only while that file runs,
    torch.compile is an identity decorator."""
    if hasattr(torch, "compile"):
        yield
        return
    torch.compile = lambda *a, **k: (lambda fn: fn)
    try:
        yield
    finally:
        del torch.compile


_installed = False


def install():
    """Puts the import hook in place and imports the indexer's modules (registering
    vllm::sparse_attn_indexer and the torch.ops._C stand-ins). Once per process."""
    global _installed
    if _installed:
        return
    if not available():
        raise RuntimeError(SKIP_REASON)
    foreign = _loader.foreign_vllm()
    if foreign is not None:
        raise RuntimeError(f"vllm_real: `vllm` is already imported from "
                           f"{getattr(foreign, '__file__', foreign)}; the harness needs a "
                           f"process of its own")
    import typing_extensions
    if not hasattr(typing_extensions, "deprecated"):
        typing_extensions.deprecated = _deprecated_stand_in
        SHIMS["typing_extensions.deprecated"] = ("missing before typing_extensions 4.5 "
                                                 "(Debian 12 has 4.4); a warning decorator")
    finder = _loader.Finder(SRC, REAL_MODULES, STUBBED_MODULES, harness=sys.modules[__name__],
                            around={"vllm.utils.deep_gemm": _torch_compile_for_import})
    _loader.install(finder)
    _installed = True
    if "vllm.utils.torch_utils" in REAL_MODULES:
        try:
            import vllm.utils.torch_utils  # noqa: F401
        except Exception as e:  # noqa: BLE001 - an API this torch lacks: the stub stands in
            sys.modules.pop("vllm.utils.torch_utils", None)
            del REAL_MODULES["vllm.utils.torch_utils"]
            finder.real.discard("vllm.utils.torch_utils")
            finder.stubbed.add("vllm.utils.torch_utils")
            STUBBED_MODULES["vllm.utils.torch_utils"] = (
                f"vLLM's file fails on torch {torch.__version__}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}")
    kernels.register_ops()
    kernels.prepare("cpu")
    import vllm.model_executor.layers.sparse_attn_indexer  # noqa: F401
    import vllm.v1.attention.backends.mla.indexer  # noqa: F401


def install_for_tests():
    """A test module's setUpModule: install(), or unittest.SkipTest when vLLM's files are absent
    or another vllm is already imported in this process."""
    import unittest
    if not available():
        raise unittest.SkipTest(SKIP_REASON)
    foreign = _loader.foreign_vllm()
    if foreign is not None:
        raise unittest.SkipTest(f"another vllm is imported in this process "
                                f"({getattr(foreign, '__file__', foreign)})")
    install()


@contextlib.contextmanager
def forward_context(attn_metadata_by_prefix, vllm_config=None, **kwargs):
    """Runs the block under vLLM's forward context with this attn_metadata (a dict layer
    prefix -> metadata, or None as in a profiling run)."""
    from vllm.forward_context import set_forward_context
    with set_forward_context(attn_metadata_by_prefix, vllm_config, **kwargs) as ctx:
        yield ctx
