"""Quantize / dequantize: fp8 (e4m3fn, e5m2) and int8, symmetric, with per-tensor, per-row
(last dim reduced) or per-block (block_size along the last dim) scales.

    scale = max(amax, AMAX_FLOOR) / QMAX[dtype]        (when no scale is given; amax = max |x|)
    q     = saturate(round(x / scale))                 (fp8: clamp to +-max, then round-to-nearest-even
                                                        by the cast; int8: round half to even, clamp
                                                        to [-128, 127])
    x'    = q * scale                                  (dequantize, in the compute dtype, cast to dtype)

Scale shapes: "tensor" -> (), "row" -> x.shape[:-1] + (1,), "block" -> x.shape[:-1] + (K / block_size,);
block quantization needs K % block_size == 0. quantize always returns (q, scale): the computed
scale, or the given one (as float32). A Python-number scale is per-tensor; it must be finite and
> 0 (InvalidValueError naming the value). Scales fed at run time are not checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import DTypeError, InvalidValueError, ShapeError
from ..ir import dtypes
from ..ir.emit import Emitter, user_source_line
from ..ir.node import Attrs, Node
from ..ir.registry import COMPOSITE, Cost, define
from ..ir.spec import TensorSpec
from . import _rules as R
from .index_gen import reshape_to
from .reduce import downcast, upcast

QMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
QMIN = {"float8_e4m3fn": -448.0, "float8_e5m2": -57344.0, "int8": -128.0}
AMAX_FLOOR = 1e-12
GRANULARITIES = ("tensor", "row", "block")


def check_scale_value(scale: Any) -> float:
    """A constant scale must be a finite number > 0."""
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
        raise InvalidValueError(f"scale must be a finite number > 0, got {scale!r}")
    return float(scale)


def scale_shape(x_shape: Sequence[int], granularity: str, block_size: int) -> tuple[int, ...]:
    x_shape = tuple(x_shape)
    if granularity not in GRANULARITIES:
        raise InvalidValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "tensor":
        return ()
    if not x_shape:
        raise ShapeError(f"{granularity} scales need an input of rank >= 1, got shape {x_shape}")
    if granularity == "row":
        return (*x_shape[:-1], 1)
    if not isinstance(block_size, int) or block_size < 1 or x_shape[-1] % block_size:
        raise ShapeError(f"block_size {block_size!r} must be a positive divisor of the last dim of {x_shape}")
    return (*x_shape[:-1], x_shape[-1] // block_size)


def _check_scale_input(specs: Sequence[TensorSpec], a: Attrs, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    want = scale_shape(x_shape, a.get("granularity", "tensor"), a.get("block_size", 128))
    if "scale" in a:
        check_scale_value(a["scale"])
        if want != ():
            raise ShapeError(f"a number scale is per-tensor; granularity {a['granularity']!r} needs a scale "
                             f"tensor of shape {want}")
    elif len(specs) > 1:
        R.require_float(specs[1], "scale")
        if specs[1].shape != want:
            raise ShapeError(f"scale has shape {specs[1].shape}, expected {want} for "
                             f"{a.get('granularity', 'tensor')} scales of {x_shape}")
    return want


def _quantize_infer(specs: Sequence[TensorSpec], a: Attrs) -> tuple[TensorSpec, TensorSpec]:
    x = specs[0]
    R.require_float(x)
    qdtype = dtypes.canonical(a["dtype"])
    if qdtype not in QMAX:
        raise DTypeError(f"quantize targets {sorted(QMAX)}, got {qdtype}")
    sshape = _check_scale_input(specs, a, x.shape)
    return x.with_(dtype=qdtype, strides=None), TensorSpec(sshape, "float32", device=x.device)


def _dequantize_infer(specs: Sequence[TensorSpec], a: Attrs) -> TensorSpec:
    q = specs[0]
    if q.dtype not in QMAX:
        raise DTypeError(f"dequantize reads {sorted(QMAX)}, got {q.dtype}")
    out = dtypes.canonical(a.get("dtype", "bfloat16"))
    if not dtypes.is_float(out) or out in dtypes.FP8:
        raise DTypeError(f"dequantize produces float32/float16/bfloat16/float64, got {out}")
    if len(specs) < 2 and "scale" not in a:
        raise ShapeError("dequantize needs a scale (tensor input or number)")
    _check_scale_input(specs, a, q.shape)
    return q.with_(dtype=out, strides=None)


# ---- torch references ----

def _blocked(x: torch.Tensor, block_size: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def _amax_scale(x: torch.Tensor, granularity: str, block_size: int, qdtype: str) -> torch.Tensor:
    a = x.abs()
    if granularity == "tensor":
        amax = a.amax()
    elif granularity == "row":
        amax = a.amax(dim=-1, keepdim=True)
    else:
        amax = _blocked(a, block_size).amax(dim=-1)
    return amax.clamp(min=AMAX_FLOOR) / QMAX[qdtype]


def _expand_scale(scale: torch.Tensor, x: torch.Tensor, granularity: str, block_size: int) -> torch.Tensor:
    if granularity != "block":
        return scale
    return scale.unsqueeze(-1).expand(*scale.shape, block_size).reshape(x.shape)


def _quantize_ref(xs: list[torch.Tensor], a: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = xs[0].float()
    gran, bs, qdtype = a.get("granularity", "tensor"), a.get("block_size", 128), a["dtype"]
    if "scale" in a:
        scale = torch.tensor(float(a["scale"]), device=x.device)
    elif len(xs) > 1:
        scale = xs[1].float()
    else:
        scale = _amax_scale(x, gran, bs, qdtype)
    v = (x / _expand_scale(scale, x, gran, bs)).clamp(QMIN[qdtype], QMAX[qdtype])
    if qdtype == "int8":
        v = torch.round(v)
    return v.to(dtypes.to_torch(qdtype)), scale


def _dequantize_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    q = xs[0].float()
    gran, bs = a.get("granularity", "tensor"), a.get("block_size", 128)
    scale = torch.tensor(float(a["scale"]), device=q.device) if "scale" in a else xs[1].float()
    return q * _expand_scale(scale, q, gran, bs)


# ---- decompositions ----

def _round_half_even(e: Emitter, v: Node) -> Node:
    """torch.round from floor: floor(v + 0.5), minus one on exact ties that landed on an odd value."""
    up = e.op("floor", e.op("add", v, 0.5))
    tie = e.op("eq", e.op("sub", up, v), 0.5)
    half = e.op("mul", up, 0.5)
    odd = e.op("ne", e.op("floor", half), half)
    return e.op("where", e.op("logical_and", tie, odd), e.op("sub", up, 1.0), up)


def _scale_node(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> Node | None:
    if "scale" in a:
        return e.scalar(float(a["scale"]), cd)
    if len(xs) > 1:
        return upcast(e, xs[1], cd)
    return None


def _with_blocks(e: Emitter, x: Node, a: Attrs) -> Node:
    """x as [..., K / block_size, block_size] for block scales, else unchanged."""
    if a.get("granularity", "tensor") != "block":
        return x
    bs = a.get("block_size", 128)
    return reshape_to(e, x, (*x.shape[:-1], x.shape[-1] // bs, bs))


def _scale_view(e: Emitter, scale: Node, a: Attrs) -> Node:
    """A block scale [..., nb] as [..., nb, 1] to broadcast over its block."""
    if a.get("granularity", "tensor") != "block":
        return scale
    return reshape_to(e, scale, (*scale.shape, 1))


def _quantize_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> tuple[Node, Node]:
    qdtype = dtypes.canonical(a["dtype"])
    gran = a.get("granularity", "tensor")
    x = _with_blocks(e, upcast(e, xs[0], cd), a)
    given = _scale_node(e, xs, a, cd)
    if given is None:  # amax over the last dim of the row or of the blocked view, kept for broadcasting
        dims = None if gran == "tensor" else (x.spec.rank - 1,)
        amax = e.op("max", e.op("abs", x), dims=dims, keepdim=gran != "tensor")
        scale = e.op("div", e.op("maximum", amax, AMAX_FLOOR), QMAX[qdtype])
        scale_out = reshape_to(e, scale, scale_shape(xs[0].shape, gran, a.get("block_size", 128)))
    else:
        scale, scale_out = _scale_view(e, given, a), given
    v = e.op("div", x, scale)
    v = e.op("minimum", e.op("maximum", v, QMIN[qdtype]), QMAX[qdtype])
    if qdtype == "int8":
        v = _round_half_even(e, v)
    q = reshape_to(e, e.op("cast", v, dtype=qdtype), xs[0].shape)
    return q, downcast(e, scale_out, "float32")


def _dequantize_dec(e: Emitter, xs: list[Node], a: Attrs, cd: str) -> Node:
    q = _with_blocks(e, e.op("cast", xs[0], dtype=cd), a)
    scale = _scale_node(e, xs, a, cd)
    assert scale is not None  # the shape rule requires one
    x = reshape_to(e, e.op("mul", q, _scale_view(e, scale, a)), xs[0].shape)
    return downcast(e, x, dtypes.canonical(a.get("dtype", "bfloat16")))


def _quant_cost(flops: int):  # type: ignore[no-untyped-def]
    def cost(ins: Sequence[TensorSpec], outs: Sequence[TensorSpec], a: Attrs) -> Cost:
        return Cost(sum(s.nbytes for s in ins) + sum(s.nbytes for s in outs), flops * ins[0].numel)
    return cost


define("quantize", _quantize_infer, _quantize_ref, num_inputs=(1, 2), props={COMPOSITE}, cost_fn=_quant_cost(5),
       decompose=_quantize_dec,
       doc="(q, scale) = quantize(x[, scale]) to fp8 e4m3fn/e5m2 or int8; scale from amax unless given.")
define("dequantize", _dequantize_infer, _dequantize_ref, num_inputs=(1, 2), props={COMPOSITE},
       cost_fn=_quant_cost(1), decompose=_dequantize_dec, doc="q * scale, cast to attrs['dtype'].")


def _constant_value_check(scale: Any, op: str) -> None:
    """A scale given as a graph constant is checked when the graph is built."""
    node = getattr(scale, "node", None)
    if node is not None and node.op in ("constant", "scalar"):
        value = node.attrs["value"]
        t = (value if isinstance(value, torch.Tensor) else torch.tensor(value)).double().flatten()
        bad = t[~(torch.isfinite(t) & (t > 0))]
        if bad.numel():
            raise InvalidValueError(f"op {op} (at {user_source_line()}): constant scale '{node.name}' must be "
                                    f"finite and > 0, got {bad[:4].tolist()}")


class QuantMethods:
    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def quantize(self, x: Any, dtype: Any, granularity: str = "tensor", block_size: int = 128, scale: Any = None,
                 name: str | None = None) -> Any:
        """(q, scale): q = saturate(round(x / scale)); scale = amax / dtype max unless given."""
        attrs: dict[str, Any] = {"dtype": dtypes.canonical(dtype), "granularity": granularity,
                                 "block_size": block_size}
        if isinstance(scale, int | float):  # checked by the shape rule, which names the node
            return self._apply("quantize", x, scale=scale, name=name, **attrs)
        if scale is not None:
            _constant_value_check(scale, "quantize")
            return self._apply("quantize", x, scale, name=name, **attrs)
        return self._apply("quantize", x, name=name, **attrs)

    def dequantize(self, q: Any, scale: Any, dtype: Any = "bfloat16", granularity: str = "tensor",
                   block_size: int = 128, name: str | None = None) -> Any:
        """q * scale as `dtype`, with the scale layout of `granularity`."""
        attrs: dict[str, Any] = {"dtype": dtypes.canonical(dtype), "granularity": granularity,
                                 "block_size": block_size}
        if isinstance(scale, int | float):
            return self._apply("dequantize", q, scale=scale, name=name, **attrs)
        _constant_value_check(scale, "dequantize")
        return self._apply("dequantize", q, scale, name=name, **attrs)
