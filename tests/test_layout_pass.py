"""The layout pass (passes/layout.py): tensor-core convolutions on NCHW tensors run channels-last,
with the pointwise/batchnorm/residual chains around them, one copy at each graph boundary, no
transposes between ops; graphs without such convolutions are left alone. Numerics vs the reference
through the Triton interpreter in fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

import fusegraph as fg
from conftest import assert_close, rand
from fusegraph.errors import InvalidValueError
from fusegraph.ir.graph import Graph as IRGraph
from fusegraph.passes.decompose import decompose
from fusegraph.passes.layout import choose_layout
from fusegraph.settings import override

TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16}


def _conv_bn_relu_constant(dtype: str) -> tuple[fg.Graph, fg.Tensor, fg.Tensor]:
    torch.manual_seed(0)
    td = TORCH_DTYPE[dtype]
    g = fg.Graph(name="cbr_const", compute_dtype="float32")
    x = g.tensor((2, 8, 6, 6), dtype=dtype, name="x")
    w = g.constant(torch.randn(16, 8, 3, 3).to(td), name="w")
    rm, rv = g.constant(torch.randn(16), name="rm"), g.constant(torch.rand(16) + 0.5, name="rv")
    gw, gb = g.constant(torch.randn(16), name="gw"), g.constant(torch.randn(16), name="gb")
    bn = g.batch_norm(g.conv2d(x, w, padding=1), rm, rv, weight=gw, bias=gb, training=False)
    y = g.relu(g.cast(bn, dtype))
    y.set_output()
    return g, x, y


def test_conv_constant_batchnorm_relu_on_nchw_is_one_channels_last_conv_kernel() -> None:
    g, _, _ = _conv_bn_relu_constant("float16")
    plan = g.build(device="cpu")
    kernels = [k for k in plan.kernels if k.kind != "constant"]
    assert len(kernels) == 1
    (kernel,) = kernels
    assert kernel.kind == "convolution" and kernel.ops[0] == "conv2d"
    assert kernel.ops[-1] == "to_layout" and "to_layout" not in kernel.ops[:-1]  # only the exit, fused
    assert "NHWC (channels-last)" in kernel.source and "epilogue kernel (triton)" in kernel.source
    conv = next(n for n in plan.graph.nodes if n.op == "conv2d")
    assert conv.spec.layout == "NHWC" and conv.inputs[0].op == "input"   # converted inside the conv call
    weight = conv.inputs[1]
    assert weight.spec.layout == "NHWC"                                  # KRSC at build time
    assert weight.attrs["value"].is_contiguous(memory_format=torch.channels_last)
    between = [n for n in plan.graph.nodes if n.spec.rank == 4 and n.op not in ("input", "constant", "to_layout")]
    assert between and all(n.spec.layout == "NHWC" for n in between), [str(n.spec) for n in between]
    assert plan.graph.outputs[0].op == "to_layout" and plan.graph.outputs[0].spec.layout is None
    assert any(r.name == "layout" for r in plan.graph.provenance)
    xt = rand(2, 8, 6, 6, dtype=torch.float16)
    out = plan(xt)
    assert out.is_contiguous()                                           # the user's layout
    assert_close(out, fg.reference(g)(xt), what="conv+bn+relu NHWC inside")


def _basic_block(dtype: str, c: int = 8) -> tuple[fg.Graph, list[fg.Tensor], fg.Tensor]:
    """conv-bn-relu-conv-bn-add-relu with batchnorm parameters as graph inputs (an epilogue each)."""
    g = fg.Graph(name=f"basic_block_{dtype}", compute_dtype="float32")
    x = g.tensor((2, c, 6, 6), dtype=dtype, name="x")
    w1 = g.tensor((c, c, 3, 3), dtype=dtype, name="w1")
    w2 = g.tensor((c, c, 3, 3), dtype=dtype, name="w2")
    params = [g.tensor((c,), dtype="float32", name=f"{p}{k}") for k in (1, 2) for p in ("rm", "rv", "gw", "gb")]

    def bn(t: fg.Tensor, k: int) -> fg.Tensor:
        rm, rv, gw, gb = params[4 * k: 4 * k + 4]
        return g.batch_norm(t, rm, rv, weight=gw, bias=gb, training=False)

    h = g.relu(bn(g.conv2d(x, w1, padding=1), 0))
    y = g.relu(g.add(bn(g.conv2d(h, w2, padding=1), 1), x))
    y.set_output()
    return g, [x, w1, w2, *params], y


def _block_feeds(dtype: str, c: int = 8) -> list[torch.Tensor]:
    td = TORCH_DTYPE[dtype]
    feeds = [rand(2, c, 6, 6, dtype=td, seed=1), rand(c, c, 3, 3, dtype=td, seed=2) * 0.2,
             rand(c, c, 3, 3, dtype=td, seed=3) * 0.2]
    for k in (1, 2):
        feeds += [rand(c, seed=10 * k), rand(c, seed=10 * k + 1, low=0.5), rand(c, seed=10 * k + 2),
                  rand(c, seed=10 * k + 3)]
    return feeds


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_resnet_basic_block_has_one_copy_in_and_one_out(dtype: str) -> None:
    g, _, _ = _basic_block(dtype)
    # fp32 convolutions use tensor cores only with TF32 allowed
    plan = g.build(device="cpu", allow_tf32=(dtype == "float32"))
    copies = [n for n in plan.graph.nodes if n.op == "to_layout"]
    assert len(copies) == 2, [c.name for c in copies]
    entry, exit_ = sorted(copies, key=lambda n: n.inputs[0].op != "input")
    assert entry.inputs[0].name == "x" and entry.spec.layout == "NHWC"
    assert plan.graph.outputs == (exit_,) and exit_.spec.layout is None
    convs = [n for n in plan.graph.nodes if n.op == "conv2d"]
    assert len(convs) == 2 and all(c.inputs[0].spec.layout == "NHWC" and c.spec.layout == "NHWC" for c in convs)
    # every 4-D value between the boundary copies is channels-last: no transposes between ops
    inside = [n for n in plan.graph.nodes if n.spec.rank == 4 and n.op not in ("input", "to_layout")]
    assert all(n.spec.layout == "NHWC" for n in inside), [(n.name, str(n.spec)) for n in inside]
    kinds = sorted(k.kind for k in plan.kernels)
    assert kinds == ["convolution", "convolution", "pointwise"]          # the entry copy, two convs
    assert sum(k.ops.count("to_layout") for k in plan.kernels) == 2
    feeds = _block_feeds(dtype)
    got = plan(*feeds)
    assert got.is_contiguous()
    assert_close(got, fg.reference(g)(*feeds), what=f"basic block {dtype}")


def test_fp32_convolutions_without_tf32_and_forced_nchw_stay_nchw() -> None:
    g, _, _ = _basic_block("float32")
    for plan in (g.build(device="cpu"), _basic_block("float16")[0].build(device="cpu", conv_layout="NCHW")):
        assert not [n for n in plan.graph.nodes if n.op == "to_layout"]
        assert all(n.spec.layout is None for n in plan.graph.nodes)
    with pytest.raises(InvalidValueError, match="conv_layout"):
        g.build(device="cpu", conv_layout="NWHC")


def test_graph_without_convolutions_is_unchanged() -> None:
    g = fg.Graph(name="pointwise_only")
    x = g.tensor((2, 8, 6, 6), dtype="float16", name="x")
    b = g.tensor((8, 1, 1), dtype="float16", name="b")
    g.relu(g.add(x, b)).set_output()
    graph: IRGraph = g.to_ir()
    out, decisions = choose_layout(graph)
    assert out is graph and decisions == []
    plan = g.build(device="cpu")
    assert all(n.spec.layout is None for n in plan.graph.nodes)


def test_decision_is_printed_with_debug_and_in_provenance(capsys: pytest.CaptureFixture[str]) -> None:
    g, _, _ = _basic_block("float16")
    with override(debug=1):
        plan = g.build(device="cpu")
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if "layout: NHWC" in ln)
    assert "conv2d" in line and "copies in: x" in line and "copies out:" in line
    assert "constructed by layout" in printed
    _, decisions = choose_layout(decompose(_basic_block("float16")[0].to_ir()))  # as build() runs it
    (decision,) = decisions
    assert decision.layout == "NHWC" and decision.entry_copies == ["x"] and len(decision.exit_copies) == 1
    assert decision.boundary_bytes <= decision.nchw_bytes
    assert "layout" in [r.name for r in plan.graph.provenance]


def test_view_that_cannot_read_nhwc_gets_an_explicit_row_major_copy() -> None:
    g = fg.Graph(name="conv_flatten", compute_dtype="float32")
    x = g.tensor((2, 4, 5, 5), dtype="float16", name="x")
    w = g.tensor((8, 4, 3, 3), dtype="float16", name="w")
    h = g.relu(g.conv2d(x, w, padding=1))
    flat = g.reshape(h, (2, -1))
    flat.set_output()
    h.set_output()
    plan = g.build(device="cpu")
    reshape = next(n for n in plan.graph.nodes if n.op == "reshape")
    assert reshape.inputs[0].op == "to_layout" and reshape.inputs[0].spec.layout is None
    xt, wt = rand(2, 4, 5, 5, dtype=torch.float16), rand(8, 4, 3, 3, dtype=torch.float16) * 0.3
    got, ref = plan.execute({x: xt, w: wt}), fg.reference(g).execute({x: xt, w: wt})
    assert_close(got[flat], ref[flat], what="flatten")
    assert_close(got[h], ref[h], what="relu out")


def test_already_channels_last_inputs_need_no_copies() -> None:
    g = fg.Graph(name="nhwc_in", compute_dtype="float32")
    x = g.tensor((2, 4, 5, 5), dtype="float16", name="x", layout="NHWC")
    w = g.tensor((8, 4, 3, 3), dtype="float16", name="w")
    g.relu(g.conv2d(x, w, padding=1)).set_output()
    plan = g.build(device="cpu")
    assert not [n for n in plan.graph.nodes if n.op == "to_layout"]


def test_groupnorm_between_convs_stays_correct() -> None:
    """groupnorm's decomposition reshapes channels into groups, which NHWC cannot view without a copy:
    the pass makes that copy explicit (a to_layout before the reshape) and keeps the numerics."""
    g = fg.Graph(name="conv_gn_conv", compute_dtype="float32")
    x = g.tensor((2, 8, 5, 5), dtype="float16", name="x")
    w1, w2 = g.tensor((8, 8, 3, 3), dtype="float16", name="w1"), g.tensor((8, 8, 3, 3), dtype="float16", name="w2")
    h = g.relu(g.group_norm(g.conv2d(x, w1, padding=1), 2))
    y = g.conv2d(h, w2, padding=1)
    y.set_output()
    plan = g.build(device="cpu")
    views = [n for n in plan.graph.nodes if n.op == "reshape"]
    assert views and all(v.spec.layout is None for v in views)
    for v in views:   # every view reads a row-major value (through an explicit copy when it was NHWC)
        assert v.inputs[0].spec.layout is None
    feeds = [rand(2, 8, 5, 5, dtype=torch.float16, seed=5), rand(8, 8, 3, 3, dtype=torch.float16, seed=6) * 0.2,
             rand(8, 8, 3, 3, dtype=torch.float16, seed=7) * 0.2]
    assert_close(plan(*feeds), fg.reference(g)(*feeds), what="conv-groupnorm-conv")


@pytest.mark.parametrize("declared", ["layout", "strides"])
def test_channels_last_input_is_read_as_it_is_no_entry_copy(declared: str) -> None:
    """A channels_last user tensor (torch.compile of a model in channels_last) is already NHWC: the
    convolutions run channels-last on it with no copy in, and the region between them stays NHWC."""
    torch.manual_seed(0)
    g = fg.Graph(name="cl_input", compute_dtype="float32")
    shape = (2, 8, 6, 6)
    if declared == "layout":
        x = g.tensor(shape, dtype="float16", name="x", layout="NHWC")
    else:
        x = g.tensor(shape, dtype="float16", name="x", strides=(288, 1, 48, 8))
    w1 = g.constant(torch.randn(8, 8, 3, 3).half(), name="w1")
    w2 = g.constant(torch.randn(8, 8, 3, 3).half(), name="w2")
    h = g.relu(g.conv2d(x, w1, padding=1))
    g.relu(g.add(g.conv2d(h, w2, padding=1), x)).set_output()
    plan = g.build(device="cpu")
    assert not any(n.op == "to_layout" and n.inputs[0].op == "input" for n in plan.graph.nodes)
    convs = [n for n in plan.graph.nodes if n.op == "conv2d"]
    assert len(convs) == 2 and all(c.spec.layout == "NHWC" for c in convs)
    xt = rand(*shape, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    assert_close(plan(xt), fg.reference(g)(xt), what="channels_last input")


def test_explicit_row_major_strides_count_as_nchw() -> None:
    """Values traced from torch carry explicit strides even when row-major (the torch frontend's
    intermediates): their convolutions are still laid out NHWC (before, only the first conv of a
    torchvision ResNet was, the rest ran NCHW)."""
    g = fg.Graph(name="explicit_strides", compute_dtype="float32")
    x = g.tensor((2, 8, 6, 6), dtype="float16", name="x", strides=(288, 36, 6, 1))
    w = g.constant(torch.randn(8, 8, 3, 3).half(), name="w")
    g.relu(g.conv2d(x, w, padding=1)).set_output()
    plan = g.build(device="cpu")
    assert all(n.spec.layout == "NHWC" for n in plan.graph.nodes if n.op == "conv2d")
    xt = rand(2, 8, 6, 6, dtype=torch.float16)
    assert_close(plan(xt), fg.reference(g)(xt), what="explicit row-major strides")


def test_layout_outputs_come_back_channels_last_without_a_copy() -> None:
    """build(layout_outputs=[k]): output k (a saved activation, for the torch backend) keeps the
    NHWC layout its region got; the plan returns a channels-last tensor with the right values."""
    g, _, _ = _conv_bn_relu_constant("float16")
    plan = g.build(device="cpu", layout_outputs=[0])
    assert "to_layout" not in [op for k in plan.kernels for op in k.ops]
    assert plan.graph.outputs[0].spec.layout == "NHWC"
    xt = rand(2, 8, 6, 6, dtype=torch.float16)
    out = plan(xt)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    assert_close(out, fg.reference(g)(xt), what="conv+bn+relu, NHWC output")
    with pytest.raises(InvalidValueError, match="layout_outputs"):
        g.build(device="cpu", layout_outputs=[1])
