"""ctypes binding of the libmoejit C API (include/moejit/moejit.h).

This module imports nothing but the standard library, so the binding itself (struct layouts,
status names, error messages, library loading) is usable and testable without torch or a GPU.

Library lookup, first match wins:
  1. $MOEJIT_LIBRARY: a path to libmoejit.so(.0). If set, it must load; no fallback hides a typo.
  2. libmoejit.so.0 next to this package (moejit/libmoejit.so.0): the wheel's.
  3. The system loader: "libmoejit.so.0" through LD_LIBRARY_PATH, ld.so.cache, ...
Before loading it, this environment's pip NVRTC (nvidia-cuda-nvrtc) is named to it through
$MOEJIT_NVRTC_LIBRARY unless that is set (moejit._nvrtc).
"""

import _ctypes
import ctypes
import os
import threading

from . import _nvrtc

# ---- Constants, mirroring the header (tests/python/test_capi.py checks them against it) ----------

# MOEJIT_STATUS_TABLE: values are fixed forever and only ever appended.
STATUS_NAMES = {
    0: "MOEJIT_SUCCESS",
    1: "MOEJIT_ERROR_INVALID_ARGUMENT",
    2: "MOEJIT_ERROR_UNSUPPORTED",
    3: "MOEJIT_ERROR_WORKSPACE_TOO_SMALL",
    4: "MOEJIT_ERROR_DRIVER_NOT_FOUND",
    5: "MOEJIT_ERROR_NO_DEVICE",
    6: "MOEJIT_ERROR_CUDA",
    7: "MOEJIT_ERROR_COMPILE",
    8: "MOEJIT_ERROR_NOT_CACHED",
    9: "MOEJIT_ERROR_OUT_OF_MEMORY",
    10: "MOEJIT_ERROR_INTERNAL",
    11: "MOEJIT_ERROR_NVRTC_NOT_FOUND",
}
SUCCESS = 0
ERROR_INVALID_ARGUMENT = 1
ERROR_UNSUPPORTED = 2
ERROR_WORKSPACE_TOO_SMALL = 3
ERROR_DRIVER_NOT_FOUND = 4
ERROR_NO_DEVICE = 5
ERROR_CUDA = 6
ERROR_COMPILE = 7
ERROR_NOT_CACHED = 8
ERROR_OUT_OF_MEMORY = 9
ERROR_INTERNAL = 10
ERROR_NVRTC_NOT_FOUND = 11

DTYPE_FLOAT32 = 0
DTYPE_FLOAT16 = 1
DTYPE_BFLOAT16 = 2
DTYPE_FLOAT8_E4M3 = 3  # since 0.3: an out_dtype only, with out_scales

SCALES_ROW_MAJOR = 0  # since 0.3: moejit_scales_layout
SCALES_COLUMN_MAJOR_ALIGNED4 = 1

INDEX_INT32 = 0
INDEX_INT64 = 1

LAYOUT_TOKEN_MAJOR = 0
LAYOUT_GATHER_MAP = 1
LAYOUT_TOKEN_INDEX = 2

MAX_HIDDEN_DIM = 65536
MAX_TOP_K = 64
MAX_NUM_TOKENS = 1 << 40

# ---- Structs -------------------------------------------------------------------------------------
# C enums are int-sized on every ABI libmoejit supports, so they are c_int here; ctypes applies the
# C alignment rules, and the layout test compares every offset with the compiler's.


class CombineArgs(ctypes.Structure):
    """struct moejit_combine_args. Create with new_combine_args() so struct_size and defaults are
    set by the library itself."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("layout", ctypes.c_int),
        ("num_tokens", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("num_rows", ctypes.c_int64),
        ("hidden_dim", ctypes.c_int64),
        ("expert_hidden", ctypes.c_void_p),
        ("expert_dtype", ctypes.c_int),
        ("expert_row_stride", ctypes.c_int64),
        ("gates", ctypes.c_void_p),
        ("indices", ctypes.c_void_p),
        ("index_type", ctypes.c_int),
        ("out", ctypes.c_void_p),
        ("out_dtype", ctypes.c_int),
        ("out_row_stride", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("accumulate", ctypes.c_int),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("dependent_launch", ctypes.c_int),  # since 0.2
        # Since 0.3: the epilogue.
        ("residual", ctypes.c_void_p),
        ("residual_dtype", ctypes.c_int),
        ("residual_row_stride", ctypes.c_int64),
        ("norm_weight", ctypes.c_void_p),
        ("norm_weight_dtype", ctypes.c_int),
        ("norm_eps", ctypes.c_float),
        ("out_scales", ctypes.c_void_p),
        ("out_scales_layout", ctypes.c_int),
        ("out_scales_pow2", ctypes.c_int),
    ]


class RuntimeOptions(ctypes.Structure):
    """struct moejit_runtime_options (the Python package uses the default runtime; this is here so
    the layout is checked and callers can create explicit runtimes through lib())."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("cache_dir", ctypes.c_char_p),
        ("cache_mode", ctypes.c_int),
        ("cache_max_bytes", ctypes.c_uint64),
        ("log_level", ctypes.c_int),
        ("template_dir", ctypes.c_char_p),
        ("cache_key_file", ctypes.c_char_p),  # since 0.3
    ]


class Stats(ctypes.Structure):
    """struct moejit_stats."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("memory_hits", ctypes.c_uint64),
        ("disk_hits", ctypes.c_uint64),
        ("compiles", ctypes.c_uint64),
        ("disk_errors", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("compile_seconds", ctypes.c_double),
        ("loaded_modules", ctypes.c_uint64),
    ]


# ---- Errors --------------------------------------------------------------------------------------


class MoejitError(RuntimeError):
    """A libmoejit call failed. Carries the status (int), its name (e.g.
    "MOEJIT_ERROR_INVALID_ARGUMENT") and moejit_last_error_message() of the failing call."""

    def __init__(self, function, status, message):
        self.function = function
        self.status = int(status)
        self.status_name = status_name(status)
        self.message = message
        super().__init__(f"{function} failed: {self.status_name}: {message}")

    def __reduce__(self):
        # The default rebuilds from self.args (the one formatted string), which __init__ does not
        # take: pickling (a worker process reporting the error, multiprocessing, Ray) and copy
        # would fail with a TypeError instead of carrying the error.
        return (type(self), (self.function, self.status, self.message))


class LibraryNotFoundError(OSError):
    """libmoejit.so.0 could not be loaded; the message lists every place that was tried."""


# ---- Loading -------------------------------------------------------------------------------------

_SONAME = "libmoejit.so.0"
_lock = threading.Lock()
_lib = None


def library_candidates():
    """The (source, path) pairs load_library() tries, in order."""
    env = os.environ.get("MOEJIT_LIBRARY")
    if env:
        return [("$MOEJIT_LIBRARY", env)]
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), _SONAME)
    candidates = []
    if os.path.exists(here):
        candidates.append(("next to the package", here))
    candidates.append(("system loader", _SONAME))
    return candidates


def _declare(lib):
    """Prototypes, so ctypes converts arguments and never truncates a pointer or a size_t."""
    c_status = ctypes.c_int
    args_p = ctypes.POINTER(CombineArgs)
    protos = {
        "moejit_version": (ctypes.c_int, []),
        "moejit_version_string": (ctypes.c_char_p, []),
        "moejit_status_name": (ctypes.c_char_p, [c_status]),
        "moejit_status_description": (ctypes.c_char_p, [c_status]),
        "moejit_last_error_message": (ctypes.c_char_p, []),
        "moejit_combine_args_init_sized": (c_status, [args_p, ctypes.c_size_t]),
        "moejit_combine_workspace_size": (c_status, [args_p, ctypes.POINTER(ctypes.c_size_t)]),
        "moejit_runtime_options_init": (c_status, [ctypes.POINTER(RuntimeOptions)]),
        "moejit_runtime_create": (
            c_status,
            [ctypes.POINTER(RuntimeOptions), ctypes.POINTER(ctypes.c_void_p)],
        ),
        "moejit_runtime_destroy": (c_status, [ctypes.c_void_p]),
        "moe_combine": (c_status, [args_p, ctypes.c_void_p]),
        "moejit_runtime_combine": (c_status, [ctypes.c_void_p, args_p, ctypes.c_void_p]),
        "moejit_runtime_get_stats": (c_status, [ctypes.c_void_p, ctypes.POINTER(Stats)]),
    }
    for name, (restype, argtypes) in protos.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def load_library():
    """The loaded libmoejit (a ctypes.CDLL with prototypes), loading it on first use."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            # Before the library's first compile, which is when it loads NVRTC.
            _nvrtc.point_library_at_pip_nvrtc()
            tried = []
            for source, path in library_candidates():
                try:
                    candidate = ctypes.CDLL(path)
                except OSError as e:
                    tried.append(f"{source}: {path}: {e}")
                    continue
                try:
                    _lib = _declare(candidate)
                    break
                except AttributeError as e:
                    # Loaded, but an older libmoejit without a function this package calls (the
                    # same SONAME): not usable, say so and try the next candidate. Unloaded first:
                    # the dynamic loader answers a name without a slash (the system loader's
                    # candidate) with an object already loaded under that SONAME, this one.
                    tried.append(f"{source}: {path}: too old for this package ({e})")
                    _ctypes.dlclose(candidate._handle)
            else:
                raise LibraryNotFoundError(
                    "cannot load libmoejit; tried:\n  "
                    + "\n  ".join(tried)
                    + "\nSet MOEJIT_LIBRARY=/path/to/libmoejit.so.0, copy the library next to the "
                    "moejit package, or add its directory to LD_LIBRARY_PATH."
                )
    return _lib


lib = load_library


# ---- Thin wrappers -------------------------------------------------------------------------------


def status_name(status):
    """"MOEJIT_ERROR_..." for a status value; from the table above, so it works without the
    library (the library's own moejit_status_name() is checked against it in the tests). A status
    the table lacks (one a newer library added) is named by the library, if it is loaded."""
    name = STATUS_NAMES.get(int(status))
    # Only a C int: ctypes would pass a larger value modulo 2^32 (2^32 + 1 as 1, a real status).
    if name is None and _lib is not None and -(1 << 31) <= int(status) < (1 << 31):
        name = (_lib.moejit_status_name(int(status)) or b"").decode("utf-8", "replace") or None
    return name or "MOEJIT_STATUS_UNKNOWN"


def last_error_message():
    """moejit_last_error_message() of this thread."""
    return load_library().moejit_last_error_message().decode("utf-8", "replace")


def check(function, status):
    """Raises MoejitError for a failed status; the message must be read on the calling thread,
    right after the call, because it is thread-local and the next libmoejit call replaces it."""
    if status != SUCCESS:
        raise MoejitError(function, status, last_error_message())


def new_combine_args():
    """A CombineArgs with the library's defaults (struct_size set, scale 1)."""
    args = CombineArgs()
    # The sized form (the C header's moejit_combine_args_init macro): the library writes no more
    # than this mirror's size, whatever its own version.
    check(
        "moejit_combine_args_init_sized",
        load_library().moejit_combine_args_init_sized(
            ctypes.byref(args), ctypes.sizeof(CombineArgs)
        ),
    )
    return args


def combine_workspace_size(args):
    """moejit_combine_workspace_size(): bytes of device workspace for these shape fields."""
    nbytes = ctypes.c_size_t(0)
    check(
        "moejit_combine_workspace_size",
        load_library().moejit_combine_workspace_size(ctypes.byref(args), ctypes.byref(nbytes)),
    )
    return nbytes.value


def combine(args, stream):
    """moe_combine(args, stream); stream is a CUstream/cudaStream_t as an int (0: legacy default)."""
    check("moe_combine", load_library().moe_combine(ctypes.byref(args), stream or None))


def version():
    """The loaded library's version string, e.g. "0.2.0"."""
    return load_library().moejit_version_string().decode()


def stats():
    """Counters of the default runtime as a dict (moejit_runtime_get_stats)."""
    s = Stats()
    s.struct_size = ctypes.sizeof(Stats)
    check("moejit_runtime_get_stats", load_library().moejit_runtime_get_stats(None, ctypes.byref(s)))
    return {name: getattr(s, name) for name, _ in Stats._fields_ if name != "struct_size"}
