"""Algebraic simplification: one rewrite table of `(pattern, fn)` rules, tinygrad-style.

A rule fires when its pattern matches a node; `fn` returns the replacement (an existing node or
a new one) or None to decline. Every replacement is checked to have the node's shape and dtype,
so a rule can never change a graph's types, only remove work.

What counts as "exact" here (each rule says which it relies on):
- x*1, 1*x, x/1, x-0 are bit-exact for every value, inf and nan included.
- x+0 -> x is exact except that -0.0 + 0.0 is +0.0: like XLA's algebraic simplifier we do not
  treat the sign of a zero as meaningful. x*0 -> 0 is NOT done for floats (inf*0 and nan*0 are nan,
  -1*0 is -0.0); it is done for integer and bool results, where it is exact.
- f(f(x)) -> x for INVOLUTION ops: exact for neg and logical_not; for reciprocal the result is
  the mathematically exact x, where two divisions would round twice (and over/underflow for
  extreme x), so the rewrite changes bits only towards the true value.
- f(f(x)) -> f(x) for IDEMPOTENT unary ops, f(x, x) -> x for IDEMPOTENT binary ops, and
  where(c, x, x) -> x: exact.
- cast(x, x.dtype) -> x, and cast(cast(x, a), b) -> cast(x, b) only when x -> a is lossless (every
  value of x's dtype is exactly representable in a) AND the remaining conversion depends only on
  the value: a -> b lossless too, or b is x's own dtype, or b is bool, or all three dtypes are
  floats (round-to-nearest of an exact value), or all three are integers (wrap-around is modular).
- Layout compositions (permute/transpose/reshape chains, reshape/expand to the input's own
  shape, a transpose folded into matmul's trans_a/trans_b) only move data, so they are exact.
- A sum/max/min over a reshape that only merges dims, each merged run wholly reduced or wholly
  kept, reduces the reshape's input instead: sum(reshape(g, [B*T, C]), 0) -> sum(g, (0, 1)), its
  result reshaped. The same elements are combined (a sum may add them in another order). The
  reduction then has its producer's (finer) iteration space, so a linear layer's bias gradient
  can share the pass of the kernel that computes its input (fusion/partition.py pairs rows with
  columns). A cast between the two moves along (sum(cast(reshape(g))) -> sum(cast(g))). A reshape
  that splits dims is left alone: the finer space is already the reduction's.
- A comparison whose operands' bounds decide it everywhere is a literal bool: bounds come from
  iotas (0 .. n-1), literals, views, lossless casts, sums, differences and products (value_range);
  `arange(S)[:, None] >= 0`, the all-true attention mask a traced Hugging Face model builds, is True.
  where(c, x, y) with a literal c is x or y (broadcast to the result), and x + z with z a zero
  broadcast and/or cast is x. Exact (the last as x+0 above).
- 1 + tanh(u) -> 2 * sigmoid(2u): an identity of the real functions, not of their roundings. It is
  cheaper (one exponential and one reciprocal where a tanh takes a series or an exponential and a
  division) and closer to the true value (for u -> -inf the sum cancels, the product does not; in a
  16-bit dtype one rounding instead of two). The tanh form of GELU (GPT-2's, spelled out in Python)
  becomes 0.5 x * 2 sigmoid(2u), the form our gelu op computes (x sigmoid(2u)); in a GEMM epilogue
  the gelu op ran at 72 us where the spelled-out form took 101 (bench/results/gluon_gemm_fc_forms_20261203.txt;
  in GPT-2's step profile the forward GELU kernel went 32 -> 31 us: bench/results/profile_targets_20261203_0210.txt,
  profile_gpt2_ranges_20261203.txt).
  Likewise 1 - tanh(u)^2 (tanh's derivative, in the backward) -> 4 s (1 - s) with s = sigmoid(2u), the
  same node as the forward's form recomputed in the backward: the kernel computes one exponential and one
  reciprocal for both and no tanh (GELU's backward is near compute-bound: two sigmoids cost more). For
  u <= 0 the product keeps its relative accuracy where 1 - t*t cancels (|t| -> 1); for u > 0 it
  cancels as 1 - t*t does (1 - s from s rounded: absolute error a few ulp of 1).
Rules that name ops need those ops registered; a rule about an unregistered op never matches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FusegraphError, UnsupportedError
from ..ir import dtypes
from ..ir.emit import Emitter
from ..ir.graph import Graph, map_nodes
from ..ir.node import Attrs, Node
from ..ir.registry import COMMUTATIVE, IDEMPOTENT, INVOLUTION, POINTWISE, get_op
from ..settings import settings
from .base import graph_pass

MAX_REWRITES_PER_NODE = 16     # a bound on rule chains at one node (each rule removes work)
ZEROS_MAX_ELEMENTS = 1 << 16   # without `expand`, x*0 for integers becomes a constant up to this size


# ---------------------------------------------------------------- patterns
@dataclass(frozen=True)
class Pat:
    """Matches a node by op name(s) and/or property and, optionally, its inputs' patterns; binds
    the matched node to `name` (a rule's fn gets the root as `node` and the bound names).
    Inputs of COMMUTATIVE ops are also tried in the swapped order."""

    op: tuple[str, ...] | None = None
    prop: str | None = None
    src: tuple[Pat, ...] | None = None
    name: str | None = None
    value: float | None = None      # match a scalar/constant whose every element equals this

    def match(self, node: Node, bound: dict[str, Node] | None = None) -> dict[str, Node] | None:
        bound = dict(bound or {})
        if self.op is not None and node.op not in self.op:
            return None
        if self.prop is not None and not get_op(node.op).has(self.prop):
            return None
        if self.value is not None and literal_value(node) != self.value:
            return None
        if self.name is not None:
            if self.name in bound and bound[self.name] is not node:
                return None
            bound[self.name] = node
        if self.src is None:
            return bound
        if len(self.src) != len(node.inputs):
            return None
        orders = [node.inputs]
        if len(node.inputs) == 2 and get_op(node.op).has(COMMUTATIVE):
            orders.append(node.inputs[::-1])
        for inputs in orders:
            result: dict[str, Node] | None = bound
            for pat, inp in zip(self.src, inputs, strict=True):
                result = pat.match(inp, result) if result is not None else None
            if result is not None:
                return result
        return None


def P(op: str | tuple[str, ...] | None = None, *src: Pat, name: str | None = None, prop: str | None = None) -> Pat:
    ops = (op,) if isinstance(op, str) else op
    return Pat(op=ops, prop=prop, src=tuple(src) if src else None, name=name)


def V(name: str) -> Pat:
    """Any node, bound to `name` (the same name twice must be the same node)."""
    return Pat(name=name)


def Lit(value: float) -> Pat:
    """A scalar or constant all of whose elements equal `value`."""
    return Pat(value=value)


def literal_value(node: Node) -> float | None:
    """The value of a scalar node, or of a constant whose elements are all equal (small ones only)."""
    if node.op == "scalar":
        return float(node.attrs["value"])
    if node.op == "constant":
        value = node.attrs["value"]
        if isinstance(value, torch.Tensor) and 0 < value.numel() <= 4096:
            first = value.reshape(-1)[0]
            if bool((value == first).all()):
                return float(first.item())
    return None


# ---------------------------------------------------------------- helpers for rules
def registered(op: str) -> bool:
    try:
        get_op(op)
    except UnsupportedError:
        return False
    return True


def emitter_for(node: Node) -> Emitter:
    return Emitter(prefix=f"{node.name}.", source=node.source)


def rebuild(node: Node, op: str, inputs: Sequence[Node], **attrs: Any) -> Node | None:
    """A new node replacing `node` (same name and source), its spec inferred; None if not valid."""
    if not registered(op):
        return None
    try:
        return emitter_for(node).op(op, *inputs, _name=node.name, **attrs)  # type: ignore[no-any-return]
    except FusegraphError:
        return None


def same_type(a: Node, b: Node) -> bool:
    return len(a.specs) == len(b.specs) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a.specs, b.specs, strict=True))


def full_like(node: Node, value: float | bool) -> Node | None:
    """`value` in node's shape and dtype, reading nothing: a scalar, broadcast by `expand` when that
    op is registered (constant folding then makes small ones a constant)."""
    v = bool(value) if node.dtype == "bool" else value
    scalar = emitter_for(node).scalar(v, node.dtype)
    if node.shape == ():
        return scalar
    if registered("expand"):
        return rebuild(node, "expand", [scalar], shape=node.shape)
    if node.spec.numel > ZEROS_MAX_ELEMENTS:
        return None
    filled = torch.full(node.shape, v, dtype=dtypes.to_torch(node.dtype))
    return Node(op="constant", inputs=(), attrs=Attrs(value=filled),
                specs=(node.spec.with_(layout=None, strides=None),), name=node.name, source=node.source)


def zeros_like(node: Node) -> Node | None:
    """An exact zero of node's shape and dtype that reads nothing (see full_like)."""
    return full_like(node, 0)


def lossless(src: str, dst: str) -> bool:
    """Every value of dtype `src` is exactly representable in dtype `dst`."""
    if src == dst or src == "bool":
        return True
    if dst == "bool":
        return False
    if dtypes.is_int(src) and dtypes.is_int(dst):
        si, di = torch.iinfo(dtypes.to_torch(src)), torch.iinfo(dtypes.to_torch(dst))
        return di.min <= si.min and si.max <= di.max
    if dtypes.is_int(src) and dtypes.is_float(dst):
        s_int, f = torch.iinfo(dtypes.to_torch(src)), torch.finfo(dtypes.to_torch(dst))
        exact_up_to = 2.0 / f.eps          # every integer up to 2^(mantissa bits + 1) is exact
        return max(abs(s_int.min), s_int.max) <= min(exact_up_to, f.max)
    if dtypes.is_float(src) and dtypes.is_float(dst):
        s, d = torch.finfo(dtypes.to_torch(src)), torch.finfo(dtypes.to_torch(dst))
        s_sub, d_sub = s.smallest_normal * s.eps, d.smallest_normal * d.eps  # smallest subnormals
        return d.eps <= s.eps and d.max >= s.max and d_sub <= s_sub
    return False  # float -> int loses fractions


def _kind(dtype: str) -> str:
    return "float" if dtypes.is_float(dtype) else ("int" if dtypes.is_int(dtype) else dtype)


def cast_chain_is_exact(x: str, a: str, b: str) -> bool:
    """cast(cast(v: x, a), b) == cast(v, b) for every v (see the module docstring)."""
    if not lossless(x, a):
        return False
    return lossless(a, b) or b == x or b == "bool" or _kind(x) == _kind(a) == _kind(b) != "bool"


def permutation_of(node: Node) -> tuple[int, ...] | None:
    """The dim permutation a permute/transpose node applies (out dim i = in dim p[i])."""
    rank = node.inputs[0].spec.rank if node.inputs else 0
    if node.op == "permute" and node.attrs.get("dims") is not None:
        return tuple(int(d) % max(rank, 1) for d in node.attrs["dims"])
    if node.op == "transpose" and "dim0" in node.attrs and "dim1" in node.attrs:
        perm = list(range(rank))
        d0, d1 = int(node.attrs["dim0"]) % max(rank, 1), int(node.attrs["dim1"]) % max(rank, 1)
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return tuple(perm)
    return None


def permute_to(node: Node, x: Node, perm: tuple[int, ...]) -> Node | None:
    """x permuted by `perm` (x itself for the identity), as a replacement for `node`."""
    if perm == tuple(range(len(perm))):
        return x
    swapped = [i for i, p in enumerate(perm) if p != i]
    if len(swapped) == 2 and registered("transpose") and not registered("permute"):
        return rebuild(node, "transpose", [x], dim0=swapped[0], dim1=swapped[1])
    return rebuild(node, "permute", [x], dims=perm)


def swaps_last_two(node: Node) -> bool:
    perm = permutation_of(node) if node.op in ("permute", "transpose") else None
    rank = len(perm) if perm is not None else 0
    return perm is not None and rank >= 2 and perm == (*range(rank - 2), rank - 1, rank - 2)


# ---------------------------------------------------------------- rules
def _involution(node: Node, inner: Node, x: Node) -> Node | None:
    return x if node.op == inner.op and node.attrs == inner.attrs and len(inner.inputs) == 1 else None


def _idempotent_unary(node: Node, inner: Node, x: Node) -> Node | None:
    same = node.op == inner.op and node.attrs == inner.attrs and len(inner.inputs) == 1
    return inner if same else None


def _int_zero(node: Node, x: Node) -> Node | None:
    return zeros_like(node) if not dtypes.is_float(node.dtype) else None


def _cast_same(node: Node, x: Node) -> Node | None:
    return x if node.attrs.get("dtype") == x.dtype else None


def _cast_chain(node: Node, inner: Node, x: Node) -> Node | None:
    if not cast_chain_is_exact(x.dtype, inner.dtype, node.dtype):
        return None
    return x if node.dtype == x.dtype else rebuild(node, "cast", [x], dtype=node.dtype)


def _permute_chain(node: Node, inner: Node, x: Node) -> Node | None:
    p_inner, p_outer = permutation_of(inner), permutation_of(node)
    if p_inner is None or p_outer is None or len(p_inner) != len(p_outer):
        return None
    return permute_to(node, x, tuple(p_inner[j] for j in p_outer))


def _permute_identity(node: Node, x: Node) -> Node | None:
    perm = permutation_of(node)
    return x if perm is not None and perm == tuple(range(len(perm))) else None


def _reshape_chain(node: Node, inner: Node, x: Node) -> Node | None:
    return rebuild(node, "reshape", [x], **dict(node.attrs))  # row-major order is kept by both


def _unary_between_reshapes(node: Node, mid: Node, inner: Node, x: Node) -> Node | None:
    """reshape(f(reshape(x))) back to x's shape, f elementwise on one input, is f(x): the view
    round trip AOTAutograd leaves around a cast (`logits.float().view(-1, V)`'s backward: the gradient
    viewed [B, T, V], cast, viewed [B*T, V] again), whose reshapes would otherwise split a kernel."""
    if node.shape != x.shape or not get_op(mid.op).has(POINTWISE) or mid.multi_output:
        return None
    return rebuild(node, mid.op, [x], **dict(mid.attrs))


def _add_into_index_put(node: Node, x: Node, y: Node) -> Node | None:
    """x + index_put(zeros, values, indices, accumulate=True) is index_put(x, values, indices,
    accumulate=True): the accumulation starts from x instead of from zeros. A tied embedding's weight
    gradient (the LM head's GEMM result plus the embedding's scattered rows) then needs no zero fill
    and no add pass over the table: a copy of x and the scatter. fp32/fp64 only (the sums are
    reassociated: x + (v1 + v2) becomes (x + v1) + v2, which a 16-bit table would round differently)."""
    for a, b in ((x, y), (y, x)):
        if b.op == "index_put" and b.attrs.get("accumulate", False) and is_literal_zero(b.inputs[0]) and \
                a.shape == b.shape and a.dtype == b.dtype == node.dtype in ("float32", "float64"):
            return rebuild(node, "index_put", [a, *b.inputs[1:]], **dict(b.attrs))
    return None


def _same_shape(node: Node, x: Node) -> Node | None:
    """A reshape or expand to the shape its input already has is the input."""
    return x if node.shape == x.shape else None


def _transpose_into_matmul(node: Node, a: Node, b: Node) -> Node | None:
    inputs, attrs = [a, b], dict(node.attrs)
    for k, flag in ((0, "trans_a"), (1, "trans_b")):
        if swaps_last_two(inputs[k]):
            inputs[k] = inputs[k].inputs[0]
            attrs[flag] = not bool(attrs.get(flag, False))
    if inputs[0] is a and inputs[1] is b:
        return None
    return rebuild(node, "matmul", inputs, **attrs)


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """The dims of `src` and of `dst` (a reshape of it, same numel > 0) in matching consecutive runs
    of equal size: ([0, 1], [0]) for (B, T, C) -> (B*T, C)'s first dims. None for an empty tensor."""
    if 0 in src or 0 in dst:
        return None
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        ga, gb, pa, pb = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(i)
                pa *= src[i]
                i += 1
            else:
                gb.append(j)
                pb *= dst[j]
                j += 1
        groups.append((ga, gb))
    if groups:   # trailing size-1 dims join the last run
        groups[-1][0].extend(range(i, len(src)))
        groups[-1][1].extend(range(j, len(dst)))
    return groups


def _reduce_through_reshape(node: Node, inner: Node, x: Node, mid: Node | None = None) -> Node | None:
    """`node` reduces reshape `inner` of x (through the cast `mid`, as autocast's bias gradients
    do: sum(cast(reshape(g)))); the same reduction of x (cast first), reshaped to node's shape."""
    dims = node.attrs.get("dims")
    if dims is None or inner.shape == x.shape or not settings.share_row_pass:
        return None
    reduced = {d % max(len(inner.shape), 1) for d in ((dims,) if isinstance(dims, int) else dims)}
    groups = reshape_groups(tuple(x.shape), tuple(inner.shape))
    if groups is None:
        return None
    new_dims: list[int] = []
    for src_dims, dst_dims in groups:
        big = [d for d in dst_dims if inner.shape[d] != 1]
        if len(big) > len([d for d in src_dims if x.shape[d] != 1]):
            return None      # splits a dim of x: the reduction is over the finer space already
        hit = [d for d in big if d in reduced]
        if hit and len(hit) != len(big):
            return None      # a run that mixes reduced and kept dims: not one reduction of x
        if hit:
            new_dims.extend(src_dims)
    if not new_dims:
        return None
    attrs = {k: v for k, v in node.attrs.items() if k not in ("dims", "keepdim")}
    try:
        if mid is not None:
            x = emitter_for(mid).op(mid.op, x, **dict(mid.attrs))
        total = emitter_for(node).op(node.op, x, dims=tuple(new_dims), keepdim=False, **attrs)
    except FusegraphError:
        return None
    return rebuild(node, "reshape", [total], shape=tuple(node.shape))


def _select_through_reshape(node: Node, inner: Node, x: Node, index: Node) -> Node | None:
    """index_select(reshape(x), dim, index) where the reshape only adds or drops size-1 dims and `dim`
    is one of x's: x's rows selected, then reshaped (a mask buffer viewed [1, 1, S, S] and read at the
    decode position: the lookup then reads the buffer itself, a graph input a kernel can gather from)."""
    dim = int(node.attrs["dim"]) % max(len(inner.shape), 1)
    big_in = [d for d, size in enumerate(inner.shape) if size != 1]
    big_x = [d for d, size in enumerate(x.shape) if size != 1]
    if dim not in big_in or [inner.shape[d] for d in big_in] != [x.shape[d] for d in big_x]:
        return None
    try:
        selected = emitter_for(node).op("index_select", x, index, dim=big_x[big_in.index(dim)])
    except FusegraphError:
        return None
    return rebuild(node, "reshape", [selected], shape=tuple(node.shape))


def broadcast_literal(node: Node) -> float | None:
    """The value of every element of `node` when it is a literal (scalar or uniform constant) seen
    through expand / reshape / cast: a where's constant condition, a zero mask broadcast and cast."""
    chain: list[Node] = []
    while node.op in ("expand", "reshape", "cast") and len(node.inputs) == 1:
        chain.append(node)
        node = node.inputs[0]
    value = literal_value(node)
    if value is None:
        return None
    try:
        t = torch.tensor(value, dtype=dtypes.to_torch(node.dtype))
        for n in reversed(chain):
            if n.op == "cast":
                t = t.to(dtypes.to_torch(n.dtype))
    except (TypeError, RuntimeError, ValueError, KeyError):
        return None
    return float(t.item())


def is_literal_zero(node: Node) -> bool:
    """Every element of `node` is a literal 0 (a scalar or constant, broadcast, reshaped or cast)."""
    return broadcast_literal(node) == 0.0


RANGE_DEPTH = 12


def value_range(node: Node, depth: int = 0) -> tuple[float, float] | None:
    """Bounds (lo, hi) on every element of an index computation: an iota (0 .. n-1), a literal, their
    views, lossless casts, sums and differences, and products with a literal. None where unknown."""
    if depth > RANGE_DEPTH:
        return None
    value = literal_value(node)
    if value is not None:
        return (value, value) if value == value else None      # NaN bounds nothing
    if node.op == "iota":
        n = int(node.shape[int(node.attrs["dim"]) % len(node.shape)])
        return (0.0, float(n - 1)) if n > 0 else None
    if node.op in ("expand", "reshape", "permute", "transpose") and node.inputs:
        return value_range(node.inputs[0], depth + 1)
    if node.op == "cast" and lossless(node.inputs[0].dtype, node.dtype) and node.dtype != "bool":
        return value_range(node.inputs[0], depth + 1)
    if node.op in ("add", "sub", "mul") and len(node.inputs) == 2 and node.dtype != "bool":
        a, b = (value_range(i, depth + 1) for i in node.inputs)
        if a is None or b is None:
            return None
        if node.op == "add":
            lo, hi = a[0] + b[0], a[1] + b[1]
        elif node.op == "sub":
            lo, hi = a[0] - b[1], a[1] - b[0]
        else:
            products = [x * y for x in a for y in b]
            lo, hi = min(products), max(products)
        # exact in the result dtype: integers inside the type's range (no wrap-around, unsigned
        # types included), floats within the integers they hold exactly
        if dtypes.is_int(node.dtype):
            info = torch.iinfo(dtypes.to_torch(node.dtype))
            return (lo, hi) if info.min <= lo and hi <= info.max and max(abs(lo), abs(hi)) <= 2.0 ** 53 else None
        # floats: integers only (a fractional literal rounds in the result's dtype), within the
        # integers the dtype holds exactly
        exact = all(float(v).is_integer() for v in (*a, *b))
        limit = 1.0 / torch.finfo(dtypes.to_torch(node.dtype)).eps
        return (lo, hi) if exact and max(abs(lo), abs(hi)) <= limit else None
    return None


def _exact_in(bounds: tuple[float, float], *dtype_names: str) -> bool:
    """Both bounds are integers every float dtype named (and float32, where a Python scalar meets an
    integer tensor) holds exactly, so the comparison sees these values, not roundings of them."""
    floats = [d for d in (*dtype_names, "float32") if dtypes.is_float(d)]
    limit = min(1.0 / torch.finfo(dtypes.to_torch(d)).eps for d in floats)
    return all(float(v).is_integer() and abs(v) <= limit for v in bounds)


_DECIDE = {
    "ge": lambda a, b: True if a[0] >= b[1] else (False if a[1] < b[0] else None),
    "gt": lambda a, b: True if a[0] > b[1] else (False if a[1] <= b[0] else None),
    "le": lambda a, b: True if a[1] <= b[0] else (False if a[0] > b[1] else None),
    "lt": lambda a, b: True if a[1] < b[0] else (False if a[0] >= b[1] else None),
    "eq": lambda a, b: True if a[0] == a[1] == b[0] == b[1] else (False if a[1] < b[0] or b[1] < a[0] else None),
    "ne": lambda a, b: False if a[0] == a[1] == b[0] == b[1] else (True if a[1] < b[0] or b[1] < a[0] else None),
}


def _decided_compare(node: Node, x: Node, y: Node) -> Node | None:
    """A comparison that the bounds of its operands decide for every element (an attention mask
    built as `q_idx >= 0` over an arange) is that constant: True/False broadcast."""
    if literal_value(x) is not None and literal_value(y) is not None:
        return None        # two literals: constant folding's job
    a, b = value_range(x), value_range(y)
    if a is None or b is None or not (_exact_in(a, x.dtype, y.dtype) and _exact_in(b, x.dtype, y.dtype)):
        return None
    decided = _DECIDE[node.op](a, b)
    return None if decided is None else full_like(node, decided)


def _broadcast_to(node: Node, x: Node) -> Node | None:
    """x as a replacement for `node` (same dtype), broadcast to node's shape when it is smaller."""
    if x.dtype != node.dtype:
        return None
    return x if x.shape == node.shape else rebuild(node, "expand", [x], shape=node.shape)


def _where_literal(node: Node, cond: Node, x: Node, y: Node) -> Node | None:
    """where(c, x, y) with a condition that is the same literal everywhere picks x or y."""
    value = broadcast_literal(cond)
    return None if value is None else _broadcast_to(node, x if value else y)


def _add_broadcast_zero(node: Node, x: Node, z: Node) -> Node | None:
    """x + 0 where the zero is broadcast and/or cast (an all-true mask's additive form, 0 or -inf,
    after the condition was decided): x, when x already has the result's shape and dtype."""
    if z.op in ("scalar", "constant") or not is_literal_zero(z):
        return None
    return x if x.shape == node.shape and x.dtype == node.dtype else None


def _sigmoid_2u(node: Node, t: Node, u: Node) -> tuple[Emitter, Node] | None:
    """(emitter, sigmoid(2u)) for the tanh rules below: floats of one dtype, settings.tanh_as_sigmoid on.
    Both rules build the same sigmoid(2u) node, so CSE keeps one where both apply (GELU's backward)."""
    if not settings.tanh_as_sigmoid or not dtypes.is_float(node.dtype) or not t.dtype == u.dtype == node.dtype:
        return None
    e = emitter_for(node)
    return e, e.op("sigmoid", e.op("mul", u, e.scalar(2.0, node.dtype)))


def _one_plus_tanh(node: Node, t: Node, u: Node) -> Node | None:
    """1 + tanh(u) -> 2 * sigmoid(2 u) (see the module docstring)."""
    made = _sigmoid_2u(node, t, u)
    if made is None:
        return None
    e, sig = made
    return rebuild(node, "mul", [sig, e.scalar(2.0, node.dtype)])


def _one_minus_tanh_squared(node: Node, t: Node, u: Node) -> Node | None:
    """1 - tanh(u) * tanh(u) -> 4 s (1 - s), s = sigmoid(2u) (see the module docstring)."""
    made = _sigmoid_2u(node, t, u)
    if made is None:
        return None
    e, sig = made
    rest = e.op("sub", e.scalar(1.0, node.dtype), sig)
    return rebuild(node, "mul", [e.op("mul", sig, rest), e.scalar(4.0, node.dtype)])


VIEWS = ("permute", "transpose")
RULES: list[tuple[Pat, Callable[..., Node | None]]] = [
    # additive / multiplicative identities (x+0 ignores the sign of zero, see above)
    (P("add", V("x"), Lit(0)), lambda node, x: x),
    (P("sub", V("x"), Lit(0)), lambda node, x: x),
    (P("mul", V("x"), Lit(1)), lambda node, x: x),
    (P("div", V("x"), Lit(1)), lambda node, x: x),
    (P("mul", V("x"), Lit(0)), _int_zero),
    (P("add", P("tanh", V("u"), name="t"), Lit(1)), _one_plus_tanh),
    (P("sub", Lit(1), P("mul", P("tanh", V("u"), name="t"), P("tanh", V("u"), name="t"))), _one_minus_tanh_squared),
    # by property: f(f(x)) = x, f(f(x)) = f(x), f(x, x) = x
    (P(None, P(None, V("x"), name="inner", prop=INVOLUTION), prop=INVOLUTION), _involution),
    (P(None, P(None, V("x"), name="inner", prop=IDEMPOTENT), prop=IDEMPOTENT), _idempotent_unary),
    (P(None, V("x"), V("x"), prop=IDEMPOTENT), lambda node, x: x),
    # casts
    (P("cast", V("x")), _cast_same),
    (P("cast", P("cast", V("x"), name="inner")), _cast_chain),
    # layout
    (P(VIEWS, P(VIEWS, V("x"), name="inner")), _permute_chain),
    (P(VIEWS, V("x")), _permute_identity),
    (P("reshape", P("reshape", V("x"), name="inner")), _reshape_chain),
    (P("reshape", P(None, P("reshape", V("x"), name="inner"), name="mid", prop=POINTWISE)), _unary_between_reshapes),
    (P(("reshape", "expand"), V("x")), _same_shape),
    (P(("sum", "max", "min"), P("reshape", V("x"), name="inner")), _reduce_through_reshape),
    (P(("sum", "max", "min"), P("cast", P("reshape", V("x"), name="inner"), name="mid")), _reduce_through_reshape),
    (P("where", V("cond"), V("x"), V("x")), lambda node, cond, x: x),
    (P("where", V("cond"), V("x"), V("y")), _where_literal),
    (P(("ge", "gt", "le", "lt", "eq", "ne"), V("x"), V("y")), _decided_compare),
    (P("add", V("x"), V("z")), _add_broadcast_zero),
    (P("add", V("x"), V("y")), _add_into_index_put),
    (P("index_select", P("reshape", V("x"), name="inner"), V("index")), _select_through_reshape),
    (P("matmul", V("a"), V("b")), _transpose_into_matmul),
]


_RULES_BY_OP: dict[str, list[tuple[Pat, Callable[..., Node | None]]]] = {}


def rules_for(op: str) -> list[tuple[Pat, Callable[..., Node | None]]]:
    """The rules whose root pattern can match an `op` node (RULES' order kept; cached per op)."""
    if op not in _RULES_BY_OP:
        props = get_op(op).props
        _RULES_BY_OP[op] = [(pat, fn) for pat, fn in RULES
                            if (pat.op is None or op in pat.op) and (pat.prop is None or pat.prop in props)]
    return _RULES_BY_OP[op]


def simplify_node(node: Node) -> Node:
    """Apply rules at `node` until none fires (bounded); every replacement keeps node's type."""
    for _ in range(MAX_REWRITES_PER_NODE):
        for pattern, fn in rules_for(node.op):
            bound = pattern.match(node)
            if bound is None:
                continue
            new = fn(node, **bound)
            if new is not None and new is not node and same_type(new, node):
                node = new
                break
        else:
            return node
    return node


@graph_pass("simplify")
def simplify(graph: Graph) -> Graph:
    """Algebraic simplification by the rewrite table RULES."""
    return map_nodes(graph, lambda node: node if node.multi_output else simplify_node(node))
