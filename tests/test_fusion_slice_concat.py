"""Slice and concat folded into generated kernels (fusion/index_map.py): a slice reads its input at
start + step * i, a concat selects its input per element with masked, shifted loads, so RoPE,
chunk -> silu(a) * b and concats with pointwise consumers are one kernel each."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.fusion.index_map import Affine, shifted

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

DTYPES = [("float32", torch.float32), ("float16", torch.float16)]


def _run(g: fg.Graph, feeds: list[torch.Tensor]) -> fg.Graph:
    plan = g.build(device="cpu")
    outs = plan(*feeds)
    refs = fg.reference(g)(*feeds)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    for k, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert_close(o, r, what=f"output {k}")
    return plan


def _launched(plan: object) -> list:
    """Kernels that run something (not zero-copy views)."""
    return [k for k in plan.kernels if k.kind != "view"]  # type: ignore[attr-defined]


def _one_generated_kernel(plan: object) -> str:
    kernels = _launched(plan)
    assert [(k.backend, k.kind) for k in kernels] == [("triton", "pointwise")], \
        [(k.name, k.backend, k.kind) for k in kernels]
    assert not any(k.kind == "library" for k in plan.kernels)  # type: ignore[attr-defined]
    return str(kernels[0].source)


def test_affine_composition() -> None:
    assert shifted(2, 0, 1) == 2
    assert shifted(2, 3, 2) == Affine(2, 2, 3)
    assert shifted(Affine(2, 2, 3), -3, 1) == Affine(2, 2, 0)
    assert shifted(Affine(2, 2, 3), 1, 3) == Affine(2, 6, 10)
    assert shifted(None, 0) is None and shifted(None, 5) == Affine(None, 0, 5)
    assert shifted(Affine(1, 1, -4), 4) == 1


@pytest.mark.parametrize("dt,tdt", DTYPES)
def test_rope_rotate_half_is_one_kernel(dt: str, tdt: torch.dtype) -> None:
    B, S, H, D = 2, 5, 3, 8
    g = fg.Graph("rope")
    x = g.tensor((B, S, H, D), dt, "x")
    cos, sin = g.tensor((S, 1, D), dt, "cos"), g.tensor((S, 1, D), dt, "sin")
    first, second = g.slice(x, 3, 0, D // 2), g.slice(x, 3, D // 2, D)
    (x * cos + g.cat([g.neg(second), first], dim=3) * sin).set_output()
    plan = _run(g, [rand(B, S, H, D, dtype=tdt), rand(S, 1, D, dtype=tdt), rand(S, 1, D, dtype=tdt)])
    source = _one_generated_kernel(plan)
    assert source.count("tl.load(in0") == 3 and "tl.where" in source


def test_rope_transposed_heads_odd_head_dim_is_one_kernel() -> None:
    """[B, S, H, D] read as [B, H, S, D] (the llama layout), an odd half (D = 10: halves of 5)."""
    B, S, H, D = 2, 3, 4, 10
    g = fg.Graph("rope_t")
    x = g.tensor((B, S, H, D), "float32", "x")
    cos, sin = g.tensor((S, D), "float32", "cos"), g.tensor((S, D), "float32", "sin")
    t = g.transpose(x, 1, 2)
    first, second = g.slice(t, 3, 0, D // 2), g.slice(t, 3, D // 2, D)
    (t * cos + g.cat([g.neg(second), first], dim=3) * sin).set_output()
    _one_generated_kernel(_run(g, [rand(B, S, H, D), rand(S, D), rand(S, D)]))


@pytest.mark.parametrize("dt,tdt", DTYPES)
def test_rope_interleaved_is_one_kernel(dt: str, tdt: torch.dtype) -> None:
    """Pairs (x[2j], x[2j+1]) rotated: step-2 slices, results stacked on a new last dim."""
    B, S, H, D = 2, 4, 3, 8
    g = fg.Graph("rope_i")
    x = g.tensor((B, S, H, D), dt, "x")
    cos, sin = g.tensor((S, 1, D // 2), dt, "cos"), g.tensor((S, 1, D // 2), dt, "sin")
    even, odd = g.slice(x, 3, 0, D, 2), g.slice(x, 3, 1, D, 2)
    r0, r1 = even * cos - odd * sin, even * sin + odd * cos
    g.cat([g.reshape(r0, (B, S, H, D // 2, 1)), g.reshape(r1, (B, S, H, D // 2, 1))], dim=4).set_output()
    plan = _run(g, [rand(B, S, H, D, dtype=tdt), rand(S, 1, D // 2, dtype=tdt), rand(S, 1, D // 2, dtype=tdt)])
    assert "* 2" in _one_generated_kernel(plan)


@pytest.mark.parametrize("dt,tdt", DTYPES)
def test_concat_of_three_with_pointwise_consumer_is_one_kernel(dt: str, tdt: torch.dtype) -> None:
    g = fg.Graph("cat3")
    a, b, c = g.tensor((4, 3, 5), dt, "a"), g.tensor((4, 7, 5), dt, "b"), g.tensor((4, 2, 5), dt, "c")
    bias = g.tensor((12, 5), dt, "bias")
    g.sigmoid(g.cat([g.exp(a), b, c * 2.0], dim=1) + bias).set_output()
    plan = _run(g, [rand(4, 3, 5, dtype=tdt), rand(4, 7, 5, dtype=tdt), rand(4, 2, 5, dtype=tdt),
                    rand(12, 5, dtype=tdt)])
    source = _one_generated_kernel(plan)
    assert source.count("tl.where") == 2
    concat_loads = [line for line in source.splitlines() if any(f"tl.load(in{k} " in line for k in range(3))]
    assert len(concat_loads) == 3 and all("mask=(mask) & " in line for line in concat_loads)  # no read past an input


@pytest.mark.parametrize("dim", [0, -1])
def test_concat_along_first_and_last_dim(dim: int) -> None:
    shapes = [(3, 5), (2, 5), (1, 5)] if dim == 0 else [(4, 3), (4, 6), (4, 1)]
    g = fg.Graph("cat_dims")
    xs = [g.tensor(s, "float32", f"x{k}") for k, s in enumerate(shapes)]
    g.relu(g.cat(xs, dim=dim)).set_output()
    _one_generated_kernel(_run(g, [rand(*s) for s in shapes]))


@pytest.mark.parametrize("dt,tdt", DTYPES)
def test_chunk_silu_gate_is_one_kernel(dt: str, tdt: torch.dtype) -> None:
    """A gated MLP's chunk(2) -> silu(a) * b, on an odd row width."""
    g = fg.Graph("swiglu")
    h = g.tensor((6, 2 * 37), dt, "h")
    (g.silu(g.slice(h, 1, 0, 37)) * g.slice(h, 1, 37, 74)).set_output()
    _one_generated_kernel(_run(g, [rand(6, 74, dtype=tdt)]))


def test_step_two_slice_with_offset_and_odd_sizes() -> None:
    g = fg.Graph("strided")
    x = g.tensor((5, 23), "float32", "x")
    y = g.tensor((5, 9), "float32", "y")
    g.add(g.slice(x, 1, 3, 21, 2), y).set_output()      # columns 3, 5, ..., 19
    source = _one_generated_kernel(_run(g, [rand(5, 23), rand(5, 9)]))
    assert "* 2 + 3" in source


def test_slice_to_size_one_and_slice_of_slice() -> None:
    g = fg.Graph("narrow")
    x = g.tensor((4, 9, 6), "float32", "x")
    col = g.slice(x, 1, 7, 8)                                   # [4, 1, 6]: a constant index
    inner = g.slice(g.slice(x, 1, 1, 9, 2), 1, 1, 4)            # columns 3, 5, 7
    g.mul(inner, col).set_output()
    _one_generated_kernel(_run(g, [rand(4, 9, 6)]))


def test_slice_graph_output_and_concat_of_slices() -> None:
    """A slice as an output of its own; a concat reassembling slices of one tensor (a roll)."""
    g = fg.Graph("roll")
    x = g.tensor((3, 10), "float32", "x")
    g.exp(g.slice(x, 1, 2, 6)).set_output()
    g.neg(g.cat([g.slice(x, 1, 7, 10), g.slice(x, 1, 0, 7)], dim=1)).set_output()
    plan = _run(g, [rand(3, 10)])
    assert all(k.backend == "triton" for k in _launched(plan)) and len(_launched(plan)) == 2


def test_concat_feeding_a_reduction() -> None:
    """sum over the concat dim and softmax across a concat: the concat is inlined in the reduction."""
    g = fg.Graph("cat_sum")
    a, b = g.tensor((6, 5), "float32", "a"), g.tensor((6, 11), "float32", "b")
    c = g.cat([a, g.exp(b)], dim=1)
    g.sum(c, dim=1).set_output()
    g.softmax(c, dim=1).set_output()
    plan = _run(g, [rand(6, 5), rand(6, 11)])
    kernels = _launched(plan)
    assert all(k.backend == "triton" for k in kernels) and not any(k.kind == "library" for k in plan.kernels)
    assert len(kernels) == 1


def test_concat_of_a_strided_slice_in_looped_row_and_column_reductions() -> None:
    """A row wider than the row block (loops over chunks of the concat) and a column sum."""
    g = fg.Graph("cat_wide")
    a, b = g.tensor((5, 130), "float32", "a"), g.tensor((5, 77), "float32", "b")
    c = g.cat([g.slice(a, 1, 1, 130, 2), b, a], dim=1)      # 65 + 77 + 130 columns
    g.softmax(c, dim=1).set_output()
    g.sum(c, dim=0).set_output()
    plan = g.build(device="cpu", max_row_block=64)
    feeds = [rand(5, 130), rand(5, 77)]
    for o, r in zip(plan(*feeds), fg.reference(g)(*feeds), strict=True):
        assert_close(o, r)
    kernels = _launched(plan)
    assert all(k.backend == "triton" and k.kind == "reduction" for k in kernels) and len(kernels) == 2


def test_mixed_dtype_concat_falls_back() -> None:
    """Inputs of different dtypes (promotion) stay a library concat: still correct."""
    g = fg.Graph("cat_mixed")
    a, b = g.tensor((3, 4), "float16", "a"), g.tensor((3, 2), "float32", "b")
    g.relu(g.cat([a, b], dim=1)).set_output()
    _run(g, [rand(3, 4, dtype=torch.float16), rand(3, 2)])


def test_llama_block_rope_fuses() -> None:
    """bench/llama_blocks.py prefill block (tiny): each RoPE is one kernel; no library concat."""
    from llama_blocks import LlamaBlock, LlamaSize, llama_prefill_graph, rope_tables

    from conftest import rel_err

    size = LlamaSize(batch=2, seq=8, dim=32, heads=4, kv_heads=2, ffn=48)
    torch.manual_seed(0)
    block = LlamaBlock(size)
    g, params = llama_prefill_graph(block, size, torch.float32, "cpu")
    plan = g.build(device="cpu")
    x = torch.randn(size.batch, size.seq, size.dim)
    cos, sin = rope_tables(size.seq, size.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        want = block(x, cos, sin)
    assert rel_err(plan(x, cos, sin, *params), want) < 1e-5
    assert not any(k.kind == "library" for k in plan.kernels)
    assert not any(n.op in ("slice", "concat") for k in plan.kernels if k.kind == "view" for n in k.nodes)
    rope = [k for k in plan.kernels if any(n.op == "concat" for n in k.nodes)]
    assert len(rope) == 2 and all(k.backend == "triton" for k in rope)
    assert len(_launched(plan)) <= 12   # 16 before slices and concats were fused


def test_torch_rotate_half_and_chunk_gate_through_the_backend() -> None:
    """transformers' rotate_half (x[..., :d/2], x[..., d/2:], torch.cat) and chunk(2) -> silu(a) * b
    through fg.compile: each is one generated kernel, nothing runs by reference."""
    import torch.nn.functional as F

    class RopeGate(torch.nn.Module):
        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, h: torch.Tensor) -> Any:
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            a, b = h.chunk(2, dim=-1)
            return x * cos + rotated * sin, F.silu(a) * b

    torch._dynamo.reset()
    x, cos, sin, h = rand(2, 3, 5, 8), rand(5, 8), rand(5, 8), rand(2, 5, 12)
    compiled = fg.compile(RopeGate())
    with torch.no_grad():
        got, want = compiled(x, cos, sin, h), RopeGate()(x, cos, sin, h)
    for o, r in zip(got, want, strict=True):
        assert_close(o, r)
    report = compiled.fusegraph_report
    assert report.fallback_ops == {}
    ops = [line for g in report.graphs for p in g.partitions for line in p.kernel_ops]
    assert len(ops) == 2 and all(line.startswith("pointwise/triton") for line in ops), ops
    torch._dynamo.reset()
