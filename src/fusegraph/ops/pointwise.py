"""Elementwise ops: unary, binary with broadcasting, comparisons, logic, where, cast.

Each entry: name, shape/dtype rule, torch reference, FLOPs per element, properties, and the
Triton expression the pointwise code generator emits (arguments are fp32 for float math)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import DTypeError
from ..ir import dtypes
from ..ir.registry import (
    ASSOCIATIVE,
    COMMUTATIVE,
    IDEMPOTENT,
    INVOLUTION,
    LAYOUT_TRANSPARENT,
    NO_UPCAST,
    POINTWISE,
    define,
)
from ..settings import settings
from . import _rules as R

PW = {POINTWISE, LAYOUT_TRANSPARENT}
_SQRT1_2 = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


def _gelu_ref(xs: list[torch.Tensor], a: Any) -> torch.Tensor:
    return F.gelu(xs[0], approximate=a.get("approximate", "none"))


def _gelu_triton(x: list[str], a: Any) -> str:
    if a.get("approximate", "none") == "tanh":
        # 0.5*x*(1+tanh(u)) == x*sigmoid(2u): one exp instead of libdevice's exact tanh.
        v = x[0]
        return f"({v} * tl.sigmoid({2 * _SQRT_2_OVER_PI} * ({v} + 0.044715 * {v} * {v} * {v})))"
    return f"(0.5 * {x[0]} * (1.0 + tl.erf({x[0]} * {_SQRT1_2})))"


# name: (torch reference, triton expression, flops per element, extra props)
_UNARY: dict[str, tuple[Any, Any, float, set[str]]] = {
    "neg": (lambda x, a: -x, lambda v, a: f"(-{v[0]})", 1, {INVOLUTION}),
    "abs": (lambda x, a: x.abs(), lambda v, a: f"tl.abs({v[0]})", 1, {IDEMPOTENT}),
    "exp": (lambda x, a: x.exp(), lambda v, a: f"tl.exp({v[0]})", 1, set()),
    "log": (lambda x, a: x.log(), lambda v, a: f"tl.log({v[0]})", 1, set()),
    "sqrt": (lambda x, a: x.sqrt(), lambda v, a: f"tl.sqrt({v[0]})", 1, set()),
    "rsqrt": (lambda x, a: x.rsqrt(), lambda v, a: f"tl.rsqrt({v[0]})", 1, set()),
    "reciprocal": (lambda x, a: x.reciprocal(), lambda v, a: f"(1.0 / {v[0]})", 1, {INVOLUTION}),
    "sin": (lambda x, a: x.sin(), lambda v, a: f"tl.sin({v[0]})", 1, set()),
    "cos": (lambda x, a: x.cos(), lambda v, a: f"tl.cos({v[0]})", 1, set()),
    "tanh": (lambda x, a: x.tanh(), lambda v, a: _tanh_expr(v[0]) if settings.tanh_branch_free
             else f"libdevice.tanh({v[0]})", 1, set()),
    "sigmoid": (lambda x, a: x.sigmoid(), lambda v, a: f"tl.sigmoid({v[0]})", 4, set()),
    "relu": (lambda x, a: x.relu(), lambda v, a: f"tl.maximum({v[0]}, 0.0)", 1, {IDEMPOTENT}),
    "gelu": (lambda x, a: _gelu_ref([x], a), lambda v, a: _gelu_triton(v, a), 8, set()),
    "silu": (lambda x, a: F.silu(x), lambda v, a: f"({v[0]} * tl.sigmoid({v[0]}))", 5, set()),
    "softplus": (lambda x, a: F.softplus(x, beta=a.get("beta", 1.0), threshold=a.get("threshold", 20.0)),
                 lambda v, a: (f"tl.where({v[0]} * {float(a.get('beta', 1.0))} > {float(a.get('threshold', 20.0))}, "
                               f"{v[0]}, tl.log(1.0 + tl.exp({v[0]} * {float(a.get('beta', 1.0))})) / "
                               f"{float(a.get('beta', 1.0))})"), 4, set()),
    "elu": (lambda x, a: F.elu(x, alpha=a.get("alpha", 1.0)),
            lambda v, a: f"tl.where({v[0]} > 0.0, {v[0]}, {float(a.get('alpha', 1.0))} * (tl.exp({v[0]}) - 1.0))",
            3, set()),
    "leaky_relu": (lambda x, a: F.leaky_relu(x, a.get("negative_slope", 0.01)),
                   lambda v, a: f"tl.where({v[0]} > 0.0, {v[0]}, {v[0]} * {float(a.get('negative_slope', 0.01))})",
                   2, set()),
    "erf": (lambda x, a: torch.erf(x), lambda v, a: f"tl.erf({v[0]})", 1, set()),
    "floor": (lambda x, a: x.floor(), lambda v, a: f"tl.floor({v[0]})", 1, {IDEMPOTENT}),
    "ceil": (lambda x, a: x.ceil(), lambda v, a: f"tl.ceil({v[0]})", 1, {IDEMPOTENT}),
}

for _name, (_ref, _tri, _flops, _props) in _UNARY.items():
    define(_name, R.same if _name in ("neg", "abs", "relu") else R.float_same,
           (lambda ref: lambda xs, a: ref(xs[0], a))(_ref),
           props=PW | _props, flops_per_element=_flops, triton=_tri, doc=f"Elementwise {_name}.")


def _cast_infer(specs: Any, attrs: Any) -> Any:
    return specs[0].with_(dtype=dtypes.canonical(attrs["dtype"]), strides=None)


define("cast", _cast_infer, lambda xs, a: xs[0].to(dtypes.to_torch(a["dtype"])),
       props=PW | {NO_UPCAST}, triton=lambda v, a: v[0],  # the store casts to the output dtype
       doc="Convert to attrs['dtype'] (round to nearest even; saturation is quantize's job).")


def _pow_expr(base: str, exponent: str) -> str:
    """x ** e in Triton: a product of x for a literal integer exponent 1..4 (GELU's tanh form has x ** 3
    and its gradient x ** 2; libdevice.pow is a log/exp sequence with special cases, many instructions
    per element. In GPT-2's GELU kernels the difference did not show on the H200: they were bound by
    their bytes), libdevice.pow otherwise. Same special values: NaN, +-inf and -0.0 propagate through
    the product as through pow."""
    try:
        value = float(exponent)
    except ValueError:   # a tensor exponent, or inf/nan spelled as an expression
        value = float("nan")
    if value in (1.0, 2.0, 3.0, 4.0):
        return "(" + " * ".join([base] * int(value)) + ")"
    return f"libdevice.pow({base}, {exponent})"


# tanh's odd Taylor coefficients x^3 .. x^11 (its series: x - x^3/3 + 2x^5/15 - 17x^7/315 + ...)
_TANH_SERIES = (-1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925)
_TANH_SERIES_BELOW = 0.4


def _tanh_expr(v: str) -> str:
    """tanh without control flow: for |x| < 0.4 its series to x^11, else sign(x) (1 - 2 / (e^{2|x|} + 1)),
    both computed and one selected (about 20 instructions: ex2.approx and div.full, no branch). Within
    about 3 ulp of tanh in fp32 (numpy, float64 reference, |x| from 1e-30 to 12); inf, -inf and NaN map as
    tanh maps them. libdevice.tanh branches on |x| per element: with it GPT-2's fc layer with its GELU in
    the GEMM's epilogue took 159 us in its best Triton tile and 299 in the ping-pong kernel, with this form
    119 and 207 (cold compiles on the H200: bench/results/choices_gpt2_sink_20261203.txt, _branch_free_)."""
    x2 = f"{v} * {v}"
    series = repr(_TANH_SERIES[-1])
    for c in reversed(_TANH_SERIES[:-1]):
        series = f"({c!r} + {x2} * {series})"
    small = f"({v} + {v} * {x2} * {series})"
    large = f"tl.where({v} < 0.0, -1.0, 1.0) * (1.0 - 2.0 / (tl.exp(2.0 * tl.abs({v})) + 1.0))"
    return f"tl.where(tl.abs({v}) < {_TANH_SERIES_BELOW}, {small}, {large})"


_BINARY: dict[str, tuple[Any, Any, float, set[str]]] = {
    "add": (torch.add, lambda v, a: f"({v[0]} + {v[1]})", 1, {COMMUTATIVE, ASSOCIATIVE}),
    "sub": (torch.sub, lambda v, a: f"({v[0]} - {v[1]})", 1, set()),
    "mul": (torch.mul, lambda v, a: f"({v[0]} * {v[1]})", 1, {COMMUTATIVE, ASSOCIATIVE}),
    "div": (torch.div, lambda v, a: f"({v[0]} / {v[1]})", 1, set()),
    "pow": (torch.pow, lambda v, a: _pow_expr(v[0], v[1]), 4, set()),
    "maximum": (torch.maximum, lambda v, a: f"tl.maximum({v[0]}, {v[1]})", 1,
                {COMMUTATIVE, ASSOCIATIVE, IDEMPOTENT}),
    "minimum": (torch.minimum, lambda v, a: f"tl.minimum({v[0]}, {v[1]})", 1,
                {COMMUTATIVE, ASSOCIATIVE, IDEMPOTENT}),
}


def _div_infer(specs: Any, attrs: Any) -> Any:
    out = R.broadcast(specs, attrs)
    return out if dtypes.is_float(out.dtype) else out.with_(dtype="float32")


for _name, (_ref, _tri, _flops, _props) in _BINARY.items():
    define(_name, _div_infer if _name == "div" else R.broadcast,
           (lambda ref: lambda xs, a: ref(xs[0], xs[1]))(_ref),
           num_inputs=(2, 2), props=PW | _props, flops_per_element=_flops, triton=_tri,
           doc=f"Elementwise {_name} with broadcasting.")

_COMPARE = {"eq": ("==", torch.eq), "ne": ("!=", torch.ne), "lt": ("<", torch.lt), "le": ("<=", torch.le),
            "gt": (">", torch.gt), "ge": (">=", torch.ge)}
for _name, (_sym, _ref) in _COMPARE.items():
    define(_name, R.broadcast_bool, (lambda ref: lambda xs, a: ref(xs[0], xs[1]))(_ref),
           num_inputs=(2, 2), props=PW | ({COMMUTATIVE} if _name in ("eq", "ne") else set()),
           flops_per_element=1, triton=(lambda s: lambda v, a: f"({v[0]} {s} {v[1]})")(_sym),
           doc=f"Elementwise comparison {_sym} (bool result).")


def _logic_infer(specs: Any, attrs: Any) -> Any:
    for s in specs:
        if s.dtype != "bool":
            raise DTypeError(f"logical ops take bool tensors, got {s.dtype}")
    return R.broadcast_bool(specs, attrs)


define("logical_and", _logic_infer, lambda xs, a: torch.logical_and(xs[0], xs[1]), num_inputs=(2, 2),
       props=PW | {COMMUTATIVE, ASSOCIATIVE, IDEMPOTENT}, triton=lambda v, a: f"({v[0]} & {v[1]})")
define("logical_or", _logic_infer, lambda xs, a: torch.logical_or(xs[0], xs[1]), num_inputs=(2, 2),
       props=PW | {COMMUTATIVE, ASSOCIATIVE, IDEMPOTENT}, triton=lambda v, a: f"({v[0]} | {v[1]})")
define("logical_not", _logic_infer, lambda xs, a: torch.logical_not(xs[0]),
       props=PW | {INVOLUTION}, triton=lambda v, a: f"({v[0]} == 0)")


def _where_infer(specs: Any, attrs: Any) -> Any:
    if specs[0].dtype != "bool":
        raise DTypeError(f"where's condition must be bool, got {specs[0].dtype}")
    shape = R.broadcast_shapes(*(s.shape for s in specs))
    return specs[1].with_(shape=shape, dtype=dtypes.promote(specs[1].dtype, specs[2].dtype),
                          strides=None, layout=None)


define("where", _where_infer, lambda xs, a: torch.where(xs[0], xs[1], xs[2]), num_inputs=(3, 3),
       props=PW, flops_per_element=1, triton=lambda v, a: f"tl.where({v[0]}, {v[1]}, {v[2]})",
       doc="cond ? a : b, with broadcasting.")

_ = math  # keep math for future closed forms


class PointwiseMethods:
    """Graph-builder methods for elementwise ops (mixed into fusegraph.Graph)."""

    def _apply(self, op: str, *operands: Any, name: str | None = None, **attrs: Any) -> Any:
        raise NotImplementedError

    def neg(self, x: Any, name: str | None = None) -> Any: return self._apply("neg", x, name=name)
    def abs(self, x: Any, name: str | None = None) -> Any: return self._apply("abs", x, name=name)
    def exp(self, x: Any, name: str | None = None) -> Any: return self._apply("exp", x, name=name)
    def log(self, x: Any, name: str | None = None) -> Any: return self._apply("log", x, name=name)
    def sqrt(self, x: Any, name: str | None = None) -> Any: return self._apply("sqrt", x, name=name)
    def rsqrt(self, x: Any, name: str | None = None) -> Any: return self._apply("rsqrt", x, name=name)
    def reciprocal(self, x: Any, name: str | None = None) -> Any:
        return self._apply("reciprocal", x, name=name)
    def sin(self, x: Any, name: str | None = None) -> Any: return self._apply("sin", x, name=name)
    def cos(self, x: Any, name: str | None = None) -> Any: return self._apply("cos", x, name=name)
    def tanh(self, x: Any, name: str | None = None) -> Any: return self._apply("tanh", x, name=name)
    def sigmoid(self, x: Any, name: str | None = None) -> Any: return self._apply("sigmoid", x, name=name)
    def relu(self, x: Any, name: str | None = None) -> Any: return self._apply("relu", x, name=name)
    def gelu(self, x: Any, approximate: str = "none", name: str | None = None) -> Any:
        return self._apply("gelu", x, approximate=approximate, name=name)
    def silu(self, x: Any, name: str | None = None) -> Any: return self._apply("silu", x, name=name)
    def softplus(self, x: Any, beta: float = 1.0, threshold: float = 20.0, name: str | None = None) -> Any:
        return self._apply("softplus", x, beta=beta, threshold=threshold, name=name)
    def elu(self, x: Any, alpha: float = 1.0, name: str | None = None) -> Any:
        return self._apply("elu", x, alpha=alpha, name=name)
    def leaky_relu(self, x: Any, negative_slope: float = 0.01, name: str | None = None) -> Any:
        return self._apply("leaky_relu", x, negative_slope=negative_slope, name=name)
    def erf(self, x: Any, name: str | None = None) -> Any: return self._apply("erf", x, name=name)
    def floor(self, x: Any, name: str | None = None) -> Any: return self._apply("floor", x, name=name)
    def ceil(self, x: Any, name: str | None = None) -> Any: return self._apply("ceil", x, name=name)
    def cast(self, x: Any, dtype: Any, name: str | None = None) -> Any:
        return self._apply("cast", x, dtype=dtypes.canonical(dtype), name=name)

    def add(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("add", a, b, name=name)
    def sub(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("sub", a, b, name=name)
    def mul(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("mul", a, b, name=name)
    def div(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("div", a, b, name=name)
    def pow(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("pow", a, b, name=name)
    def maximum(self, a: Any, b: Any, name: str | None = None) -> Any:
        return self._apply("maximum", a, b, name=name)
    def minimum(self, a: Any, b: Any, name: str | None = None) -> Any:
        return self._apply("minimum", a, b, name=name)
    def eq(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("eq", a, b, name=name)
    def ne(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("ne", a, b, name=name)
    def lt(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("lt", a, b, name=name)
    def le(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("le", a, b, name=name)
    def gt(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("gt", a, b, name=name)
    def ge(self, a: Any, b: Any, name: str | None = None) -> Any: return self._apply("ge", a, b, name=name)
    def logical_and(self, a: Any, b: Any, name: str | None = None) -> Any:
        return self._apply("logical_and", a, b, name=name)
    def logical_or(self, a: Any, b: Any, name: str | None = None) -> Any:
        return self._apply("logical_or", a, b, name=name)
    def logical_not(self, a: Any, name: str | None = None) -> Any:
        return self._apply("logical_not", a, name=name)
    def where(self, cond: Any, a: Any, b: Any, name: str | None = None) -> Any:
        return self._apply("where", cond, a, b, name=name)
