"""Shared setup for tests/python. Two ways to run them:

- Against the source tree (ctest -L python): PYTHONPATH=<repo>/python and
  MOEJIT_LIBRARY=<build>/libmoejit.so.0; by hand the same way:
      PYTHONPATH=python MOEJIT_LIBRARY=build/libmoejit.so.0 python3 -m pytest -q tests/python
- Against an installed wheel (tools/wheel-check.sh, tools/gpu-wheel-check.sh):
  MOEJIT_TEST_INSTALLED=1, with the Python the wheel was installed into. The package then comes
  from site-packages and its library from next to it; the checkout's python/ is never imported.
"""
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
INSTALLED = os.environ.get("MOEJIT_TEST_INSTALLED") == "1"

if INSTALLED:
    if os.environ.get("MOEJIT_LIBRARY"):
        raise RuntimeError("MOEJIT_TEST_INSTALLED=1 tests the wheel's own library: unset "
                           "MOEJIT_LIBRARY")
    source = (REPO / "python").resolve()
    sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.curdir).resolve() != source]
    import moejit  # noqa: E402

    if pathlib.Path(moejit.__file__).resolve().is_relative_to(source):
        raise RuntimeError(f"MOEJIT_TEST_INSTALLED=1 but moejit was imported from the checkout "
                           f"({moejit.__file__}), not from the installed wheel")
else:
    # Importable without PYTHONPATH too, from a checkout.
    if str(REPO / "python") not in sys.path:
        sys.path.insert(0, str(REPO / "python"))
    # Subprocess tests run elsewhere: a relative path must not change meaning.
    for var in ("MOEJIT_LIBRARY", "MOEJIT_PRECOMPILE"):
        if os.environ.get(var, "").count("/"):
            os.environ[var] = os.path.abspath(os.environ[var])
    if "MOEJIT_LIBRARY" not in os.environ:
        for candidate in sorted(REPO.glob("build*/libmoejit.so.0")):
            os.environ["MOEJIT_LIBRARY"] = str(candidate)
            break


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def package_dir():
    """The moejit package under test: the checkout's python/moejit, or the installed one."""
    import moejit

    return pathlib.Path(moejit.__file__).resolve().parent


@pytest.fixture(scope="session")
def library_file(package_dir):
    """The libmoejit under test: $MOEJIT_LIBRARY (source tree), or the wheel's next to the package;
    None if there is none to test."""
    if INSTALLED:
        return str(package_dir / "libmoejit.so.0")
    return os.environ.get("MOEJIT_LIBRARY")
