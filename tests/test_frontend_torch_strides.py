"""Partition boundaries and strides: what torch traced (fake strides) versus what runs (real strides).

AOTAutograd decides from the traced strides, e.g. that `att.transpose(1, 2).reshape(b, t, d)` is a
view. The tensors that cross a partition boundary must therefore keep the traced stride order, and
views replayed on real inputs must not assume the traced strides."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from conftest import assert_close, rand
from fusegraph.frontends.torch_partition import dense_strides_in_order, partition_graph

aten = torch.ops.aten
B, H, T, D = 2, 2, 4, 8


def _split(fn, *example: torch.Tensor) -> torch.fx.GraphModule:
    gm = make_fx(fn, tracing_mode="fake")(*example)
    warnings.simplefilter("ignore")
    split, record = partition_graph(gm, "forward", {}, lambda message: None)
    assert record.partitions and all(p.status == "fusegraph" for p in record.partitions), record
    return split


def _transpose_view_matmul(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # a is [B, H, T, D] laid out as [B, T, H, D] (what an SDPA backend returns); the reshape is a view
    rows = aten.view.default(aten.transpose.int(a, 1, 2), [B, T, H * D])
    return aten.mm.default(aten.view.default(rows, [B * T, H * D]), w), rows


def test_view_of_input_replayed_on_other_real_strides():
    # traced with a [B, T, H, D]-ordered input; at run time the producer (an eager op) returned a
    # contiguous one: aten.view would raise "view size is not compatible ... Use .reshape(...)"
    traced = rand(B, T, H, D).transpose(1, 2)
    w = rand(H * D, 5)
    split = _split(_transpose_view_matmul, traced, w)
    real = traced.contiguous()
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        real.transpose(1, 2).view(B, T, H * D)  # what the replay did before
    out, rows = split(real, w)
    want_out, want_rows = _transpose_view_matmul(traced, w)   # the same values
    assert_close(out, want_out)
    assert_close(rows, want_rows)


def _qkv_heads(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = aten.view.default(aten.mm.default(x, w), [B, T, 3, H, D])
    q = aten.select.int(aten.permute.default(y, [2, 0, 3, 1, 4]), 0, 0)
    return q, aten.cumsum.default(q, -1)   # cumsum: no translator, so q leaves the partition


def test_output_with_gaps_keeps_the_traced_stride_order():
    # q sliced out of a fused qkv projection: traced strides (T*3*H*D, D, 3*H*D, 1) have gaps; an
    # SDPA backend called on it lays its output out in q's stride order, which AOTAutograd's
    # reshape-as-view of the attention output relies on: q must come out [B, T, H, D]-ordered
    x, w = rand(B * T, 4), rand(4, 3 * H * D)
    split = _split(_qkv_heads, x, w)
    q, _ = split(x, w)
    want, _ = _qkv_heads(x, w)
    assert_close(q, want)
    assert q.stride() == (T * H * D, D, H * D, 1)
    assert q.transpose(1, 2).is_contiguous()


def test_dense_strides_in_order():
    t = torch.empty(2, 3, 4, 5).permute(0, 2, 1, 3)
    assert dense_strides_in_order(t) == t.stride()
    gapped = torch.empty(2, 4, 3, 10)[..., :5].permute(0, 2, 1, 3)   # [2, 3, 4, 5], inner rows padded
    assert dense_strides_in_order(gapped) == (60, 5, 15, 1)
    assert dense_strides_in_order(torch.empty(3, 1).expand(3, 4)) is None   # overlapping


def test_gapped_value_from_our_partition_feeds_the_next_without_a_rebuild():
    # what the forward saves for the backward: the next partition was traced with the gapped strides
    # but is built for what our partitions hand over (dense, same order): no second Plan at run time
    x, w = rand(B * T, 4), rand(4, 3 * H * D)
    q, _ = _split(_qkv_heads, x, w)(x, w)
    traced_q = _qkv_heads(x, w)[0]
    assert traced_q.stride() != q.stride()

    def scale_heads(q: torch.Tensor) -> torch.Tensor:
        return aten.mul.Tensor(q, 2.0)

    consumer = _split(scale_heads, traced_q)
    (fused,) = [m for name, m in consumer.named_children() if name.startswith("fused")]
    assert_close(consumer(q), traced_q * 2.0)
    assert fused.plan._variants == {}
