"""Zero-copy views (fusion/views.py): views at kernel boundaries are strided aliases (kind "view",
no launch), reshapes around matmuls no longer block epilogue fusion, and SDPA reads q/k/v as
strided views of the fused qkv projection. Kernel counts are asserted on the torch.compile path
(the transformer block of bench/torch_backend_gpu.py) and on graphs built with fg.Graph."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.settings import settings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

from torch_backend_gpu import LAYOUT_OPS, Block, MatmulSoftmaxBlock  # the blocks measured on the GPU


def kernel_lists(compiled: torch.nn.Module) -> dict[str, list[str]]:
    """Per ATen graph kind: the launched kernels ("kind/backend: op+op") of its fusegraph partitions."""
    out: dict[str, list[str]] = {}
    for graph in compiled.fusegraph_report.graphs:
        out.setdefault(graph.kind, []).extend(k for p in graph.partitions if p.status == "fusegraph"
                                              for k in p.kernel_ops)
        assert all(p.status == "fusegraph" for p in graph.partitions), graph.partitions
    return out


def layout_only(kernels: list[str]) -> list[str]:
    return [k for k in kernels if set(k.split(": ", 1)[1].split("+")) <= LAYOUT_OPS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_block_inference_kernels_and_numerics(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Block(64, 4).to(dtype)
    x = torch.randn(2, 16, 64, dtype=dtype)
    torch._dynamo.reset()
    compiled = fg.compile(model)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert_close(got, want, tol=1e-4 if dtype == torch.float32 else 1e-2)
    kernels = kernel_lists(compiled)["inference"]
    # 2 layernorms, 4 GEMMs with their epilogues, 1 attention (was 25 kernels, 16 layout-only)
    assert len(kernels) <= 8, kernels
    assert len(layout_only(kernels)) <= 1, kernels
    gemms = [k for k in kernels if k.startswith("matmul/")]
    assert len(gemms) == 4, kernels
    # bias + residual in the fc2 epilogue, and in the proj's unless the residual goes to the layernorm
    # after it (settings.norm_residual, on by default); bias + gelu in fc1's
    assert sum(k.endswith("matmul+add+add") for k in gemms) == (1 if settings.norm_residual else 2), gemms
    assert any(k.startswith("reduction/") and k.split(": ")[1].startswith("add+") for k in kernels) \
        == settings.norm_residual, kernels
    assert any(k.endswith("matmul+add+gelu") for k in gemms), gemms
    assert not any(k.startswith("pointwise/") for k in kernels), kernels


def train_and_compare(model: torch.nn.Module, shape: tuple[int, ...]) -> torch.nn.Module:
    """One backward of `model` through fg.compile on a random input and output gradient: output,
    parameter and input gradients match eager (fp32, 1e-4); the compiled module."""
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    grad = torch.randn(*shape)
    torch._dynamo.reset()
    compiled = fg.compile(model)
    out = compiled(x)
    out.backward(grad)
    got = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    want_out = model(x)
    want_out.backward(grad)
    assert_close(out, want_out, tol=1e-4)
    for g, w in zip(got, [p.grad for p in model.parameters()] + [x.grad], strict=True):
        assert_close(g, w, tol=1e-4)
    return compiled


def test_block_training_gradients_match_eager() -> None:
    torch.manual_seed(0)
    compiled = train_and_compare(Block(64, 4), (2, 16, 64))
    kernels = kernel_lists(compiled)
    fwd = kernels["forward"]
    # the forward's GEMM epilogues fuse as in inference; q/k/v and the attention output are saved
    # for the backward (dense outputs): at most those copies are layout-only
    assert sum(k.startswith("matmul/") for k in fwd) == 4, fwd
    assert sum(k.endswith("matmul+add+add") for k in fwd) == (1 if settings.norm_residual else 2), fwd
    assert len(layout_only(fwd)) <= 4, fwd
    assert len(fwd) <= 11, fwd


class SplitHeadsAttention(torch.nn.Module):
    """GPT-2's attention layout: one qkv projection split into q, k, v, each viewed [B, T, H, D] and
    transposed to [B, H, T, D]; the backward concatenates dq, dk, dv back for the qkv weight gradient."""

    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.heads = torch.nn.Linear(d, 3 * d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)


def test_attention_gradients_feed_the_qkv_gradient_as_views() -> None:
    """dq/dk/dv are laid out [B, T, H, D] (views.attention_grad_layouts), so their transpose + reshape
    into the concatenated qkv gradient are views: no library reshape copies after the attention."""
    torch.manual_seed(0)
    compiled = train_and_compare(SplitHeadsAttention(), (2, 8, 32))
    bwd = kernel_lists(compiled)["backward"]
    assert any(k.startswith("attention/") for k in bwd), bwd
    assert not [k for k in bwd if k.endswith(": reshape")], bwd


def _views(plan: object) -> list[str]:
    return [k.nodes[0].op for k in plan.kernels if k.kind == "view"]


def test_graph_permute_slice_feed_matmul_without_copies() -> None:
    # y = x[:, 8:24].T @ w: the transpose becomes the matmul's trans_a flag (simplify), the slice a
    # strided view the GEMM reads in place (it was a copy kernel)
    g = fg.Graph(name="views_mm", compute_dtype="float32")
    x = g.tensor((16, 32), dtype="float32", name="x")
    w = g.tensor((16, 12), dtype="float32", name="w")
    xs = g.slice(x, dim=1, start=8, end=24)
    y = g.matmul(g.transpose(xs, 0, 1), w)
    y.set_output()
    plan = g.build(device="cpu")
    x_t, w_t = rand(16, 32), rand(16, 12)
    assert_close(plan(x_t, w_t), x_t[:, 8:24].T @ w_t, tol=1e-5)
    assert _views(plan) == ["slice"], [k.name for k in plan.kernels]
    assert [k.kind for k in plan.kernels if k.kind != "view"] == ["matmul"]


def test_graph_qkv_views_feed_attention() -> None:
    # q, k, v as views of one [B, T, 3, H, D] tensor, the attention output read back through
    # transpose + reshape into a matmul: no copy kernels, the output laid out [B, T, H, D]
    b, t, h, d = 2, 16, 2, 16
    g = fg.Graph(name="views_sdpa", compute_dtype="float32")
    qkv = g.tensor((b, t, 3 * h * d), dtype="float16", name="qkv")
    wo = g.tensor((h * d, h * d), dtype="float16", name="wo")
    heads = g.permute(g.reshape(qkv, b, t, 3, h, d), 2, 0, 3, 1, 4)
    q, k, v = (g.reshape(g.slice(heads, dim=0, start=i, end=i + 1), b, h, t, d) for i in range(3))
    att = g.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = g.matmul(g.reshape(g.transpose(att, 1, 2), b * t, h * d), wo)
    y.set_output()
    plan = g.build(device="cpu")
    assert [k.kind for k in plan.kernels if k.kind != "view"] == ["attention", "matmul"], \
        [f"{k.kind}: {'+'.join(k.ops)}" for k in plan.kernels]
    sdpa = next(k for k in plan.kernels if k.kind == "attention").nodes[0]
    assert sdpa.spec.strides == (t * h * d, d, h * d, 1)     # [B, T, H, D] in memory
    qkv_t, wo_t = rand(b, t, 3 * h * d, dtype=torch.float16), rand(h * d, h * d, dtype=torch.float16)
    q_t, k_t, v_t = qkv_t.view(b, t, 3, h, d).permute(2, 0, 3, 1, 4).float()
    att_t = F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True)
    want = att_t.transpose(1, 2).reshape(b * t, h * d) @ wo_t.float()
    assert_close(plan(qkv_t, wo_t).float(), want, tol=1e-2)


def test_regrouping_reshape_of_a_transposed_tensor_stays_a_copy() -> None:
    g = fg.Graph(name="copy", compute_dtype="float32")
    x = g.tensor((4, 6, 8), dtype="float32", name="x")
    w = g.tensor((24, 5), dtype="float32", name="w")
    y = g.matmul(g.reshape(g.transpose(x, 1, 2), 4 * 8, 6), g.slice(w, dim=0, end=6))
    y.set_output()
    plan = g.build(device="cpu")
    x_t, w_t = rand(4, 6, 8), rand(24, 5)
    assert_close(plan(x_t, w_t), x_t.transpose(1, 2).reshape(32, 6) @ w_t[:6], tol=1e-5)
    copies = [k for k in plan.kernels if k.kind != "view" and k.kind != "matmul"]
    assert len(copies) == 1 and "reshape" in copies[0].ops, [f"{k.kind}: {k.ops}" for k in plan.kernels]


def test_output_views_stay_dense() -> None:
    g = fg.Graph(name="out_view", compute_dtype="float32")
    x = g.tensor((8, 12), dtype="float32", name="x")
    w = g.tensor((12, 12), dtype="float32", name="w")
    y = g.matmul(x, w)
    g.transpose(y, 0, 1).set_output()     # a non-contiguous view: copied
    g.reshape(y, 4, 24).set_output()      # contiguous: an alias
    plan = g.build(device="cpu")
    x_t, w_t = rand(8, 12), rand(12, 12)
    t_out, r_out = plan(x_t, w_t)
    assert t_out.is_contiguous() and r_out.is_contiguous()
    assert_close(t_out, (x_t @ w_t).T, tol=1e-5)
    assert_close(r_out, (x_t @ w_t).reshape(4, 24), tol=1e-5)


def test_output_view_of_a_gemm_epilogue_is_an_alias() -> None:
    """An output that is a contiguous view (row slice, reshape) of a GEMM result or of its epilogue
    (a cast) aliases the buffer the GEMM kernel stores: no copy kernel; a transposed view is still a
    dense copy (test_output_views_stay_dense)."""
    g = fg.Graph(name="epilogue_views", compute_dtype="float32")
    x = g.tensor((8, 12), dtype="float16", name="x")
    w = g.tensor((12, 16), dtype="float16", name="w")
    y = g.cast(g.matmul(x, w), "float32")
    g.slice(y, 0, 0, 6).set_output()                 # leading rows: contiguous
    g.reshape(g.matmul(w, g.transpose(w, 0, 1)), 3, 48).set_output()
    plan = g.build(device="cpu")
    assert [k.kind for k in plan.kernels].count("matmul") == 2
    assert all(k.kind in ("matmul", "view", "constant") for k in plan.kernels), [k.ops for k in plan.kernels]
    assert any(k.kind == "matmul" and "cast" in k.ops for k in plan.kernels)   # the cast stays in the epilogue
    x_t, w_t = rand(8, 12, dtype=torch.float16), rand(12, 16, dtype=torch.float16)
    rows, flat = plan(x_t, w_t)
    want_rows, want_flat = fg.reference(g)(x_t, w_t)
    assert rows.shape == (6, 16) and rows.is_contiguous() and flat.shape == (3, 48) and flat.is_contiguous()
    assert_close(rows, want_rows, tol=5e-3)
    assert_close(flat.float(), want_flat.float(), tol=5e-3)


def test_sunk_reshape_keeps_partial_broadcasts_apart() -> None:
    # a [B, 1, N] operand does not broadcast over the flattened rows: the reshape stays where it is
    g = fg.Graph(name="partial", compute_dtype="float32")
    x = g.tensor((2, 4, 8), dtype="float32", name="x")
    w = g.tensor((8, 8), dtype="float32", name="w")
    s = g.tensor((2, 1, 8), dtype="float32", name="s")
    y = g.mul(g.reshape(g.matmul(g.reshape(x, 8, 8), w), 2, 4, 8), s)
    y.set_output()
    plan = g.build(device="cpu")
    x_t, w_t, s_t = rand(2, 4, 8), rand(8, 8), rand(2, 1, 8)
    assert_close(plan(x_t, w_t, s_t), (x_t.reshape(8, 8) @ w_t).reshape(2, 4, 8) * s_t, tol=1e-5)


def test_pointwise_result_stored_in_the_order_a_permute_reshape_reads() -> None:
    # the attention backward's (dq, dk, dv) stacked [3, B, H, T, D] -> permute -> reshape [B*T, 3*H*D]:
    # the pointwise kernel writes its result permuted, so the reshape is a view (it was a copy)
    g = fg.Graph(name="relayout", compute_dtype="float32")
    x = g.tensor((3, 2, 4, 8, 8), dtype="float32", name="x")
    w = g.tensor((3 * 4 * 8, 5), dtype="float32", name="w")
    y = g.matmul(g.reshape(g.permute(g.mul(x, 2.0), 1, 3, 0, 2, 4), 2 * 8, 3 * 4 * 8), w)
    y.set_output()
    plan = g.build(device="cpu")
    assert [k.kind for k in plan.kernels if k.kind != "view"] == ["pointwise", "matmul"], \
        [f"{k.kind}: {'+'.join(k.ops)}" for k in plan.kernels]
    x_t, w_t = rand(3, 2, 4, 8, 8), rand(96, 5)
    want = (x_t * 2).permute(1, 3, 0, 2, 4).reshape(16, 96) @ w_t
    assert_close(plan(x_t, w_t), want, tol=1e-5)


def test_misaligned_slice_stays_a_copy() -> None:
    # an alias starting 4 bytes into its base would hand the GEMM a pointer that is not 16-byte
    # aligned (generated kernels are compiled for aligned pointers): that slice is copied
    g = fg.Graph(name="misaligned", compute_dtype="float32")
    x = g.tensor((16, 33), dtype="float32", name="x")
    w = g.tensor((32, 8), dtype="float32", name="w")
    aligned = g.matmul(g.slice(x, dim=1, start=0, end=32), w)
    shifted = g.matmul(g.slice(x, dim=1, start=1, end=33), w)
    aligned.set_output()
    shifted.set_output()
    plan = g.build(device="cpu")
    view_starts = [k.nodes[0].attrs["start"] for k in plan.kernels if k.kind == "view"]
    assert view_starts == [0], [f"{k.kind}: {'+'.join(k.ops)}" for k in plan.kernels]
    x_t, w_t = rand(16, 33), rand(32, 8)
    a_out, s_out = plan(x_t, w_t)
    assert_close(a_out, x_t[:, :32] @ w_t, tol=1e-5)
    assert_close(s_out, x_t[:, 1:] @ w_t, tol=1e-5)


class ReluAttentionBlock(MatmulSoftmaxBlock):
    """MatmulSoftmaxBlock with relu in place of softmax: two batched GEMMs no attention op covers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.relu(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


@pytest.mark.parametrize("block", [MatmulSoftmaxBlock, ReluAttentionBlock])
def test_bmm_of_views_becomes_a_batched_matmul_without_copies(block: type) -> None:
    # view -> bmm -> view around q @ k^T and p @ v: the GEMMs take the [B, H] batch dims with their
    # strides (q, k, v stay views of the qkv projection); only att.transpose(1, 2).reshape copies.
    # With softmax between them the chain is one attention op reading the same views.
    torch.manual_seed(0)
    model = block(64, 4)
    x = torch.randn(2, 16, 64)
    torch._dynamo.reset()
    compiled = fg.compile(model)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert_close(got, want, tol=1e-4)
    kernels = kernel_lists(compiled)["inference"]
    assert len(kernels) <= 10 and len(layout_only(kernels)) <= 1, kernels   # was 13 (4 reshape copies)
    attention = sum(k.startswith("attention/") for k in kernels)
    assert attention == (1 if block is MatmulSoftmaxBlock else 0), kernels
    assert sum(k.startswith("matmul/") for k in kernels) == 6 - 2 * attention, kernels


def test_layouts_with_gaps_are_told_apart_from_dense_and_overlapping_ones():
    from fusegraph.fusion.views import dense_in_order, gapped

    q = (2, 4, 8, 16)                                   # [B, H, T, D] sliced out of [B, T, 3*H*D]
    qkv_view = (8 * 3 * 64, 16, 3 * 64, 1)
    assert gapped(q, qkv_view) and dense_in_order(q, qkv_view) == (512, 16, 64, 1)
    assert not gapped(q, (512, 128, 16, 1))             # contiguous
    assert not gapped(q, (512, 16, 64, 1))              # a dense permutation ([B, T, H, D] in memory)
    assert dense_in_order(q, (0, 16, 64, 1)) is None and not gapped(q, (0, 16, 64, 1))   # broadcast


def test_channels_last_pointwise_output_written_in_its_layout() -> None:
    """relu + max-pool of a channels-last tensor (no convolution, so no layout pass region): the plan
    writes its output channels-last (what torch returns), walking the domain channel-innermost so the
    NHWC loads coalesce, instead of NCHW order plus a restriding copy."""
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1)).eval()
    x = rand(2, 8, 12, 12).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        compiled = fg.compile(model)
        got, want = compiled(x), model(x)
    assert_close(got, want)
    assert got.stride() == want.stride()
    [graph] = compiled.fusegraph_report.graphs
    [part] = graph.partitions
    plan = part.plan_ref()
    assert len(plan.kernels) == 1   # no restriding copy inside the plan
    spec = plan.graph.outputs[0].spec
    assert spec.memory_strides == tuple(want.stride()), spec
    assert "offs % 8" in plan.kernels[0].source   # the channel (8 of them) is the innermost index
