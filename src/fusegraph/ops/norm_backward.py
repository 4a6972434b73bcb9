"""Normalization backward ops: multi-output composites (dx, dweight[, dbias]).

Each recomputes its statistics from x (one extra reduction, no saved mean/rstd to keep alive)
and decomposes into sum reductions and pointwise ops only, so the fusion compiler turns
layernorm backward into two fused reductions: a row reduction giving dx, and a column
reduction giving dweight and dbias, without materializing x_hat.

With xhat = (x - mean) * rstd and g = grad_out * weight (or grad_out without a weight):
    dx      = rstd * (g - mean(g) - xhat * mean(g * xhat))        (rmsnorm: no mean(g) term)
    dweight = sum(grad_out * xhat) over the non-normalized dims
    dbias   = sum(grad_out)        over the non-normalized dims
dweight and dbias are returned even without a weight or bias (they are then the gradients an
identity weight / zero bias would get); unused outputs disappear in dead-code elimination.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ShapeError
from ..ir.emit import Emitter
from ..ir.node import Attrs, Node
from ..ir.registry import COMPOSITE, Cost, define
from ..ir.spec import TensorSpec
from . import _rules as R
from .index_gen import channel_view_shape, reshape_to
from .norm import group_view_shape
from .reduce import downcast, upcast

# ---- shape rules ----

def _check_grad(specs: Sequence[TensorSpec]) -> tuple[TensorSpec, TensorSpec]:
    dy, x = specs[0], specs[1]
    R.require_float(x, "input")
    R.require_float(dy, "grad_out")
    if dy.shape != x.shape:
        raise ShapeError(f"grad_out has shape {dy.shape}, expected the input's shape {x.shape}")
    return dy, x


def _param_dtype(specs: Sequence[TensorSpec], a: Attrs) -> str:
    return specs[2].dtype if a.get("has_weight") else specs[1].dtype


def _trailing_infer(specs: Sequence[TensorSpec], a: Attrs, outputs: int) -> tuple[TensorSpec, ...]:
    x = _check_grad(specs)[1]
    shape = tuple(a["normalized_shape"])
    if len(shape) > x.rank or x.shape[x.rank - len(shape):] != shape:
        raise ShapeError(f"normalized_shape {shape} does not match the trailing dims of input {x.shape}")
    if a.get("has_weight") and specs[2].shape != shape:
        raise ShapeError(f"weight has shape {specs[2].shape}, expected normalized_shape {shape}")
    param = TensorSpec(shape, _param_dtype(specs, a), device=x.device)
    return (x.with_(strides=None),) + (param,) * (outputs - 1)


def _channel_infer(specs: Sequence[TensorSpec], a: Attrs, op: str) -> tuple[TensorSpec, ...]:
    x = _check_grad(specs)[1]
    if x.rank < 2:
        raise ShapeError(f"{op} needs an input of shape [N, C, *spatial], got {x.shape}")
    if a.get("has_weight") and specs[2].shape != (x.shape[1],):
        raise ShapeError(f"weight has shape {specs[2].shape}, expected ({x.shape[1]},)")
    if op == "groupnorm_backward":
        groups = a["num_groups"]
        if not isinstance(groups, int) or groups < 1 or x.shape[1] % groups:
            raise ShapeError(f"num_groups {groups!r} must be a positive divisor of the {x.shape[1]} channels")
    elif _non_channel_count(x.shape) < 2:
        raise ShapeError(f"batchnorm training needs more than one value per channel, input {x.shape}")
    param = TensorSpec((x.shape[1],), _param_dtype(specs, a), device=x.device)
    return (x.with_(strides=None), param, param)


def _non_channel_count(shape: Sequence[int]) -> int:
    n = shape[0]
    for s in shape[2:]:
        n *= s
    return n


# ---- torch references (closed form; tests check them against autograd) ----

def _closed_form(dy: torch.Tensor, x: torch.Tensor, g: torch.Tensor, dims: list[int], eps: float,
                 rms: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, xhat) for statistics over `dims`; `g` is grad_out times the weight."""
    if rms:
        rstd = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
        xhat = x * rstd
        return rstd * (g - xhat * (g * xhat).mean(dim=dims, keepdim=True)), xhat
    mean = x.mean(dim=dims, keepdim=True)
    rstd = torch.rsqrt((x - mean).pow(2).mean(dim=dims, keepdim=True) + eps)
    xhat = (x - mean) * rstd
    dx = rstd * (g - g.mean(dim=dims, keepdim=True) - xhat * (g * xhat).mean(dim=dims, keepdim=True))
    return dx, xhat


def _sum_over(t: torch.Tensor, dims: list[int]) -> torch.Tensor:
    return t.sum(dim=dims) if dims else t


def _trailing_ref(xs: list[torch.Tensor], a: Any, rms: bool) -> tuple[torch.Tensor, ...]:
    dy, x = xs[0], xs[1]
    k = len(a["normalized_shape"])
    stat_dims = list(range(x.dim() - k, x.dim()))
    lead = list(range(x.dim() - k))
    g = dy * xs[2] if a.get("has_weight") else dy
    dx, xhat = _closed_form(dy, x, g, stat_dims, a["eps"], rms)
    dweight = _sum_over(dy * xhat, lead)
    return (dx, dweight) if rms else (dx, dweight, _sum_over(dy, lead))


def _channel_ref(xs: list[torch.Tensor], a: Any, groups: int | None) -> tuple[torch.Tensor, ...]:
    dy, x = xs[0], xs[1]
    view = channel_view_shape(x.shape[1], x.dim())
    g = dy * xs[2].reshape(view) if a.get("has_weight") else dy
    if groups is None:
        dx, xhat = _closed_form(dy, x, g, [0, *range(2, x.dim())], a["eps"], rms=False)
    else:
        grouped = group_view_shape(x.shape, groups)
        dx, xhat = _closed_form(dy.reshape(grouped), x.reshape(grouped), g.reshape(grouped), [2], a["eps"],
                                rms=False)
        dx, xhat = dx.reshape(x.shape), xhat.reshape(x.shape)
    param_dims = [0, *range(2, x.dim())]
    return dx, (dy * xhat).sum(dim=param_dims), dy.sum(dim=param_dims)


# ---- decompositions into sum reductions and pointwise ops ----

def _mean(e: Emitter, t: Node, dims: tuple[int, ...], n: int) -> Node:
    return e.op("mul", e.op("sum", t, dims=dims, keepdim=True), 1.0 / n)


def _closed_form_dec(e: Emitter, x: Node, g: Node, dims: tuple[int, ...], eps: float,
                     rms: bool) -> tuple[Node, Node]:
    n = 1
    for d in dims:
        n *= x.shape[d]
    centered = x if rms else e.op("sub", x, _mean(e, x, dims, n))
    rstd = e.op("rsqrt", e.op("add", _mean(e, e.op("mul", centered, centered), dims, n), eps))
    xhat = e.op("mul", centered, rstd)
    proj = e.op("mul", xhat, _mean(e, e.op("mul", g, xhat), dims, n))
    inner = e.op("sub", g, proj) if rms else e.op("sub", e.op("sub", g, _mean(e, g, dims, n)), proj)
    return e.op("mul", rstd, inner), xhat


def _sum_over_dec(e: Emitter, t: Node, dims: tuple[int, ...]) -> Node:
    return e.op("sum", t, dims=dims, keepdim=False) if dims else t


def _trailing_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str, rms: bool) -> tuple[Node, ...]:
    dy, x = upcast(e, xs[0], cd), upcast(e, xs[1], cd)
    k = len(a["normalized_shape"])
    rank = x.spec.rank
    g = e.op("mul", dy, upcast(e, xs[2], cd)) if a.get("has_weight") else dy
    dx, xhat = _closed_form_dec(e, x, g, tuple(range(rank - k, rank)), float(a["eps"]), rms)
    lead = tuple(range(rank - k))
    param_dtype = xs[2].dtype if a.get("has_weight") else xs[1].dtype
    outs = [downcast(e, dx, xs[1].dtype), downcast(e, _sum_over_dec(e, e.op("mul", dy, xhat), lead), param_dtype)]
    if not rms:
        outs.append(downcast(e, _sum_over_dec(e, dy, lead), param_dtype))
    return tuple(outs)


def _channel_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str, groups: int | None) -> tuple[Node, ...]:
    dy, x = upcast(e, xs[0], cd), upcast(e, xs[1], cd)
    rank = x.spec.rank
    view = channel_view_shape(x.shape[1], rank)
    g = e.op("mul", dy, reshape_to(e, upcast(e, xs[2], cd), view)) if a.get("has_weight") else dy
    eps = float(a["eps"])
    if groups is None:
        dx, xhat = _closed_form_dec(e, x, g, (0, *range(2, rank)), eps, rms=False)
    else:
        grouped = group_view_shape(x.shape, groups)
        dx_g, xhat_g = _closed_form_dec(e, reshape_to(e, x, grouped), reshape_to(e, g, grouped), (2,), eps,
                                        rms=False)
        dx, xhat = reshape_to(e, dx_g, x.shape), reshape_to(e, xhat_g, x.shape)
    param_dims = (0, *range(2, rank))
    param_dtype = xs[2].dtype if a.get("has_weight") else xs[1].dtype
    dweight = e.op("sum", e.op("mul", dy, xhat), dims=param_dims, keepdim=False)
    dbias = e.op("sum", dy, dims=param_dims, keepdim=False)
    return (downcast(e, dx, xs[1].dtype), downcast(e, dweight, param_dtype), downcast(e, dbias, param_dtype))


def _backward_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    return Cost(sum(s.nbytes for s in ins) + sum(s.nbytes for s in outs), 14 * ins[1].numel)


_DOC = " Inputs: grad_out, x[, weight]; statistics are recomputed from x."
define("layernorm_backward", lambda s, a: _trailing_infer(s, a, 3),
       lambda xs, a: _trailing_ref(xs, a, rms=False), num_inputs=(2, 3), props={COMPOSITE},
       cost_fn=_backward_cost, decompose=lambda e, xs, a, cd: _trailing_dec(e, xs, a, cd, rms=False),
       doc="(dx, dweight, dbias) of layernorm." + _DOC)
define("rmsnorm_backward", lambda s, a: _trailing_infer(s, a, 2),
       lambda xs, a: _trailing_ref(xs, a, rms=True), num_inputs=(2, 3), props={COMPOSITE},
       cost_fn=_backward_cost, decompose=lambda e, xs, a, cd: _trailing_dec(e, xs, a, cd, rms=True),
       doc="(dx, dweight) of rmsnorm." + _DOC)
define("batchnorm_backward", lambda s, a: _channel_infer(s, a, "batchnorm_backward"),
       lambda xs, a: _channel_ref(xs, a, None), num_inputs=(2, 3), props={COMPOSITE},
       cost_fn=_backward_cost, decompose=lambda e, xs, a, cd: _channel_dec(e, xs, a, cd, None),
       doc="(dx, dweight, dbias) of training-mode batchnorm (batch statistics)." + _DOC)
define("groupnorm_backward", lambda s, a: _channel_infer(s, a, "groupnorm_backward"),
       lambda xs, a: _channel_ref(xs, a, a["num_groups"]), num_inputs=(2, 3), props={COMPOSITE},
       cost_fn=_backward_cost, decompose=lambda e, xs, a, cd: _channel_dec(e, xs, a, cd, a["num_groups"]),
       doc="(dx, dweight, dbias) of groupnorm." + _DOC)


def _trailing_shape(x: Any, normalized_shape: Any) -> tuple[int, ...]:
    if normalized_shape is None:
        return (x.shape[-1],)
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


class NormBackwardMethods:
    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def layernorm_backward(self, grad_out: Any, input: Any, normalized_shape: Any = None, weight: Any = None,
                           eps: float = 1e-5, name: str | None = None) -> Any:
        """(dx, dweight, dbias) of layernorm(input, normalized_shape, weight, bias, eps)."""
        args = [grad_out, input] + ([weight] if weight is not None else [])
        return self._apply("layernorm_backward", *args, normalized_shape=_trailing_shape(input, normalized_shape),
                           has_weight=weight is not None, eps=float(eps), name=name)

    def rmsnorm_backward(self, grad_out: Any, input: Any, normalized_shape: Any = None, weight: Any = None,
                         eps: float = 1e-6, name: str | None = None) -> Any:
        """(dx, dweight) of rmsnorm(input, normalized_shape, weight, eps)."""
        args = [grad_out, input] + ([weight] if weight is not None else [])
        return self._apply("rmsnorm_backward", *args, normalized_shape=_trailing_shape(input, normalized_shape),
                           has_weight=weight is not None, eps=float(eps), name=name)

    def batchnorm_backward(self, grad_out: Any, input: Any, weight: Any = None, eps: float = 1e-5,
                           name: str | None = None) -> Any:
        """(dx, dweight, dbias) of batch_norm(input, ..., weight, bias, training=True, eps=eps)."""
        args = [grad_out, input] + ([weight] if weight is not None else [])
        return self._apply("batchnorm_backward", *args, has_weight=weight is not None, eps=float(eps), name=name)

    def groupnorm_backward(self, grad_out: Any, input: Any, num_groups: int, weight: Any = None,
                           eps: float = 1e-5, name: str | None = None) -> Any:
        """(dx, dweight, dbias) of group_norm(input, num_groups, weight, bias, eps)."""
        args = [grad_out, input] + ([weight] if weight is not None else [])
        return self._apply("groupnorm_backward", *args, num_groups=num_groups, has_weight=weight is not None,
                           eps=float(eps), name=name)

    batch_norm_backward = batchnorm_backward
    group_norm_backward = groupnorm_backward
    layer_norm_backward = layernorm_backward
