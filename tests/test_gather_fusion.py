"""Gathers read in place: an embedding lookup or index_select of a graph input is a 'gather' entry of
the kernel that uses the rows (fusion/partition.py), not a torch launch and a buffer of its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import fusegraph as fg
from conftest import assert_close
from fusegraph.settings import override


def _ops(plan: fg.Plan) -> list[str]:
    return [f"{k.kind}/{k.backend}:{'+'.join(n.op for n in k.nodes)}" for k in plan.kernels if k.kind != "view"]


def _bert_embeddings(dtype: str, vocab: int = 97, positions: int = 40, d: int = 48) -> tuple[fg.Graph, dict]:
    g = fg.Graph("bert_embeddings")
    ids = g.tensor((3, 17), "int64", "ids")
    pos = g.tensor((17,), "int64", "pos")
    kinds = g.tensor((3, 17), "int64", "kinds")
    words = g.tensor((vocab, d), dtype, "words")
    places = g.tensor((positions, d), dtype, "places")
    types = g.tensor((2, d), dtype, "types")
    w, b = g.tensor((d,), dtype, "ln_w"), g.tensor((d,), dtype, "ln_b")
    h = g.add(g.add(g.embedding(ids, words), g.embedding(pos, places)), g.embedding(kinds, types))
    g.layernorm(h, weight=w, bias=b).set_output()
    torch_dtype = getattr(torch, dtype)
    values = {"ids": torch.randint(0, vocab, (3, 17)), "pos": torch.randperm(positions)[:17],
              "kinds": torch.randint(0, 2, (3, 17)), "words": torch.randn(vocab, d, dtype=torch_dtype),
              "places": torch.randn(positions, d, dtype=torch_dtype), "types": torch.randn(2, d, dtype=torch_dtype),
              "ln_w": torch.rand(d, dtype=torch_dtype) + 0.5, "ln_b": torch.randn(d, dtype=torch_dtype)}
    return g, values


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_embedding_sum_and_layernorm_is_one_kernel(dtype: str) -> None:
    """BERT's embeddings: three lookups, their sum and the layernorm read the tables in one kernel
    (no torch embedding launches, no [B, T, D] buffers of rows); the values match the reference."""
    g, values = _bert_embeddings(dtype)
    plan = g.build(device="cpu")
    ops = _ops(plan)
    assert len(ops) == 1 and ops[0].startswith("reduction/triton:") and ops[0].count("embedding") == 3, ops
    (kernel,) = [k for k in plan.kernels if k.kind != "view"]
    assert {n.name for n in kernel.inputs} >= {"words", "places", "types", "ids", "pos", "kinds"}
    # bytes moved: the indices, the rows gathered (51 of the 97-row vocabulary, 17 of the 40 positions,
    # the 2-row type table whole), the layernorm's weights and the output
    size = 2 if dtype == "float16" else 4
    rows, d = 3 * 17, 48
    want = (2 * 51 + 17) * 8 + (rows * d + 17 * d + 2 * d + 2 * d + rows * d) * size
    assert kernel.cost.bytes == want, (kernel.cost.bytes, want)
    args = [values[name] for name in ("ids", "pos", "kinds", "words", "places", "types", "ln_w", "ln_b")]
    assert_close(plan(*args), fg.reference(g)(*args), what=f"embeddings + layernorm {dtype}")
    with override(fuse_gathers=False):
        g2, _ = _bert_embeddings(dtype)
        off = _ops(g2.build(device="cpu"))
    assert sum(op.startswith("library/") for op in off) == 3, off


def test_rotary_tables_at_a_position_fuse_into_the_rotation() -> None:
    """A decode step's rotary embedding: cos/sin rows of the tables at the current position
    (index_select, dim 0, a one-element index) are read by the rotation kernel itself."""
    g = fg.Graph("rope_decode")
    q = g.tensor((1, 8, 1, 16), "float32", "q")
    cos_t, sin_t = g.tensor((64, 16), "float32", "cos"), g.tensor((64, 16), "float32", "sin")
    pos = g.tensor((1,), "int64", "pos")
    cos, sin = g.index_select(cos_t, 0, pos), g.index_select(sin_t, 0, pos)
    x1, x2 = g.slice(q, 3, 0, 8), g.slice(q, 3, 8, 16)
    rotated = g.concat([g.neg(x2), x1], dim=3)
    g.add(g.mul(q, cos), g.mul(rotated, sin)).set_output()
    plan = g.build(device="cpu")
    ops = _ops(plan)
    assert len(ops) == 1 and ops[0].startswith("pointwise/triton:") and ops[0].count("index_select") == 2, ops
    xs = [torch.randn(1, 8, 1, 16), torch.randn(64, 16), torch.randn(64, 16), torch.tensor([37])]
    assert_close(plan(*xs), fg.reference(g)(*xs), what="rope at a position")


def test_index_select_along_an_inner_dim() -> None:
    """index_select along dim 1 of a 3-D table: the other dims come from the kernel's index."""
    g = fg.Graph("select_inner")
    x = g.tensor((4, 30, 6), "float32", "x")
    idx = g.tensor((9,), "int32", "idx")
    g.relu(g.index_select(x, 1, idx)).set_output()
    plan = g.build(device="cpu")
    ops = _ops(plan)
    assert ops == ["pointwise/triton:index_select+relu"], ops
    xs = [torch.randn(4, 30, 6), torch.tensor([29, 0, 3, 3, 17, 8, 8, 1, 12], dtype=torch.int32)]
    assert_close(plan(*xs), fg.reference(g)(*xs), what="index_select dim 1")


def test_gather_of_a_computed_table_stays_a_library_op() -> None:
    """A table the plan computes is no graph input: its lookup runs in torch after it is stored."""
    g = fg.Graph("computed_table")
    w = g.tensor((10, 8), "float32", "w")
    ids = g.tensor((5,), "int64", "ids")
    g.embedding(ids, g.mul(w, 2.0)).set_output()
    ops = _ops(g.build(device="cpu"))
    assert any(op.startswith("library/") and "embedding" in op for op in ops), ops


class TinyEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.words, self.places = nn.Embedding(50, 32), nn.Embedding(16, 32)
        self.norm, self.proj = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1])
        return self.proj(self.norm(self.words(ids) + self.places(pos)))


def test_backend_embeddings_fuse_in_inference_and_train() -> None:
    """Through torch.compile: the inference plan has no torch embedding launch; training still
    matches eager (the lookups' backward stays an index_put in torch)."""
    torch.manual_seed(0)
    model, ids = TinyEncoder(), torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        compiled = fg.compile(model)
        assert_close(compiled(ids), model(ids), what="inference")
    report = compiled.fusegraph_report
    ops = [k for graph in report.graphs for p in graph.partitions for k in p.kernel_ops]
    assert not any("embedding" in k and k.startswith("library/") for k in ops), ops
    torch._dynamo.reset()
    trained, ref = TinyEncoder(), TinyEncoder()
    ref.load_state_dict(trained.state_dict())
    out = fg.compile(trained)(ids)
    out.square().sum().backward()
    want = ref(ids)
    want.square().sum().backward()
    assert_close(out, want, what="training forward")
    for (name, p), q in zip(trained.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, q.grad, tol=1e-4, what=f"grad {name}")


@pytest.mark.parametrize("body", [False, True, 2])
def test_wide_rows_gathered_in_every_pointwise_body(monkeypatch: pytest.MonkeyPatch, body: Any) -> None:
    """Rows of 4160 elements: the flat (False), row-tiled (True) and segmented (2) pointwise bodies
    each read the gathered rows right (the index is a per-row value in the last two)."""
    import fusegraph.lower as lower
    from fusegraph.codegen import configs

    def candidates(gen: Any, options: Any = None) -> list[dict[str, Any]]:
        if gen.kind == "pointwise":
            return [{"BLOCK": 1024, "num_warps": 4, "ROW_TILED": body}]
        return configs.candidate_configs(gen, options)

    monkeypatch.setattr(lower, "candidate_configs", candidates)
    g = fg.Graph("wide_rows")
    ids = g.tensor((2, 3), "int64", "ids")
    table = g.tensor((11, 4160), "float16", "table")
    scale = g.tensor((2, 3, 4160), "float16", "scale")
    g.mul(g.embedding(ids, table), scale).set_output()
    plan = g.build(device="cpu")
    (kernel,) = [k for k in plan.kernels if k.kind != "view"]
    assert kernel.kind == "pointwise" and kernel.config.get("ROW_TILED") == body
    xs = [torch.tensor([[10, 0, 4], [4, 7, 1]]), torch.randn(11, 4160).half(), torch.randn(2, 3, 4160).half()]
    assert_close(plan(*xs), fg.reference(g)(*xs), what=f"gathered rows, body {body}")


def test_rows_of_a_viewed_buffer_are_gathered_from_the_buffer() -> None:
    """A decode step's mask row: index_select(reshape(mask, [1, 1, S, S]), 2, pos) is rewritten to
    reshape(index_select(mask, 0, pos)) (passes/simplify.py), so the lookup reads the graph input and
    joins the kernel that uses the row. A reshape that merges dims is left alone."""
    g = fg.Graph("mask_row")
    mask = g.tensor((16, 16), "bool", "mask")
    pos = g.tensor((1,), "int64", "pos")
    row = g.index_select(g.reshape(mask, (1, 1, 16, 16)), 2, pos)
    g.where(row, g.tensor((1, 1, 1, 16), "float32", "x"), -1.0).set_output()
    plan = g.build(device="cpu")
    ops = _ops(plan)
    assert len(ops) == 1 and ops[0].startswith("pointwise/triton:") and "index_select" in ops[0], ops
    xs = [torch.rand(16, 16) > 0.5, torch.tensor([11]), torch.randn(1, 1, 1, 16)]
    assert_close(plan(*xs), fg.reference(g)(*xs), what="mask row")

    merged = fg.Graph("merged_view")
    table = merged.tensor((4, 6, 8), "float32", "table")
    picked = merged.index_select(merged.reshape(table, (24, 8)), 0, merged.tensor((3,), "int64", "i"))
    merged.relu(picked).set_output()
    ops = _ops(merged.build(device="cpu"))
    assert any(op.startswith("library/") and "index_select" in op for op in ops), ops


@pytest.mark.parametrize("body", [False, True, 2])
def test_gathered_rows_compile_for_sm90(body: Any, tmp_path: Any) -> None:
    """Each pointwise body of a gathering kernel compiles with Triton's compiler for sm_90 (not only
    under the interpreter), and the row-tiled one moves the gathered row in 16-byte vectors."""
    import re

    from ptx_helpers import sm90_ptx

    g = fg.Graph("wide_rows_ptx")
    ids = g.tensor((2, 3), "int64", "ids")
    table = g.tensor((11, 4160), "float16", "table")
    scale = g.tensor((2, 3, 4160), "float16", "scale")
    g.mul(g.embedding(ids, table), scale).set_output()
    (kernel,) = [k for k in g.build(device="cpu").kernels if k.kind != "view"]
    names = {n.name: f"in{k}" for k, n in enumerate(kernel.inputs)}
    types = {names["ids"]: "*i64", names["table"]: "*fp16", names["scale"]: "*fp16", "out0": "*fp16"}
    ptx = sm90_ptx(kernel.source, kernel.name, {"BLOCK": 1024, "ROW_TILED": body, "USE_PDL": False}, types, tmp_path)
    loads = set(re.findall(r"ld\.global[.\w]*", ptx))
    assert loads, ptx[-2000:]
    if body is True:
        assert any(".v4" in o for o in loads), loads


def test_gathered_sum_read_by_three_kernels_is_stored_once() -> None:
    """A residual stream that starts as wte[ids] + wtt[kinds], read by three kernels (a layernorm,
    then a layernorm after each of two GEMMs). Re-gathering both tables' rows in every kernel reads
    6x the sum's bytes; storing it once and reading it twice, 5x. The recompute rule counts a gather
    as the rows it reads (fusion/recompute.py), so the tables are gathered in one kernel only."""
    g = fg.Graph("residual_stream")
    ids, kinds = g.tensor((2, 8), "int64", "ids"), g.tensor((2, 8), "int64", "kinds")
    wte, wtt = g.tensor((50, 32), "float32", "wte"), g.tensor((4, 32), "float32", "wtt")
    w1, w2 = g.tensor((32, 32), "float32", "w1"), g.tensor((32, 32), "float32", "w2")
    h0 = g.add(g.embedding(ids, wte), g.embedding(kinds, wtt))
    y1 = g.matmul(g.layernorm(h0), w1)
    y2 = g.matmul(g.layernorm(g.add(h0, y1)), w2)
    g.layernorm(g.add(h0, y2)).set_output()
    plan = g.build(device="cpu")
    ops = _ops(plan)
    assert sum("embedding" in op for op in ops) == 1, ops
    xs = [torch.randint(0, 50, (2, 8)), torch.randint(0, 4, (2, 8)), torch.randn(50, 32), torch.randn(4, 32),
          torch.randn(32, 32) * 0.2, torch.randn(32, 32) * 0.2]
    assert_close(plan(*xs), fg.reference(g)(*xs), what="residual stream")
