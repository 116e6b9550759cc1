"""The package around the library: finding pip's NVRTC, moejit.precompile() and the
moejit-precompile command, NVRTC that cannot be found. No torch, no GPU needed.

The precompile tests run the tool: the wheel's (MOEJIT_TEST_INSTALLED=1) or $MOEJIT_PRECOMPILE
(ctest sets it to the build's); they skip without one. MOEJIT_EXPECT_NVRTC=pip (the wheel checks
with pip's nvidia-cuda-nvrtc installed) makes them also check that the library loaded pip's NVRTC.
"""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import moejit
from moejit import _nvrtc, _precompile

INSTALLED = os.environ.get("MOEJIT_TEST_INSTALLED") == "1"
# One small kernel: token-major, bf16, H=64, K=2, int32, for sm_90 (compiles in well under 1 s).
SMALL = dict(hidden=64, top_k=2, dtype="bf16", layout="token_major", index_type="int32",
             arch="sm_90")


def fake_pip_nvrtc(site, layout):
    path = pathlib.Path(site) / layout
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return str(path)


# ---- finding pip's NVRTC -------------------------------------------------------------------------


def test_pip_nvrtc_found_on_the_path_cuda_13_first(tmp_path):
    a, b = tmp_path / "site-a", tmp_path / "site-b"
    cu12 = fake_pip_nvrtc(a, _nvrtc.PIP_LAYOUTS[1])
    cu13 = fake_pip_nvrtc(b, _nvrtc.PIP_LAYOUTS[0])
    assert _nvrtc.pip_nvrtc_candidates([str(a), str(b)]) == [cu13, cu12]
    assert _nvrtc.find_pip_nvrtc([str(a), str(b)]) == cu13
    assert _nvrtc.find_pip_nvrtc([str(tmp_path / "empty")]) is None
    # The layouts of the real packages: nvidia-cuda-nvrtc (13), nvidia-cuda-nvrtc-cu12.
    assert _nvrtc.PIP_LAYOUTS == ("nvidia/cu13/lib/libnvrtc.so.13",
                                  "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")


def test_the_library_is_told_unless_the_user_chose(tmp_path, monkeypatch):
    cu13 = fake_pip_nvrtc(tmp_path, _nvrtc.PIP_LAYOUTS[0])
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    monkeypatch.setenv(_nvrtc.ENV, "")  # empty counts as unset; restored after the test
    assert _nvrtc.point_library_at_pip_nvrtc() == cu13
    assert os.environ[_nvrtc.ENV] == cu13
    monkeypatch.setenv(_nvrtc.ENV, "/mine/libnvrtc.so.13")
    assert _nvrtc.point_library_at_pip_nvrtc() == "/mine/libnvrtc.so.13"
    assert os.environ[_nvrtc.ENV] == "/mine/libnvrtc.so.13"


# ---- moejit.precompile() and the command ---------------------------------------------------------


@pytest.fixture
def tool():
    try:
        return _precompile.tool_path()
    except FileNotFoundError as e:
        if INSTALLED:
            raise  # the wheel must hold the tool
        pytest.skip(str(e))


def test_precompile_argument_errors_name_the_argument(tmp_path):
    with pytest.raises(TypeError, match="hidden must be an int or a list of ints, got str"):
        moejit.precompile(hidden="64", top_k=2, dtype="bf16")
    with pytest.raises(TypeError, match="dtype must be a str or a list of str, got int"):
        moejit.precompile(hidden=64, top_k=2, dtype=16)
    with pytest.raises(TypeError, match="arch must be a str, got list"):
        moejit.precompile(hidden=64, top_k=2, dtype="bf16", arch=["sm_90"])
    with pytest.raises(ValueError, match="jobs = 0; allowed: 1..1024"):
        moejit.precompile(hidden=64, top_k=2, dtype="bf16", jobs=0)
    with pytest.raises(TypeError, match="dry_run must be a bool"):
        moejit.precompile(hidden=64, top_k=2, dtype="bf16", dry_run=1)
    with pytest.raises(ValueError, match="nothing to compile"):
        moejit.precompile(cache_dir=tmp_path)


def test_precompile_compiles_then_finds_it_cached(tool, tmp_path):
    first = moejit.precompile(**SMALL, cache_dir=tmp_path / "cache")
    assert (first["total"], first["compiled"], first["failed"]) == (1, 1, 0)
    again = moejit.precompile(**SMALL, cache_dir=tmp_path / "cache")
    assert (again["total"], again["compiled"], again["failed"]) == (1, 0, 0)


def test_precompile_takes_the_epilogue(tool, tmp_path):
    # H = 64 rows are too short to split: each epilogue adds its one-block module.
    plan = moejit.precompile(**SMALL, epilogue=["none", "norm-fp8"], dry_run=True,
                             cache_dir=tmp_path / "cache")
    specs = [job["spec"] for job in plan["jobs"]]
    assert plan["total"] == 2 and specs[0].startswith("kind=token_major ")
    assert specs[1].startswith("kind=token_major_epilogue ") and "out=fp8" in specs[1]
    with pytest.raises(TypeError, match="epilogue must be a str or a list of str, got int"):
        moejit.precompile(**SMALL, epilogue=1, cache_dir=tmp_path)


def test_precompile_failure_raises_with_the_tools_message(tool, tmp_path):
    with pytest.raises(moejit.PrecompileError) as info:
        moejit.precompile(hidden=64, top_k=2, dtype="bf16", arch="sm_1", cache_dir=tmp_path)
    assert info.value.returncode == 2
    assert "sm_1" in str(info.value)


def run_tool(args, env_update, tmp_path):
    """`moejit-precompile ARGS` through the package's command (moejit._precompile.main)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(pathlib.Path(moejit.__file__).resolve().parents[1])
    env.update(env_update)
    return subprocess.run([sys.executable, "-c",
                           "import sys, moejit._precompile as p; sys.exit(p.main(sys.argv[1:]))"]
                          + args, env=env, cwd=tmp_path, capture_output=True, text=True)


def small_args(cache):
    return ["--hidden", "64", "--topk", "2", "--dtype", "bf16", "--layout", "token_major",
            "--index-type", "int32", "--arch", "sm_90", "--cache-dir", str(cache)]


def test_the_command_runs_the_tool(tool, tmp_path):
    r = run_tool(["--help"], {}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Usage: moejit-precompile" in r.stdout


def test_the_console_command_is_installed(tool, tmp_path):
    if not INSTALLED:
        pytest.skip("the console command exists once the wheel is installed")
    command = shutil.which("moejit-precompile",
                           path=os.pathsep.join([os.path.dirname(sys.executable),
                                                 os.environ.get("PATH", "")]))
    assert command is not None, "moejit-precompile is not on PATH next to " + sys.executable
    r = subprocess.run([command, "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Usage: moejit-precompile" in r.stdout


def test_missing_nvrtc_is_a_clear_error_naming_what_was_searched(tool, tmp_path):
    missing = str(tmp_path / "nowhere" / "libnvrtc.so.13")
    r = run_tool(small_args(tmp_path / "cache"), {_nvrtc.ENV: missing}, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NVRTC (libnvrtc.so) could not be loaded" in r.stderr
    assert missing + " ($MOEJIT_NVRTC_LIBRARY): No such file or directory" in r.stderr


def loaded_nvrtc(stderr):
    """(path, origin) from the library's debug line "loaded NVRTC 13.0 from PATH (ORIGIN)"."""
    m = re.search(r"loaded NVRTC [0-9.]+ from (\S+) \((.*)\)", stderr)
    assert m, "no 'loaded NVRTC' line in:\n" + stderr
    return m.group(1), m.group(2)


def test_the_library_says_which_nvrtc_it_loaded(tool, tmp_path):
    # With a pip NVRTC in this environment (moejit[cu13], torch), that one; else a toolkit's.
    r = run_tool(small_args(tmp_path / "cache"), {"MOEJIT_LOG_LEVEL": "debug"}, tmp_path)
    assert r.returncode == 0, r.stderr
    path, origin = loaded_nvrtc(r.stderr)
    print(f"NVRTC used: {path} ({origin})")
    pip = _nvrtc.find_pip_nvrtc()
    if os.environ.get(_nvrtc.ENV):
        assert origin == "$MOEJIT_NVRTC_LIBRARY"
    elif pip is not None:
        assert (path, origin) == (pip, "$MOEJIT_NVRTC_LIBRARY")
    if os.environ.get("MOEJIT_EXPECT_NVRTC") == "pip":
        assert pip is not None, "MOEJIT_EXPECT_NVRTC=pip but no nvidia-cuda-nvrtc on sys.path"
        assert os.path.realpath(path) == os.path.realpath(pip)
