"""Column reductions sharing the row kernel's pass (settings.share_row_pass): a reduction over a
reshape that merges dims moves to the reshape's input (passes/simplify.py); bias and layernorm
weight gradients join the layernorm-backward row kernel they read from (fusion/partition.py); a
pointwise value stored beside its column sums runs as a split column reduction (codegen/column_split).
Structure is asserted on the partition, numerics against eager / the reference executor on fresh data."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.codegen.triton_gen import generate
from fusegraph.fusion.partition import KernelGroup, partition_graph
from fusegraph.ir import Graph as IRGraph
from fusegraph.passes import optimize, simplify
from fusegraph.passes.simplify import reshape_groups
from fusegraph.settings import override


def _reduction_inputs(graph: IRGraph) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(input shape, dims) of every sum in the graph."""
    return [(tuple(n.inputs[0].shape), tuple(n.attrs["dims"])) for n in graph.nodes if n.op == "sum"]


def _same(before: IRGraph, after: IRGraph) -> None:
    feeds = [rand(*n.shape) for n in before.inputs]
    for a, b in zip(fg.reference(after)(*feeds), fg.reference(before)(*feeds), strict=True):
        assert_close(a, b, tol=1e-6)


def test_reshape_groups_pairs_consecutive_runs():
    assert reshape_groups((4, 8, 16), (32, 16)) == [([0, 1], [0]), ([2], [1])]
    assert reshape_groups((32, 16), (4, 8, 16)) == [([0], [0, 1]), ([1], [2])]
    assert reshape_groups((4, 8), (2, 16)) == [([0, 1], [0, 1])]
    assert reshape_groups((4, 1, 8), (32,)) == [([0, 1, 2], [0])]
    assert reshape_groups((0, 3), (3, 0)) is None


@pytest.mark.parametrize("shape,view,dims,moved", [
    ((4, 8, 16), (32, 16), (0,), ((4, 8, 16), (0, 1))),     # a bias gradient over flattened tokens
    ((4, 8, 16), (4, 128), (1,), ((4, 8, 16), (1, 2))),
    ((4, 8, 16), (32, 16), (1,), ((4, 8, 16), (2,))),
    ((32, 16), (4, 8, 16), (0, 1), None),                   # a split: the reduction is on the finer view
    ((4, 8), (2, 16), (0,), None),                          # the run mixes a reduced and a kept dim
])
def test_sum_over_a_merging_reshape_reduces_its_input(shape, view, dims, moved):
    g = fg.Graph("sum_reshape")
    x = g.tensor(shape, name="x")
    g.sum(g.reshape(x, view), dims).set_output()
    ir = g.to_ir()
    out = simplify(ir)
    assert _reduction_inputs(out) == [moved if moved else (view, dims)]
    assert tuple(out.outputs[0].shape) == tuple(ir.outputs[0].shape)
    _same(ir, out)
    with override(share_row_pass=False):
        assert _reduction_inputs(simplify(ir)) == [(view, dims)]


def test_sum_of_a_cast_reshape_reduces_the_cast_input():
    """autocast's bias gradient: sum(cast(reshape(g_bf16, [B*T, C]), fp32), 0) -> sum over (0, 1) of cast(g)."""
    g = fg.Graph("sum_cast_reshape")
    x = g.tensor((4, 8, 16), dtype="bfloat16", name="x")
    g.sum(g.cast(g.reshape(x, (32, 16)), "float32"), 0).set_output()
    ir = g.to_ir()
    out = simplify(ir)
    assert _reduction_inputs(out) == [((4, 8, 16), (0, 1))]
    assert out.outputs[0].dtype == "float32"
    feeds = [rand(4, 8, 16, dtype=torch.bfloat16)]
    assert_close(fg.reference(out)(*feeds), fg.reference(ir)(*feeds), tol=1e-6)


def _layernorm_backward_with_bias_grad(tokens: tuple[int, int], c: int) -> fg.Graph:
    """Layernorm backward (dx, dw, db) whose dx, plus the incoming residual gradient, is also the
    input of a linear layer's bias gradient: sum over the flattened [tokens, c] view."""
    g = fg.Graph("ln_bwd_bias")
    b, t = tokens
    x, dy, res = g.tensor((b, t, c), name="x"), g.tensor((b, t, c), name="dy"), g.tensor((b, t, c), name="res")
    w = g.tensor((c,), name="w")
    mean = g.mean(x, 2, keepdim=True)
    xc = g.sub(x, mean)
    rstd = g.rsqrt(g.add(g.mean(g.mul(xc, xc), 2, keepdim=True), 1e-5))
    xhat = g.mul(xc, rstd)
    gw = g.mul(dy, w)
    proj = g.mul(xhat, g.mean(g.mul(gw, xhat), 2, keepdim=True))
    dx = g.mul(rstd, g.sub(g.sub(gw, g.mean(gw, 2, keepdim=True)), proj))
    dres = g.add(dx, res)
    dres.set_output()
    g.sum(g.mul(dy, xhat), (0, 1)).set_output()                  # dw
    g.sum(dy, (0, 1)).set_output()                               # db
    g.sum(g.reshape(dres, (b * t, c)), 0).set_output()           # the previous linear's bias gradient
    return g


def _compute_kernels(share: bool) -> list[str]:
    with override(share_row_pass=share):
        plan = _layernorm_backward_with_bias_grad((2, 8), 16).build()
    return [k.name for k in plan.kernels if k.kind != "view"]


def test_layernorm_weight_and_bias_gradients_share_the_dx_pass():
    """dx (+ the residual gradient), dw, db and the bias gradient: one row + column kernel."""
    assert len(_compute_kernels(True)) == 1, _compute_kernels(True)
    assert len(_compute_kernels(False)) == 2, _compute_kernels(False)   # the bias gradient apart


@pytest.mark.parametrize("share", [True, False])
def test_layernorm_backward_with_bias_grad_numerics(share):
    with override(share_row_pass=share):
        g = _layernorm_backward_with_bias_grad((4, 160), 24)   # 640 rows: the column partials span programs
        plan = g.build()
        feeds = [rand(*n.shape) for n in g.to_ir().inputs]
        for got, ref in zip(plan(*feeds), fg.reference(g)(*feeds), strict=True):
            assert_close(got, ref, tol=1e-4)


def test_rows_too_wide_for_one_pass_fall_back_to_two_kernels():
    """A pair whose rows do not fit in registers (max_row_block below the row) runs as the row kernel
    and the merged column kernel (dw, db and the bias gradient in one), with the same results."""
    g = _layernorm_backward_with_bias_grad((4, 40), 64)
    plan = g.build(max_row_block=32)
    compute = [k for k in plan.kernels if k.kind != "view"]
    assert len(compute) == 2, [k.name for k in compute]
    assert any(k.name.endswith("_cols") for k in compute), [k.name for k in compute]
    feeds = [rand(*n.shape) for n in g.to_ir().inputs]
    for got, ref in zip(plan(*feeds), fg.reference(g)(*feeds), strict=True):
        assert_close(got, ref, tol=1e-4)


def test_pointwise_result_stored_by_a_split_column_reduction():
    """gelu's gradient and its column sums (the bias gradient) over 1024 rows: one split column
    kernel whose partial pass also stores the gradient; numerics against the reference."""
    g = fg.Graph("gelu_bwd_bias")
    dy, h = g.tensor((4, 256, 32), name="dy"), g.tensor((4, 256, 32), name="h")
    grad = g.mul(dy, g.sigmoid(h))
    grad.set_output()
    g.sum(g.reshape(grad, (1024, 32)), 0).set_output()
    groups = [it for it in partition_graph(optimize(g.to_ir())).items if isinstance(it, KernelGroup)]
    assert len(groups) == 1
    gen = generate(groups[0], "k")
    assert gen.column and gen.finish_name, "expected the two-stage (split) column kernel"
    plan = g.build()
    assert [k.kind for k in plan.kernels if k.kind != "view"] == ["reduction"]
    feeds = [rand(*n.shape) for n in g.to_ir().inputs]
    for got, ref in zip(plan(*feeds), fg.reference(g)(*feeds), strict=True):
        assert_close(got, ref, tol=1e-5)


class PreNormMLP(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x)), approximate="tanh"))


def test_training_two_blocks_fewer_backward_kernels_same_gradients():
    """Two pre-norm MLP blocks, 512 tokens: with share_row_pass the second layernorm's backward takes
    its dw, db and the first block's projection bias gradient (the first layernorm has no dx to
    compute: its input needs no gradient), and gelu's backward takes fc's bias gradient."""
    torch._dynamo.reset()
    x = rand(2, 256, 16)
    counts = {}
    for share in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(PreNormMLP(), PreNormMLP())
        with override(share_row_pass=share):
            compiled = fg.compile(model)
            out = compiled(x)
            proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            (out * proj).sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        (model(x) * proj).sum().backward()
        for (name, _), a, b in zip(model.named_parameters(), got, [p.grad for p in model.parameters()], strict=True):
            assert_close(a, b, tol=1e-4, what=f"grad {name} (share_row_pass={share})")
        backward = compiled.fusegraph_report.graphs[1]
        kernels = [k for p in backward.partitions for k in p.kernel_ops if not k.startswith("matmul/")]
        counts[share] = len(kernels)
        if share:   # no bias gradient over a flattened view left on its own
            assert not any(k.endswith(": sum+reshape") for k in kernels), kernels
        torch._dynamo.reset()
    assert counts[True] < counts[False], counts
