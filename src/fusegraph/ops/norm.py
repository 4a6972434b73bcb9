"""Normalizations (forward). Each is a composite: its decomposition into reductions and
pointwise ops is what the fusion compiler sees, so it fuses through the general mechanism."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ShapeError
from ..ir import dtypes
from ..ir.emit import Emitter, user_source_line
from ..ir.node import Attrs, Node
from ..ir.registry import COMPOSITE, Cost, define
from ..ir.spec import TensorSpec
from . import _rules as R
from .index_gen import channel_view_shape, reshape_to
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


# ---- batchnorm and groupnorm: per-channel affine over [N, C, *spatial] ----

def _channel_params(specs: Sequence[TensorSpec], names: Sequence[str], x: TensorSpec) -> None:
    for what, s in zip(names, specs, strict=False):
        if s.shape != (x.shape[1],):
            raise ShapeError(f"{what} has shape {s.shape}, expected ({x.shape[1]},) for input {x.shape}")


def _channel_input(x: TensorSpec, op: str) -> None:
    R.require_float(x)
    if x.rank < 2:
        raise ShapeError(f"{op} needs an input of shape [N, C, *spatial], got {x.shape}")


def _batch_count(shape: Sequence[int]) -> int:
    """Values per channel that batch statistics average over: N * prod(spatial)."""
    n = shape[0]
    for s in shape[2:]:
        n *= s
    return n


def batchnorm_param_names(a: Any) -> list[str]:
    """Names of the optional inputs after x, in order: running_mean, running_var, weight, bias."""
    names = ["running_mean", "running_var"] if a.get("has_running") else []
    return names + [n for n, flag in (("weight", "has_weight"), ("bias", "has_bias")) if a.get(flag)]


def _stat_dtype(dtype: str) -> str:
    """Batch statistics come out in at least float32 (running stats stay float32 under autocast)."""
    return dtype if dtypes.itemsize(dtype) >= 4 else "float32"


def _batchnorm_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec | tuple[TensorSpec, ...]:
    x = specs[0]
    _channel_input(x, "batchnorm")
    names = batchnorm_param_names(a)
    if len(names) != len(specs) - 1:
        raise ShapeError(f"batchnorm got {len(specs) - 1} parameter tensors, expected {names}")
    _channel_params(specs[1:], names, x)
    y = x.with_(strides=None)
    if not a.get("training"):
        return y
    if _batch_count(x.shape) < 2:
        raise ShapeError(f"batchnorm training needs more than one value per channel, input {x.shape}")
    stat = TensorSpec((x.shape[1],), _stat_dtype(x.dtype), device=x.device)
    return (y, stat, stat)


def _named_params(xs: list[torch.Tensor], a: Any) -> dict[str, Any]:
    return dict(zip(batchnorm_param_names(a), xs[1:], strict=True))


def _batchnorm_ref(xs: list[torch.Tensor], a: Any) -> Any:
    p = _named_params(xs, a)
    x, eps = xs[0], a.get("eps", 1e-5)
    if not a.get("training"):
        return F.batch_norm(x, p["running_mean"], p["running_var"], p.get("weight"), p.get("bias"),
                            training=False, eps=eps)
    dims = [0, *range(2, x.dim())]
    mean = x.mean(dim=dims)
    var_unbiased = x.var(dim=dims, correction=1)
    y = F.batch_norm(x, None, None, p.get("weight"), p.get("bias"), training=True, eps=eps)
    return y, mean, var_unbiased


def _affine_per_channel(e: Emitter, y: Node, params: dict[str, Node], cd: str) -> Node:
    view = channel_view_shape(y.shape[1], y.spec.rank)
    if "weight" in params:
        y = e.op("mul", y, reshape_to(e, upcast(e, params["weight"], cd), view))
    if "bias" in params:
        y = e.op("add", y, reshape_to(e, upcast(e, params["bias"], cd), view))
    return y


def _batchnorm_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> Any:
    params = dict(zip(batchnorm_param_names(a), xs[1:], strict=True))
    x = upcast(e, xs[0], cd)
    eps = float(a.get("eps", 1e-5))
    view = channel_view_shape(x.shape[1], x.spec.rank)
    if not a.get("training"):
        mean = reshape_to(e, upcast(e, params["running_mean"], cd), view)
        var = reshape_to(e, upcast(e, params["running_var"], cd), view)
        y = e.op("mul", e.op("sub", x, mean), e.op("rsqrt", e.op("add", var, eps)))
        return downcast(e, _affine_per_channel(e, y, params, cd), xs[0].dtype)
    dims = (0, *range(2, x.spec.rank))
    n = _batch_count(x.shape)
    mean = e.op("mul", e.op("sum", x, dims=dims, keepdim=True), 1.0 / n)
    centered = e.op("sub", x, mean)
    sumsq = e.op("sum", e.op("mul", centered, centered), dims=dims, keepdim=True)
    rstd = e.op("rsqrt", e.op("add", e.op("mul", sumsq, 1.0 / n), eps))
    y = _affine_per_channel(e, e.op("mul", centered, rstd), params, cd)
    channels = (x.shape[1],)
    mean_out = reshape_to(e, mean, channels)
    var_out = reshape_to(e, e.op("mul", sumsq, 1.0 / (n - 1)), channels)
    stat = _stat_dtype(xs[0].dtype)
    return downcast(e, y, xs[0].dtype), downcast(e, mean_out, stat), downcast(e, var_out, stat)


def _groupnorm_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    x = specs[0]
    _channel_input(x, "groupnorm")
    groups = a["num_groups"]
    if not isinstance(groups, int) or groups < 1 or x.shape[1] % groups:
        raise ShapeError(f"num_groups {groups!r} must be a positive divisor of the {x.shape[1]} channels "
                         f"of input {x.shape}")
    names = [n for n, flag in (("weight", "has_weight"), ("bias", "has_bias")) if a.get(flag)]
    _channel_params(specs[1:], names, x)
    return x.with_(strides=None)


def _groupnorm_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    w, b = _affine_args(xs, a)
    return F.group_norm(xs[0], a["num_groups"], w, b, a.get("eps", 1e-5))


def group_view_shape(shape: Sequence[int], groups: int) -> tuple[int, int, int]:
    """[N, C, *spatial] seen as [N, G, C/G * prod(spatial)]: one row per (sample, group)."""
    per_group = 1
    for s in shape[1:]:
        per_group *= s
    return (shape[0], groups, per_group // groups)


def _groupnorm_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> Node:
    x = upcast(e, xs[0], cd)
    grouped = reshape_to(e, x, group_view_shape(x.shape, a["num_groups"]))
    normalized = _normalize_dec(e, [grouped], Attrs(normalized_shape=(grouped.shape[2],),
                                                    eps=a.get("eps", 1e-5)), cd, rms=False)
    y = reshape_to(e, normalized, x.shape)
    params = {}
    if a.get("has_weight"):
        params["weight"] = xs[1]
    if a.get("has_bias"):
        params["bias"] = xs[1 + bool(a.get("has_weight"))]
    return downcast(e, _affine_per_channel(e, y, params, cd), xs[0].dtype)


def _channel_norm_cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
    return Cost(sum(s.nbytes for s in ins) + sum(s.nbytes for s in outs), 8 * ins[0].numel)


define("batchnorm", _batchnorm_infer, _batchnorm_ref, num_inputs=(1, 5), props={COMPOSITE},
       cost_fn=_channel_norm_cost, decompose=_batchnorm_dec,
       doc="Batch normalization over [N, C, *spatial]. Inference (training=False): normalizes with "
           "running_mean / running_var, one output. Training: normalizes with batch statistics and "
           "returns (y, batch_mean, batch_var) with batch_var UNBIASED (what torch folds into "
           "running_var), statistics in at least float32; graphs are functional, so running stats are "
           "not updated in place: "
           "new_running = (1 - momentum) * running + momentum * batch_stat (momentum is recorded).")
define("groupnorm", _groupnorm_infer, _groupnorm_ref, num_inputs=(1, 3), props={COMPOSITE},
       cost_fn=_channel_norm_cost, decompose=_groupnorm_dec,
       doc="Group normalization: statistics per (sample, group of C/num_groups channels); "
           "per-channel weight and bias.")


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

    def layer_norm(self, input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
                   eps: float = 1e-5, name: str | None = None) -> Any:
        """F.layer_norm's name and argument order; the same op as layernorm."""
        return self.layernorm(input, normalized_shape, weight, bias, eps, name=name)

    def rms_norm(self, input: Any, normalized_shape: Any, weight: Any = None, eps: float | None = None,
                 name: str | None = None) -> Any:
        """F.rms_norm: eps None means torch.finfo(input dtype).eps, as torch does."""
        if eps is None:
            eps = float(torch.finfo(dtypes.to_torch(input.dtype)).eps)
        return self.rmsnorm(input, normalized_shape, weight, eps, name=name)

    def batch_norm(self, input: Any, running_mean: Any, running_var: Any, weight: Any = None,
                   bias: Any = None, training: bool = False, momentum: float = 0.1, eps: float = 1e-5,
                   name: str | None = None) -> Any:
        """F.batch_norm. training=False: returns y. training=True: returns (y, batch_mean,
        batch_var_unbiased); update running stats functionally with `momentum` if needed.
        Without running stats (None, None), batch statistics are used, as in torch."""
        has_running = running_mean is not None or running_var is not None
        if has_running and (running_mean is None or running_var is None):
            raise ShapeError(f"op batchnorm (at {user_source_line()}): give both running_mean and running_var, "
                             "or neither")
        batch_stats = bool(training) or not has_running
        args = [input] + ([] if batch_stats else [running_mean, running_var])
        args += [t for t in (weight, bias) if t is not None]
        out = self._apply("batchnorm", *args, training=batch_stats, has_running=not batch_stats,
                          has_weight=weight is not None, has_bias=bias is not None, momentum=float(momentum),
                          eps=float(eps), name=name)
        return out[0] if batch_stats and not training else out

    def group_norm(self, input: Any, num_groups: int, weight: Any = None, bias: Any = None, eps: float = 1e-5,
                   name: str | None = None) -> Any:
        """F.group_norm."""
        args = [input] + [t for t in (weight, bias) if t is not None]
        return self._apply("groupnorm", *args, num_groups=num_groups, has_weight=weight is not None,
                           has_bias=bias is not None, eps=float(eps), name=name)

    batchnorm = batch_norm
    groupnorm = group_norm
