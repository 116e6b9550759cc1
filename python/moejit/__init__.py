"""libmoejit for Python: the MoE combine, JIT-compiled for the shapes you call it with.

    import moejit
    out = moejit.combine(expert_hidden, layout="gather_map", gather_map=m, gates=g)

moejit.combine / moejit.combine_op need torch and are imported on first use; version(), stats()
and the ctypes layer (moejit._capi) work without torch. The shared library is found through
$MOEJIT_LIBRARY, then next to this package, then the system loader (see moejit._capi).
"""

__version__ = "0.3.0"  # CMake's project version; the test release.version holds them equal

from ._capi import LibraryNotFoundError, MoejitError


def version():
    """Version string of the loaded libmoejit, e.g. "0.2.0"."""
    from . import _capi

    return _capi.version()


def stats():
    """Counters of the default runtime: memory_hits, disk_hits, compiles, disk_errors, launches,
    compile_seconds; and loaded_modules, the modules it holds loaded now."""
    from . import _capi

    return _capi.stats()


def __getattr__(name):
    # Lazy, so that `import moejit` works (and is fast) without torch.
    if name in ("combine", "combine_op"):
        from . import torch_ops

        value = getattr(torch_ops, name)
        # From now on a plain module attribute: torch.compile (dynamo) then sees an ordinary
        # function, and later lookups skip this hook.
        globals()[name] = value
        return value
    raise AttributeError(f"module 'moejit' has no attribute {name!r}")


# combine / combine_op are left out so that `from moejit import *` works without torch (the star
# import would load them through the hook above); use moejit.combine or import them by name.
__all__ = ["version", "stats", "MoejitError", "LibraryNotFoundError"]
