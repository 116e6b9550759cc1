"""libmoejit for Python: the Mixture-of-Experts combine, compiled at run time for the shapes you
call it with.

    import moejit
    out = moejit.combine(expert_hidden, layout="gather_map", gather_map=m, gates=g)

moejit.combine / moejit.combine_op (the custom op torch.ops.moejit.combine) and
moejit.combine_epilogue_op (torch.ops.moejit.combine_epilogue: with the residual add, RMSNorm and
fp8 output) work on torch tensors; the ops are registered when this package is imported, if torch
can be imported. version(), stats(),
precompile() and the ctypes layer (moejit._capi) need no torch and no GPU. The library is the
wheel's libmoejit.so.0 next to this file ($MOEJIT_LIBRARY overrides it, see moejit._capi); NVRTC
comes from this environment's nvidia-cuda-nvrtc package or a CUDA toolkit (moejit._nvrtc).
Documentation: docs/python.md.
"""

import importlib.util
from typing import Dict, List, Optional, Union

__version__ = "0.3.0"  # CMake's project version; the test release.version holds them equal

from ._capi import LibraryNotFoundError, MoejitError
from ._precompile import PrecompileError, precompile


def version() -> str:
    """Version string of the loaded libmoejit, e.g. "0.2.0". Loads the library; needs no GPU."""
    from . import _capi

    return _capi.version()


def stats() -> Dict[str, Union[int, float]]:
    """Counters of the default runtime: memory_hits, disk_hits, compiles, disk_errors, launches,
    compile_seconds; and loaded_modules, the modules it holds loaded now."""
    from . import _capi

    return _capi.stats()


# Why moejit.combine is unavailable (torch missing, too old or broken), or None once registered.
_torch_unavailable: Optional[BaseException] = None


def _register_torch_op() -> None:
    """Imports torch_ops, which registers torch.ops.moejit.combine, if torch can be imported: an
    engine that imports moejit finds the op without touching moejit.combine first. Without torch,
    `import moejit` still works; only moejit.combine / combine_op then say why they cannot."""
    global _torch_unavailable, combine, combine_op, combine_epilogue_op
    if importlib.util.find_spec("torch") is None:
        _torch_unavailable = ModuleNotFoundError("No module named 'torch'", name="torch")
        return
    try:
        from . import torch_ops
    except Exception as e:  # torch too old (torch_ops says so), or an install that fails to import
        _torch_unavailable = e
        return
    # Plain module attributes: torch.compile (dynamo) then sees ordinary functions.
    combine = torch_ops.combine
    combine_op = torch_ops.combine_op
    combine_epilogue_op = torch_ops.combine_epilogue_op


def __getattr__(name: str):
    if name in ("combine", "combine_op", "combine_epilogue_op") and _torch_unavailable is not None:
        raise ImportError(
            f"moejit.{name} works on torch tensors and needs PyTorch 2.4 or newer, which could not "
            f"be imported in this Python ({type(_torch_unavailable).__name__}: "
            f"{_torch_unavailable}). Install torch (pip install torch), or call the C API through "
            f"moejit._capi (ctypes, no torch needed).", name="torch") from _torch_unavailable
    raise AttributeError(f"module 'moejit' has no attribute {name!r}")


_register_torch_op()

__all__: List[str] = ["version", "stats", "precompile", "MoejitError", "LibraryNotFoundError",
                      "PrecompileError"]
if _torch_unavailable is None:
    __all__ += ["combine", "combine_op", "combine_epilogue_op"]
