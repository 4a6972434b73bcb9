"""sm_90 PTX of a generated kernel, compiled by Triton on a machine without a GPU: what the tests read to
check the instructions a kernel compiles to (16-byte vectors, TMA, griddepcontrol)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

_COMPILE = """
import importlib.util, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
path, name, constants, types = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
spec = importlib.util.spec_from_file_location("fg_ptx_check", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
fn = getattr(module, name)
signature = {a: ("constexpr" if a in constants else types.get(a, "*fp32")) for a in fn.arg_names}
attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a not in constants}
src = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
sys.stdout.write(compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def sm90_ptx(source: str, name: str, constants: dict[str, Any], types: dict[str, str], tmp: Path) -> str:
    """The kernel compiled for sm_90 by Triton's compiler (no GPU needed), in a process of its own: the
    interpreter (TRITON_INTERPRET=1, as in CI) leaves this one unable to compile."""
    path = tmp / f"{name}.py"
    path.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(path), name, json.dumps(constants), json.dumps(types)],
                          capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:   # a Triton that cannot compile for CUDA on this machine
        pytest.skip(f"cannot compile sm_90 PTX here: {done.stderr[-300:]}")
    return done.stdout


_COMPILE_EXACT = """
import importlib.util, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
path, name, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
loader = importlib.util.spec_from_file_location("fg_ptx_check", path)
module = importlib.util.module_from_spec(loader)
loader.loader.exec_module(module)
attrs = {tuple(k): v for k, v in spec["attrs"]}
src = ASTSource(fn=getattr(module, name), signature=spec["signature"], constexprs=spec["constants"], attrs=attrs)
sys.stdout.write(compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"]).asm["ptx"])
"""


def sm90_ptx_exact(source: str, name: str, signature: dict[str, str], constants: dict[str, Any],
                   attrs: dict[tuple[int, ...], Any], options: dict[str, Any]) -> str:
    """`name` from `source` compiled for sm_90 with exactly this signature, these constexprs, these
    argument attributes (divisibility) and launch options, in a process without TRITON_INTERPRET (the
    interpreter patches triton.language in the process it runs in). A compile error fails the test."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.py"
        path.write_text(source)
        spec = {"signature": signature, "constants": constants, "attrs": [[list(k), v] for k, v in attrs.items()],
                "options": options}
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-c", _COMPILE_EXACT, str(path), name, json.dumps(spec)],
                              capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"sm_90 compile of {name} failed: {done.stderr[-2000:]}")
    return done.stdout
