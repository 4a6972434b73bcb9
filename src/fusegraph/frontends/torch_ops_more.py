"""ATen -> fusegraph translators found missing by the model zoo (bench/zoo.py --cpu-smoke): windowed
pooling, tensor indexing, as_strided views that are plain reshapes/permutes, prefix counts (cumsum
of a bool mask). Scatter-like writes (aten.index_put: the scatter-add of an embedding backward, a KV
cache's index_copy_) are in torch_ops_scatter. Same table as torch_ops (see its docstring); registered
on import by torch_ops_nn.

Pooling is written as pad + k*k strided slices combined pointwise (max / sum), which fuses into one
kernel: each window position is a range-masked load of the (unpadded) input, the padding a select of
the fill value (fusion/index_map.py), so no padded copy is made.
Indexing with one index tensor is an index_select; as_strided is served when its (size, stride)
describe a permutation of the input's contiguous layout (what views of views leave behind).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from .torch_ops import Ctx, _dims, cast_to, node_users_only_first, translates

aten = torch.ops.aten


# ---------------- pooling ----------------

def _pair(v: Any, default: Sequence[int]) -> tuple[int, int]:
    if v is None or (isinstance(v, list | tuple) and len(v) == 0):
        return int(default[0]), int(default[1])
    if isinstance(v, int):
        return v, v
    return (int(v[0]), int(v[0])) if len(v) == 1 else (int(v[0]), int(v[1]))


def _pool_geometry(node: torch.fx.Node) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    args = list(node.args) + [None] * 4
    kernel = _pair(args[1], (1, 1))
    stride = _pair(args[2], kernel)
    padding = _pair(args[3] if args[3] is not None else 0, (0, 0))
    return kernel, stride, padding


def _max_pool_supports(node: torch.fx.Node) -> str | None:
    dilation = node.args[4] if len(node.args) > 4 else node.kwargs.get("dilation", 1)
    if _pair(dilation, (1, 1)) != (1, 1):
        return "dilated max pooling"
    return None


def _windows(cx: Ctx, x: Any, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
             fill: float) -> list[Any]:
    """The kernel[0]*kernel[1] strided views of x (padded with `fill`) whose combination is the pooled output
    (the output size is the node's own: ceil_mode's extra row/column reads the padding)."""
    h, w = x.shape[-2:]
    oh, ow = _out_shape(cx)[-2:]
    rank = len(x.shape)
    extra_h = max(0, (oh - 1) * stride[0] + kernel[0] - h - 2 * padding[0])
    extra_w = max(0, (ow - 1) * stride[1] + kernel[1] - w - 2 * padding[1])
    if any((padding[0], padding[1], extra_h, extra_w)):
        x = cx.g.pad(x, (padding[1], padding[1] + extra_w, padding[0], padding[0] + extra_h), value=fill)
    views = []
    for i in range(kernel[0]):
        rows = cx.g.slice(x, rank - 2, i, i + (oh - 1) * stride[0] + 1, stride[0])
        for j in range(kernel[1]):
            views.append(cx.g.slice(rows, rank - 1, j, j + (ow - 1) * stride[1] + 1, stride[1]))
    return views


def _out_shape(cx: Ctx) -> tuple[int, ...]:
    val = cx.val[0] if isinstance(cx.val, list | tuple) else cx.val
    return tuple(int(d) for d in val.shape)


@translates(aten.max_pool2d_with_indices.default, supports=_max_pool_supports)
def _max_pool2d(cx: Ctx, x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                ceil_mode: bool = False) -> Any:
    kernel, strides, pads = _pool_geometry(cx.node)
    views = _windows(cx, x, kernel, strides, pads, float("-inf"))
    if node_users_only_first(cx.node):   # inference: the values only
        out = views[0]
        for v in views[1:]:
            out = cx.g.maximum(out, v)
        return (out, None)
    return _max_with_indices(cx, x, views, kernel, strides, pads)


def _max_with_indices(cx: Ctx, x: Any, views: list[Any], kernel: tuple[int, int], strides: tuple[int, int],
                      pads: tuple[int, int]) -> tuple[Any, Any]:
    """Values and indices (into each input plane, h * W + w) of max pooling, as torch computes them:
    the windows scanned row by row from -inf and the window's first in-bounds index, a value taking
    over when it is strictly greater or NaN (the first maximum wins a tie, the last NaN wins). The
    padding (-inf) never takes over, so every index lies inside the input (what the backward's
    scatter of the gradient reads)."""
    g = cx.g
    w = x.shape[-1]
    shape = _out_shape(cx)
    rank = len(shape)
    top = g.add(g.mul(g.iota(shape, rank - 2), strides[0]), -pads[0])    # the window's first row, per output
    left = g.add(g.mul(g.iota(shape, rank - 1), strides[1]), -pads[1])
    best = g.expand(g.cast(g.constant(torch.tensor(float("-inf"))), views[0].dtype), shape)
    index = g.add(g.mul(g.maximum(top, 0), w), g.maximum(left, 0))
    for k, v in enumerate(views):
        i, j = divmod(k, kernel[1])
        at = g.add(g.mul(g.add(top, i), w), g.add(left, j))
        takes = g.logical_or(g.gt(v, best), g.ne(v, v))
        best = g.where(takes, v, best)
        index = g.where(takes, at, index)
    return (best, index)


@translates(aten.avg_pool2d.default)
def _avg_pool2d(cx: Ctx, x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                count_include_pad: bool = True, divisor_override: Any = None) -> Any:
    kernel, strides, pads = _pool_geometry(cx.node)
    x = cast_to(cx, x, cx.dtype)
    views = _windows(cx, x, kernel, strides, pads, 0.0)
    total = views[0]
    for v in views[1:]:
        total = cx.g.add(total, v)
    if divisor_override:
        return cx.g.div(total, float(divisor_override))
    # torch's divisor per output position (the window's size clipped to the padded input, or to the input
    # without count_include_pad): sum of ones / average of ones over the same windows, computed here
    h, w = x.shape[-2:]
    ones = torch.ones(1, 1, h, w, dtype=torch.float64)
    sums = torch.nn.functional.avg_pool2d(ones, kernel, strides, pads, ceil_mode, True, 1)
    means = torch.nn.functional.avg_pool2d(ones, kernel, strides, pads, ceil_mode, count_include_pad)
    counts = (sums / means).round()
    if bool((counts == kernel[0] * kernel[1]).all()):
        return cx.g.div(total, float(kernel[0] * kernel[1]))
    divisor = cx.g.constant(counts.to(torch.float32).reshape((1,) * (len(cx.shape) - 2) + cx.shape[-2:]))
    return cx.g.div(total, cx.g.expand(cast_to(cx, divisor, cx.dtype), cx.shape))


# ---------------- indexing ----------------

def _index_supports(node: torch.fx.Node) -> str | None:
    indices: Any = node.args[1]
    dims = [d for d, i in enumerate(indices) if i is not None]
    if not dims:
        return "indexing without index tensors"
    if dims != list(range(dims[0], dims[-1] + 1)):
        return "index tensors at non-adjacent dims"
    for d in dims:
        val = indices[d].meta.get("val") if isinstance(indices[d], torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dtype not in (torch.int64, torch.int32):
            return "indexing with a boolean mask"
    return None


@translates(aten.index.Tensor, supports=_index_supports)
def _index(cx: Ctx, x: Any, indices: Sequence[Any]) -> Any:
    """x[..., i0, i1, ..., :] with integer index tensors at adjacent dims d..e: the dims d..e of x are
    flattened into one, the (broadcast) indices combined into one flat index (negative ones wrapped),
    and an index_select picks it; the result is reshaped to x.shape[:d] + index shape + x.shape[e+1:]."""
    dims = [d for d, i in enumerate(indices) if i is not None]
    first, last = dims[0], dims[-1]
    index_shape = tuple(torch.broadcast_shapes(*(tuple(indices[d].shape) for d in dims)))
    flat: Any = None
    for d in dims:
        idx = cast_to(cx, indices[d], "int64")
        size = int(x.shape[d])
        idx = cx.g.where(cx.g.lt(idx, 0), cx.g.add(idx, size), idx)
        if flat is not None:
            flat = cx.g.add(cx.g.mul(flat, size), idx)
        else:
            flat = idx
    if tuple(flat.shape) != index_shape:
        if len(flat.shape) < len(index_shape):
            flat = cx.g.reshape(flat, (1,) * (len(index_shape) - len(flat.shape)) + tuple(flat.shape))
        flat = cx.g.expand(flat, index_shape)
    n = math.prod(index_shape)
    flat = flat if len(flat.shape) == 1 else cx.g.reshape(flat, (n,))
    merged = (*x.shape[:first], math.prod(x.shape[first:last + 1]), *x.shape[last + 1:])
    source = x if tuple(x.shape) == merged else cx.g.reshape(x, merged)
    picked = cx.g.index_select(source, first, flat)
    shape = tuple(x.shape[:first]) + index_shape + tuple(x.shape[last + 1:])
    return picked if tuple(picked.shape) == shape else cx.g.reshape(picked, shape)


# ---------------- as_strided ----------------

def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(int(s), 1)
    return list(reversed(strides))


def strided_as_permute(size: Sequence[int], stride: Sequence[int], numel: int) -> tuple[list[int], list[int]] | None:
    """When as_strided(x, size, stride, 0) of a contiguous x with `numel` elements is a permutation of a
    reshape: (the reshape's shape, the permutation); else None."""
    size, stride = [int(s) for s in size], [int(s) for s in stride]
    if math.prod(size) != numel:
        return None
    order = sorted(range(len(size)), key=lambda d: (-stride[d], -size[d]))  # outermost first
    shape = [size[d] for d in order]
    if [stride[d] for d in order if size[d] != 1] != [s for s, n in zip(_contiguous_strides(shape), shape,
                                                                        strict=True) if n != 1]:
        return None
    perm = [order.index(d) for d in range(len(size))]
    return shape, perm


def _as_strided_supports(node: torch.fx.Node) -> str | None:
    args = [*node.args, None]
    x: Any = node.args[0]
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not val.is_contiguous():
        return "as_strided of a non-contiguous tensor"
    offset = args[3] if args[3] is not None else node.kwargs.get("storage_offset")
    if offset is not None and offset != val.storage_offset():
        return "as_strided with a storage offset of its own"
    if strided_as_permute(args[1], args[2], val.numel()) is None:  # type: ignore[arg-type]
        return "as_strided that is not a permutation of the input's layout"
    return None


@translates(aten.as_strided.default, supports=_as_strided_supports)
def _as_strided(cx: Ctx, x: Any, size: Sequence[int], stride: Sequence[int], storage_offset: Any = None) -> Any:
    layout = strided_as_permute(size, stride, math.prod(x.shape))
    assert layout is not None  # checked by _as_strided_supports
    shape, perm = layout
    y = x if tuple(x.shape) == tuple(shape) else cx.g.reshape(x, tuple(shape))
    return y if perm == list(range(len(perm))) else cx.g.permute(y, tuple(perm))


# ---------------- cumsum ----------------

_CUMSUM_MAX_N, _CUMSUM_MAX_WORK = 4096, 2**30


def _counts_bool(node: Any) -> bool:
    """A bool tensor, or an integer cast of one (its prefix sums are counts <= n: exact in float32)."""
    if not isinstance(node, torch.fx.Node):
        return False
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
        return True
    casts = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
    return node.target in casts and _counts_bool(node.args[0])


def _cumsum_supports(node: torch.fx.Node) -> str | None:
    x: Any = node.args[0]
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return "cumsum of a scalar"
    dim: Any = node.args[1]
    n = int(val.shape[int(dim) % val.dim()])
    if n > _CUMSUM_MAX_N or (val.numel() // max(n, 1)) * n * n > _CUMSUM_MAX_WORK:
        return f"cumsum over {n} elements (a triangular matmul would cost n^2 per row)"
    if _counts_bool(x):
        return None
    # floats would lose precision in a TF32 matmul; other integers may exceed float32's exact range
    return f"cumsum of a {val.dtype} tensor (served: prefix counts of a bool tensor)"


@translates(aten.cumsum.default, supports=_cumsum_supports)
def _cumsum(cx: Ctx, x: Any, dim: int, *, dtype: Any = None) -> Any:
    """Prefix counts of a bool tensor (as in transformers' masks) along `dim`: a float32 matmul with an
    upper-triangular matrix of ones (tri[i, j] = 1 for i <= j); exact (0/1 operands, sums <= n < 2^24)."""
    rank = len(x.shape)
    dim %= rank
    n = int(x.shape[dim])
    xf = cast_to(cx, x, "float32")
    perm = [d for d in range(rank) if d != dim] + [dim]
    moved = xf if dim == rank - 1 else cx.g.permute(xf, tuple(perm))
    moved_shape = tuple(moved.shape)
    rows = math.prod(moved_shape[:-1])
    flat = moved if rank == 2 else cx.g.reshape(moved, (rows, n))
    out = cx.g.matmul(flat, cx.g.constant(torch.triu(torch.ones(n, n, dtype=torch.float32))))
    out = out if rank == 2 else cx.g.reshape(out, moved_shape)
    if dim != rank - 1:
        out = cx.g.permute(out, tuple(perm.index(d) for d in range(rank)))
    return out


# ---------------- any / all, fmod ----------------

@translates(aten.any.dim, aten.any.dims, aten.any.default, aten.all.dim, aten.all.dims, aten.all.default)
def _any_all(cx: Ctx, x: Any, dim: Any = None, keepdim: bool = False) -> Any:
    """any: max over dims of (x != 0) as 0/1 floats; all: min of the same; the result as bool."""
    nonzero = cx.g.cast(cx.g.ne(x, 0) if x.dtype != "bool" else x, "float32")
    rank = len(x.shape)
    dims = _dims(dim, rank) if rank else None
    if dims is None and rank:
        dims = tuple(range(rank))
    is_any = cx.node.target in (aten.any.dim, aten.any.dims, aten.any.default)
    if not rank:
        reduced = nonzero
    else:
        reduced = (cx.g.amax if is_any else cx.g.min)(nonzero, dims, keepdim)
    return cx.g.ne(reduced, 0.0)


@translates(aten.fmod.Scalar, aten.fmod.Tensor)
def _fmod(cx: Ctx, a: Any, b: Any) -> Any:
    """torch.fmod: a - trunc(a / b) * b (the result has the sign of a), computed in float32."""
    a32, b32 = cast_to(cx, a, "float32"), cast_to(cx, b, "float32")
    quotient = cx.g.div(a32, b32)
    truncated = cx.g.where(cx.g.lt(quotient, 0.0), cx.g.ceil(quotient), cx.g.floor(quotient))
    return cast_to(cx, cx.g.sub(a32, cx.g.mul(truncated, b32)), cx.dtype)
