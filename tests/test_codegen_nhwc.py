"""Pointwise kernels walk the domain in the output's memory order: an NHWC (channels-last) chain
loads and stores with the flat index (coalesced), and a per-channel broadcast indexes the channel."""

import torch

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.settings import override


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _bn_relu_graph(x_t: torch.Tensor, scale_t: torch.Tensor, shift_t: torch.Tensor) -> fg.Graph:
    g = fg.Graph(name="nhwc_affine_relu")
    x = g.tensor_like(x_t, name="x")
    s = g.tensor_like(scale_t, name="scale")
    b = g.tensor_like(shift_t, name="shift")
    g.relu(g.add(g.mul(x, s), b)).set_output()
    return g


def test_nhwc_pointwise_uses_the_flat_index_and_matches_reference() -> None:
    x_t = _nhwc(rand(2, 5, 3, 7))
    scale_t, shift_t = rand(5, 1, 1), rand(5, 1, 1)
    g = _bn_relu_graph(x_t, scale_t, shift_t)
    with override(use_triton=True):
        plan = g.build(device="cpu")
    (kernel,) = plan.kernels
    assert kernel.backend == "triton" and kernel.kind == "pointwise"
    src = kernel.source
    assert "tl.load(in0 + offs," in src, src        # x: NHWC, read with the flat index
    assert "tl.store(out0 + offs," in src, src      # output keeps x's NHWC layout, written flat
    assert "i1 = offs % 5" in src, src              # the channel is the innermost (stride-1) dim
    out = plan(x_t, scale_t, shift_t)
    ref = fg.reference(g)(x_t, scale_t, shift_t)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, ref, what="nhwc affine relu")


def test_row_major_pointwise_is_unchanged() -> None:
    x_t = rand(2, 5, 3, 7)
    scale_t, shift_t = rand(5, 1, 1), rand(5, 1, 1)
    g = _bn_relu_graph(x_t, scale_t, shift_t)
    plan = g.build(device="cpu")
    (kernel,) = plan.kernels
    assert "tl.load(in0 + offs," in kernel.source
    assert_close(plan(x_t, scale_t, shift_t), fg.reference(g)(x_t, scale_t, shift_t), what="row-major")
