"""matmul / linear, conv2d (+ data and weight gradients), scaled dot-product attention (+ backward):
op table against independent torch (float64 on the same values; autograd for the gradients),
exact costs, structure, and typed errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fusegraph as fg
from fusegraph.ir.registry import COMPOSITE, MATMUL, get_op
from fusegraph.passes.decompose import decompose_graph
from optable import OpCase, const, make, params, run_case, seeded

# ---------------------------------------------------------------- matmul / linear

LINALG = [
    OpCase("mm_odd", [make(13, 37), make(37, 11)], lambda g, a, b: g.matmul(a, b), lambda a, b: a @ b),
    OpCase("bmm_broadcast", [make(2, 1, 5, 7), make(3, 7, 4)], lambda g, a, b: g.matmul(a, b),
           lambda a, b: torch.matmul(a, b)),
    OpCase("mm_trans_a", [make(37, 13), make(37, 11)], lambda g, a, b: g.matmul(a, b, transpose_a=True),
           lambda a, b: a.t() @ b),
    OpCase("bmm_trans_b_noncontig", [make(3, 13, 9, transpose=(1, 2)), make(3, 6, 9, transpose=(0, 1))],
           lambda g, a, b: g.matmul(a, b, transpose_b=True), lambda a, b: a @ b.transpose(-1, -2)),
    OpCase("mm_trans_both", [make(9, 5), make(4, 9)], lambda g, a, b: g.matmul(a, b, True, True),
           lambda a, b: a.t() @ b.t()),
    OpCase("mm_strided_slice", [make(10, 8, step=2), make(8, 5, transpose=(0, 1))],
           lambda g, a, b: g.matmul(a, b), lambda a, b: a @ b),
    OpCase("matvec_1d_a", [make(7), make(2, 7, 3)], lambda g, a, b: g.matmul(a, b), torch.matmul),
    OpCase("matvec_1d_b", [make(2, 3, 7), make(7)], lambda g, a, b: g.matmul(a, b), torch.matmul),
    OpCase("dot_1d", [make(33), make(33)], lambda g, a, b: g.matmul(a, b), torch.matmul),
    OpCase("linear_bias", [make(2, 5, 17), make(9, 17), make(9)], lambda g, x, w, b: g.linear(x, w, b),
           F.linear),
    OpCase("linear_nobias_noncontig", [make(6, 17, transpose=(0, 1)), make(4, 17)],
           lambda g, x, w: g.linear(x, w), lambda x, w: x @ w.t()),
]


@pytest.mark.parametrize(("case", "dtype"), params(LINALG))
def test_linalg_table(case: OpCase, dtype: torch.dtype) -> None:
    run_case(case, dtype)


# ---------------------------------------------------------------- convolution

def _conv_input_grad(shape, stride=1, padding=0, dilation=1, groups=1):  # type: ignore[no-untyped-def]
    def expect(grad_out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
        F.conv2d(x, w, None, stride, padding, dilation, groups).backward(grad_out)
        return x.grad
    return expect


def _conv_weight_grad(shape, stride=1, padding=0, dilation=1, groups=1):  # type: ignore[no-untyped-def]
    def expect(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        w = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
        F.conv2d(x, w, None, stride, padding, dilation, groups).backward(grad_out)
        return w.grad
    return expect


CONV = [
    OpCase("conv_bias_pad", [make(2, 3, 9, 11), make(4, 3, 3, 3), make(4)],
           lambda g, x, w, b: g.conv2d(x, w, b, padding=1), lambda x, w, b: F.conv2d(x, w, b, padding=1)),
    OpCase("conv_stride_dilation", [make(1, 4, 13, 10), make(6, 4, 3, 2)],
           lambda g, x, w: g.conv2d(x, w, stride=(2, 1), padding=(1, 0), dilation=(2, 1)),
           lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=(1, 0), dilation=(2, 1))),
    OpCase("conv_groups_noncontig", [make(2, 6, 7, 7, transpose=(2, 3)), make(9, 2, 3, 3)],
           lambda g, x, w: g.conv2d(x, w, groups=3, padding="same"),
           lambda x, w: F.conv2d(x, w, groups=3, padding=1)),
    OpCase("conv_depthwise_nhwc", [make(2, 4, 8, 8), make(4, 1, 3, 3), make(4)],
           lambda g, x, w, b: g.conv2d(x, w, b, stride=2, padding=1, groups=4),
           lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, groups=4), channels_last=(0,)),
    OpCase("conv_bwd_input", [make(2, 6, 5, 6), make(6, 2, 3, 3)],
           lambda g, go, w: g.conv2d_backward_input(go, w, (2, 4, 9, 11), stride=2, padding=1, groups=2),
           _conv_input_grad((2, 4, 9, 11), stride=2, padding=1, groups=2)),
    OpCase("conv_bwd_input_dilated", [make(1, 5, 6, 8), make(5, 3, 3, 2)],
           lambda g, go, w: g.conv2d_backward_input(go, w, (1, 3, 8, 9), padding=(1, 0), dilation=(2, 1)),
           _conv_input_grad((1, 3, 8, 9), padding=(1, 0), dilation=(2, 1))),
    OpCase("conv_bwd_weight", [make(2, 4, 9, 11), make(2, 6, 5, 6)],
           lambda g, x, go: g.conv2d_backward_weight(x, go, (6, 2, 3, 3), stride=2, padding=1, groups=2),
           _conv_weight_grad((6, 2, 3, 3), stride=2, padding=1, groups=2)),
    OpCase("conv_bwd_weight_noncontig", [make(1, 3, 8, 9, transpose=(2, 3)), make(1, 5, 6, 8)],
           lambda g, x, go: g.conv2d_backward_weight(x, go, (5, 3, 3, 2), padding=(1, 0), dilation=(2, 1)),
           _conv_weight_grad((5, 3, 3, 2), padding=(1, 0), dilation=(2, 1))),
]


@pytest.mark.parametrize(("case", "dtype"), params(CONV))
def test_conv_table(case: OpCase, dtype: torch.dtype) -> None:
    run_case(case, dtype)


def test_conv_keeps_channels_last_layout() -> None:
    g = fg.Graph()
    x = g.tensor((2, 4, 8, 8), layout="NHWC")
    w = g.tensor((8, 4, 3, 3))
    y = g.conv2d(x, w, padding=1)
    assert y.spec.layout == "NHWC" and y.shape == (2, 8, 8, 8)
    dx = g.conv2d_backward_input(y, w, (2, 4, 8, 8), padding=1)
    assert dx.spec.layout == "NHWC"


# ---------------------------------------------------------------- attention

def _sdpa(**kw):  # type: ignore[no-untyped-def]
    return lambda q, k, v, *mask: F.scaled_dot_product_attention(q, k, v, *mask, **kw)


def _sdpa_grads(**kw):  # type: ignore[no-untyped-def]
    def expect(q, k, v, grad_out, *mask):  # type: ignore[no-untyped-def]
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(q, k, v, *mask, **kw).backward(grad_out)
        return q.grad, k.grad, v.grad
    return expect


def _bwd(with_lse: bool = False, **kw):  # type: ignore[no-untyped-def]
    def build(g, q, k, v, grad_out, *mask):  # type: ignore[no-untyped-def]
        m = mask[0] if mask else None
        if with_lse:
            out, lse = g.scaled_dot_product_attention(q, k, v, m, return_lse=True, **kw)
        else:
            out, lse = g.scaled_dot_product_attention(q, k, v, m, **kw), None
        return g.sdpa_backward(grad_out, q, k, v, out, lse=lse, attn_mask=m, **kw)
    return build


_BOOL_MASK = torch.rand(2, 1, 5, 7, generator=seeded(0)) > 0.4
_BOOL_MASK[..., 0] = True  # every query sees at least one key (torch's math path gives NaN otherwise)

ATTENTION = [
    OpCase("sdpa_basic_dv", [make(2, 3, 5, 8), make(2, 3, 7, 8), make(2, 3, 7, 6)],
           lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v), _sdpa()),
    OpCase("sdpa_causal", [make(1, 2, 6, 16), make(1, 2, 6, 16), make(1, 2, 6, 16)],
           lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v, is_causal=True), _sdpa(is_causal=True)),
    OpCase("sdpa_causal_rect", [make(1, 2, 5, 8), make(1, 2, 9, 8), make(1, 2, 9, 8)],
           lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v, is_causal=True), _sdpa(is_causal=True)),
    OpCase("sdpa_float_mask_scale", [make(2, 2, 5, 8), make(2, 2, 7, 8), make(2, 2, 7, 8), make(5, 7)],
           lambda g, q, k, v, m: g.scaled_dot_product_attention(q, k, v, m, scale=0.3),
           _sdpa(scale=0.3)),
    OpCase("sdpa_bool_mask", [make(2, 3, 5, 8), make(2, 3, 7, 8), make(2, 3, 7, 8), const(_BOOL_MASK)],
           lambda g, q, k, v, m: g.scaled_dot_product_attention(q, k, v, attn_mask=m), _sdpa()),
    OpCase("sdpa_gqa_noncontig", [make(1, 4, 5, 8, transpose=(1, 2)), make(1, 2, 7, 8), make(1, 2, 7, 8)],
           lambda g, q, k, v: g.scaled_dot_product_attention(q, k, v, enable_gqa=True), _sdpa(enable_gqa=True)),
    OpCase("sdpa_bwd", [make(2, 2, 5, 8), make(2, 2, 7, 8), make(2, 2, 7, 8), make(2, 2, 5, 8)],
           _bwd(), _sdpa_grads()),
    OpCase("sdpa_bwd_causal_lse", [make(1, 2, 6, 8), make(1, 2, 6, 8), make(1, 2, 6, 8), make(1, 2, 6, 8)],
           _bwd(with_lse=True, is_causal=True), _sdpa_grads(is_causal=True)),
    OpCase("sdpa_bwd_gqa_mask", [make(1, 4, 5, 8), make(1, 2, 7, 8), make(1, 2, 7, 6), make(1, 4, 5, 6),
                                 make(1, 1, 5, 7)],
           _bwd(enable_gqa=True, scale=0.2), _sdpa_grads(enable_gqa=True, scale=0.2)),
    OpCase("sdpa_bwd_bool_mask_noncontig", [make(2, 3, 5, 8, transpose=(1, 2)), make(2, 3, 7, 8),
                                            make(2, 3, 7, 8), make(2, 3, 5, 8), const(_BOOL_MASK)],
           _bwd(), _sdpa_grads()),
]


@pytest.mark.parametrize(("case", "dtype"), params(ATTENTION))
def test_attention_table(case: OpCase, dtype: torch.dtype) -> None:
    run_case(case, dtype)


def test_sdpa_lse_and_fully_masked_rows() -> None:
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool)
    mask[..., 2, :] = False   # query 2 sees no key
    g = fg.Graph()
    hq, hk, hv, hm = (g.tensor_like(t) for t in (q, k, v, mask))
    out, lse = g.scaled_dot_product_attention(hq, hk, hv, hm, return_lse=True)
    out.set_output()
    lse.set_output()
    got_out, got_lse = fg.reference(g)(q, k, v, mask)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(8)
    want_lse = torch.logsumexp(scores, dim=-1)
    keep = torch.tensor([0, 1, 3])
    torch.testing.assert_close(got_lse[..., keep].double(), want_lse[..., keep])
    assert torch.isneginf(got_lse[..., 2]).all() and (got_out[..., 2, :] == 0).all()
    want = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got_out[..., keep, :], want[..., keep, :])


# ---------------------------------------------------------------- costs and structure

def _cost(handle: fg.Tensor) -> tuple[int, int]:
    node = handle.node
    cost = get_op(node.op).cost([i.spec for i in node.inputs], list(node.specs), node.attrs)
    return cost.bytes, cost.flops


def test_exact_costs() -> None:
    g = fg.Graph()
    a, b = g.tensor((2, 3, 5, 7), "float16"), g.tensor((7, 4), "float16")
    assert _cost(g.matmul(a, b)) == (2 * (210 + 28 + 120), 2 * 5 * 4 * 7 * 6)
    at = g.tensor((2, 3, 7, 5), "float16")
    assert _cost(g.matmul(at, b, transpose_a=True)) == (2 * (210 + 28 + 120), 2 * 5 * 4 * 7 * 6)
    x, w, bias = g.tensor((2, 6, 7, 7)), g.tensor((9, 2, 3, 3)), g.tensor((9,))
    y = g.conv2d(x, w, bias, padding=1, groups=3)
    conv_flops = 2 * 2 * 9 * 7 * 7 * 2 * 3 * 3
    assert _cost(y) == (4 * (2 * 6 * 49 + 9 * 18 + 9 + 2 * 9 * 49), conv_flops + 2 * 9 * 49)
    assert _cost(g.conv2d_backward_input(y, w, (2, 6, 7, 7), padding=1, groups=3))[1] == conv_flops
    assert _cost(g.conv2d_backward_weight(x, y, (9, 2, 3, 3), padding=1, groups=3))[1] == conv_flops
    q = g.tensor((2, 4, 8, 16), "bfloat16")
    kv = g.tensor((2, 2, 8, 16), "bfloat16")
    out = g.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    fwd = 4 * 2 * 4 * 8 * 8 * 16 // 2
    assert _cost(out) == (2 * (2 * 4 * 8 * 16 * 2 + 2 * 2 * 2 * 8 * 16), fwd)
    dq, dk, dv = g.sdpa_backward(out, q, kv, kv, out, is_causal=True, enable_gqa=True)
    assert (dq.shape, dk.shape, dv.shape) == ((2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16))
    bytes_in = 2 * (3 * 2 * 4 * 8 * 16 + 2 * 2 * 2 * 8 * 16)
    assert _cost_of_multi(dq) == (bytes_in + 2 * (2 * 4 * 8 * 16 + 2 * 2 * 2 * 8 * 16), fwd * 5 // 2)


def _cost_of_multi(getitem: fg.Tensor) -> tuple[int, int]:
    node = getitem.node.inputs[0]
    cost = get_op(node.op).cost([i.spec for i in node.inputs], list(node.specs), node.attrs)
    return cost.bytes, cost.flops


def test_linear_decomposes_to_matmul_trans_b_plus_add() -> None:
    g = fg.Graph()
    x, w, b = g.tensor((4, 8)), g.tensor((3, 8)), g.tensor((3,))
    y = g.linear(x, w, b)
    y.set_output()
    assert get_op("linear").has(COMPOSITE) and get_op("matmul").has(MATMUL)
    ir = decompose_graph(g.to_ir())
    ops = [n.op for n in ir.nodes if n.op != "input"]
    assert ops == ["matmul", "add"]
    mm = next(n for n in ir.nodes if n.op == "matmul")
    assert mm.attrs["trans_b"] is True and mm.attrs["trans_a"] is False
    xt, wt, bt = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
    torch.testing.assert_close(fg.reference(ir)(xt, wt, bt), F.linear(xt, wt, bt))


def test_sdpa_backward_is_one_node_split_by_getitems() -> None:
    g = fg.Graph()
    q = g.tensor((1, 2, 4, 8))
    grads = g.sdpa_backward(q, q, q, q, q)
    assert len(grads) == 3 and all(t.node.op == "getitem" for t in grads)
    assert len({t.node.inputs[0].id for t in grads}) == 1
    assert grads[0].node.inputs[0].op == "sdpa_backward"


# ---------------------------------------------------------------- typed errors

def _graph_and(*shapes, dtype="float32"):  # type: ignore[no-untyped-def]
    g = fg.Graph()
    return g, [g.tensor(s, dtype) for s in shapes]


def test_matmul_errors() -> None:
    g, (a, b) = _graph_and((3, 4), (5, 6))
    with pytest.raises(fg.ShapeError, match=r"op matmul.*K=4.*K=5"):
        g.matmul(a, b)
    g, (a, b) = _graph_and((2, 3, 4), (3, 4, 5))
    with pytest.raises(fg.ShapeError, match=r"op matmul.*batch dims.*\(2, 3, 4\).*\(3, 4, 5\)"):
        g.matmul(a, b)
    g = fg.Graph()
    with pytest.raises(fg.DTypeError, match=r"op matmul.*float32 and float16"):
        g.matmul(g.tensor((3, 4)), g.tensor((4, 5), "float16"))
    with pytest.raises(fg.DTypeError, match=r"op matmul.*int32"):
        g.matmul(g.tensor((3, 4), "int32"), g.tensor((4, 5), "int32"))
    g, (x, w) = _graph_and((2, 7), (3, 8))
    with pytest.raises(fg.ShapeError, match=r"op linear.*in_features 7.*\(3, 8\) expects 8"):
        g.linear(x, w)


def test_conv_errors() -> None:
    g, (x, w) = _graph_and((1, 4, 8, 8), (6, 3, 3, 3))
    with pytest.raises(fg.ShapeError, match=r"op conv2d.*3 input channels per group.*C/groups=4"):
        g.conv2d(x, w)
    g, (x, w) = _graph_and((1, 4, 8, 8), (6, 1, 3, 3))
    with pytest.raises(fg.ShapeError, match=r"op conv2d.*groups=3 must divide.*C=4.*K=6"):
        g.conv2d(x, w, groups=3)
    g, (x, w) = _graph_and((1, 4, 8, 8), (6, 4, 3, 3))
    with pytest.raises(fg.ShapeError, match=r"op conv2d.*stride=\(0, 0\)"):
        g.conv2d(x, w, stride=0)
    with pytest.raises(fg.ShapeError, match=r"op conv2d.*empty output"):
        g.conv2d(x, w, dilation=5)
    g, (go, w) = _graph_and((1, 6, 5, 5), (6, 4, 3, 3))
    with pytest.raises(fg.ShapeError, match=r"op conv2d_backward_input.*\(1, 6, 5, 5\).*\(1, 6, 6, 6\)"):
        g.conv2d_backward_input(go, w, (1, 4, 8, 8))


def test_attention_errors() -> None:
    g, (q, kv) = _graph_and((1, 6, 5, 8), (1, 4, 5, 8))
    with pytest.raises(fg.ShapeError, match=r"op scaled_dot_product_attention.*H=6.*Hk=4"):
        g.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    with pytest.raises(fg.ShapeError, match=r"6 heads.*have 4.*enable_gqa"):
        g.scaled_dot_product_attention(q, kv, kv)
    with pytest.raises(fg.UnsupportedError, match=r"op scaled_dot_product_attention.*dropout_p=0.1"):
        g.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    g, (q, mask) = _graph_and((1, 2, 5, 8), (3, 5))
    with pytest.raises(fg.ShapeError, match=r"attn_mask of shape \(3, 5\).*\(1, 2, 5, 5\)"):
        g.scaled_dot_product_attention(q, q, q, mask)
    g, (q, k) = _graph_and((1, 2, 5, 8), (1, 2, 5, 4))
    with pytest.raises(fg.ShapeError, match=r"head dims differ.*D=8.*D=4"):
        g.scaled_dot_product_attention(q, k, k)
    g = fg.Graph()
    q = g.tensor((1, 2, 5, 8))
    with pytest.raises(fg.DTypeError, match=r"attn_mask must be bool or floating point, got int64"):
        g.scaled_dot_product_attention(q, q, q, g.tensor((5, 5), "int64"))
    with pytest.raises(fg.ShapeError, match=r"query must be 4-D.*\(2, 5, 8\)"):
        g.scaled_dot_product_attention(g.tensor((2, 5, 8)), q, q)
    with pytest.raises(fg.ShapeError, match=r"op sdpa_backward.*grad_out has shape \(1, 2, 4, 8\)"):
        g.sdpa_backward(g.tensor((1, 2, 4, 8)), q, q, q, q)


def test_reference_matmul_restores_the_users_fp32_precision() -> None:
    g = fg.Graph()
    a = g.tensor((4, 4))
    g.matmul(a, a).set_output()
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        fg.reference(g)(torch.randn(4, 4))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
