"""Reductions over any axes, and softmax / log_softmax (composites of reductions)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..ir import dtypes
from ..ir.emit import Emitter
from ..ir.node import Attrs, Node
from ..ir.registry import COMPOSITE, REDUCTION, Cost, define
from ..ir.spec import TensorSpec
from . import _rules as R


def _dims(x: torch.Tensor, a: Any) -> list[int]:
    return list(R.norm_dims(a.get("dims"), x.dim()))


def upcast(e: Emitter, x: Node, compute_dtype: str) -> Node:
    """Decompositions compute in the graph's compute dtype; the cast is free inside a fused kernel."""
    if dtypes.is_float(x.dtype) and dtypes.itemsize(x.dtype) < dtypes.itemsize(compute_dtype):
        return e.op("cast", x, dtype=compute_dtype)
    if not dtypes.is_float(x.dtype):
        return e.op("cast", x, dtype=compute_dtype)
    return x


def downcast(e: Emitter, y: Node, dtype: str) -> Node:
    return y if y.dtype == dtype else e.op("cast", y, dtype=dtype)


def _reduce_cost(flops_per_input: float):  # type: ignore[no-untyped-def]
    def cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
        return Cost(ins[0].nbytes + sum(o.nbytes for o in outs), int(flops_per_input * ins[0].numel))
    return cost


def _sum_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    return torch.sum(xs[0], dim=_dims(xs[0], a), keepdim=a.get("keepdim", False))


def _max_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    return torch.amax(xs[0], dim=_dims(xs[0], a), keepdim=a.get("keepdim", False))


def _min_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    return torch.amin(xs[0], dim=_dims(xs[0], a), keepdim=a.get("keepdim", False))


def _mean_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    return torch.mean(xs[0], dim=_dims(xs[0], a), keepdim=a.get("keepdim", False))


def _var_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    return torch.var(xs[0], dim=_dims(xs[0], a), keepdim=a.get("keepdim", False),
                     correction=a.get("correction", 1))


def _norm2_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    return torch.linalg.vector_norm(xs[0], 2, dim=_dims(xs[0], a), keepdim=a.get("keepdim", False))


def _count(x: Node, dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= x.shape[d]
    return n


def _mean_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> Node:
    x = upcast(e, xs[0], cd)
    dims = R.norm_dims(a.get("dims"), x.spec.rank)
    s = e.op("sum", x, dims=dims, keepdim=a.get("keepdim", False))
    mean = e.op("mul", s, 1.0 / max(_count(x, dims), 1))
    return downcast(e, mean, xs[0].dtype if dtypes.is_float(xs[0].dtype) else cd)


def _var_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> Node:
    x = upcast(e, xs[0], cd)
    dims = R.norm_dims(a.get("dims"), x.spec.rank)
    n = _count(x, dims)
    mean = e.op("mul", e.op("sum", x, dims=dims, keepdim=True), 1.0 / max(n, 1))
    d = e.op("sub", x, mean)
    ss = e.op("sum", e.op("mul", d, d), dims=dims, keepdim=a.get("keepdim", False))
    var = e.op("mul", ss, 1.0 / max(n - a.get("correction", 1), 1))
    return downcast(e, var, xs[0].dtype if dtypes.is_float(xs[0].dtype) else cd)


def _norm2_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> Node:
    x = upcast(e, xs[0], cd)
    dims = R.norm_dims(a.get("dims"), x.spec.rank)
    ss = e.op("sum", e.op("mul", x, x), dims=dims, keepdim=a.get("keepdim", False))
    return downcast(e, e.op("sqrt", ss), xs[0].dtype)


RED = {REDUCTION}
define("sum", R.reduce, _sum_ref, props=RED, cost_fn=_reduce_cost(1), extra={"combine": "sum"},
       doc="Sum over attrs['dims'] (None = all).")
define("max", R.reduce, _max_ref, props=RED, cost_fn=_reduce_cost(1), extra={"combine": "max"},
       doc="Maximum over dims (values only).")
define("min", R.reduce, _min_ref, props=RED, cost_fn=_reduce_cost(1), extra={"combine": "min"},
       doc="Minimum over dims (values only).")
define("amax", R.reduce, _max_ref, props={COMPOSITE}, cost_fn=_reduce_cost(1),
       decompose=lambda e, xs, a, cd: e.op("max", xs[0], dims=a.get("dims"), keepdim=a.get("keepdim", False)),
       doc="torch.amax: maximum over dims.")
define("mean", R.float_reduce, _mean_ref, props={COMPOSITE}, cost_fn=_reduce_cost(1), decompose=_mean_dec)
define("var", R.float_reduce, _var_ref, props={COMPOSITE}, cost_fn=_reduce_cost(3), decompose=_var_dec,
       doc="Variance over dims with Bessel `correction` (default 1, as torch.var).")
define("norm2", R.float_reduce, _norm2_ref, props={COMPOSITE}, cost_fn=_reduce_cost(2), decompose=_norm2_dec,
       doc="Euclidean norm over dims.")


def _softmax_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    R.norm_dim(a["dim"], specs[0].rank)
    out_dtype = a.get("dtype") or specs[0].dtype
    R.require_float(specs[0].with_(dtype=out_dtype) if not dtypes.is_float(specs[0].dtype) else specs[0])
    return specs[0].with_(dtype=dtypes.canonical(out_dtype), strides=None)


def _softmax_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    return torch.softmax(xs[0].float() if xs[0].dtype != torch.float64 else xs[0], dim=a["dim"])


def _log_softmax_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    return torch.log_softmax(xs[0].float() if xs[0].dtype != torch.float64 else xs[0], dim=a["dim"])


def _softmax_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str, log: bool = False) -> Node:
    x = upcast(e, xs[0], cd)
    dim = R.norm_dim(a["dim"], x.spec.rank)
    m = e.op("max", x, dims=(dim,), keepdim=True)
    z = e.op("sub", x, m)
    ez = e.op("exp", z)
    s = e.op("sum", ez, dims=(dim,), keepdim=True)
    out = e.op("sub", z, e.op("log", s)) if log else e.op("div", ez, s)
    return downcast(e, out, dtypes.canonical(a.get("dtype") or xs[0].dtype))


_SOFTMAX_COST = _reduce_cost(5)
define("softmax", _softmax_infer, _softmax_ref, props={COMPOSITE}, cost_fn=_SOFTMAX_COST,
       decompose=_softmax_dec, doc="softmax(x, dim); statistics in the compute dtype.")
define("log_softmax", _softmax_infer, _log_softmax_ref, props={COMPOSITE}, cost_fn=_SOFTMAX_COST,
       decompose=lambda e, xs, a, cd: _softmax_dec(e, xs, a, cd, log=True))


def _dims_arg(dim: Any) -> Any:
    return None if dim is None else (tuple(dim) if isinstance(dim, list | tuple) else (dim,))


class ReductionMethods:
    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def sum(self, x: Any, dim: Any = None, keepdim: bool = False, name: str | None = None) -> Any:
        return self._apply("sum", x, dims=_dims_arg(dim), keepdim=keepdim, name=name)

    def mean(self, x: Any, dim: Any = None, keepdim: bool = False, name: str | None = None) -> Any:
        return self._apply("mean", x, dims=_dims_arg(dim), keepdim=keepdim, name=name)

    def max(self, x: Any, dim: Any = None, keepdim: bool = False, name: str | None = None) -> Any:
        return self._apply("max", x, dims=_dims_arg(dim), keepdim=keepdim, name=name)

    def min(self, x: Any, dim: Any = None, keepdim: bool = False, name: str | None = None) -> Any:
        return self._apply("min", x, dims=_dims_arg(dim), keepdim=keepdim, name=name)

    def amax(self, x: Any, dim: Any = None, keepdim: bool = False, name: str | None = None) -> Any:
        return self._apply("amax", x, dims=_dims_arg(dim), keepdim=keepdim, name=name)

    def var(self, x: Any, dim: Any = None, keepdim: bool = False, correction: int = 1,
            name: str | None = None) -> Any:
        return self._apply("var", x, dims=_dims_arg(dim), keepdim=keepdim, correction=correction, name=name)

    def norm2(self, x: Any, dim: Any = None, keepdim: bool = False, name: str | None = None) -> Any:
        return self._apply("norm2", x, dims=_dims_arg(dim), keepdim=keepdim, name=name)

    def softmax(self, x: Any, dim: int = -1, dtype: Any = None, name: str | None = None) -> Any:
        return self._apply("softmax", x, dim=dim, dtype=None if dtype is None else dtypes.canonical(dtype),
                           name=name)

    def log_softmax(self, x: Any, dim: int = -1, dtype: Any = None, name: str | None = None) -> Any:
        return self._apply("log_softmax", x, dim=dim,
                           dtype=None if dtype is None else dtypes.canonical(dtype), name=name)
