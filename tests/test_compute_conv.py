"""Convolution: conv + batchnorm (inference) + relu is one convolution kernel with the
batchnorm affine and relu as its fused epilogue, no layout transposes, numerics vs the reference;
NHWC inputs stay NHWC; convolution gradients against the reference."""

from __future__ import annotations

import pytest
import torch

import fusegraph as fg
from conftest import assert_close

LAYOUT_OPS = {"permute", "transpose", "contiguous", "copy"}


def _conv_bn_relu(layout: str | None) -> tuple[fg.Graph, list, object]:
    g = fg.Graph(name="cbr", compute_dtype="float32")
    x = g.tensor((2, 8, 10, 10), dtype="float16", name="x", **({"layout": layout} if layout else {}))
    w = g.tensor((16, 8, 3, 3), dtype="float16", name="w")
    rm, rv = g.tensor((16,), dtype="float32", name="rm"), g.tensor((16,), dtype="float32", name="rv")
    gw, gb = g.tensor((16,), dtype="float16", name="gw"), g.tensor((16,), dtype="float16", name="gb")
    bn = g.batch_norm(g.conv2d(x, w, padding=1), rm, rv, weight=gw, bias=gb, training=False)
    y = g.relu(bn)
    y.set_output()
    return g, [x, w, rm, rv, gw, gb], y


def _feeds(layout: str | None) -> list[torch.Tensor]:
    x = torch.randn(2, 8, 10, 10, dtype=torch.float16)
    if layout == "NHWC":
        x = x.contiguous(memory_format=torch.channels_last)
    return [x, torch.randn(16, 8, 3, 3, dtype=torch.float16), torch.randn(16), torch.rand(16) + 0.5,
            torch.randn(16, dtype=torch.float16), torch.randn(16, dtype=torch.float16)]


@pytest.mark.parametrize("layout", [None, "NHWC"])
def test_conv_batchnorm_relu_inference_is_one_conv_with_fused_epilogue(layout: str | None) -> None:
    g, ins, y = _conv_bn_relu(layout)
    plan = g.build(device="cpu")
    assert len(plan.kernels) == 1
    (kernel,) = plan.kernels
    # an NCHW input: the conv runs channels-last (the layout pass) and the epilogue's store writes the
    # user's NCHW output (the one boundary conversion, fused as the kernel's last op)
    ops = kernel.ops[:-1] if layout is None else kernel.ops
    assert kernel.kind == "convolution" and ops[0] == "conv2d" and ops[-1] == "relu"
    assert kernel.ops.count("to_layout") == (1 if layout is None else 0)
    assert not LAYOUT_OPS & set(kernel.ops)
    assert not LAYOUT_OPS & {n.op for n in plan.graph.nodes}
    assert "epilogue kernel (triton)" in kernel.source
    xs = _feeds(layout)
    got = plan.execute(dict(zip(ins, xs, strict=True)))[y]
    ref = fg.reference(g).execute(dict(zip(ins, xs, strict=True)))[y]
    assert_close(got, ref, what="conv+bn+relu")
    if layout == "NHWC":
        assert got.is_contiguous(memory_format=torch.channels_last)


def test_conv_gradients_match_reference() -> None:
    g = fg.Graph(name="convgrad", compute_dtype="float32")
    x = g.tensor((2, 4, 7, 7), dtype="float32", name="x")
    w = g.tensor((6, 4, 3, 3), dtype="float32", name="w")
    dy = g.tensor((2, 6, 4, 4), dtype="float32", name="dy")
    dx = g.conv2d_backward_input(dy, w, (2, 4, 7, 7), stride=2, padding=1)
    dw = g.conv2d_backward_weight(x, dy, (6, 4, 3, 3), stride=2, padding=1)
    dx.set_output()
    dw.set_output()
    plan = g.build(device="cpu")
    assert [k.kind for k in plan.kernels] == ["convolution", "convolution"]
    xt, wt = torch.randn(2, 4, 7, 7, requires_grad=True), torch.randn(6, 4, 3, 3, requires_grad=True)
    out = torch.nn.functional.conv2d(xt, wt, stride=2, padding=1)
    dyt = torch.randn_like(out)
    out.backward(dyt)
    got = plan.execute({x: xt.detach(), w: wt.detach(), dy: dyt})
    assert_close(got[dx], xt.grad, what="dx")
    assert_close(got[dw], wt.grad, tol=1e-5, what="dw")


def test_batchnorm_with_constant_parameters_folds_into_the_conv_weights() -> None:
    torch.manual_seed(0)
    g = fg.Graph(name="folded", compute_dtype="float32")
    x = g.tensor((2, 8, 10, 10), dtype="float32", name="x")
    w = g.constant(torch.randn(16, 8, 3, 3), name="w")
    cb = g.constant(torch.randn(16), name="cb")
    rm, rv = g.constant(torch.randn(16), name="rm"), g.constant(torch.rand(16) + 0.5, name="rv")
    gw, gb = g.constant(torch.randn(16), name="gw"), g.constant(torch.randn(16), name="gb")
    y = g.relu(g.batch_norm(g.conv2d(x, w, cb, padding=1), rm, rv, weight=gw, bias=gb, training=False, eps=1e-3))
    y.set_output()
    plan = g.build(device="cpu")
    ops = [n.op for n in plan.graph.nodes]
    assert "batchnorm" not in ops and ops.count("conv2d") == 1
    (kernel,) = [k for k in plan.kernels if k.ops != ["constant"]]  # constants: zero-cost sources
    assert kernel.kind == "convolution" and kernel.ops == ["conv2d", "relu"]
    xt = torch.randn(2, 8, 10, 10)
    assert_close(plan(xt), fg.reference(g)(xt), tol=1e-5)


def test_cudnn_fused_conv_relu_candidate_only_for_a_relu_epilogue() -> None:
    from fusegraph.backends.conv_kernel import cudnn_fused_relu
    from fusegraph.fusion.epilogue import ConvGroup, claim_epilogues
    from fusegraph.fusion.partition import partition_graph

    def group_of(activation: str) -> ConvGroup:
        g = fg.Graph(name="cr", compute_dtype="float32")
        x = g.tensor((2, 4, 6, 6), dtype="float16", name="x")
        w = g.tensor((8, 4, 3, 3), dtype="float16", name="w")
        b = g.tensor((8,), dtype="float16", name="b")
        y = getattr(g, activation)(g.conv2d(x, w, b, padding=1))
        y.set_output()
        plan = g.build(device="cpu")
        (item,) = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
        assert isinstance(item, ConvGroup)
        return item

    relu = group_of("relu")
    assert cudnn_fused_relu(relu, "cpu") is None          # cuDNN only on the GPU
    assert callable(cudnn_fused_relu(relu, "cuda"))        # planned there (autotuned against conv + epilogue)
    assert cudnn_fused_relu(group_of("sigmoid"), "cuda") is None


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("case", [dict(stride=1, padding=1, groups=1, dilation=1),
                                  dict(stride=2, padding=0, groups=2, dilation=1),    # output padding 1
                                  dict(stride=2, padding=2, groups=1, dilation=2)])
def test_native_conv_gradients_match_torch(channels_last: bool, case: dict) -> None:
    """The GPU path of conv2d_backward_input / _weight (cuDNN's dgrad / wgrad in the operands' dtype,
    channels-last operands kept so) computes what torch.nn.grad does; run here on CPU in fp32."""
    from fusegraph.backends import cudnn

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 10, 10, generator=gen)
    w = torch.randn(6, 4 // case["groups"], 3, 3, generator=gen)
    out = torch.nn.functional.conv2d(x, w, **case)
    g = torch.randn(out.shape, generator=gen)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    xs, ws, gs = (t.contiguous(memory_format=fmt) for t in (x, w, g))
    attrs = {**case, "input_shape": tuple(x.shape), "weight_shape": tuple(w.shape)}
    dx = cudnn.conv2d_input_grad(attrs, g.shape[2:], w.shape[2:], channels_last)(gs, ws)
    dw = cudnn.conv2d_weight_grad(attrs, channels_last)(xs, gs)
    assert_close(dx, torch.nn.grad.conv2d_input(x.shape, w, g, **case))
    assert_close(dw, torch.nn.grad.conv2d_weight(x, w.shape, g, **case))
    assert dx.shape == x.shape and dw.shape == w.shape
    assert dx.is_contiguous(memory_format=fmt)
