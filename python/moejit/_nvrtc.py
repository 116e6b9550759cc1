"""Where this Python environment's pip NVRTC is, for the library, which cannot import Python.

libmoejit loads NVRTC with dlopen at its first compile, from $MOEJIT_NVRTC_LIBRARY if set, else
from pip's package next to libmoejit, then from a CUDA toolkit (src/nvrtc_loader.h). A package
installed elsewhere than libmoejit (a venv with --system-site-packages, pip --target, PYTHONPATH)
is found here instead, on sys.path, and named to the library through MOEJIT_NVRTC_LIBRARY before
its first use. A variable the user set is never changed.
"""

import os
import sys
from typing import List, Optional

ENV = "MOEJIT_NVRTC_LIBRARY"

# pip's layout per CUDA major, newest first: nvidia-cuda-nvrtc (13) and nvidia-cuda-nvrtc-cu12.
PIP_LAYOUTS = (
    os.path.join("nvidia", "cu13", "lib", "libnvrtc.so.13"),
    os.path.join("nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12"),
)


def pip_nvrtc_candidates(paths: Optional[List[str]] = None) -> List[str]:
    """Every pip NVRTC library on `paths` (default sys.path), in the library's order of
    preference: CUDA 13 before 12, then sys.path order."""
    paths = sys.path if paths is None else paths
    found = []
    for layout in PIP_LAYOUTS:
        for entry in paths:
            candidate = os.path.abspath(os.path.join(entry or os.curdir, layout))
            if os.path.isfile(candidate) and candidate not in found:
                found.append(candidate)
    return found


def find_pip_nvrtc(paths: Optional[List[str]] = None) -> Optional[str]:
    """The pip NVRTC the library should use, or None if this environment has none."""
    found = pip_nvrtc_candidates(paths)
    return found[0] if found else None


def point_library_at_pip_nvrtc() -> Optional[str]:
    """Sets $MOEJIT_NVRTC_LIBRARY to this environment's pip NVRTC unless it is set already.
    Returns the value the library will use (None: it searches a toolkit itself)."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    path = find_pip_nvrtc()
    if path is not None:
        os.environ[ENV] = path
    return path
