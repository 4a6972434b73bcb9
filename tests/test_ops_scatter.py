"""Scatter-like ops (ops/scatter.py): the op table, typed errors, costs, the plan (library kernels inside the
fused plan, the destination input left unmodified), and the two models that needed them: a GPT-2 training
step (embedding backward's index_put accumulate) and the llama decode block (static KV cache written with
index_copy_) through the torch backend with no eager fallback."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rel_err
from fusegraph.frontends.torch_partition import FallbackWarning
from fusegraph.settings import override
from optable import OpCase, const, make, params, run_case

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
aten = torch.ops.aten

_DUP_ROWS = torch.tensor([[1, 4], [1, -1]])             # duplicates (1) and a negative index
_ROWS_I32 = torch.tensor([0, 2, 2], dtype=torch.int32)
_COLS = torch.tensor([4, 0, 1])
_SCATTER_INDEX = torch.tensor([[0, 1, 3], [0, 2, 3]])

SCATTER = [
    OpCase("index_put_accumulate_duplicates", [make(6, 3), const(_DUP_ROWS), make(2, 2, 3)],
           lambda g, x, i, v: g.index_put(x, [i], v, accumulate=True),
           lambda x, i, v: aten.index_put.default(x, [i], v, True)),
    OpCase("index_put_overwrite_dim2_broadcast_values", [make(1, 2, 6, 4), const(torch.tensor([3])), make(2, 1, 4)],
           lambda g, x, i, v: g.index_put(x, [None, None, i], v),
           lambda x, i, v: aten.index_put.default(x, [None, None, i], v)),
    OpCase("index_put_non_adjacent_int32_noncontig", [make(3, 4, 5, transpose=(1, 2)), const(_ROWS_I32),
                                                      const(_COLS), make(4)],
           lambda g, x, i, j, v: g.index_put(x, [i, None, j], v, accumulate=True),
           lambda x, i, j, v: aten.index_put.default(x, [i.long(), None, j], v, True)),
    OpCase("index_copy_dim1", [make(4, 5, 3), const(torch.tensor([3, 0])), make(4, 2, 3)],
           lambda g, x, i, s: g.index_copy(x, 1, i, s), lambda x, i, s: torch.index_copy(x, 1, i, s)),
    OpCase("scatter_add_dim0", [make(4, 3), const(_SCATTER_INDEX), make(2, 3)],
           lambda g, x, i, s: g.scatter_add(x, 0, i, s), lambda x, i, s: torch.scatter_add(x, 0, i, s)),
    OpCase("scatter_add_last_dim_smaller_index", [make(3, 5), const(torch.tensor([[4, 4], [0, 1]])), make(3, 3)],
           lambda g, x, i, s: g.scatter_add(x, -1, i, s), lambda x, i, s: torch.scatter_add(x, -1, i, s)),
    OpCase("slice_scatter_step2", [make(3, 7), make(3, 3)], lambda g, x, s: g.slice_scatter(x, s, 1, 1, 6, 2),
           lambda x, s: torch.slice_scatter(x, s, 1, 1, 6, 2)),
    OpCase("slice_scatter_open_end", [make(5, 2), make(2, 2)], lambda g, x, s: g.slice_scatter(x, s, 0, -2),
           lambda x, s: torch.slice_scatter(x, s, 0, -2)),
    # in-place forms on a graph input (frontends/input_mutation.py: a re-inplaced KV cache update)
    OpCase("index_copy_inplace_dim2", [make(1, 2, 6, 4), const(torch.tensor([3])), make(1, 2, 1, 4)],
           lambda g, x, i, s: g._apply("index_copy_inplace", x, i, s, dim=2),
           lambda x, i, s: torch.index_copy(x, 2, i, s)),
    OpCase("index_put_inplace_dim2", [make(1, 2, 6, 4), const(torch.tensor([4, 1])), make(2, 1, 4)],
           lambda g, x, i, v: g._apply("index_put_inplace", x, v, i, index_dims=(2,), accumulate=False),
           lambda x, i, v: aten.index_put.default(x, [None, None, i], v)),
]


@pytest.mark.parametrize(("case", "dtype"), params(SCATTER))
def test_reference(case: OpCase, dtype: torch.dtype) -> None:
    run_case(case, dtype)


def test_accumulate_sums_duplicates_and_destination_is_not_modified() -> None:
    g = fg.Graph(name="scatter_plan")
    x = g.tensor((5, 2), name="x")
    i = g.tensor((3,), dtype="int64", name="i")
    v = g.tensor((3, 2), name="v")
    g.index_put(g.exp(x), [i], v, accumulate=True).set_output()
    plan = g.build(device="cpu")
    assert any(k.kind == "library" and k.nodes[0].op == "index_put" for k in plan.kernels)
    xs, vs = torch.zeros(5, 2), torch.ones(3, 2)
    out = plan(xs, torch.tensor([2, 2, 0]), vs)
    want = torch.ones(5, 2)
    want[2] += 2
    want[0] += 1
    assert torch.equal(out, want)
    assert torch.equal(xs, torch.zeros(5, 2))  # functional: the input is not written


_SCATTER_INTO = [
    ("index_put", lambda g, d, i, v: g.index_put(d, [i], v, accumulate=True),
     lambda d, i, v: aten.index_put.default(d, [i], v, True), (3,), (3, 6)),
    ("index_copy", lambda g, d, i, v: g.index_copy(d, 0, i, v), lambda d, i, v: torch.index_copy(d, 0, i, v),
     (3,), (3, 6)),
    ("scatter_add", lambda g, d, i, v: g.scatter_add(d, 0, i, v), lambda d, i, v: torch.scatter_add(d, 0, i, v),
     (3, 6), (3, 6)),
    ("slice_scatter", lambda g, d, i, v: g.slice_scatter(d, v, 0, 1, 7, 2),
     lambda d, i, v: torch.slice_scatter(d, v, 0, 1, 7, 2), None, (3, 6)),
]


@pytest.mark.parametrize(("op", "build", "want", "index_shape", "values_shape"), _SCATTER_INTO,
                         ids=[c[0] for c in _SCATTER_INTO])
def test_scatter_into_a_dying_intermediate_writes_in_place(op, build, want, index_shape, values_shape) -> None:  # type: ignore[no-untyped-def]
    """The destination is an intermediate nothing reads afterwards (an embedding gradient scatter-added
    into the tied LM head's gradient): the memory plan runs the op's in-place form, no copy of the
    destination; results equal the functional op's, call after call, and the plan's inputs are not written."""
    g = fg.Graph(name=f"{op}_into")
    x = g.tensor((8, 6), name="x")
    v = g.tensor(values_shape, name="v")
    i = g.tensor(index_shape, dtype="int64", name="i") if index_shape else None
    build(g, g.exp(x), i, v).set_output()
    plan = g.build(device="cpu")
    assert plan.memory.inplace == 1
    from fusegraph.ir.registry import get_op
    k = next(k for k in plan.kernels if k.nodes[0].op == op)
    copying = get_op(op).cost([n.spec for n in k.nodes[0].inputs], list(k.nodes[0].specs), k.nodes[0].attrs)
    assert "in place" in k.note and k.cost.bytes == copying.bytes - 2 * 8 * 6 * 4   # no copy of the destination
    index = torch.tensor([5, 1, 5]) if index_shape == (3,) else torch.tensor([[5, 1, 5, 0, 7, 2]] * 3)
    for _ in range(2):
        xs, vs = torch.randn(8, 6), torch.randn(*values_shape)
        before = xs.clone()
        args = (xs, vs, index) if i is not None else (xs, vs)
        got = plan(*args)
        expect = want(torch.exp(before), index, vs) if i is not None else want(torch.exp(before), None, vs)
        assert_close(got, expect, what=op)
        assert torch.equal(xs, before)


def test_scatter_into_a_live_or_pinned_destination_copies() -> None:
    """No in-place write when the destination is read later, is a graph input, or a build-time constant
    (a constant written in place would carry one call's values into the next)."""
    g = fg.Graph(name="scatter_live")
    x = g.tensor((8, 6), name="x")
    i = g.tensor((3,), dtype="int64", name="i")
    v = g.tensor((3, 6), name="v")
    d = g.exp(x)
    g.add(g.index_put(d, [i], v, accumulate=True), d).set_output()   # the destination read afterwards
    g.index_put(x, [i], v, accumulate=True).set_output()   # a graph input as the destination
    g.index_put(g.constant(torch.zeros(8, 6)), [i], v, accumulate=True).set_output()
    plan = g.build(device="cpu")
    scatters = [step for step, k in enumerate(plan.kernels) if k.nodes[0].op == "index_put"]
    assert len(scatters) == 3   # each runs its copying launcher (the final add may still write in place)
    assert all(plan._steps[step][0] is plan.kernels[step].launch for step in scatters)
    index = torch.tensor([5, 1, 5])
    for _ in range(2):
        xs, vs = torch.randn(8, 6), torch.randn(3, 6)
        before = xs.clone()
        got = plan(xs, index, vs)
        e = torch.exp(before)
        assert_close(got[0], aten.index_put.default(e, [index], vs, True) + e, what="live")
        assert_close(got[1], aten.index_put.default(before, [index], vs, True), what="input")
        assert_close(got[2], aten.index_put.default(torch.zeros(8, 6), [index], vs, True), what="constant")
        assert torch.equal(xs, before)


def test_costs_count_the_copy_and_the_region() -> None:
    g = fg.Graph(name="scatter_cost")
    x = g.tensor((100, 8), name="x")
    i = g.tensor((3,), dtype="int64", name="i")
    v = g.tensor((3, 8), name="v")
    node = g.index_put(x, [i], v, accumulate=True).node
    from fusegraph.ir.registry import get_op
    cost = get_op("index_put").cost([n.spec for n in node.inputs], list(node.specs), node.attrs)
    copy = 2 * 100 * 8 * 4
    region = 3 * 8 * 4
    assert cost.bytes == copy + 3 * 8 + region + 2 * region  # indices, values, region read + written
    node = g.slice_scatter(x, g.tensor((100, 2), name="s"), 1, 0, 2).node
    cost = get_op("slice_scatter").cost([n.spec for n in node.inputs], list(node.specs), node.attrs)
    assert cost.bytes == copy + 2 * (100 * 2 * 4)


@pytest.mark.parametrize("build,error,match", [
    (lambda g, x: g.index_put(x, [g.tensor((2,), dtype="int64")], g.tensor((2, 3), dtype="float16")),
     fg.DTypeError, r"op index_put.*values of dtype float16 must have the destination's dtype float32"),
    (lambda g, x: g.index_put(x, [g.tensor((2,), dtype="int64")], g.tensor((3, 3))),
     fg.ShapeError, r"op index_put.*values of shape \(3, 3\) do not broadcast to the indexed region \(2, 3\)"),
    (lambda g, x: g.index_put(x, [g.tensor((4,), dtype="bool")], g.tensor((3,))),
     fg.DTypeError, r"op index_put.*boolean mask"),
    (lambda g, x: g.index_put(x, [g.tensor((2,), dtype="float32")], g.tensor((3,))),
     fg.DTypeError, r"op index_put.*index 0 must be an integer tensor, got float32"),
    (lambda g, x: g.index_put(x, [None, None, g.tensor((1,), dtype="int64")], g.tensor((3,))),
     fg.ShapeError, r"op index_put.*index_dims \(2,\) must be dims of the destination \(rank 2\)"),
    (lambda g, x: g.index_copy(x, 0, g.tensor((2,), dtype="int64"), g.tensor((3, 3))),
     fg.ShapeError, r"op index_copy.*source of shape \(3, 3\) must be \(2, 3\)"),
    (lambda g, x: g.scatter_add(x, 0, g.tensor((2,), dtype="int64"), g.tensor((2, 3))),
     fg.ShapeError, r"op scatter_add.*must have one rank"),
    (lambda g, x: g.slice_scatter(x, g.tensor((4, 1)), 1, 0, 3, 2),
     fg.ShapeError, r"op slice_scatter.*src of shape \(4, 1\) must be \(4, 2\)"),
    (lambda g, x: g.slice_scatter(x, g.tensor((4, 1)), 1, 0, 3, 0),
     fg.InvalidValueError, r"op slice_scatter.*step must be a positive int"),
])
def test_typed_errors(build, error, match) -> None:  # type: ignore[no-untyped-def]
    g = fg.Graph(name="scatter_errors")
    x = g.tensor((4, 3), name="x")
    with pytest.raises(error, match=match):
        build(g, x)


# ---------------- models through the torch backend ----------------

@pytest.fixture
def fresh_dynamo():  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
def test_llama_decode_block_one_partition_no_fallback_matches_eager() -> None:
    """The static KV cache's index_copy_ is translated: the decode step is one fusegraph partition (what a
    single CUDA graph needs), and every decode step's output and the caches match eager."""
    sys.path.insert(0, BENCH)
    from llama_blocks import LlamaDecodeBlock, LlamaSize

    torch.manual_seed(3)
    size = LlamaSize(batch=1, seq=6, dim=32, heads=4, kv_heads=2, ffn=48)
    eager = LlamaDecodeBlock(size)
    block = LlamaDecodeBlock(size)
    block.load_state_dict(eager.state_dict())
    compiled = fg.compile(block, mode="reduce-overhead")
    x = torch.randn(1, size.seq, size.dim)
    with torch.no_grad(), override(use_triton=False):
        for pos in range(size.seq):
            token, at = x[:, pos:pos + 1], torch.tensor([pos])
            assert rel_err(compiled(token, at), eager(token, at)) < 1e-5, f"decode step {pos}"
    assert rel_err(block.k_cache, eager.k_cache) < 1e-6 and rel_err(block.v_cache, eager.v_cache) < 1e-6
    assert block.k_cache[:, :, size.seq - 1].abs().sum() > 0  # the last position was written in place
    report = compiled.fusegraph_report
    assert report.fallback_ops == {}, report.fallback_ops
    assert [len(g.partitions) for g in report.graphs] == [1]
    assert "aten.index_copy_.default" in report.compiled_ops   # written into the cache in place (input_mutation.py)


@pytest.mark.usefixtures("fresh_dynamo")
def test_gpt2_training_step_no_fallback_matches_eager() -> None:
    """The embedding backward's scatter-add (index_put accumulate) compiles: no eager op in forward or
    backward, loss and every gradient match eager."""
    pytest.importorskip("transformers")
    sys.path.insert(0, BENCH)
    import zoo_models

    m = zoo_models.get("hf_gpt2")
    missing = zoo_models.available(m)
    if missing:
        pytest.skip(missing)
    model = m.build("tiny").train()
    ex = m.example(2, torch.float32, "cpu", "tiny")
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def step(fn):  # type: ignore[no-untyped-def]
        model.zero_grad(set_to_none=True)
        loss = m.loss(fn(*ex.inputs), ex.target)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    ref = step(model)
    model.load_state_dict(state)
    compiled = fg.compile(model)
    with override(use_triton=False), warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # an eager fallback fails the test
        got = step(compiled)
    names = ["loss"] + [n for n, _ in model.named_parameters()]
    for name, g, r in zip(names, got, ref, strict=True):
        assert_close(g, r, tol=1e-4, what=name)
    report = compiled.fusegraph_report
    assert report.fallback_ops == {}, report.fallback_ops
    assert {g.kind for g in report.graphs} >= {"forward", "backward"}
    assert all(len(g.partitions) == 1 for g in report.graphs), [(g.kind, len(g.partitions)) for g in report.graphs]
    assert "aten.index_put.default" in report.compiled_ops
