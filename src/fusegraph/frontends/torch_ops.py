"""ATen -> fusegraph IR: one table entry per ATen op, each a function that builds fusegraph ops.

A translator gets a Ctx (the fg.Graph under construction and the FX node's fake output values) and
the node's arguments with FX nodes already replaced by fusegraph Tensors. It returns a Tensor (or a
tuple for multi-output ops). translate_node() then checks the result against the FX node's own
shape and casts to its dtype, so a translator only has to get the math right.

`supports` predicates say, before any translation, whether an op's particular call can be served
(e.g. convolution: 2-d and not transposed); what cannot becomes an eager partition.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..api import Graph, Tensor
from ..errors import UnsupportedError
from ..ir import dtypes

aten = torch.ops.aten
prims = torch.ops.prims


@dataclass
class Ctx:
    """What a translator may look at: the builder and the FX node (meta['val'] = fake outputs)."""

    g: Graph
    node: torch.fx.Node

    @property
    def val(self) -> Any:
        return self.node.meta.get("val")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.val.shape)

    @property
    def dtype(self) -> str:
        return dtypes.canonical(self.val.dtype)

    def used_outputs(self) -> set[int]:
        """Which items of a multi-output node are read (through a getitem that has users)."""
        return {int(u.args[1]) for u in self.node.users  # type: ignore[arg-type]
                if u.target is operator.getitem and u.users}


Translator = Callable[..., Any]
TRANSLATORS: dict[Any, Translator] = {}
SUPPORTS: dict[Any, Callable[[torch.fx.Node], str | None]] = {}


def translates(*ops: Any, supports: Callable[[torch.fx.Node], str | None] | None = None
               ) -> Callable[[Translator], Translator]:
    """Register `fn` for ATen overloads; `supports(node)` returns None or why this call is not served."""
    def register(fn: Translator) -> Translator:
        for op in ops:
            TRANSLATORS[op] = fn
            if supports is not None:
                SUPPORTS[op] = supports
        return fn
    return register


def lookup(target: Any) -> Translator | None:
    return TRANSLATORS.get(target)


# ---------------- helpers ----------------

def _is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def cast_to(cx: Ctx, x: Any, dtype: str) -> Any:
    """x in `dtype` (a cast node only when it differs); Python numbers pass through."""
    if _is_tensor(x) and x.dtype != dtype:
        return cx.g.cast(x, dtype)
    return x


def _common_dtype(*xs: Any) -> str:
    """torch's promotion over tensors and Python scalars (a float scalar makes int tensors float)."""
    tensor_dtypes = [x.dtype for x in xs if _is_tensor(x)]
    result = dtypes.promote(*tensor_dtypes) if tensor_dtypes else "float32"
    if any(isinstance(x, float) for x in xs) and not dtypes.is_float(result):
        result = "float32"
    return result


def _shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if _is_tensor(x) else ()


def _binary(method: str, *, compare: bool = False) -> Translator:
    """Pointwise binary op: operands cast to the result dtype (or the promoted one for comparisons)."""
    def translate(cx: Ctx, a: Any, b: Any, *, alpha: Any = None) -> Any:
        dtype = _common_dtype(a, b) if compare else cx.dtype
        a, b = cast_to(cx, a, dtype), cast_to(cx, b, dtype)
        if alpha is not None and alpha != 1:
            b = cx.g.mul(b, alpha)
        return getattr(cx.g, method)(a, b)
    return translate


def _unary(method: str) -> Translator:
    def translate(cx: Ctx, x: Any) -> Any:
        return getattr(cx.g, method)(cast_to(cx, x, cx.dtype) if dtypes.is_float(cx.dtype) else x)
    return translate


def _dims(dim: Any, rank: int) -> tuple[int, ...] | None:
    if dim is None or (isinstance(dim, list | tuple) and len(dim) == 0):
        return None
    dims = tuple(dim) if isinstance(dim, list | tuple) else (dim,)
    return tuple(d % rank if rank else 0 for d in dims)


def _reshape_to(cx: Ctx, x: Any) -> Any:
    """Shape changes whose target shape is the node's own output shape."""
    return x if tuple(x.shape) == cx.shape else cx.g.reshape(x, cx.shape)


def _full_constant(cx: Ctx, value: Any, shape: Sequence[int], dtype: str) -> Any:
    """A constant filled with `value`: one scalar, broadcast (a stride-0 view, not a materialized buffer)."""
    scalar = cx.g.constant(torch.tensor(value, dtype=dtypes.to_torch(dtype)))
    if not shape:
        return scalar
    return cx.g.expand(cx.g.reshape(scalar, (1,) * len(shape)), tuple(shape))


def node_users_only_first(node: torch.fx.Node) -> bool:
    """Only the first output of a multi-output node is read (its statistics/indices are not;
    a getitem nobody reads does not count)."""
    return all(u.target is operator.getitem and (u.args[1] == 0 or not u.users) for u in node.users)


# ---------------- pointwise ----------------

for _op, _m in [(aten.add, "add"), (aten.sub, "sub"), (aten.mul, "mul"), (aten.div, "div"),
                (aten.maximum, "maximum"), (aten.minimum, "minimum"), (aten.pow, "pow")]:
    translates(*[getattr(_op, o) for o in ("Tensor", "Scalar", "Tensor_Tensor", "Tensor_Scalar", "default")
                 if hasattr(_op, o)])(_binary(_m))
for _op, _m in [(aten.eq, "eq"), (aten.ne, "ne"), (aten.lt, "lt"), (aten.le, "le"), (aten.gt, "gt"),
                (aten.ge, "ge"), (aten.logical_and, "logical_and"), (aten.logical_or, "logical_or")]:
    translates(*[getattr(_op, o) for o in ("Tensor", "Scalar", "default") if hasattr(_op, o)])(
        _binary(_m, compare=True))
for _op, _m in [(aten.exp, "exp"), (aten.log, "log"), (aten.sqrt, "sqrt"), (aten.rsqrt, "rsqrt"),
                (aten.reciprocal, "reciprocal"), (aten.sin, "sin"), (aten.cos, "cos"), (aten.tanh, "tanh"),
                (aten.sigmoid, "sigmoid"), (aten.relu, "relu"), (aten.silu, "silu"), (aten.erf, "erf"),
                (aten.neg, "neg"), (aten.abs, "abs"), (aten.floor, "floor"), (aten.ceil, "ceil"),
                (aten.logical_not, "logical_not")]:
    translates(_op.default)(_unary(_m))


@translates(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(cx: Ctx, x: Any, other: Any, alpha: Any = 1) -> Any:
    x, other = cast_to(cx, x, cx.dtype), cast_to(cx, other, cx.dtype)
    return cx.g.sub(other, x if alpha == 1 else cx.g.mul(x, alpha))


@translates(aten.div.Tensor_mode, aten.div.Scalar_mode,
            supports=lambda n: None if n.kwargs.get("rounding_mode") == "floor" else "rounding_mode other than floor")
def _div_floor(cx: Ctx, a: Any, b: Any, *, rounding_mode: str) -> Any:
    return cx.g.floor(cx.g.div(cast_to(cx, a, cx.dtype), cast_to(cx, b, cx.dtype)))


@translates(aten.gelu.default)
def _gelu(cx: Ctx, x: Any, approximate: str = "none") -> Any:
    return cx.g.gelu(x, approximate=approximate)


@translates(aten.leaky_relu.default)
def _leaky_relu(cx: Ctx, x: Any, negative_slope: float = 0.01) -> Any:
    return cx.g.leaky_relu(x, negative_slope)


@translates(aten.elu.default, supports=lambda n: None if all(a == 1 for a in n.args[2:4]) else "elu scales")
def _elu(cx: Ctx, x: Any, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> Any:
    return cx.g.elu(x, alpha)


@translates(aten.softplus.default)
def _softplus(cx: Ctx, x: Any, beta: float = 1.0, threshold: float = 20.0) -> Any:
    return cx.g.softplus(x, beta, threshold)


@translates(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(cx: Ctx, cond: Any, a: Any, b: Any) -> Any:
    return cx.g.where(cast_to(cx, cond, "bool"), cast_to(cx, a, cx.dtype), cast_to(cx, b, cx.dtype))


@translates(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default)
def _clamp(cx: Ctx, x: Any, lo: Any = None, hi: Any = None) -> Any:
    if cx.node.target is aten.clamp_max.default:
        lo, hi = None, lo
    if cx.node.target is aten.hardtanh.default:
        lo = -1.0 if lo is None else lo
        hi = 1.0 if hi is None else hi
    y = cast_to(cx, x, cx.dtype)
    if lo is not None:
        y = cx.g.maximum(y, lo)
    if hi is not None:
        y = cx.g.minimum(y, hi)
    return y


@translates(aten._to_copy.default, prims.convert_element_type.default, aten.to.dtype)
def _to_copy(cx: Ctx, x: Any, dtype: Any = None, **kwargs: Any) -> Any:
    return cast_to(cx, x, cx.dtype)


@translates(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default, aten.detach.default,
            aten.contiguous.default)
def _identity(cx: Ctx, x: Any, **kwargs: Any) -> Any:
    return x


@translates(aten.scalar_tensor.default)
def _scalar_tensor(cx: Ctx, value: Any, **kwargs: Any) -> Any:
    return cx.g.constant(torch.tensor(value, dtype=cx.val.dtype))


@translates(aten.full.default, aten.zeros.default, aten.ones.default)
def _full(cx: Ctx, size: Any, value: Any = None, **kwargs: Any) -> Any:
    if cx.node.target is aten.zeros.default:
        value = 0
    elif cx.node.target is aten.ones.default:
        value = 1
    return _full_constant(cx, value, cx.shape, cx.dtype)


@translates(aten.full_like.default, aten.zeros_like.default, aten.ones_like.default)
def _full_like(cx: Ctx, x: Any, value: Any = None, **kwargs: Any) -> Any:
    if cx.node.target is aten.zeros_like.default:
        value = 0
    elif cx.node.target is aten.ones_like.default:
        value = 1
    return _full_constant(cx, value, cx.shape, cx.dtype)


# ---------------- reductions ----------------

@translates(aten.sum.dim_IntList, aten.sum.default)
def _sum(cx: Ctx, x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    return cx.g.sum(cast_to(cx, x, cx.dtype), _dims(dim, len(x.shape)), keepdim)


@translates(aten.mean.dim, aten.mean.default)
def _mean(cx: Ctx, x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    return cx.g.mean(cast_to(cx, x, cx.dtype), _dims(dim, len(x.shape)), keepdim)


@translates(aten.amax.default, aten.amin.default)
def _amax(cx: Ctx, x: Any, dim: Any = (), keepdim: bool = False) -> Any:
    method = cx.g.amax if cx.node.target is aten.amax.default else cx.g.min
    return method(x, _dims(dim, len(x.shape)), keepdim)


@translates(aten.var.correction, aten.var.dim)
def _var(cx: Ctx, x: Any, dim: Any = None, *args: Any, correction: Any = None, keepdim: bool = False,
         unbiased: Any = None) -> Any:
    if cx.node.target is aten.var.dim:  # var.dim(self, dim, unbiased=True, keepdim=False)
        unbiased = args[0] if args else (True if unbiased is None else unbiased)
        keepdim = args[1] if len(args) > 1 else keepdim
        correction = 1 if unbiased else 0
    correction = 1 if correction is None else correction
    return cx.g.var(x, _dims(dim, len(x.shape)), keepdim, int(correction))


@translates(aten._softmax.default)
def _softmax(cx: Ctx, x: Any, dim: int, half_to_float: bool) -> Any:
    return cx.g.softmax(x, dim, dtype=cx.dtype if half_to_float else None)


@translates(aten._log_softmax.default)
def _log_softmax(cx: Ctx, x: Any, dim: int, half_to_float: bool) -> Any:
    return cx.g.log_softmax(x, dim, dtype=cx.dtype if half_to_float else None)


# ---------------- views and indexing ----------------

@translates(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
            aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.flatten.using_ints)
def _reshape(cx: Ctx, x: Any, *args: Any) -> Any:
    return _reshape_to(cx, x)


@translates(aten.permute.default)
def _permute(cx: Ctx, x: Any, dims: Sequence[int]) -> Any:
    return cx.g.permute(x, tuple(d % len(x.shape) for d in dims))


@translates(aten.transpose.int)
def _transpose(cx: Ctx, x: Any, dim0: int, dim1: int) -> Any:
    return cx.g.transpose(x, dim0, dim1)


@translates(aten.t.default, aten.numpy_T.default)
def _t(cx: Ctx, x: Any) -> Any:
    return x if len(x.shape) < 2 else cx.g.transpose(x, 0, 1)


@translates(aten.expand.default)
def _expand(cx: Ctx, x: Any, size: Any, *, implicit: bool = False) -> Any:
    if len(x.shape) < len(cx.shape):  # expand adds leading dims; fusegraph's expand keeps the rank
        x = cx.g.reshape(x, (1,) * (len(cx.shape) - len(x.shape)) + tuple(x.shape))
    return x if tuple(x.shape) == cx.shape else cx.g.expand(x, cx.shape)


@translates(aten.slice.Tensor)
def _slice(cx: Ctx, x: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Any:
    size = x.shape[dim]
    if (start in (None, 0)) and (end is None or end >= size) and step == 1:
        return x
    return cx.g.slice(x, dim, start, None if end is None else min(end, size), step)


@translates(aten.select.int)
def _select(cx: Ctx, x: Any, dim: int, index: int) -> Any:
    index = index + x.shape[dim] if index < 0 else index
    return _reshape_to(cx, cx.g.slice(x, dim, index, index + 1, 1))


@translates(aten.cat.default)
def _cat(cx: Ctx, tensors: Sequence[Any], dim: int = 0) -> Any:
    parts = [cast_to(cx, t, cx.dtype) for t in tensors if math.prod(t.shape) > 0 or len(t.shape) > 1]
    return parts[0] if len(parts) == 1 else cx.g.cat(parts, dim)


@translates(aten.embedding.default)
def _embedding(cx: Ctx, weight: Any, indices: Any, padding_idx: int = -1, scale_grad_by_freq: bool = False,
               sparse: bool = False) -> Any:
    return cx.g.embedding(indices, weight)


@translates(aten.index_select.default)
def _index_select(cx: Ctx, x: Any, dim: int, index: Any) -> Any:
    return cx.g.index_select(x, dim, index)


@translates(aten.gather.default, supports=lambda n: "sparse_grad gather" if n.kwargs.get("sparse_grad") else None)
def _gather(cx: Ctx, x: Any, dim: int, index: Any, *, sparse_grad: bool = False) -> Any:
    return cx.g.gather(x, dim, index)


@translates(aten.constant_pad_nd.default)
def _pad(cx: Ctx, x: Any, pad: Sequence[int], value: float = 0.0) -> Any:
    return cx.g.pad(x, tuple(pad), value=float(value))


@translates(aten.split_with_sizes.default, aten.split.Tensor)
def _split(cx: Ctx, x: Any, sizes: Any, dim: int = 0) -> Any:
    size = x.shape[dim]
    if isinstance(sizes, int):  # split.Tensor: equal chunks of `sizes` (the last may be shorter)
        sizes = [min(sizes, size - start) for start in range(0, size, sizes)]
    out, start = [], 0
    for length in sizes:
        out.append(x if length == size else cx.g.slice(x, dim, start, start + length, 1))
        start += length
    return tuple(out)


@translates(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(cx: Ctx, *args: Any, **kwargs: Any) -> Any:
    start, step = (0, 1) if cx.node.target is aten.arange.default else (args[0], args[2] if len(args) > 2 else 1)
    index = cx.g.iota(cx.shape, 0, cx.dtype)
    if step != 1:
        index = cx.g.mul(index, step)
    return index if start == 0 else cx.g.add(index, start)


@translates(aten.bitwise_not.default, supports=lambda n: _bool_only(n))
def _bitwise_not(cx: Ctx, x: Any) -> Any:
    return cx.g.logical_not(x)


@translates(aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, supports=lambda n: _bool_only(n))
def _bitwise_binary(cx: Ctx, a: Any, b: Any) -> Any:
    return (cx.g.logical_and if cx.node.target is aten.bitwise_and.Tensor else cx.g.logical_or)(a, b)


def _bool_only(node: torch.fx.Node) -> str | None:
    val = node.meta.get("val")
    return None if isinstance(val, torch.Tensor) and val.dtype == torch.bool else "bitwise op on integers"


@translates(aten.copy.default)
def _copy(cx: Ctx, dst: Any, src: Any, non_blocking: bool = False) -> Any:
    """Functional copy: src broadcast to dst's shape, in dst's dtype."""
    src = cast_to(cx, src, cx.dtype)
    if len(src.shape) < len(cx.shape):
        src = cx.g.reshape(src, (1,) * (len(cx.shape) - len(src.shape)) + tuple(src.shape))
    return src if tuple(src.shape) == cx.shape else cx.g.expand(src, cx.shape)


@translates(aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
            aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.empty_like.default)
def _new_filled(cx: Ctx, *args: Any, **kwargs: Any) -> Any:
    """Fresh tensors; `empty` is given zeros (its values are unspecified)."""
    value: Any = 0
    if cx.node.target is aten.new_ones.default:
        value = 1
    elif cx.node.target is aten.new_full.default:
        value = args[2]
    return _full_constant(cx, value, cx.shape, cx.dtype)


@translates(aten.max.dim, aten.min.dim,
            supports=lambda n: None if node_users_only_first(n) else "the indices of max/min are read")
def _max_dim(cx: Ctx, x: Any, dim: int, keepdim: bool = False) -> Any:
    reduce = cx.g.amax if cx.node.target is aten.max.dim else cx.g.min
    return (reduce(x, (dim % len(x.shape),), keepdim), None)


@translates(aten.sign.default, supports=lambda n: None if _is_float_node(n) else "sign of an integer tensor")
def _sign(cx: Ctx, x: Any) -> Any:
    return cx.g.where(cx.g.gt(x, 0.0), 1.0, cx.g.where(cx.g.lt(x, 0.0), -1.0, cx.g.mul(x, 0.0)))


def _is_float_node(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


@translates(aten.linalg_vector_norm.default,
            supports=lambda n: None if (n.args[1] if len(n.args) > 1 else n.kwargs.get("ord", 2)) == 2
            and not n.kwargs.get("dtype") else "a norm other than the 2-norm")
def _vector_norm(cx: Ctx, x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    return cx.g.norm2(x, _dims(dim, len(x.shape)), keepdim)


def native_ops() -> set[Any]:
    """The overload packets that are translated natively (not to be decomposed by AOTAutograd)."""
    return {op.overloadpacket for op in TRANSLATORS if hasattr(op, "overloadpacket")}


def translate_node(cx: Ctx, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Run the node's translator and reconcile its result with the node's fake value (dtype casts;
    a wrong shape is a translator bug and raises, which sends the partition to eager)."""
    fn = TRANSLATORS.get(cx.node.target)
    if fn is None:
        raise UnsupportedError(f"no translator for {cx.node.target}")
    out = fn(cx, *args, **kwargs)
    if isinstance(out, tuple):
        vals = cx.val
        return tuple(_reconcile(cx, o, v) if o is not None and isinstance(v, torch.Tensor) else o
                     for o, v in zip(out, vals, strict=False))
    return _reconcile(cx, out, cx.val)


def _reconcile(cx: Ctx, out: Any, val: torch.Tensor) -> Any:
    if not _is_tensor(out):
        return out
    if tuple(out.shape) != tuple(val.shape):
        raise UnsupportedError(f"translation of {cx.node.target} ({cx.node.name}) gave shape {tuple(out.shape)}, "
                               f"torch says {tuple(val.shape)}")
    return cast_to(cx, out, dtypes.canonical(val.dtype))


# Translators of neural-network ops (norms, matmul, conv, attention, losses, pooling) register on import.
from . import torch_ops_nn  # noqa: E402, F401
