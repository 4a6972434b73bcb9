"""TensorSpec: what the compiler knows about a tensor (shape, dtype, memory layout, device)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from . import dtypes

# Named layouts map a logical dim order to a memory order (outermost first).
LAYOUTS: dict[str, tuple[int, ...]] = {"NHWC": (0, 2, 3, 1), "NDHWC": (0, 2, 3, 4, 1)}


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def strides_for_order(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a dense tensor whose dims are laid out in memory in `order` (outermost first)."""
    strides = [0] * len(shape)
    acc = 1
    for dim in reversed(order):
        strides[dim] = acc
        acc *= max(shape[dim], 1)
    return tuple(strides)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str
    layout: str | None = None          # None = row-major contiguous; "NHWC" etc.; "strided" = see strides
    strides: tuple[int, ...] | None = field(default=None, compare=True)
    device: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", dtypes.canonical(self.dtype))
        if self.strides is not None:
            object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtypes.itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def memory_strides(self) -> tuple[int, ...]:
        """Element strides of the tensor as laid out in memory."""
        if self.strides is not None:
            return self.strides
        if self.layout in LAYOUTS and len(LAYOUTS[self.layout]) == self.rank:
            return strides_for_order(self.shape, LAYOUTS[self.layout])
        return contiguous_strides(self.shape)

    def with_(self, **changes: object) -> TensorSpec:
        values: dict[str, Any] = {"shape": self.shape, "dtype": self.dtype, "layout": self.layout,
                  "strides": self.strides, "device": self.device}
        values.update(changes)
        return TensorSpec(**values)  # type: ignore[arg-type]

    def __str__(self) -> str:
        dims = "x".join(str(s) for s in self.shape) or "scalar"
        lay = f" {self.layout}" if self.layout else ""
        return f"{self.dtype}[{dims}]{lay}"


def dense_in_order(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """Dense strides in the dimension order of `strides` (innermost = smallest), or None when
    `strides` overlap (a stride-0 broadcast)."""
    dims = sorted(range(len(shape)), key=lambda i: (strides[i], i))
    reach = 1
    for i in dims:
        if shape[i] == 1:
            continue
        if strides[i] < reach:
            return None
        reach = strides[i] * shape[i]
    out = [0] * len(shape)
    expected = 1
    for i in dims:
        out[i] = expected
        expected *= max(int(shape[i]), 1)
    return tuple(out)


def same_strides(shape: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Strides `a` and `b` address the same elements of `shape` (they may differ on size-1 dims)."""
    return len(a) == len(b) and all(x == y for x, y, s in zip(a, b, shape, strict=True) if s > 1)
