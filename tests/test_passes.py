"""Each pass: node counts and ops before/after, and numerics (reference before vs after) on fresh data."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.ir import Graph as IRGraph
from fusegraph.ir.registry import RANDOM, all_ops, define
from fusegraph.passes import PIPELINE, cse, dce, fold, optimize, simplify
from fusegraph.passes.fold import fold_constants
from fusegraph.passes.simplify import cast_chain_is_exact, lossless
from fusegraph.settings import override


def ops_of(graph: IRGraph) -> Counter[str]:
    return Counter(n.op for n in graph.nodes if n.op != "input")


def feeds_for(graph: IRGraph) -> list[torch.Tensor]:
    out = []
    for n in graph.inputs:
        dtype = fg.ir.dtypes.to_torch(n.dtype)
        if dtype.is_floating_point:
            out.append(rand(*n.shape, dtype=dtype))
        elif dtype == torch.bool:
            out.append(torch.rand(n.shape) > 0.5)
        else:
            out.append(torch.randint(-50, 50, n.shape, dtype=dtype))
    return out


def same_results(before: IRGraph, after: IRGraph, tol: float | None = None) -> None:
    """The reference executor gives the same outputs before and after, on fresh random data."""
    feeds = feeds_for(before)
    outs_before = fg.reference(before)(*feeds)
    outs_after = fg.reference(after)(*feeds)
    if isinstance(outs_before, torch.Tensor):
        outs_before, outs_after = (outs_before,), (outs_after,)
    for k, (a, b) in enumerate(zip(outs_after, outs_before, strict=True)):
        assert a.dtype == b.dtype, f"output {k}: dtype {a.dtype} != {b.dtype}"
        assert_close(a, b, tol=tol, what=f"output {k}")


def outputs(g: fg.Graph, *tensors: fg.Tensor) -> IRGraph:
    for t in tensors:
        t.set_output()
    return g.to_ir()


# ---------------------------------------------------------------- dce
def test_dce_drops_nodes_no_output_needs() -> None:
    g = fg.Graph("dce")
    x = g.tensor((4, 8), name="x")
    live = g.exp(x)
    dead = g.tanh(g.sin(x))
    ir = outputs(g, live)
    with_dead = ir.with_(order=(*ir.nodes, dead.node.inputs[0], dead.node))
    assert ops_of(with_dead) == Counter({"exp": 1, "sin": 1, "tanh": 1})
    out = dce(with_dead)
    assert ops_of(out) == Counter({"exp": 1})
    assert out.inputs == ir.inputs and out.provenance[-1].name == "dce"
    assert out.provenance[-1].nodes_before == 4 and out.provenance[-1].nodes_after == 2
    same_results(with_dead, out)


# ---------------------------------------------------------------- cse
def test_cse_merges_equal_nodes_and_commuted_inputs() -> None:
    g = fg.Graph("cse")
    x, y = g.tensor((4, 8), name="x"), g.tensor((4, 8), name="y")
    a = g.add(g.exp(x), g.exp(x))          # two equal exps
    b = g.mul(x, y)
    c = g.mul(y, x)                        # commutative: same as b
    d = g.sub(x, y)
    e = g.sub(y, x)                        # not commutative: stays
    ir = outputs(g, a, g.add(b, c), g.add(d, e))
    assert ops_of(ir) == Counter({"exp": 2, "add": 3, "mul": 2, "sub": 2})
    out = cse(ir)
    assert ops_of(out) == Counter({"exp": 1, "add": 3, "mul": 1, "sub": 2})
    same_results(ir, out)


def test_cse_keeps_different_attrs_and_scalar_types_apart() -> None:
    g = fg.Graph("cse_attrs")
    x = g.tensor((4, 8), name="x")
    s0, s1 = g.sum(x, 0), g.sum(x, 1)                 # different dims
    p, n = g.add(x, 0.0), g.add(x, -0.0)              # +0.0 and -0.0 are different values
    i = g.tensor((4, 8), dtype="int32", name="i")
    ia, ib = g.mul(i, 2), g.mul(i, 2)                  # equal: merge
    ir = outputs(g, s0, s1, p, n, ia, ib)
    out = cse(ir)
    assert ops_of(out)["sum"] == 2 and ops_of(out)["add"] == 2 and ops_of(out)["mul"] == 1
    assert out.outputs[4] is out.outputs[5]
    same_results(ir, out)


def _random_op() -> str:
    name = "test_noise"
    if name not in all_ops():
        define(name, lambda specs, a: specs[0], lambda xs, a: xs[0] + torch.randn_like(xs[0]),
               props={RANDOM}, doc="test-only: x plus fresh noise")
    return name


def test_cse_never_merges_random_ops() -> None:
    op = _random_op()
    g = fg.Graph("cse_random")
    x = g.tensor((16,), name="x")
    a, b = g._apply(op, x), g._apply(op, x)
    ir = outputs(g, g.sub(a, b))
    out = cse(ir)
    assert ops_of(out)[op] == 2
    assert ops_of(fold(ir))[op] == 2


# ---------------------------------------------------------------- fold
def test_fold_evaluates_scalar_and_constant_arithmetic() -> None:
    g = fg.Graph("fold")
    x = g.tensor((4, 8), name="x")
    k = g.mul(g.add(g.constant(2.0), g.constant(3.0)), 0.5)          # 2.5, a scalar
    w = g.exp(g.constant(torch.arange(8, dtype=torch.float32) / 8))  # a constant vector
    ir = outputs(g, g.add(g.mul(x, k), w))
    assert ops_of(ir) == Counter({"scalar": 3, "add": 2, "mul": 2, "exp": 1, "constant": 1})
    out = fold(ir)
    assert ops_of(out) == Counter({"scalar": 1, "constant": 1, "mul": 1, "add": 1})
    scalar = next(n for n in out.nodes if n.op == "scalar")
    assert scalar.attrs["value"] == 2.5 and scalar.dtype == "float32"
    const = next(n for n in out.nodes if n.op == "constant")
    assert torch.allclose(const.attrs["value"], torch.exp(torch.arange(8) / 8))
    same_results(ir, out)


def test_fold_keeps_low_precision_semantics() -> None:
    g = fg.Graph("fold_bf16")
    x = g.tensor((8,), dtype="bfloat16", name="x")
    c = g.constant(torch.tensor([1.0, 3.0, 7.0, 1e-3, 100.0, 2.0, 0.5, 9.0], dtype=torch.bfloat16))
    ir = outputs(g, g.mul(x, g.sqrt(c)))
    out = fold(ir)
    assert ops_of(out) == Counter({"constant": 1, "mul": 1})
    assert next(n for n in out.nodes if n.op == "constant").dtype == "bfloat16"
    feeds = feeds_for(ir)
    assert torch.equal(fg.reference(ir)(*feeds), fg.reference(out)(*feeds))


def test_fold_never_folds_inputs_or_grows_memory() -> None:
    g = fg.Graph("fold_limits")
    x = g.tensor((4, 8), name="x")
    big = g.expand(g.constant(1.5), 64, 64)                     # a broadcast: cheaper computed
    small = g.exp(g.constant(torch.ones(16)))                  # 16 elements: folds
    ir = outputs(g, g.exp(x), big, small)
    out = fold(ir)
    assert ops_of(out)["exp"] == 1 and ops_of(out)["expand"] == 1
    capped = fold_constants(ir, max_elements=8)                # the size cap
    assert ops_of(capped)["exp"] == 2
    same_results(ir, out)


# ---------------------------------------------------------------- simplify
def test_simplify_identities() -> None:
    g = fg.Graph("identities")
    x = g.tensor((4, 8), name="x")
    a = g.mul(g.add(x, 0.0), 1.0)              # x
    b = g.div(g.sub(a, 0), 1)                  # x
    c = g.mul(1.0, g.add(0, b))                # commuted forms: x
    ir = outputs(g, g.exp(c))
    assert ops_of(ir)["exp"] == 1 and len(ir.nodes) == 14
    out = simplify(ir)
    assert ops_of(out) == Counter({"exp": 1})
    assert out.outputs[0].inputs[0] is ir.inputs[0]
    same_results(ir, out)


def test_simplify_does_not_change_types_by_broadcast_or_promotion() -> None:
    g = fg.Graph("typed")
    x = g.tensor((8,), name="x")
    h = g.tensor((8,), dtype="float16", name="h")
    ones = g.constant(torch.ones(4, 8))
    a = g.mul(x, ones)                                         # broadcasts to (4, 8): stays
    b = g.add(h, g.constant(torch.zeros(8, dtype=torch.float32)))  # promotes to float32: stays
    ir = outputs(g, a, b)
    out = simplify(ir)
    assert ops_of(out) == ops_of(ir)
    same_results(ir, out)


def test_times_zero_only_for_integers() -> None:
    g = fg.Graph("zero")
    x = g.tensor((4, 8), name="x")
    i = g.tensor((4, 8), dtype="int32", name="i")
    fx, ix = g.mul(x, 0.0), g.mul(0, i)
    ir = outputs(g, fx, ix)
    out = simplify(ir)
    assert out.outputs[0].op == "mul"                          # inf * 0 is nan: kept
    zeros = out.outputs[1]
    assert zeros.op == "expand" and zeros.inputs[0].op == "scalar" and zeros.inputs[0].attrs["value"] == 0
    assert ops_of(out) == Counter({"mul": 1, "expand": 1, "scalar": 2})   # i is no longer read
    feeds = [torch.tensor([float("inf")]).expand(4, 8).clone(), torch.randint(-9, 9, (4, 8), dtype=torch.int32)]
    before, after = fg.reference(ir)(*feeds), fg.reference(out)(*feeds)
    assert torch.isnan(after[0]).all() and torch.isnan(before[0]).all()
    assert torch.equal(after[1], torch.zeros(4, 8, dtype=torch.int32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_plus_tanh_becomes_twice_a_sigmoid(dtype: str) -> None:
    """GPT-2's GELU spelled out, 0.5 x (1 + tanh(u)): the sum becomes 2 sigmoid(2u) (no tanh left), with
    the same results, and no cancellation where tanh(u) is near -1 (there the sum loses every digit)."""
    g = fg.Graph("gelu_spelled")
    x = g.tensor((4, 64), dtype=dtype, name="x")
    u = g.mul(g.add(x, g.mul(g.pow(x, 3.0), 0.044715)), 0.7978845608028654)
    ir = outputs(g, g.mul(g.mul(x, 0.5), g.add(1.0, g.tanh(u))))
    out = simplify(ir)
    assert ops_of(out)["tanh"] == 0 and ops_of(out)["sigmoid"] == 1
    same_results(ir, out, tol=2e-2 if dtype == "bfloat16" else None)
    far = fg.Graph("far")
    v = far.tensor((3,), name="v")
    far_ir = outputs(far, far.add(far.tanh(v), 1.0))
    at = torch.tensor([-9.0, -20.0, 0.5])
    got, summed = fg.reference(simplify(far_ir))(at), fg.reference(far_ir)(at)
    want = 2.0 / (1.0 + torch.exp(-2.0 * at.double()))             # the true 1 + tanh(u)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=0)
    assert summed[1] == 0 and not torch.allclose(summed[:1].double(), want[:1], rtol=1e-2)   # the sum cancels


def test_one_minus_tanh_squared_becomes_a_product_of_sigmoids() -> None:
    """tanh's derivative as the backward writes it, 1 - t * t with t = tanh(u): 4 s (1 - s), s = sigmoid(2u),
    no tanh left, the same results; relatively accurate for u <= 0 where 1 - t * t cancels, and for u > 0
    within a few ulp of 1 absolutely (as 1 - t * t is). Beside GELU's forward form, one sigmoid for both."""
    g = fg.Graph("dtanh")
    u = g.tensor((4, 64), name="u")
    t = g.tanh(u)
    ir = outputs(g, g.sub(1.0, g.mul(t, t)))
    out = simplify(ir)
    assert ops_of(out)["tanh"] == 0 and ops_of(out)["sigmoid"] == 1
    same_results(ir, out)
    at = torch.tensor([[-12.0, -6.0, -0.3, 0.0, 0.3, 6.0, 12.0]])
    g2 = fg.Graph("dtanh_far")
    t2 = g2.tanh(g2.tensor((1, 7), name="u"))
    far = outputs(g2, g2.sub(1.0, g2.mul(t2, t2)))
    got = fg.reference(simplify(far))(at).double()
    want = 1.0 / torch.cosh(at.double()) ** 2                        # the true derivative, sech^2
    assert torch.allclose(got[:, :4], want[:, :4], rtol=1e-5, atol=0)
    assert torch.allclose(got, want, rtol=1e-5, atol=4 * 2.0 ** -22)
    both = fg.Graph("gelu_and_grad")                                 # GELU's forward form and its derivative
    v = both.tensor((4, 64), name="v")
    tv = both.tanh(v)
    shared = simplify(outputs(both, both.add(tv, 1.0), both.sub(1.0, both.mul(tv, tv))))
    assert ops_of(cse(shared))["sigmoid"] == 1


def test_tanh_as_sigmoid_off_keeps_the_tanh() -> None:
    """The setting tanh_as_sigmoid=0 (kept for the GPU A/B) leaves both tanh forms alone."""
    g = fg.Graph("tanh_kept")
    u = g.tensor((4, 8), name="u")
    t = g.tanh(u)
    ir = outputs(g, g.add(t, 1.0), g.sub(1.0, g.mul(t, t)))
    with override(tanh_as_sigmoid=False):
        out = simplify(ir)
    assert ops_of(out)["tanh"] == 1 and ops_of(out)["sigmoid"] == 0
    assert ops_of(simplify(ir))["tanh"] == 0


def test_involutions_and_idempotents_by_property() -> None:
    g = fg.Graph("props")
    x = g.tensor((4, 8), name="x")
    b = g.tensor((4, 8), dtype="bool", name="b")
    a = g.neg(g.neg(x))                                    # x
    r = g.relu(g.relu(g.abs(g.abs(x))))                    # relu(abs(x))
    m = g.maximum(x, x)                                    # x
    n = g.logical_not(g.logical_not(b))                    # b
    w = g.where(b, r, r)                                   # r
    ir = outputs(g, g.add(a, r), m, n, w)
    out = simplify(ir)
    assert ops_of(out) == Counter({"add": 1, "relu": 1, "abs": 1})
    assert out.outputs[1] is out.inputs[0] and out.outputs[2] is out.inputs[1]
    assert out.outputs[3].op == "relu"
    same_results(ir, out)


@pytest.mark.parametrize(("x", "a", "b", "exact"), [
    ("bfloat16", "float32", "bfloat16", True),     # round trip through a wider type
    ("float16", "float32", "bfloat16", True),      # exact first step, then one rounding
    ("float32", "bfloat16", "float32", False),     # first step rounds
    ("float32", "float16", "bfloat16", False),     # double rounding
    ("int8", "int32", "int16", True),              # integers: modular
    ("int32", "int8", "int32", False),             # first step wraps
    ("int8", "float32", "int32", False),           # float -> int after int: not kept
    ("int8", "float16", "int8", True),             # round trip
    ("float32", "float64", "bool", True),
    ("float32", "int32", "float32", False),        # truncation
])
def test_cast_chain_exactness(x: str, a: str, b: str, exact: bool) -> None:
    assert cast_chain_is_exact(x, a, b) is exact
    g = fg.Graph("casts")
    t = g.tensor((64,), dtype=x, name="t")
    ir = outputs(g, g.cast(g.cast(t, a), b))
    out = simplify(ir)
    assert ops_of(out)["cast"] == (2 if not exact else (0 if b == x else 1))
    feeds = feeds_for(ir)
    if dtypes_is_float(x):
        feeds = [(feeds[0].float() * 37).to(feeds[0].dtype)]   # values that exercise rounding
    assert torch.equal(fg.reference(ir)(*feeds), fg.reference(out)(*feeds))


def dtypes_is_float(name: str) -> bool:
    return name.startswith(("float", "bfloat"))


def test_lossless_table() -> None:
    assert lossless("float16", "float32") and lossless("bfloat16", "float32")
    assert not lossless("float16", "bfloat16") and not lossless("bfloat16", "float16")
    assert lossless("int16", "float32") and not lossless("int32", "float32")
    assert lossless("uint8", "int16") and not lossless("int8", "uint8")
    assert not lossless("float32", "int64") and not lossless("float32", "bool")


def test_cast_to_same_dtype_is_removed() -> None:
    g = fg.Graph("cast_same")
    x = g.tensor((4,), name="x")
    ir = outputs(g, g.exp(g.cast(x, "float32")))
    assert ops_of(simplify(ir)) == Counter({"exp": 1})


def test_permute_and_transpose_chains_compose() -> None:
    g = fg.Graph("perm")
    x = g.tensor((2, 3, 4), name="x")
    a = g.permute(g.permute(x, 2, 0, 1), 1, 2, 0)         # identity
    b = g.transpose(g.transpose(x, 0, 1), 1, 0)           # identity
    c = g.transpose(g.permute(x, 1, 0, 2), 0, 2)          # one permute
    d = g.permute(x, 0, 1, 2)                             # identity
    ir = outputs(g, g.add(a, b), c, g.exp(d))
    assert ops_of(ir) == Counter({"permute": 4, "transpose": 3, "add": 1, "exp": 1})
    out = simplify(ir)
    assert ops_of(out) == Counter({"permute": 1, "add": 1, "exp": 1})
    assert next(n for n in out.nodes if n.op == "permute").attrs["dims"] == (2, 0, 1)
    same_results(ir, out)


def test_reshape_chains() -> None:
    g = fg.Graph("reshape")
    x = g.tensor((2, 3, 4), name="x")
    a = g.reshape(g.reshape(g.reshape(x, 6, 4), 4, 6), 3, 8)
    b = g.reshape(x, 2, 3, 4)
    c = g.reshape(g.reshape(x, 24), 2, 3, 4)
    e = g.expand(x, 2, 3, 4)                              # expand to its own shape
    ir = outputs(g, a, g.add(b, c), e)
    out = simplify(ir)
    assert ops_of(out) == Counter({"reshape": 1, "add": 1})
    assert out.outputs[2] is out.inputs[0]
    assert out.outputs[0].inputs[0] is out.inputs[0]
    same_results(ir, out)


def test_elementwise_between_inverse_reshapes() -> None:
    """reshape(f(reshape(x))) back to x's shape is f(x) for a one-input elementwise f (the cast
    AOTAutograd leaves between `.view(B, T, V)` and `.view(B*T, V)`); a reshape to another shape, or
    an op with two tensor inputs, stays."""
    g = fg.Graph("round_trip")
    x = g.tensor((6, 5), name="x")
    y = g.tensor((2, 3, 5), name="y")
    a = g.reshape(g.cast(g.reshape(x, 2, 3, 5), "float16"), 6, 5)       # -> cast(x)
    b = g.reshape(g.exp(g.reshape(x, 30)), 3, 10)                        # another shape: kept
    c = g.reshape(g.add(g.reshape(x, 2, 3, 5), y), 6, 5)                 # two tensor inputs: kept
    ir = outputs(g, a, b, c)
    out = simplify(ir)
    assert out.outputs[0].op == "cast" and out.outputs[0].inputs[0] is out.inputs[0]
    assert ops_of(out)["reshape"] == 4
    same_results(ir, out)


def test_add_of_a_scatter_into_zeros_accumulates_into_the_addend() -> None:
    """x + index_put(zeros, v, idx, accumulate=True) -> index_put(x, v, idx, accumulate=True) (a tied
    embedding's gradient); not for a non-accumulating put, a non-zero base, or a 16-bit table."""
    g = fg.Graph("tied_grad")
    x = g.tensor((8, 4), name="x")
    v = g.tensor((5, 4), name="v")
    idx = g.tensor((5,), dtype="int64", name="idx")
    zeros = g.constant(torch.zeros(8, 4))
    a = g.add(x, g.index_put(zeros, [idx], v, accumulate=True))
    b = g.add(g.index_put(zeros, [idx], v, accumulate=False), x)             # not accumulating: kept
    c = g.add(x, g.index_put(x, [idx], v, accumulate=True))                  # base is not zeros: kept
    h = g.tensor((8, 4), dtype="float16", name="h")
    vh = g.tensor((5, 4), dtype="float16", name="vh")
    d = g.add(h, g.index_put(g.constant(torch.zeros(8, 4, dtype=torch.float16)), [idx], vh, accumulate=True))
    ir = outputs(g, a, b, c, d)
    out = simplify(ir)
    assert out.outputs[0].op == "index_put" and out.outputs[0].inputs[0] is out.inputs[0]
    assert [o.op for o in out.outputs[1:]] == ["add", "add", "add"]
    feeds = [rand(8, 4), rand(5, 4), torch.tensor([1, 3, 3, 0, 7]), rand(8, 4, dtype=torch.float16),
             rand(5, 4, dtype=torch.float16)]
    for got, want in zip(fg.reference(out)(*feeds), fg.reference(ir)(*feeds), strict=True):
        assert_close(got.float(), want.float(), tol=1e-3)


def test_transpose_folds_into_matmul_flags() -> None:
    g = fg.Graph("mm")
    a = g.tensor((2, 8, 4), name="a")
    b = g.tensor((2, 5, 8), name="b")
    y = g.matmul(g.transpose(a, -1, -2), g.transpose(b, 1, 2))   # a^T @ b^T
    z = g.matmul(g.permute(a, 0, 2, 1), b, transpose_b=True)      # permute of the last two dims
    ir = outputs(g, y, z)
    out = simplify(ir)
    assert ops_of(out) == Counter({"matmul": 2})
    flags = [(n.attrs["trans_a"], n.attrs["trans_b"]) for n in out.outputs]
    assert flags == [(True, True), (True, True)]
    same_results(ir, out)


# ---------------------------------------------------------------- pipeline
def test_pipeline_order_and_fixed_point() -> None:
    mine = ("simplify", "fold", "cse", "dce")          # other passes may sit between them
    assert [p.name for p in PIPELINE if p.name in mine] == list(mine)
    g = fg.Graph("pipeline")
    x = g.tensor((4, 8), name="x")
    one = g.sub(g.constant(2.0), g.constant(1.0))   # fold -> 1.0, then simplify x*1 -> x
    a = g.exp(g.mul(x, one))
    b = g.exp(x)                                    # then cse merges a and b
    ir = outputs(g, g.add(a, b))
    out = optimize(ir)
    assert ops_of(out) == Counter({"exp": 1, "add": 1})
    names = [r.name for r in out.provenance]
    assert [n for n in names if n in mine][:4] == list(mine) and len(names) >= 2 * len(PIPELINE)
    assert len(optimize(out).provenance) == len(out.provenance) + len(PIPELINE)   # a fixed point: one round
    same_results(ir, out)


def test_passes_are_pure_and_verified_between_passes() -> None:
    g = fg.Graph("pure")
    x = g.tensor((4, 8), name="x")
    ir = outputs(g, g.mul(g.neg(g.neg(x)), 1.0))
    nodes = ir.nodes
    with override(verify=True):
        out = optimize(ir)
    assert ir.nodes == nodes and ir.provenance == ()
    assert len(out.nodes) == 1   # only the input is left


def test_a_pass_that_breaks_the_graph_is_caught_by_the_verifier() -> None:
    from fusegraph.ir import Node
    from fusegraph.passes import graph_pass

    @graph_pass("broken")
    def broken(graph: IRGraph) -> IRGraph:
        out = graph.outputs[0]
        wrong = out.replace(specs=(out.spec.with_(shape=(3,)),))   # a spec the op does not infer
        return graph.with_(outputs=(wrong,))

    g = fg.Graph("broken")
    x = g.tensor((4,), name="x")
    ir = outputs(g, g.exp(x))
    broken(ir)  # verification off: no check
    with override(verify=True), pytest.raises(fg.GraphError, match="after pass broken"):
        broken(ir)
    assert isinstance(ir.outputs[0], Node)


def _split_op() -> str:
    name = "test_split2_passes"
    if name not in all_ops():
        define(name, lambda specs, a: (specs[0], specs[0]), lambda xs, a: (xs[0] + 1, xs[0] * 2),
               doc="test-only two-output op")
    return name


def test_fold_and_cse_through_multi_output_nodes() -> None:
    op = _split_op()
    g = fg.Graph("multi")
    x = g.tensor((4,), name="x")
    known_a, known_b = g._apply(op, g.constant(torch.arange(4, dtype=torch.float32)))   # all inputs known
    live_a, live_b = g._apply(op, x)
    again_a, _ = g._apply(op, x)                                                     # same as live
    ir = outputs(g, g.add(g.mul(live_a, known_a), g.add(live_b, known_b)), g.sub(again_a, live_a))
    assert ops_of(ir)[op] == 3 and ops_of(ir)["getitem"] == 5
    folded = fold(ir)
    assert ops_of(folded)[op] == 2 and ops_of(folded)["constant"] == 2
    assert [n.attrs["value"].tolist() for n in folded.nodes if n.op == "constant"] == [[1, 2, 3, 4], [0, 2, 4, 6]]
    merged = cse(folded)
    assert ops_of(merged)[op] == 1 and ops_of(merged)["getitem"] == 2
    same_results(ir, merged)


def _cast_probe_values(name: str) -> torch.Tensor:
    """Edge values of a dtype (zeros of both signs, extremes, inf, nan, fractions) plus random ones."""
    dtype = fg.ir.dtypes.to_torch(name)
    if dtype == torch.bool:
        return torch.tensor([True, False])
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        edges = torch.tensor([0.0, -0.0, 1.0, -1.5, 1 / 3, 1e-3, 3e-5, 1e-8, 255.5, -129.5, 448.0, 57344.0,
                              65504.0, 7e4, 3e38, 2.0**24 + 1, float("inf"), float("-inf"), float("nan")],
                             dtype=torch.float64)
        spread = torch.randn(500, generator=gen, dtype=torch.float64) * torch.logspace(-8, 8, 500, dtype=torch.float64)
        return torch.cat([edges, spread]).to(dtype)
    info = torch.iinfo(dtype)
    edges = torch.tensor([info.min, info.max, 0, 1, info.max // 2], dtype=torch.int64)
    return torch.cat([edges, torch.randint(info.min, info.max, (500,), generator=gen)]).to(dtype)


def test_every_cast_chain_called_exact_is_exact_in_torch() -> None:
    names = list(fg.ir.dtypes.TORCH_DTYPES)
    checked = 0
    for x, a, b in ((x, a, b) for x in names for a in names for b in names):
        if not cast_chain_is_exact(x, a, b):
            continue
        values = _cast_probe_values(x)
        two = values.to(fg.ir.dtypes.to_torch(a)).to(fg.ir.dtypes.to_torch(b))
        one = values.to(fg.ir.dtypes.to_torch(b))
        if one.dtype == torch.bool:
            assert torch.equal(one, two), (x, a, b)
        else:
            o, t = one.double(), two.double()
            same = (o == t) & (torch.signbit(o) == torch.signbit(t)) | (torch.isnan(o) & torch.isnan(t))
            assert bool(same.all()), f"cast chain {x} -> {a} -> {b} differs at {values[~same][:4].tolist()}"
        checked += 1
    assert checked > 300


def test_decompose_expands_composites_unless_kept() -> None:
    from fusegraph.passes.decompose import decompose, decompose_keeping

    g = fg.Graph("decompose")
    x = g.tensor((4, 16), dtype="bfloat16", name="x")
    w = g.tensor((16,), dtype="bfloat16", name="w")
    ir = outputs(g, g.softmax(g.layernorm(x, weight=w), -1))
    assert ops_of(ir) == Counter({"layernorm": 1, "softmax": 1})
    out = decompose(ir)
    ops = ops_of(out)
    assert "layernorm" not in ops and "softmax" not in ops
    assert ops["sum"] == 3 and ops["max"] == 1 and ops["rsqrt"] == 1 and ops["exp"] == 1
    kept = decompose_keeping({"layernorm"})(ir)
    assert ops_of(kept)["layernorm"] == 1 and "softmax" not in ops_of(kept)
    assert kept.provenance[-1].name == "decompose"
    same_results(ir, out)
    same_results(ir, kept)


def test_debug_levels_verify_and_print_every_pass(capsys: pytest.CaptureFixture[str]) -> None:
    g = fg.Graph("debug")
    x = g.tensor((4,), name="x")
    ir = outputs(g, g.exp(g.mul(x, 1.0)))
    with override(debug=4):
        optimize(ir)
    printed = capsys.readouterr().out
    for p in PIPELINE:
        assert f"--- after {p.name} ---" in printed
    assert "exp_" in printed and "# constructed by simplify" in printed
    from fusegraph.passes import graph_pass

    @graph_pass("drops_an_input")
    def drops_an_input(graph: IRGraph) -> IRGraph:
        return graph.with_(inputs=())

    with override(debug=1), pytest.raises(fg.GraphError, match="after pass drops_an_input"):
        drops_an_input(ir)
