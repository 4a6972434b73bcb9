"""Shape and dtype rules shared by op definitions. They raise ShapeError / DTypeError with the
offending values; the emitter prefixes the node, op and user line."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import DTypeError, ShapeError
from ..ir import dtypes
from ..ir.node import Attrs
from ..ir.spec import TensorSpec


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        sizes = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            raise ShapeError(f"shapes {', '.join(str(tuple(s)) for s in shapes)} are not broadcastable "
                             f"(dim {i - rank}: sizes {sorted(sizes)})")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def norm_dim(dim: int, rank: int) -> int:
    if not -max(rank, 1) <= dim < max(rank, 1):
        raise ShapeError(f"dim {dim} is out of range for a tensor of rank {rank}")
    return dim % max(rank, 1)


def norm_dims(dims: int | Sequence[int] | None, rank: int) -> tuple[int, ...]:
    """Normalized, sorted, unique dims; None means all dims."""
    if dims is None:
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = (dims,)
    out = sorted({norm_dim(d, rank) for d in dims})
    if len(out) != len(tuple(dims)):
        raise ShapeError(f"dims {tuple(dims)} repeat a dimension")
    return tuple(out)


def reduced_shape(shape: tuple[int, ...], dims: tuple[int, ...], keepdim: bool) -> tuple[int, ...]:
    if keepdim:
        return tuple(1 if i in dims else s for i, s in enumerate(shape))
    return tuple(s for i, s in enumerate(shape) if i not in dims)


def require_float(spec: TensorSpec, what: str = "input") -> None:
    if not dtypes.is_float(spec.dtype):
        raise DTypeError(f"{what} must be a floating-point tensor, got {spec.dtype}")


def same(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    """Output like the first input."""
    return specs[0].with_(strides=None)


def float_same(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    """Output like the (floating) input: ints are promoted to float32, as torch does for exp etc."""
    s = specs[0]
    dtype = s.dtype if dtypes.is_float(s.dtype) else "float32"
    return s.with_(dtype=dtype, strides=None)


def broadcast(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    """Elementwise over broadcast inputs; dtype by torch promotion. Layout follows the first
    input of the full output shape."""
    shape = broadcast_shapes(*(s.shape for s in specs))
    dtype = dtypes.promote(*(s.dtype for s in specs))
    layout = next((s.layout for s in specs if s.shape == shape and s.layout), None)
    return TensorSpec(shape, dtype, layout=layout, device=specs[0].device)


def broadcast_bool(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    return broadcast(specs, attrs).with_(dtype="bool")


def reduce(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    s = specs[0]
    dims = norm_dims(attrs.get("dims"), s.rank)
    return TensorSpec(reduced_shape(s.shape, dims, bool(attrs.get("keepdim", False))), s.dtype,
                      device=s.device)


def float_reduce(specs: Sequence[TensorSpec], attrs: Attrs) -> TensorSpec:
    out = reduce(specs, attrs)
    return out if dtypes.is_float(out.dtype) else out.with_(dtype="float32")
