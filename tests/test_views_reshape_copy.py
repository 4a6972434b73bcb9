"""Reshapes that are no view of their input: our copy kernel over the common refinement."""

from __future__ import annotations

import torch

import fusegraph as fg


def test_a_reshape_that_is_no_view_runs_as_our_copy_kernel() -> None:
    """q.view(T, B*H, D) of a permuted value regroups dims that are not contiguous in memory: a copy.
    It runs as a generated copy kernel over the two shapes' common refinement (not torch's strided
    copy), and the values match; off (settings.reshape_copy_kernel), the reference copies it."""
    from fusegraph.lower import common_refinement, refined_strides
    from fusegraph.settings import override

    assert common_refinement((5, 4, 96), (5, 16, 24)) == (5, 4, 4, 24)
    assert common_refinement((2, 3), (3, 2)) is None and common_refinement((6, 1, 4), (24,)) == (6, 4)
    assert refined_strides((5, 4, 96), (384, 96, 1), (5, 4, 4, 24)) == (384, 96, 24, 1)
    assert refined_strides((4, 16, 96), (96, 384, 1), (4, 16, 4, 24)) == (96, 384, 24, 1)

    def build() -> fg.Plan:
        g = fg.Graph("reshape_copy")
        x = g.tensor((16, 4, 96), "float16", "x")
        r = g.reshape(g.transpose(x, 0, 1), (4, 64, 24))
        g.matmul(r, g.tensor((4, 24, 8), "float16", "w")).set_output()
        return g.build(device="cpu")

    xs, w = torch.randn(16, 4, 96).half(), torch.randn(4, 24, 8).half()
    want = torch.matmul(xs.transpose(0, 1).reshape(4, 64, 24).float(), w.float())
    plan = build()
    copies = [k for k in plan.kernels if k.name.endswith("_reshape_copy")]
    assert len(copies) == 1 and copies[0].backend == "triton" and copies[0].kind == "pointwise"
    assert float((plan(xs, w).float() - want).norm() / want.norm()) < 1e-2
    with override(reshape_copy_kernel=False):
        plan = build()
    assert not any(k.name.endswith("_reshape_copy") for k in plan.kernels)
    assert float((plan(xs, w).float() - want).norm() / want.norm()) < 1e-2


def test_the_copy_kernel_reads_a_caller_layout_it_was_not_built_for() -> None:
    """The reshape reads a view of a graph input: the caller's strides show through it (the plan's input
    check looks at shapes, not strides), so the copy kernel takes the layout it was built for first."""
    g = fg.Graph("reshape_copy_strides")
    x = g.tensor((16, 4, 96), "float32", "x")
    g.relu(g.reshape(g.transpose(x, 0, 1), (4, 64, 24))).set_output()
    plan = g.build(device="cpu")
    assert any(k.name.endswith("_reshape_copy") for k in plan.kernels)
    base = torch.randn(4, 16, 96)
    for xs in (base.transpose(0, 1).contiguous(), base.transpose(0, 1)):   # dense, then another layout
        want = torch.relu(xs.transpose(0, 1).reshape(4, 64, 24))
        assert torch.equal(plan(xs), want)
