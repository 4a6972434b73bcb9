"""Normalizations (forward). Each is a composite: its decomposition into reductions and
pointwise ops is what the fusion compiler sees, so it fuses through the general mechanism."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ShapeError
from ..ir.emit import Emitter
from ..ir.node import Attrs, Node
from ..ir.registry import COMPOSITE, Cost, define
from ..ir.spec import TensorSpec
from . import _rules as R
from .reduce import downcast, upcast


def _norm_shape(a: Attrs, x: TensorSpec) -> tuple[int, ...]:
    shape = tuple(a["normalized_shape"])
    if x.shape[len(x.shape) - len(shape):] != shape or len(shape) > x.rank:
        raise ShapeError(f"normalized_shape {shape} does not match the trailing dims of input {x.shape}")
    return shape


def _layernorm_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x = specs[0]
    R.require_float(x)
    shape = _norm_shape(a, x)
    for what, s in zip(("weight", "bias"), specs[1:], strict=False):
        if s.shape != shape:
            raise ShapeError(f"{what} has shape {s.shape}, expected normalized_shape {shape}")
    return x.with_(strides=None)


def _affine_args(xs: list[torch.Tensor], a: Any) -> tuple[Any, Any]:
    w = xs[1] if a.get("has_weight") else None
    b = xs[1 + bool(a.get("has_weight"))] if a.get("has_bias") else None
    return w, b


def _layernorm_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    w, b = _affine_args(xs, a)
    return F.layer_norm(xs[0], tuple(a["normalized_shape"]), w, b, a.get("eps", 1e-5))


def _rmsnorm_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    w, _ = _affine_args(xs, a)
    x = xs[0]
    dims = list(range(x.dim() - len(a["normalized_shape"]), x.dim()))
    y = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + a.get("eps", 1e-6))
    return y * w if w is not None else y


def _normalize_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str, rms: bool) -> Node:
    x = upcast(e, xs[0], cd)
    k = len(a["normalized_shape"])
    dims = tuple(range(x.spec.rank - k, x.spec.rank))
    n = 1
    for d in dims:
        n *= x.shape[d]
    if rms:
        centered = x
    else:
        mean = e.op("mul", e.op("sum", x, dims=dims, keepdim=True), 1.0 / n)
        centered = e.op("sub", x, mean)
    var = e.op("mul", e.op("sum", e.op("mul", centered, centered), dims=dims, keepdim=True), 1.0 / n)
    y = e.op("mul", centered, e.op("rsqrt", e.op("add", var, float(a.get("eps", 1e-6 if rms else 1e-5)))))
    w, b = (xs[1] if a.get("has_weight") else None), None
    if a.get("has_bias"):
        b = xs[1 + bool(a.get("has_weight"))]
    if w is not None:
        y = e.op("mul", y, upcast(e, w, cd))
    if b is not None:
        y = e.op("add", y, upcast(e, b, cd))
    return downcast(e, y, xs[0].dtype)


def _norm_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    return Cost(sum(s.nbytes for s in ins) + sum(s.nbytes for s in outs), 8 * ins[0].numel)


define("layernorm", _layernorm_infer, _layernorm_ref, num_inputs=(1, 3), props={COMPOSITE},
       cost_fn=_norm_cost, decompose=lambda e, xs, a, cd: _normalize_dec(e, xs, a, cd, rms=False),
       doc="Layer normalization over the trailing normalized_shape; optional weight and bias.")
define("rmsnorm", _layernorm_infer, _rmsnorm_ref, num_inputs=(1, 2), props={COMPOSITE},
       cost_fn=_norm_cost, decompose=lambda e, xs, a, cd: _normalize_dec(e, xs, a, cd, rms=True),
       doc="RMS normalization over the trailing normalized_shape; optional weight.")


def _shape_of(x: Any, normalized_shape: Any) -> tuple[int, ...]:
    if normalized_shape is None:
        return (x.shape[-1],)
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


class NormMethods:
    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def layernorm(self, x: Any, normalized_shape: Any = None, weight: Any = None, bias: Any = None,
                  eps: float = 1e-5, name: str | None = None) -> Any:
        """F.layer_norm; normalized_shape defaults to the last dim."""
        args = [x] + [t for t in (weight, bias) if t is not None]
        return self._apply("layernorm", *args, normalized_shape=_shape_of(x, normalized_shape),
                           has_weight=weight is not None, has_bias=bias is not None, eps=eps, name=name)

    def rmsnorm(self, x: Any, normalized_shape: Any = None, weight: Any = None, eps: float = 1e-6,
                name: str | None = None) -> Any:
        args = [x] + ([weight] if weight is not None else [])
        return self._apply("rmsnorm", *args, normalized_shape=_shape_of(x, normalized_shape),
                           has_weight=weight is not None, has_bias=False, eps=eps, name=name)
