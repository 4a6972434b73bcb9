"""passes/pad_dims.py: GEMMs whose M, N or K is misaligned run on zero-padded operands.

The LM-head pattern (vocabulary 1001 here, 50257 in GPT-2): logits = h @ W^T pads N (W's rows),
dh = g @ W pads K (g's columns and W's rows: one pad of W shared with the forward), dW = g^T @ h
pads M (g's columns, the same pad), the results sliced. The thresholds (MIN_FLOPS, COPY_BUDGET)
are lowered so that CPU-sized GEMMs qualify; results match the reference executor and the build
without the pass; outputs keep the strides the caller expects unless it takes padded rows.
"""

from __future__ import annotations

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand, tiny_lm_head_step
from fusegraph.passes import pad_dims as pad_module
from fusegraph.passes.pad_dims import pad_gemm_dims_graph
from fusegraph.settings import override

M, K, V = 64, 32, 1001


@pytest.fixture
def small_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pad_module, "MIN_FLOPS", 1)
    monkeypatch.setattr(pad_module, "COPY_BUDGET", 1e9)


def head(dtype: str = "float16") -> tuple[fg.Graph, list[object]]:
    """The head of a training step, W a bf16/fp16 cast of an fp32 parameter as under autocast."""
    g = fg.Graph(name="lm_head", compute_dtype="float32")
    h = g.tensor((M, K), dtype=dtype, name="h")
    w32 = g.tensor((V, K), dtype="float32", name="w32")
    y = g.tensor((M, V), dtype=dtype, name="y")
    w = g.cast(w32, dtype, name="w")
    logits = g.matmul(h, w, transpose_b=True, name="logits")
    grad = g.cast(g.div(g.sub(g.softmax(g.cast(logits, "float32"), -1), g.cast(y, "float32")), float(M)),
                  dtype, name="grad")
    g.cast(g.matmul(grad, w, name="dh"), "float32").set_output()
    g.cast(g.matmul(g.transpose(grad, 0, 1), h, name="dw"), "float32").set_output()
    return g, [h, w32, y]


def feeds(dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    return [rand(M, K, dtype=dtype), rand(V, K) * 0.2, torch.softmax(rand(M, V), -1).to(dtype)]


def matmuls(plan: object) -> list[object]:
    return [n for n in plan.graph.nodes if n.op == "matmul"]   # type: ignore[attr-defined]


def test_lm_head_gemms_run_on_aligned_dims_and_match(small_gemms: None) -> None:
    g, handles = head()
    plan = g.build(device="cpu")
    mms = matmuls(plan)
    assert len(mms) == 3
    for mm in mms:   # every GEMM dim is the padded 1008 or aligned: 1001 appears in no operand
        assert all(V not in x.shape for x in mm.inputs), [x.shape for x in mm.inputs]
        assert V not in mm.shape
    pads = [n for n in plan.graph.nodes if n.op == "pad"]
    assert len(pads) == 2, [p.name for p in pads]   # W once (N and K share it), the gradient once (K and M)
    kernels = [k for k in plan.kernels if k.kind not in ("view", "constant")]
    # the pads are stored by the kernels computing their inputs (the cast of W, the softmax backward);
    # the fp32 casts stay the GEMMs' epilogues; the dW slice is a view, not a copy
    assert [k.kind for k in kernels].count("matmul") == 3
    assert not any(k.ops == ["pad"] or k.ops == ["slice"] for k in kernels), [k.ops for k in kernels]
    assert sum(1 for k in kernels if k.kind == "matmul" and "cast" in k.ops) == 2
    data = feeds()
    dh, dw = plan(*data)
    want = list(fg.reference(g).execute(dict(zip(handles, data, strict=True))).values())
    assert_close(dh, want[0], tol=5e-3, what="dh")
    assert_close(dw, want[1], tol=5e-3, what="dw")
    assert dh.shape == (M, K) and dw.shape == (V, K) and dw.is_contiguous() and dh.is_contiguous()
    with override(pad_gemm_dims=False):
        plain = g.build(device="cpu")
    assert any(V in x.shape for mm in matmuls(plain) for x in mm.inputs)
    dh0, dw0 = plain(*data)
    assert_close(dh, dh0, tol=5e-3, what="dh vs unpadded")
    assert_close(dw, dw0, tol=5e-3, what="dw vs unpadded")


def test_thresholds_leave_small_gemms_alone() -> None:
    g, _ = head()
    plan = g.build(device="cpu")
    assert not any(n.op == "pad" for n in plan.graph.nodes)   # MIN_FLOPS: a 64 x 1001 x 32 GEMM is tiny
    with override(pad_align=False):
        assert pad_gemm_dims_graph(g.build(device="cpu").graph, min_flops=1).nodes is not None


def test_input_copies_priced_against_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pad of a graph input is a copy: taken within COPY_BUDGET of the GEMM's floor, else not."""
    g = fg.Graph(name="odd_k", compute_dtype="float32")
    a = g.tensor((M, V), dtype="float16", name="a")
    b = g.tensor((V, K), dtype="float16", name="b")
    g.matmul(a, b).set_output()
    monkeypatch.setattr(pad_module, "MIN_FLOPS", 1)
    padded = pad_gemm_dims_graph(g.build(device="cpu", fuse=False).graph, min_flops=1)
    assert not any(n.op == "pad" for n in padded.nodes)   # two input copies cost more than this GEMM
    monkeypatch.setattr(pad_module, "COPY_BUDGET", 1e9)
    plan = g.build(device="cpu")
    pads = [n for n in plan.graph.nodes if n.op == "pad"]
    assert len(pads) == 2 and all(p.inputs[0].op == "input" for p in pads)
    mm = matmuls(plan)[0]
    assert mm.inputs[0].shape == (M, 1008) and mm.inputs[1].shape == (1008, K)
    x, y = rand(M, V, dtype=torch.float16), rand(V, K, dtype=torch.float16)
    out = plan(x, y)
    assert_close(out.float(), x.float() @ y.float(), tol=5e-3)


def test_sliced_output_only_where_the_caller_takes_padded_rows(small_gemms: None) -> None:
    """logits = h @ W^T returned: padded along N only at a pad_outputs position, where it comes back
    as a view with aligned rows; elsewhere the GEMM keeps N = 1001 and a dense output."""
    g = fg.Graph(name="logits", compute_dtype="float32")
    h = g.tensor((M, K), dtype="float16", name="h")
    w32 = g.tensor((V, K), dtype="float32", name="w32")
    g.matmul(h, g.cast(w32, "float16"), transpose_b=True, name="logits").set_output()
    h_t, w_t = rand(M, K, dtype=torch.float16), rand(V, K)
    want = h_t.float() @ w_t.half().float().T
    dense = g.build(device="cpu")
    assert matmuls(dense)[0].shape == (M, V)
    out = dense(h_t, w_t)
    assert out.stride() == (V, 1)
    assert_close(out.float(), want, tol=5e-3)
    free = g.build(device="cpu", pad_outputs=[0])
    assert matmuls(free)[0].shape == (M, 1008)
    out = free(h_t, w_t)
    assert out.shape == (M, V) and out.stride() == (1008, 1)
    assert_close(out.float(), want, tol=5e-3)


def test_epilogue_with_a_bias_along_the_padded_dim_stays_below_the_slice(small_gemms: None) -> None:
    """A bias along N does not move above an N slice (it would need padding too): the GEMM is
    padded, the bias add reads the slice; values still match."""
    g = fg.Graph(name="biased", compute_dtype="float32")
    h = g.tensor((M, K), dtype="float16", name="h")
    w32 = g.tensor((V, K), dtype="float32", name="w32")
    bias = g.tensor((V,), dtype="float16", name="bias")
    y = g.add(g.matmul(h, g.cast(w32, "float16"), transpose_b=True), bias)
    g.sum(g.cast(y, "float32"), dim=-1).set_output()
    plan = g.build(device="cpu")
    assert matmuls(plan)[0].shape == (M, 1008)
    h_t, w_t, b_t = rand(M, K, dtype=torch.float16), rand(V, K), rand(V, dtype=torch.float16)
    out = plan(h_t, w_t, b_t)
    ref = ((h_t.float() @ w_t.half().float().T).half() + b_t).float().sum(-1)
    assert_close(out, ref, tol=5e-3)


def test_registered_setting_turns_it_off(small_gemms: None) -> None:
    g, _ = head()
    with override(pad_gemm_dims=False):
        assert not any(n.op == "pad" for n in g.build(device="cpu").graph.nodes)
    with override(pad_align=False):
        assert not any(n.op == "pad" for n in g.build(device="cpu").graph.nodes)


def test_torch_training_lm_head(small_gemms: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through torch.compile (AOTAutograd, fp16 model): the forward's logits GEMM and the backward's
    two GEMMs run on the padded vocabulary; loss, logits and every gradient match eager."""
    plans = tiny_lm_head_step(monkeypatch, V, K)
    gemm_shapes = [tuple(x.shape) for p in plans for n in p.graph.nodes if n.op == "matmul" for x in n.inputs]
    assert gemm_shapes and not any(V in s for s in gemm_shapes), gemm_shapes


@pytest.mark.parametrize("config", [{"BLOCK": 2048, "num_warps": 4, "ROW_TILED": True},
                                    {"BLOCK": 1024, "num_warps": 4, "ROW_TILED": 2},
                                    {"BLOCK": 1024, "num_warps": 4, "ROW_TILED": False}])
def test_zero_padded_rows_in_every_pointwise_body(config: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """A value zero-padded along its rows (a logits gradient written for the GEMM after it) keeps
    the row-tiled body (per-row operands loaded once per program; blocks before the padding without
    its range conditions) and the segmented one; each body the tuner may pick matches the reference."""
    import fusegraph.lower as lower

    monkeypatch.setattr(lower, "candidate_configs", lambda gen, options=None: [config])
    rows, vocab, padded = 5, 4133, 4160
    g = fg.Graph(name="padded_rows")
    x, lse = g.tensor((rows, vocab), "float16", "x"), g.tensor((rows, 1), "float32", "lse")
    g.pad(g.cast(g.exp(g.sub(g.cast(x, "float32"), lse)), "float16"), (0, padded - vocab)).set_output()
    plan = g.build()
    (kernel,) = plan.kernels
    assert "row = pid //" in kernel.source and "if ROW_TILED == 2:" in kernel.source, kernel.source
    # blocks inside the unpadded row skip the padding's range conditions (vector loads on a GPU)
    assert f"if c0 + BLOCK <= {vocab}:" in kernel.source
    xs, ls = rand(rows, vocab, dtype=torch.float16), rand(rows, 1)
    out = plan(xs, ls)
    assert out.shape == (rows, padded) and bool((out[:, vocab:] == 0).all())
    assert_close(out.float(), fg.reference(g)(xs, ls).float(), tol=5e-3)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("odd", ["m", "n", "k", "mnk"])
@pytest.mark.parametrize("batch", [(), (3,)])
def test_every_layout_and_odd_dim_matches(small_gemms: None, trans_a: bool, trans_b: bool, odd: str,
                                          batch: tuple[int, ...]) -> None:
    """A GEMM (batched or not, either operand transposed) with an odd M, N, K or all three, a cast
    and a scalar scale after it: padded where the odd dim is a row, values equal to the reference."""
    m, n, k = (37 if "m" in odd else 32), (45 if "n" in odd else 48), (53 if "k" in odd else 64)
    g = fg.Graph(name="odd_gemm", compute_dtype="float32")
    a = g.tensor((*batch, k, m) if trans_a else (*batch, m, k), dtype="float16", name="a")
    b = g.tensor((*batch, n, k) if trans_b else (*batch, k, n), dtype="float16", name="b")
    y = g.mul(g.cast(g.matmul(a, b, transpose_a=trans_a, transpose_b=trans_b), "float32"), 0.5)
    y.set_output()
    plan = g.build(device="cpu")
    (mm,) = matmuls(plan)
    row_odd = ("n" in odd) or ("k" in odd and (not trans_a or trans_b)) or ("m" in odd and trans_a)
    assert any(n_.op == "pad" for n_ in plan.graph.nodes) is row_odd
    a_t = rand(*a.shape, dtype=torch.float16)
    b_t = rand(*b.shape, dtype=torch.float16)
    out = plan(a_t, b_t)
    want = fg.reference(g)(a_t, b_t)
    assert out.shape == want.shape == (*batch, m, n) and out.is_contiguous()
    assert_close(out, want, tol=2e-3)
    sliced = "n" in odd or ("m" in odd and trans_a)   # the result is computed padded, then sliced
    assert (tuple(mm.shape[-2:]) != (m, n)) is sliced, mm.shape


def test_other_readers_read_the_padded_value(small_gemms: None) -> None:
    """A weight's cast padded for the GEMM and also returned transposed (saved for a backward):
    the output is a view of the padded buffer, the weight is cast once."""
    g = fg.Graph(name="saved_weight", compute_dtype="float32")
    h = g.tensor((M, K), dtype="float16", name="h")
    w32 = g.tensor((V, K), dtype="float32", name="w32")
    w = g.cast(w32, "float16", name="w")
    g.sum(g.cast(g.matmul(h, w, transpose_b=True), "float32"), dim=-1).set_output()
    g.transpose(w, 0, 1).set_output()
    # returned in the strides torch traces for w.t() (the torch frontend passes them)
    plan = g.build(device="cpu", output_strides=[None, (1, K)])
    readers = [k for k in plan.kernels if any(i.op == "input" and i.name == "w32" for i in k.inputs)]
    assert len(readers) == 1 and "pad" in readers[0].ops, [k.ops for k in readers]
    assert not any(k.kind != "view" and "transpose" in k.ops for k in plan.kernels), [k.ops for k in plan.kernels]
    h_t, w_t = rand(M, K, dtype=torch.float16), rand(V, K)
    sums, w_out = plan(h_t, w_t)
    want_sums, want_w = fg.reference(g)(h_t, w_t)
    assert w_out.shape == (K, V) and w_out.stride() == (1, K)
    assert torch.equal(w_out, want_w)
    assert_close(sums, want_sums, tol=5e-3)
