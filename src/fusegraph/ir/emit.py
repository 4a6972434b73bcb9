"""Emitter: the one place that creates Nodes. It converts Python numbers to scalar nodes, runs
the op's shape/dtype rule (prefixing errors with the node, op and user line), and splits
multi-output ops into getitem nodes. The user-facing builder and every decomposition use it."""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

from ..errors import FusegraphError, GraphError, where
from . import dtypes
from .node import Attrs, Node
from .registry import get_op
from .spec import TensorSpec

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Files inside the package that build graphs as a user would (the demo's blocks): their lines are shown.
USER_CODE_FILES: set[str] = set()

Operand = Node | int | float | bool


def user_source_line() -> str:
    """file:line of the innermost frame outside the fusegraph package (the user's code)."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if (not filename.startswith(_PACKAGE_DIR) or filename in USER_CODE_FILES) and "importlib" not in filename:
            return f"{os.path.relpath(filename) if filename.startswith(os.getcwd()) else filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return ""


def scalar_dtype(value: int | float | bool, like: str | None) -> str:
    """The dtype a Python number takes next to a tensor of dtype `like` (torch's weak typing)."""
    if isinstance(value, bool):
        return like if like == "bool" else (like or "bool")
    if isinstance(value, int):
        return like or "int64"
    if like is not None and dtypes.is_float(like):
        return like
    return "float32"


class Emitter:
    def __init__(self, prefix: str = "", source: str | None = None) -> None:
        self.prefix = prefix
        self.source = source          # fixed source (decompositions inherit the parent's line)
        self._counter = itertools.count()
        self.created: list[Node] = []

    def fresh_name(self, hint: str) -> str:
        return f"{self.prefix}{hint}_{next(self._counter)}"

    def scalar(self, value: int | float | bool, dtype: str) -> Node:
        spec = TensorSpec((), dtype)
        return self._make("scalar", (), Attrs(value=value), (spec,), None)

    def op(self, name: str, *operands: Operand, _name: str | None = None, **attrs: Any) -> Any:
        """Create an op node; returns a Node, or a tuple of getitem Nodes for multi-output ops."""
        opdef = get_op(name)
        like = next((o.dtype for o in operands if isinstance(o, Node) and not o.multi_output), None)
        inputs = tuple(o if isinstance(o, Node) else self.scalar(o, scalar_dtype(o, like))
                       for o in operands)
        lo, hi = opdef.num_inputs
        source = self.source if self.source is not None else user_source_line()
        node_name = _name or self.fresh_name(name)
        if len(inputs) < lo or (hi >= 0 and len(inputs) > hi):
            raise GraphError(f"{where(name, node_name, source)}: takes {lo}..{hi if hi >= 0 else 'n'} "
                             f"inputs, got {len(inputs)}")
        for i in inputs:
            if i.multi_output:
                raise GraphError(f"{where(name, node_name, source)}: input '{i.name}' has several "
                                 "outputs; select one first")
        frozen = Attrs({k: v for k, v in attrs.items() if v is not None or k in ("dims",)})
        try:
            out = opdef.infer([i.spec for i in inputs], frozen)
        except FusegraphError as err:
            raise type(err)(f"{where(name, node_name, source)}: {err}") from None
        specs = out if isinstance(out, tuple) else (out,)
        node = self._make(name, inputs, frozen, specs, node_name, source)
        if len(specs) == 1:
            return node
        return tuple(self._make("getitem", (node,), Attrs(index=k), (s,), f"{node_name}.{k}", source)
                     for k, s in enumerate(specs))

    def _make(self, op: str, inputs: tuple[Node, ...], attrs: Attrs, specs: tuple[TensorSpec, ...],
              name: str | None, source: str | None = None) -> Node:
        node = Node(op=op, inputs=inputs, attrs=attrs, specs=specs, name=name or self.fresh_name(op),
                    source=source if source is not None else (self.source or ""))
        self.created.append(node)
        return node
