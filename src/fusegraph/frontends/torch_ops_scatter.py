"""ATen -> fusegraph translators for scatter-like writes (ops/scatter.py), in the functional forms
AOTAutograd's functionalization leaves: index_put (embedding backward's scatter-add, a static KV
cache's index_copy_ after decomposition), index_copy, scatter_add, slice_scatter. select_scatter is
decomposed by the core ATen table into slice_scatter. Same table as torch_ops (see its docstring);
registered on import by torch_ops_nn.

In-place forms (aten.index_copy_, aten.index_put_ without accumulation) appear only where
frontends/input_mutation.py re-inplaced a kept input mutation (a static KV cache update): they become
the IR ops index_copy_inplace / index_put_inplace, which write the indexed rows into the partition's
input (the caller's tensor) and return it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from . import input_mutation  # noqa: F401  (registers the in-place IR ops)
from .torch_ops import Ctx, cast_to, translates

aten = torch.ops.aten


def _fake(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def _index_put_supports(node: torch.fx.Node) -> str | None:
    indices: Any = node.args[1]
    if not any(i is not None for i in indices):
        return "index_put without index tensors"
    for i in indices:
        if i is None:
            continue
        val = _fake(i)
        if not isinstance(val, torch.Tensor):
            return "index_put with an index that is not a tensor"
        if val.dtype == torch.bool:
            return "index_put with a boolean mask (data-dependent positions)"
        if val.dtype not in (torch.int64, torch.int32):
            return f"index_put with a {val.dtype} index"
    return None


@translates(aten.index_put.default, supports=_index_put_supports)
def _index_put(cx: Ctx, x: Any, indices: Any, values: Any, accumulate: bool = False) -> Any:
    values = cast_to(cx, values, x.dtype)
    if not hasattr(values, "shape"):  # a Python number: a 0-d tensor broadcast to the region
        values = cx.g.constant(torch.tensor(values, dtype=_fake(cx.node.args[0]).dtype))
    return cx.g.index_put(x, list(indices), values, accumulate=bool(accumulate))


@translates(aten.index_copy.default)
def _index_copy(cx: Ctx, x: Any, dim: int, index: Any, source: Any) -> Any:
    return cx.g.index_copy(x, dim, index, cast_to(cx, source, x.dtype))


def _scatter_add_supports(node: torch.fx.Node) -> str | None:
    index = _fake(node.args[2])
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int64, torch.int32):
        return "scatter_add with a non-integer index"
    return None


@translates(aten.scatter_add.default, supports=_scatter_add_supports)
def _scatter_add(cx: Ctx, x: Any, dim: int, index: Any, src: Any) -> Any:
    return cx.g.scatter_add(x, dim, index, cast_to(cx, src, x.dtype))


@translates(aten.slice_scatter.default)
def _slice_scatter(cx: Ctx, x: Any, src: Any, dim: int = 0, start: Any = None, end: Any = None,
                   step: int = 1) -> Any:
    size = int(x.shape[dim])
    start = None if start is None else max(-size, min(int(start), size))   # torch clamps; sys.maxsize ends
    end = None if end is None else max(-size, min(int(end), size))
    return cx.g.slice_scatter(x, cast_to(cx, src, x.dtype), dim, start, end, int(step))


# ---------------- in-place forms: a kept input mutation re-inplaced (frontends/input_mutation.py) ----------------

def _inplace_supports(node: torch.fx.Node) -> str | None:
    dest = node.args[0]
    if not isinstance(dest, torch.fx.Node) or dest.op != "placeholder":
        return "an in-place scatter into a value that is not a graph input"
    if node.target is aten.index_put_.default:
        if (len(node.args) > 3 and node.args[3]) or node.kwargs.get("accumulate"):
            return "an accumulating index_put_"
        return _index_put_supports(node)
    return None


def _destination(cx: Ctx, x: Any) -> Any:
    """The written tensor must be a Plan input (the partition's placeholder), not a copy of it."""
    if getattr(getattr(x, "node", None), "op", None) != "input":
        raise TypeError(f"{cx.node.name}: in-place scatter into {x!r}, which is not an input of the partition")
    return x


@translates(aten.index_copy_.default, supports=_inplace_supports)
def _index_copy_inplace(cx: Ctx, x: Any, dim: int, index: Any, source: Any) -> Any:
    x = _destination(cx, x)
    return cx.g._apply("index_copy_inplace", x, index, cast_to(cx, source, x.dtype), dim=dim)


@translates(aten.index_put_.default, supports=_inplace_supports)
def _index_put_inplace(cx: Ctx, x: Any, indices: Any, values: Any, accumulate: bool = False) -> Any:
    x = _destination(cx, x)
    values = cast_to(cx, values, x.dtype)
    if not hasattr(values, "shape"):  # a Python number: a 0-d tensor broadcast to the region
        values = cx.g.constant(torch.tensor(values, dtype=_fake(cx.node.args[0]).dtype))
    dims = tuple(d for d, i in enumerate(indices) if i is not None)
    return cx.g._apply("index_put_inplace", x, values, *[i for i in indices if i is not None], index_dims=dims,
                       accumulate=False)
