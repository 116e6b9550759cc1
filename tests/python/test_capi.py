"""The ctypes layer against the C header and the library: no torch, no GPU needed."""
import ctypes
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading

import pytest

from moejit import _capi

REPO = pathlib.Path(__file__).resolve().parents[2]
HEADER = REPO / "include" / "moejit" / "moejit.h"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """sizeof/offsetof and constants as the C compiler sees them (tests/python/layout_probe.c)."""
    exe = os.environ.get("MOEJIT_LAYOUT_PROBE")
    if not exe:
        cc = shutil.which(os.environ.get("CC", "cc"))
        if cc is None:
            pytest.skip("no MOEJIT_LAYOUT_PROBE and no C compiler to build the layout probe")
        exe = str(tmp_path_factory.mktemp("probe") / "layout_probe")
        subprocess.run([cc, "-std=c99", "-I", str(REPO / "include"),
                        str(pathlib.Path(__file__).with_name("layout_probe.c")), "-o", exe],
                       check=True)
    return json.loads(subprocess.run([exe], check=True, capture_output=True, text=True).stdout)


@pytest.mark.parametrize("cname,pytype", [("moejit_combine_args", _capi.CombineArgs),
                                          ("moejit_runtime_options", _capi.RuntimeOptions),
                                          ("moejit_stats", _capi.Stats)])
def test_struct_layout_matches_c(probe, cname, pytype):
    c = probe[cname]
    assert ctypes.sizeof(pytype) == c["sizeof"]
    py_fields = [name for name, _ in pytype._fields_]
    assert py_fields == list(c["fields"]), "fields missing, extra or out of order"
    for name, (offset, size) in c["fields"].items():
        field = getattr(pytype, name)
        assert (field.offset, field.size) == (offset, size), name


def test_constants_match_c(probe):
    for name, value in probe["constants"].items():
        if name == "sizeof_enum":
            assert value == ctypes.sizeof(ctypes.c_int)
        else:
            assert getattr(_capi, name) == value, name
    assert {int(k): v for k, v in probe["status"].items()} == _capi.STATUS_NAMES


def test_status_table_matches_header_text():
    # Independent of the probe: parse the X-macro table itself.
    text = HEADER.read_text()
    entries = dict((int(v), n) for n, v in re.findall(r"X\((MOEJIT_\w+),\s*(\d+)", text))
    assert entries == _capi.STATUS_NAMES
    for value, name in entries.items():
        assert getattr(_capi, name[len("MOEJIT_"):]) == value


def test_library_status_names_and_descriptions():
    lib = _capi.load_library()
    for value, name in _capi.STATUS_NAMES.items():
        assert lib.moejit_status_name(value).decode() == name
        assert lib.moejit_status_description(value)
    assert lib.moejit_status_name(999).decode() == "MOEJIT_STATUS_UNKNOWN"
    assert _capi.status_name(999) == "MOEJIT_STATUS_UNKNOWN"


def test_a_status_the_package_does_not_know_is_named_by_the_library(monkeypatch):
    # As if the library were newer than this package: its status 8 missing from the table.
    _capi.load_library()
    monkeypatch.setattr(_capi, "STATUS_NAMES",
                        {k: v for k, v in _capi.STATUS_NAMES.items() if k != 8})
    assert _capi.status_name(8) == "MOEJIT_ERROR_NOT_CACHED"
    assert _capi.status_name(999) == "MOEJIT_STATUS_UNKNOWN"


def test_a_status_past_the_c_int_range_is_unknown():
    # moejit_status is a C int: ctypes would pass 2^32 + 1 as 1, and the library would name it.
    _capi.load_library()
    for value in (1 << 31, (1 << 32) + 1, 1 << 40, -(1 << 31) - 1):
        assert _capi.status_name(value) == "MOEJIT_STATUS_UNKNOWN", value


def test_version():
    lib = _capi.load_library()
    major, minor, patch = (int(x) for x in _capi.version().split("."))
    assert lib.moejit_version() == major * 10000 + minor * 100 + patch
    import moejit

    assert moejit.version() == _capi.version()


def test_stats_is_a_dict_of_counters():
    import moejit

    s = moejit.stats()
    assert set(s) == {"memory_hits", "disk_hits", "compiles", "disk_errors", "launches",
                      "compile_seconds", "loaded_modules"}


def test_args_defaults_come_from_the_library():
    a = _capi.new_combine_args()
    assert a.struct_size == ctypes.sizeof(_capi.CombineArgs)
    assert a.scale == 1.0 and a.accumulate == 0 and a.workspace is None


def shape_args(**fields):
    a = _capi.new_combine_args()
    for k, v in fields.items():
        setattr(a, k, v)
    return a


def expect_error(status, fn, *args):
    with pytest.raises(_capi.MoejitError) as info:
        fn(*args)
    assert info.value.status == status
    assert info.value.status_name == _capi.STATUS_NAMES[status]
    assert info.value.status_name in str(info.value)
    return info.value


def test_workspace_size_bad_hidden_dim():
    e = expect_error(_capi.ERROR_INVALID_ARGUMENT, _capi.combine_workspace_size,
                     shape_args(hidden_dim=0, top_k=2))
    assert "args->hidden_dim = 0" in e.message and "1..65536" in e.message


def test_workspace_size_bad_top_k():
    e = expect_error(_capi.ERROR_INVALID_ARGUMENT, _capi.combine_workspace_size,
                     shape_args(layout=_capi.LAYOUT_GATHER_MAP, hidden_dim=64, top_k=65))
    assert "args->top_k = 65" in e.message


def test_workspace_size_bad_struct_size():
    a = shape_args(hidden_dim=64, top_k=2)
    a.struct_size = 8
    e = expect_error(_capi.ERROR_INVALID_ARGUMENT, _capi.combine_workspace_size, a)
    assert "struct_size = 8" in e.message


def test_workspace_size_values():
    assert _capi.combine_workspace_size(shape_args(hidden_dim=64, top_k=2, num_tokens=33)) == 0
    n = _capi.combine_workspace_size(
        shape_args(layout=_capi.LAYOUT_TOKEN_INDEX, hidden_dim=64, num_tokens=33, num_rows=66))
    assert n >= 33 * 4


def test_workspace_size_null_arguments():
    lib = _capi.load_library()
    nbytes = ctypes.c_size_t()
    assert lib.moejit_combine_workspace_size(None, ctypes.byref(nbytes)) == 1
    assert "args = NULL" in _capi.last_error_message()
    a = shape_args(hidden_dim=64, top_k=2)
    assert lib.moejit_combine_workspace_size(ctypes.byref(a), None) == 1
    assert "bytes = NULL" in _capi.last_error_message()


def test_combine_null_args():
    assert _capi.load_library().moe_combine(None, None) == _capi.ERROR_INVALID_ARGUMENT
    assert "args = NULL" in _capi.last_error_message()


# The cases below fail argument validation, which the library finishes before it touches the
# driver, so the (fake, aligned) pointers are never dereferenced, GPU or not. Separate buffers: the
# library refuses an out that overlaps its inputs.
FAKE = 0x10000
FAKE_INDICES = 0x20000
FAKE_OUT = 0x30000


def test_combine_token_index_without_workspace():
    a = shape_args(layout=_capi.LAYOUT_TOKEN_INDEX, hidden_dim=64, num_tokens=4, num_rows=8,
                   expert_hidden=FAKE, indices=FAKE_INDICES, out=FAKE_OUT)
    e = expect_error(_capi.ERROR_WORKSPACE_TOO_SMALL, _capi.combine, a, 0)
    assert "moejit_combine_workspace_size" in e.message


def test_combine_bad_accumulate():
    a = shape_args(hidden_dim=64, top_k=2, num_tokens=4, expert_hidden=FAKE, out=FAKE_OUT,
                   accumulate=2)
    e = expect_error(_capi.ERROR_INVALID_ARGUMENT, _capi.combine, a, 0)
    assert "args->accumulate = 2" in e.message


def test_combine_missing_out():
    a = shape_args(hidden_dim=64, top_k=2, num_tokens=4, expert_hidden=FAKE)
    e = expect_error(_capi.ERROR_INVALID_ARGUMENT, _capi.combine, a, 0)
    assert "args->out = NULL" in e.message


def test_combine_bad_dtype_enum():
    a = shape_args(hidden_dim=64, top_k=2, num_tokens=4, expert_hidden=FAKE, out=FAKE_OUT,
                   out_dtype=7)
    e = expect_error(_capi.ERROR_INVALID_ARGUMENT, _capi.combine, a, 0)
    assert "args->out_dtype = 7" in e.message


def test_last_error_is_per_thread():
    expect_error(_capi.ERROR_INVALID_ARGUMENT, _capi.combine_workspace_size, shape_args())
    seen = []
    t = threading.Thread(target=lambda: seen.append(_capi.last_error_message()))
    t.start()
    t.join()
    assert seen == [""]
    assert "hidden_dim" in _capi.last_error_message()


# Makes `import torch` fail in a subprocess, as in an environment without torch.
BLOCK_TORCH = "import sys\nsys.modules['torch'] = None\n"


def package_env(package_dir):
    """A subprocess's environment for the package under test and its library."""
    env = {"PYTHONPATH": str(package_dir.parent)}
    if os.environ.get("MOEJIT_LIBRARY"):
        env["MOEJIT_LIBRARY"] = os.environ["MOEJIT_LIBRARY"]
    return env


def run_python(code, env_update, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("MOEJIT_LIBRARY", "PYTHONPATH")}
    env.update(env_update)
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                          text=True)


def test_missing_library_names_what_was_tried(tmp_path, package_dir):
    r = run_python("import moejit; moejit.version()",
                   {"MOEJIT_LIBRARY": str(tmp_path / "nope.so"),
                    "PYTHONPATH": str(package_dir.parent)}, tmp_path)
    assert r.returncode != 0
    assert "LibraryNotFoundError" in r.stderr and "nope.so" in r.stderr
    assert "MOEJIT_LIBRARY" in r.stderr


# The package's Python files alone, as in the checkout (the wheel's library and tool left out).
PYTHON_FILES_ONLY = shutil.ignore_patterns("__pycache__", "libmoejit.so*", "moejit-precompile",
                                           "precompile-configs")


def test_library_next_to_the_package(tmp_path, package_dir, library_file):
    lib = library_file
    if not lib:
        pytest.skip("MOEJIT_LIBRARY not set: no built library to copy")
    pkg = tmp_path / "moejit"
    shutil.copytree(package_dir, pkg, ignore=PYTHON_FILES_ONLY)
    shutil.copy(lib, pkg / "libmoejit.so.0")
    r = run_python("import moejit, moejit._capi as c; moejit.version(); "
                   "print(c.load_library()._name)", {"PYTHONPATH": str(tmp_path)}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(pkg / "libmoejit.so.0")


def test_a_library_without_this_packages_functions_is_skipped(tmp_path, package_dir):
    # Loads, but lacks the package's functions (as a libmoejit older than the package would):
    # named in what was tried, then the next candidate; never a bare AttributeError.
    import ctypes.util
    libc = ctypes.util.find_library("c")
    if not libc:
        pytest.skip("no libc to stand in for an old library")
    r = run_python("import moejit._capi as c\n"
                   "try:\n    c.load_library(); print('loaded another candidate')\n"
                   "except c.LibraryNotFoundError as e:\n    print(e)",
                   {"MOEJIT_LIBRARY": libc, "PYTHONPATH": str(package_dir.parent)}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "AttributeError" not in r.stderr
    # MOEJIT_LIBRARY is the only candidate: a load that succeeds accepted libc.
    assert "loaded another candidate" not in r.stdout
    assert "too old for this package" in r.stdout and libc in r.stdout


def test_an_old_library_next_to_the_package_falls_back_to_the_system_one(tmp_path, package_dir,
                                                                        library_file):
    # The old library carries the same SONAME: unless it is unloaded, the system loader's
    # candidate ("libmoejit.so.0", no slash) resolves to it again and the newer one is never tried.
    lib = library_file
    cc = shutil.which(os.environ.get("CC", "cc"))
    if not lib or cc is None:
        pytest.skip("needs MOEJIT_LIBRARY (a built library) and a C compiler")
    pkg = tmp_path / "moejit"
    shutil.copytree(package_dir, pkg, ignore=PYTHON_FILES_ONLY)
    (tmp_path / "old.c").write_text("int moejit_version(void) { return 100; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libmoejit.so.0", str(tmp_path / "old.c"),
                    "-o", str(pkg / "libmoejit.so.0")], check=True)
    system_dir = tmp_path / "system"
    system_dir.mkdir()
    shutil.copy(lib, system_dir / "libmoejit.so.0")
    r = run_python("import moejit, moejit._capi as c; print(c.load_library()._name, "
                   "c.load_library().moejit_version())",
                   {"PYTHONPATH": str(tmp_path), "LD_LIBRARY_PATH": str(system_dir)}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "libmoejit.so.0" and r.stdout.split()[1] != "100"


def test_star_import_works_without_torch(tmp_path, package_dir):
    r = run_python(BLOCK_TORCH + "from moejit import *\nprint('combine' in dir(), version())",
                   package_env(package_dir), tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "False"


def test_torch_without_custom_op_is_named(tmp_path, package_dir):
    # torch before 2.4 has no torch.library.custom_op: say so, not "module 'torch.library' has no
    # attribute 'custom_op'" from moejit.combine's lookup. A stand-in torch, so no torch is needed.
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("__version__ = '2.3.1'\nfloat32 = float16 = bfloat16 = None\n"
                                       "from . import library\n")
    (stub / "library.py").write_text("")
    r = run_python("import moejit\ntry:\n    moejit.combine\nexcept ImportError as e:\n"
                   "    print(e)",
                   {"PYTHONPATH": os.pathsep.join([str(tmp_path / "stub"), str(package_dir.parent)])},
                   tmp_path)
    assert r.returncode == 0, r.stderr
    assert "needs torch 2.4 or newer" in r.stdout and "torch 2.3.1" in r.stdout




def test_import_works_without_torch(tmp_path, package_dir):
    r = run_python(BLOCK_TORCH + "import moejit; moejit.version(); moejit.stats(); print('ok')",
                   package_env(package_dir), tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_combine_without_torch_says_torch_is_needed(tmp_path, package_dir):
    r = run_python(BLOCK_TORCH + "import moejit\n"
                   "for name in ('combine', 'combine_op', 'combine_epilogue_op'):\n"
                   "    try:\n        getattr(moejit, name)\n"
                   "    except ImportError as e:\n        print(e.name, '|', e)\n"
                   "try:\n    from moejit import combine\n"
                   "except ImportError as e:\n    print(e.name, '|', e)",
                   {"PYTHONPATH": str(package_dir.parent)}, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 4, r.stdout
    for line, name in zip(lines, ("combine", "combine_op", "combine_epilogue_op", "combine")):
        assert line.startswith(f"torch | moejit.{name} works on torch tensors and needs PyTorch")
        assert "pip install torch" in line


def test_torch_op_is_registered_on_import_when_torch_is_importable(tmp_path, package_dir):
    # A stand-in torch whose torch.library.custom_op records what is registered: importing moejit
    # alone registers moejit::combine (an engine may call torch.ops.moejit.combine first).
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "__version__ = '2.11.0'\nfloat32 = float16 = bfloat16 = float8_e4m3fn = 'dtype'\n"
        "Tensor = dtype = object\n"
        "from . import library\n")
    (stub / "library.py").write_text(
        "registered = []\n"
        "class _Op:\n    def __init__(self, f): self.f = f\n"
        "    def register_fake(self, g): return g\n"
        "def custom_op(name, mutates_args):\n"
        "    def wrap(f):\n        registered.append(name)\n        return _Op(f)\n"
        "    return wrap\n")
    r = run_python("import moejit, torch.library\nprint(torch.library.registered, "
                   "callable(moejit.combine), 'combine' in moejit.__all__)",
                   {"PYTHONPATH": os.pathsep.join([str(tmp_path / "stub"), str(package_dir.parent)])},
                   tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['moejit::combine', 'moejit::combine_epilogue'] True True"


def test_error_survives_pickling_and_copy():
    # A worker process sends its exception to the parent pickled (multiprocessing, Ray).
    import copy
    import pickle

    e = expect_error(_capi.ERROR_INVALID_ARGUMENT, _capi.combine_workspace_size,
                     shape_args(hidden_dim=0, top_k=2))
    for other in (pickle.loads(pickle.dumps(e)), copy.copy(e)):
        assert type(other) is _capi.MoejitError
        assert (other.function, other.status, other.status_name, other.message) == (
            e.function, e.status, e.status_name, e.message)
        assert str(other) == str(e)
