"""moejit.precompile() and the `moejit-precompile` console command: both run the moejit-precompile
tool shipped in the wheel (moejit/moejit-precompile), with this environment's pip NVRTC named to
it as to the library (moejit._nvrtc). The tool's options and exit codes: docs/precompile.md.
"""

import json
import numbers
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _nvrtc

TOOL = "moejit-precompile"
# A tool built elsewhere (a source checkout: build/tools/precompile/moejit-precompile).
TOOL_ENV = "MOEJIT_PRECOMPILE"

class PrecompileError(RuntimeError):
    """moejit-precompile exited non-zero. Carries .returncode, .stderr (its messages) and
    .summary (its --json summary as a dict, or None if it printed none)."""

    def __init__(self, returncode: int, stderr: str, summary: Optional[Dict[str, Any]]):
        self.returncode = returncode
        self.stderr = stderr
        self.summary = summary
        # The exit codes' meanings: moejit-precompile --help, docs/precompile.md.
        super().__init__(f"moejit-precompile exited {returncode}:\n{stderr.strip()}")

    def __reduce__(self):
        return (type(self), (self.returncode, self.stderr, self.summary))


def tool_path() -> str:
    """The moejit-precompile executable: $MOEJIT_PRECOMPILE if set, else the wheel's, next to this
    package. Raises FileNotFoundError naming both when neither exists."""
    env = os.environ.get(TOOL_ENV)
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(f"${TOOL_ENV} = {env!r} is not a file")
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), TOOL)
    if os.path.isfile(here):
        return here
    raise FileNotFoundError(
        f"{TOOL} was not found: not at {here} (installed by the moejit wheel) and ${TOOL_ENV} is "
        f"not set (a source build has it at build/tools/precompile/{TOOL})")


def _tool_env() -> Dict[str, str]:
    env = dict(os.environ)
    if not env.get(_nvrtc.ENV):
        nvrtc = _nvrtc.find_pip_nvrtc()
        if nvrtc is not None:
            env[_nvrtc.ENV] = nvrtc
    return env


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `moejit-precompile` console command: runs the tool with the given arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        tool = tool_path()
    except FileNotFoundError as e:
        print(f"moejit-precompile: {e}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Replaces this process: the tool's exit status and signals are the command's own.
    os.execve(tool, [tool] + args, _tool_env())
    return 1  # not reached


# Keyword -> (the tool's option, what it takes): "ints" / "words" a comma list (one value or a list),
# "paths" the option once per path (one or a list), "word" / "path" a single value.
_OPTIONS = {
    "model_config": ("--model-config", "paths"),
    "hidden": ("--hidden", "ints"),
    "top_k": ("--topk", "ints"),
    "dtype": ("--dtype", "words"),
    "out_dtype": ("--out-dtype", "word"),
    "layout": ("--layout", "words"),
    "index_type": ("--index-type", "words"),
    "epilogue": ("--epilogue", "words"),
    "manifest": ("--manifest", "paths"),
    "arch": ("--arch", "word"),
    "cache_dir": ("--cache-dir", "path"),
}
_TAKES = {"ints": "an int or a list of ints", "words": "a str or a list of str",
          "paths": "a path or a list of paths", "word": "a str", "path": "a path"}


def _option(name: str, value: Any) -> List[str]:
    """The tool's arguments for keyword `name`; TypeError / ValueError name the keyword."""
    flag, takes = _OPTIONS[name]
    many = takes in ("ints", "words", "paths")
    values = list(value) if many and isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ValueError(f"moejit.precompile: {name} is an empty list")
    for v in values:
        if takes == "ints":
            ok = isinstance(v, numbers.Integral) and not isinstance(v, bool)
        elif takes in ("paths", "path"):
            ok = isinstance(v, (str, os.PathLike))
        else:
            ok = isinstance(v, str)
        if not ok:
            raise TypeError(f"moejit.precompile: {name} must be {_TAKES[takes]}, got "
                            f"{type(v).__name__} ({v!r})")
    if takes == "paths":
        return [arg for v in values for arg in (flag, os.fspath(v))]
    text = [str(int(v)) if takes == "ints" else os.fspath(v) for v in values]
    return [flag, ",".join(text)]


def precompile(*, model_config: Union[str, "os.PathLike[str]", Sequence[Any], None] = None,
               hidden: Union[int, Sequence[int], None] = None,
               top_k: Union[int, Sequence[int], None] = None,
               dtype: Union[str, Sequence[str], None] = None, out_dtype: Optional[str] = None,
               layout: Union[str, Sequence[str], None] = None,
               index_type: Union[str, Sequence[str], None] = None,
               epilogue: Union[str, Sequence[str], None] = None,
               manifest: Union[str, "os.PathLike[str]", Sequence[Any], None] = None,
               arch: Optional[str] = None, cache_dir: Union[str, "os.PathLike[str]", None] = None,
               jobs: Optional[int] = None, readable_by_all: bool = False,
               dry_run: bool = False) -> Dict[str, Any]:
    """Compiles libmoejit's kernels into the disk cache ahead of time (no GPU needed), so that
    serving never compiles: runs the moejit-precompile tool and returns its JSON summary.

    Each keyword is one of the tool's options (docs/precompile.md):
      model_config  Hugging Face config.json path(s): hidden size, top-k and dtype read from it
      hidden, top_k extra shapes, every combination (ints or lists of ints); need dtype
      dtype         "fp32" | "fp16" | "bf16" (or a list); out_dtype: the output's (default dtype)
      layout        "token_major" | "gather_map" | "token_index" (or a list; default all three)
      index_type    "int32" | "int64" (or a list; default both)
      epilogue      "none" | "residual" | "norm" | "norm-fp8" (or a list; default: from the
                    model config's rms_norm_eps and fp8 activations, else "none")
      manifest      file(s) of specializations or shapes, one per line
      arch          "sm_90", "sm_80,sm_90" or "all" (default: the GPU present)
      cache_dir     the cache directory (default: the library's, e.g. ~/.cache/moejit)
      jobs          parallel compiles (default: the number of cores)
      readable_by_all  let every user read the cache (a cache warmed by root, served by another)
      dry_run       list what would be compiled and whether it is cached; compile nothing

    Returns the summary as a dict ("total", "compiled", "cached", "failed", "jobs": one entry per
    kernel, ...). Raises TypeError / ValueError for a wrong argument (naming it), PrecompileError
    (with .returncode, .stderr, .summary) when the tool exits non-zero, and FileNotFoundError when
    the tool is not installed.

        moejit.precompile(model_config="config.json", arch="sm_90", cache_dir="/opt/moejit-cache")
    """
    given = {"model_config": model_config, "hidden": hidden, "top_k": top_k, "dtype": dtype,
             "out_dtype": out_dtype, "layout": layout, "index_type": index_type,
             "epilogue": epilogue, "manifest": manifest, "arch": arch, "cache_dir": cache_dir}
    args = [arg for name, value in given.items() if value is not None
            for arg in _option(name, value)]
    if model_config is None and manifest is None and hidden is None:
        raise ValueError("moejit.precompile: nothing to compile; give model_config, manifest, or "
                         "hidden + top_k + dtype")
    if jobs is not None:
        if isinstance(jobs, bool) or not isinstance(jobs, numbers.Integral):
            raise TypeError(f"moejit.precompile: jobs must be an int, got {type(jobs).__name__}")
        if not 1 <= jobs <= 1024:
            raise ValueError(f"moejit.precompile: jobs = {jobs}; allowed: 1..1024")
        args += ["--jobs", str(int(jobs))]
    for name, flag_value, flag in (("readable_by_all", readable_by_all, "--readable-by-all"),
                                   ("dry_run", dry_run, "--dry-run")):
        if not isinstance(flag_value, bool):
            raise TypeError(f"moejit.precompile: {name} must be a bool, got "
                            f"{type(flag_value).__name__}")
        if flag_value:
            args.append(flag)
    done = subprocess.run([tool_path()] + args + ["--json"], env=_tool_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        summary = json.loads(done.stdout) if done.stdout.strip() else None
    except ValueError:
        summary = None
    if done.returncode != 0:
        raise PrecompileError(done.returncode, done.stderr, summary)
    if summary is None:
        raise PrecompileError(done.returncode, "no JSON summary on stdout:\n" + done.stdout +
                              done.stderr, None)
    return summary
