"""Attention in the torch backend: layouts of library attention outputs inside a Plan, and the
training-time ATen attention ops (memory-efficient, cuDNN, forward and backward) translated onto
our scaled_dot_product_attention(return_lse=True) / sdpa_backward."""

from __future__ import annotations

import torch

import fusegraph as fg
from conftest import assert_close
from fusegraph.backends import attention_kernel

F16 = torch.float16


def test_attention_output_laid_out_like_torch_sdpa_is_read_correctly(monkeypatch):
    # torch's SDPA backends return out [B, H, S, D] laid out as [B, S, H, D]; the generated kernel
    # after it reads with the spec's (dense) strides, so the kernel must hand over dense memory
    def transposed_layout(node, problem, config):
        def launch(args):
            out = torch.nn.functional.scaled_dot_product_attention(
                args[0].float(), args[1].float(), args[2].float(), is_causal=problem.causal).to(args[0].dtype)
            return [out.transpose(1, 2).contiguous().transpose(1, 2)]
        return launch

    monkeypatch.setattr(attention_kernel, "_triton_forward", transposed_layout)
    g = fg.Graph(name="sdpa_then_reshape", compute_dtype="float32")
    q, k, v = (g.tensor((2, 2, 16, 16), dtype="float16", name=n) for n in "qkv")
    att = g.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = g.mul(g.reshape(g.transpose(att, 1, 2), (2, 16, 32)), 2.0)
    y.set_output()
    plan = g.build(device="cpu")
    assert any(kern.kind == "attention" and kern.backend == "triton" for kern in plan.kernels)
    xs = [torch.randn(2, 2, 16, 16, dtype=F16) for _ in range(3)]
    assert_close(plan(*xs), fg.reference(g)(*xs), what="sdpa -> transpose -> reshape")


# ---- training-time CUDA attention ops, traced on CPU through their meta functions ----

import pytest  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from fusegraph.frontends.torch_partition import partition_graph  # noqa: E402

aten = torch.ops.aten
B, H, S, D = 2, 2, 40, 16   # S = 40: the memory-efficient lse is padded to 64


def _efficient(q, k, v):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True, 0.0, True)
    return out, lse, seed, offset


def _efficient_backward(do, q, k, v, out, lse, seed, offset):
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward.default(
        do, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True)
    return dq, dk, dv


def _cudnn(q, k, v):
    r = aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, True, 0.0, True)
    return r[0], r[1], r[6], r[7]


def _cudnn_backward(do, q, k, v, out, lse, seed, offset):
    return aten._scaled_dot_product_cudnn_attention_backward.default(
        do, q, k, v, out, lse, seed, offset, None, None, None, S, S, 0.0, True)


def _flash(q, k, v):
    r = aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, True)
    return r[0], r[1], r[6], r[7]


def _flash_backward(do, q, k, v, out, lse, seed, offset):
    return aten._scaled_dot_product_flash_attention_backward.default(
        do, q, k, v, out, lse, None, None, S, S, 0.0, True, seed, offset)


def _compiled(fn, kind, *example):
    gm = make_fx(fn, tracing_mode="fake")(*example)
    split, record = partition_graph(gm, kind, {}, lambda message: None)
    assert record.fallbacks == {} and [p.status for p in record.partitions] == ["fusegraph"], record
    (part,) = record.partitions
    assert len(part.kernel_ops) == part.kernels and any(k.startswith("attention/") for k in part.kernel_ops)
    return split


@pytest.mark.parametrize("dtype", [torch.float32, F16])
@pytest.mark.parametrize("ops", ["efficient", "cudnn", "flash"])
def test_training_attention_ops_forward_and_backward_are_ours(ops, dtype):
    # AOTAutograd splits forward and backward into two graphs: out, lse and the RNG state cross
    # between them; both halves are translated, so our lse (in torch's padded/unit-dim shape) feeds
    # our backward, and the RNG state is a placeholder nobody reads
    forward, backward = {"efficient": (_efficient, _efficient_backward), "cudnn": (_cudnn, _cudnn_backward),
                         "flash": (_flash, _flash_backward)}[ops]
    if ops == "flash" and dtype == torch.float32:
        pytest.skip("flash attention is half precision only")
    q, k, v, do = (torch.randn(B, H, S, D).to(dtype) for _ in range(4))
    fwd = _compiled(forward, "forward", q, k, v)
    out, lse, seed, offset = fwd(q, k, v)
    assert lse.dtype == torch.float32
    bwd = _compiled(backward, "backward", do, q, k, v, out, lse, seed, offset)
    dq, dk, dv = bwd(do, q, k, v, out, lse, seed, offset)
    kernels = [kern for part in (fwd, bwd) for name, mod in part.named_children() if name.startswith("fused")
               for kern in mod.plan.kernels if kern.kind == "attention"]
    assert [kern.backend for kern in kernels] == ["triton" if dtype == F16 else "reference"] * 2
    leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    ref.backward(do.float())
    for name, got, want in [("out", out, ref), ("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad),
                            ("dv", dv, leaves[2].grad)]:
        assert got.dtype == dtype
        assert_close(got.float(), want, tol=1e-5 if dtype == torch.float32 else 5e-3, what=name)
    want_lse = torch.logsumexp(q.float() @ k.float().transpose(-1, -2) / D ** 0.5
                               + torch.full((S, S), float("-inf")).triu(1), dim=-1)
    assert_close(lse.reshape(B, H, -1)[..., :S], want_lse, what="lse (natural log)")


def test_efficient_attention_with_a_bias():
    # an additive bias is our float mask; with is_causal too (torch's fused kernels allow it, we do
    # not) the op stays eager and says why, the rest of the graph is still ours
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    bias = torch.randn(B, H, S, S)

    def biased(q, k, v, bias):
        return aten._scaled_dot_product_efficient_attention.default(q, k, v, bias, False, 0.0, False)[0]

    out = _compiled(biased, "inference", q, k, v, bias)(q, k, v, bias)
    assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias))

    def biased_causal(q, k, v, bias):
        return aten._scaled_dot_product_efficient_attention.default(q * 2, k, v, bias, False, 0.0, True)[0]

    gm = make_fx(biased_causal, tracing_mode="fake")(q, k, v, bias)
    _, record = partition_graph(gm, "inference", {}, lambda message: None)
    assert record.fallbacks == {("aten._scaled_dot_product_efficient_attention.default",
                                 "attention bias together with is_causal"): 1}
    assert [p.status for p in record.partitions] == ["fusegraph"]   # q * 2
