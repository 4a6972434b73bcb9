"""Immutable IR nodes. A node is one typed tensor operation; identity is the node object itself."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .spec import TensorSpec

_next_id = itertools.count()


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return Attrs(value)
    return value


class Attrs(Mapping[str, Any]):
    """A frozen, hashable mapping of op attributes (lists become tuples)."""

    __slots__ = ("_hash", "_items")

    def __init__(self, values: Mapping[str, Any] | None = None, **kw: Any) -> None:
        merged = dict(values or {}, **kw)
        self._items = dict(sorted((k, _freeze(v)) for k, v in merged.items()))
        self._hash: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def key(self) -> tuple[tuple[str, Any], ...]:
        """A hashable summary; tensors (constants) hash by identity."""
        return tuple((k, v if _hashable(v) else ("<obj>", id(v))) for k, v in self._items.items())

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self.key())
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Attrs) and self.key() == other.key()

    def replace(self, **changes: Any) -> Attrs:
        return Attrs(self._items, **changes)

    def __repr__(self) -> str:
        return ", ".join(f"{k}={_short(v)}" for k, v in self._items.items())


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _short(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    return repr(value)


@dataclass(frozen=True, eq=False)
class Node:
    """One operation. `specs` has one entry per output; most ops have exactly one.

    Multi-output ops (e.g. layernorm_backward) are consumed through `getitem` nodes.
    """

    op: str
    inputs: tuple[Node, ...]
    attrs: Attrs
    specs: tuple[TensorSpec, ...]
    name: str
    source: str = ""
    id: int = field(default_factory=lambda: next(_next_id))

    @property
    def spec(self) -> TensorSpec:
        if len(self.specs) != 1:
            raise AttributeError(f"node {self.name} ({self.op}) has {len(self.specs)} outputs")
        return self.specs[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def multi_output(self) -> bool:
        return len(self.specs) != 1

    def replace(self, **changes: Any) -> Node:
        """A new node (fresh id) with some fields changed."""
        values: dict[str, Any] = {"op": self.op, "inputs": self.inputs, "attrs": self.attrs, "specs": self.specs,
                  "name": self.name, "source": self.source}
        values.update(changes)
        return Node(**values)

    def __repr__(self) -> str:
        return f"Node({self.name}: {self.op})"
