"""Constant pad fused into generated kernels (fusion/index_map.py): the padded value reads its input
at `i - before` with a range-masked load and selects the pad value outside, so a max/avg pool
(pad + strided slices + maximum/add) is one kernel reading its input directly, with no pad buffer;
and a torchvision ResNet through fg.compile keeps NHWC from its first convolution to its pooling,
with no layout copy or library kernel inside the plan."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusegraph as fg
from conftest import assert_close, rand

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))


def _launched(plan: Any) -> list[Any]:
    return [k for k in plan.kernels if k.kind != "view"]


def _ops(kernel: Any) -> set[str]:
    return {n.op for n in kernel.nodes}


# ---- the graph API: pad fused into its consumer ----

@pytest.mark.parametrize("pad,value", [((1, 1, 1, 1), float("-inf")), ((2, 0, 0, 3), 0.0), ((1, -2, -1, 2), 1.5),
                                       ((-1, -1, 0, 0, 2, 1), -0.25)])
@pytest.mark.parametrize("dt,tdt", [("float32", torch.float32), ("float16", torch.float16)])
def test_constant_pad_is_fused_into_its_pointwise_consumer(pad: tuple[int, ...], value: float, dt: str,
                                                           tdt: torch.dtype) -> None:
    g = fg.Graph("pad")
    x, y = g.tensor((2, 3, 5, 6), dt, "x"), g.tensor((1, 1, 1, 1), dt, "y")
    p = g.pad(g.exp(x), pad, value=value)
    g.maximum(p * 2.0, y).set_output()
    plan = g.build(device="cpu")
    xv, yv = rand(2, 3, 5, 6, dtype=tdt), torch.full((1, 1, 1, 1), -5.0, dtype=tdt)
    out = plan(xv, yv)
    ref = torch.maximum(F.pad(torch.exp(xv.float()).to(tdt), list(pad), value=value).float() * 2.0, yv.float())
    assert_close(out.float(), ref, tol=1e-5 if dt == "float32" else 5e-3)
    kernels = _launched(plan)
    assert [(k.backend, k.kind) for k in kernels] == [("triton", "pointwise")], [k.name for k in kernels]
    assert "pad" in _ops(kernels[0])


def test_pad_of_a_size_one_dim_selects_by_the_output_index() -> None:
    g = fg.Graph("pad1")
    x = g.tensor((3, 1), "float32", "x")
    g.neg(g.pad(x, (2, 1, 1, 0), value=7.0)).set_output()
    plan = g.build(device="cpu")
    xv = rand(3, 1)
    assert_close(plan(xv), -F.pad(xv, [2, 1, 1, 0], value=7.0))
    assert all(k.backend == "triton" for k in _launched(plan))


def test_padded_value_reduced_in_the_same_kernel() -> None:
    g = fg.Graph("pad_sum")
    x = g.tensor((4, 6), "float32", "x")
    g.sum(g.pad(x, (2, 3), value=0.5), (1,)).set_output()
    plan = g.build(device="cpu")
    xv = rand(4, 6)
    assert_close(plan(xv), F.pad(xv, [2, 3], value=0.5).sum(1))
    assert [k.kind for k in _launched(plan)] == ["reduction"]


# ---- through fg.compile: F.pad, max_pool2d, avg_pool2d ----

class _PadThenAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.pad(x * 2.0, (1, -2, 2, -1), value=-3.0)) + 1.0


def test_torch_f_pad_with_positive_and_negative_pads_is_one_kernel() -> None:
    model = _PadThenAct()
    x = rand(2, 3, 6, 7)
    compiled = fg.compile(model)
    assert_close(compiled(x), model(x))
    parts = [p for g in compiled.fusegraph_report.graphs for p in g.partitions]
    assert [p.status for p in parts] == ["fusegraph"]
    assert len(parts[0].kernel_ops) == 1 and parts[0].kernel_ops[0].startswith("pointwise/triton"), parts[0].kernel_ops


def _stem(channels_last: bool, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.MaxPool2d(3, 2, 1)).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 1.5)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(dtype=dtype, memory_format=fmt)  # type: ignore[call-overload]
    return model, rand(2, 3, 30, 30, dtype=dtype).contiguous(memory_format=fmt)


def _plan_of(compiled: Any) -> Any:
    parts = [p for g in compiled.fusegraph_report.graphs for p in g.partitions]
    assert [p.status for p in parts] == ["fusegraph"], [(p.status, p.reason) for p in parts]
    return parts[0].plan


@pytest.mark.parametrize("channels_last,dtype", [(False, torch.float32), (True, torch.float16)])
def test_resnet_stem_maxpool_is_one_generated_kernel_without_pad_buffer(channels_last: bool,
                                                                         dtype: torch.dtype) -> None:
    model, x = _stem(channels_last, dtype)
    compiled = fg.compile(model)
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    assert_close(out, ref)
    plan = _plan_of(compiled)
    kernels = _launched(plan)
    assert not [k for k in kernels if k.kind == "library" or ("pad" in _ops(k) and k.backend != "triton")]
    pools = [k for k in kernels if "maximum" in _ops(k)]
    assert len(pools) == 1 and pools[0].backend == "triton" and {"pad", "slice"} <= _ops(pools[0])
    assert [k.kind for k in kernels] == ["convolution", "pointwise"], [k.name for k in kernels]
    # batchnorm + relu are the convolution's epilogue, stored once; the pool reads their result and
    # does not rebuild them at each of its 9 window taps (fusion/recompute.epilogue_values)
    conv_kernel, pool_kernel = kernels
    assert {"rsqrt", "relu"} <= _ops(conv_kernel) and not {"rsqrt", "relu", "sub"} & _ops(pool_kernel)
    if dtype == torch.float16:   # tensor-core convolution: NHWC through the pooling, no copy
        conv, pool = kernels
        assert conv.outputs[0].spec.layout == "NHWC" and pool.inputs[0] is conv.outputs[0]
        assert not any(n.op == "to_layout" for k in kernels for n in k.nodes)


def test_avg_pool_with_padding_is_one_kernel() -> None:
    class Pool(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.avg_pool2d(torch.relu(x), 3, 2, 1, count_include_pad=False) + F.avg_pool2d(x, 2, 2, 0, True)

    x = rand(2, 4, 9, 9)
    compiled = fg.compile(Pool())
    assert_close(compiled(x), Pool()(x))
    kernels = [k for k in _launched(_plan_of(compiled)) if k.kind != "constant"]   # the divisors: built once
    assert len(kernels) == 1 and kernels[0].backend == "triton", [k.name for k in kernels]
    assert {"pad", "slice", "add"} <= _ops(kernels[0])


# ---- a torchvision ResNet: NHWC inside, copies only at the input ----

@pytest.mark.parametrize("channels_last", [False, True])
def test_torchvision_resnet_has_no_layout_copy_inside_the_plan(channels_last: bool) -> None:
    from zoo_models import ensure_torchvision_importable, get

    ensure_torchvision_importable()
    pytest.importorskip("torchvision")

    torch.manual_seed(0)
    model = get("tv_resnet18").build("tiny").eval()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(dtype=torch.float16, memory_format=fmt)  # type: ignore[call-overload]
    x = rand(2, 3, 32, 32, dtype=torch.float16).contiguous(memory_format=fmt)
    compiled = fg.compile(model)
    with torch.no_grad():
        out, ref = compiled(x), model(x)
    assert_close(out, ref, tol=1e-2)
    kernels = _launched(_plan_of(compiled))
    assert not [k.name for k in kernels if k.kind == "library" or "to_layout" in _ops(k)]
    convs = [k for k in kernels if k.kind == "convolution"]
    assert len(convs) == 12
    graph_inputs = {n.id for n in convs[0].inputs if n.op == "input"}
    for k in convs:   # every activation NHWC; only the first reads the (NCHW or NHWC) graph input
        conv = next(n for n in k.nodes if n.op == "conv2d")
        act = conv.inputs[0]
        assert act.spec.layout == "NHWC" or act.id in graph_inputs, (k.name, act.name, act.spec)
        assert conv.spec.layout == "NHWC", k.name
    pool = [k for k in kernels if "maximum" in _ops(k)]
    assert len(pool) == 1 and pool[0].outputs[0].spec.layout == "NHWC"
    assert all(n.spec.layout == "NHWC" for n in pool[0].inputs if n.spec.rank == 4)


# ---- the layout decision names the weights a convolution call re-lays out ----

@pytest.mark.parametrize("kernel,weight_layout,converted", [(3, "KCRS", True), (3, "KRSC", False), (1, "KCRS", False)])
def test_layout_decision_names_weights_converted_per_call(kernel: int, weight_layout: str, converted: bool) -> None:
    from fusegraph.passes.decompose import decompose
    from fusegraph.passes.layout import choose_layout

    g = fg.Graph("w_in", compute_dtype="float32")
    x = g.tensor((2, 8, 6, 6), "float16", "x")
    shape = (8, 8, kernel, kernel)
    strides = None if weight_layout == "KCRS" else (8 * kernel * kernel, 1, 8 * kernel, 8)
    w = g.tensor(shape, "float16", "w", strides=strides)
    g.relu(g.conv2d(x, w, padding=kernel // 2)).set_output()
    _, decisions = choose_layout(decompose(g.to_ir()))
    (decision,) = decisions
    assert decision.layout == "NHWC"
    assert decision.weights_converted_in_conv == (["w"] if converted else [])
    assert "weights re-laid out inside the conv call" in str(decision)


def test_batchnorm_stays_in_the_pool_when_the_conv_result_is_an_output_too() -> None:
    """The conv's result is returned as well, so it is stored anyway and cannot take the batchnorm as
    its epilogue: storing batchnorm + relu separately would only add bytes (no third kernel)."""
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, _ = _stem(False, torch.float32)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            conv = self.stem[0](x)
            return conv, self.stem[3](self.stem[2](self.stem[1](conv)))

    model = Both().eval()
    x = rand(2, 3, 30, 30)
    compiled = fg.compile(model)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)
    kernels = _launched(_plan_of(compiled))
    assert [k.kind for k in kernels] == ["convolution", "pointwise"], [k.name for k in kernels]
    assert {"rsqrt", "maximum"} <= _ops(kernels[1])


@pytest.mark.parametrize("weight_is_output", [False, True])
def test_a_computed_weight_is_written_krsc_by_its_own_kernel(weight_is_output: bool) -> None:
    """autocast's half-precision cast of an fp32 parameter feeding an NHWC convolution: the cast kernel
    writes the weight KRSC (channels-last), so the convolution call copies nothing; a cast the user also
    gets back keeps its layout (and is converted in the call, as before)."""
    from fusegraph.passes.decompose import decompose
    from fusegraph.passes.layout import choose_layout

    g = fg.Graph("w_cast", compute_dtype="float32")
    x = g.tensor((2, 8, 6, 6), "float16", "x")
    w32 = g.tensor((8, 8, 3, 3), "float32", "w32")
    w = g.cast(w32, "float16", name="w")
    g.relu(g.conv2d(x, w, padding=1)).set_output()
    if weight_is_output:
        w.set_output()
    graph, decisions = choose_layout(decompose(g.to_ir()))
    (decision,) = decisions
    assert decision.layout == "NHWC"
    cast = next(n for n in graph.nodes if n.op == "cast" and n.spec.rank == 4)
    if weight_is_output:
        assert decision.weights_written_nhwc == [] and decision.weights_converted_in_conv == ["w"]
        assert cast.spec.layout != "NHWC"
    else:
        assert decision.weights_written_nhwc == ["w"] and decision.weights_converted_in_conv == []
        assert cast.spec.layout == "NHWC" and cast.spec.memory_strides == (72, 1, 24, 8)
        assert "weights their kernel writes KRSC: w" in str(decision)
    plan = g.build()
    xs, ws = rand(2, 8, 6, 6, dtype=torch.float16), rand(8, 8, 3, 3)
    got = plan(xs, ws)
    out = got[0] if weight_is_output else got
    want = torch.relu(torch.nn.functional.conv2d(xs.float(), ws.half().float(), padding=1))
    assert_close(out.float(), want, tol=2e-3)
    if weight_is_output:
        assert torch.equal(got[1], ws.half()) and got[1].is_contiguous()   # the user's value, row-major
