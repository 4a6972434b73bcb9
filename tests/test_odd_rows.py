"""Kernels over rows whose width is not a multiple of 16 (a 50257-wide vocab): `cols < C` varies element
by element, so Triton would load and store every element of such a row alone. The generated row-tiled
pointwise body, row-reduction loop and GEMM epilogue therefore split full blocks (no column mask:
16-byte vectors where the rows are aligned, e.g. padded) from the row's last block (masked). Both
paths run here against the reference, and the sm_90 PTX (compiled on the CPU) shows the vectors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand
from ptx_helpers import sm90_ptx

ROWS, VOCAB, PADDED = 6, 4133, 4160   # pad_align: 4133 fp16 elements -> 128-byte rows of 4160


def _only(monkeypatch: pytest.MonkeyPatch, kind: str, config: dict[str, Any]) -> None:
    """Every generated kernel of `kind` gets `config` (no timing)."""
    import fusegraph.lower as lower
    from fusegraph.codegen import configs

    def candidates(gen: Any, options: Any = None) -> list[dict[str, Any]]:
        return [config] if gen.kind == kind else configs.candidate_configs(gen, options)

    monkeypatch.setattr(lower, "candidate_configs", candidates)


def _ce_backward_into_gemm() -> tuple[fg.Graph, list[torch.Tensor]]:
    """softmax(x) - onehot(target), scaled, into a GEMM: pad_align gives the gradient padded rows."""
    g = fg.Graph(name="ce_backward_gemm")
    x, lse = g.tensor((ROWS, VOCAB), "float16", "x"), g.tensor((ROWS, 1), "float32", "lse")
    target, w = g.tensor((ROWS, 1), "int64", "target"), g.tensor((VOCAB, 16), "float16", "w")
    onehot = g.cast(g.eq(g.iota((ROWS, VOCAB), 1, "int64"), target), "float32")
    grad = g.cast(g.mul(g.sub(g.exp(g.sub(g.cast(x, "float32"), lse)), onehot), 0.5), "float16")
    g.matmul(grad, w).set_output()
    xs = rand(ROWS, VOCAB, dtype=torch.float16)
    data = [xs, torch.logsumexp(xs.float(), 1, keepdim=True), torch.randint(0, VOCAB, (ROWS, 1)),
            rand(VOCAB, 16, dtype=torch.float16)]
    return g, data


@pytest.mark.parametrize("block", [1024, 2048])
def test_row_tiled_body_splits_full_blocks_from_the_last(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _only(monkeypatch, "pointwise", {"BLOCK": block, "num_warps": 4, "ROW_TILED": True})
    g, data = _ce_backward_into_gemm()
    plan = g.build()
    (pointwise,) = [k for k in plan.kernels if k.kind == "pointwise"]
    assert pointwise.outputs[0].spec.memory_strides[0] == PADDED
    src = pointwise.source
    assert f"if c0 + BLOCK <= {VOCAB}:" in src and "mask = tl.full([BLOCK], 1, tl.int1)" in src, src
    assert src.count(f"tl.store(out0 + row * {PADDED} + cols") >= 2, src   # the store, in both paths
    assert_close(plan(*data), fg.reference(g)(*data), what=f"row-tiled, BLOCK {block}")


def test_even_row_widths_keep_one_body(monkeypatch: pytest.MonkeyPatch) -> None:
    _only(monkeypatch, "pointwise", {"BLOCK": 1024, "num_warps": 4, "ROW_TILED": True})
    g = fg.Graph(name="even")
    x, r = g.tensor((4, 4096), "float16", "x"), g.tensor((4, 1), "float32", "r")
    g.exp(g.sub(x, r)).set_output()
    (kernel,) = g.build().kernels
    assert "if c0 + BLOCK" not in kernel.source and "mask = cols < 4096" in kernel.source


@pytest.mark.parametrize("block_c", [512, 4096, 8192])
def test_row_reduction_over_odd_rows_loops_full_chunks_then_the_tail(block_c: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A log-sum-exp (online softmax) and a sum over 4133-wide rows in chunks: full chunks without the
    column mask, then the partial one (the only one when the chunk is wider than the row: 8192)."""
    _only(monkeypatch, "reduction", {"ROWS": 2, "BLOCK_C": block_c, "SINGLE": False, "num_warps": 4})
    g = fg.Graph(name="lse")
    x = g.tensor((5, VOCAB), "float16", "x")
    xf = g.cast(x, "float32")
    m = g.max(xf, dim=1, keepdim=True)
    g.add(g.log(g.sum(g.exp(g.sub(xf, m)), dim=1, keepdim=True)), m).set_output()
    g.sum(xf, dim=1).set_output()
    plan = g.build()
    (kernel,) = plan.kernels
    assert f"range(0, {VOCAB} - {VOCAB} % BLOCK_C, BLOCK_C, num_stages=STAGES)" in kernel.source, kernel.source
    assert f"if {VOCAB} % BLOCK_C != 0:" in kernel.source
    xs = rand(5, VOCAB, dtype=torch.float16)
    outs, refs = plan(xs), fg.reference(g)(xs)
    for o, r in zip(outs, refs, strict=True):
        assert_close(o, r, what=f"BLOCK_C {block_c}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemm_epilogue_full_column_tiles_drop_the_mask(dtype: torch.dtype) -> None:
    """x @ w^T + bias, relu, with N = 100: the column tiles inside N store without the column mask,
    the edge tile with it; the bias (read along N) too."""
    dt = {torch.float16: "float16", torch.float32: "float32"}[dtype]
    g = fg.Graph(name="odd_n", compute_dtype=dt)
    x, w, b = g.tensor((40, 32), dt, "x"), g.tensor((100, 32), dt, "w"), g.tensor((100,), dt, "b")
    g.relu(g.add(g.linear(x, w), b)).set_output()
    plan = g.build()
    (gemm,) = [k for k in plan.kernels if k.kind == "matmul"]
    assert "* BLOCK_N + BLOCK_N <= N) & (" in gemm.source
    assert "mask_n = tl.full([1, BLOCK_N], 1, tl.int1)" in gemm.source
    data = [rand(40, 32, dtype=dtype), rand(100, 32, dtype=dtype), rand(100, dtype=dtype)]
    assert_close(plan(*data), fg.reference(g)(*data), what="odd N")


def test_padded_rows_load_and_store_16_byte_vectors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The row-tiled gradient kernel reading padded logits and writing padded rows, compiled for sm_90:
    16-byte vector loads and stores (in the full blocks), where the single masked body had 2-byte ones."""
    _only(monkeypatch, "pointwise", {"BLOCK": 1024, "num_warps": 4, "ROW_TILED": True})
    g = fg.Graph(name="padded_in_out")
    x = g.tensor((ROWS, VOCAB), "float16", "x", strides=(PADDED, 1))
    lse = g.tensor((ROWS, 1), "float32", "lse")
    w = g.tensor((VOCAB, 16), "float16", "w")
    grad = g.cast(g.mul(g.exp(g.sub(g.cast(x, "float32"), lse)), 0.5), "float16")
    g.matmul(grad, w).set_output()
    plan = g.build(device="cpu")   # planned only: no kernel runs (under the interpreter) before the compile
    (kernel,) = [k for k in plan.kernels if k.kind == "pointwise"]
    types = {"in0": "*fp16", "in1": "*fp32", "out0": "*fp16"}
    ptx = sm90_ptx(kernel.source, kernel.name, {"BLOCK": 1024, "ROW_TILED": True, "USE_PDL": False}, types,
                     tmp_path)
    ops = set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))
    assert any(o.startswith("ld.global") and ".v4" in o for o in ops), ops
    assert any(o.startswith("st.global") and ".v4" in o for o in ops), ops


def _vector_ops(ptx: str) -> set[str]:
    return {o for o in re.findall(r"(?:ld|st)\.global[.\w]*", ptx) if ".v4" in o}


@pytest.mark.parametrize("prefetch", [False, True])
def test_row_reduction_over_padded_rows_loads_16_byte_vectors(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path, prefetch: bool) -> None:
    """A log-sum-exp over padded rows (the forward's cross-entropy over padded logits), sm_90 PTX:
    vector loads in the full chunks, with and without the next chunk's loads issued ahead."""
    _only(monkeypatch, "reduction", {"ROWS": 2, "BLOCK_C": 1024, "SINGLE": False, "num_warps": 4})
    g = fg.Graph(name="lse_padded")
    x = g.tensor((ROWS, VOCAB), "float16", "x", strides=(PADDED, 1))
    xf = g.cast(x, "float32")
    m = g.max(xf, dim=1, keepdim=True)
    g.add(g.log(g.sum(g.exp(g.sub(xf, m)), dim=1, keepdim=True)), m).set_output()
    (kernel,) = g.build(device="cpu").kernels
    consts = {"ROWS": 2, "BLOCK_C": 1024, "SINGLE": False, "STAGES": 1, "PREFETCH": prefetch, "USE_PDL": False}
    ptx = sm90_ptx(kernel.source, kernel.name, consts, {"in0": "*fp16", "out0": "*fp32"}, tmp_path)
    assert any(o.startswith("ld.global") for o in _vector_ops(ptx)), ptx[-2000:]


@pytest.mark.parametrize("tma", [False, True])
def test_gemm_into_padded_rows_stores_16_byte_vectors(tma: bool, tmp_path: Path) -> None:
    """A logits-like GEMM (N = 4133) whose result another GEMM reads: pad_align pads its rows. In sm_90
    PTX the pointer path's tiles inside the output store 16-byte vectors; the TMA path stores the tile
    with a bulk tensor copy from shared memory."""
    g = fg.Graph(name="lm_head", compute_dtype="float16")
    x, w = g.tensor((256, 64), "float16", "x"), g.tensor((VOCAB, 64), "float16", "w")
    g.matmul(g.linear(x, w), w).set_output()
    plan = g.build(device="cpu")
    (gemm,) = [k for k in plan.kernels if k.kind == "matmul" and k.outputs[0].shape == (256, VOCAB)]
    assert gemm.outputs[0].spec.memory_strides == (PADDED, 1)
    assert gemm.config.get("VARIANT", "tiled") == "tiled", gemm.config
    consts = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "EVEN_K": True, "USE_TMA": tma,
              "USE_PDL": False}
    ptx = sm90_ptx(gemm.source, gemm.name, consts, {"in0": "*fp16", "in1": "*fp16", "out0": "*fp16"}, tmp_path)
    if tma:
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx), ptx[-2000:]
    else:
        assert any(o.startswith("st.global") for o in _vector_ops(ptx)), ptx[-2000:]


@pytest.mark.parametrize("variant", ["tiled", "persistent"])
def test_gemm_into_padded_rows_stores_through_tma(variant: str) -> None:
    """On the TMA path the padded logits tile is written by a TMA descriptor store (clipped at the
    output's edges by the copy engine: no masks, whatever N is), in the tiled and the persistent
    kernel; the interpreter emulates it, with edge tiles in M and N, against the reference."""
    from fusegraph.backends.matmul_kernel import GemmLaunch
    from fusegraph.codegen.compile import load_triton_function
    from fusegraph.codegen.matmul import generate_gemm
    from fusegraph.fusion.epilogue import MatmulGroup, claim_epilogues
    from fusegraph.fusion.partition import partition_graph

    g = fg.Graph(name="lm_head_tma", compute_dtype="float32")
    x, w = g.tensor((40, 64), "float16", "x"), g.tensor((VOCAB, 64), "float16", "w")
    logits = g.matmul(x, w, transpose_b=True, name="logits")
    g.matmul(logits, w).set_output()
    plan = g.build(device="cpu")
    items = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    group = next(i for i in items if isinstance(i, MatmulGroup) and i.matmul.name == "logits")
    gen = generate_gemm(group, f"lm_head_tma_{variant}")
    source = gen.source_of(variant)
    assert "out0_desc = tl.make_tensor_descriptor(out0, shape=[M, N], strides=[4160, 1]" in source
    assert "out0_desc.store([" in source
    config = {"VARIANT": variant, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 2, "USE_TMA": True,
              "num_warps": 4, "num_stages": 3}
    if variant == "persistent":
        config.update(NUM_PROGRAMS=5, FLATTEN=True, WARP_SPECIALIZE=False)
    launch = GemmLaunch(load_triton_function(gen.source, gen.name), gen, config, "cpu")
    xs, ws = rand(40, 64, dtype=torch.float16), rand(VOCAB, 64, dtype=torch.float16)
    (got,) = launch([{"x": xs, "w": ws}[n.name] for n in gen.inputs])
    assert got.stride() == (PADDED, 1)
    assert_close(got.float(), xs.float() @ ws.float().T, tol=5e-3, what=variant)


def test_tma_store_setting_off_writes_pointer_stores() -> None:
    from fusegraph.codegen.matmul import generate_gemm
    from fusegraph.fusion.epilogue import MatmulGroup, claim_epilogues
    from fusegraph.fusion.partition import partition_graph
    from fusegraph.settings import override

    g = fg.Graph(name="lm_head_no_tma_store", compute_dtype="float32")
    x, w = g.tensor((40, 64), "float16", "x"), g.tensor((VOCAB, 64), "float16", "w")
    g.matmul(g.matmul(x, w, transpose_b=True, name="logits"), w).set_output()
    plan = g.build(device="cpu")
    items = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    group = next(i for i in items if isinstance(i, MatmulGroup) and i.matmul.name == "logits")
    with override(gemm_tma_store=False):
        source = generate_gemm(group, "no_tma_store").source_of("persistent")
    assert "_desc.store(" not in source and "tl.store(out0 + offs_m * 4160 + offs_n" in source
