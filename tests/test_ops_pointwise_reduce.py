"""Op table for the elementwise ops, reductions and softmax: each case built through fg.Graph, run by
the reference executor AND compiled by build() (generated Triton under the interpreter), compared
with independent float64 torch; plus a check that every registered op has a row in some op table."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusegraph as fg
from conftest import assert_close
from fusegraph.ir.registry import all_ops
from optable import OpCase, make, params, run_case


def positive(*shape: int, transpose: tuple[int, int] | None = None):  # type: ignore[no-untyped-def]
    base = make(*shape, transpose=transpose)
    return lambda dtype: base(dtype).abs() + 0.25


def boolean(*shape: int):  # type: ignore[no-untyped-def]
    base = make(*shape)
    return lambda dtype: base(torch.float32) > 0


X = make(7, 33)                       # odd sizes
XT = make(9, 5, transpose=(0, 1))     # non-contiguous (a transposed view)
ROW = make(33)                        # broadcast along rows
COL = make(7, 1)                      # broadcast along columns

_UNARY = {
    "neg": (lambda x: -x, X), "abs": (torch.abs, XT), "exp": (torch.exp, X), "log": (torch.log, positive(7, 33)),
    "sqrt": (torch.sqrt, positive(9, 5, transpose=(0, 1))), "rsqrt": (torch.rsqrt, positive(7, 33)),
    "reciprocal": (torch.reciprocal, positive(7, 33)), "sin": (torch.sin, X), "cos": (torch.cos, XT),
    "tanh": (torch.tanh, X), "sigmoid": (torch.sigmoid, X), "relu": (torch.relu, XT), "silu": (F.silu, X),
    "erf": (torch.erf, X), "floor": (torch.floor, X), "ceil": (torch.ceil, XT),
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
    "minimum": torch.minimum,
}
_COMPARE = {"eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge}

POINTWISE = (
    [OpCase(f"{name}", [maker], (lambda n: lambda g, x: getattr(g, n)(x))(name), (lambda f: lambda x: f(x))(fn))
     for name, (fn, maker) in _UNARY.items()]
    + [OpCase(f"{name}_bcast_row", [X, ROW], (lambda n: lambda g, a, b: getattr(g, n)(a, b))(name),
              (lambda f: lambda a, b: f(a, b))(fn)) for name, fn in _BINARY.items()]
    + [OpCase(f"{name}_bcast_col_noncontig", [make(7, 9, transpose=(0, 1)), make(7, 1)],
              (lambda n: lambda g, a, b: getattr(g, n)(b, a))(name), (lambda f: lambda a, b: f(b, a))(fn))
       for name, fn in _BINARY.items()]
    + [OpCase(f"{name}_scalar", [X], (lambda n: lambda g, a: getattr(g, n)(a, 0.5))(name),
              (lambda f: lambda a: f(a, torch.tensor(0.5, dtype=torch.float64)))(fn))
       for name, fn in _BINARY.items()]
    + [OpCase("pow", [positive(7, 33), ROW], lambda g, a, b: g.pow(a, b), torch.pow),
       OpCase("gelu_erf", [X], lambda g, x: g.gelu(x), lambda x: F.gelu(x)),
       OpCase("gelu_tanh", [XT], lambda g, x: g.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
       OpCase("softplus", [X], lambda g, x: g.softplus(x, beta=2.0, threshold=3.0),
              lambda x: F.softplus(x, beta=2.0, threshold=3.0)),
       OpCase("elu", [X], lambda g, x: g.elu(x, alpha=0.7), lambda x: F.elu(x, alpha=0.7)),
       OpCase("leaky_relu", [XT], lambda g, x: g.leaky_relu(x, 0.2), lambda x: F.leaky_relu(x, 0.2)),
       OpCase("cast_to_float32", [X], lambda g, x: g.cast(x, "float32"), lambda x: x.float()),
       OpCase("where_bcast", [boolean(7, 33), X, ROW], lambda g, c, a, b: g.where(c, a, b), torch.where),
       OpCase("logical_ops", [boolean(7, 33), boolean(33)],
              lambda g, a, b: (g.logical_and(a, b), g.logical_or(a, b), g.logical_not(a)),
              lambda a, b: (a & b, a | b, ~a))]
    + [OpCase(f"{name}_bcast", [X, ROW], (lambda n: lambda g, a, b: getattr(g, n)(a, b))(name),
              (lambda f: lambda a, b: f(a, b))(fn)) for name, fn in _COMPARE.items()]
)

REDUCTIONS = [
    OpCase("sum_last", [X], lambda g, x: g.sum(x, -1), lambda x: x.sum(-1)),
    OpCase("sum_all_noncontig", [XT], lambda g, x: g.sum(x), lambda x: x.sum()),
    OpCase("sum_first_keepdim", [X], lambda g, x: g.sum(x, 0, keepdim=True), lambda x: x.sum(0, keepdim=True)),
    OpCase("mean_dims", [make(3, 5, 7)], lambda g, x: g.mean(x, (0, 2)), lambda x: x.mean((0, 2))),
    OpCase("max_last", [X], lambda g, x: g.max(x, -1), lambda x: x.amax(-1)),
    OpCase("min_first_noncontig", [XT], lambda g, x: g.min(x, 0), lambda x: x.amin(0)),
    OpCase("amax_keepdim", [make(4, 6, 5)], lambda g, x: g.amax(x, 1, keepdim=True),
           lambda x: x.amax(1, keepdim=True)),
    OpCase("var_unbiased", [X], lambda g, x: g.var(x, -1), lambda x: x.var(-1)),
    OpCase("var_biased_cols", [XT], lambda g, x: g.var(x, 0, correction=0), lambda x: x.var(0, correction=0)),
    OpCase("norm2_last", [X], lambda g, x: g.norm2(x, -1), lambda x: torch.linalg.vector_norm(x, dim=-1)),
    OpCase("softmax_last", [X], lambda g, x: g.softmax(x, -1), lambda x: torch.softmax(x, -1)),
    OpCase("softmax_first_noncontig", [XT], lambda g, x: g.softmax(x, 0), lambda x: torch.softmax(x, 0)),
    OpCase("log_softmax_last", [X], lambda g, x: g.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1)),
]

# float16/bfloat16 outputs of reductions over 33+ values accumulate rounding; softmax-like ops keep 2e-2.
_TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
for _case in REDUCTIONS:
    _case.tol.update(_TOL)
for _case in POINTWISE:
    if _case.id in ("pow", "softplus") or _case.id.startswith(("div", "reciprocal")):
        _case.tol.update({torch.float16: 5e-3, torch.bfloat16: 2e-2})


@torch.no_grad()
def _run_built(case: OpCase, dtype: torch.dtype) -> None:
    """The same case compiled by build(): fused generated kernels (Triton interpreter on CPU)."""
    tensors = [m(dtype) for m in case.makers]
    g = fg.Graph(name=f"built_{case.id}")
    handles = [g.tensor_like(t, name=f"in{k}") for k, t in enumerate(tensors)]
    built = case.build(g, *handles)
    outs = built if isinstance(built, tuple) else (built,)
    for o in outs:
        o.set_output()
    plan = g.build(device="cpu")
    got = plan(*tensors)
    got = got if isinstance(got, tuple) else (got,)
    expected = case.expect(*(t.double() if t.is_floating_point() else t for t in tensors))
    expected = expected if isinstance(expected, tuple) else (expected,)
    for k, (out, want) in enumerate(zip(got, expected, strict=True)):
        if out.is_floating_point():
            assert_close(out, want, tol=case.tol.get(out.dtype), what=f"built {case.id} output {k} ({dtype})")
        else:
            assert torch.equal(out, want.to(out.dtype)), f"built {case.id} output {k}: values differ"


import pytest  # noqa: E402


@pytest.mark.parametrize(("case", "dtype"), params(POINTWISE + REDUCTIONS))
def test_reference(case: OpCase, dtype: torch.dtype) -> None:
    run_case(case, dtype)


@pytest.mark.parametrize(("case", "dtype"), params(POINTWISE + REDUCTIONS))
def test_built(case: OpCase, dtype: torch.dtype) -> None:
    _run_built(case, dtype)


def _table_ops() -> set[str]:
    from test_ops_layout import LAYOUT
    from test_ops_linalg_conv_attn import ATTENTION, CONV, LINALG
    from test_ops_norm_loss_quant import LOSSES, NORM_BACKWARD, NORMS, QUANT, RANDOM_AND_INDEX
    from test_ops_scatter import SCATTER

    ops: set[str] = set()
    for case in (POINTWISE + REDUCTIONS + LAYOUT + LINALG + CONV + ATTENTION + NORMS + NORM_BACKWARD + LOSSES
                 + RANDOM_AND_INDEX + QUANT + SCATTER):
        tensors = [m(case.dtypes[0]) for m in case.makers]
        g = fg.Graph(name=case.id)
        handles = [g.tensor_like(t, name=f"in{k}") for k, t in enumerate(tensors)]
        built = case.build(g, *handles)
        for o in built if isinstance(built, tuple) else (built,):
            o.set_output()
        ops |= {n.op for n in g.to_ir().nodes}
    return ops


def test_every_registered_op_has_a_table_row() -> None:
    plumbing = {"input", "scalar", "constant", "getitem"}
    # ops named test_* are registered by other test modules (test_ir, test_passes) in the same process
    missing = sorted(op for op in set(all_ops()) - plumbing - _table_ops() if not op.startswith("test_"))
    assert not missing, f"ops without a row in any op table: {missing}"
