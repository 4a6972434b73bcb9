"""A table harness for op tests: each OpCase builds a graph through fg.Graph, runs it with the
reference executor, and compares to an independent torch computation (done in float64 on the
same input values), over several dtypes.

Inputs are made by `makers` (dtype -> tensor), which is where non-contiguous inputs come from
(`.t()`, `.transpose`, slicing); integer inputs (indices) ignore the dtype they are given."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.ir import dtypes as fg_dtypes

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
Maker = Callable[[torch.dtype], torch.Tensor]


def make(*shape: int, transpose: tuple[int, int] | None = None, step: int = 1) -> Maker:
    """A maker of random data of `shape`; with `transpose` the tensor is a transposed view (made from
    a tensor of the swapped shape), with `step` > 1 a strided slice of the last dim. Integer dtypes
    get random integers in [-50, 50)."""
    def build(dtype: torch.dtype) -> torch.Tensor:
        base = list(shape)
        if transpose is not None:
            i, j = transpose
            base[i], base[j] = base[j], base[i]
        if step > 1:
            base[-1] *= step
        if dtype.is_floating_point:
            t = rand(*base, dtype=dtype)
        else:
            t = torch.randint(-50, 50, base, dtype=dtype)
        if transpose is not None:
            t = t.transpose(*transpose)
        if step > 1:
            t = t[..., ::step]
        assert tuple(t.shape) == shape
        return t
    return build


def seeded(seed: int) -> torch.Generator:
    """A generator for module-level fixed data (masks, indices), the same in every process."""
    return torch.Generator().manual_seed(seed)


def const(tensor: torch.Tensor) -> Maker:
    """A fixed tensor (indices, masks) whatever the dtype of the case."""
    return lambda dtype: tensor


@dataclass
class OpCase:
    id: str
    makers: Sequence[Maker]
    build: Callable[..., Any]               # (g, *handles) -> handle or tuple of handles
    expect: Callable[..., Any]              # (*float64 tensors) -> tensor or tuple (independent torch)
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES
    tol: dict[torch.dtype, float] = field(default_factory=dict)
    channels_last: Sequence[int] = ()       # inputs to feed as channels-last (declared NHWC)


def params(cases: Sequence[OpCase]) -> list[Any]:
    return [pytest.param(c, d, id=f"{c.id}-{str(d).replace('torch.', '')}") for c in cases for d in c.dtypes]


def _widen(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def run_case(case: OpCase, dtype: torch.dtype) -> None:
    torch.manual_seed(zlib.crc32(case.id.encode()))  # reproducible across runs and xdist workers
    tensors = [m(dtype) for m in case.makers]
    tensors = [t.contiguous(memory_format=torch.channels_last) if k in case.channels_last else t
               for k, t in enumerate(tensors)]
    g = fg.Graph(name=case.id)
    handles = [g.tensor_like(t, name=f"in{k}") for k, t in enumerate(tensors)]
    for k in case.channels_last:
        assert handles[k].spec.layout == "NHWC"
    built = case.build(g, *handles)
    outs = built if isinstance(built, tuple) else (built,)
    for o in outs:
        o.set_output()
    g.validate()
    results = fg.reference(g).execute(dict(zip(handles, tensors, strict=True)))
    expected = case.expect(*(_widen(t) for t in tensors))
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(expected) == len(outs)
    for k, (o, want) in enumerate(zip(outs, expected, strict=True)):
        got = results[o]
        assert got.dtype == fg_dtypes.to_torch(o.dtype), f"{case.id} output {k}: dtype {got.dtype} != {o.dtype}"
        assert tuple(got.shape) == o.shape, f"{case.id} output {k}: shape {tuple(got.shape)} != inferred {o.shape}"
        if got.is_floating_point():
            assert_close(got, want, tol=case.tol.get(got.dtype), what=f"{case.id} output {k} ({dtype})")
        else:
            assert torch.equal(got, want.to(got.dtype)), f"{case.id} output {k}: values differ"
