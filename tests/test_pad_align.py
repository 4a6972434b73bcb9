"""passes/pad_align.py: misaligned GEMM operands and results get padded row strides.

The LM-head pattern of GPT-2 (vocabulary 50257, here 1001): logits = h @ W^T, a softmax
cross-entropy backward, then grad @ W and grad^T @ h. The [M, 1001] values inside the plan are
stored with a 16/128-byte aligned row stride; results match the reference executor; graph outputs
keep their dense strides; aligned graphs are left alone; inputs are copied only when the cost
model says the copy is cheap next to the GEMM.
"""

from __future__ import annotations

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand, tiny_lm_head_step
from fusegraph.ir.spec import TensorSpec, contiguous_strides
from fusegraph.passes import PIPELINE, optimize
from fusegraph.passes import pad_align as pad_module
from fusegraph.passes.pad_align import pad_align_disabled, pad_align_graph, padded_row, padded_strides
from fusegraph.perf.devices import get_device
from fusegraph.settings import override

M, K = 64, 32
TORCH = {"float32": torch.float32, "float16": torch.float16}


def lm_head(n: int, dtype: str) -> tuple[fg.Graph, list[object]]:
    """logits = h @ W^T, grad = (softmax(logits) - y) / M, dh = grad @ W, dW = grad^T @ h."""
    g = fg.Graph(name=f"lm_head_{n}", compute_dtype="float32")
    h = g.tensor((M, K), dtype=dtype, name="h")
    w = g.tensor((n, K), dtype=dtype, name="w")
    y = g.tensor((M, n), dtype=dtype, name="y")
    logits = g.matmul(h, w, transpose_b=True, name="logits")
    grad = g.div(g.sub(g.softmax(logits, -1), y), float(M), name="grad")
    dh = g.matmul(grad, w, name="dh")
    dw = g.matmul(g.transpose(grad, 0, 1), h, name="dw")
    dh.set_output()
    dw.set_output()
    return g, [h, w, y]


def feeds(n: int, dtype: str) -> list[torch.Tensor]:
    dt = TORCH[dtype]
    return [rand(M, K, dtype=dt), rand(n, K, dtype=dt) * 0.2, torch.softmax(rand(M, n), -1).to(dt)]


def gemms(graph: object) -> dict[str, object]:
    return {n.name: n for n in graph.nodes if n.op == "matmul"}   # type: ignore[attr-defined]


def row_stride(node: object) -> int:
    return int(node.spec.memory_strides[-2])   # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_lm_head_intermediates_padded_and_match_reference(dtype: str) -> None:
    g, handles = lm_head(1001, dtype)
    plan = g.build(device="cpu")
    mms = gemms(plan.graph)
    grad = mms["dh"].inputs[0]
    assert grad.shape == (M, 1001) and grad is mms["dw"].inputs[0] and mms["dw"].attrs["trans_a"]
    stride = row_stride(grad)
    assert stride > 1001 and stride % 8 == 0 and (stride * grad.spec.itemsize) % 16 == 0, grad.spec
    assert row_stride(mms["logits"]) == 1001   # read by the softmax only: kept dense (settings.pad_results off)
    # the GEMM reading the padded gradient gets its TMA path (it had none with a 1001-element row)
    dh_kernel = next(k for k in plan.kernels if any(n.name == "dh" for n in k.nodes))
    assert dh_kernel.backend == "triton" and "make_tensor_descriptor" in dh_kernel.source
    data = feeds(1001, dtype)
    dh, dw = plan(*data)
    want = fg.reference(g).execute(dict(zip(handles, data, strict=True)))
    outs = list(want.values())
    tol = 1e-5 if dtype == "float32" else 5e-3
    assert_close(dh, outs[0], tol=tol, what="dh")
    assert_close(dw, outs[1], tol=tol, what="dw")
    assert dh.shape == (M, K) and dw.shape == (1001, K)
    assert dh.stride() == contiguous_strides((M, K)) and dw.stride() == contiguous_strides((1001, K))


def test_without_the_pass_the_row_stays_misaligned() -> None:
    g, _ = lm_head(1001, "float16")
    with pad_align_disabled():
        plan = g.build(device="cpu")
    mms = gemms(plan.graph)
    assert row_stride(mms["dh"].inputs[0]) == 1001
    dh_kernel = next(k for k in plan.kernels if any(n.name == "dh" for n in k.nodes))
    assert "make_tensor_descriptor" not in dh_kernel.source


def test_aligned_graph_is_unchanged() -> None:
    g, _ = lm_head(1024, "float16")
    ir = optimize(g.to_ir())
    assert pad_align_graph(ir) is ir
    plan = g.build(device="cpu")
    assert all(n.spec.strides is None for n in plan.graph.nodes if n.op != "input"), \
        [(n.name, n.spec.strides) for n in plan.graph.nodes if n.spec.strides is not None]


def test_registered_in_the_pipeline_and_idempotent() -> None:
    assert [p.name for p in PIPELINE][-1] == "pad_align"
    g, _ = lm_head(1001, "float16")
    once = optimize(g.to_ir())
    assert pad_align_graph(once) is once     # already padded: a fixed point


def _logits_and_softmax(rows: int) -> fg.Graph:
    """Graph outputs: misaligned logits [rows, 1001] (fp16 rows of 2002 bytes), and their softmax."""
    g = fg.Graph(name="logits_out", compute_dtype="float32")
    h = g.tensor((rows, K), dtype="float16", name="h")
    w = g.tensor((1001, K), dtype="float16", name="w")
    logits = g.matmul(h, w, transpose_b=True)
    logits.set_output()
    g.softmax(logits, -1).set_output()
    return g


def test_graph_outputs_are_never_padded() -> None:
    plan = _logits_and_softmax(M).build(device="cpu")
    assert all(n.spec.strides is None for n in plan.graph.outputs)
    h_t, w_t = rand(M, K, dtype=torch.float16), rand(1001, K, dtype=torch.float16)
    out, sm = plan(h_t, w_t)
    assert out.stride() == (1001, 1) and sm.stride() == (1001, 1)
    assert_close(out.float(), h_t.float() @ w_t.float().T, tol=5e-3)


def test_outputs_the_caller_takes_padded_are_padded() -> None:
    """build(pad_outputs=[...]): a large misaligned output at a listed position comes back with padded
    rows (the torch backend's saved logits), the same values; an unlisted or small one stays dense;
    a position past the outputs is a typed error."""
    rows = 1024     # 1024 x 1001 fp16 = 2.0 MB, over MIN_OUTPUT_BYTES
    g = _logits_and_softmax(rows)
    plan = g.build(device="cpu", pad_outputs=[0])
    h_t, w_t = rand(rows, K, dtype=torch.float16), rand(1001, K, dtype=torch.float16)
    out, sm = plan(h_t, w_t)
    assert out.stride() == (1008, 1) and sm.stride() == (1001, 1)   # 2002-byte rows to 2016
    assert_close(out.float(), h_t.float() @ w_t.float().T, tol=5e-3)
    assert_close(sm.float(), torch.softmax(h_t.float() @ w_t.float().T, -1), tol=5e-3)
    assert g.build(device="cpu", pad_outputs=[1]).graph.outputs[0].spec.strides is None
    with override(pad_align=False):
        assert g.build(device="cpu", pad_outputs=[0]).graph.outputs[0].spec.strides is None
    with pytest.raises(fg.InvalidValueError, match="pad_outputs"):
        g.build(device="cpu", pad_outputs=[2])
    small = _logits_and_softmax(M)      # 64 x 1001: 125 KB, under MIN_OUTPUT_BYTES
    assert small.build(device="cpu", pad_outputs=[0]).graph.outputs[0].spec.strides is None


def _input_gemm(n_out: int, dtype: str) -> fg.Graph:
    g = fg.Graph(name="input_gemm", compute_dtype="float32")
    x = g.tensor((M, 1001), dtype=dtype, name="x")
    w = g.tensor((1001, n_out), dtype=dtype, name="w")
    g.matmul(x, w).set_output()
    return g


def test_input_copied_only_when_cheap_next_to_the_gemm() -> None:
    h200 = get_device("H200")
    heavy = pad_align_graph(optimize(_input_gemm(512, "float32").to_ir()), h200, min_copy_bytes=0)
    copies = [n for n in heavy.nodes if n.op == "to_layout"]
    assert len(copies) == 1 and copies[0].inputs[0].op == "input" and row_stride(copies[0]) == 1024
    light = optimize(_input_gemm(8, "float16").to_ir())      # the copy would move more than the GEMM
    assert pad_align_graph(light, h200, min_copy_bytes=0) is light
    big_enough = optimize(_input_gemm(512, "float32").to_ir())
    assert pad_align_graph(big_enough, h200) is big_enough   # 256 KiB: under MIN_COPY_BYTES


def test_input_copy_runs_and_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pad_module, "MIN_COPY_BYTES", 0)
    g = _input_gemm(512, "float32")
    plan = g.build(device="cpu")
    copy = next(k for k in plan.kernels if "to_layout" in k.ops)
    assert row_stride(copy.outputs[0]) == 1024 and copy.backend == "triton"
    x, w = rand(M, 1001), rand(1001, 512)
    assert_close(plan(x, w), x @ w, tol=1e-5)


def test_padded_row_rules() -> None:
    assert padded_row(50257, 2) == 50304          # 128-byte rows for long rows (Inductor's choice)
    assert padded_row(1001, 2) == 1008            # 16 bytes for short ones
    assert padded_row(768, 2) is None             # aligned already
    assert padded_row(3, 2) is None               # padding would more than double it
    assert padded_strides(TensorSpec((8, 1024, 50257), "bfloat16")) == (1024 * 50304, 50304, 1)
    assert padded_strides(TensorSpec((1, 50257), "bfloat16")) is None   # one row: nothing to align
    assert padded_strides(TensorSpec((64, 1001), "int64")) is None


@pytest.mark.parametrize("trans", [(False, False), (True, False), (False, True)])
def test_cublas_matmul_into_padded_output(trans: tuple[bool, bool]) -> None:
    from fusegraph.backends.cublas import matmul_into

    ta, tb = trans
    a = rand(*((K, M) if ta else (M, K)))
    b = rand(*((1001, K) if tb else (K, 1001)))
    out = matmul_into(a, b, ta, tb, (1024, 1))
    assert out.stride() == (1024, 1) and out.shape == (M, 1001)
    assert_close(out, (a.T if ta else a) @ (b.T if tb else b), tol=1e-5)
    batched = matmul_into(rand(2, M, K), rand(2, K, 1001), False, False, (M * 1008, 1008, 1))
    assert batched.stride() == (M * 1008, 1008, 1)


def gemm_chain(dtype: str) -> tuple[fg.Graph, list[object]]:
    """t = h @ W^T [M, 1001] read by two GEMMs (t @ W, t^T @ h) and a softmax: t is a GEMM operand."""
    g = fg.Graph(name="gemm_chain", compute_dtype="float32")
    h = g.tensor((M, K), dtype=dtype, name="h")
    w = g.tensor((1001, K), dtype=dtype, name="w")
    t = g.matmul(h, w, transpose_b=True, name="t")
    g.matmul(t, w, name="tw").set_output()
    g.matmul(g.transpose(t, 0, 1), h, name="th").set_output()
    g.softmax(t, -1).set_output()
    return g, [h, w]


def test_gemm_result_read_by_a_gemm_is_padded() -> None:
    g, handles = gemm_chain("float16")
    plan = g.build(device="cpu")
    assert row_stride(gemms(plan.graph)["t"]) == 1008
    data = [rand(M, K, dtype=torch.float16), rand(1001, K, dtype=torch.float16) * 0.2]
    want = list(fg.reference(g).execute(dict(zip(handles, data, strict=True))).values())
    for got, ref in zip(plan(*data), want, strict=True):
        assert got.stride() == contiguous_strides(tuple(ref.shape))
        assert_close(got.float(), ref.float(), tol=5e-3)


def test_pad_results_pads_a_gemm_result_no_gemm_reads() -> None:
    g, handles = lm_head(1001, "float32")
    with override(pad_results=True):
        plan = g.build(device="cpu")
    assert row_stride(gemms(plan.graph)["logits"]) == 1024
    data = feeds(1001, "float32")
    want = list(fg.reference(g).execute(dict(zip(handles, data, strict=True))).values())
    for got, ref in zip(plan(*data), want, strict=True):
        assert_close(got, ref, tol=1e-5)


def test_cublas_candidate_in_a_padded_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # every GEMM as the cuBLAS candidate: the product t is written into its padded buffer
    # (torch.mm out=), then read through its padded row (lda) by the next GEMMs
    from fusegraph.backends import matmul_kernel

    monkeypatch.setattr(matmul_kernel, "_choose", lambda *args, **kw: {"backend": "cublas"})
    g, handles = gemm_chain("float32")
    plan = g.build(device="cpu")
    assert [k.backend for k in plan.kernels if k.kind == "matmul"] == ["cublas"] * 3
    assert row_stride(gemms(plan.graph)["t"]) == 1024
    data = [rand(M, K), rand(1001, K) * 0.2]
    want = list(fg.reference(g).execute(dict(zip(handles, data, strict=True))).values())
    for got, ref in zip(plan(*data), want, strict=True):
        assert_close(got, ref, tol=1e-5)


def test_tma_gemm_reads_the_padded_operand() -> None:
    # the Triton GEMM's TMA path (emulated by the interpreter) on the padded gradient
    from fusegraph.backends.matmul_kernel import GemmLaunch
    from fusegraph.codegen.compile import load_triton_function
    from fusegraph.codegen.matmul import gemm_configs, generate_gemm
    from fusegraph.fusion.epilogue import MatmulGroup, claim_epilogues
    from fusegraph.fusion.partition import partition_graph

    g, _ = lm_head(1001, "float16")
    plan = g.build(device="cpu")
    items = claim_epilogues(partition_graph(plan.graph).items, plan.graph)
    group = next(i for i in items if isinstance(i, MatmulGroup) and i.matmul.name == "dh")
    gen = generate_gemm(group, "pad_align_tma_dh")
    assert gen.tma and gen.geometry.a_strides == (1008, 1)
    config = next(c for c in gemm_configs(gen.geometry, tma=True) if c.get("USE_TMA"))
    launch = GemmLaunch(load_triton_function(gen.source, gen.name), gen, dict(config, BLOCK_K=32), "cpu")
    grad = torch.empty_strided((M, 1001), (1008, 1), dtype=torch.float16).copy_(rand(M, 1001) * 0.1)
    w = rand(1001, K, dtype=torch.float16)
    by_name = {"grad": grad, "w": w}
    (got,) = launch([by_name[n.name] for n in gen.inputs])
    assert_close(got.float(), grad.float() @ w.float(), tol=5e-3)


def test_cross_entropy_head_gradient_padded() -> None:
    # the GPT-2 head as bench/pad_align_gpu.py builds it: loss and its backward in one plan; the
    # gradient (a cast after pointwise ops whose specs carry the "strided" tag) is padded too
    g = fg.Graph(name="ce_head", compute_dtype="float32")
    h = g.tensor((M, K), dtype="float16", name="h")
    w = g.tensor((1001, K), dtype="float16", name="w")
    y = g.tensor((M,), dtype="int64", name="y")
    gloss = g.tensor((), dtype="float32", name="gloss")
    logits = g.matmul(h, w, transpose_b=True, name="logits")
    loss = g.cross_entropy(logits, y, reduction="sum", name="loss")
    dlogits = g.cross_entropy_backward(gloss, logits, y, reduction="sum", name="dlogits")
    dh = g.matmul(dlogits, w, name="dh")
    dw = g.matmul(g.transpose(dlogits, 0, 1), h, name="dw")
    for out in (loss, dh, dw):
        out.set_output()
    plan = g.build(device="cpu")
    mms = gemms(plan.graph)
    assert row_stride(mms["dh"].inputs[0]) == 1008 and row_stride(mms["logits"]) == 1001
    # written padded by the kernel computing it: no copy (the composite cross_entropy_backward seen
    # before decomposition is not a library result to copy)
    assert not [n.name for n in plan.graph.nodes if n.op == "to_layout"]
    data = [rand(M, K, dtype=torch.float16), rand(1001, K, dtype=torch.float16) * 0.2,
            torch.randint(0, 1001, (M,)), torch.tensor(1.0 / M)]
    want = list(fg.reference(g).execute(dict(zip([h, w, y, gloss], data, strict=True))).values())
    for got, ref in zip(plan(*data), want, strict=True):
        assert_close(got.float(), ref.float(), tol=5e-3)


def test_matmul_result_returned_through_a_view_stays_dense() -> None:
    # the forward's logits: a reshape of the GEMM result is a graph output, a free alias of a dense
    # result; padding the result would turn that alias into a copy
    g = fg.Graph(name="logits_view_out", compute_dtype="float32")
    h = g.tensor((M, K), dtype="float16", name="h")
    w = g.tensor((1001, K), dtype="float16", name="w")
    logits = g.matmul(h, w, transpose_b=True, name="logits")
    g.reshape(logits, 4, M // 4, 1001).set_output()
    g.matmul(g.softmax(logits, -1), w, name="back").set_output()
    plan = g.build(device="cpu")
    assert row_stride(gemms(plan.graph)["logits"]) == 1001
    assert row_stride(gemms(plan.graph)["back"].inputs[0]) == 1008    # the softmax is padded
    assert [k.kind for k in plan.kernels].count("pointwise") == 0, [k.name for k in plan.kernels]


@pytest.mark.filterwarnings("error::fusegraph.lower.FusionFallbackWarning")
def test_torch_training_lm_head_gradient_padded(monkeypatch: pytest.MonkeyPatch) -> None:
    # through torch.compile (AOTAutograd): the backward's [tokens, vocab] gradient feeding the two
    # GEMMs is padded inside the plan; the returned logits and all gradients match eager
    vocab = 1001
    plans = tiny_lm_head_step(monkeypatch, vocab, 32)
    backward = [p for p in plans if "backward" in p.graph.name]
    operands = [i for p in backward for n in p.graph.nodes if n.op == "matmul"
                for i in n.inputs if i.shape[-1] == vocab and i.op != "input"]   # not W^T
    assert operands and all(row_stride(i) == 1008 for i in operands), [i.spec for i in operands]
    # the casts around the fp32 loss (`.float().view(-1, V)`) fuse into the cross-entropy backward's
    # kernel: AOTAutograd's view round trip around them is simplified away
    casts = [k for p in backward for k in p.kernels if k.ops == ["cast"] and k.outputs[0].shape[-1] == vocab]
    assert not casts, [k.name for k in casts]
