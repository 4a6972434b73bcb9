"""Index generators: `iota`, a primitive with no inputs whose value is the index along one dim.

iota is what decompositions use to build one-hot masks (cross-entropy's target logit) and
position-dependent values without reading memory. It is pointwise-like: the code generator
computes it from the tile's index along `attrs["dim"]`.

Triton hook contract: `triton(args, attrs)` takes ONE argument, the name of the variable that
holds the index along `attrs["dim"]` (already broadcast to the tile), and returns the expression
of the value. `extra["index_dim_attr"] == "dim"` names that attribute; `extra["generator"]`
says the op reads no memory. iota is pure, so CSE may merge equal (shape, dim, dtype); constant
folding should leave it alone (folding it would materialize a tensor that costs only registers).

Also here: `reshape_to`, the one helper the decompositions use to add or split dims.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import DTypeError, ShapeError
from ..ir import dtypes
from ..ir.emit import Emitter
from ..ir.node import Attrs, Node
from ..ir.registry import POINTWISE, define
from ..ir.spec import TensorSpec
from . import _rules as R

_TRITON_DTYPES = {"int64": "tl.int64", "int32": "tl.int32", "int16": "tl.int16", "int8": "tl.int8",
                  "float32": "tl.float32", "float64": "tl.float64", "float16": "tl.float16",
                  "bfloat16": "tl.bfloat16"}


def _iota_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    shape = tuple(a["shape"])
    if not shape or any((not isinstance(s, int)) or s < 0 for s in shape):
        raise ShapeError(f"iota needs a shape of rank >= 1 with non-negative sizes, got {shape}")
    dim = R.norm_dim(a["dim"], len(shape))
    dtype = dtypes.canonical(a.get("dtype", "int64"))
    if dtype not in _TRITON_DTYPES:
        raise DTypeError(f"iota dtype must be an integer or float type, got {dtype}")
    exact_up_to = {"float32": 2 ** 24, "float16": 2 ** 11, "bfloat16": 2 ** 8}.get(dtype)
    if exact_up_to is not None and shape[dim] > exact_up_to:
        raise DTypeError(f"iota over {shape[dim]} positions is not exact in {dtype}")
    return TensorSpec(shape, dtype)


def _iota_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    shape = tuple(a["shape"])
    dim = R.norm_dim(a["dim"], len(shape))
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return torch.arange(shape[dim], dtype=dtypes.to_torch(a.get("dtype", "int64"))).view(view).expand(shape)


def _iota_triton(args: list[str], a: Any) -> str:
    return f"({args[0]}).to({_TRITON_DTYPES[dtypes.canonical(a.get('dtype', 'int64'))]})"


define("iota", _iota_infer, _iota_ref, num_inputs=(0, 0), props={POINTWISE},
       triton=_iota_triton, extra={"index_dim_attr": "dim", "generator": True},
       doc="iota(shape, dim, dtype): the index along `dim`, broadcast over the other dims. "
           "Triton hook: args[0] is the index variable along attrs['dim'].")


def reshape_to(e: Emitter, x: Node, shape: Sequence[int]) -> Node:
    """Reshape inside a decomposition (a view: the fusion compiler folds it into indexing)."""
    shape = tuple(int(s) for s in shape)
    return x if x.shape == shape else e.op("reshape", x, shape=shape)


def channel_view_shape(channels: int, rank: int) -> tuple[int, ...]:
    """Shape that broadcasts a per-channel [C] vector against an [N, C, *spatial] tensor."""
    return (channels,) + (1,) * (rank - 2)


class IndexGenMethods:
    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def iota(self, shape: Sequence[int], dim: int = 0, dtype: Any = "int64", name: str | None = None) -> Any:
        """The index along `dim` of a tensor of `shape` (torch.arange(shape[dim]) broadcast)."""
        return self._apply("iota", shape=tuple(shape), dim=dim, dtype=dtypes.canonical(dtype), name=name)
