"""Layout and indexing: views (reshape, permute, transpose, expand, slice) and data movement
(concat, pad, gather, embedding, index_select).

A VIEW op moves no data when the code generator folds it into the consumer's indexing, so its
cost is 0 bytes and 0 FLOPs; a partition that must materialize one pays the copy in its own
cost. `extra["view"]` names the index map, `extra["view_params"](in_spec, attrs)` gives its
normalized parameters, and `extra["fold"](in_spec, attrs, strides, offset)` turns the element
strides and offset through which the input is read into those of the output, or None when the
view is not a strided view of the input (a reshape across non-mergeable strides). All these
ops are exact data movement, so the reference sees its inputs' own dtypes (NO_UPCAST)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import DTypeError, ShapeError
from ..ir import dtypes
from ..ir.node import Attrs
from ..ir.registry import LAYOUT_TRANSPARENT, NO_UPCAST, POINTWISE, VIEW, Cost, define
from ..ir.spec import LAYOUTS, TensorSpec, contiguous_strides
from . import _rules as R


def _free(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    return Cost(0, 0)


def _moved(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    return Cost(sum(s.nbytes for s in ins) + sum(s.nbytes for s in outs), 0)


def _out(x: TensorSpec, shape: tuple[int, ...], keep_layout: bool = False) -> TensorSpec:
    return TensorSpec(shape, x.dtype, layout=x.layout if keep_layout else None, device=x.device)


Strided = tuple[tuple[int, ...], int]  # (element strides, element offset) of a strided view


def reshape_strides(shape: Sequence[int], strides: Sequence[int], new_shape: Sequence[int]) -> tuple[int, ...] | None:
    """Strides that read a tensor of `shape`/`strides` as `new_shape` in row-major order without a
    copy, or None (torch's view rule: only dims that are contiguous with each other merge or split)."""
    if math.prod(shape) == 0 or not shape:
        return tuple(contiguous_strides(tuple(new_shape)))
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    base = strides[-1]
    tensor_numel = view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != tensor_numel * base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_strides[view_d] = view_numel * base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                base, tensor_numel, view_numel = strides[d - 1], 1, 1
    return tuple(new_strides) if view_d == -1 else None


def _fold_reshape(x: TensorSpec, a: Attrs, strides: Sequence[int], offset: int) -> Strided | None:
    new = reshape_strides(x.shape, strides, resolve_shape(x.numel, a["shape"]))
    return None if new is None else (new, offset)


def _fold_permute(x: TensorSpec, a: Attrs, strides: Sequence[int], offset: int) -> Strided:
    return tuple(strides[p] for p in _permutation(x, a)), offset


def _fold_expand(x: TensorSpec, a: Attrs, strides: Sequence[int], offset: int) -> Strided:
    shape = _expand_shape(x, a["shape"])
    lead = len(shape) - x.rank
    kept = (0 if x.shape[i] == 1 and shape[lead + i] != 1 else strides[i] for i in range(x.rank))
    return (0,) * lead + tuple(kept), offset


def _fold_slice(x: TensorSpec, a: Attrs, strides: Sequence[int], offset: int) -> Strided:
    p = _slice_params(x, a)
    out = list(strides)
    out[p["dim"]] = strides[p["dim"]] * p["step"]
    return tuple(out), offset + p["start"] * strides[p["dim"]]


# ---- reshape: out flat index == in flat index (row-major) ----

def resolve_shape(numel: int, shape: Sequence[int], what: str = "reshape") -> tuple[int, ...]:
    """`shape` with its one -1 resolved so that it holds `numel` elements."""
    shape = tuple(int(s) for s in shape)
    unknown = [i for i, s in enumerate(shape) if s == -1]
    if len(unknown) > 1 or any(s < -1 for s in shape):
        raise ShapeError(f"{what} shape {shape} may have at most one -1 and no other negative size")
    known = math.prod(s for s in shape if s != -1)
    if unknown:
        if known == 0 or numel % known:
            raise ShapeError(f"cannot {what} {numel} elements into shape {shape}")
        shape = (*shape[:unknown[0]], numel // known, *shape[unknown[0] + 1:])
    if math.prod(shape) != numel:
        raise ShapeError(f"cannot {what} {numel} elements into shape {shape} ({math.prod(shape)} elements)")
    return shape


def _reshape_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x = specs[0]
    try:
        return _out(x, resolve_shape(x.numel, a["shape"]))
    except ShapeError as err:
        raise ShapeError(f"input of shape {x.shape}: {err}") from None


define("reshape", _reshape_infer, lambda xs, a: xs[0].reshape(tuple(a["shape"])), props={VIEW, NO_UPCAST},
       cost_fn=_free,
       extra={"view": "reshape", "view_params": lambda x, a: {"shape": resolve_shape(x.numel, a["shape"])},
              "fold": _fold_reshape},
       doc="x.reshape(shape) (one -1 allowed). View: out row-major index == in row-major index.")


# ---- permute / transpose: out dim i is in dim perm[i] ----

def _permutation(x: TensorSpec, a: Attrs) -> tuple[int, ...]:
    if "dims" in a:
        dims = tuple(a["dims"])
        if len(dims) != x.rank:
            raise ShapeError(f"permute dims {dims} must name each of the {x.rank} dims of shape {x.shape} once")
        perm = tuple(R.norm_dim(d, x.rank) for d in dims)
        if sorted(perm) != list(range(x.rank)):
            raise ShapeError(f"permute dims {dims} are not a permutation of the dims of shape {x.shape}")
        return perm
    d0, d1 = R.norm_dim(a["dim0"], x.rank), R.norm_dim(a["dim1"], x.rank)
    swapped = list(range(x.rank))
    swapped[d0], swapped[d1] = swapped[d1], swapped[d0]
    return tuple(swapped)


def _permute_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x = specs[0]
    try:
        perm = _permutation(x, a)
    except ShapeError as err:
        raise ShapeError(f"input of shape {x.shape}: {err}") from None
    return _out(x, tuple(x.shape[p] for p in perm))


_PERMUTE_EXTRA = {"view": "permute", "view_params": lambda x, a: {"perm": _permutation(x, a)}, "fold": _fold_permute}
define("permute", _permute_infer, lambda xs, a: xs[0].permute(*a["dims"]), props={VIEW, NO_UPCAST},
       cost_fn=_free, extra=_PERMUTE_EXTRA, doc="x.permute(dims). View: out[i...] = in[i permuted back].")
define("transpose", _permute_infer, lambda xs, a: xs[0].transpose(a["dim0"], a["dim1"]),
       props={VIEW, NO_UPCAST}, cost_fn=_free, extra=_PERMUTE_EXTRA,
       doc="x.transpose(dim0, dim1): a permute that swaps two dims (view_params gives the permutation).")


# ---- expand: size-1 (and new leading) dims broadcast with stride 0 ----

def _expand_shape(x: TensorSpec, shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    lead = len(shape) - x.rank
    if lead < 0:
        raise ShapeError(f"cannot expand shape {x.shape} to fewer dims {shape}")
    out = []
    for i, size in enumerate(shape):
        if i < lead:
            if size < 0:
                raise ShapeError(f"expand to {shape}: new leading dim {i} cannot be {size}")
            out.append(size)
            continue
        have = x.shape[i - lead]
        if size == -1:
            out.append(have)
        elif have in (1, size) and size >= 0:
            out.append(size)
        else:
            raise ShapeError(f"cannot expand shape {x.shape} to {shape}: dim {i} has size {have}, which is "
                             f"neither 1 nor {size}")
    return tuple(out)


define("expand", lambda s, a: _out(s[0], _expand_shape(s[0], a["shape"])),
       lambda xs, a: xs[0].expand(*a["shape"]), props={VIEW, NO_UPCAST}, cost_fn=_free,
       extra={"view": "broadcast", "view_params": lambda x, a: {"shape": _expand_shape(x, a["shape"])},
              "fold": _fold_expand},
       doc="x.expand(shape) (-1 keeps a size). View: broadcast dims read with stride 0.")


# ---- slice: in[dim] = start + step * out[dim] ----

def slice_bounds(size: int, start: int | None, end: int | None, step: int) -> tuple[int, int, int]:
    """(start, length, step) after torch's rules: negative bounds count from the end, then clamp."""
    if step < 1:
        raise ShapeError(f"slice step must be >= 1, got {step}")
    lo = 0 if start is None else (start + size if start < 0 else start)
    hi = size if end is None else (end + size if end < 0 else end)
    lo, hi = min(max(lo, 0), size), min(max(hi, 0), size)
    return lo, max(0, -(-(hi - lo) // step)), step


def _slice_params(x: TensorSpec, a: Attrs) -> dict[str, int]:
    dim = R.norm_dim(a.get("dim", 0), x.rank)
    start, length, step = slice_bounds(x.shape[dim], a.get("start"), a.get("end"), int(a.get("step", 1)))
    return {"dim": dim, "start": start, "length": length, "step": step}


def _slice_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x = specs[0]
    if x.rank == 0:
        raise ShapeError("cannot slice a 0-d tensor")
    try:
        p = _slice_params(x, a)
    except ShapeError as err:
        raise ShapeError(f"input of shape {x.shape}: {err}") from None
    shape = list(x.shape)
    shape[p["dim"]] = p["length"]
    return _out(x, tuple(shape), keep_layout=True)


def _slice_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    x = xs[0]
    index = [slice(None)] * x.dim()
    index[a.get("dim", 0)] = slice(a.get("start"), a.get("end"), a.get("step", 1))
    return x[tuple(index)]


define("slice", _slice_infer, _slice_ref, props={VIEW, LAYOUT_TRANSPARENT, NO_UPCAST}, cost_fn=_free,
       extra={"view": "slice", "view_params": _slice_params, "fold": _fold_slice},
       doc="x[..., start:end:step, ...] along dim (torch's negative and clamped bounds; step >= 1). "
           "View: in[dim] = start + step * out[dim]. Output keeps x's layout.")


# ---- data movement ----

def _concat_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    first = specs[0]
    if first.rank == 0:
        raise ShapeError("cannot concat 0-d tensors")
    dim = R.norm_dim(a.get("dim", 0), first.rank)
    for k, s in enumerate(specs[1:], start=1):
        if s.rank != first.rank or any(s.shape[i] != first.shape[i] for i in range(s.rank) if i != dim):
            raise ShapeError(f"tensor {k} has shape {s.shape}, tensor 0 has shape {first.shape}: all sizes but "
                             f"dim {dim} must match")
    shape = list(first.shape)
    shape[dim] = sum(s.shape[dim] for s in specs)
    dtype = dtypes.promote(*(s.dtype for s in specs))
    return TensorSpec(tuple(shape), dtype, layout=first.layout, device=first.device)


define("concat", _concat_infer, lambda xs, a: torch.cat(xs, dim=a.get("dim", 0)), num_inputs=(1, -1),
       props={LAYOUT_TRANSPARENT, NO_UPCAST}, cost_fn=_moved,
       doc="torch.cat(tensors, dim) (dtypes promote as in torch); output keeps the first input's layout.")


def _pad_amounts(x: TensorSpec, pad: Sequence[int]) -> tuple[int, ...]:
    pad = tuple(int(p) for p in pad)
    if len(pad) % 2 or len(pad) // 2 > x.rank:
        raise ShapeError(f"pad {pad} must hold (before, after) pairs for at most {x.rank} dims, last dim first")
    shape = list(x.shape)
    for k in range(len(pad) // 2):
        dim = x.rank - 1 - k
        shape[dim] += pad[2 * k] + pad[2 * k + 1]
        if shape[dim] < 0:
            raise ShapeError(f"pad {pad} makes dim {dim} of shape {x.shape} negative ({shape[dim]})")
    return tuple(shape)


define("pad", lambda s, a: _out(s[0], _pad_amounts(s[0], a["pad"]), keep_layout=True),
       lambda xs, a: F.pad(xs[0], list(a["pad"]), mode="constant", value=a.get("value", 0.0)),
       props={LAYOUT_TRANSPARENT, NO_UPCAST}, cost_fn=_moved,
       doc="F.pad(x, pad, 'constant', value): pad is (before, after) pairs, last dim first; negative crops.")


def require_index(spec: TensorSpec, what: str = "index") -> None:
    if not dtypes.is_int(spec.dtype):
        raise DTypeError(f"{what} must be an integer tensor, got {spec.dtype}")


def _gathered_cost(source: TensorSpec, read: int, index: TensorSpec, out: TensorSpec) -> Cost:
    """Each index read once, each output written once; the source read once at most (a gather reads
    only the rows it selects, so min(source bytes, elements gathered))."""
    return Cost(min(source.nbytes, read * source.itemsize) + index.nbytes + out.nbytes, 0)


def _gather_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x, index = specs
    require_index(index)
    dim = R.norm_dim(a["dim"], x.rank)
    if index.rank != x.rank:
        raise ShapeError(f"index of shape {index.shape} must have the rank of input {x.shape}")
    bad = [i for i in range(x.rank) if i != dim and index.shape[i] > x.shape[i]]
    if bad:
        raise ShapeError(f"index of shape {index.shape} is larger than input {x.shape} in dim {bad[0]} "
                         f"(only dim {dim} may be)")
    return TensorSpec(index.shape, x.dtype, device=x.device)


define("gather", _gather_infer, lambda xs, a: torch.gather(xs[0], a["dim"], xs[1].long()), num_inputs=(2, 2),
       props={NO_UPCAST}, cost_fn=lambda i, o, a: _gathered_cost(i[0], o[0].numel, i[1], o[0]),
       doc="torch.gather(x, dim, index): out[i][j] = x[index[i][j]][j] (for dim 0).")


def _embedding_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    indices, weight = specs
    require_index(indices, "indices")
    if weight.rank != 2:
        raise ShapeError(f"weight must be 2-D [num_embeddings, dim], got shape {weight.shape}")
    return TensorSpec((*indices.shape, weight.shape[1]), weight.dtype, device=weight.device)


define("embedding", _embedding_infer, lambda xs, a: F.embedding(xs[0].long(), xs[1]), num_inputs=(2, 2),
       props={NO_UPCAST}, cost_fn=lambda i, o, a: _gathered_cost(i[1], o[0].numel, i[0], o[0]),
       doc="F.embedding(indices, weight): rows of weight selected by integer indices.")


def _index_select_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x, index = specs
    require_index(index)
    if index.rank > 1:
        raise ShapeError(f"index must be 0-D or 1-D, got shape {index.shape}")
    dim = R.norm_dim(a["dim"], x.rank)
    shape = list(x.shape)
    shape[dim] = index.numel
    return TensorSpec(tuple(shape), x.dtype, device=x.device)


define("index_select", _index_select_infer, lambda xs, a: torch.index_select(xs[0], a["dim"], xs[1].long()),
       num_inputs=(2, 2), props={NO_UPCAST}, cost_fn=lambda i, o, a: _gathered_cost(i[0], o[0].numel, i[1], o[0]),
       doc="torch.index_select(x, dim, index) with a 1-D integer index.")


# ---- to_layout: the same values in another memory layout (one copy; the layout pass's boundary) ----

def _to_layout_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x, layout = specs[0], a["layout"]
    if layout == "contiguous":
        return x.with_(layout=None, strides=None)
    if layout not in LAYOUTS or len(LAYOUTS[layout]) != x.rank:
        known = ", ".join(f"{k} (rank {len(v)})" for k, v in LAYOUTS.items())
        raise ShapeError(f"to_layout: layout {layout!r} does not fit shape {x.shape}; use 'contiguous' or one "
                         f"of {known}")
    return x.with_(layout=layout, strides=None)


def _to_layout_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    if a["layout"] == "contiguous":
        return xs[0].contiguous()
    fmt = torch.channels_last if xs[0].dim() == 4 else torch.channels_last_3d
    return xs[0].contiguous(memory_format=fmt)


define("to_layout", _to_layout_infer, _to_layout_ref, props={POINTWISE, NO_UPCAST}, cost_fn=_moved,
       triton=lambda v, a: v[0], extra={"layout_conversion": True},
       doc="The same values laid out as attrs['layout'] ('NHWC', 'NDHWC' or 'contiguous' = row-major): one "
           "copy. The layout pass puts one at each graph boundary of a channels-last region.")


def _shape_arg(shape: Any) -> tuple[int, ...]:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], list | tuple) else tuple(shape)


class LayoutMethods:
    """Graph-builder methods for views and indexing (mixed into fusegraph.Graph)."""

    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def reshape(self, x: Any, *shape: Any, name: str | None = None) -> Any:
        """x.reshape(shape): g.reshape(x, (2, -1)) or g.reshape(x, 2, -1)."""
        return self._apply("reshape", x, shape=_shape_arg(shape), name=name)

    def permute(self, x: Any, *dims: Any, name: str | None = None) -> Any:
        return self._apply("permute", x, dims=_shape_arg(dims), name=name)

    def transpose(self, x: Any, dim0: int, dim1: int, name: str | None = None) -> Any:
        return self._apply("transpose", x, dim0=dim0, dim1=dim1, name=name)

    def expand(self, x: Any, *shape: Any, name: str | None = None) -> Any:
        return self._apply("expand", x, shape=_shape_arg(shape), name=name)

    def slice(self, x: Any, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1,
              name: str | None = None) -> Any:
        """x[..., start:end:step] along dim."""
        return self._apply("slice", x, dim=dim, start=start, end=end, step=step, name=name)

    def concat(self, tensors: Sequence[Any], dim: int = 0, name: str | None = None) -> Any:
        """torch.cat(tensors, dim)."""
        return self._apply("concat", *tensors, dim=dim, name=name)

    def cat(self, tensors: Sequence[Any], dim: int = 0, name: str | None = None) -> Any:
        """torch.cat's name for concat."""
        return self._apply("concat", *tensors, dim=dim, name=name)

    def pad(self, input: Any, pad: Sequence[int], mode: str = "constant", value: float = 0.0,
            name: str | None = None) -> Any:
        """F.pad in constant mode."""
        if mode != "constant":
            from ..errors import UnsupportedError
            raise UnsupportedError(f"pad: mode {mode!r} is not supported; only 'constant'")
        return self._apply("pad", input, pad=tuple(pad), value=float(value), name=name)

    def to_layout(self, x: Any, layout: str, name: str | None = None) -> Any:
        """x copied into memory layout `layout` ('NHWC', 'NDHWC' or 'contiguous'); values unchanged."""
        return self._apply("to_layout", x, layout=layout, name=name)

    def gather(self, input: Any, dim: int, index: Any, name: str | None = None) -> Any:
        return self._apply("gather", input, index, dim=dim, name=name)

    def embedding(self, input: Any, weight: Any, name: str | None = None) -> Any:
        """F.embedding(input, weight): input holds integer indices."""
        return self._apply("embedding", input, weight, name=name)

    def index_select(self, input: Any, dim: int, index: Any, name: str | None = None) -> Any:
        return self._apply("index_select", input, index, dim=dim, name=name)
