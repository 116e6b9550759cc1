"""Shared setup for tests/python. ctest runs them with PYTHONPATH=<repo>/python and
MOEJIT_LIBRARY=<build>/libmoejit.so.0; run by hand the same way:
    PYTHONPATH=python MOEJIT_LIBRARY=build/libmoejit.so.0 python3 -m pytest -q tests/python
"""
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
# Importable without PYTHONPATH too, from a checkout.
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))
if os.environ.get("MOEJIT_LIBRARY", "").count("/"):
    # Subprocess tests run elsewhere: a relative path must not change meaning.
    os.environ["MOEJIT_LIBRARY"] = os.path.abspath(os.environ["MOEJIT_LIBRARY"])
elif "MOEJIT_LIBRARY" not in os.environ:
    for candidate in sorted(REPO.glob("build*/libmoejit.so.0")):
        os.environ["MOEJIT_LIBRARY"] = str(candidate)
        break
