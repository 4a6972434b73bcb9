"""Load what `fusegraph explain` / `whatif` report on: a script or a module that builds a plan.

Convention: the target defines `build()` returning `(plan, inputs)`, where `plan` is a built
fusegraph Plan (`g.build()`) and `inputs` its input tensors (a list in declaration order, or a
feed dict); `inputs` may be None (fresh random inputs are made on a GPU). A target is

- a path to a Python file: `fusegraph explain my_model.py` (run as a script, then `build()` is called);
- a module path: `fusegraph explain mypkg.blocks`, or `mypkg.blocks:make_block` for another function.

When the target raises, the user sees the target's own traceback (fusegraph's frames left out).
"""

from __future__ import annotations

import importlib
import runpy
import sys
import traceback
from pathlib import Path
from typing import Any

from ..errors import FusegraphError


class TargetError(FusegraphError):
    """The user's script or module failed, or does not follow the build() convention."""

    def __init__(self, message: str, user_traceback: str = "") -> None:
        super().__init__(message)
        self.user_traceback = user_traceback


def _user_traceback(err: BaseException, target_file: str | None) -> str:
    """The traceback from the first frame of the user's code on (runpy/loader frames dropped)."""
    frames = traceback.extract_tb(err.__traceback__)
    here = str(Path(__file__).resolve())
    skip = ("runpy.py", "importlib", here)
    start = 0
    for i, frame in enumerate(frames):
        if target_file and Path(frame.filename).resolve() == Path(target_file).resolve():
            start = i
            break
        if not any(s in frame.filename for s in skip):
            start = i
            break
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames[start:])]
    lines += traceback.format_exception_only(type(err), err)
    return "".join(lines)


def load_target(target: str) -> tuple[Any, Any, str]:
    """(plan, inputs, title) from a script path or a module path (see the module docstring)."""
    func_name = "build"
    path = Path(target)
    if target.endswith(".py") or path.exists():
        if not path.exists():
            raise TargetError(f"script {target!r} does not exist")
        title, file = path.stem, str(path)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            namespace = runpy.run_path(str(path), run_name="__fusegraph_target__")
        except SystemExit as err:
            raise TargetError(f"script {target} exited (code {err.code}) before defining build()") from None
        except Exception as err:
            raise TargetError(f"script {target} failed: {type(err).__name__}: {err}",
                              _user_traceback(err, file)) from err
        finally:
            sys.path.pop(0)
    else:
        module_name, _, attr = target.partition(":")
        func_name = attr or func_name
        title, file = module_name, None
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and module_name.startswith(err.name):
                raise TargetError(f"{target!r} is neither a script path nor an importable module "
                                  f"(no module named {err.name!r})") from None
            raise TargetError(f"module {module_name} failed to import: {err}", _user_traceback(err, None)) from err
        except Exception as err:
            raise TargetError(f"module {module_name} failed to import: {type(err).__name__}: {err}",
                              _user_traceback(err, None)) from err
        namespace = vars(module)
        file = getattr(module, "__file__", None)
    build = namespace.get(func_name)
    if not callable(build):
        raise TargetError(f"{target} defines no function {func_name}(); it must return (plan, inputs) — "
                          "see `fusegraph explain --help`")
    try:
        result = build()
    except Exception as err:
        raise TargetError(f"{target}: {func_name}() failed: {type(err).__name__}: {err}",
                          _user_traceback(err, file)) from err
    if not (isinstance(result, tuple) and len(result) == 2) or not hasattr(result[0], "kernels"):
        raise TargetError(f"{target}: {func_name}() must return (plan, inputs) with plan = g.build(); "
                          f"got {type(result).__name__}")
    return result[0], result[1], title
