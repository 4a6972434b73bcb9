"""Scatter-like ops: write (or accumulate) values into a copy of a destination tensor at given
positions. What AOTAutograd's functionalization leaves of in-place writes: an embedding backward's
scatter-add (`index_put(zeros, [ids], grad, accumulate=True)`), a static KV cache written with
`index_copy_` (decomposed to `index_put(cache, [None, None, pos], k)`), slice assignment
(`slice_scatter`).

The IR is functional: every op here returns a NEW tensor equal to the destination with the
region written; the destination input is not modified. There is no Triton code generation:
lowering runs each as a library kernel through its reference (lower.node_kernel), which keeps it
inside the fused plan (and inside a captured CUDA graph: the torch kernels used are capturable).
The library kernel is copy-then-write (torch's functional `index_put` etc. clone the destination and
write in place into the clone), so its cost counts the destination's copy (read + write) plus the
written region. Where the destination is an intermediate of the Plan that nothing reads afterwards,
the memory plan runs the op's in-place form instead (INPLACE_FORMS, below): only the region, its
indices and its values move.

Inputs are seen in their own dtypes (NO_UPCAST): values must have the destination's dtype (torch's
rule for index_put; the frontend casts), and accumulation is torch's own, in that dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import DTypeError, InvalidValueError, ShapeError
from ..ir.node import Attrs
from ..ir.registry import NO_UPCAST, Cost, define
from ..ir.spec import TensorSpec
from . import _rules as R
from .layout import require_index


def _same_dtype(x: TensorSpec, values: TensorSpec, what: str) -> None:
    if values.dtype != x.dtype:
        raise DTypeError(f"{what} of dtype {values.dtype} must have the destination's dtype {x.dtype}")


def _copy_cost(x: TensorSpec) -> int:
    """The library kernel's copy of the destination: read once, written once."""
    return 2 * x.nbytes


def _region_cost(region_numel: int, itemsize: int, index_bytes: int, values_bytes: int, accumulate: bool) -> Cost:
    """Indices and values read once; the region written once (read too when accumulating)."""
    touched = region_numel * itemsize * (2 if accumulate else 1)
    return Cost(index_bytes + values_bytes + touched, region_numel if accumulate else 0)


# ---------------- index_put ----------------

def _index_put_dims(a: Attrs, rank: int, count: int) -> tuple[int, ...]:
    dims = tuple(a["index_dims"])
    if len(dims) != count:
        raise ShapeError(f"index_dims {dims} name {len(dims)} dims for {count} index tensors")
    if not dims:
        raise ShapeError("index_put needs at least one index tensor")
    if any(not isinstance(d, int) or not 0 <= d < rank for d in dims):
        raise ShapeError(f"index_dims {dims} must be dims of the destination (rank {rank}), in [0, {rank})")
    if list(dims) != sorted(set(dims)):
        raise ShapeError(f"index_dims {dims} must be strictly increasing")
    return dims


def indexed_shape(x_shape: tuple[int, ...], dims: Sequence[int], index_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of x[indices] (torch advanced indexing): with index tensors at adjacent dims the
    broadcast index shape takes their place; at non-adjacent dims it comes first."""
    rest = tuple(s for d, s in enumerate(x_shape) if d not in dims)
    if list(dims) == list(range(dims[0], dims[-1] + 1)):
        return tuple(x_shape[:dims[0]]) + index_shape + tuple(x_shape[dims[-1] + 1:])
    return index_shape + rest


def _index_put_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x, values, *indices = specs
    dims = _index_put_dims(a, x.rank, len(indices))
    for k, index in enumerate(indices):
        if index.dtype == "bool":
            raise DTypeError(f"index {k} is a boolean mask (its shape depends on the data); "
                             "index_put takes integer index tensors")
        require_index(index, f"index {k}")
    _same_dtype(x, values, "values")
    index_shape = R.broadcast_shapes(*(i.shape for i in indices))
    region = indexed_shape(x.shape, dims, index_shape)
    try:
        R.broadcast_shapes(values.shape, region)
    except ShapeError:
        raise ShapeError(f"values of shape {values.shape} do not broadcast to the indexed region {region}") from None
    if R.broadcast_shapes(values.shape, region) != region:
        raise ShapeError(f"values of shape {values.shape} are larger than the indexed region {region}")
    if not isinstance(a.get("accumulate", False), bool):
        raise InvalidValueError(f"accumulate must be a bool, got {a['accumulate']!r}")
    return x.with_(strides=None)


def _full_indices(indices: Sequence[torch.Tensor], a: Any) -> list[torch.Tensor | None]:
    """ATen's index list: one entry per dim up to the last indexed one, None for ':'."""
    dims = tuple(a["index_dims"])
    full: list[torch.Tensor | None] = [None] * (dims[-1] + 1)   # trailing dims: ':' (no entry)
    for d, index in zip(dims, indices, strict=True):
        full[d] = index if index.dtype == torch.int64 else index.long()
    return full


def _index_put_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    x, values, *indices = xs
    return torch.ops.aten.index_put.default(x, _full_indices(indices, a), values, bool(a.get("accumulate", False)))


def _index_put_into(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    x, values, *indices = xs
    return torch.ops.aten.index_put_.default(x, _full_indices(indices, a), values, bool(a.get("accumulate", False)))


def _index_put_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    x, values, *indices = ins
    index_shape = R.broadcast_shapes(*(i.shape for i in indices))
    region = indexed_shape(x.shape, tuple(a["index_dims"]), index_shape)
    numel = 1
    for s in region:
        numel *= s
    cost = _region_cost(numel, x.itemsize, sum(i.nbytes for i in indices), values.nbytes,
                        bool(a.get("accumulate", False)))
    return cost + Cost(_copy_cost(x), 0)


define("index_put", _index_put_infer, _index_put_ref, num_inputs=(3, -1), props={NO_UPCAST},
       cost_fn=_index_put_cost,
       doc="torch.index_put(x, indices, values, accumulate): a copy of x with values (broadcast to "
           "x[indices]) written at the integer index tensors; inputs (x, values, *index tensors), "
           "attrs index_dims (the dims the index tensors index, increasing; the others are ':'). "
           "accumulate=True adds, summing duplicate indices. Functional: x is not modified.")


# ---------------- index_copy ----------------

def _index_copy_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x, index, source = specs
    require_index(index)
    if index.rank > 1:
        raise ShapeError(f"index must be 0-D or 1-D, got shape {index.shape}")
    dim = R.norm_dim(a["dim"], x.rank)
    _same_dtype(x, source, "source")
    want = list(x.shape)
    if want:
        want[dim] = index.numel
    if tuple(want) != source.shape:
        raise ShapeError(f"source of shape {source.shape} must be {tuple(want)} (the destination {x.shape} "
                         f"with dim {dim} of the index's length {index.numel})")
    return x.with_(strides=None)


def _index_copy_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    x, index, source = ins
    return _region_cost(source.numel, x.itemsize, index.nbytes, source.nbytes, False) + Cost(_copy_cost(x), 0)


define("index_copy", _index_copy_infer,
       lambda xs, a: torch.index_copy(xs[0], R.norm_dim(a["dim"], xs[0].dim()), xs[1].long(), xs[2]),
       num_inputs=(3, 3), props={NO_UPCAST}, cost_fn=_index_copy_cost,
       doc="torch.index_copy(x, dim, index, source): a copy of x whose slices index[i] along dim are "
           "source's slice i (a 1-D integer index). Functional: x is not modified.")


# ---------------- scatter_add ----------------

def _scatter_add_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x, index, src = specs
    require_index(index)
    dim = R.norm_dim(a["dim"], x.rank)
    _same_dtype(x, src, "src")
    if not index.rank == src.rank == x.rank:
        raise ShapeError(f"destination {x.shape}, index {index.shape} and src {src.shape} must have one rank")
    for d in range(x.rank):
        if index.shape[d] > src.shape[d] or (d != dim and index.shape[d] > x.shape[d]):
            raise ShapeError(f"index of shape {index.shape} is larger than src {src.shape} or than the "
                             f"destination {x.shape} in dim {d} (only dim {dim} of the destination may be smaller)")
    return x.with_(strides=None)


def _scatter_add_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    x, index, src = ins
    return (_region_cost(index.numel, x.itemsize, index.nbytes, index.numel * src.itemsize, True)
            + Cost(_copy_cost(x), 0))


define("scatter_add", _scatter_add_infer,
       lambda xs, a: torch.scatter_add(xs[0], R.norm_dim(a["dim"], xs[0].dim()), xs[1].long(), xs[2]),
       num_inputs=(3, 3), props={NO_UPCAST}, cost_fn=_scatter_add_cost,
       doc="torch.scatter_add(x, dim, index, src): a copy of x plus src[i][j] added at [index[i][j]][j] "
           "(dim 0); duplicates summed. Functional: x is not modified.")


# ---------------- slice_scatter ----------------

def slice_range(size: int, start: int | None, end: int | None, step: int) -> range:
    """The positions a python slice start:end:step selects of `size` (torch's clamping)."""
    if not isinstance(step, int) or step < 1:
        raise InvalidValueError(f"slice step must be a positive int, got {step!r}")
    return range(size)[slice(start, end, step)]


def _slice_scatter_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x, src = specs
    dim = R.norm_dim(a["dim"], x.rank)
    _same_dtype(x, src, "src")
    picked = slice_range(x.shape[dim], a.get("start"), a.get("end"), a.get("step", 1))
    want = list(x.shape)
    want[dim] = len(picked)
    if tuple(want) != src.shape:
        raise ShapeError(f"src of shape {src.shape} must be {tuple(want)} (the slice "
                         f"{a.get('start')}:{a.get('end')}:{a.get('step', 1)} of dim {dim} of {x.shape})")
    return x.with_(strides=None)


def _slice_scatter_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    x, src = xs
    return torch.slice_scatter(x, src, R.norm_dim(a["dim"], x.dim()), a.get("start"), a.get("end"),
                               a.get("step", 1))


define("slice_scatter", _slice_scatter_infer, _slice_scatter_ref, num_inputs=(2, 2), props={NO_UPCAST},
       cost_fn=lambda i, o, a: (_region_cost(i[1].numel, i[0].itemsize, 0, i[1].nbytes, False)
                                + Cost(_copy_cost(i[0]), 0)),
       doc="torch.slice_scatter(x, src, dim, start, end, step): a copy of x with x[..., start:end:step, ...] "
           "(along dim) replaced by src. Functional: x is not modified.")


def _slice_scatter_into(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    x, src = xs
    dim = R.norm_dim(a["dim"], x.dim())
    where = (slice(None),) * dim + (slice(a.get("start"), a.get("end"), a.get("step", 1)),)
    x[where].copy_(src)
    return x


# In-place forms of the ops above: each writes (or accumulates) the region into its first input's memory
# and returns that tensor, with the functional op's results. The memory plan (runtime/memory.py
# plan_schedule) runs one instead of the copy-then-write reference when the destination is an
# intermediate that dies at this op, so only the region, indices and values move (an embedding's
# gradient scatter-added into the tied LM head's gradient: no copy of the [vocab, dim] table).
INPLACE_FORMS: dict[str, Callable[[list[torch.Tensor], Any], torch.Tensor]] = {
    "index_put": _index_put_into,
    "index_copy": lambda xs, a: xs[0].index_copy_(R.norm_dim(a["dim"], xs[0].dim()), xs[1].long(), xs[2]),
    "scatter_add": lambda xs, a: xs[0].scatter_add_(R.norm_dim(a["dim"], xs[0].dim()), xs[1].long(), xs[2]),
    "slice_scatter": _slice_scatter_into,
}


class ScatterMethods:
    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def index_put(self, input: Any, indices: Sequence[Any], values: Any, accumulate: bool = False,
                  name: str | None = None) -> Any:
        """torch.index_put: `indices` is one entry per leading dim of input, an integer tensor or None
        (':'); returns a new tensor (input is not modified)."""
        dims = tuple(d for d, i in enumerate(indices) if i is not None)
        tensors = [i for i in indices if i is not None]
        return self._apply("index_put", input, values, *tensors, index_dims=dims, accumulate=bool(accumulate),
                           name=name)

    def index_copy(self, input: Any, dim: int, index: Any, source: Any, name: str | None = None) -> Any:
        """torch.index_copy (functional)."""
        return self._apply("index_copy", input, index, source, dim=dim, name=name)

    def scatter_add(self, input: Any, dim: int, index: Any, src: Any, name: str | None = None) -> Any:
        """torch.scatter_add (functional)."""
        return self._apply("scatter_add", input, index, src, dim=dim, name=name)

    def slice_scatter(self, input: Any, src: Any, dim: int = 0, start: int | None = None, end: int | None = None,
                      step: int = 1, name: str | None = None) -> Any:
        """torch.slice_scatter (functional)."""
        return self._apply("slice_scatter", input, src, dim=dim, start=start, end=end, step=step, name=name)
