"""Losses: cross_entropy and its backward, composites of reductions and pointwise ops.

Logits are [N, C] or [N, C, d1, ...] (classes on dim 1, as torch), targets are class indices
of shape [N] or [N, d1, ...]. Rows whose target equals ignore_index contribute nothing; "mean"
divides by the number of the other rows (all ignored: 0/0 = nan, as torch). Class weights are
not supported. A target outside [0, C) that is not ignore_index is not checked: its target
logit reads as 0 (torch raises at run time).

Decomposition: logsumexp = log(sum(exp(x - max))) + max; the target logit is
sum(where(iota_class == target, x, 0)); label smoothing adds ls * mean_c(x).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import DTypeError, InvalidValueError, ShapeError, UnsupportedError
from ..ir import dtypes
from ..ir.emit import Emitter, user_source_line
from ..ir.node import Attrs, Node
from ..ir.registry import COMPOSITE, Cost, define
from ..ir.spec import TensorSpec
from . import _rules as R
from .index_gen import reshape_to
from .reduce import downcast, upcast

REDUCTIONS = ("mean", "sum", "none")


def _check_loss_args(logits: TensorSpec, target: TensorSpec, a: Attrs) -> None:
    R.require_float(logits, "logits")
    if logits.rank < 2:
        raise ShapeError(f"cross_entropy needs logits of shape [N, C, *d], got {logits.shape}")
    if not dtypes.is_int(target.dtype):
        raise DTypeError(f"cross_entropy targets must be integer class indices, got {target.dtype}")
    want = (logits.shape[0], *logits.shape[2:])
    if target.shape != want:
        raise ShapeError(f"target has shape {target.shape}, expected {want} for logits {logits.shape}")
    if a.get("reduction", "mean") not in REDUCTIONS:
        raise InvalidValueError(f"reduction must be one of {REDUCTIONS}, got {a.get('reduction')!r}")
    ls = a.get("label_smoothing", 0.0)
    if not 0.0 <= ls <= 1.0:
        raise InvalidValueError(f"label_smoothing must be in [0, 1], got {ls!r}")


def _loss_spec(logits: TensorSpec, target: TensorSpec, a: Attrs) -> TensorSpec:
    shape = target.shape if a.get("reduction", "mean") == "none" else ()
    return TensorSpec(shape, logits.dtype, device=logits.device)


def _ce_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    _check_loss_args(specs[0], specs[1], a)
    return _loss_spec(specs[0], specs[1], a)


def _ce_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    return F.cross_entropy(xs[0], xs[1].long(), ignore_index=a.get("ignore_index", -100),
                           reduction=a.get("reduction", "mean"), label_smoothing=a.get("label_smoothing", 0.0))


def _ce_backward_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    grad, logits, target = specs
    _check_loss_args(logits, target, a)
    R.require_float(grad, "grad")
    want = _loss_spec(logits, target, a).shape
    if grad.shape != want:
        raise ShapeError(f"grad has shape {grad.shape}, expected {want} (the loss's shape for "
                         f"reduction={a.get('reduction', 'mean')!r})")
    return logits.with_(strides=None)


def _ce_backward_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    """Closed form: (softmax(x) - (1 - ls) * onehot - ls / C) * valid * dloss/dloss_row."""
    grad, x, target = xs
    classes, ls = x.shape[1], a.get("label_smoothing", 0.0)
    valid = target != a.get("ignore_index", -100)
    onehot = F.one_hot(torch.where(valid, target, 0).long(), classes).movedim(-1, 1).to(x.dtype)
    d = torch.softmax(x, dim=1) - (1.0 - ls) * onehot - ls / classes
    reduction = a.get("reduction", "mean")
    if reduction == "none":
        row = grad
    elif reduction == "sum":
        row = grad.expand(target.shape)
    else:
        row = (grad / valid.sum()).expand(target.shape)
    return d * torch.where(valid, row, 0).unsqueeze(1)


class _Parts:
    """Shared pieces of the forward and backward decompositions."""

    def __init__(self, e: Emitter, logits: Node, target: Node, a: Attrs, cd: str) -> None:
        self.x = upcast(e, logits, cd)
        shape = self.x.shape
        self.classes = shape[1]
        self.keep_shape = (shape[0], 1, *shape[2:])  # target with a unit class dim
        self.t = reshape_to(e, target, self.keep_shape)
        self.valid = e.op("ne", self.t, int(a.get("ignore_index", -100)))
        index_dtype = target.dtype if target.dtype in ("int32", "int64") else "int64"
        self.onehot = e.op("eq", e.op("iota", shape=shape, dim=1, dtype=index_dtype), self.t)
        m = e.op("max", self.x, dims=(1,), keepdim=True)
        sum_exp = e.op("sum", e.op("exp", e.op("sub", self.x, m)), dims=(1,), keepdim=True)
        self.lse = e.op("add", e.op("log", sum_exp), m)


def _count_valid(e: Emitter, valid: Node, cd: str) -> Node:
    return e.op("sum", e.op("cast", valid, dtype=cd), dims=None, keepdim=False)


def _ce_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> Node:
    p = _Parts(e, xs[0], xs[1], a, cd)
    ls = float(a.get("label_smoothing", 0.0))
    zero = e.scalar(0.0, cd)
    target_logit = e.op("sum", e.op("where", p.onehot, p.x, zero), dims=(1,), keepdim=True)
    loss = e.op("sub", p.lse, e.op("mul", target_logit, 1.0 - ls) if ls else target_logit)
    if ls:
        mean_logit = e.op("mul", e.op("sum", p.x, dims=(1,), keepdim=True), 1.0 / p.classes)
        loss = e.op("sub", loss, e.op("mul", mean_logit, ls))
    loss = reshape_to(e, e.op("where", p.valid, loss, zero), xs[1].shape)
    reduction = a.get("reduction", "mean")
    if reduction == "sum":
        loss = e.op("sum", loss, dims=None, keepdim=False)
    elif reduction == "mean":
        loss = e.op("div", e.op("sum", loss, dims=None, keepdim=False), _count_valid(e, p.valid, cd))
    return downcast(e, loss, xs[0].dtype)


def _ce_backward_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> Node:
    grad = upcast(e, xs[0], cd)
    p = _Parts(e, xs[1], xs[2], a, cd)
    ls = float(a.get("label_smoothing", 0.0))
    probs = e.op("exp", e.op("sub", p.x, p.lse))
    off = ls / p.classes
    target_prob = e.op("where", p.onehot, e.scalar(1.0 - ls + off, cd), e.scalar(off, cd))
    reduction = a.get("reduction", "mean")
    if reduction == "none":
        row = reshape_to(e, grad, p.keep_shape)
    elif reduction == "sum":
        row = grad
    else:
        row = e.op("div", grad, _count_valid(e, p.valid, cd))
    row = e.op("where", p.valid, row, e.scalar(0.0, cd))
    return downcast(e, e.op("mul", e.op("sub", probs, target_prob), row), xs[1].dtype)


def _ce_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    logits = next(s for s in ins if s.rank >= 2 and dtypes.is_float(s.dtype))
    return Cost(sum(s.nbytes for s in ins) + sum(s.nbytes for s in outs), 6 * logits.numel)


define("cross_entropy", _ce_infer, _ce_ref, num_inputs=(2, 2), props={COMPOSITE}, cost_fn=_ce_cost,
       decompose=_ce_dec, doc="F.cross_entropy(logits, target, ignore_index, reduction, label_smoothing).")
define("cross_entropy_backward", _ce_backward_infer, _ce_backward_ref, num_inputs=(3, 3), props={COMPOSITE},
       cost_fn=_ce_cost, decompose=_ce_backward_dec,
       doc="d loss / d logits of cross_entropy; inputs grad (the loss's shape), logits, target.")


class LossMethods:
    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def cross_entropy(self, input: Any, target: Any, weight: Any = None, *, ignore_index: int = -100,
                      reduction: str = "mean", label_smoothing: float = 0.0, name: str | None = None) -> Any:
        """F.cross_entropy with class indices as targets (no class weights)."""
        if weight is not None:
            raise UnsupportedError(f"op cross_entropy (at {user_source_line()}): class weights are not supported")
        return self._apply("cross_entropy", input, target, ignore_index=int(ignore_index), reduction=reduction,
                           label_smoothing=float(label_smoothing), name=name)

    def cross_entropy_backward(self, grad: Any, input: Any, target: Any, *, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0,
                               name: str | None = None) -> Any:
        """Gradient of cross_entropy(input, target, ...) w.r.t. input, given the loss's gradient."""
        return self._apply("cross_entropy_backward", grad, input, target, ignore_index=int(ignore_index),
                           reduction=reduction, label_smoothing=float(label_smoothing), name=name)
