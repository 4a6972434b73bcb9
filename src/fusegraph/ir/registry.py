"""The one op registry. Every op is one OpDef: signature, shape/dtype rule, reference
implementation (torch), cost, properties, and optionally a Triton expression and a decomposition.

Passes never name ops: they ask properties (`POINTWISE in op.props`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsupportedError
from .node import Attrs
from .spec import TensorSpec

# Properties passes query.
POINTWISE = "pointwise"            # out[i] depends on in[i] only (with broadcasting)
REDUCTION = "reduction"            # reduces attrs["dims"] of its single input
LAYOUT_TRANSPARENT = "layout_transparent"  # commutes with a permutation of dims (pointwise ops)
COMMUTATIVE = "commutative"
ASSOCIATIVE = "associative"
IDEMPOTENT = "idempotent"          # f(f(x)) == f(x)
INVOLUTION = "involution"          # f(f(x)) == x
VIEW = "view"                      # reshape/permute/...: moves no data when folded into indexing
COMPOSITE = "composite"            # has a decomposition into simpler registered ops
RANDOM = "random"                  # not pure: never CSE'd or folded
SOURCE = "source"                  # input / constant: no inputs
MATMUL = "matmul"                  # tensor-core work
NO_UPCAST = "no_upcast"            # reference sees its inputs' own dtypes (not compute_dtype)
WRITES_INPUT = "writes_input"      # writes into its first input's memory and returns it (no bytes of its own)

InferFn = Callable[[Sequence[TensorSpec], Attrs], "TensorSpec | tuple[TensorSpec, ...]"]
RefFn = Callable[..., Any]


@dataclass(frozen=True)
class Cost:
    bytes: int      # minimum bytes moved through device memory: inputs read once, outputs written once
    flops: int

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.bytes + other.bytes, self.flops + other.flops)


CostFn = Callable[[Sequence[TensorSpec], Sequence[TensorSpec], Attrs], Cost]


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: InferFn
    reference: RefFn                       # (list[torch.Tensor], Attrs) -> Tensor | tuple
    num_inputs: tuple[int, int] = (1, 1)   # (min, max) inputs; max -1 = unbounded
    props: frozenset[str] = frozenset()
    flops_per_element: float = 0.0         # for the default cost: per output element
    cost_fn: CostFn | None = None
    triton: Callable[..., str] | None = None   # pointwise: (args: list[str], attrs) -> Triton expr
    decompose: Callable[..., Any] | None = None  # (builder, inputs, attrs) -> node(s) of simpler ops
    doc: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def cost(self, in_specs: Sequence[TensorSpec], out_specs: Sequence[TensorSpec], attrs: Attrs) -> Cost:
        if self.cost_fn is not None:
            return self.cost_fn(in_specs, out_specs, attrs)
        nbytes = sum(s.nbytes for s in in_specs) + sum(s.nbytes for s in out_specs)
        flops = int(self.flops_per_element * sum(s.numel for s in out_specs))
        return Cost(nbytes, flops)

    def has(self, prop: str) -> bool:
        return prop in self.props


_OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in _OPS:
        raise ValueError(f"op {op.name!r} registered twice")
    _OPS[op.name] = op
    return op


def define(name: str, infer: InferFn, reference: RefFn, **kw: Any) -> OpDef:
    """Register an op in one call: `define("exp", same_shape, lambda xs, a: torch.exp(xs[0]), ...)`."""
    if "props" in kw:
        kw["props"] = frozenset(kw["props"])
    return register(OpDef(name=name, infer=infer, reference=reference, **kw))


def get_op(name: str) -> OpDef:
    _ensure_loaded()
    try:
        return _OPS[name]
    except KeyError:
        raise UnsupportedError(f"unknown op {name!r}") from None


def all_ops() -> dict[str, OpDef]:
    _ensure_loaded()
    return dict(_OPS)


_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:  # an import statement per lookup costs microseconds; passes look ops up per node
        from .. import ops  # noqa: F401  (importing registers every op)
        _loaded = True
