#!/usr/bin/env python3
"""One version everywhere: CMake's project version (the one source) against the header's macros,
the built library's moejit_version() / moejit_version_string(), the Python package's
__version__ and, where pyproject.toml exists, the wheel version scikit-build-core reads.

    check_version.py PROJECT_VERSION SOURCE_DIR VERSION_PROBE

VERSION_PROBE is version_probe.c built against the header and linked with the library.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

# scikit-build-core's regex provider (scikit_build_core.metadata.regex): re.search with
# re.MULTILINE over the input file, then `result` formatted with the match's groups, then
# `remove` substituted away. Its default regex, for an input without `regex`:
DEFAULT_REGEX = r'(?i)^(__version__|VERSION)(?: ?\: ?str)? *= *([\'"])v?(?P<value>.+?)\2'
REGEX_PROVIDER = "scikit_build_core.metadata.regex"


def wheel_version(source, pyproject):
    """The version scikit-build-core would give the wheel, or a reason it would not come from
    CMakeLists.txt."""
    import tomllib  # Python 3.11 (Debian 12's); needed only where pyproject.toml exists

    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = config.get("project", {})
    if "version" in project:
        return None, f"pyproject.toml sets a static version {project['version']!r}"
    if "version" not in project.get("dynamic", []):
        return None, "pyproject.toml's [project] dynamic does not list version"
    settings = config.get("tool", {}).get("scikit-build", {}).get("metadata", {}).get("version")
    if not settings or settings.get("provider") != REGEX_PROVIDER:
        return None, f"[tool.scikit-build] metadata.version.provider is not {REGEX_PROVIDER!r}"
    if Path(settings.get("input", "")) != Path("CMakeLists.txt"):
        return None, (f"metadata.version.input is {settings.get('input')!r}, not CMakeLists.txt "
                      "(the project version's one source)")
    text = (source / settings["input"]).read_text(encoding="utf-8")
    match = re.search(settings.get("regex", DEFAULT_REGEX), text, re.MULTILINE)
    if not match:
        return None, f"metadata.version.regex matches nothing in {settings['input']}"
    value = settings.get("result", "{value}").format(*match.groups(), **match.groupdict())
    if settings.get("remove"):
        value = re.sub(settings["remove"], "", value)
    return value, None


def main():
    expected, source, probe = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    major, minor, patch = (int(p) for p in expected.split("."))
    failures = []

    def check(what, actual, want):
        ok = actual == want
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {actual!r}" + ("" if ok else f", want {want!r}"))
        if not ok:
            failures.append(what)

    print(f"CMake project version (CMakeLists.txt): {expected}")
    out = subprocess.run([probe], check=True, capture_output=True, text=True).stdout
    probed = dict(line.split(" ", 1) for line in out.splitlines())
    check("header MOEJIT_VERSION_MAJOR", int(probed["header_major"]), major)
    check("header MOEJIT_VERSION_MINOR", int(probed["header_minor"]), minor)
    check("header MOEJIT_VERSION_PATCH", int(probed["header_patch"]), patch)
    check("header MOEJIT_VERSION_NUMBER", int(probed["header_number"]),
          major * 10000 + minor * 100 + patch)
    check("library moejit_version()", int(probed["library_number"]),
          major * 10000 + minor * 100 + patch)
    check("library moejit_version_string()", probed["library_string"], expected)

    # The package as its users import it (the import loads no library).
    code = "import moejit; print(moejit.__version__)"
    env = dict(os.environ, PYTHONPATH=str(source / "python"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        print(f"FAIL python moejit.__version__: import failed:\n{result.stderr}")
        failures.append("python")
    else:
        check("python moejit.__version__", result.stdout.strip(), expected)

    pyproject = source / "pyproject.toml"
    if pyproject.exists():
        value, why = wheel_version(source, pyproject)
        if why:
            print(f"FAIL wheel version: {why}")
            failures.append("wheel")
        else:
            check("wheel version (scikit-build-core regex provider on CMakeLists.txt)", value,
                  expected)
    else:
        print("no pyproject.toml: no wheel version to check")

    if failures:
        sys.exit(f"{len(failures)} version(s) differ from CMake's project version {expected}")


if __name__ == "__main__":
    main()
